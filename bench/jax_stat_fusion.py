"""What XLA makes of the jitted reference's statistic: one call, or parts and a small program.

Per step of a jitted ``fori_loop`` of ``h = h + 0.5 * norm(h, w)`` (float32, d = 4096),
the norm as:

- ``naive``: the jnp formula;
- ``default`` / ``reference``: ``polynorm.jax.rms_norm`` (``backend="array_api"`` for the
  reference, whose ``rstd`` is one compiled call: ``ROW_RSTD``);
- ``rstd_call``: the kernels' rstd handler, then XLA's ``h * r * w``;
- ``parts_plain``: the reference's row statistics (three outputs), ``1 / (sqrt(ss / k) +
  eps)`` in XLA, then ``h * r * w``;
- ``parts_chain``: the same statistics with the reference's own selection and hypot-style
  eps in XLA: the reference before ``ROW_RSTD``.

Microseconds a step, medians of interleaved shuffled rounds; then, for each program, the
small fusions XLA splits over its pool (``outer_dimension_partitions``).

    python bench/jax_stat_fusion.py [TOKENS] [ROUNDS]
"""

from __future__ import annotations

import random
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import polynorm.jax as pj
from polynorm.jax import ffi
from polynorm.jax.norm import _on_huge_pages

D = 4096
EPS = 1e-6
STEPS = 16


def variants(n: int) -> dict:
    ffi.available()
    rows = jax.ShapeDtypeStruct((n,), jnp.float32)
    rstd = jax.ffi.ffi_call(ffi.compiled_rstd_target("float32", "float32"), rows)
    parts = jax.ffi.ffi_call(ffi.compiled_row_stats_target("float32"), (rows,) * 3)
    floor = D * float(np.finfo(np.float32).smallest_normal / np.finfo(np.float32).eps)

    def y_of(h, r, w):
        return _on_huge_pages(h * r[:, None] * w)

    def chain(ss, m, ss2):  # the reference's _rms and _rstd_from_rms, eps inside
        ok = (ss >= floor) & (ss <= float(np.finfo(np.float32).max))
        rms = jnp.where(ok, jnp.sqrt(ss / D), jnp.where(m == jnp.inf, m, m * jnp.sqrt(ss2 / D)))
        se = np.float32(np.sqrt(EPS))
        a, b = jnp.where(rms > se, rms, se), jnp.where(rms > se, se, rms)
        q = b / jnp.where(a == 0, 1.0, a)
        return 1 / (a * jnp.sqrt(1 + q * q))

    def naive(h, w):
        return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + EPS) * w

    return {
        "naive": naive,
        "default": lambda h, w: pj.rms_norm(h, w),
        "reference": lambda h, w: pj.rms_norm(h, w, backend="array_api"),
        "rstd_call": lambda h, w: y_of(h, rstd(h, a_flags=np.int64(8), b_k=np.int64(D),
                                                c_eps=np.float64(EPS)), w),
        "parts_plain": lambda h, w: y_of(
            h, 1 / (jnp.sqrt(parts(h, a_floor=np.float64(floor))[0] / D) + EPS), w),
        "parts_chain": lambda h, w: y_of(h, chain(*parts(h, a_floor=np.float64(floor))), w),
    }


def main(n: int, rounds: int) -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, D), np.float32))
    w = jnp.asarray(rng.standard_normal(D, np.float32))
    progs = {k: jax.jit(lambda x, w, f=f: jax.lax.fori_loop(
        0, STEPS, lambda i, h: h + 0.5 * f(h, w), x)) for k, f in variants(n).items()}
    for f in progs.values():
        jax.block_until_ready(f(x, w))
    reps = max(1, 5000 // n)
    times: dict[str, list[float]] = {k: [] for k in progs}
    order = list(progs.items())
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for k, f in order:
            t = time.perf_counter()
            for _ in range(reps):
                jax.block_until_ready(f(x, w))
            times[k].append((time.perf_counter() - t) / (reps * STEPS) * 1e6)
    print(n, {k: round(statistics.median(v), 1) for k, v in times.items()})
    for k, f in progs.items():
        split = [m.group(1) for m in re.finditer(
            r"f32\[(\d+)\]\{0\} fusion\([^\n]*outer_dimension_partitions\":\[\"",
            f.lower(x, w).compile().as_text())]
        print(f"  {k}: small fusions split over the pool: {split or 'none'}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2048,
         int(sys.argv[2]) if len(sys.argv) > 2 else 9)
