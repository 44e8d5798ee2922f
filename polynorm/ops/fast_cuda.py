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
from typing import Any

from polynorm import backends as _backends
from polynorm.core.options import Options, promote
from polynorm.ops import fast as _fast
from polynorm.ops.fast import _plan

__all__ = ["forward", "backward"]

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
    if out is not None or not _takes(opts):
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
    r1 = None if rstd is None else rstd.reshape(n)
    dx, dw, db = st[3].backward(dy2, x2, weight, bias, r1, g2, plan)
    return (dx if x.dim() == 2 else dx.view(x.shape)), dw, db
