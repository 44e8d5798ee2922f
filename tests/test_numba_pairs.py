"""The bfloat16 backward's explicit-vector dx pass against the scalar loop it replaces.

:func:`polynorm.backends.numba.pairs.dx_pairs` must give the bits of
``numba.backward_kernels._dx_pass`` (LLVM's vectorization of the scalar loop) on
the same row: dx, and the row-tree terms it leaves in the pool (in the
pair layout), joined with waiting siblings or not, with ``k`` inside a
16-column block.  Its rounding is checked against the codec on every
bfloat16 top half with the low halves that decide ties and carries.
:func:`~polynorm.backends.numba.pairs.dot_pairs` is checked against its
documented summation order, written out in numpy.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from numba import njit  # noqa: E402

from polynorm.backends.numba.backward_kernels import _PAD, _dx_pass  # noqa: E402
from polynorm.backends.numba.codec import encode_array  # noqa: E402
from polynorm.backends.numba.kernels import DOT_BLOCK  # noqa: E402
from polynorm.backends.numba.pairs import (  # noqa: E402
    PAIR_BLOCK,
    dot_pairs,
    dx_pairs,
    pair_position,
    pair_weight,
)

_POOL_ROWS = 4  # the row written (0) and three waiting siblings


@njit
def _both(x, dy, w, g2, k, rc, coef, fold, dx_pairs_out, dx_loop_out, pc_pairs, pc_loop):
    n = g2.shape[0]
    dx_pairs(x, dy, dx_pairs_out, g2, pc_pairs, _PAD, 0, 0, n, k, rc, coef, 0, 1, 2, 3, fold)
    km = min(max(k, 0), n)
    oc = np.float32(0.0)
    _dx_pass(0, 0, km, dy, x, w, None, dx_loop_out, 0, 0, rc, oc, coef, pc_loop, 0, 1, 2, 3,
             fold)
    _dx_pass(0, km, n, dy, x, w, None, dx_loop_out, 0, 0, rc, oc, np.float32(0.0), pc_loop, 0,
             1, 2, 3, fold)


def _positions(n):
    return np.array([pair_position(j, n) for j in range(n)])


def _run(x, dy, w, k, rc, coef, fold, rng):
    """dx and the written pool row (columns in order) of both passes on row ``x``."""
    n = x.shape[1]
    pos = _positions(n)
    with np.errstate(invalid="ignore"):
        g = w + np.float32(0.0)  # the kernel's weight plus offset (0)
    g2 = np.empty(n, np.float32)
    g2[pos] = g
    siblings = rng.standard_normal((_POOL_ROWS, n)).astype(np.float32)
    pc_loop = np.full((_POOL_ROWS, n + 2 * _PAD), np.nan, np.float32)
    pc_pairs = pc_loop.copy()
    pc_loop[:, _PAD:_PAD + n] = siblings
    pc_pairs[:, _PAD + pos] = siblings
    dx_a = np.zeros_like(x)
    dx_b = np.ones_like(x)
    _both(x, dy, w, g2, k, np.float32(rc), np.float32(coef), fold, dx_a, dx_b, pc_pairs, pc_loop)
    assert np.isnan(pc_pairs[:, :_PAD]).all() and np.isnan(pc_pairs[:, _PAD + n:]).all()
    return (dx_a, pc_pairs[0, _PAD + pos]), (dx_b, pc_loop[0, _PAD:_PAD + n])


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("k", [0, 7, 16, 37, 64, 200])
def test_pair_pass_has_the_scalar_loops_bits(fold, k, rng):
    n = 4 * PAIR_BLOCK
    x = rng.standard_normal((1, n)).astype(np.float32)
    dy = rng.standard_normal((1, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    # non-finite values, each alone in its column (where two NaNs meet, which
    # payload survives is the machine code's operand order)
    x[0, 3], dy[0, 9], w[20], x[0, 33], dy[0, 50] = np.nan, np.inf, np.nan, -np.inf, 3e38
    w[21] = np.float32(np.frombuffer(np.uint32(0x7F800001).tobytes(), np.float32)[0])  # sNaN
    x[0, 60], dy[0, 61] = 1e-39, -1e-40  # subnormal
    xb, dyb = (encode_array(a.ravel(), True).reshape(1, n) for a in (x, dy))
    (dxa, pa), (dxb, pb) = _run(xb, dyb, w, k, 0.731, -1.37, fold, rng)
    assert (_bits(dxa) == _bits(dxb)).all()
    assert (_bits(pa) == _bits(pb)).all()
    assert not (_bits(dxb) == 0).all()


def test_pair_rounding_matches_the_codec():
    """dy = 1, x = 0, rc = 1: dx is the weight rounded to bfloat16, for every top
    half with the low halves of ties, carries, NaN payloads and subnormals."""
    tops = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF], np.uint32)
    words = (tops[:, None] | lows[None, :]).ravel()
    w = words.view(np.float32)
    n = w.shape[0]
    assert n % PAIR_BLOCK == 0
    one = np.full((1, n), 0x3F80, np.uint16)
    zero = np.zeros((1, n), np.uint16)
    (dxa, _), (dxb, _) = _run(zero, one, w, n, 1.0, 0.5, False, np.random.default_rng(0))
    # the weight plus the offset (-0 becomes +0, a signalling NaN quiet), rounded
    with np.errstate(invalid="ignore"):
        want = encode_array(w + np.float32(0.0), True)
    assert (dxa.ravel() == want).all()
    assert (dxb.ravel() == want).all()


@njit
def _dot(x, dy, w, offset, npair, rc):
    g2 = pair_weight(w, offset, npair)
    return dot_pairs(x, dy, g2, w, 0, rc, np.float32(offset))


def _fma32(a, b, c):
    # a * b is exact in float64; the add rounds there, then to float32 (a double
    # rounding that differs from one fused rounding about once in 2**29 adds)
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _documented_dot(x, dy, w, offset, npair, rc):
    """The order :func:`dot_pairs` documents, one float32 operation at a time."""
    d = x.shape[0]
    g = w + np.float32(offset)
    p = dy * (x * rc)  # float32 products, as the kernel rounds them
    c = 0.0
    for b in range(0, d, DOT_BLOCK):
        e = min(b + DOT_BLOCK, d)
        pe = max(b, min(e, npair))
        lanes = np.zeros(2 * PAIR_BLOCK, np.float32)
        for m, j0 in enumerate(range(b, pe, PAIR_BLOCK)):
            cols = j0 + np.r_[0:PAIR_BLOCK:2, 1:PAIR_BLOCK:2]  # even columns first
            base = PAIR_BLOCK * (m % 2)
            for t, j in enumerate(cols):
                lanes[base + t] = _fma32(g[j], p[j], lanes[base + t])
        h = PAIR_BLOCK // 2
        v = np.float32(lanes[0:h] + lanes[2 * h:3 * h]) + np.float32(lanes[h:2 * h] + lanes[3 * h:])
        while v.shape[0] > 1:
            v = v[: v.shape[0] // 2] + v[v.shape[0] // 2:]
        s = v[0]
        for j in range(pe, e):
            s = _fma32(g[j], p[j], s)
        c += np.float64(s)
    return c


@pytest.mark.parametrize("d", [16, 48, 515, 1040, 1300])
def test_dot_pairs_sums_in_its_documented_order(d, rng):
    npair = d - d % PAIR_BLOCK
    x = rng.standard_normal(d).astype(np.float32) * np.float32(3.0)
    dy = rng.standard_normal(d).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    xb, dyb = (encode_array(a, True) for a in (x, dy))
    xf, dyf = (np.ascontiguousarray(a.astype(np.uint32) << 16).view(np.float32)
               for a in (xb, dyb))
    rc, offset = np.float32(0.61), 0.25
    got = _dot(xb[None, :], dyb[None, :], w, offset, npair, rc)
    assert got == _documented_dot(xf, dyf, w, offset, npair, rc)
