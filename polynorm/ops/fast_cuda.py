"""The front end's fast path for torch CUDA tensors, straight to the cupy backend.

A small call's time on a GPU is its host work: the kernels of a (4096, 1024)
forward take ~13 us, the general path's array-API machinery (namespace and
device checks, layout, dtype lookups) tens of microseconds more.  Here plain
torch CUDA tensors on one device, ``axis=-1``, no ``out`` and ``backend`` left
at ``"auto"`` (or ``"cupy"``) go to :mod:`polynorm.backends.cuda` with the
:class:`~polynorm.core.options.Plan` and nothing else.  As in :mod:`polynorm.ops.fast`,
only the valid, simple case is taken: anything else returns ``None`` and the
general path of :mod:`polynorm.ops.norm` runs, with every check and message its own.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from polynorm import backends as _backends
from polynorm.core.options import Options, promote
from polynorm.ops import fast as _fast
from polynorm.ops.fast import _plan

__all__ = ["forward", "backward"]

#: call key (:func:`_key`) -> Record, or False: no record for such calls (the backend's
#: general code runs them)
_RECORDS: dict = {}
#: most keys kept (shapes come and go: decode steps, ragged batches)
RECORDS_MAX = 1024

#: [torch, {torch dtype: name}, (Tensor, Parameter), cupy backend module] once usable
_STATE: list = []


def _state() -> list | None:
    if _STATE:
        return _STATE
    torch = sys.modules.get("torch")  # a torch tensor exists, so torch is imported
    if torch is None or not _backends.usable("cupy"):
        return None
    names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
             torch.float64: "float64"}
    _STATE.extend([torch, names, (torch.Tensor, torch.nn.Parameter), _backends.get("cupy")])
    return _STATE


def _takes(opts: Options) -> bool:
    backend, axis = opts.backend, opts.axis
    return (backend.__class__ is str and backend in ("auto", "cupy")
            and axis.__class__ is int and axis == -1)


def _vector(a: Any, d: int, dev: Any, st: list) -> bool:
    """weight/bias the fast path takes: absent, or a (d,) float tensor on ``dev``."""
    return a is None or (type(a) in st[2] and a.device == dev and a.dim() == 1 and a.shape[0] == d
                         and a.dtype in st[1])


def _like(a: Any, x: Any, st: list) -> bool:
    """residual/dy/grad_residual: absent, or a float tensor of x's shape on x's device."""
    return a is None or (type(a) is st[2][0] and a.device == x.device and a.shape == x.shape
                         and a.dtype in st[1])


def _rows(a: Any, n: int, d: int) -> Any:
    """``a`` as (n, d) rows without a copy, or None (the general path copies)."""
    if a is None or a.dim() == 2:
        return a
    return a.view(n, d) if a.is_contiguous() else None


def _on_device(x: Any) -> bool:
    return x.is_cuda


def _head(x: Any, weight: Any, bias: Any, st: list) -> tuple | None:
    """``(dtype name, d, n)`` of a torch CUDA ``x`` the fast path takes, else None."""
    if type(x) is not st[2][0] or not _on_device(x) or x.dim() == 0:
        return None
    dtype = st[1].get(x.dtype)
    d = x.shape[-1]
    if dtype is None or d == 0:
        return None
    n = x.numel() // d
    dev = x.device
    if n == 0 or not (_vector(weight, d, dev, st) and _vector(bias, d, dev, st)):
        return None
    return dtype, d, n


def forward(x, residual, weight, bias, out, return_rstd: bool, opts: Options, fused: bool):
    """``rms_norm``/``add_rms_norm`` on torch CUDA tensors, or None for the general path."""
    if out is not None:
        return None
    key = _key(opts, x, residual, weight, bias)
    rec = _RECORDS.get(key) if key is not None else None
    if rec:
        r = _run(rec, x, [x, residual, weight, bias])
        if r is not None:
            y, h, rstd = r
            if fused:
                return (y, h, rstd) if return_rstd else (y, h)
            return (y, rstd) if return_rstd else y
    return _forward(x, residual, weight, bias, return_rstd, opts, fused, key if rec is None else None)


def _forward(x, residual, weight, bias, return_rstd: bool, opts: Options, fused: bool, key):
    """The checked fast path; ``key``: where to keep the record of such calls (None: not now)."""
    if not _takes(opts):
        return None
    st = _state()
    if st is None:
        return None
    head = _head(x, weight, bias, st)
    if head is None or not _like(residual, x, st):
        return None
    dtype, d, n = head
    if residual is not None:
        dtype = promote(dtype, st[1][residual.dtype])
    plan = _plan(d, dtype, opts)
    x2, r2 = _rows(x, n, d), _rows(residual, n, d)
    if plan is None or x2 is None or (residual is not None and r2 is None):
        return None
    if _fast._apart(plan, residual, opts):
        return None
    if key is not None:
        rec = _remember(key, lambda hp: hp.forward_record(x2, r2, weight, bias, plan, x.shape))
        if rec:
            r = _run(rec, x, [x, residual, weight, bias])
            if r is not None:
                y, h, rstd = r
                if fused:
                    return (y, h, rstd) if return_rstd else (y, h)
                return (y, rstd) if return_rstd else y
    y, h, rstd = st[3].forward(x2, r2, weight, bias, plan)
    shape = x.shape
    if len(shape) != 2:
        y = y.view(shape)
        h = None if h is None else h.view(shape)
    rstd = rstd.view(shape[:-1])
    if fused:
        return (y, h, rstd) if return_rstd else (y, h)
    return (y, rstd) if return_rstd else y


def backward(dy, x, weight, bias, rstd, grad_residual, opts: Options):
    """``rms_norm_backward`` on torch CUDA tensors, or None for the general path."""
    key = _key(opts, x, weight, bias, dy, rstd, grad_residual)
    rec = _RECORDS.get(key) if key is not None else None
    if rec:
        r = _run(rec, x, [dy, x, weight, rstd, grad_residual])
        if r is not None:
            return tuple(r)
    return _backward(dy, x, weight, bias, rstd, grad_residual, opts, key if rec is None else None)


def _backward(dy, x, weight, bias, rstd, grad_residual, opts: Options, key):
    """The checked fast path of :func:`backward` (``key`` as in :func:`_forward`)."""
    if not _takes(opts):
        return None
    st = _state()
    if st is None:
        return None
    head = _head(x, weight, bias, st)
    if head is None or not (_like(dy, x, st) and dy is not None and _like(grad_residual, x, st)):
        return None
    dtype, d, n = head
    plan = _plan(d, dtype, opts)
    if plan is None:
        return None
    if rstd is not None and not (type(rstd) is st[2][0] and rstd.device == x.device
                                 and rstd.shape == x.shape[:-1]
                                 and st[1].get(rstd.dtype) == plan.rstd_dtype):
        return None
    x2, dy2, g2 = _rows(x, n, d), _rows(dy, n, d), _rows(grad_residual, n, d)
    if x2 is None or dy2 is None or (grad_residual is not None and g2 is None):
        return None
    if key is not None:
        rec = _remember(key, lambda hp: hp.backward_record(dy2, x2, weight, bias, rstd, g2, plan,
                                                           x.shape))
        if rec:
            r = _run(rec, x, [dy, x, weight, rstd, grad_residual])
            if r is not None:
                return tuple(r)
    r1 = None if rstd is None else rstd.reshape(n)
    dx, dw, db = st[3].backward(dy2, x2, weight, bias, r1, g2, plan)
    return (dx if x.dim() == 2 else dx.view(x.shape)), dw, db


# ------------------------------------------------------------------ launch records

#: the exact scalar types an option may have in a key: a ``True`` must not find the
#: record of a ``1`` (equal keys), which make_plan would refuse
_EXACT = (float, int, str, type(None))


def _tkey(a: Any) -> tuple | None:
    if a is None:
        return None
    return (a.__class__, a.dtype, a.shape, a.stride(), a.get_device())


#: id -> Options object whose fields are all of the exact types (the object kept, so
#: its id is not reused): pack_options hands the default and each eps-only call the
#: same object, checked once
_EXACT_OPTS: dict[int, Options] = {}


def _key(opts: Options, *arrays: Any) -> tuple | None:
    """Everything the fast path checks a call on, or None where a key would not say it
    (options of other types than the exact scalar ones)."""
    if _EXACT_OPTS.get(id(opts)) is not opts:
        for v in opts:
            if v.__class__ not in _EXACT:
                return None
        if len(_EXACT_OPTS) >= 64:
            _EXACT_OPTS.clear()
        _EXACT_OPTS[id(opts)] = opts
    try:
        return (opts, *(_tkey(a) for a in arrays))
    except (AttributeError, TypeError):
        return None


_HOSTPATH: list = []


def _hostpath():
    """:mod:`polynorm.backends.cuda.hostpath`, or None where records cannot launch."""
    if not _HOSTPATH:
        from polynorm.backends.cuda import hostpath

        _HOSTPATH.append(hostpath if hostpath.available() else None)
    return _HOSTPATH[0]


def _remember(key: tuple, build) -> Any:
    """The record ``build(hostpath)`` makes for calls of ``key`` (False: none), kept.
    Records are the cupy backend's launches: none where another module stands in for it."""
    hp = _hostpath()
    ok = hp is not None and _STATE[3] is hp.backend
    rec = (build(hp) or False) if ok else False
    if len(_RECORDS) >= RECORDS_MAX:
        _RECORDS.clear()
    _RECORDS[key] = rec
    return rec


