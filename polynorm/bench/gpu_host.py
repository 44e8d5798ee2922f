"""GPU check of the torch-CUDA host path (launch records): host time per call and CUDA
graph capture.

For fwd, add and bwd of 4096 x 1024 bfloat16 (``--shape``, ``--dtype``) on torch CUDA
tensors, records:

* ``host_us``: host time per call, the issue loop alone (``calls`` calls with no sync
  between them, each returning as soon as its kernels are queued) -- ``after`` with
  the launch records, ``before`` with them off (the cupy backend's own call), and
  torch's ``F.rms_norm`` (fwd) / ``x + r`` then ``F.rms_norm`` (add) beside them,
  in interleaved batches; ``e2e_us``: the same calls synchronized at both ends;
* ``graph``: the call captured in ``torch.cuda.graph`` (after a warm-up on a side
  stream, as torch documents), its inputs refilled, replayed, and its results
  compared bit for bit with an eager call on the new inputs; the same for
  ``polynorm.torch.rms_norm(..., save="output")`` forward and backward;
* ``pieces_us``: the host cost of the steps a record's call makes (``torch.empty``
  of the results, the raw stream, ``cuLaunchKernel`` alone).

    python -m polynorm.bench.gpu_host [--shape 4096x1024] [--dtype bfloat16] [--out PATH] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

EPS = 1e-6
TARGET_US = 20.0


def _sync_free_us(fn, calls: int) -> float:
    """Host microseconds per call of ``calls`` calls with no sync between them."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / calls * 1e6


def _e2e_us(fn, calls: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _records(on: bool) -> None:
    from polynorm.ops import fast_cuda

    fast_cuda._RECORDS.clear()
    if on:
        fast_cuda._HOSTPATH.clear()  # found again: the record module where it can launch
    else:
        fast_cuda._HOSTPATH[:] = [None]


def _bits(a) -> Any:
    import torch

    if a is None:
        return None
    a = a.detach().contiguous()
    size = a.element_size()
    return a.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).cpu()


def _same(got, want) -> bool:
    import torch

    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    return len(got) == len(want) and all(
        (g is None and w is None) or (g is not None and w is not None and g.shape == w.shape
                                      and torch.equal(_bits(g), _bits(w)))
        for g, w in zip(got, want, strict=True))


def _ops(torch, pn, n: int, d: int, dt: Any) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x, r, dy = (torch.randn(n, d, device="cuda", dtype=dt, generator=g) for _ in range(3))
    w = torch.randn(d, device="cuda", dtype=dt, generator=g)
    rstd = pn.rms_norm(x, w, eps=EPS, return_rstd=True)[1]
    F = torch.nn.functional
    return {
        "fwd": ((x, w), lambda x, w: pn.rms_norm(x, w, eps=EPS),
                lambda x, w: F.rms_norm(x, (d,), w, EPS)),
        "add": ((x, r, w), lambda x, r, w: pn.add_rms_norm(x, r, w, eps=EPS),
                lambda x, r, w: F.rms_norm(x + r, (d,), w, EPS)),
        "bwd": ((dy, x, w, rstd), lambda dy, x, w, rstd: pn.rms_norm_backward(dy, x, w, rstd=rstd, eps=EPS),
                None),
    }


def host_times(n: int, d: int, dtype: str, calls: int, reps: int) -> list[dict]:
    import torch

    import polynorm as pn

    dt = getattr(torch, dtype)
    rows = []
    for op, (args, call, peer) in _ops(torch, pn, n, d, dt).items():
        paths = {"after": lambda c=call, a=args: c(*a), "before": lambda c=call, a=args: c(*a)}
        if peer is not None:
            paths["torch"] = lambda p=peer, a=args: p(*a)
        host: dict[str, list[float]] = {k: [] for k in paths}
        e2e: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(reps):
            for name, fn in paths.items():
                if name in ("after", "before"):
                    _records(name == "after")
                fn()  # the record (after), the kernels' load (both)
                host[name].append(_sync_free_us(fn, calls))
                e2e[name].append(_e2e_us(fn, calls))
        _records(True)
        med = {k: round(statistics.median(v), 2) for k, v in host.items()}
        rows.append({"op": op, "shape": [n, d], "dtype": dtype, "host_us": med,
                     "e2e_us": {k: round(statistics.median(v), 2) for k, v in e2e.items()},
                     "target_us": TARGET_US, "meets_target": med["after"] <= TARGET_US})
        print(f"{op} {dtype} {n}x{d}: host per call after {med['after']:.1f} us, before "
              f"{med['before']:.1f} us" + (f", torch {med['torch']:.1f} us" if "torch" in med else ""),
              flush=True)
    return rows


