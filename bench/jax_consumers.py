"""polynorm's two jitted forward paths against the jnp formula, by what consumes ``y``.

Under ``jax.jit`` on one CPU device the kernels compute ``rstd`` and XLA the elementwise
pass (``statistic``; from 32 MiB its ``y`` on huge pages: ``polynorm.jax.norm._on_huge_pages``),
or the whole kernel call writes ``y`` (``whole``, huge pages asked for: what calls with a bias
take); ``default`` is what ``polynorm.jax.rms_norm`` picks (the statistic, but the whole call
for bfloat16 from 32 MiB: ``polynorm.jax.norm._xla_elementwise``).  Which is faster depends on
what reads ``y``, which a trace cannot see.  Per step of a jitted ``fori_loop``
(d = 4096, float32 unless ``--dtype``), microseconds, medians of 9 shuffled rounds:

- ``call``: a jitted call of the norm alone (``y`` is the program's output);
- ``add``: ``h = h + 0.5 * norm(h)`` (XLA fuses the formula's pass into the add);
- ``barrier``: the same with ``y`` behind ``lax.optimization_barrier``;
- ``matmul``: ``h = h + (norm(h) @ a) @ c`` (a transformer's norm feeds a projection).

    python bench/jax_consumers.py [TOKENS ...] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import random
import statistics
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
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * r * w.astype(jnp.float32)).astype(x.dtype)


def default(x, w):
    return pj.rms_norm(x, w)


def statistic(x, w):
    """The statistic path at every size."""
    keep = jn.BF16_KERNEL_PASS_MIN_BYTES
    jn.BF16_KERNEL_PASS_MIN_BYTES = 1 << 62
    try:
        return pj.rms_norm(x, w)
    finally:
        jn.BF16_KERNEL_PASS_MIN_BYTES = keep


def whole(x, w):
    """The whole kernel call: the statistic path switched off at trace time."""
    keep = jn._xla_elementwise
    jn._xla_elementwise = lambda plan, bias, size: False
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


def main(tokens, dtype="float32") -> None:
    paths = (("naive", naive), ("default", default), ("statistic", statistic), ("whole", whole))
    variants = {(name, k): f for name, norm in paths for k, f in consumers(norm).items()}
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((D, 16), np.float32) * 1e-3, dtype)
    c = jnp.asarray(rng.standard_normal((16, D), np.float32) * 1e-3, dtype)
    w = jnp.ones(D, dtype)
    for n in tokens:
        x = jnp.asarray(rng.standard_normal((n, D), np.float32), dtype)
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
            cells.append(f"{consumer}: naive {base:.0f} us, " + ", ".join(
                f"{v} {base / med[(v, consumer)]:.2f}x" for v in ("default", "statistic", "whole")))
        print(n, " | ".join(cells), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("tokens", type=int, nargs="*", default=[256, 2048, 4096])
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    main(args.tokens, args.dtype)
