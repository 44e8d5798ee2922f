"""``polynorm check``: a self-test of every usable backend on this machine.

Each backend runs a few small cases per dtype and is compared with

* an independent float64 formula of the spec (forward, fused add), written
  here in plain numpy so that a bug shared by all backends still shows, and
  float64 central differences of that formula (backward); and
* the array-API reference backend on the same inputs ("vs reference").

Inputs are rounded to the dtype under test first and the truth is computed
from the rounded values, so the only error allowed is the backend's own
rounding: a few units in the last place of the output dtype, measured
relative to the largest magnitude of the expected result.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import polynorm as pn
from polynorm.core.dtypes import FLOAT_DTYPES, numpy_dtype

#: Allowed error, relative to max |expected|, per dtype.  Low precision:
#: 8 unit roundoffs (one final rounding, plus the llama mode's extra
#: roundings of xhat and of the weight product).  float32: accumulation
#: over d = 700 in float32 may cost ~sqrt(d) ulps.  float64: central
#: differences with h = 1e-6 are good to ~1e-9, the forward to ~1e-15.
TOL = {
    "float16": 8 * 2.0**-11,
    "bfloat16": 8 * 2.0**-8,
    "float32": 2e-5,
    "float64": 1e-7,
}

#: (tokens, d): odd d for tails; d = 700 crosses block/vector widths; 64 x 1024 is big
#: enough for the multi-threaded / multi-block paths (its backward is checked against the
#: closed-form float64 gradient, finite differences there would take seconds).
SHAPES = ((4, 13), (3, 700), (64, 1024))
_FD_MAX_ELEMENTS = 4096

#: Checks in table order.
TESTS = ("fwd", "pRMS", "llama", "add", "bwd", "bwd+")

_FD_STEP = 1e-6


@dataclass
class Result:
    """One check of one backend at one dtype; ``ok`` is None when skipped."""

    backend: str
    dtype: str
    test: str
    ok: bool | None
    err: float = float("nan")
    tol: float = float("nan")
    detail: str = ""


# ------------------------------------------------------------------ arrays per backend


@dataclass(frozen=True)
class _Arrays:
    """How to hand numpy data to one backend and read its results back."""

    make: Callable[[np.ndarray], Any]
    read: Callable[[Any], np.ndarray]
    dtypes: tuple[str, ...] = FLOAT_DTYPES


def _arrays(backend: str) -> _Arrays:
    if backend == "cupy":
        import cupy

        # cupy has no bfloat16 dtype: bfloat16 reaches the cupy kernels as torch CUDA tensors
        torch = _torch_cuda()
        if torch is None:
            return _Arrays(cupy.asarray, cupy.asnumpy, ("float16", "float32", "float64"))

        def make(a):
            if a.dtype.name != "bfloat16":
                return cupy.asarray(a)
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()

        def read(a):
            if isinstance(a, torch.Tensor):
                return a.cpu().view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
            return cupy.asnumpy(a)

        return _Arrays(make, read)
    if backend == "dask":
        import dask.array as da

        def make(a):
            # tokens in two chunks, the normalized axis whole; weight/bias in one chunk
            chunks = (max(1, a.shape[0] // 2), *a.shape[1:]) if a.ndim == 2 else a.shape
            return da.from_array(a, chunks=chunks)

        return _Arrays(make, lambda a: np.asarray(a.compute()))
    return _Arrays(lambda a: a.copy(), np.asarray)


def _torch_cuda():
    """torch when it is installed with a usable CUDA device, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _supported_dtypes(backend: str, arrays: _Arrays) -> tuple[str, ...]:
    # polynorm.backends is shadowed by the function pn.backends; import the package itself
    registry = importlib.import_module("polynorm.backends")
    mod = registry._loaded.get(backend)
    declared = getattr(mod, "DTYPES", None)
    return tuple(declared) if declared is not None else arrays.dtypes


# ------------------------------------------------------------------ float64 truth


