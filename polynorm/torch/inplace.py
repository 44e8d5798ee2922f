"""The in-place fused add for torch: :func:`add_rms_norm_` and ``polynorm::add_rms_norm_``.

The op declares its mutation in its schema (``Tensor(a!) x, Tensor(b!)
residual``, ``torch.library`` ``mutates_args``), as vLLM's
``fused_add_rms_norm`` and FlashInfer's ``fused_add_rmsnorm`` do, so
``torch.compile`` (functionalization) and CUDA graphs see that ``x`` and
``residual`` change.  It is for inference: it records no autograd history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from polynorm.core.options import (
    Options,
    TorchOptions,
    make_plan,
    pack_options,
    promote,
    takes_options,
)
from polynorm.ops import norm as _api
from polynorm.torch._custom_ops import _DTYPE_NAMES, _NOPTS, _OPTS, _from_op, _op_args
from polynorm.torch.norm import _EPS_DOC_ADD, _check_tensors, _default_eps, _eager

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["add_rms_norm_"]


@torch.library.custom_op(
    "polynorm::add_rms_norm_", mutates_args=("x", "residual"),
    schema=f"(Tensor(a!) x, Tensor(b!) residual, Tensor? weight, Tensor? bias, {_OPTS}) -> ()",
)
def _add_rms_norm_op_(x, residual, weight, bias, *args):
    _api.add_rms_norm_(x, residual, weight, bias, **_from_op(args[:_NOPTS])._asdict())


@_add_rms_norm_op_.register_fake
def _(x, residual, weight, bias, *args):
    # the checks that need no data: the dtypes that x and residual must receive
    opts = Options(*args[:_NOPTS])
    xn, rn = _DTYPE_NAMES.get(x.dtype), _DTYPE_NAMES.get(residual.dtype)
    if xn is None or rn is None:
        bad = "x" if xn is None else "residual"
        raise TypeError(f"{bad} must have a floating dtype, got "
                        f"{x.dtype if xn is None else residual.dtype}")
    if x.shape != residual.shape:
        raise ValueError(f"residual must have shape {tuple(x.shape)} (the shape of x), "
                         f"got {tuple(residual.shape)}")
    d = x.shape[-1] if x.ndim else 1
    if isinstance(d, int) and len(opts.axis) == 1 and opts.axis[0] in (-1, x.ndim - 1):
        plan = make_plan(d, promote(xn, rn), _from_op(args[:_NOPTS]))
        if plan.out_dtype != xn or plan.h_dtype != rn:
            bad = "x" if plan.out_dtype != xn else "residual"
            raise TypeError(f"{bad} cannot receive its result in place (y: {plan.out_dtype}, "
                            f"h: {plan.h_dtype}; x: {xn}, residual: {rn})")


@takes_options(docs={"eps": _EPS_DOC_ADD})
def add_rms_norm_(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    **options: Unpack[TorchOptions],
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`polynorm.add_rms_norm_` for torch: ``residual <- x + residual``,
    ``x <- y``, through the custom op ``torch.ops.polynorm.add_rms_norm_``.

    vLLM's ``fused_add_rms_norm(input, residual, weight, epsilon)`` and
    FlashInfer's ``fused_add_rmsnorm``, with the bits of
    :func:`polynorm.add_rms_norm`.  Works eagerly and under ``torch.compile``
    (``fullgraph=True``: the op's schema marks ``x`` and ``residual`` as
    mutated); eager calls skip the op's dispatch (~90 us) and bump the
    tensors' version counters themselves.  Inference only: no autograd history is recorded, so ``x`` and
    ``residual`` must not require grad while grad mode is on.

    Parameters
    ----------
    x, residual : torch.Tensor
        Receive ``y`` and ``h``; see :func:`polynorm.add_rms_norm_` for the
        dtype and memory rules.
    weight, bias : torch.Tensor, optional
    {options}

    Returns
    -------
    (x, residual)
        The tensors passed (the op itself returns nothing, as vLLM's).

    Examples
    --------
    >>> import torch
    >>> from polynorm.torch import add_rms_norm_
    >>> x, residual = torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 2.0]])
    >>> _ = add_rms_norm_(x, residual, eps=0.0)
    >>> residual, x
    (tensor([[3., 4.]]), tensor([[0.8485, 1.1314]]))
    """
    if residual is None:
        raise TypeError("residual must be a tensor, got None")
    _check_tensors(x=x, residual=residual, weight=weight, bias=bias)
    opts = pack_options("add_rms_norm_", options)
    if opts.eps is None:
        opts = opts._replace(eps=_default_eps(None, x.dtype, residual.dtype))
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad):
        bad = "x" if x.requires_grad else "residual"
        raise ValueError(f"{bad} requires grad: add_rms_norm_ overwrites it and records no "
                         "autograd history; use polynorm.torch.add_rms_norm for training")
    if _eager(x):
        # the op's eager dispatch of a mutating op costs ~90 us; the same call straight,
        # with the version counters bumped as the op's dispatch bumps them
        _api.add_rms_norm_(x, residual, weight, bias, **opts._asdict())
        torch.autograd.graph.increment_version((x, residual))
        return x, residual
    torch.ops.polynorm.add_rms_norm_(x, residual, weight, bias, *_op_args(opts))
    return x, residual
