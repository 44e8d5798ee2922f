"""Where the host time of one cupy-backend call goes (needs a GPU).

For a small case, where the end-to-end call is bound by the host, prints:

* the call's time per call (CUDA events around a batch) beside its kernels
  replayed alone (:func:`polynorm.backends.cuda.recording`) and torch's own
  ``F.rms_norm``: the host overhead is the difference;
* the host cost of the interop steps one call makes (DLPack both ways, the
  stream hand-over), each timed alone;
* cProfile's top entries (own time) over a batch of calls.

    python bench/gpu_overhead.py [--op fwd|add|bwd] [--shape 4096x1024] [--calls 300]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def per_call(fn, calls: int) -> float:
    """Seconds per call: wall time of ``calls`` calls, synchronized at both ends."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def host_us(fn, calls: int = 2000) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def profile_case(lib: str, dtype: str, op: str, n: int, d: int, calls: int) -> None:
    """One case: the call against its kernels alone (and torch), then cProfile."""
    import cupy
    import torch

    import polynorm as pn
    from polynorm.backends import cuda as cb

    F = torch.nn.functional
    tdt = getattr(torch, dtype)
    x = torch.randn(n, d, device="cuda", dtype=tdt)
    r = torch.randn(n, d, device="cuda", dtype=tdt)
    w = torch.randn(d, device="cuda", dtype=tdt)
    if lib == "cupy":
        x, r, w = (cupy.from_dlpack(t) for t in (x, r, w))
    if op == "fwd":
        call = lambda: pn.rms_norm(x, w)  # noqa: E731
    elif op == "add":
        call = lambda: pn.add_rms_norm(x, r, w)  # noqa: E731
    else:
        rstd = pn.rms_norm(x, w, return_rstd=True)[1]
        call = lambda: pn.rms_norm_backward(r, x, w, rstd=rstd)  # noqa: E731
    with cb.recording() as replay:
        keep = call()
    t_call = per_call(call, calls)
    t_kern = per_call(replay, calls)
    del keep
    line = (f"{op} {lib} {dtype} {n}x{d}: call {t_call * 1e6:8.1f} us, kernels alone "
            f"{t_kern * 1e6:7.1f} us ({sum(la is not None for la, _, _ in replay.launches)} launches)")
    if lib == "torch" and op == "fwd":
        t_torch = per_call(lambda: F.rms_norm(x, (d,), w, 1e-6), calls)
        line += f", torch F.rms_norm {t_torch * 1e6:7.1f} us"
    print(line, flush=True)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    print("\n".join(ln for ln in s.getvalue().splitlines() if ln.strip())[:6000], flush=True)


def main() -> int:
    import cupy
    import torch

    import polynorm as pn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=("fwd", "add", "bwd"), default="fwd")
    p.add_argument("--shape", default="4096x1024")
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    n, d = (int(v) for v in args.shape.split("x"))

    for lib, dtype in (("torch", "bfloat16"), ("torch", "float32"), ("cupy", "float32")):
        profile_case(lib, dtype, args.op, n, d, args.calls)

    # the interop steps, alone (host time per step)
    xt = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    xc = cupy.from_dlpack(xt.view(torch.int16))
    stream = torch.cuda.current_stream()
    steps = {
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "cupy.cuda.ExternalStream(ptr)": lambda: cupy.cuda.ExternalStream(stream.cuda_stream, 0),
        "with cupy.cuda.Device(0)": lambda: cupy.cuda.Device(0).__enter__(),
        "cupy.from_dlpack(torch int16 view)": lambda: cupy.from_dlpack(xt.view(torch.int16)),
        "torch.from_dlpack(cupy)": lambda: torch.from_dlpack(xc),
        "cupy.empty((n, d), int16)": lambda: cupy.empty((n, d), "int16"),
        "torch.empty((n, d), bf16)": lambda: torch.empty((n, d), device="cuda", dtype=torch.bfloat16),
        "pn.backends()": lambda: pn.backends(),
    }
    for name, fn in steps.items():
        print(f"  {name:<40} {host_us(fn):8.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