def graph_checks(n: int, d: int, dtype: str) -> list[dict]:
    """Each op captured in a CUDA graph, replayed on refilled inputs, against eager bits."""
    import torch

    import polynorm as pn
    import polynorm.torch as pnt

    dt = getattr(torch, dtype)
    _records(True)
    out = []
    for op, (args, call, _) in _ops(torch, pn, n, d, dt).items():
        out.append(_capture(op, torch, args, lambda a, c=call: c(*a)))

    g = torch.Generator(device="cuda").manual_seed(1)
    xr = torch.randn(n, d, device="cuda", dtype=dt, generator=g)
    w = torch.randn(d, device="cuda", dtype=dt, generator=g).requires_grad_()
    dy = torch.randn(n, d, device="cuda", dtype=dt, generator=g)

    def train(a):
        x, dyy = a
        x = x.detach().requires_grad_()
        y = pnt.rms_norm(x, w, eps=EPS, save="output")
        gx, gw = torch.autograd.grad(y, (x, w), dyy)
        return y, gx, gw

    out.append(_capture("torch-autograd save=output", torch, (xr, dy), train))
    return out


def _capture(label: str, torch, args: tuple, run) -> dict:
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                run(args)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = run(args)
        for a in args:  # new values, same buffers
            if a.is_floating_point():
                a.copy_(torch.randn_like(a) if a.dim() > 1 else a * 0.5 + 0.25)
        graph.replay()
        torch.cuda.synchronize()
        want = run(args)
        torch.cuda.synchronize()
        ok = _same(static, want)
        print(f"graph {label}: {'same bits as eager' if ok else 'DIFFERENT from eager'}", flush=True)
        return {"op": label, "captured": True, "replay_same_bits": ok}
    except Exception as exc:
        print(f"graph {label}: FAILED {type(exc).__name__}: {exc}", flush=True)
        return {"op": label, "captured": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def pieces(n: int, d: int, dtype: str, calls: int) -> dict:
    """Host microseconds of the steps of a record's call, each alone."""
    import torch

    import polynorm as pn
    from polynorm.ops import fast_cuda

    dt = getattr(torch, dtype)
    x = torch.randn(n, d, device="cuda", dtype=dt)
    w = torch.randn(d, device="cuda", dtype=dt)
    _records(True)
    pn.rms_norm(x, w, eps=EPS)
    recs = [r for r in fast_cuda._RECORDS.values() if r]
    dev = x.device
    out = {
        "torch.empty((n, d))": _sync_free_us(lambda: torch.empty((n, d), dtype=dt, device=dev), calls),
        "torch.empty((n,)) float32": _sync_free_us(lambda: torch.empty((n,), dtype=torch.float32, device=dev), calls),
        "torch.empty_like(x)": _sync_free_us(lambda: torch.empty_like(x), calls),
        "raw current stream": _sync_free_us(lambda: torch._C._cuda_getCurrentRawStream(0), calls),
        "current device": _sync_free_us(lambda: torch._C._cuda_getDevice(), calls),
        "call key": _sync_free_us(lambda: fast_cuda._key(pn.core.options.Options(), x, None, w, None),
                                  calls),
    }
    if recs:
        from polynorm.backends.cuda import hostpath

        fn, grid, block, shared, cells, params, _ = recs[0].steps[0]
        stream = torch._C._cuda_getCurrentRawStream(x.get_device())
        go = hostpath._launcher()
        out["cuLaunchKernel (the fwd step)"] = _sync_free_us(
            lambda: go(fn, grid, block, shared, stream, params), calls)
        out["record call (allocate + launch)"] = _sync_free_us(
            lambda: recs[0]([x, None, w, None], stream), calls)
    for k, v in out.items():
        print(f"  {k:<36} {v:7.2f} us", flush=True)
    return {k: round(v, 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polynorm.bench.gpu_host",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4096x1024")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON path")
    p.add_argument("--dry-run", action="store_true", help="say what would run; needs no GPU")
    args = p.parse_args(argv)
    n, d = (int(v) for v in args.shape.split("x"))
    if args.dry_run:
        from polynorm.ops import fast_cuda

        hp = fast_cuda._hostpath()
        print(f"would measure fwd/add/bwd {args.dtype} {n}x{d}: host time per call with launch "
              f"records on/off and torch's F.rms_norm; CUDA graph capture + replay against eager "
              f"bits; cuda-bindings' driver module (the records' launch) "
              f"{'imports' if hp is not None else 'does not import: the cupy backend calls run'} here")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA torch: nothing to measure", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {"what": "python -m polynorm.bench.gpu_host " + " ".join(argv or sys.argv[1:]),
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    for name, step in (("host", lambda: host_times(n, d, args.dtype, args.calls, args.reps)),
                       ("graph", lambda: graph_checks(n, d, args.dtype)),
                       ("pieces_us", lambda: pieces(n, d, args.dtype, args.calls))):
        try:
            doc[name] = step()
        except Exception as exc:  # keep what the other steps measured
            doc[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
        save()
    ok = isinstance(doc.get("graph"), list) and all(g.get("replay_same_bits") for g in doc["graph"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
