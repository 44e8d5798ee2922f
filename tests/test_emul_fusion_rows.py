"""The fusions on pn_fwd_rows' body (pn_gated_rows, pn_quant_rows) give the bits of the
segment kernels they replace (pn_gated_fwd, pn_quant_fwd), run on the CPU by the emulator.

The dispatcher sends a gated segment (row, group) or a quantized row to the rows body
where its tree (``launch.segment_tree``: the segment kernels' threads, ``IT`` chunks
each, the tail after them) has at least one whole warp of tree threads; the launch knobs
(warps per segment, segments per block) must not change a bit.  Every case compares the
rows kernel with the segment kernel (``rows=False``) bit for bit, and one case per dtype
with the reference at the usual tolerances.
"""

from __future__ import annotations

import numpy as np
import pytest
from _oracle import TOL, assert_close
from test_emul_fusions import _data, _gplan, _qplan, _tol, emul_gated_forward, emul_quant_forward
from test_emul_kernels import NP, _bits, _seed

from polynorm.backends import reference
from polynorm.backends.cuda import launch as cl

ROWS_DTYPES = ("bfloat16", "float16", "float32")


def _gated_rows_vs_segments(x, z, w, b, gp, tag, rows_config=None):
    n, d = x.shape
    xd = next(k for k, v in NP.items() if x.dtype == v)
    kz = cl.kernel_dtype(xd, next(k for k, v in NP.items() if z.dtype == v))
    ko = cl.kernel_dtype(xd, gp.plan.out_dtype)
    la = cl.gated_forward_launch(n, d, gp.group_size, xd, kz, ko, rows_config=rows_config)
    assert la.name.startswith("pn_gated_rows"), (la.name, tag)
    got = emul_gated_forward(x, z, w, b, gp, rows_config=rows_config)
    ref = emul_gated_forward(x, z, w, b, gp, rows=False)
    for a, r, what in zip(got, ref, ("y", "rstd"), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(r), err_msg=f"{what}: {la.name} vs pn_gated_fwd {tag}")
    return got, la


#: (d, group_size): one group per tree shape (ITEMS 1 with a tail, ITEMS 2 with a tail; 2001:
#: float32's ITEMS 2 with a tail), groups with and without tails, a segment of 64 tree threads
GATED_SHAPES = ((300, 300), (1000, 1000), (4101, 4101), (2001, 2001), (3 * 1000, 1000), (4 * 256, 256))


@pytest.mark.parametrize("dtype", ROWS_DTYPES)
def test_gated_rows_same_bits_as_segments(dtype):
    """norm_before_gate both ways, with and without weight, bias, offset, partial, eps
    outside, a float32 output: pn_gated_fwd's y and rstd bits (n = 5: a ragged last block)."""
    rng = np.random.default_rng(_seed("gated-rows", dtype))
    cases = [(False, {}), (True, {"bias": True, "offset": 1.0}), (True, {"no_weight": True, "partial": 0.6}),
             (False, {"eps_mode": "outside", "out_dtype": "float32", "bias": True})]
    for d, gs in GATED_SHAPES:
        if not cl.seg_rows_candidates(gs, dtype):
            assert dtype == "float32" and gs == 4101  # 4 chunks per tree thread: pn_gated_fwd keeps it
            continue
        for nbg, opt in cases:
            if dtype == "float32" and opt.get("out_dtype"):
                continue
            x = _data(rng, (5, d), dtype)
            z = _data(rng, (5, d), dtype, 2.0)
            w = None if opt.get("no_weight") else _data(rng, d, dtype)
            b = _data(rng, d, dtype) if opt.get("bias") else None
            kw = {k: v for k, v in opt.items() if k in ("partial", "eps_mode", "offset", "out_dtype")}
            if gs != d:
                kw.pop("partial", None)  # partial is for one group only
            gp = _gplan(d, dtype, gs, nbg, **kw)
            _gated_rows_vs_segments(x, z, w, b, gp, f"d={d} gs={gs} nbg={nbg} {opt}")
    # and against the reference (its own summation order: tolerances)
    x, z = _data(rng, (3, 1000), dtype), _data(rng, (3, 1000), dtype, 2.0)
    w = _data(rng, 1000, dtype)
    for nbg in (False, True):
        gp = _gplan(1000, dtype, None, nbg)
        (y, r), _ = _gated_rows_vs_segments(x, z, w, None, gp, f"reference nbg={nbg}")
        ey, er = reference.gated_forward(x, z, w, None, gp)
        assert_close(y, ey, _tol(dtype), f"y vs reference nbg={nbg}")
        assert_close(r, er, TOL["float32"], f"rstd vs reference nbg={nbg}")


