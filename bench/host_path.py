"""Host time per call of the torch-CUDA path on the CPU, with the launch stubbed.

Without a GPU: torch CPU tensors stand in for CUDA ones (the fast path's device test
patched, as in tests/test_cuda_host_path.py), and each path's last step before the
driver is a no-op:

* ``before``: the cupy backend's own call (``polynorm.ops.fast_cuda`` with no launch
  records): dtype decisions, launch rules, the argument tuple of numpy scalars, the
  stream context, ``torch.empty`` results; its kernel is a no-op callable, so CuPy's
  per-argument conversion in ``Function.__call__`` (tens of objects per launch) is
  *not* counted: the real before costs more;
* ``after``: the launch record (``polynorm.backends.cuda.hostpath``): the call key,
  ``data_ptr()``s, ``torch.empty`` results, the pointer cells; ``cuLaunchKernel`` a
  no-op Python function (the driver's own launch, ~2-4 us on a GPU, not counted);
* ``floor``: the op's results allocated as ``torch.empty(shape, dtype=, device=)``
  (the records allocate cheaper: ``torch.empty_like`` of an input where one has the
  result's shape and dtype, sizes as separate ints) and the inputs' ``data_ptr()``s.

Each is timed through the public call (``pn.rms_norm`` / ``pn.add_rms_norm`` /
``pn.rms_norm_backward``, backend "auto"; the Numba fast path's host-tensor test
answers "not mine" as for a CUDA tensor).  Allocations are CPU ``torch.empty`` (glibc;
CUDA's caching allocator differs), the same on every row.  The GPU's numbers come from
``bench/gpu_check.sh`` (``polynorm.bench.gpu --host-path``).

    python bench/host_path.py [--shape 4096x1024] [--dtype bfloat16] [--reps 61] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Kernel:
    ptr = 1

    def __init__(self):
        self.max_dynamic_shared_size_bytes = 48 * 1024

    def __call__(self, grid, block, args, shared_mem=0):
        pass


class _Ctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake_cupy():
    import types

    m = types.ModuleType("cupy")
    dev = types.SimpleNamespace(id=0, compute_capability="90")
    m.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        Device=lambda *a: _Ctx(), ExternalStream=lambda ptr, dev: _Ctx(),
        get_current_stream=_Ctx, runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
    m.cuda.Device.id = dev.id  # type: ignore[attr-defined]
    return m


@contextlib.contextmanager
def stand_in():
    """Patches: CPU tensors taken as CUDA ones, both paths' launches no-ops."""
    import torch

    from polynorm.backends import cuda as be
    from polynorm.backends.cuda import hostpath
    from polynorm.core import interop
    from polynorm.ops import fast_cuda

    names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
             torch.float64: "float64"}
    kern = _Kernel()
    saved = []

    missing = object()

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name, missing)))
        setattr(obj, name, value)

    patch(fast_cuda, "_STATE", [torch, names, (torch.Tensor, torch.nn.Parameter), be])
    patch(fast_cuda, "_on_device", lambda x: True)
    patch(fast_cuda, "_current_device", lambda t: -1)
    patch(fast_cuda, "_stream", lambda t, dev: 7)
    patch(fast_cuda, "_HOSTPATH", [hostpath])
    patch(fast_cuda, "_RECORDS", {})
    patch(interop, "torch_host_views", lambda arrays: None)  # what a CUDA tensor gets
    patch(be, "_kernel", lambda launch: kern)
    patch(be, "_device", lambda: (132, 227 * 1024))
    patch(be, "_device_name", lambda: "")
    patch(torch.cuda, "current_device", lambda: 0)
    patch(torch._C, "_cuda_getCurrentRawStream", lambda dev: 7)
    patch(hostpath, "_LAUNCHER", [lambda fn, grid, block, shared, stream, params: None, None,
                                  lambda ptr: ptr])
    cupy = sys.modules.get("cupy")
    sys.modules["cupy"] = _fake_cupy()  # type: ignore[assignment]
    try:
        yield fast_cuda, hostpath
    finally:
        for obj, name, value in reversed(saved):
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        if cupy is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = cupy


