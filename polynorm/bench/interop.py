"""Interop benchmark: torch tensors, the torch module, and dask on a cluster.

Five measurements, each a :class:`~polynorm.bench.common.Record` of suite
``"interop"``:

``dispatch`` (1 x 4096 float32 torch CPU tensor)
    ``pn.rms_norm(x, w)`` end to end against torch's own ``F.rms_norm`` on
    the same tensor; ratio ``torch`` = torch's time / polynorm's (target:
    >= 1, not slower).  ``extra`` has the same call on the numpy view.
``fwd`` (16384 x 4096 torch CPU tensor; 2048 x 4096 with ``quick``)
    ``pn.rms_norm`` on the tensor against the parallel copy roof (ratio
    ``copy``) and against the same call on the numpy array holding the same
    data (ratio ``numpy_input`` = numpy-input time / tensor time; target:
    >= 0.95, i.e. the tensor reaches the kernel's bandwidth within 5%).
``module`` (4096 x 4096; 512 x 4096 with ``quick``)
    ``polynorm.torch.RMSNorm`` forward + backward (``torch.autograd.grad``
    of x and weight) against ``torch.nn.RMSNorm`` on CPU; ratio ``torch``
    (target >= 5).
``dask`` (16384 x 4096 float32 in 8 row chunks; 2048 x 4096 with ``quick``)
    ``pn.rms_norm`` on a dask array persisted on a ``LocalCluster`` of two
    single-threaded worker processes (Numba single-threaded in each), timed to the result being held on the
    workers (``persist`` + ``wait``, nothing gathered), against the in-memory
    kernel on the same data; ratio ``in_memory`` = in-memory time / cluster
    time (< 1: the cluster is slower; on one small machine it shares the
    same cores and adds scheduling), and ratio ``cluster_copy`` = the time of
    a per-chunk copy on the same cluster / polynorm's (the cluster's roof).
``jit`` (1 x 4096 and 16384 x 4096 float32; 2048 x 4096 with ``quick``)
    ``polynorm.jax.rms_norm`` under ``jax.jit`` against a jitted jnp RMSNorm,
    for ``backend="auto"`` (the reference, compiled by XLA) and ``"numba"``
    (the kernels in an XLA FFI call); ratio ``jnp`` = jnp's time / polynorm's.

Run ``python bench/interop.py`` (``--quick`` stays under a minute); wrap it
in ``flock /tmp/polynorm-bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from polynorm.bench.common import (
    Record,
    format_table,
    gbps,
    median_time,
    paired_median,
    stderr_progress,
    write_json,
)

DTYPES = ("float32", "bfloat16")
EPS = 1e-6
Progress = Callable[[int, int, str], None]


def available() -> tuple[bool, str]:
    """Needs the Numba backend (the kernel measured) and torch or dask.distributed."""
    import importlib.util

    import polynorm as pn

    ok, why = pn.backends()["numba"]
    if not ok:
        return False, f"numba backend unusable: {why}"
    if not any(importlib.util.find_spec(m) for m in ("torch", "distributed")):
        return False, "neither torch nor dask.distributed is installed"
    return True, "ok"


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _tensor(rng, shape, dtype: str):
    import torch

    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(_torch_dtype(dtype))


def dispatch(min_time: float) -> Record:
    """(1, 4096) float32: end-to-end call on a torch tensor vs ``F.rms_norm``."""
    import torch
    import torch.nn.functional as F

    import polynorm as pn
    from polynorm.core import interop as _interop

    rng = np.random.default_rng(0)
    x, w = _tensor(rng, (1, 4096), "float32"), 1 + 0.1 * _tensor(rng, (4096,), "float32")
    xn, wn = _interop.to_numpy(x), _interop.to_numpy(w)
    with torch.no_grad():
        t, tt = paired_median(lambda: pn.rms_norm(x, w, eps=EPS),
                             lambda: F.rms_norm(x, (4096,), w, EPS), min_time=min_time)
    tn = median_time(lambda: pn.rms_norm(xn, wn, eps=EPS), min_time=min_time)
    moved = 2 * x.numel() * 4 + w.numel() * 4
    return Record("interop", "dispatch", "torch-cpu", "float32", 1, 4096, t, moved,
                  gbps(moved, t), {"torch": tt / t},
                  {"torch_s": tt, "numpy_input_s": tn, "what": "pn.rms_norm(tensor) vs F.rms_norm"})


def bandwidth(n: int, d: int, dtype: str, min_time: float) -> Record:
    """Large torch tensor vs the same data as numpy, both against the copy roof
    (:mod:`polynorm.bench.roof`), all timed in the same rounds."""
    import polynorm as pn
    from polynorm.bench.roof import paired_roof
    from polynorm.core import interop as _interop

    rng = np.random.default_rng(1)
    x, w = _tensor(rng, (n, d), dtype), _tensor(rng, (d,), dtype)
    xn, wn = _interop.to_numpy(x), _interop.to_numpy(w)
    p = paired_roof(lambda: pn.rms_norm(x, w, eps=EPS), xn, min_time=min_time,
                    peers={"numpy": lambda: pn.rms_norm(xn, wn, eps=EPS)})
    t, tn = p.op_s, p.peers["numpy"]
    moved = 2 * xn.nbytes + wn.nbytes
    rate = gbps(moved, t)
    roof = gbps(2 * xn.nbytes, p.roof_s)
    return Record("interop", "fwd", "torch-cpu", dtype, n, d, t, moved, rate,
                  {"copy": p.speed * moved / (2 * xn.nbytes), "numpy_input": tn / t},
                  {"copy_gbps": roof, "roof_copy": p.fastest, "numpy_input_s": tn,
                   "numpy_input_copy": gbps(moved, tn) / roof})


def module(n: int, d: int, dtype: str, min_time: float) -> Record:
    """``polynorm.torch.RMSNorm`` forward + backward vs ``torch.nn.RMSNorm``."""
    import torch

    from polynorm.torch import RMSNorm

    rng = np.random.default_rng(2)
    tdt = _torch_dtype(dtype)
    x = _tensor(rng, (n, d), dtype).requires_grad_()
    dy = _tensor(rng, (n, d), dtype)
    ours = RMSNorm(d, eps=EPS, dtype=tdt)
    theirs = torch.nn.RMSNorm(d, eps=EPS, dtype=tdt)

    def step(m):
        def f():
            y = m(x)
            return torch.autograd.grad(y, (x, m.weight), dy)

        return f

    t, tt = paired_median(step(ours), step(theirs), min_time=min_time, min_repeat=3)
    itemsize = x.element_size()
    moved = 5 * n * d * itemsize  # fwd: x in, y out; bwd: x, dy in, dx out
    return Record("interop", "module", "torch-cpu", dtype, n, d, t, moved, gbps(moved, t),
                  {"torch": tt / t}, {"torch_s": tt, "what": "RMSNorm fwd+bwd vs torch.nn.RMSNorm"})


def jax_jit(n: int, d: int, backend: str, min_time: float) -> Record:
    """``polynorm.jax.rms_norm`` under ``jax.jit`` vs a jitted jnp RMSNorm (float32).

    ``backend="auto"``: the reference, compiled by XLA; ``"numba"``: the kernels
    through the XLA FFI host call.  Ratio ``jnp`` = jnp's time / polynorm's.
    """
    import jax
    import jax.numpy as jnp

    import polynorm.jax as pnj

    x = jax.random.normal(jax.random.key(0), (n, d), jnp.float32)
    w = 1 + 0.1 * jax.random.normal(jax.random.key(1), (d,), jnp.float32)

    def ref(x, w):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
        return (y * w).astype(x.dtype)

    ours = jax.jit(lambda x, w: pnj.rms_norm(x, w, eps=EPS, backend=backend))
    theirs = jax.jit(ref)
    t, tt = paired_median(lambda: ours(x, w).block_until_ready(),
                          lambda: theirs(x, w).block_until_ready(), min_time=min_time)
    moved = 2 * n * d * 4 + d * 4
    return Record("interop", "jit", f"jax-{backend}", "float32", n, d, t, moved,
                  gbps(moved, t), {"jnp": tt / t}, {"jnp_s": tt})


def _copy_block(b, run):
    return b.copy()


def dask_cluster(n: int, d: int, min_time: float, chunks: int = 8, workers: int = 2,
                 threads: int = 1) -> Record:
    """Throughput on a 2-process LocalCluster vs the in-memory kernel on the same data.

    Beside the in-memory kernel, the cluster's own roof: a per-chunk copy of
    the same data on the same cluster (ratio ``cluster_copy``).
    """
    import dask.array as da
    import distributed

    import polynorm as pn

    # one core per worker: a worker's kernels run single-threaded, as its tasks do, rather
    # than two workers' Numba thread pools fighting over the same cores
    env = {"NUMBA_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    with distributed.LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
        worker_dashboard_address=None, env=env,
    ) as cluster, distributed.Client(cluster) as client:
        rs = da.random.RandomState(3)
        xd = rs.standard_normal((n, d), chunks=(-(-n // chunks), d)).astype(np.float32).persist()
        wd = da.ones(d, dtype=np.float32, chunks=d).persist()
        distributed.wait([xd, wd])
        runs = iter(range(1 << 30))

        def timed(make):
            def go():
                # dask names tasks by their inputs: a per-run argument gives new task
                # names, so the scheduler cannot hand back a result it still holds
                y = make(next(runs)).persist()
                distributed.wait(y)
                del y

            for _ in range(3):  # workers load the kernels and warm their allocators
                go()
            return median_time(go, min_time=min_time, min_repeat=3)

        t = timed(lambda i: pn.rms_norm(xd, wd, eps=EPS * (1 + 1e-9 * i)))
        tc = timed(lambda i: xd.map_blocks(_copy_block, i, dtype=xd.dtype))
        x, w = client.compute([xd, wd], sync=True)
    tm = median_time(lambda: pn.rms_norm(x, w, eps=EPS), min_time=min_time, min_repeat=3)
    moved = 2 * x.nbytes + w.nbytes
    return Record("interop", "dask", "dask-localcluster", "float32", n, d, t, moved,
                  gbps(moved, t), {"in_memory": tm / t, "cluster_copy": tc / t},
                  {"in_memory_s": tm, "in_memory_gbps": gbps(moved, tm), "cluster_copy_s": tc,
                   "chunks": chunks, "workers": workers, "threads_per_worker": 1,
                   "numba_threads_per_worker": threads})


def run(
    *, quick: bool = False, dtypes: list[str] | None = None, progress: Progress | None = None
) -> list[Record]:
    """All five measurements; ``quick`` takes smaller shapes and shorter timings (< 60 s)."""
    import importlib.util

    dtypes = list(dtypes or DTYPES)
    min_time = 0.03 if quick else 0.3
    big = (2048, 4096) if quick else (16384, 4096)
    mod_shape = (512, 4096) if quick else (4096, 4096)
    steps: list[tuple[str, Callable[[], Record]]] = []
    if importlib.util.find_spec("torch") is not None:
        steps.append(("dispatch 1x4096 float32", lambda: dispatch(min_time)))
        for dt in dtypes:
            steps.append((f"fwd {dt} {big[0]}x{big[1]}",
                          lambda dt=dt: bandwidth(*big, dt, min_time)))
        for dt in dtypes:
            steps.append((f"module {dt} {mod_shape[0]}x{mod_shape[1]}",
                          lambda dt=dt: module(*mod_shape, dt, min_time)))
    if importlib.util.find_spec("distributed") is not None:
        steps.append((f"dask {big[0]}x{big[1]}", lambda: dask_cluster(*big, min_time)))
    if importlib.util.find_spec("jax") is not None:
        for shape in ((1, 4096), big):
            for be in ("auto", "numba"):
                steps.append((f"jit {be} {shape[0]}x{shape[1]}",
                              lambda shape=shape, be=be: jax_jit(*shape, be, min_time)))
    records = []
    for i, (label, step) in enumerate(steps):
        if progress:
            progress(i, len(steps), label)
        records.append(step())
    if progress:
        progress(len(steps), len(steps), "done")
    return records


def main(argv: list[str] | None = None) -> int:
    """``python -m polynorm.bench.interop [--quick] [--dtypes ...] [--json PATH]``."""
    p = argparse.ArgumentParser(prog="polynorm.bench.interop",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, short timings (< 60 s)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None)
    p.add_argument("--json", default="bench/results/interop.json",
                   help="where to write the records")
    p.add_argument("--note", default="", help="a note stored in the JSON (e.g. 'shared machine')")
    args = p.parse_args(argv)
    ok, why = available()
    if not ok:
        print(f"interop benchmark cannot run here: {why}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()

    records = run(quick=args.quick, dtypes=args.dtypes, progress=stderr_progress)
    print(file=sys.stderr)
    print(format_table(records, ["torch", "copy", "numpy_input", "in_memory", "cluster_copy",
                                 "jnp"]))
    print()
    for r in records:
        print(_verdict(r))
    meta: dict[str, Any] = {"suite": "interop", "quick": args.quick, "note": args.note,
                            "seconds": time.perf_counter() - t0, "numpy": np.__version__}
    for lib in ("torch", "dask", "distributed", "numba", "jax"):
        try:
            meta[lib] = __import__(lib).__version__
        except ImportError:
            pass
    write_json(args.json, records, meta)
    print(f"wrote {args.json}")
    return 0


_TARGETS = {"dispatch": ("torch", 1.0), "fwd": ("numpy_input", 0.95), "module": ("torch", 5.0)}


def _verdict(r: Record) -> str:
    """One line per record: the number the issue asks for and its target."""
    head = f"{r.op:>8} {r.dtype:<8} {r.tokens}x{r.d}:"
    if r.op == "jit":
        return (f"{head} {r.backend}: jitted jnp takes {r.ratios['jnp']:.2f}x polynorm's time "
                f"(no target)")
    if r.op == "dask":
        return (f"{head} cluster {r.gbps:.1f} GB/s vs in-memory "
                f"{r.extra['in_memory_gbps']:.1f} GB/s (ratio {r.ratios['in_memory']:.2f}); "
                f"{r.ratios['cluster_copy']:.2f} of a per-chunk copy on the same cluster")
    key, target = _TARGETS[r.op]
    got = r.ratios[key]
    return f"{head} {key} = {got:.2f} (target >= {target:g}: {'met' if got >= target else 'NOT met'})"