def _formula(x, w, b, *, k, eps, inside, offset):
    """The spec's forward in float64, row by row; returns (y, per-row loss helper)."""
    ms = np.mean(x[:, :k] ** 2, axis=1, keepdims=True)
    rstd = 1 / np.sqrt(ms + eps) if inside else 1 / (np.sqrt(ms) + eps)
    y = x * rstd
    if w is not None:
        y = y * (w + offset)
    if b is not None:
        y = y + b
    return y


def _fd_grads(x, w, b, g, **opts):
    """Central differences of ``sum(g * y)``: (dx, dw, db) in float64.

    Tokens are independent, so one column perturbed in every row at once gives
    that column of dx for all rows (from the per-row losses).
    """
    h = _FD_STEP

    def row_loss(xx, ww, bb):
        return np.sum(g * _formula(xx, ww, bb, **opts), axis=1)

    dx = np.empty_like(x)
    for j in range(x.shape[1]):
        xp_, xm = x.copy(), x.copy()
        xp_[:, j] += h
        xm[:, j] -= h
        dx[:, j] = (row_loss(xp_, w, b) - row_loss(xm, w, b)) / (2 * h)

    def param_grad(p, which):
        if p is None:
            return None
        out = np.empty_like(p)
        for j in range(p.size):
            pp, pm = p.copy(), p.copy()
            pp[j] += h
            pm[j] -= h
            args_p = (x, pp, b) if which == "w" else (x, w, pp)
            args_m = (x, pm, b) if which == "w" else (x, w, pm)
            out[j] = (row_loss(*args_p).sum() - row_loss(*args_m).sum()) / (2 * h)
        return out

    return dx, param_grad(w, "w"), param_grad(b, "b")


def _exact_grads(x, w, b, g, *, k, eps, inside, offset):
    """Closed-form float64 gradients of ``sum(g * y)`` (the spec's backward)."""
    ms = np.mean(x[:, :k] ** 2, axis=1, keepdims=True)
    s = np.sqrt(ms)
    r = 1 / np.sqrt(ms + eps) if inside else 1 / (s + eps)
    ge = g if w is None else g * (w + offset)
    c = np.sum(ge * x, axis=1, keepdims=True)
    # d rstd / d ms: -r**3 / 2 inside, -r**2 / (2 s) outside (0 where the row is zero)
    with np.errstate(divide="ignore", invalid="ignore"):
        drdms = -0.5 * r**3 if inside else np.where(s > 0, -0.5 * r**2 / s, 0.0)
    dx = r * ge
    dx[:, :k] += x[:, :k] * c * drdms * (2 / k)
    dw = None if w is None else np.sum(g * x * r, axis=0)
    db = None if b is None else np.sum(g, axis=0)
    return dx, dw, db


# ------------------------------------------------------------------ one backend, one dtype


def _rel_err(got, want) -> float:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"shape {got.shape}, expected {want.shape}")
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
    return float(np.max(np.abs(got - want), initial=0.0)) / scale


class _Mismatch(Exception):
    def __init__(self, what: str, err: float):
        super().__init__(what)
        self.what, self.err = what, err


def _compare(pairs: dict[str, tuple[Any, Any]], tol: float) -> float:
    """Largest error over named (got, want) pairs; raises _Mismatch over ``tol``."""
    worst = 0.0
    for what, (got, want) in pairs.items():
        e = _rel_err(got, want)
        if not e <= tol:  # also catches NaN
            raise _Mismatch(what, e)
        worst = max(worst, e)
    return worst


