"""The front end's fast path for ``backend="array_api"``: numpy arrays and torch CPU tensors.

A (1, 4096) call of the reference costs its library a few microseconds of work; the
general path's namespace, device and layout checks and the reference's own per-step
wrapping cost ten times that.  Here a plain call (``rms_norm``, no residual and no
``out``, ``axis=-1``, a C-contiguous ``x`` of one or more tokens, ``weight``/``bias``
absent or contiguous vectors of ``x``'s library, dtype and device checks passing
trivially) goes with the cached :class:`~polynorm.core.options.Plan` to
:func:`polynorm.backends.reference.eager_forward`, which gives the reference's bits.
As in :mod:`polynorm.ops.fast`, only the valid, simple case is taken: anything else
returns ``None`` and the general path of :mod:`polynorm.ops.norm` runs, with every
check and message its own.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from polynorm.backends import reference as _ref
from polynorm.core.options import Options, make_plan
from polynorm.ops.fast import _NAMES, _names

__all__ = ["forward"]

#: [{torch dtype: name}, torch.Tensor, torch.nn.Parameter, torch.no_grad, whether a
#: functorch transform or a jit trace is running] once torch is seen
_TORCH: list = []


def _torch_state() -> list:
    if not _TORCH:
        torch = sys.modules["torch"]
        names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                 torch.float64: "float64"}
        functorch = torch._C._are_functorch_transforms_active
        tracing = torch._C._is_tracing

        def transformed() -> bool:
            # wrapped tensors (torch.func) have no memory for numpy to view, and a jit
            # trace would keep a token's rstd as a constant: the general path runs
            return functorch() or tracing()

        _TORCH.extend([names, torch.Tensor, torch.nn.Parameter, torch.no_grad, transformed])
    return _TORCH


def _np_vector(a: Any, d: int, names: dict) -> bool:
    return (type(a) is np.ndarray and a.ndim == 1 and a.shape[0] == d
                         and a.dtype in names and a.flags.c_contiguous)


def _torch_vector(a: Any, d: int, st: list) -> bool:
    return ((type(a) is st[1] or type(a) is st[2]) and a.is_cpu
                         and a.dim() == 1 and a.shape[0] == d and a.dtype in st[0]
                         and a.is_contiguous())


def forward(x: Any, weight: Any, bias: Any, return_rstd: bool, opts: Options) -> Any:
    """``rms_norm``'s result for a call the fast path takes, else None."""
    axis = opts.axis
    if axis.__class__ is not int or axis != -1 or opts.residual_dtype is not None:
        return None  # residual_dtype without a residual: the general path's error
    tx = type(x)
    if tx is np.ndarray:
        names = _NAMES if len(_NAMES) == 4 else _names()
        dtype = names.get(x.dtype)
        if dtype is None or not x.flags.c_contiguous:
            return None
        shape = x.shape
        if (len(shape) == 0 or (weight is not None and not _np_vector(weight, shape[-1], names))
                or (bias is not None and not _np_vector(bias, shape[-1], names))):
            return None
        eager = _ref.eager_numpy
        grad = False
    else:
        st = _TORCH
        if not st:
            if tx.__module__ != "torch" or tx.__name__ != "Tensor":
                return None
            st = _torch_state()
        if tx is not st[1]:
            return None
        dtype = st[0].get(x.dtype)
        if dtype is None or not x.is_cpu or not x.is_contiguous() or st[4]():
            return None
        shape = x.shape
        if (len(shape) == 0 or (weight is not None and not _torch_vector(weight, shape[-1], st))
                or (bias is not None and not _torch_vector(bias, shape[-1], st))):
            return None
        eager = _ref.eager_torch
        grad = (x.requires_grad or (weight is not None and weight.requires_grad)
                or (bias is not None and bias.requires_grad))
    d = shape[-1]
    two_d = len(shape) == 2
    n = shape[0] if two_d else math.prod(shape[:-1])
    if n == 0 or d == 0 or opts.group_size is not None:
        return None  # the general path's empty results; its groups
    try:
        plan = make_plan(d, dtype, opts)
    except (TypeError, ValueError):
        return None  # the general path raises it, in its own order
    if plan.llama or plan.cast_none:
        return None
    x2 = x if two_d else x.reshape(n, d)
    if grad:
        with _TORCH[3]():  # no history, as the general path (polynorm.torch is for training)
            r = eager(x2, weight, bias, plan, return_rstd)
    else:
        r = eager(x2, weight, bias, plan, return_rstd)
    if r is None:
        return None
    if two_d:
        return r if return_rstd else r[0]
    y = r[0].reshape(shape)
    return (y, r[1].reshape(shape[:-1])) if return_rstd else y
