"""polynorm under ``jax.jit`` and on eager jax arrays vs the naive jnp formula jitted.

Three settings, each paired (every round runs each variant once, interleaved, in a
shuffled order; medians over rounds; ratios are ``jnp time / variant time``, above 1: the
variant is faster; ``*_iqr``: the quartiles of the rounds' own ratios; ``eager_extra_us``:
an eager call's microseconds over the jitted formula's, the median of the rounds'
differences):

- ``us``: a jitted function of the norm alone, called back to back (the next call's
  dispatch overlaps the last one's computation where XLA runs it asynchronously);
- ``block_us``: the same calls, each waited for before the next (a decode loop that
  uses each result: no overlap, and where XLA runs the call on its pool, the handoff
  to a pool thread and back);
- ``graph_us``: the norm inside a jitted program, per step of a ``fori_loop`` of
  ``h = h + 0.5 * norm(h, w)`` (a residual stream), one call per round trip: what a norm
  costs in a jitted model, where XLA fuses the jnp formula with its neighbours and a
  custom call's output takes a pass of its own;
- ``grad_us``: a jitted ``jax.vjp`` of the norm alone, forward and backward (the
  cotangent is ``x``), returning ``(dx, dweight)``: a training step's norm; each call
  waits for the last, as a step's gradients are used before the next step starts
  (back-to-back independent calls would overlap on XLA's threads, which no training
  loop does).

    python bench/jax_jit.py [--rounds N] [--tokens 1 8 2048] [--json PATH]

On a process with one CPU device, ``jit_default`` and ``jit_numba`` are the compiled
kernel call (polynorm.backends.numba.xla) and ``jit_array_api`` the reference that the
default ran before it; ``eager_pj_front`` / ``eager_pj_jitted`` are an eager call's two
routes forced (the front end on numpy views / the jitted kernel call), which
``polynorm.jax.norm.EAGER_JIT_MAX_BYTES`` chooses between.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import polynorm as pn
import polynorm.jax as pj

D = 4096
TOKENS = (1, 2, 4, 8, 16, 64, 256, 2048, 4096)


def naive(x, w, eps=1e-6):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * r * w.astype(jnp.float32)).astype(x.dtype)


def variants():
    return {
        "jnp_naive_jit": jax.jit(naive),
        "jit_default": jax.jit(lambda x, w: pj.rms_norm(x, w)),
        "jit_numba": jax.jit(lambda x, w: pj.rms_norm(x, w, backend="numba")),
        "jit_array_api": jax.jit(lambda x, w: pj.rms_norm(x, w, backend="array_api")),
        "eager_pn": lambda x, w: pn.rms_norm(x, w),
        "eager_pj": lambda x, w: pj.rms_norm(x, w),
        **_forced(),
    }


def _forced():
    """The two eager routes of polynorm.jax.rms_norm, where this polynorm has them."""
    try:
        from polynorm.core.options import pack_options
        from polynorm.jax import norm as jn
        from polynorm.ops import norm as api

        jn._kernel_y  # noqa: B018 - absent before the jitted kernel call
    except (ImportError, AttributeError):
        return {}
    opts = pack_options("rms_norm", {})
    jitted = jax.jit(lambda x, w: jn._kernel_y(jn._static(opts), x, w, None))
    # return_rstd: a call the jitted route leaves to the front end (y and rstd back to jax)
    return {"eager_pj_front": lambda x, w: api.forward(x, None, w, None, opts,
                                                       return_rstd=True)[0],
            "eager_pj_jitted": jitted}


#: steps of the program of the ``graph`` setting
GRAPH_STEPS = 16

#: a ``graph`` sample runs the program once per this many calls of a ``us`` sample
GRAPH_PROGRAMS_PER_CALLS = 4

#: the eager calls, whose ``eager_extra_us`` is their time over the jitted jnp formula's
#: (the median of the rounds' differences)
EAGER_VARIANTS = ("eager_pn", "eager_pj")

#: the variants that run inside a program too (the others are eager calls)
GRAPH_VARIANTS = ("jnp_naive_jit", "jit_default", "jit_numba", "jit_array_api")


def _graph(norm):
    """A jitted residual stream of GRAPH_STEPS norms of ``norm`` (the untransformed
    variant: ``naive`` or a lambda over ``pj.rms_norm``)."""
    return jax.jit(lambda x, w: jax.lax.fori_loop(
        0, GRAPH_STEPS, lambda i, h: h + (0.5 * norm(h, w)).astype(h.dtype), x))


def graph_variants():
    return {"jnp_naive_jit": _graph(naive),
            "jit_default": _graph(lambda x, w: pj.rms_norm(x, w)),
            "jit_numba": _graph(lambda x, w: pj.rms_norm(x, w, backend="numba")),
            "jit_array_api": _graph(lambda x, w: pj.rms_norm(x, w, backend="array_api"))}


def _grad(norm):
    """A jitted forward and backward of ``norm``: ``(dx, dweight)`` for the cotangent ``x``."""
    return jax.jit(lambda x, w: jax.vjp(norm, x, w)[1](x))


def grad_variants():
    return {"jnp_naive_jit": _grad(naive),
            "jit_default": _grad(lambda x, w: pj.rms_norm(x, w)),
            "jit_numba": _grad(lambda x, w: pj.rms_norm(x, w, backend="numba")),
            "jit_array_api": _grad(lambda x, w: pj.rms_norm(x, w, backend="array_api"))}


def _time_graph(f, x, w, reps):
    t = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(f(x, w))
    return (time.perf_counter() - t) / (reps * GRAPH_STEPS)


def _time_steps(f, x, w, reps):
    t = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(f(x, w))
    return (time.perf_counter() - t) / reps


def _time(f, x, w, reps):
    t = time.perf_counter()
    for _ in range(reps):
        y = f(x, w)
    jax.block_until_ready(y)
    return (time.perf_counter() - t) / reps


def _quartiles(base: list[float], times: list[float]) -> list[float]:
    """The first and third quartiles of the per-round ratios ``base / time``: a round
    times every variant once, back to back, so its ratio sees one machine state; the
    spread says how far a median ratio near 1 is from parity."""
    ratios = sorted(b / t for b, t in zip(base, times, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return [round(q[0], 3), round(q[2], 3)]


def run(rounds: int, tokens=TOKENS, dtypes=("float32", "bfloat16"), only=None):
    fns = variants()
    gfns = graph_variants()
    dfns = grad_variants()
    if only:
        fns = {k: f for k, f in fns.items() if k == "jnp_naive_jit" or k in only}
        gfns = {k: f for k, f in gfns.items() if k == "jnp_naive_jit" or k in only}
        dfns = {k: f for k, f in dfns.items() if k == "jnp_naive_jit" or k in only}
    rows = []
    for dtype in dtypes:
        for n in tokens:
            rng = np.random.default_rng(0)
            x = jnp.asarray(rng.standard_normal((n, D), np.float32), dtype)
            w = jnp.asarray(rng.standard_normal(D, np.float32), dtype)
            reps = max(1, min(200, 20000 // n))
            # at decode sizes a step takes 2-12 us: one program per GRAPH_STEPS calls would
            # make samples of 0.4 ms, too short to time steadily
            greps = max(1, reps // GRAPH_PROGRAMS_PER_CALLS)
            for f in (*fns.values(), *gfns.values(), *dfns.values()):  # compile and warm
                jax.block_until_ready(f(x, w))
            times = {k: [] for k in fns}
            btimes = {k: [] for k in fns}
            gtimes = {k: [] for k in gfns}
            dtimes = {k: [] for k in dfns}
            order = [(k, f, times, _time, reps) for k, f in fns.items()]
            order += [(k, f, btimes, _time_steps, max(1, reps // 2)) for k, f in fns.items()]
            order += [(k, f, gtimes, _time_graph, greps) for k, f in gfns.items()]
            order += [(k, f, dtimes, _time_steps, max(1, reps // 2)) for k, f in dfns.items()]
            for i in range(rounds):
                random.Random(i).shuffle(order)  # no variant always first (or after another)
                for k, f, into, timer, r in order:
                    into[k].append(timer(f, x, w, r))
            row = {"dtype": str(dtype), "tokens": n, "d": D}
            for us, speed, ts in (("us", "speed_vs_jnp", times),
                                  ("block_us", "block_speed_vs_jnp", btimes),
                                  ("graph_us", "graph_speed_vs_jnp", gtimes),
                                  ("grad_us", "grad_speed_vs_jnp", dtimes)):
                med = {k: statistics.median(v) for k, v in ts.items()}
                base = med["jnp_naive_jit"]
                row[us] = {k: round(v * 1e6, 2) for k, v in med.items()}
                row[speed] = {k: round(base / v, 3) for k, v in med.items()}
                row[speed + "_iqr"] = {k: _quartiles(ts["jnp_naive_jit"], v) for k, v in ts.items()
                                       if k != "jnp_naive_jit"}
            # the bar for eager calls: a jitted jnp call plus a few microseconds
            row["eager_extra_us"] = {
                k: round(1e6 * statistics.median(
                    e - b for e, b in zip(times[k], times["jnp_naive_jit"], strict=True)), 2)
                for k in EAGER_VARIANTS if k in times}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--only", nargs="+", help="these variants (and the jnp formula) only")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = run(a.rounds, tuple(a.tokens), tuple(a.dtypes), a.only)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"machine": platform.node(), "jax": jax.__version__, "rows": rows}, fh,
                      indent=1)
