"""The row tree: dweight/dbias summed in one order fixed by the global row index.

Three claims are checked: :func:`_rowtree.merge` computes the tree that its
docstring defines (against a recursive oracle written here from the
definition); the Numba kernel sums over that same tree (dbias's leaves are
``dy`` itself, so the oracle predicts its bits exactly); and any split of
the rows into contiguous ranges, merged, gives the bits of one in-memory
call -- the property the dask backend relies on.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn
from polynorm.backends import rowtree as _rowtree
from polynorm.core.options import Options, make_plan

nb = pytest.importorskip("polynorm.backends.numba")
pytest.importorskip("numba")

G = _rowtree.TREE_G
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
          "float64": np.float64}


def _tree(leaves: np.ndarray, cdt) -> np.ndarray:
    """The definition, recursively: node (l, j) = left + right, or left when the
    right child holds no row; adds in ``cdt`` below level G, float64 above."""
    n = leaves.shape[0]

    def node(lv: int, j: int) -> np.ndarray:
        if lv == 0:
            return leaves[j].astype(cdt)
        left = node(lv - 1, 2 * j)
        if (2 * j + 1) << (lv - 1) >= n:
            return left
        right = node(lv - 1, 2 * j + 1)
        dt = cdt if lv < G else np.float64
        return left.astype(dt) + right.astype(dt)

    top = max(0, (n - 1).bit_length())
    return node(top, 0).astype(np.float64)


def _leaf_states(leaves: np.ndarray) -> list[_rowtree.State]:
    return [(np.array([0]), np.array([g]), leaves[g:g + 1].astype(np.float64))
            for g in range(leaves.shape[0])]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 31, 100])
@pytest.mark.parametrize("cdt", [np.float32, np.float64])
def test_merge_is_the_defined_tree(n, cdt):
    rng = np.random.default_rng(n)
    leaves = (rng.standard_normal((n, 3)) * 10.0 ** rng.integers(-3, 4, (n, 1))).astype(cdt)
    want = _tree(leaves, cdt)
    states = _leaf_states(leaves)
    rng.shuffle(states)  # order of arrival does not matter
    got = _rowtree.root(_rowtree.merge(states, n, np.dtype(cdt)), n)
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))
    # merged in adjacent groups, as dask's fan-in does
    groups = [_rowtree.merge(_leaf_states(leaves)[i:i + 3], n, np.dtype(cdt))
              for i in range(0, n, 3)]
    got2 = _rowtree.root(_rowtree.merge(groups, n, np.dtype(cdt)), n)
    np.testing.assert_array_equal(got2.view(np.uint64), want.view(np.uint64))


def test_merge_rejects_a_partial_root():
    leaves = np.ones((4, 2))
    with pytest.raises(ValueError, match="cover"):
        _rowtree.root(_rowtree.merge(_leaf_states(leaves)[:3], 4, np.dtype(np.float64)), 4)


def _plan(d, dtype, **kw):
    opts = dict(eps=1e-6, partial=1.0, offset=0.0, eps_mode="inside", casting="fp32",
                out_dtype=None)
    opts.update(kw)
    return make_plan(d, dtype, Options(**opts))


@pytest.mark.parametrize("n", [1, 7, 16, 33, 1000, 4099])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_kernel_sums_dbias_over_the_defined_tree(n, dtype):
    """dbias's leaves are dy in the compute dtype (exact): its bits are the oracle's."""
    rng = np.random.default_rng(n)
    d = 24
    dt = DTYPES[dtype]
    x = rng.standard_normal((n, d)).astype(dt)
    dy = (rng.standard_normal((n, d)) * 10.0 ** rng.integers(-2, 3, (n, 1))).astype(dt)
    cdt = np.float64 if dtype == "float64" else np.float32
    _, _, db = nb.backward(dy, x, None, np.zeros(d, np.float64), None, None, _plan(d, dtype))
    want = _tree(dy.astype(cdt), cdt)
    np.testing.assert_array_equal(db.view(np.uint64), want.view(np.uint64))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("wide", [False, True])
def test_kernel_sums_dweight_over_the_defined_tree(dtype, wide):
    """dweight's leaves are ``dy * (x * rstd)`` in float32 (rstd given): numpy's
    float32 products are the kernel's, so the tree predicts dweight's bits --
    for rows that group 16 leaves a node and for rows wide enough to fold
    their waiting siblings in the dx pass instead (``_GROUP_MAX_BYTES``)."""
    from polynorm.backends.numba import backward_kernels as K

    limit = K._GROUP_MAX_BYTES_F16 if dtype == "float16" else K._GROUP_MAX_BYTES
    # terms of dweight and dbias: 2 d columns in a pool row of float32
    d = limit // (2 * 4 * 2**G) + 3 if wide else 40
    n = 40
    rng = np.random.default_rng(d)
    dt = DTYPES[dtype]
    x = rng.standard_normal((n, d)).astype(dt)
    dy = (rng.standard_normal((n, d)) * 10.0 ** rng.integers(-2, 3, (n, 1))).astype(dt)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    b = np.zeros(d, np.float32)
    rstd = pn.rms_norm(x, eps=1e-6, return_rstd=True)[1]
    _, dw, db = nb.backward(dy, x, w, b, rstd, None, _plan(d, dtype))
    f32 = np.float32
    leaves = dy.astype(f32) * (x.astype(f32) * rstd.astype(f32)[:, None])
    np.testing.assert_array_equal(dw.view(np.uint32),
                                  _tree(leaves, f32).astype(f32).view(np.uint32))
    np.testing.assert_array_equal(db.view(np.uint32),
                                  _tree(dy.astype(f32), f32).astype(f32).view(np.uint32))


def _cuts(rng, n, k):
    return sorted({0, n, *rng.integers(0, n + 1, size=k).tolist()})


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("n", "d"), [(1, 1), (5, 3), (37, 31), (300, 8), (2100, 130)])
def test_any_split_of_the_rows_gives_the_same_bits(dtype, n, d):
    rng = np.random.default_rng(n * d)
    dt = DTYPES[dtype]
    x = rng.standard_normal((n, d)).astype(dt)
    dy = rng.standard_normal((n, d)).astype(dt)
    gr = rng.standard_normal((n, d)).astype(dt)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    b = rng.standard_normal(d).astype(dt)
    rstd = pn.rms_norm(x, eps=1e-6, return_rstd=True)[1]
    for kw, args in (
        (dict(), (w, b, None, None)),
        (dict(partial=1.0 if d == 1 else 0.5, offset=0.5, eps_mode="outside"), (w, None, None, gr)),
        (dict(), (None, b, None, None)),
        (dict(), (w, None, rstd, None)),
    ):
        plan = _plan(d, dtype, **kw)
        wt, bi, rs, g = args
        dx, dw, db = nb.backward(dy, x, wt, bi, rs, g, plan)
        for trial in range(3):
            cuts = _cuts(rng, n, 1 + 4 * trial)
            dxs, states = [], []
            for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
                gi = None if g is None else g[lo:hi]
                ri = None if rs is None else rs[lo:hi]
                part, state = nb.backward_range(dy[lo:hi], x[lo:hi], wt, bi, ri, gi, plan, lo, n)
                dxs.append(part)
                states.append(state)
            cdt = np.dtype(np.float64 if dtype == "float64" else np.float32)
            total = _rowtree.root(_rowtree.merge(states[::-1], n, cdt), n)
            dw2, db2 = nb.finish(total, d, None if wt is None else wt.dtype,
                                 None if bi is None else bi.dtype)
            np.testing.assert_array_equal(np.concatenate(dxs).view(np.uint8), dx.view(np.uint8))
            for got, want in ((dw2, dw), (db2, db)):
                assert (got is None) == (want is None)
                if want is not None:
                    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                                  err_msg=f"cuts {cuts}")


def test_pairwise_sum_is_accurate():
    """65536 rows of float32 terms: the tree's float32 levels reach only 16 rows,
    so dweight is within a few float32 ulps of the float64 sum."""
    rng = np.random.default_rng(9)
    n, d = 65536, 16
    x = rng.standard_normal((n, d)).astype(np.float32)
    dy = (1 + rng.random((n, d))).astype(np.float32)  # no cancellation
    plan = _plan(d, "float32")
    _, dw, db = nb.backward(dy, x, np.ones(d, np.float32), np.zeros(d, np.float32), None, None,
                            plan)
    exact_db = dy.astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(db, exact_db, rtol=4 * 2.0**-24)
    xh = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6)
    exact_dw = (dy.astype(np.float64) * xh).sum(axis=0)
    scale = np.abs(dy.astype(np.float64) * xh).sum(axis=0)
    assert np.all(np.abs(dw - exact_dw) <= 8 * 2.0**-24 * scale)


def test_range_without_weight_or_bias_has_nothing_to_sum():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 5)).astype(np.float32)
    plan = _plan(5, "float32")
    dx, state = nb.backward_range(x[2:], x[2:], None, None, None, None, plan, 2, 9)
    np.testing.assert_array_equal(dx, nb.backward(x, x, None, None, None, None, plan)[0][2:])
    assert state[0].shape == (0,) and state[2].shape == (0, 0)
