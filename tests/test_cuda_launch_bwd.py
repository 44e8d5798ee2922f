"""Launch rules of the register backward kernel pn_bwd (pure Python, no compiler).

Whether a weight / grad_residual is passed is a compile-time parameter of
pn_bwd (HAS_W / HAS_G): it picks the instantiation and nothing else, so the
grid, block, rows per block and partial buffers (which fix the order of the
dweight / dbias sums) are the same for every combination.
"""

from __future__ import annotations

import dataclasses

import pytest

from polynorm.backends.cuda import launch as cl

FLAGS = [(hw, hg) for hw in (False, True) for hg in (False, True)]


def _tf(v: bool) -> str:
    return "true" if v else "false"


@pytest.mark.parametrize("x", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("d", [1, 3, 8, 31, 64, 100, 128, 255, 256, 257, 1000, 2048, 4096, 6000, 8192])
def test_bwd_flags_pick_the_instantiation_only(x, d):
    names = set(cl.specialisations())
    for n in (1, 2, 7, 64, 4096, 1 << 21):
        for num_sms in (1, 108, 132):
            for t in (tt for tt in cl.BWD_TYPES if tt[0] == x):
                base = None
                for hw, hg in FLAGS:
                    la = cl.backward_launch(n, d, *t, num_sms=num_sms, has_w=hw, has_g=hg)
                    assert la.name in names
                    if la.big:
                        assert la.name == cl.bwd_name(*t, None)
                        continue
                    if la.name.startswith("pn_bwd_rows"):  # HAS_W / HAS_G: the last two arguments
                        assert la.name.endswith(f", {_tf(hw)}, {_tf(hg)}>") and cl.bwd_tree(d, x) is not None
                        shape = dataclasses.replace(la, name="")
                        base = base or shape
                        assert shape == base, (n, d, t, hw, hg)
                        continue
                    sshape = cl.small_bwd_shape(d, x)
                    if cl.takes_small_bwd(d, x, t[1]):
                        assert la.name == cl.bwd_small_name(*t, sshape[1], sshape[0], hw, hg)
                        assert la.name.endswith(f", {_tf(hw)}, {_tf(hg)}, {sshape[0]}>")
                    else:
                        assert la.name == cl.bwd_name(*t, 1, hw, hg)
                        assert la.name.endswith(f", 1, {_tf(hw)}, {_tf(hg)}>")
                    shape = dataclasses.replace(la, name="")
                    base = base or shape
                    assert shape == base, (n, d, t, hw, hg)


def test_bwd_specialisations_cover_every_flag():
    names = cl.specialisations()
    bwd = [nm for nm in names if nm.startswith("pn_bwd<")]
    assert len(bwd) == len(cl.BWD_TYPES) * len(cl.BWD_ITEMS) * len(FLAGS) == len(set(bwd))
    for t in cl.BWD_TYPES:
        for hw, hg in FLAGS:
            assert cl.bwd_name(*t, 1, hw, hg) in names


def test_bwd_headline_shapes():
    """The README's backward cases: the ITEMS=1 kernel at d=4096, with its dynamic shared
    memory: the tail sums plus the row ring (3 stages of 3 pieces, the larger ring) where
    that exceeds the dweight/dbias accumulator rows, which then alias it; pn_bwd_small at
    d=128 (8 lanes per row, 4 rows per warp, where pn_bwd gives a row 16 threads)."""
    la = cl.backward_launch(16384, 4096, "bfloat16", num_sms=132, rows=False)
    assert la.name == "pn_bwd<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 1, true, false>"
    assert (la.block, la.tpr, la.grid) == (512, 512, 264)
    assert la.shared == 2 * 8 * 4 + 3 * 3 * 16 * 512 > 2 * 4096 * 4
    la = cl.backward_launch(1 << 21, 128, "bfloat16", num_sms=132, has_w=False, has_g=True)
    assert la.name == "pn_bwd_small<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 2, false, true, 8>"
    assert (la.block, la.tpr, la.grid, la.shared, la.partial_rows) == (256, 8, 528, 2 * 32 * 128 * 4, 528)
    la = cl.backward_launch(1 << 21, 128, "bfloat16", num_sms=132, has_w=False, has_g=True, small=False)
    assert la.name == "pn_bwd<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 1, false, true>"
    assert (la.block, la.tpr, la.grid) == (256, 16, 528)
    assert la.shared == 2 * 16 * 8 * 4 + 3 * 3 * 16 * 256
    # one row per lane (a single block of two row slots): one stage; the accumulator rows are larger
    la = cl.backward_launch(1, 128, "bfloat16", num_sms=132, small=False)
    assert la.shared == 2 * 2 * 128 * 4 > 2 * 2 * 8 * 4 + 3 * 16 * 32 and la.block == 32


@pytest.mark.parametrize("x", ["float16", "bfloat16", "float32", "float64"])
def test_bwd_small_shape_stands_for_pn_bwds_threads(x):
    """pn_bwd_small's lanes x ITEMS are exactly pn_bwd's threads per row (its tree), at
    least VEC lanes per row (the tail elements sit in item 0), rows inside one warp, and
    a compiled instantiation for every d <= SMALL_D with a shape (float64 rows of 128
    pn_bwd threads stay with pn_bwd)."""
    names = set(cl.specialisations())
    vec = cl.VEC[x]
    for d in range(1, cl.SMALL_D + 2):
        sshape = cl.small_bwd_shape(d, x)
        ref = cl.backward_launch(64, d, x, small=False)
        if sshape is None:
            assert d > cl.SMALL_D or (x == "float64" and ref.tpr == 128), (x, d)
            assert cl.backward_launch(64, d, x).name == ref.name
            continue
        lpr, items, wide = sshape
        assert lpr * items == ref.tpr and lpr & (lpr - 1) == 0 and vec <= lpr <= 32
        assert wide == (ref.tpr > 32) and (not wide or lpr == 32)
        for n in (1, 7, 1 << 21):
            la = cl.backward_launch(n, d, x)
            assert la.name in names and la.tpr == lpr and la.block % 32 == 0 and la.block <= cl.SMALL_THREADS
            assert la.shared == 2 * (la.block // lpr) * la.ldp * cl.ITEMSIZE[cl.compute_dtype(x)]
