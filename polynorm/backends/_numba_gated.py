"""Numba kernels of gated RMSNorm (:class:`polynorm._options.GatedPlan`).

Rows arrive in the compute dtype (float32 or float64, converted by the
caller), C-contiguous; the kernels run ``prange`` over tokens and each row
is computed by the same serial code whatever the thread count or the other
rows (batch invariance).  The sum of squares is accumulated in float64, in
index order.  ``dweight``/``dbias`` leave the kernel as per-row leaves and
are summed over the row tree of :mod:`._rowtree` by :func:`tree_sum`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._numba_kernels import _jit
from ._rowtree import TREE_G


def _forward(x, z, w, b, y, rstd, has_w, has_b, eps, eps_inside, offset, one, gs, k, nbg):
    n, d = x.shape
    groups = d // gs
    for i in prange(n):
        for g in range(groups):
            lo = g * gs
            ss = 0.0
            if nbg:
                for j in range(lo, lo + k):
                    v = x[i, j]
                    ss += np.float64(v) * np.float64(v)
            else:
                # the gated value is parked in y: the output pass reads it
                # back instead of computing the exp a second time
                for j in range(lo, lo + k):
                    zj = z[i, j]
                    v = x[i, j] * (zj / (one + math.exp(-zj)))
                    y[i, j] = v
                    ss += np.float64(v) * np.float64(v)
            ms = ss / k
            r = 1.0 / math.sqrt(ms + eps) if eps_inside else 1.0 / (math.sqrt(ms) + eps)
            rstd[i, g] = r
            rc = rstd[i, g]  # rounded to the compute dtype, as the reference's rstd
            for j in range(lo, lo + gs):
                if nbg:
                    zj = z[i, j]
                    s = zj / (one + math.exp(-zj))
                    v = x[i, j]
                elif j - lo < k:
                    s = one
                    v = y[i, j]
                else:
                    zj = z[i, j]
                    s = one
                    v = x[i, j] * (zj / (one + math.exp(-zj)))
                t = v * rc
                if has_w:
                    t = t * (w[j] + offset)
                if has_b:
                    t = t + b[j]
                if nbg:
                    t = t * s
                y[i, j] = t


def _backward(dy, x, z, w, b, rstd, dx, dz, lw, lb, has_w, has_b, has_rstd,
              eps, eps_inside, offset, one, gs, k, nbg):
    n, d = x.shape
    groups = d // gs
    for i in prange(n):
        for g in range(groups):
            lo = g * gs
            ss = 0.0
            for j in range(lo, lo + k):
                zj = z[i, j]
                v = x[i, j] if nbg else x[i, j] * (zj / (one + math.exp(-zj)))
                ss += np.float64(v) * np.float64(v)
            ms = ss / k
            sq = math.sqrt(ms)
            # dx[i, lo] is scratch until the last loop writes it: it rounds
            # float64 scalars to the compute dtype
            if has_rstd:
                rc = rstd[i, g]
            else:
                dx[i, lo] = 1.0 / math.sqrt(ms + eps) if eps_inside else 1.0 / (sq + eps)
                rc = dx[i, lo]
            zero = one - one
            c = zero
            for j in range(lo, lo + gs):
                zj = z[i, j]
                s = zj / (one + math.exp(-zj))
                v = x[i, j] if nbg else x[i, j] * s
                dn = dy[i, j] * s if nbg else dy[i, j]
                gdy = dn * (w[j] + offset) if has_w else dn
                c += gdy * (v * rc)
            dx[i, lo] = c / k
            if not eps_inside:
                dx[i, lo] = dx[i, lo] * ((sq + eps) / sq) if sq != 0 else dx[i, lo] * zero
            coef = dx[i, lo]
            for j in range(lo, lo + gs):
                zj = z[i, j]
                sig = one / (one + math.exp(-zj))
                s = zj * sig
                ds = sig * (one + zj * (one - sig))
                v = x[i, j] if nbg else x[i, j] * s
                xh = v * rc
                dn = dy[i, j] * s if nbg else dy[i, j]
                gdy = dn * (w[j] + offset) if has_w else dn
                m = coef if j - lo < k else coef * zero
                dv = rc * (gdy - xh * m)
                if nbg:
                    dx[i, j] = dv
                    pre = xh * (w[j] + offset) if has_w else xh
                    if has_b:
                        pre = pre + b[j]
                    dz[i, j] = dy[i, j] * pre * ds
                else:
                    dx[i, j] = dv * s
                    dz[i, j] = dv * x[i, j] * ds
                lw[i, j] = dn * xh
                if has_b:
                    lb[i, j] = dn


# one thread (small calls, and a child forked after an OpenMP launch) and
# prange over tokens: the same row code, so the same bits
forward_serial = _jit()(_forward)
forward_parallel = _jit(parallel=True)(_forward)
backward_serial = _jit()(_backward)
backward_parallel = _jit(parallel=True)(_backward)


def tree_sum(leaves: np.ndarray) -> np.ndarray:
    """Sum of ``leaves`` (rows, d) over rows in :mod:`._rowtree`'s order: pairs
    of adjacent nodes level by level, a lone last node carried up; adds below
    level ``TREE_G`` in the leaves' dtype, from it up in float64."""
    cur = leaves
    level = 1
    while cur.shape[0] > 1:
        m = cur.shape[0]
        if level == TREE_G:
            cur = cur.astype(np.float64)
        pairs = cur[0:m - 1:2] + cur[1:m:2]
        cur = np.concatenate([pairs, cur[m - 1:]]) if m % 2 else pairs
        level += 1
    return cur[0].astype(np.float64)
