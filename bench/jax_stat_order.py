"""The row order of the rstd handler's statistic: first row first against last row first.

Two rstd handlers in one process (:func:`polynorm.backends.numba.xla._row_stat_handler`
over :func:`polynorm.backends.numba.kernels.rstd_rows` called row by row, ``fwd`` and
``rev``) against the jnp formula, float32 rows of d = 4096 under ``jax.jit``:
``x * rstd * w`` as a jitted call and per step of a jitted ``fori_loop`` of
``h = h + 0.5 * norm(h, w)`` (``g_`` columns).  Microseconds, medians of 15 shuffled
rounds; ``a/b``: the median and quartiles of the rounds' own ratios.

    python bench/jax_stat_order.py [TOKENS ...]
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from numba import carray, njit

from polynorm.backends import numba as nbk
from polynorm.backends.numba import xla

D = 4096
#: steps of the ``g_`` programs
STEPS = 16
ROUNDS = 15
_ROWS = nbk._k().rstd_rows
_F32 = np.dtype(np.float32)


@njit(nogil=True)
def _stat_fwd(lo, hi, xd, rd, n, d, flags, kk, eps):
    x, r = carray(xla._pointer(xd), (n, d), _F32), carray(xla._pointer(rd), (n,), _F32)
    for i in range(lo, hi):
        _ROWS(i, i + 1, x, r, flags, kk, eps)


@njit(nogil=True)
def _stat_rev(lo, hi, xd, rd, n, d, flags, kk, eps):
    x, r = carray(xla._pointer(xd), (n, d), _F32), carray(xla._pointer(rd), (n,), _F32)
    for i in range(hi - 1, lo - 1, -1):
        _ROWS(i, i + 1, x, r, flags, kk, eps)


def _register() -> None:
    for name, stat in (("fwd", _stat_fwd), ("rev", _stat_rev)):
        address = xla._row_stat_handler(stat, True, ("bench_order", name))
        jax.ffi.register_ffi_target("bench_order_" + name, jax.ffi.pycapsule(address),
                                    platform="cpu")


def _norm(name):
    def norm(x, w):
        call = jax.ffi.ffi_call("bench_order_" + name, jax.ShapeDtypeStruct(x.shape[:-1], x.dtype))
        r = call(x, a_flags=np.int64(1), b_k=np.int64(D), c_eps=np.float64(1e-6))
        return x * r[:, None] * w
    return norm


def naive(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w


def _graph(norm):
    return jax.jit(lambda x, w: jax.lax.fori_loop(0, STEPS, lambda i, h: h + 0.5 * norm(h, w), x))


def _ratio(times, a: str, b: str) -> tuple[float, float, float]:
    """The median and quartiles of the rounds' ratios ``a / b``."""
    rs = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
    q = statistics.quantiles(rs, n=4)
    return round(statistics.median(rs), 3), round(q[0], 3), round(q[2], 3)


def main(tokens) -> None:
    _register()
    norms = {"naive": naive, "fwd": _norm("fwd"), "rev": _norm("rev")}
    variants = {**{k: jax.jit(f) for k, f in norms.items()},
                **{"g_" + k: _graph(f) for k, f in norms.items()}}
    for n in tokens:
        x = jnp.asarray(np.random.default_rng(0).standard_normal((n, D), np.float32))
        w = jnp.ones(D, jnp.float32)
        reps = max(3, int(4e5 // (n * D // 64 + 50)))
        for f in variants.values():
            jax.block_until_ready(f(x, w))
        times: dict[str, list[float]] = {k: [] for k in variants}
        order = list(variants)
        for r in range(ROUNDS):
            random.Random(r).shuffle(order)
            for k in order:
                steps = STEPS if k.startswith("g_") else 1
                calls = max(1, reps // steps)
                t = time.perf_counter()
                for _ in range(calls):
                    o = variants[k](x, w)
                jax.block_until_ready(o)
                times[k].append((time.perf_counter() - t) / calls / steps * 1e6)
        print(n, {k: round(statistics.median(v), 1) for k, v in times.items()},
              "naive/fwd", _ratio(times, "naive", "fwd"), "naive/rev", _ratio(times, "naive", "rev"),
              "g_naive/g_fwd", _ratio(times, "g_naive", "g_fwd"),
              "g_naive/g_rev", _ratio(times, "g_naive", "g_rev"), flush=True)


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [256, 1024, 2048])
