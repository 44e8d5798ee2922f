"""pn_bwd_rows (several rows per block, 1-16 warps per row, the row's x and dy in
registers) gives pn_bwd's / pn_bwd_big's dx bits, run on the CPU by the emulator.

The dispatcher sends backward rows of ``d > 256`` with float compute (and dy as wide as
x) to pn_bwd_rows; the tree its row sums run over is fixed by ``d``
(``launch.bwd_tree``: pn_bwd's threads per row, or pn_bwd_big's block for single-slice
rows, with that kernel's arithmetic), so the launch knobs (warps per row, rows per block,
grid) must not change a bit of dx.  dweight / dbias are the launch's partial rows (row
slots accumulated in order, slots added in order) summed by pn_colsum: the test writes
that order out in numpy and compares bits, and with pn_bwd's own rows per block and grid
the partial rows, hence dweight / dbias, are pn_bwd's (pn_bwd_big's) bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from _oracle import assert_close, looser
from test_emul_kernels import (
    BWD_OPTIONS,
    NP,
    _bits,
    _bwd_case,
    _cast_keep,
    _check_backward,
    _colsum,
    _data,
    _garbage,
    _launch,
    _name,
    _plan,
    _rs,
    _seed,
    emul_backward,
)

from polynorm.backends import reference
from polynorm.backends.cuda import launch as cl

ROWS_DTYPES = ("bfloat16", "float16", "float32")
#: one d per tree: pn_bwd's (few tree warps; a tail; the longest), pn_bwd_big's single
#: slice at one and two passes (two: float32 only; 16-bit x has no instantiation of two
#: chunks per tree thread, and float32 d = 16390 has two slices: pn_bwd_big keeps both)
D_TREES = (300, 1000, 4101, 8195, 16390)


def _run(dy, x, w, b, rstd, g, plan, launch):
    """Run one backward ``launch`` (any kernel of the pn_bwd ABI) on the emulator:
    (dx, dweight partial rows, dbias partial rows, dweight, dbias)."""
    xd, wd, bd = _name(x), _name(w), _name(b)
    types = cl.backward_types(xd, _name(dy), _name(g), wd)
    ct = types.compute
    dyk, gk, wk, rk = (_cast_keep(dy, types.dy), _cast_keep(g, types.dy), _cast_keep(w, types.weight),
                       _cast_keep(rstd, ct))  # fmt: skip
    n, d = x.shape
    dx = _garbage((n, d), xd)
    shape = (launch.partial_rows, launch.ldp)
    dwp = (np.zeros(shape, NP[ct]) if launch.big else _garbage(shape, ct)) if w is not None else None
    dbp = (np.zeros(shape, NP[ct]) if launch.big else _garbage(shape, ct)) if b is not None else None
    args = (dyk, _rs(dyk), x, _rs(x), wk, rk, gk, _rs(gk), dx, _rs(dx), dwp, dbp, np.int64(launch.ldp),
            np.int64(n), np.int32(d), np.int32(plan.k), np.int32(launch.stash if launch.big else launch.tpr),
            np.float64(plan.eps), np.int32(plan.eps_inside), np.float64(plan.offset))  # fmt: skip
    _launch(launch, args, xd)
    dw = _colsum(dwp, d, ct, wd) if w is not None else None
    db = _colsum(dbp, d, ct, bd) if b is not None else None
    return dx, dwp, dbp, dw, db


def _launch_order_sums(dy, x, rstd, la, out_dtype):
    """dweight and dbias as the launch sums them, written out: row slot s of block b takes
    rows (b + i * grid) * rpb + s in order (float32 adds from 0), a block's slots are added
    0, 1, ... (float32), and pn_colsum adds partial rows r = q, q + 8, ... per q in double
    from 0, then the 8 sums in order, rounding once to float32 and then to the output."""
    n, d = x.shape
    r = rstd.astype(np.float32)[:, None]
    leaves = {"w": dy.astype(np.float32) * (x.astype(np.float32) * r), "b": dy.astype(np.float32)}
    rpb = la.block // (32 * cl.rows_shape(la.tpr)[2])
    out = {}
    for key, leaf in leaves.items():
        part = np.zeros((la.grid, d), np.float32)
        for blk in range(la.grid):
            slots = []
            for s in range(rpb):
                acc = np.zeros(d, np.float32)
                g0 = blk * rpb
                while g0 < n:
                    if g0 + s < n:
                        acc = acc + leaf[g0 + s]
                    g0 += la.grid * rpb
                slots.append(acc)
            v = slots[0]
            for t in slots[1:]:
                v = v + t
            part[blk] = v
        grp = [np.zeros(d, np.float64) for _ in range(8)]
        for q in range(8):
            for row in range(q, la.grid, 8):
                grp[q] = grp[q] + part[row].astype(np.float64)
        tot = grp[0]
        for t in grp[1:]:
            tot = tot + t
        out[key] = tot.astype(np.float32).astype(NP[out_dtype])
    return out["w"], out["b"]


def _same_dx_bits(dy, x, w, b, rstd, g, plan, tag, rows_config=None, want_rows=True, num_sms=cl.DEFAULT_SMS):
    got = emul_backward(dy, x, w, b, rstd, g, plan, rows_config=rows_config, num_sms=num_sms)
    if want_rows:
        assert got[3].name.startswith("pn_bwd_rows"), (got[3].name, tag)
    ref = emul_backward(dy, x, w, b, rstd, g, plan, rows=False, split=False, num_sms=num_sms)
    assert not ref[3].name.startswith("pn_bwd_rows")
    np.testing.assert_array_equal(_bits(got[0]), _bits(ref[0]), err_msg=f"dx: {got[3].name} vs {ref[3].name} {tag}")
    return got


@pytest.mark.parametrize("dtype", ROWS_DTYPES)
def test_bwd_rows_same_bits_as_before_for_every_tree(dtype):
    """dx bits of pn_bwd (d = 300, 1000, 4101) and pn_bwd_big (8195, 16390: one and two
    passes of the single slice), n = 5 (a ragged last row group); dweight / dbias in the
    launch's written-out order, and close to the reference."""
    rng = np.random.default_rng(_seed("bwd-rows", dtype))
    for d in D_TREES:
        tree = cl.bwd_tree(d, dtype)
        if not cl.bwd_rows_candidates(d, dtype):
            assert d == 16390 and (tree is None) == (dtype == "float32")
            assert not cl.backward_launch(5, d, dtype).name.startswith("pn_bwd_rows")
            continue
        dy, x, w, b, rstd, g, plan = _bwd_case(rng, 5, d, dtype, dict(bias=True, rstd=True))
        dx, dw, db, la = _same_dx_bits(dy, x, w, b, rstd, g, plan, f"d={d}")
        assert cl.rows_shape(la.tpr) == (tree[0] // 32, tree[2], cl.rows_shape(la.tpr)[2])
        ww, wb = _launch_order_sums(dy, x, rstd, la, dtype)
        np.testing.assert_array_equal(_bits(dw), _bits(ww), err_msg=f"dweight order d={d}")
        np.testing.assert_array_equal(_bits(db), _bits(wb), err_msg=f"dbias order d={d}")
        rdx, rdw, rdb = reference.backward(dy, x, w, b, rstd, g, plan)
        assert_close(dw, rdw, looser(dtype, dtype), f"dweight d={d}")
        assert_close(dx, rdx, looser(dtype, dtype), f"dx d={d}")


#: BWD_OPTIONS of test_emul_kernels that pn_bwd_rows takes (dy in x's width)
ROWS_BWD_OPTS = ("everything", "no_weight", "bias_no_weight", "partial", "offset", "eps_outside", "rstd_given",
                 "grad_residual", "weight_f32")


@pytest.mark.parametrize("dtype", ROWS_DTYPES)
@pytest.mark.parametrize("opt", ROWS_BWD_OPTS)
def test_bwd_rows_options_same_bits(dtype, opt):
    """Options (no weight, bias, partial k, offset, eps outside, rstd given, grad_residual,
    a float32 weight): pn_bwd's dx bits at d = 1000 and pn_bwd_big's at d = 8195 (float32
    d = 4101: one pass of pn_bwd_big's tree), n = 7, and close to the reference."""
    rng = np.random.default_rng(_seed("bwd-rows-opt", dtype, opt))
    for d in (1000, 4101 if dtype == "float32" else 8195):
        dy, x, w, b, rstd, g, plan = _bwd_case(rng, 7, d, dtype, BWD_OPTIONS[opt])
        _same_dx_bits(dy, x, w, b, rstd, g, plan, f"{opt} d={d}")
        _check_backward(dy, x, w, b, rstd, g, plan)


@pytest.mark.parametrize("dtype,d", [("bfloat16", 4096), ("float16", 2000), ("float32", 3000)])
def test_bwd_rows_every_knob_candidate_same_bits(dtype, d):
    """Every (warps per row, rows per block) the tuning table may pick, with a persistent
    grid smaller than the row groups (num_sms=1): pn_bwd's dx bits, and dweight / dbias in
    each launch's order."""
    rng = np.random.default_rng(_seed("bwd-rows-knobs", dtype, d))
    dy, x, w, b, rstd, g, plan = _bwd_case(rng, 9, d, dtype, dict(bias=True, rstd=True, grad_residual=True))
    cands = cl.bwd_rows_candidates(d, dtype)
    assert len(cands) >= 2
    for cfg in cands:
        dx, dw, db, la = _same_dx_bits(dy, x, w, b, rstd, g, plan, f"config={cfg}", rows_config=cfg, num_sms=1)
        r, rpb = cfg
        assert la.block == 32 * r * rpb and cl.rows_shape(la.tpr)[2] == r
        ww, wb = _launch_order_sums(dy, x, rstd, la, dtype)
        np.testing.assert_array_equal(_bits(dw), _bits(ww), err_msg=f"dweight order {cfg}")
        np.testing.assert_array_equal(_bits(db), _bits(wb), err_msg=f"dbias order {cfg}")


@pytest.mark.parametrize("dtype,d", [("bfloat16", 1000), ("float32", 2000), ("bfloat16", 8195)])
def test_bwd_rows_with_the_old_launch_gives_its_partial_rows(dtype, d):
    """With pn_bwd's rows per block and grid (pn_bwd_big's grid, one row per block), the
    partial rows, so dweight / dbias, are the old kernel's bit for bit: the same order of
    every add."""
    rng = np.random.default_rng(_seed("bwd-rows-old", dtype, d))
    dy, x, w, b, rstd, g, plan = _bwd_case(rng, 11, d, dtype, dict(bias=True))
    n = x.shape[0]
    old = cl.backward_launch(n, d, dtype, num_sms=2, rows=False)
    rpb = 1 if old.big else old.block // old.tpr
    cfg = next(c for c in cl.bwd_rows_candidates(d, dtype) if c[1] == rpb)
    new = cl.bwd_rows_launch(n, d, dtype, config=cfg, grid=old.grid)
    assert new.partial_rows == old.partial_rows and new.ldp == old.ldp
    a = _run(dy, x, w, b, rstd, g, plan, new)
    o = _run(dy, x, w, b, rstd, g, plan, old)
    for what, u, v in zip(("dx", "dweight partials", "dbias partials", "dweight", "dbias"), a, o, strict=True):
        if what.endswith("partials"):
            u, v = u[:, :d], v[:, :d]
        np.testing.assert_array_equal(_bits(u), _bits(v), err_msg=f"{what}: {new.name} vs {old.name}")


@pytest.mark.parametrize("x16", [False, True], ids=["wide", "float16"])  # float16 x: the slow run (tests/conftest.py)
def test_bwd_rows_extreme_values_same_bits(x16):
    """The float runs' exact fallbacks (squares that overflow float32 or are tiny; g*dy*x
    that overflows), NaN / Inf / zero rows, eps 0, and misaligned rows (the
    element-by-element twin): pn_bwd's / pn_bwd_big's dx bits."""
    rng = np.random.default_rng(23)
    for dtype, scale in (("float32", 1e25), ("float32", 1e-30), ("bfloat16", 1e30), ("float16", 1e4)):
        if (dtype == "float16") != x16:
            continue
        for d in (1000, 8195 if dtype != "float32" else 4101):
            dy, x, w, b, _, g, _ = _bwd_case(rng, 7, d, dtype, dict(bias=True))
            x = (x.astype(np.float64) * scale).astype(x.dtype)
            x[2] = 0
            x[3, d // 2] = np.inf
            x[4, 7] = np.nan
            x[5, ::3] *= 1e-3
            if dtype == "float32":
                dy[6] *= np.float32(1e30)
            _same_dx_bits(dy, x, w, b, None, g, _plan(d, dtype, eps=0.0), f"{dtype} scale={scale} d={d}")
    if x16:
        return
    dy, x, w, b, rstd, g, plan = _bwd_case(rng, 4, 1003, "bfloat16", dict(grad_residual=True))
    wide = np.concatenate([x, x[:, :3]], axis=1)[:, 1:1002]  # rows not 16-byte aligned
    dy, g, w = dy[:, :1001].copy(), g[:, :1001].copy(), w[:1001].copy()
    _same_dx_bits(dy, wide, w, None, None, g, _plan(1001, "bfloat16"), "misaligned")


def test_bwd_rows_launch_rule():
    """The rule's launches: whole warps, at most BWD_ROWS_THREADS per block, slots that
    cover the row, pn_bwd's / pn_bwd_big's tree for every n, instantiated names; a float32
    dy of 16-bit x, float64 and multi-slice rows keep the old kernels; tuning configs
    that do not fit are a ValueError."""
    names = set(cl.specialisations())
    for x in ROWS_DTYPES:
        for d in (257, 512, 1000, 2048, 4096, 4101, 8192, 8195, 16384, 16390):
            tree = cl.bwd_tree(d, x)
            for n in (1, 7, 4096, 1 << 15):
                for hw, hg in ((True, False), (False, True)):
                    la = cl.backward_launch(n, d, x, has_w=hw, has_g=hg)
                    if not cl.bwd_rows_candidates(d, x):
                        assert not la.name.startswith("pn_bwd_rows")
                        continue
                    assert la.name.startswith("pn_bwd_rows") and la.name in names, (x, d, n, la.name)
                    nw, big, r = cl.rows_shape(la.tpr)
                    it, mw = (int(v) for v in la.name.rstrip(">").split(",")[-4:-2])
                    t, t_items, t_big = tree
                    assert nw * 32 == t and big == t_big and r * mw == nw and it == t_items
                    assert la.block % (32 * r) == 0 and la.block <= cl.BWD_ROWS_THREADS
                    rpb = la.block // (32 * r)
                    assert 1 <= la.grid <= -(-n // rpb) and rpb * nw <= cl.ROWS_RED and it * mw <= cl.BWD_ROWS_CHUNKS
                    assert la.partial_rows == la.grid and la.shared == cl.bwd_rows_shared(d, x, rpb, True)
                    old = cl.backward_launch(n, d, x, has_w=hw, has_g=hg, rows=False)
                    assert old.big == t_big or old.slices
    assert not cl.backward_launch(64, 4096, "bfloat16", "float32").name.startswith("pn_bwd_rows")
    assert not cl.backward_launch(64, 4096, "float64").name.startswith("pn_bwd_rows")
    assert not cl.backward_launch(64, 200, "bfloat16").name.startswith("pn_bwd_rows")
    with pytest.raises(ValueError, match="warps per row"):
        cl.bwd_rows_launch(64, 4096, "bfloat16", config=(1, 8))


def test_bwd_rows_tuning_table(tmp_path, monkeypatch):
    """A "bwd" entry of the device's table picks the config; other devices keep the rule."""
    import json

    monkeypatch.setattr(cl, "TUNING_DIR", tmp_path)
    cl.tuning_table.cache_clear()
    cl.bwd_rows_launch.cache_clear()
    key = cl.tuning_key("bwd", "bfloat16", 4096, 32768)
    (tmp_path / "Test_GPU.json").write_text(json.dumps(
        {"device": "Test GPU", "cases": {key: {"warps_per_row": 8, "rows_per_block": 2}}}))
    try:
        tuned = cl.bwd_rows_launch(32768, 4096, "bfloat16", device="Test GPU")
        rule = cl.bwd_rows_launch(32768, 4096, "bfloat16", device="Other GPU")
        assert cl.rows_shape(tuned.tpr)[2] == 8 and tuned.block == 512
        assert rule == cl.bwd_rows_launch(32768, 4096, "bfloat16") and rule.block != tuned.block
    finally:
        cl.tuning_table.cache_clear()
        cl.bwd_rows_launch.cache_clear()


def test_bwd_rows_fd_float32():
    """Finite differences of the reference forward (float64 sums of the float32 rows)
    against pn_bwd_rows' dx / dweight at d = 1000 (pn_bwd's tree) and 4101 (pn_bwd_big's)."""
    rng = np.random.default_rng(5)
    for d in (1000, 4101):
        x = _data(rng, 3, d, "float32")
        w = _data(rng, 1, d, "float32")[0]
        dy = _data(rng, 3, d, "float32")
        plan = _plan(d, "float32", eps=1e-3)
        dx, dw, _, la = emul_backward(dy, x, w, None, None, None, plan)
        assert la.name.startswith("pn_bwd_rows")

        g64 = dy.astype(np.float64)

        def loss(xx, ww, g=g64):
            ms = (xx.astype(np.float64) ** 2).mean(axis=1, keepdims=True)
            return float(((xx / np.sqrt(ms + 1e-3)) * ww * g).sum())

        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        h = 1e-4
        for i, j in ((0, 3), (2, d - 1), (1, d // 2)):
            xp, xm = x64.copy(), x64.copy()
            xp[i, j] += h
            xm[i, j] -= h
            fd = (loss(xp, w64) - loss(xm, w64)) / (2 * h)
            assert abs(fd - float(dx[i, j])) <= 1e-3 * max(1.0, abs(fd)), (d, i, j, fd, dx[i, j])
            wp, wm = w64.copy(), w64.copy()
            wp[j] += h
            wm[j] -= h
            fdw = (loss(x64, wp) - loss(x64, wm)) / (2 * h)
            assert abs(fdw - float(dw[j])) <= 1e-3 * max(1.0, abs(fdw)), (d, j, fdw, dw[j])


def test_bwd_rows_sum_the_tree_warps_left_to_right():
    """A float32 row (d = 1024: pn_bwd's 8 tree warps of 32 tree threads, one chunk each)
    whose tree-warp sums of squares are 1.0 and squares of a few 2^-28 multiples, and an eps
    that puts rstd at a float32 rounding boundary: left to right (the tree) gives
    31.999998, any other order 32.0.  Every launch of pn_bwd_rows recomputes that r: its
    dx equals the dx it gives with rstd = 31.999998 passed in, and pn_bwd's."""
    d, eps = 1024, 5.820766037136632e-11
    ms = [2, 6, 9, 7, 0, 4, 5, 5]  # tree warp 4 holds 1.0
    runs = [1.0 if w == 4 else (m * 2.0**-28) ** 2 for w, m in enumerate(ms)]
    ltr = runs[0]
    for v in runs[1:]:
        ltr = ltr + v
    rtl = 0.0
    for v in reversed(runs):
        rtl = v + rtl
    want = np.float32(1.0 / np.sqrt(ltr / d + eps))
    assert want != np.float32(1.0 / np.sqrt(rtl / d + eps))  # the orders differ in the bits
    x = np.zeros((3, d), np.float32)
    for w, m in enumerate(ms):  # chunk 32 * w (columns 128 * w ..): tree thread 32 * w
        x[:, 128 * w] = 1.0 if w == 4 else m * 2.0**-28
    dy = np.ones((3, d), np.float32)
    dy[:, 1::2] = -0.5
    plan = _plan(d, "float32", eps=eps)
    given = np.full(3, want, np.float32)
    for cfg in cl.bwd_rows_candidates(d, "float32"):
        got = _same_dx_bits(dy, x, None, None, None, None, plan, f"tree order {cfg}", rows_config=cfg)
        ref = emul_backward(dy, x, None, None, given, None, plan, rows_config=cfg)
        np.testing.assert_array_equal(_bits(got[0]), _bits(ref[0]), err_msg=f"r of {cfg}")