def _run_test(test: str, backend: str, dtype: str, arr: _Arrays, rng) -> float:
    """Run one named check on every shape; return its worst relative error."""
    tol = TOL[dtype]
    ndt = numpy_dtype(dtype)
    worst = 0.0
    for n, d in SHAPES:
        # rounded inputs; the float64 truth is computed from exactly these values
        x = rng.standard_normal((n, d)).astype(ndt)
        w = (1 + 0.5 * rng.standard_normal(d)).astype(ndt)
        b = (0.1 * rng.standard_normal(d)).astype(ndt)
        g = rng.standard_normal((n, d)).astype(ndt)
        r = rng.standard_normal((n, d)).astype(ndt)
        x64, w64, b64, g64, r64 = (a.astype(np.float64) for a in (x, w, b, g, r))
        opts: dict[str, Any] = {}
        if test in ("pRMS", "bwd+"):
            opts = dict(partial=0.5, offset=1.0, eps_mode="outside", eps=1e-5)
        fopts = dict(
            k=int(d * opts.get("partial", 1.0)),
            eps=opts.get("eps", 1e-6),
            inside=opts.get("eps_mode", "inside") == "inside",
            offset=opts.get("offset", 0.0),
        )
        mk, rd = arr.make, arr.read
        tag = f"(n={n}, d={d})"

        def both(fn, *args, mk=mk, **kw):
            """Result of the backend under test and of the reference backend."""
            got = fn(*(mk(a) if a is not None else None for a in args), backend=backend, **kw)
            ref = fn(*args, backend="array_api", **kw)
            return got, ref

        if test in ("fwd", "pRMS", "llama"):
            bias = b if test == "pRMS" else None
            kw = dict(opts, casting="llama") if test == "llama" else opts
            got, ref = both(pn.rms_norm, x, w, bias, **kw)
            want = _formula(x64, w64, None if bias is None else b64, **fopts)
            worst = max(worst, _compare(
                {f"y vs float64 formula {tag}": (rd(got), want),
                 f"y vs reference {tag}": (rd(got), ref)}, tol))
        elif test == "add":
            (y, h), (yr, hr) = both(pn.add_rms_norm, x, r, w)
            h_want = (x64 + r64).astype(ndt).astype(np.float64)
            want = _formula(h_want, w64, None, **fopts)
            worst = max(worst, _compare(
                {f"h vs x + residual {tag}": (rd(h), h_want),
                 f"y vs float64 formula {tag}": (rd(y), want),
                 f"y vs reference {tag}": (rd(y), yr)}, tol))
        else:  # bwd, bwd+
            full = test == "bwd+"
            bias = b if full else None
            kw = dict(opts)
            if full:
                # rstd from the backend's own forward, and the fused-add gradient
                _, rstd = pn.rms_norm(mk(x), mk(w), mk(b), return_rstd=True, backend=backend, **opts)
                _, rstd_ref = pn.rms_norm(x, w, b, return_rstd=True, backend="array_api", **opts)
                got = pn.rms_norm_backward(mk(g), mk(x), mk(w), mk(b), rstd=rstd,
                                           grad_residual=mk(r), backend=backend, **kw)
                ref = pn.rms_norm_backward(g, x, w, b, rstd=rstd_ref, grad_residual=r,
                                           backend="array_api", **kw)
            else:
                got, ref = both(pn.rms_norm_backward, g, x, w, None, **kw)
            grads = _fd_grads if n * d <= _FD_MAX_ELEMENTS else _exact_grads
            how = "finite differences" if grads is _fd_grads else "float64 gradient"
            dx_w, dw_w, db_w = grads(x64, w64, None if bias is None else b64, g64, **fopts)
            if full:
                dx_w = dx_w + r64
            pairs = {f"dx vs {how} {tag}": (rd(got[0]), dx_w),
                     f"dweight vs {how} {tag}": (rd(got[1]), dw_w),
                     f"dx vs reference {tag}": (rd(got[0]), ref[0]),
                     f"dweight vs reference {tag}": (rd(got[1]), ref[1])}
            if full:
                pairs[f"dbias vs {how} {tag}"] = (rd(got[2]), db_w)
            worst = max(worst, _compare(pairs, tol))
    return worst


def _torch_cpu_arrays() -> _Arrays:
    """torch CPU tensors (bfloat16 through an int16 view): the DLPack route into Numba."""
    import torch

    def make(a):
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(a.copy())

    def read(t):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
        return t.numpy()

    return _Arrays(make, read)


