"""Differentiable RMSNorm for torch: autograd functions and an ``nn.Module``.

:func:`polynorm.rms_norm` on a tensor computes on its data and records no
autograd history.  For training use this module: :func:`rms_norm` and
:func:`add_rms_norm` are ``torch.autograd.Function``\\ s whose backward is
polynorm's hand-written one (:func:`polynorm.rms_norm_backward`, fed the
``rstd`` saved by the forward), and :class:`RMSNorm` is a drop-in for
``torch.nn.RMSNorm``.

CPU tensors run on the Numba kernels through zero-copy views; CUDA tensors on
the CuPy kernels through DLPack (that path is not tested on a machine without
a GPU).  The backward is not itself differentiable (no double backward), and
``torch.compile`` runs these functions as opaque eager calls (a graph break
on each side), not traced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from . import _api

__all__ = ["rms_norm", "add_rms_norm", "RMSNorm"]


def _options(eps, axis, partial, offset, eps_mode, casting, backend) -> dict[str, Any]:
    return dict(eps=eps, axis=axis, partial=partial, offset=offset, eps_mode=eps_mode,
                casting=casting, backend=backend)


def _param_grads(ctx, dw, db, first: int):
    """dweight/dbias, or None where autograd does not need one (input ``first`` is weight)."""
    need = ctx.needs_input_grad
    return (dw if need[first] else None, db if need[first + 1] else None)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, opts, out_dtype):
        y, rstd = _api.rms_norm(x, weight, bias, out_dtype=out_dtype, return_rstd=True, **opts)
        ctx.save_for_backward(x, weight, bias, rstd)
        ctx.opts = opts
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, bias, rstd = ctx.saved_tensors
        dx, dw, db = _api.rms_norm_backward(
            dy.contiguous(), x, weight, bias, rstd=rstd, **ctx.opts
        )
        return (dx, *_param_grads(ctx, dw, db, 1), None, None)


class _AddRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, opts, out_dtype):
        y, h, rstd = _api.add_rms_norm(
            x, residual, weight, bias, out_dtype=out_dtype, return_rstd=True, **opts
        )
        ctx.save_for_backward(h, weight, bias, rstd)
        ctx.opts = opts
        ctx.dtypes = (x.dtype, residual.dtype)
        return y, h

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dh):
        h, weight, bias, rstd = ctx.saved_tensors
        # dh: the gradient reaching h through the residual stream, fused into dx
        dxh, dw, db = _api.rms_norm_backward(
            dy.contiguous(), h, weight, bias, rstd=rstd,
            grad_residual=None if dh is None else dh.contiguous(), **ctx.opts,
        )
        x_dtype, r_dtype = ctx.dtypes
        need = ctx.needs_input_grad
        gx = dxh.to(x_dtype) if need[0] else None
        gr = dxh.to(r_dtype) if need[1] else None
        return (gx, gr, *_param_grads(ctx, dw, db, 2), None, None)


# torch.compile must not trace into the kernels (numba's dispatcher crashes dynamo):
# these calls are opaque to it, a graph break on each side.
@torch.compiler.disable
def _apply_rms_norm(x, weight, bias, opts, out_dtype):
    return _RMSNormFn.apply(x, weight, bias, opts, out_dtype)


@torch.compiler.disable
def _apply_add_rms_norm(x, residual, weight, bias, opts, out_dtype):
    return _AddRMSNormFn.apply(x, residual, weight, bias, opts, out_dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    axis: int | tuple[int, ...] = -1,
    partial: float = 1.0,
    offset: float = 0.0,
    eps_mode: str = "inside",
    casting: str = "fp32",
    out_dtype: Any = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Differentiable :func:`polynorm.rms_norm` for torch tensors.

    Same arguments and result as :func:`polynorm.rms_norm` (without ``out``
    and ``return_rstd``); gradients flow to ``x``, ``weight`` and ``bias``
    through polynorm's hand-written backward.

    Parameters
    ----------
    x : torch.Tensor
        Float tensor (float16, bfloat16, float32, float64), CPU or CUDA.
    weight, bias : torch.Tensor, optional
        Shape of ``x`` over the normalized axes; may have another float dtype.
    eps, axis, partial, offset, eps_mode, casting, out_dtype, backend
        As in :func:`polynorm.rms_norm`.

    Returns
    -------
    torch.Tensor
        ``y``, with ``x``'s shape and device and ``out_dtype`` (default ``x``'s).

    Examples
    --------
    >>> import torch
    >>> from polynorm.torch import rms_norm
    >>> x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    >>> y = rms_norm(x, eps=0.0)
    >>> y
    tensor([[0.8485, 1.1314]], grad_fn=<_RMSNormFnBackward>)
    >>> y.sum().backward()
    >>> x.grad
    tensor([[ 0.0453, -0.0339]])
    """
    opts = _options(eps, axis, partial, offset, eps_mode, casting, backend)
    return _apply_rms_norm(x, weight, bias, opts, out_dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    axis: int | tuple[int, ...] = -1,
    partial: float = 1.0,
    offset: float = 0.0,
    eps_mode: str = "inside",
    casting: str = "fp32",
    out_dtype: Any = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable :func:`polynorm.add_rms_norm`: ``h = x + residual``, ``y = rms_norm(h)``.

    Returns ``(y, h)``; both carry gradients (``h`` is the residual stream a
    transformer block passes on), and the backward fuses the gradient
    arriving at ``h`` into the one it computes for ``x`` and ``residual``.

    Parameters
    ----------
    x, residual : torch.Tensor
        Same shape; ``h`` has their promoted dtype.
    weight, bias : torch.Tensor, optional
    eps, axis, partial, offset, eps_mode, casting, out_dtype, backend
        As in :func:`polynorm.add_rms_norm`.

    Returns
    -------
    (y, h) : tuple of torch.Tensor
        The gradients of ``x`` and ``residual`` come back in their own dtypes.

    Examples
    --------
    >>> import torch
    >>> from polynorm.torch import add_rms_norm
    >>> x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    >>> y, h = add_rms_norm(x, torch.tensor([[2.0, 2.0]]), eps=0.0)
    >>> h.detach(), y.detach()
    (tensor([[3., 4.]]), tensor([[0.8485, 1.1314]]))
    >>> (y.sum() + h.sum()).backward()
    >>> x.grad
    tensor([[1.0453, 0.9661]])
    """
    if residual is None:
        raise TypeError("residual must be a tensor, got None")
    opts = _options(eps, axis, partial, offset, eps_mode, casting, backend)
    return _apply_add_rms_norm(x, residual, weight, bias, opts, out_dtype)


class RMSNorm(torch.nn.Module):
    """Drop-in replacement for ``torch.nn.RMSNorm`` running polynorm's kernels.

    Parameters
    ----------
    normalized_shape : int or sequence of int
        The trailing shape normalized over, as in ``torch.nn.RMSNorm``.
    eps : float, optional
        ``None`` (the default, as in torch) uses the machine epsilon of the
        dtype torch computes in: ``torch.finfo(torch.float32).eps`` for
        float16/bfloat16/float32 input, float64's for float64 input.
    elementwise_affine : bool
        Learn a ``weight`` of ``normalized_shape``.
    device, dtype
        For the parameters, as in torch.
    bias : bool
        Also learn an additive ``bias`` (the RMSNorm paper's code has one;
        torch's module does not).  Keyword only, like everything after.
    partial : float
        pRMSNorm: the statistic uses the first ``floor(d * partial)`` elements.
    offset : float
        Scale by ``weight + offset``; ``offset=1.0`` is Gemma's ``1 + w``.
        The weight is initialised to ``1 - offset`` so that a fresh module
        scales by one.
    eps_mode : {"inside", "outside"}
    casting : {"fp32", "llama"}
        See :func:`polynorm.rms_norm`.
    backend : str
        Forced backend, default ``"auto"``.

    Examples
    --------
    >>> import torch
    >>> from polynorm.torch import RMSNorm
    >>> m = RMSNorm(4)
    >>> m
    RMSNorm((4,), eps=None, elementwise_affine=True)
    >>> x = torch.randn(2, 4)
    >>> torch.allclose(m(x), torch.nn.RMSNorm(4)(x), atol=1e-6)
    True
    """

    normalized_shape: tuple[int, ...]
    eps: float | None
    elementwise_affine: bool

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = False,
        partial: float = 1.0,
        offset: float = 0.0,
        eps_mode: str = "inside",
        casting: str = "fp32",
        backend: str = "auto",
    ) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.partial = partial
        self.offset = offset
        self.eps_mode = eps_mode
        self.casting = casting
        self.backend = backend
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("weight", None)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("bias", None)
        # fail at construction, not at the first forward, for a bad option
        _check_options(math.prod(self.normalized_shape), eps, partial, offset, eps_mode, casting)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight ``1 - offset`` (a scale of one), bias zero."""
        with torch.no_grad():
            if self.weight is not None:
                self.weight.fill_(1.0 - self.offset)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nd = len(self.normalized_shape)
        if tuple(x.shape[x.ndim - nd:]) != self.normalized_shape:
            raise ValueError(
                f"x must end in normalized_shape {self.normalized_shape}, got shape {tuple(x.shape)}"
            )
        eps = self.eps
        if eps is None:  # torch takes the eps of its opmath dtype, not of x's dtype
            eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
        axis = -1 if nd == 1 else tuple(range(-nd, 0))  # an int axis takes the fast front end
        return rms_norm(
            x, self.weight, self.bias, eps=eps, axis=axis, partial=self.partial,
            offset=self.offset, eps_mode=self.eps_mode, casting=self.casting, backend=self.backend,
        )

    def extra_repr(self) -> str:
        s = f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        if self.bias is not None:
            s += ", bias=True"
        for name, default in (("partial", 1.0), ("offset", 0.0), ("eps_mode", "inside"),
                              ("casting", "fp32")):
            if getattr(self, name) != default:
                s += f", {name}={getattr(self, name)!r}"
        return s


def _check_options(d, eps, partial, offset, eps_mode, casting) -> None:
    from ._options import make_plan

    make_plan(d, "float32", eps=1e-6 if eps is None else eps, partial=partial, offset=offset,
              eps_mode=eps_mode, casting=casting, out_dtype=None)