@pytest.mark.parametrize("dtype,gs", [("bfloat16", 4096), ("float32", 2000), ("float16", 1000)])
def test_gated_rows_every_knob_candidate_same_bits(dtype, gs):
    """Every (warps per segment, segments per block) the tuning sweep may pick, two groups
    per row and n odd: the same bits."""
    rng = np.random.default_rng(_seed("gated-knobs", dtype, gs))
    n, d = 3, 2 * gs
    x, z = _data(rng, (n, d), dtype), _data(rng, (n, d), dtype, 2.0)
    w = _data(rng, d, dtype)
    gp = _gplan(d, dtype, gs, False, eps_mode="outside")
    cands = cl.seg_rows_candidates(gs, dtype)
    assert len(cands) >= 2
    for cfg in cands:
        _, la = _gated_rows_vs_segments(x, z, w, None, gp, f"config={cfg}", rows_config=cfg)
        r, rpb = cfg
        assert la.block == 32 * r * rpb and cl.rows_shape(la.tpr)[2] == r


@pytest.mark.parametrize("x16", [False, True], ids=["wide", "float16"])  # float16 x: the slow run (tests/conftest.py)
def test_gated_rows_extreme_values_and_misaligned_rows(x16):
    """Runs out of float32's range (the lanes' exact fallback), Inf / NaN / zero segments,
    eps 0, a tiny rstd's wide path, and rows not 16-byte aligned (the element twin)."""
    rng = np.random.default_rng(31)
    for dtype, scale in (("float32", 1e25), ("float32", 1e-30), ("bfloat16", 1e30), ("float16", 1e4)):
        if (dtype == "float16") != x16:
            continue
        d = 1000
        x = _data(rng, (6, d), dtype, scale)
        x[2] = 0
        x[3, d // 2] = np.inf
        x[4, 7] = np.nan
        x[5, ::3] *= 1e-3
        if dtype == "float32":
            x[5] = _data(rng, (1, d), dtype, 1e-40)[0]  # rms below 2^-128: rstd beyond float32
        z = _data(rng, (6, d), dtype, 2.0)
        w = _data(rng, d, dtype)
        for nbg in (False, True):
            _gated_rows_vs_segments(x, z, w, None, _gplan(d, dtype, d // 2, nbg, eps=0.0), f"{dtype} {scale} {nbg}")
    if x16:
        return
    x = _data(rng, (4, 1003), "bfloat16")
    wide = np.concatenate([x, x[:, :3]], axis=1)[:, 1:1002]  # rows not 16-byte aligned
    z = wide[::-1].copy()
    w = _data(rng, 1001, "bfloat16")
    _gated_rows_vs_segments(wide, z, w, None, _gplan(1001, "bfloat16", None, True), "misaligned")


def test_gated_rows_launch_rule():
    """The rule's launches: whole warps, at most ROWS_THREADS per block, the segment
    kernels' tree (tree warps = segment_tpr / 32), slots that cover the segment; shapes
    it does not take keep pn_gated_fwd; configs that do not fit are a ValueError."""
    names = set(cl.specialisations())
    for x in ROWS_DTYPES:
        for d, gs in ((300, 300), (4096, 4096), (4096, 128), (8192, 8192), (16384, 16384), (32768, 32768),
                      (4101, 4101), (2048, 64)):
            tree = cl.segment_tree(gs, x)
            for n in (1, 7, 4096):
                la = cl.gated_forward_launch(n, d, gs, x)
                if tree is None or not cl.seg_rows_candidates(gs, x):
                    assert la.name.startswith("pn_gated_fwd"), (x, gs, la.name)
                    continue
                assert la.name.startswith("pn_gated_rows") and la.name in names, (x, d, gs, n, la.name)
                nw, tfirst, r = cl.rows_shape(la.tpr)
                it, mw = (int(v) for v in la.name.rstrip(">").split(",")[-2:])
                assert nw * 32 == tree[0] == cl.segment_tpr(gs, x) and not tfirst and r * mw == nw
                assert it == tree[1] and 32 * nw * it * cl.VEC[x] >= gs - gs % cl.VEC[x]
                assert la.block % (32 * r) == 0 and la.block <= cl.ROWS_THREADS
                rpb = la.block // (32 * r)
                segs = n * (d // gs)
                assert la.grid * rpb >= segs and (la.grid - 1) * rpb < segs and rpb * nw <= cl.ROWS_RED
    assert cl.gated_forward_launch(64, 4096, 4096, "float64").name.startswith("pn_gated_fwd")
    assert cl.gated_forward_launch(64, 4096, 4096, "bfloat16", "float32").name.startswith("pn_gated_fwd")
    assert cl.gated_forward_launch(64, 4096, 4096, "bfloat16", rows=False).name.startswith("pn_gated_fwd")
    with pytest.raises(ValueError, match="warps per segment"):
        cl.gated_forward_launch(64, 4096, 4096, "bfloat16", rows_config=(1, 8))


# ----------------------------------------------------------------------------- quantized output


def _quant_rows_vs_segments(x, res, w, b, qp, tag, rows_config=None):
    n, d = x.shape
    xd = next(k for k, v in NP.items() if x.dtype == v)
    la = cl.quant_launch(n, d, xd, qp.qdtype, group_size=qp.group_size, rows_config=rows_config)
    assert la.name.startswith("pn_quant_rows"), (la.name, tag)
    got = emul_quant_forward(x, res, w, b, qp, rows_config=rows_config)
    ref = emul_quant_forward(x, res, w, b, qp, rows=False)
    for a, r, what in zip(got, ref, ("q", "scales", "h"), strict=True):
        if r is None:
            assert a is None, what
            continue
        np.testing.assert_array_equal(_bits(np.asarray(a)), _bits(np.asarray(r)),
                                      err_msg=f"{what}: {la.name} vs pn_quant_fwd {tag}")
    return got, la


QUANT_ROWS_OPTS = [
    ("float8_e4m3fn", "token", "divide", {}),
    ("int8", "token", "divide", {"residual": True, "bias": True, "offset": 1.0}),
    ("float8_e5m2", "static", "divide", {"partial": 0.6, "eps_mode": "outside"}),
    ("float8_e4m3fn", "token", "reciprocal", {"residual": True, "eps": 0.0}),
    ("int8", "static", "reciprocal", {"bias": True}),
]


@pytest.mark.parametrize("dtype", ROWS_DTYPES)
def test_quant_rows_same_bits_as_segments(dtype):
    """Formats, per-token and static scales, divide and reciprocal, residual (h written),
    bias, offset, partial, eps outside and 0: pn_quant_fwd's q, scales and h bits (n = 5:
    a ragged last block)."""
    rng = np.random.default_rng(_seed("quant-rows", dtype))
    for d in (300, 1000, 4101, 2001, 5001):
        assert cl.seg_rows_candidates(d, dtype, cl.QUANT_ROWS_SHAPES), d  # float32 4101, 5001: IT 3 in 4 slots
        for qdtype, mode, smode, opt in QUANT_ROWS_OPTS:
            x = _data(rng, (5, d), dtype, 3.0)
            res = _data(rng, (5, d), dtype) if opt.get("residual") else None
            w = _data(rng, d, dtype)
            b = _data(rng, d, "float32") if opt.get("bias") else None
            kw = {k: v for k, v in opt.items() if k in ("partial", "eps_mode", "offset", "eps")}
            qp = _qplan(d, dtype, qdtype, 0.02 if mode == "static" else None, None, scale_mode=smode, **kw)
            _quant_rows_vs_segments(x, res, w, b, qp, f"d={d} {qdtype} {mode} {smode} {opt}")


@pytest.mark.parametrize("dtype,d", [("bfloat16", 4096), ("float32", 1000), ("float16", 16384)])
def test_quant_rows_every_knob_candidate_same_bits(dtype, d):
    """Every (warps per row, rows per block) the tuning sweep may pick, n odd, with a
    residual: the same bits (float16 d = 16384: the segment kernels' 1024-thread tree, 8
    warps of 8 chunks per lane)."""
    rng = np.random.default_rng(_seed("quant-knobs", dtype, d))
    x, res = _data(rng, (3, d), dtype, 3.0), _data(rng, (3, d), dtype)
    w = _data(rng, d, dtype)
    qp = _qplan(d, dtype, "float8_e4m3fn", None, None)
    cands = cl.seg_rows_candidates(d, dtype, cl.QUANT_ROWS_SHAPES)
    assert len(cands) >= (1 if d == 16384 else 2)
    for cfg in cands:
        _, la = _quant_rows_vs_segments(x, res, w, None, qp, f"config={cfg}", rows_config=cfg)
        assert la.block == 32 * cfg[0] * cfg[1] and cl.rows_shape(la.tpr)[2] == cfg[0]


@pytest.mark.parametrize("x16", [False, True], ids=["wide", "float16"])  # float16 x: the slow run (tests/conftest.py)
def test_quant_rows_extreme_values_and_misaligned_rows(x16):
    """Runs out of float32's range, Inf / NaN / zero rows (NaN and 1 scales), eps 0, a
    float32 row whose rstd overflows float32 (the wide path), rows not 16-byte aligned."""
    rng = np.random.default_rng(41)
    for dtype, scale in (("float32", 1e25), ("float32", 1e-30), ("bfloat16", 1e30), ("float16", 1e4)):
        if (dtype == "float16") != x16:
            continue
        d = 1000
        x = _data(rng, (6, d), dtype, scale)
        x[2] = 0
        x[3, d // 2] = np.inf
        x[4, 7] = np.nan
        x[5, ::3] *= 1e-3
        if dtype == "float32":
            x[5] = _data(rng, (1, d), dtype, 1e-40)[0]  # rms below 2^-128: rstd beyond float32
        w = _data(rng, d, dtype)
        for qdtype in ("float8_e4m3fn", "int8"):
            qp = _qplan(d, dtype, qdtype, None, None, eps=0.0)
            _quant_rows_vs_segments(x, None, w, None, qp, f"{dtype} {scale} {qdtype}")
    if x16:
        return
    x = _data(rng, (4, 1003), "bfloat16", 3.0)
    wide = np.concatenate([x, x[:, :3]], axis=1)[:, 1:1002]  # rows not 16-byte aligned
    w = _data(rng, 1001, "bfloat16")
    _quant_rows_vs_segments(wide, wide[::-1].copy(), w, None, _qplan(1001, "bfloat16"), "misaligned")


def test_quant_rows_launch_rule():
    """The rule's launches cover the rows with pn_quant_fwd's tree; several scale groups per
    row, float64 and rows too long keep pn_quant_fwd; unfit configs are a ValueError."""
    names = set(cl.specialisations())
    for x in ROWS_DTYPES:
        for d in (100, 300, 1000, 4096, 4101, 5001, 8192, 16384, 16400):
            tree = cl.segment_tree(d, x)
            for n in (1, 7, 4096):
                for fmt in ("float8_e4m3fn", "int8", "float8_e5m2"):
                    la = cl.quant_launch(n, d, x, fmt, group_size=d)
                    if tree is None or not cl.seg_rows_candidates(d, x, cl.QUANT_ROWS_SHAPES):
                        assert la.name.startswith("pn_quant_fwd"), (x, d, la.name)
                        continue
                    assert la.name.startswith("pn_quant_rows") and la.name in names, (x, d, n, la.name)
                    nw, tfirst, r = cl.rows_shape(la.tpr)
                    it, mw = (int(v) for v in la.name.rstrip(">").split(",")[-2:])
                    # IT: the tree's chunks per tree thread, or more slots (skipped beyond the row)
                    assert nw * 32 == tree[0] and it >= tree[1] and not tfirst and r * mw == nw
                    rpb = la.block // (32 * r)
                    assert la.grid * rpb >= n and (la.grid - 1) * rpb < n and la.block <= cl.ROWS_THREADS
        assert cl.quant_launch(64, 4096, x, group_size=128).name.startswith("pn_quant_fwd")
        assert cl.quant_launch(64, 4096, x).name.startswith("pn_quant_fwd")
    assert cl.quant_launch(64, 4096, "float64", group_size=4096).name.startswith("pn_quant_fwd")
    with pytest.raises(ValueError, match="warps per segment"):
        cl.quant_launch(64, 4096, "bfloat16", group_size=4096, rows_config=(1, 8))


@pytest.mark.parametrize("qdtype", ["int8", "float8_e4m3fn"])
def test_quant_rows_divide_and_reciprocal_at_midpoints(qdtype):
    """Rows of ones with eps 0 (rstd exactly 1: y is the weight) whose weights sit where
    y / s and y * float32(1 / s) round to neighbouring codes: pn_quant_rows gives each
    scale_mode's formula's codes (written out in test_quant_conventions), static and per
    token (random rows almost never tell the two apart)."""
    from test_quant_conventions import _midpoint_row, peer_divide, peer_reciprocal

    s1 = np.float32(0.875)
    w = _midpoint_row(qdtype, s1)
    w = np.tile(w, -(-300 // w.size))[:300] if w.size < 300 else w  # rows of >= 32 tree threads
    w[-1] = np.float32(s1) * np.float32(127.0 if qdtype == "int8" else 448.0)
    x = np.ones((3, w.size), np.float32)
    for mode, f in (("divide", peer_divide), ("reciprocal", peer_reciprocal)):
        want = f(x * w, s1, qdtype)
        for scale in (float(s1), None):
            qp = _qplan(w.size, "float32", qdtype, scale, None, scale_mode=mode, eps=0.0)
            (q, s, _), la = _quant_rows_vs_segments(x, None, w, None, qp, f"{mode} scale={scale}")
            np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(want).view(np.uint8),
                                          f"{mode} scale={scale}")
            assert np.all(np.asarray(s) == s1)


def test_rows_fusions_sum_the_tree_warps_left_to_right():
    """A float32 row (d = 1024: 8 tree warps of 32 tree threads, one run each) whose
    tree-warp sums are 1.0 and squares of a few 2^-28 multiples, and an eps that puts rstd at
    a float32 rounding boundary: the segment kernels' tree (left to right) gives 31.999998,
    other orders 32.0 (random rows almost never tell orders apart: their double sums are
    exact).  pn_gated_rows' rstd and pn_quant_rows' per-token scale (y = x * rstd at the 1.0,
    no weight) follow the tree for every launch."""
    d, eps = 1024, 5.820766037136632e-11
    ms = [2, 6, 9, 7, 0, 4, 5, 5]  # tree warp 4 holds 1.0
    runs = [1.0 if w == 4 else (m * 2.0**-28) ** 2 for w, m in enumerate(ms)]
    ltr = runs[0]
    for v in runs[1:]:
        ltr = ltr + v
    rtl = 0.0
    for v in reversed(runs):
        rtl = v + rtl
    want, other = (np.float32(1.0 / np.sqrt(s / d + eps)) for s in (ltr, rtl))
    assert want != other
    x = np.zeros((3, d), np.float32)
    for w, m in enumerate(ms):  # chunk 32 * w (columns 128 * w ..): tree thread 32 * w
        x[:, 128 * w] = 1.0 if w == 4 else m * 2.0**-28
    z = np.ones((3, d), np.float32)
    gp = _gplan(d, "float32", None, True, eps=eps)
    for cfg in cl.seg_rows_candidates(d, "float32"):
        (_, r), _ = _gated_rows_vs_segments(x, z, None, None, gp, f"tree order {cfg}", rows_config=cfg)
        np.testing.assert_array_equal(r[:, 0], np.full(3, want), err_msg=f"{cfg}")
    qmax = np.float32(448.0)  # float8_e4m3fn (int8's 127 maps both to one scale)
    assert want / qmax != other / qmax
    qp = _qplan(d, "float32", "float8_e4m3fn", None, None, eps=eps)
    for cfg in cl.seg_rows_candidates(d, "float32", cl.QUANT_ROWS_SHAPES):
        (_, s, _), _ = _quant_rows_vs_segments(x, None, None, None, qp, f"tree order {cfg}", rows_config=cfg)
        np.testing.assert_array_equal(np.asarray(s)[:, 0], np.full(3, want / qmax), err_msg=f"{cfg}")
