"""Where the row-statistic XLA handlers should start splitting rows over XLA's pool,
and in how many chunks.

Compiles :func:`polynorm.backends.numba.xla.rstd_handler` once per candidate (the
threshold ``STAT_POOL_MIN_ELEMENTS``: 64 Ki, 256 Ki, 1 Mi elements, never; and at 256 Ki,
the chunks in shares, one a thread, or in one sequence for all threads,
``xla._MAX_SHARES`` 64 and 1: ``shares``, ``one_seq``) and times, paired and interleaved,
float32 rows of d = 4096 under ``jax.jit``: ``x * rstd * w`` with the rstd from each
handler against the jnp formula, as a jitted call and per step of a jitted
``fori_loop`` of ``h = h + 0.5 * norm(h, w)`` (``g_`` columns: there each step's ``h`` is
the output of XLA's loop fusion, partitioned over its pool, of the step before).
Microseconds, medians of the rounds.

    python bench/jax_stat_pool.py [TOKENS ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from polynorm.backends.numba import xla

D = 4096
#: name: (STAT_POOL_MIN_ELEMENTS, _MAX_SHARES)
THRESHOLDS = {"p64k": (1 << 16, 64), "p256k_shares": (1 << 18, 64), "p256k_one_seq": (1 << 18, 1),
              "p1m": (1 << 20, 64), "never": (1 << 62, 64)}


def _register() -> None:
    for name, (elements, shares) in THRESHOLDS.items():
        xla.STAT_POOL_MIN_ELEMENTS = elements
        xla._MAX_SHARES = shares
        xla.rstd_handler.cache_clear()
        address = xla.rstd_handler("float32", "float32")
        jax.ffi.register_ffi_target("bench_rstd_" + name, jax.ffi.pycapsule(address),
                                    platform="cpu")


def _norm(name):
    def norm(x, w):
        call = jax.ffi.ffi_call("bench_rstd_" + name, jax.ShapeDtypeStruct(x.shape[:-1], x.dtype),
                                vmap_method="expand_dims")
        r = call(x, a_flags=np.int64(1), b_k=np.int64(D), c_eps=np.float64(1e-6))
        return x * r[:, None] * w
    return norm


def naive(x, w, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _graph(norm):
    return jax.jit(lambda x, w: jax.lax.fori_loop(0, 16, lambda i, h: h + 0.5 * norm(h, w), x))


def main(tokens) -> None:
    _register()
    norms = {"naive": naive, **{n: _norm(n) for n in THRESHOLDS}}
    variants = {**{k: jax.jit(f) for k, f in norms.items()},
                **{"g_" + k: _graph(f) for k, f in norms.items()}}
    for n in tokens:
        x = jnp.asarray(np.random.default_rng(0).standard_normal((n, D), dtype=np.float32))
        w = jnp.ones(D, jnp.float32)
        reps = max(3, int(1e5 // (n * D // 64 + 50)))
        for f in variants.values():
            jax.block_until_ready(f(x, w))
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(11):
            for k, f in variants.items():
                t = time.perf_counter()
                for _ in range(reps):
                    o = f(x, w)
                jax.block_until_ready(o)
                times[k].append((time.perf_counter() - t) / reps * 1e6
                                / (16 if k.startswith("g_") else 1))
        print(n, " ".join(f"{k}={statistics.median(v):.1f}" for k, v in times.items()),
              flush=True)


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [16, 32, 64, 128, 256])
