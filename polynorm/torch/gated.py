"""Differentiable gated RMSNorm for torch (re-exported by :mod:`polynorm.torch`).

One custom op pair, ``torch.ops.polynorm.rms_norm_gated`` and
``.rms_norm_gated_backward``, with fake implementations and the
hand-written backward (:func:`polynorm.rms_norm_gated_backward`, fed the
forward's ``rstd``) registered through ``register_autograd``: eager calls
and ``torch.compile(fullgraph=True)`` run the same op, so the same bits.
``torch.func`` and ``torch.jit.trace`` work as for :func:`polynorm.torch.rms_norm`
(vmap rules; an ``autograd.Function`` with ``setup_context`` under ``torch.func``);
second derivatives and forward-mode AD raise ``NotImplementedError``.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.forward_ad as _forward_ad

from polynorm.core.options import NormOptions, Options, pack_options, takes_options
from polynorm.ops import gated as _gated

if TYPE_CHECKING:
    from typing_extensions import Unpack
from polynorm.torch._custom_ops import (
    _NOPTS,
    _OPTS,
    _fake_checks,
    _from_op,
    _front,
    _function,
    _functorch,
    _no_context,
    _op_args,
    _refuse_second_order,
    _vmap_loop,
    _vmapped_opts,
)
from polynorm.torch.norm import rms_norm as _rms_norm

__all__ = ["rms_norm_gated", "RMSNormGated"]

# the op's own group_size under another name: the options' schema has a group_size too
# (the plain norm's), and torch.compile refuses duplicate argument names
_GATE = "int? gate_group_size, bool norm_before_gate"


def _rstd_shape(x, axis, group_size, batch):
    from polynorm.ops.norm import _normalize_axis

    if group_size is None:
        return batch
    d = math.prod(x.shape[a] for a in _normalize_axis(tuple(axis), x.ndim))
    return [*batch, d // group_size]


@torch.library.custom_op(
    "polynorm::rms_norm_gated", mutates_args=(),
    schema=f"(Tensor x, Tensor z, Tensor? weight, Tensor? bias, {_GATE}, {_OPTS}) "
    "-> (Tensor, Tensor)",
)
def _gated_op(x, z, weight, bias, group_size, norm_before_gate, *opts):
    y, rstd = _gated.gated_forward(x, z, weight, bias, _from_op(opts), group_size=group_size,
                                   norm_before_gate=norm_before_gate, return_rstd=True)
    return y.contiguous(), rstd.contiguous()


@_gated_op.register_fake
def _(x, z, weight, bias, group_size, norm_before_gate, *opts):
    y_dtype, r_dtype, batch = _fake_checks(x, x.dtype, opts)
    return (x.new_empty(x.shape, dtype=y_dtype),
            x.new_empty(_rstd_shape(x, Options(*opts).axis, group_size, batch), dtype=r_dtype))


@torch.library.custom_op(
    "polynorm::rms_norm_gated_backward", mutates_args=(),
    schema=f"(Tensor dy, Tensor x, Tensor z, Tensor? weight, Tensor? bias, Tensor? rstd, "
    f"{_GATE}, {_OPTS}) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _gated_backward_op(dy, x, z, weight, bias, rstd, group_size, norm_before_gate, *opts):
    dx, dz, dw, db = _gated.gated_backward(dy, x, z, weight, bias, rstd, _from_op(opts),
                                           group_size=group_size,
                                           norm_before_gate=norm_before_gate)
    return (dx.contiguous(), dz.contiguous(),
            x.new_empty(0) if dw is None else dw.contiguous(),
            x.new_empty(0) if db is None else db.contiguous())


@_gated_backward_op.register_fake
def _(dy, x, z, weight, bias, rstd, group_size, norm_before_gate, *opts):
    return (x.new_empty(x.shape), z.new_empty(z.shape),
            x.new_empty(0) if weight is None else weight.new_empty(weight.shape),
            x.new_empty(0) if bias is None else bias.new_empty(bias.shape))


def _setup(ctx, inputs, output):
    x, z, weight, bias, group_size, norm_before_gate, *opts = inputs
    ctx.save_for_backward(x, z, weight, bias, output[1])
    ctx.opts = (group_size, norm_before_gate, *Options(*opts)._replace(out_dtype=None))
    ctx.mark_non_differentiable(output[1])


def _bwd(ctx, dy, _drstd):
    x, z, weight, bias, rstd = ctx.saved_tensors
    # grad on (create_graph=True, torch.func): a node refusing a second derivative
    bwd = _GatedBackwardFn.apply if torch.is_grad_enabled() else _gated_backward_op
    dx, dz, dw, db = bwd(dy.contiguous(), x, z, weight, bias, rstd, *ctx.opts)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dz if need[1] else None,
            dw if weight is not None and need[2] else None,
            db if bias is not None and need[3] else None, *(None,) * (2 + _NOPTS))


_gated_op.register_autograd(_bwd, setup_context=_setup)


@_gated_op.register_vmap
def _(info, in_dims, x, z, weight, bias, group_size, norm_before_gate, *opts):
    xd, zd, wd, bd = in_dims[:4]
    if wd is not None or bd is not None:
        return _vmap_loop(_gated_op, info, in_dims, x, z, weight, bias, group_size,
                          norm_before_gate, *opts)
    n = info.batch_size
    out = _gated_op(_front(x, xd, n), _front(z, zd, n), weight, bias, group_size,
                    norm_before_gate, *_vmapped_opts(opts, x.ndim - (xd is not None)))
    return out, (0, 0)


_gated_backward_op.register_vmap(functools.partial(_vmap_loop, _gated_backward_op))
_gated_backward_op.register_autograd(_refuse_second_order("rms_norm_gated"),
                                     setup_context=_no_context)
_GatedBackwardFn = _function("_GatedBackwardFn", _gated_backward_op, _no_context,
                             _refuse_second_order("rms_norm_gated"), "rms_norm_gated's backward")
_GatedFn = _function("_GatedFn", _gated_op, _setup, _bwd, "rms_norm_gated")


@takes_options()
def rms_norm_gated(
    x: torch.Tensor,
    z: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    **options: Unpack[NormOptions],
) -> torch.Tensor:
    """Differentiable :func:`polynorm.rms_norm_gated` (gradients for x, z, weight, bias).

    Parameters
    ----------
    x, z, weight, bias : torch.Tensor
        As in :func:`polynorm.rms_norm_gated`; any of them may require grad.
    group_size : int, optional
        As in :func:`polynorm.rms_norm_gated`.
    norm_before_gate : bool
        As in :func:`polynorm.rms_norm_gated`.
    {options}

    Returns
    -------
    torch.Tensor
        ``y``; its backward is :func:`polynorm.rms_norm_gated_backward` (a custom op,
        so ``torch.compile(fullgraph=True)`` keeps it).

    Examples
    --------
    >>> import torch
    >>> import polynorm.torch as pt
    >>> x = torch.randn(2, 8, requires_grad=True)
    >>> z = torch.randn(2, 8, requires_grad=True)
    >>> pt.rms_norm_gated(x, z, group_size=4).sum().backward()
    >>> x.grad.shape, z.grad.shape
    (torch.Size([2, 8]), torch.Size([2, 8]))
    """
    opts = pack_options("rms_norm_gated", options)
    if z is None:  # Mamba's RMSNormGated(z=None): the grouped norm, no gate
        return _rms_norm(x, weight, bias,
                        **_gated.ungated_options(opts, group_size, norm_before_gate)._asdict())
    args = (x, z, weight, bias, group_size, bool(norm_before_gate), *_op_args(opts))
    # torch.func and forward-mode AD: the Function (the op's own autograd has no
    # setup_context for torch.func, and no jvp to refuse forward mode clearly)
    if _functorch() or (not torch.compiler.is_compiling() and _forward_ad._current_level >= 0):
        return _GatedFn.apply(*args)[0]
    return torch.ops.polynorm.rms_norm_gated(*args)[0]


class RMSNormGated(torch.nn.Module):
    """Gated RMSNorm module (Mamba-2's ``RMSNormGated``): ``forward(x, z)``.

    Parameters
    ----------
    hidden_size : int
        The size of the last axis (the normalized one).
    eps : float
    group_size : int, optional
    norm_before_gate : bool
        ``False`` is Mamba-2's default; Qwen3-Next uses ``True``.
    device, dtype
        Of the weight (initialised to ones).
    **options
        The keyword options of :func:`rms_norm_gated` (``offset``, ``casting``,
        ``out_dtype``, ...), passed to every forward; ``eps`` is the module's and
        the normalized axis is the last.

    Examples
    --------
    >>> import torch
    >>> from polynorm.torch import RMSNormGated
    >>> m = RMSNormGated(8, group_size=4)
    >>> m(torch.randn(3, 8), torch.randn(3, 8)).shape
    torch.Size([3, 8])
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, group_size: int | None = None,
                 norm_before_gate: bool = False, *, device: Any = None, dtype: Any = None,
                 **options: Unpack[NormOptions]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        pack_options("RMSNormGated", options, eps=eps, axis=-1)
        self.options = dict(options)
        if group_size is not None and hidden_size % group_size:
            raise ValueError(f"group_size={group_size} must divide hidden_size={hidden_size}")

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return rms_norm_gated(x, z, self.weight, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate, eps=self.eps,
                              **self.options)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}")
