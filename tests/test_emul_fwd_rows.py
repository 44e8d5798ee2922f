"""pn_fwd_rows (several rows per block, 1-8 warps per row, the row in registers) gives
pn_fwd's / pn_fwd_big's y, h and rstd bits, run on the CPU by the emulator.

The dispatcher sends rows of ``d > 256`` with float compute to pn_fwd_rows; the tree
its statistic is summed over is fixed by ``d`` (``launch.fwd_tree``: pn_fwd's threads
per row and ITEMS, or pn_fwd_big's block for single-slice rows), and the launch knobs
(warps per row, rows per block) must not change a bit.  Every case here compares
pn_fwd_rows with the kernel that had the rows before (``rows=False``) bit for bit, and
with the reference backend at the usual tolerances.
"""

from __future__ import annotations

import numpy as np
import pytest
from _oracle import assert_close, looser
from test_emul_kernels import OPTIONS, _bits, _data, _option_case, _plan, _seed, emul_forward

from polynorm.backends import reference
from polynorm.backends.cuda import launch as cl

ROWS_DTYPES = ("bfloat16", "float16", "float32")
#: one d per tree shape: pn_fwd ITEMS 1 (few tree warps), ITEMS 2 with a tail, the longest
#: ITEMS 2 / 4 rows, pn_fwd_big's single-slice rows (tail first; float32 has none)
D_TREES = (300, 1000, 4101, 8195, 16390)


def _same_bits(x, res, w, b, plan, tag, rows_config=None, want_rows=True):
    got = emul_forward(x, res, w, b, plan, rows_config=rows_config)
    assert got is not None
    if want_rows:
        assert got[3].name.startswith("pn_fwd_rows"), (got[3].name, tag)
    ref = emul_forward(x, res, w, b, plan, rows=False, split=False)
    assert not ref[3].name.startswith("pn_fwd_rows")
    for a, r, what in zip(got[:3], ref[:3], ("y", "h", "rstd"), strict=True):
        if a is not None:
            np.testing.assert_array_equal(_bits(a), _bits(r), err_msg=f"{what}: {got[3].name} vs {ref[3].name} {tag}")
    return got


@pytest.mark.parametrize("dtype", ROWS_DTYPES)
def test_rows_same_bits_as_before_for_every_tree(dtype):
    rng = np.random.default_rng(_seed("rows", dtype))
    for d in D_TREES:
        if cl.fwd_tree(d, dtype) is None:
            assert dtype == "float32" and d == 16390  # two slices: pn_fwd_big keeps them
            continue
        x = _data(rng, 3, d, dtype)
        w = _data(rng, 1, d, dtype)[0]
        plan = _plan(d, dtype)
        y, _, rstd, la = _same_bits(x, None, w, None, plan, f"d={d}")
        ry, _, rr = reference.forward(x, None, w, None, plan)
        assert_close(y, ry, looser(plan.norm_dtype, plan.out_dtype), f"y of {la.name} d={d}")


#: OPTIONS of test_emul_kernels that pn_fwd_rows takes (h and y in x's dtype)
ROWS_OPTS = ("everything", "no_weight", "bias", "partial", "offset", "eps_outside", "eps_inside_large", "llama",
             "llama_offset_bias", "residual", "weight_f32", "out_f32")


@pytest.mark.parametrize("dtype", ROWS_DTYPES)
@pytest.mark.parametrize("opt", ROWS_OPTS)
def test_rows_options_same_bits(dtype, opt):
    """Options (residual, bias, partial, eps outside, offset, llama casting, a float32
    weight): pn_fwd's bits at two trees (d = 1000, ITEMS 1; d = 4101, ITEMS 2 and a tail)."""
    rng = np.random.default_rng(_seed("rows-opt", dtype, opt))
    for d in (1000, 4101):
        x, res, w, b, plan = _option_case(rng, 5, d, dtype, OPTIONS[opt])
        _same_bits(x, res, w, b, plan, f"{opt} d={d}")


@pytest.mark.parametrize("dtype,d", [("bfloat16", 4096), ("float16", 8195), ("float32", 2000), ("float32", 1000)])
def test_rows_every_knob_candidate_same_bits(dtype, d):
    """Every (warps per row, rows per block) the tuning sweep may pick: the same bits, also
    with a ragged last block (n odd)."""
    rng = np.random.default_rng(_seed("rows-knobs", dtype, d))
    x = _data(rng, 5, d, dtype)
    res = _data(rng, 5, d, dtype)
    w = _data(rng, 1, d, dtype)[0]
    plan = _plan(d, dtype, partial=0.7)
    cands = cl.rows_candidates(d, dtype)
    assert len(cands) >= 2
    for cfg in cands:
        la = _same_bits(x, res, w, None, plan, f"config={cfg}", rows_config=cfg)[3]
        r, rpb = cfg
        assert la.block == 32 * r * rpb and cl.rows_shape(la.tpr)[2] == r


