"""GPU benchmark: the cupy backend against a device copy and its peers.

For fwd, add (fused residual add + norm), bwd and the fusions -- gated
(``rms_norm_gated``, Mamba-2's default: ``norm_before_gate=False``, one group)
and quant (``rms_norm_quant`` with a residual and a static float8_e4m3fn
scale: vLLM's ``fused_add_rms_norm_static_fp8_quant``) -- at tokens x hidden sizes
(:data:`TOKENS` x :data:`HIDDEN`) in bfloat16, float16 and float32, each case
records polynorm's effective bandwidth (bytes the op must move / time) and:

* ``copy``: that bandwidth over the bandwidth of a device copy moving the same
  bytes (half read, half written) -- the roof; the issue's targets are
  >= 0.85 (fwd, add at >= 4096 tokens) and >= 0.75 (bwd);
* ``copy_kernel``: the same against the kernels alone (their launches
  recorded once and replayed, no host work between): what the kernels reach
  where the end-to-end call is bound by the host (small shapes);
* ``torch``, ``torch.compile``, ``liger``, ``quack``: peer time / polynorm time
  (> 1: polynorm faster), for the peers importable here; for gated, Mamba's
  ``rmsnorm_fn`` (``mamba``) and for quant vLLM's kernel (``vllm``), or the
  reason they were skipped in the record's ``extra``.

Arrays are torch CUDA tensors when torch has CUDA (needed for bfloat16 and
the peers), cupy arrays otherwise.  Times are CUDA-event medians.  Cases
whose arrays would not fit in a third of the free device memory are skipped
and listed in the JSON's ``meta``.  ``--dry-run`` lists the cases without a GPU.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from polynorm.bench.common import Record, format_table, gbps, write_json
from polynorm.bench.gpu_cases import (
    DTYPES,
    cases,
    op_bytes,
)

EPS = 1e-6

Progress = Callable[[int, int, str], None]


def available() -> tuple[bool, str]:
    import polynorm as pn

    return pn.backends()["cupy"]


# ------------------------------------------------------------------ array library glue


class _Lib:
    """torch CUDA (preferred) or cupy: allocation, events, copy."""

    def __init__(self) -> None:
        self.torch = None
        try:
            import torch

            if torch.cuda.is_available():
                self.torch = torch
        except ImportError:
            pass
        import cupy

        self.cupy = cupy

    @property
    def name(self) -> str:
        return "torch" if self.torch is not None else "cupy"

    def dtypes(self) -> tuple[str, ...]:
        return DTYPES if self.torch is not None else ("float16", "float32")

    def randn(self, shape, dtype: str):
        if self.torch is not None:
            return self.torch.randn(shape, device="cuda", dtype=getattr(self.torch, dtype))
        return self.cupy.random.standard_normal(shape, dtype="float32").astype(dtype)

    def empty_bytes(self, nbytes: int):
        if self.torch is not None:
            return self.torch.empty(nbytes, device="cuda", dtype=self.torch.uint8)
        return self.cupy.empty(nbytes, dtype="uint8")

    def copy_fn(self, nbytes: int):
        half = max(1, nbytes // 2)
        src, dst = self.empty_bytes(half), self.empty_bytes(half)
        if self.torch is not None:
            return lambda: dst.copy_(src)
        return lambda: dst.__setitem__(slice(None), src)

    def free_bytes(self) -> int:
        return int(self.cupy.cuda.runtime.memGetInfo()[0])

    def release(self) -> None:
        if self.torch is not None:
            self.torch.cuda.empty_cache()
        self.cupy.get_default_memory_pool().free_all_blocks()

    def time(self, fn: Callable[[], Any], target: float = 0.02) -> float:
        """Median seconds per call over 3 batches of event-timed calls."""
        if self.torch is not None:
            ev = lambda: self.torch.cuda.Event(enable_timing=True)  # noqa: E731
            elapsed = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731
        else:
            ev = self.cupy.cuda.Event
            elapsed = lambda a, b: self.cupy.cuda.get_elapsed_time(a, b) / 1e3  # noqa: E731

        def batch(reps: int) -> float:
            a, b = ev(), ev()
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            return elapsed(a, b) / reps

        fn()  # warm-up (compilation, allocation)
        one = batch(1)
        reps = max(1, min(200, int(target / max(one, 1e-6))))
        return statistics.median(batch(reps) for _ in range(3))


# ------------------------------------------------------------------ the callables per op


def _polynorm(lib: _Lib, op: str, x, r, w, dy, rstd):
    import polynorm as pn

    if op == "fwd":
        return lambda: pn.rms_norm(x, w, eps=EPS)
    if op == "add":
        return lambda: pn.add_rms_norm(x, r, w, eps=EPS)
    if op == "gated":  # r is the gate z
        return lambda: pn.rms_norm_gated(x, r, w, eps=EPS)
    if op == "quant":
        return lambda: pn.rms_norm_quant(x, w, residual=r, scale=QUANT_SCALE, eps=EPS)
    return lambda: pn.rms_norm_backward(dy, x, w, rstd=rstd, eps=EPS)


#: the static scale of the quant case
QUANT_SCALE = 0.05


def _fusion_peers(torch, op: str, x, r, w, skipped: dict) -> dict[str, Callable]:
    """torch eager compositions and the fused kernels of Mamba (gated) / vLLM (quant);
    a peer that does not import or set up is left out with its reason in ``skipped``."""
    F = torch.nn.functional
    d = x.shape[-1]
    out: dict[str, Callable] = {}
    if op == "gated":
        out["torch"] = lambda: F.rms_norm(x * F.silu(r), (d,), w, EPS)
        try:
            from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn

            out["mamba"] = lambda: rmsnorm_fn(x, w, None, z=r, eps=EPS, group_size=None,
                                              norm_before_gate=False)
        except Exception as exc:
            skipped["mamba"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        return out
    f8 = torch.float8_e4m3fn
    out["torch"] = lambda: (F.rms_norm(x + r, (d,), w, EPS).float() / QUANT_SCALE).clamp(-448, 448).to(f8)
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

        kern = torch.ops._C.fused_add_rms_norm_static_fp8_quant
        q = torch.empty(x.shape, dtype=f8, device=x.device)
        res = r.clone()  # updated in place (h): the bytes of our h
        scale = torch.tensor([QUANT_SCALE], dtype=torch.float32, device=x.device)
        out["vllm"] = lambda: kern(q, x, res, w, scale, EPS)
    except Exception as exc:
        skipped["vllm"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    return out


def _peers(lib: _Lib, op: str, dtype: str, x, r, w, dy, compiled: dict) -> dict[str, Callable]:
    """Peer callables for this case (torch only); failures to set up are skipped."""
    torch = lib.torch
    if torch is None:
        return {}
    if op in ("gated", "quant"):
        return _fusion_peers(torch, op, x, r, w, compiled.setdefault(("skipped", op), {}))
    F = torch.nn.functional
    d = x.shape[-1]
    out: dict[str, Callable] = {}

    def eager(xx, ww):
        return F.rms_norm(xx, (d,), ww, EPS)

    fns: dict[str, Callable] = {"torch": eager}
    if ("compile", op) not in compiled:
        try:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            compiled[("compile", op)] = torch.compile(eager, dynamic=True)
        except Exception as exc:
            compiled[("compile", op)] = exc
    if callable(compiled[("compile", op)]):
        fns["torch.compile"] = compiled[("compile", op)]
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # the same work as ours: a new output (in_place=False) and one rounding at
        # the end (casting_mode="none"); positional (X, W, eps, offset,
        # casting_mode, in_place), as keywords changed across Liger versions
        fns["liger"] = lambda xx, ww: LigerRMSNormFunction.apply(xx, ww, EPS, 0.0, "none", False)
    except Exception:
        pass
    try:
        from quack.rmsnorm import rmsnorm as quack_rmsnorm

        fns["quack"] = lambda xx, ww: quack_rmsnorm(xx, ww, eps=EPS)
    except Exception:
        pass
    for name, f in fns.items():
        if op == "fwd":
            out[name] = lambda f=f: f(x, w)
        elif op == "add" and name == "quack":  # QuACK fuses the residual add too
            out[name] = lambda: quack_rmsnorm(x, w, residual=r, eps=EPS, prenorm=True)
        elif op == "add":
            out[name] = lambda f=f: f(x + r, w)
        else:
            xg = x.detach().requires_grad_(True)
            wg = w.detach().requires_grad_(True)
            try:
                y = f(xg, wg)
            except Exception:
                continue
            out[name] = lambda y=y, xg=xg, wg=wg: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
    return out


# ------------------------------------------------------------------ the suite


def run(
    *,
    quick: bool = False,
    dtypes: list[str] | None = None,
    progress: Progress | None = None,
    peers: bool = True,
    budget_s: float | None = None,
    skipped: list[str] | None = None,
    on_record: Callable[[list[Record], list[str]], None] | None = None,
) -> list[Record]:
    """Measure every case that fits; returns one :class:`Record` per case.

    ``budget_s``: stop starting new cases after this many seconds (the
    remaining ones are added to ``skipped``).  ``on_record(records, skipped)``
    is called after every case (the CLI rewrites its JSON there).
    """
    import polynorm as pn

    lib = _Lib()
    allowed = [d for d in lib.dtypes() if dtypes is None or d in dtypes]
    todo = cases(quick, allowed)
    skipped = skipped if skipped is not None else []
    compiled: dict = {}
    records: list[Record] = []
    start = time.perf_counter()
    for i, (op, dt, n, d) in enumerate(todo):
        label = f"{op} {dt} {n}x{d}"
        if progress:
            progress(i, len(todo), label)
        if budget_s is not None and time.perf_counter() - start > budget_s:
            skipped.append(f"{label}: time budget")
            continue
        nbytes = op_bytes(op, dt, n, d)
        if 3 * nbytes > lib.free_bytes():
            skipped.append(f"{label}: needs {3 * nbytes / 1e9:.1f} GB")
            continue
        try:
            x = lib.randn((n, d), dt)
            w = lib.randn((d,), dt)
            r = lib.randn((n, d), dt) if op in ("add", "gated", "quant") else None
            dy = lib.randn((n, d), dt) if op == "bwd" else None
            rstd = pn.rms_norm(x, w, eps=EPS, return_rstd=True)[1] if op == "bwd" else None
            call = _polynorm(lib, op, x, r, w, dy, rstd)
            t = lib.time(call)
            t_kernel, launches = _kernel_time(lib, call)
            t_copy = lib.time(lib.copy_fn(nbytes))
            rec = Record(suite="gpu", op=op, backend="cupy", dtype=dt, tokens=n, d=d, seconds=t,
                         bytes=nbytes, gbps=gbps(nbytes, t), ratios={"copy": t_copy / t},
                         extra={"arrays": lib.name, "launches": launches,
                                **_launch_info(op, dt, n, d)})
            if t_kernel is not None:
                rec.ratios["copy_kernel"] = t_copy / t_kernel
                rec.extra.update(kernel_seconds=t_kernel, kernel_gbps=gbps(nbytes, t_kernel))
            if peers:
                for name, fn in _peers(lib, op, dt, x, r, w, dy, compiled).items():
                    try:
                        rec.ratios[name] = lib.time(fn) / t
                    except Exception as exc:  # OOM, unsupported shape, ...
                        rec.extra[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                for name, why in compiled.get(("skipped", op), {}).items():
                    rec.extra[f"{name}_skipped"] = why
            records.append(rec)
        except Exception as exc:
            skipped.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
        finally:
            x = w = r = dy = rstd = None
            lib.release()
        if on_record is not None:  # after every case: a timeout keeps what was measured
            on_record(records, skipped)
    if progress:
        progress(len(todo), len(todo), "done")
    return records


def _kernel_time(lib: _Lib, call: Callable[[], Any]) -> tuple[float | None, list[str]]:
    """Seconds per call of the kernels alone: ``call``'s launches recorded once
    (:func:`polynorm.backends.cuda.recording`) and replayed back to back, with no
    planning, casts, allocation or DLPack in between; and the kernels' names.
    ``None`` when the call launched no kernel of the cupy backend."""
    from polynorm.backends import cuda as cupy_backend

    with cupy_backend.recording() as replay:
        result = call()
    names = [la.name for la, _, _ in replay.launches if la is not None]
    t = lib.time(replay) if names else None
    del result  # the outputs lived as long as the replay wrote into them
    return t, names


def _launch_info(op: str, dtype: str, n: int, d: int) -> dict:
    """The kernel launch the cupy backend makes for this case, and how its kernel was compiled."""
    from polynorm.backends import cuda as cupy_backend
    from polynorm.backends.cuda import launch as cl

    try:
        sms, smem = cupy_backend._device()
        if op == "bwd":
            la = cl.backward_launch(n, d, dtype, dtype, dtype, num_sms=sms, max_smem=smem)
        elif op == "gated":
            la = cl.gated_forward_launch(n, d, d, dtype, num_sms=sms, device=cupy_backend._device_name())
        elif op == "quant":
            la = cl.quant_launch(n, d, dtype, group_size=d, num_sms=sms, device=cupy_backend._device_name())
        else:
            la = cl.forward_launch(n, d, dtype, dtype if op == "add" else None, dtype, dtype, max_smem=smem,
                                   num_sms=sms, has_res=op == "add", device=cupy_backend._device_name())
        paths = sorted({v for (_, name), v in cupy_backend.compile_paths.items() if name == la.name})
        return {"kernel": la.name, "grid": la.grid, "block": la.block, "shared": la.shared,
                "compile": paths[0] if len(paths) == 1 else paths}
    except Exception as exc:  # the record keeps its time either way
        return {"launch_error": f"{type(exc).__name__}: {str(exc)[:120]}"}


def _device_name() -> str:
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:  # no cupy / no device: say so in the JSON
        return f"unknown ({type(exc).__name__})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4096 tokens, d in {4096, 65536}")
    p.add_argument("--dtypes", nargs="*", choices=DTYPES)
    p.add_argument("--no-peers", action="store_true", help="skip torch / torch.compile / Liger / QuACK")
    p.add_argument("--budget", type=float, default=None, help="seconds; later cases are skipped")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gpu-<date>.json)")
    p.add_argument("--dry-run", action="store_true", help="list the cases and peers; needs no GPU")
    p.add_argument("--gpu-model", action="store_true",
                   help="print the launch model's predictions for these cases (polynorm.bench.model); no GPU")
    args = p.parse_args(argv)
    todo = cases(args.quick, args.dtypes)
    if args.gpu_model:
        from polynorm.bench import model

        for row in model.predictions(todo):
            print(row)
        return 0
    if args.dry_run:
        peers = {}
        for mod in ("torch", "liger_kernel", "quack", "cupy", "mamba_ssm", "vllm"):
            try:
                __import__(mod)
                peers[mod] = "importable"
            except Exception as exc:
                peers[mod] = f"missing ({type(exc).__name__})"
        print(f"{len(todo)} cases, e.g. {todo[:2]}; importable here: {peers}")
        ok, why = available()
        print(f"cupy backend: {'usable' if ok else 'NOT usable: ' + why}")
        return 0
    ok, why = available()
    if not ok:
        print(f"GPU benchmark cannot run: {why}", file=sys.stderr)
        return 2
    skipped: list[str] = []

    def progress(i: int, n: int, label: str) -> None:
        print(f"[{i}/{n}] {label}", file=sys.stderr, flush=True)

    meta = {"device": _device_name(), "skipped": skipped,
            "targets": {"fwd": 0.85, "add": 0.85, "bwd": 0.75},
            "timing": "CUDA events around batches of end-to-end pn.* calls (seconds: host planning "
                      "included) and of the same kernels replayed alone (kernel_seconds, "
                      "ratio copy_kernel)"}
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M")
    out = args.out or f"bench/results/gpu-{stamp}.json"

    def save(recs: list[Record], skip: list[str]) -> None:
        write_json(out, recs, {**meta, "skipped": skip})

    recs = run(quick=args.quick, dtypes=args.dtypes, progress=progress, peers=not args.no_peers,
               budget_s=args.budget, skipped=skipped, on_record=save)
    save(recs, skipped)
    print(format_table(recs))
    print(f"wrote {out} ({len(recs)} records, {len(skipped)} skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