def keep_freed_memory() -> bool:
    """glibc: serve the results' sizes from the heap and never trim it, as CUDA's caching
    allocator keeps freed blocks (else a large CPU ``torch.empty`` maps fresh pages
    now and then, which no GPU call pays)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-1, 1 << 30) and libc.mallopt(-3, 32 << 20))  # TRIM, MMAP thresholds
    except (OSError, AttributeError):
        return False


def per_call_us(fn, calls: int) -> float:
    """Microseconds per call of a batch, the garbage collector off (as ``timeit``): a
    collection started by one path's garbage would land in the next path's batch."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6
    finally:
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    import torch

    import polynorm as pn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4096x1024")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=61)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    n, d = (int(v) for v in args.shape.split("x"))
    dt = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    heap = keep_freed_memory()
    g = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(n, d, generator=g).to(dt) for _ in range(3))
    w = torch.nn.Parameter(torch.randn(d, generator=g).to(dt))
    rows = []
    with stand_in() as (fast_cuda, hostpath):
        rstd = pn.rms_norm(x, w, return_rstd=True)[1]
        ops = {
            "fwd": (lambda: pn.rms_norm(x, w), [((n, d), dt), ((n,), torch.float32)], (x, w)),
            "add": (lambda: pn.add_rms_norm(x, r, w),
                    [((n, d), dt), ((n, d), dt), ((n,), torch.float32)], (x, r, w)),
            "bwd": (lambda: pn.rms_norm_backward(dy, x, w, rstd=rstd),
                    [((n, d), dt), ((264, d), torch.float32), ((d,), dt)], (dy, x, w, rstd)),
        }
        for op, (call, outs, ins) in ops.items():
            def floor(outs=outs, ins=ins):
                bufs = [torch.empty(s, dtype=t, device=x.device) for s, t in outs]
                return [a.data_ptr() for a in (*ins, *bufs)]

            def before(call=call):
                fast_cuda._HOSTPATH[:] = [None]
                fast_cuda._RECORDS.clear()
                return call

            paths = {"before": before(), "after": call, "floor": floor}
            times: dict[str, list[float]] = {k: [] for k in paths}
            fast_cuda._HOSTPATH[:] = [hostpath]
            fast_cuda._RECORDS.clear()
            call()  # the record
            assert any(fast_cuda._RECORDS.values()), "no record was built"
            for _ in range(args.reps):  # interleaved: before, after, floor
                fast_cuda._HOSTPATH[:] = [None]
                fast_cuda._RECORDS.clear()
                call()
                times["before"].append(per_call_us(call, args.calls))
                fast_cuda._HOSTPATH[:] = [hostpath]
                fast_cuda._RECORDS.clear()
                call()
                times["after"].append(per_call_us(call, args.calls))
                times["floor"].append(per_call_us(floor, args.calls))
            med = {k: round(statistics.median(v), 2) for k, v in times.items()}
            low = {k: round(min(v), 2) for k, v in times.items()}
            row = {"op": op, "shape": [n, d], "dtype": args.dtype, "min_us": low, "median_us": med,
                   "after_over_before": round(low["after"] / low["before"], 3),
                   "after_minus_floor_us": round(low["after"] - low["floor"], 2)}
            rows.append(row)
            print(f"{op} {args.dtype} {n}x{d}: before {low['before']:7.2f} us, after {low['after']:6.2f} us,"
                  f" floor {low['floor']:6.2f} us (after / before {row['after_over_before']:.3f}; "
                  f"medians {med['before']:.1f}, {med['after']:.1f}, {med['floor']:.1f})", flush=True)
    doc = {
        "what": ("python bench/host_path.py " + " ".join(argv if argv is not None else sys.argv[1:])
                 + ": host time per public call on the CPU, torch CPU tensors standing in for CUDA "
                 "ones, the launch stubbed (before: the cupy backend's call with a no-op kernel, "
                 "CuPy's argument conversion not counted; after: the launch record, "
                 "cuLaunchKernel a no-op; floor: the op's torch.empty results and data_ptr()s); "
                 f"the fastest (min_us; the headline: on a shared machine other work only adds) and the "
                 f"median of {args.reps} interleaved batches of {args.calls} calls, the garbage collector off"),
        "machine": f"{platform.machine()}, torch {torch.__version__}, python {platform.python_version()}",
        "allocator": "glibc mallopt: no trim, mmap threshold 32 MB" if heap else "glibc defaults",
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