@pytest.mark.parametrize("x16", [False, True], ids=["wide", "float16"])  # float16 x: the slow run (tests/conftest.py)
def test_rows_extreme_values_same_bits(x16):
    """The float runs' exact fallback (squares that overflow float32 or are tiny: the
    lane's slow path), NaN / Inf / zero rows, eps 0, and misaligned rows (the
    element-by-element twin): pn_fwd's bits."""
    rng = np.random.default_rng(21)
    for dtype, scale in (("float32", 1e25), ("float32", 1e-30), ("bfloat16", 1e30), ("float16", 1e4)):
        if (dtype == "float16") != x16:
            continue
        for d in (1000, 4101):
            x = _data(rng, 6, d, dtype, scale)
            x[2] = 0
            x[3, d // 2] = np.inf
            x[4, 7] = np.nan
            x[5, ::3] *= 1e-3
            w = _data(rng, 1, d, dtype)[0]
            _same_bits(x, None, w, None, _plan(d, dtype, eps=0.0), f"{dtype} scale={scale} d={d}")
    x = _data(rng, 4, 1003, "bfloat16")
    wide = np.concatenate([x, x[:, :3]], axis=1)[:, 1:1002]  # rows not 16-byte aligned
    w = _data(rng, 1, 1001, "bfloat16")[0]
    _same_bits(wide, wide[::-1].copy(), w, None, _plan(1001, "bfloat16"), "misaligned")


def test_rows_sum_the_tree_warps_left_to_right():
    """A float32 row (d = 1024: 8 tree warps of 32 tree threads, one run each) whose
    tree-warp sums are 1.0 and squares of a few 2^-28 multiples, and an eps that puts rstd
    at a float32 rounding boundary: left to right (the tree) gives 31.999998, right to left
    or any fold that starts elsewhere 32.0.  Every launch of pn_fwd_rows gives the tree's
    bits (a wrong order shows here, where random rows almost never tell orders apart)."""
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
    plan = _plan(d, "float32", eps=eps)
    for cfg in cl.rows_candidates(d, "float32"):
        got = _same_bits(x, None, None, None, plan, f"tree order {cfg}", rows_config=cfg)
        np.testing.assert_array_equal(got[2], np.full(3, want), err_msg=f"{cfg}")


def test_rows_launch_rule():
    """The rule's launches: whole warps, at most ROWS_THREADS per block, slots that cover
    the row, the same tree for every n; tuning configs that do not fit are a ValueError."""
    names = set(cl.specialisations())
    for x in ROWS_DTYPES:
        for d in (257, 512, 1000, 2048, 4096, 4101, 8192, 8195, 16384, 16390):
            tree = cl.fwd_tree(d, x)
            for n in (1, 7, 4096, 1 << 15):
                la = cl.forward_launch(n, d, x)
                if tree is None or not cl.rows_candidates(d, x):
                    assert not la.name.startswith("pn_fwd_rows")
                    continue
                assert la.name.startswith("pn_fwd_rows") and la.name in names, (x, d, n, la.name)
                nw, tfirst, r = cl.rows_shape(la.tpr)
                it, mw = (int(v) for v in la.name.rstrip(">").split(",")[-2:])
                t, t_items, t_first = tree
                assert nw * 32 == t and tfirst == t_first and r * mw == nw and it == t_items
                assert la.block % 32 == 0 and la.block <= cl.ROWS_THREADS and la.block % (32 * r) == 0
                rpb = la.block // (32 * r)
                assert la.grid * rpb >= n and (la.grid - 1) * rpb < n and rpb * nw <= cl.ROWS_RED
                assert it * mw <= cl.ROWS_CHUNKS
    assert not cl.forward_launch(64, 4096, "bfloat16", rows=False).name.startswith("pn_fwd_rows")
    assert not cl.forward_launch(64, 4096, "float64").name.startswith("pn_fwd_rows")
    assert not cl.forward_launch(64, 4096, "bfloat16", "float32").name.startswith("pn_fwd_rows")
    with pytest.raises(ValueError, match="warps per row"):
        cl.rows_launch(64, 4096, "bfloat16", config=(1, 8))


def test_tuning_table_is_read_per_device(tmp_path, monkeypatch):
    """A table entry for the device and case picks the config; other devices and cases
    keep the rule."""
    import json

    monkeypatch.setattr(cl, "TUNING_DIR", tmp_path)
    cl.tuning_table.cache_clear()
    cl.rows_launch.cache_clear()
    key = cl.tuning_key("fwd", "bfloat16", 4096, 32768)
    bad = cl.tuning_key("fwd", "bfloat16", 2048, 32768)  # no such launch: the rule
    (tmp_path / "Test_GPU.json").write_text(json.dumps(
        {"device": "Test GPU", "cases": {key: {"warps_per_row": 4, "rows_per_block": 1},
                                         bad: {"warps_per_row": 1, "rows_per_block": 64}}}))
    try:
        tuned = cl.rows_launch(32768, 4096, "bfloat16", device="Test GPU")
        rule = cl.rows_launch(32768, 4096, "bfloat16", device="Other GPU")
        add = cl.rows_launch(32768, 4096, "bfloat16", device="Test GPU", has_res=True)
        assert cl.rows_shape(tuned.tpr)[2] == 4 and tuned.block == 128
        assert rule == add == cl.rows_launch(32768, 4096, "bfloat16")
        assert rule.name.split(",")[:4] == tuned.name.split(",")[:4]
        # n above the largest bucket takes the largest; a case without an entry, the rule
        assert cl.rows_launch(40000, 4096, "bfloat16", device="Test GPU") == cl.rows_launch(
            40000, 4096, "bfloat16", config=(4, 1))
        assert cl.rows_launch(32768, 2048, "bfloat16", device="Test GPU") == cl.rows_launch(32768, 2048, "bfloat16")
    finally:
        cl.tuning_table.cache_clear()
        cl.rows_launch.cache_clear()