def _stream(torch: Any, dev: int) -> int:
    """torch's current stream on device ``dev`` (a raw pointer: ~0.3 us against
    ``torch.cuda.current_stream``'s ~5)."""
    return torch._C._cuda_getCurrentRawStream(dev)


def _current_device(torch: Any) -> int:
    return torch._C._cuda_getDevice()


def _run(rec: Any, x: Any, inputs: list) -> list | None:
    """``rec``'s results for ``inputs``, or None where the current device is not ``x``'s
    (the record launches in the current context; the backend's own call switches) or
    while the backend records its launches (``cuda.recording``: the bench's replays)."""
    torch = _STATE[0]
    dev = x.get_device()
    if _current_device(torch) != dev or _STATE[3]._recorded is not None:
        return None
    try:
        return rec(inputs, _stream(torch, dev))
    except RuntimeError as exc:
        from polynorm.backends.cuda import hostpath

        if not isinstance(exc, hostpath.LaunchError):
            raise
        # the backend's own call runs it (and raises what is the device's fault); a thread
        # without a current context gets one there, any other refusal turns records off
        if exc.code != hostpath.INVALID_CONTEXT:
            warnings.warn(f"{exc}; polynorm launches through cupy from now on", RuntimeWarning,
                          stacklevel=4)
            _HOSTPATH[:] = [None]
            _RECORDS.clear()
        return None
