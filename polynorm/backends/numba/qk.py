"""Numba kernel of QK-norm (+ RoPE) on ``(T, H, D)`` heads, in place (:func:`polynorm.qk_norm`).

Each token's ``(H, D)`` view goes through the plain forward's own row drivers
(:func:`.numba.kernels._plain_rows`, ``_bits_rows`` for 16-bit rows;
``_fwd_norm_row_llama`` per row in llama casting), with ``y`` the view itself: the
bits of :func:`polynorm.rms_norm` (16-bit rows included), stored in the heads' own
dtype.  RoPE then reads those stored values back (:func:`.numba.codec.load`), rotates
each pair in the compute type (``a*c - b*s``, ``b*c + a*s``: no fused multiply-add,
Numba compiles without ``contract``) and stores them rounded once, in the
reference's (:func:`polynorm.backends.reference.rope_rotate`) operations and order.

Tokens run in ranges under ``prange``; a token's bits depend only on its own
values, its position's cache row and the options (batch invariance).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from polynorm.backends.numba.codec import load, store
from polynorm.backends.numba.kernels import (
    _bits_rows,
    _fwd_norm_row_llama,
    _jit,
    _plain_rows,
    _range_bounds,
    _range_count,
)


@_jit()
def _rope_token(a, h0, h1, cs, t, neox):
    """RoPE of heads ``[h0, h1)`` of token ``t`` (``a``: its heads) in place."""
    rot = cs.shape[1]
    half = rot // 2
    for h in range(h0, h1):
        for i in range(half):
            c = cs[t, i]
            s = cs[t, half + i]
            if neox:
                j0, j1 = i, i + half
            else:
                j0, j1 = 2 * i, 2 * i + 1
            x1 = load(a[h, j0])
            x2 = load(a[h, j1])
            store(a, (h, j0), x1 * c - x2 * s)
            store(a, (h, j1), x2 * c + x1 * s)


@_jit()
def qk_rows(lo, hi, x, h0, h1, w, rstd, flags, k, eps, offset, cs, neox):
    """Tokens ``[lo, hi)``: norm of each head row (fp32 casting; float32/float64 rows:
    the plain forward's two passes per row), then RoPE where ``cs`` has columns
    (``(T, rot)`` rows ``[cos | sin]``; ``(0, 0)`` without)."""
    for t in range(lo, hi):
        a = x[t]
        _plain_rows(h0, h1, a, w, None, a, rstd, flags, k, eps, offset)
        if cs.shape[1] > 0:
            _rope_token(a, h0, h1, cs, t, neox)


@_jit()
def qk_bits_rows(lo, hi, x, h0, h1, w, rstd, flags, k, eps, offset, cs, neox):
    """:func:`qk_rows` for 16-bit rows: the forward's pipeline over a token's heads (the
    next head's sum taken during this head's output pass, its block output)."""
    for t in range(lo, hi):
        a = x[t]
        _bits_rows(h0, h1, a, w, None, a, rstd, flags, k, eps, offset)
        if cs.shape[1] > 0:
            _rope_token(a, h0, h1, cs, t, neox)


@_jit(parallel=True)
def qk_bits_parallel(x, h0, h1, w, rstd, flags, k, eps, offset, cs, neox):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        own = np.empty_like(rstd)
        qk_bits_rows(lo, hi, x, h0, h1, w, own, flags, k, eps, offset, cs, neox)


@_jit()
def qk_llama_rows(lo, hi, x, h0, h1, w, rstd, flags, k, eps, offset, cs, neox):
    """:func:`qk_rows` in llama casting."""
    for t in range(lo, hi):
        a = x[t]
        for h in range(h0, h1):
            _fwd_norm_row_llama(h, a, w, None, a, rstd, flags, k, eps, offset)
        if cs.shape[1] > 0:
            _rope_token(a, h0, h1, cs, t, neox)


@_jit(parallel=True)
def qk_parallel(x, h0, h1, w, rstd, flags, k, eps, offset, cs, neox):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        own = np.empty_like(rstd)  # one rstd scratch row per task
        qk_rows(lo, hi, x, h0, h1, w, own, flags, k, eps, offset, cs, neox)


@_jit(parallel=True)
def qk_llama_parallel(x, h0, h1, w, rstd, flags, k, eps, offset, cs, neox):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        own = np.empty_like(rstd)
        qk_llama_rows(lo, hi, x, h0, h1, w, own, flags, k, eps, offset, cs, neox)
