"""polynorm's two jitted float32 forward paths against the jnp formula, by what consumes ``y``.

Under ``jax.jit`` on one CPU device the default computes ``rstd`` in the kernels and leaves
the elementwise pass to XLA (``statistic``); the whole kernel call (``whole``: the Numba
forward writes ``y``, huge pages asked for) is what calls with a bias take.  Which is faster
depends on what reads ``y``, which a trace cannot see.  Per step of a jitted ``fori_loop``
(d = 4096, float32), microseconds, medians of 9 shuffled rounds:

- ``call``: a jitted call of the norm alone (``y`` is the program's output);
- ``add``: ``h = h + 0.5 * norm(h)`` (XLA fuses the formula's pass into the add);
- ``barrier``: the same with ``y`` behind ``lax.optimization_barrier``;
- ``matmul``: ``h = h + (norm(h) @ a) @ c`` (a transformer's norm feeds a projection).

    python bench/jax_consumers.py [TOKENS ...]
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import polynorm.jax as pj
from polynorm.jax import norm as jn

D = 4096
STEPS = 16
ROUNDS = 9


def naive(x, w, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def statistic(x, w):
    return pj.rms_norm(x, w)


def whole(x, w):
    """The whole kernel call: the default with its statistic path switched off at trace time."""
    keep = jn._xla_elementwise
    jn._xla_elementwise = lambda plan, bias: False
    try:
        return pj.rms_norm(x, w)
    finally:
        jn._xla_elementwise = keep


def _loop(step):
    return jax.jit(lambda x, w, a, c: jax.lax.fori_loop(0, STEPS, lambda i, h: step(h, w, a, c), x))


def consumers(norm):
    return {
        "call": jax.jit(lambda x, w, a, c: norm(x, w)),
        "add": _loop(lambda h, w, a, c: h + 0.5 * norm(h, w)),
        "barrier": _loop(lambda h, w, a, c: h + 0.5 * jax.lax.optimization_barrier(norm(h, w))),
        "matmul": _loop(lambda h, w, a, c: h + (norm(h, w) @ a) @ c),
    }


def main(tokens) -> None:
    variants = {(name, k): f for name, norm in (("naive", naive), ("statistic", statistic),
                                                ("whole", whole))
                for k, f in consumers(norm).items()}
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((D, 16), np.float32)) * 1e-3
    c = jnp.asarray(rng.standard_normal((16, D), np.float32)) * 1e-3
    w = jnp.ones(D, jnp.float32)
    for n in tokens:
        x = jnp.asarray(rng.standard_normal((n, D), np.float32))
        for f in variants.values():
            jax.block_until_ready(f(x, w, a, c))
        times: dict = {k: [] for k in variants}
        order = list(variants)
        for r in range(ROUNDS):
            random.Random(r).shuffle(order)
            for k in order:
                calls, steps = (20, 1) if k[1] == "call" else (3, STEPS)
                t = time.perf_counter()
                for _ in range(calls):
                    o = variants[k](x, w, a, c)
                jax.block_until_ready(o)
                times[k].append((time.perf_counter() - t) / calls / steps * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = []
        for consumer in ("call", "add", "barrier", "matmul"):
            base = med[("naive", consumer)]
            cells.append(f"{consumer}: naive {base:.0f} us, statistic "
                         f"{base / med[('statistic', consumer)]:.2f}x, whole "
                         f"{base / med[('whole', consumer)]:.2f}x")
        print(n, " | ".join(cells), flush=True)


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [256, 2048, 4096])
