"""RMSNorm with quantized output for torch (re-exported by :mod:`polynorm.torch`).

One custom op, ``torch.ops.polynorm.rms_norm_quant``, with a fake
implementation, so that ``torch.compile(fullgraph=True)`` keeps it in its
graph; eager calls and compiled ones run the same kernel (the same bits).
Inference only: the op has no autograd formula (``q`` is not differentiable).
``torch.vmap`` and ``torch.jit.trace`` run the op (it has a vmap rule).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from polynorm.core.options import (
    SCALE_MODES,
    NormOptions,
    Options,
    pack_options,
    takes_options,
)
from polynorm.ops import quant as _quant

if TYPE_CHECKING:
    from typing_extensions import Unpack
from polynorm.torch._custom_ops import (
    _OPTS,
    _fake_checks,
    _from_op,
    _front,
    _op_args,
    _vmap_loop,
    _vmapped_opts,
)

__all__ = ["rms_norm_quant"]

_QDTYPES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
            torch.int8: "int8"}


def _qdtype(dtype: Any) -> torch.dtype:
    from polynorm.core.options import parse_quant_dtype

    if isinstance(dtype, torch.dtype) and dtype in _QDTYPES:
        return dtype
    return getattr(torch, parse_quant_dtype(dtype))


@torch.library.custom_op(
    "polynorm::rms_norm_quant", mutates_args=(),
    schema=f"(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, Tensor? scale, "
    f"float? scale_value, ScalarType dtype, int? scale_group_size, str scale_mode, {_OPTS}) "
    "-> (Tensor, Tensor, Tensor)",
)
def _quant_op(x, weight, bias, residual, scale, scale_value, dtype, group_size, scale_mode,
              *opts):
    # every option by its field, so that a new one is not dropped here
    o = _from_op(opts)._asdict()
    del o["out_dtype"]
    del o["group_size"]  # the op's own group_size (the scales') is the function's
    out = _quant.rms_norm_quant(
        x, weight, bias, residual=residual, dtype=_QDTYPES[dtype],
        scale=scale if scale is not None else scale_value, group_size=group_size,
        scale_mode=scale_mode, **o,
    )
    h = out[2].contiguous() if residual is not None else x.new_empty(0)
    return out[0].contiguous(), out[1].contiguous(), h


@_quant_op.register_fake
def _(x, weight, bias, residual, scale, scale_value, dtype, group_size, scale_mode, *opts):
    from polynorm.ops.norm import _normalize_axis

    _, _, batch = _fake_checks(x, x.dtype, opts)
    if scale is not None or scale_value is not None:
        s_shape: list = []
    elif group_size is None:
        s_shape = batch
    else:
        d = math.prod(x.shape[a] for a in _normalize_axis(tuple(Options(*opts).axis), x.ndim))
        s_shape = [*batch, d // group_size]
    if residual is None:
        h = x.new_empty(0)
    else:
        from polynorm.torch._custom_ops import _fake_add

        h = x.new_empty(x.shape, dtype=_fake_add(x, residual, opts)[1])
    return (x.new_empty(x.shape, dtype=dtype), x.new_empty(s_shape, dtype=torch.float32), h)


@_quant_op.register_vmap
def _(info, in_dims, x, weight, bias, residual, scale, scale_value, dtype, group_size,
      scale_mode, *opts):
    xd, wd, bd, rd, sd = in_dims[:5]
    if wd is not None or bd is not None or sd is not None:
        return _vmap_loop(_quant_op, info, in_dims, x, weight, bias, residual, scale,
                          scale_value, dtype, group_size, scale_mode, *opts)
    n = info.batch_size
    out = _quant_op(_front(x, xd, n), weight, bias, _front(residual, rd, n), scale, scale_value,
                    dtype, group_size, scale_mode,
                    *_vmapped_opts(opts, x.ndim - (xd is not None)))
    static = scale is not None or scale_value is not None  # one scale, not one per token
    return out, (0, None if static else 0, None if residual is None else 0)


@takes_options(exclude=("out_dtype",))
def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    dtype: Any = torch.float8_e4m3fn,
    scale: float | torch.Tensor | None = None,
    group_size: int | None = None,
    scale_mode: str = "divide",
    **options: Unpack[NormOptions],
) -> tuple[torch.Tensor, ...]:
    """:func:`polynorm.rms_norm_quant` as a torch custom op (``torch.compile``-able).

    Parameters
    ----------
    x, weight, bias, residual : torch.Tensor
        As in :func:`polynorm.rms_norm_quant`.
    dtype : torch.float8_e4m3fn, torch.float8_e5m2 or torch.int8 (or their names)
    scale : float or torch.Tensor, optional
        A static scale: a float (a constant of a compiled graph) or a
        one-element float tensor (an input of it).
    group_size : int, optional
        As in :func:`polynorm.rms_norm_quant`.
    scale_mode : str
        As in :func:`polynorm.rms_norm_quant`.
    {options}

    Returns
    -------
    (q, scales) or (q, scales, h)

    Examples
    --------
    >>> import torch
    >>> import polynorm.torch as pt
    >>> f = torch.compile(lambda x: pt.rms_norm_quant(x, group_size=4), fullgraph=True)
    >>> q, s = f(torch.randn(3, 8))
    >>> q.dtype, tuple(s.shape)
    (torch.float8_e4m3fn, (3, 2))
    """
    st = scale if isinstance(scale, torch.Tensor) else None
    sv = None if scale is None or st is not None else scale
    if sv is not None and not isinstance(sv, float):
        from polynorm.core.options import _check_real

        sv = _check_real("scale", sv)
    if not (isinstance(scale_mode, str) and scale_mode in SCALE_MODES):
        # the schema's str would reject a non-string with a message that names no argument
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    opts = pack_options("rms_norm_quant", options, out_dtype=None)
    q, s, h = torch.ops.polynorm.rms_norm_quant(
        x, weight, bias, residual, st, sv, _qdtype(dtype), group_size, scale_mode,
        *_op_args(opts))
    return (q, s) if residual is None else (q, s, h)