def _backend_rows(backend: str, dtypes: list[str], label: str | None = None,
                  arr: _Arrays | None = None) -> list[Result]:
    """Every check of ``backend`` at ``dtypes``; ``label``/``arr``: another array library."""
    label = label or backend
    try:
        arr = arr or _arrays(backend)
    except ImportError as exc:  # e.g. the dask backend without dask.array
        return [Result(label, dt, t, None, detail=f"cannot make arrays: {exc}")
                for dt in dtypes for t in TESTS]
    supported = _supported_dtypes(backend, arr)
    rows = []
    for dt in dtypes:
        if dt not in supported:
            rows += [Result(label, dt, t, None, detail=f"{backend} has no {dt} here")
                     for t in TESTS]
            continue
        for t in TESTS:
            rng = np.random.default_rng([20261130, TESTS.index(t), FLOAT_DTYPES.index(dt)])
            try:
                err = _run_test(t, backend, dt, arr, rng)
                rows.append(Result(label, dt, t, True, err, TOL[dt]))
            except _Mismatch as m:
                rows.append(Result(label, dt, t, False, m.err, TOL[dt],
                                   f"{m.what}: error {m.err:.3g} > tolerance {TOL[dt]:.3g}"))
            except Exception as exc:  # a crash is a failure with its message, not a traceback
                where = traceback.extract_tb(exc.__traceback__)[-1]
                rows.append(Result(label, dt, t, False, detail=(
                    f"raised {type(exc).__name__}: {exc} "
                    f"(at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})")))
    return rows


# ------------------------------------------------------------------ public entry points


def run(backends: list[str] | None = None, dtypes: list[str] | None = None) -> list[Result]:
    """Check ``backends`` (default: all) at ``dtypes`` (default: all four).

    Unusable backends give one skipped row with the reason.  The Numba backend
    is also checked on torch CPU tensors (row ``numba+torch``) when torch is
    installed: the zero-copy route most torch users take.

    Examples
    --------
    >>> rows = run(["array_api"], ["float64"])
    >>> all(r.ok for r in rows), len(rows) == len(TESTS)
    (True, True)
    """
    report = pn.backends()
    names = list(report) if backends is None else backends
    dts = list(FLOAT_DTYPES) if dtypes is None else dtypes
    rows: list[Result] = []
    for name in names:
        usable, reason = report[name]
        if not usable:
            rows.append(Result(name, "-", "-", None, detail=reason))
            continue
        rows += _backend_rows(name, dts)
        if name == "numba" and importlib.util.find_spec("torch") is not None:
            rows += _backend_rows(name, dts, "numba+torch", _torch_cpu_arrays())
    return rows


def failed(rows: list[Result]) -> bool:
    """True when any check ran and failed."""
    return any(r.ok is False for r in rows)


def format_rows(rows: list[Result]) -> str:
    """A pass/fail table (backend x dtype rows, one column per check) and the failures."""
    cells = {"True": "ok", "False": "FAIL", "None": "skip"}
    head = ["backend", "dtype", *TESTS, "max err/tol"]
    table = [head]
    skipped: list[str] = []
    seen: dict[tuple[str, str], dict[str, Result]] = {}
    for r in rows:
        if r.test == "-":
            skipped.append(f"  {r.backend}: not usable here ({r.detail})")
            continue
        seen.setdefault((r.backend, r.dtype), {})[r.test] = r
    for (be, dt), by_test in seen.items():
        ratios = [r.err / r.tol for r in by_test.values() if r.ok and math.isfinite(r.err)]
        table.append([be, dt, *(cells[str(by_test[t].ok)] if t in by_test else "-" for t in TESTS),
                      f"{max(ratios):.2f}" if ratios else "-"])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in table]
    fails = [f"  {r.backend} {r.dtype} {r.test}: {r.detail}" for r in rows if r.ok is False]
    notes = sorted({f"  {r.backend} {r.dtype}: {r.detail}" for r in rows
                    if r.ok is None and r.test != "-"})
    if skipped:
        lines += ["", "skipped backends:", *skipped]
    if notes:
        lines += ["", "skipped dtypes:", *notes]
    if fails:
        lines += ["", "FAILURES:", *fails]
    n_ok = sum(r.ok is True for r in rows)
    n_bad = sum(r.ok is False for r in rows)
    lines += ["", f"{n_ok} checks passed, {n_bad} failed" + (
        "" if rows else " (nothing to check)")]
    return "\n".join(lines)
