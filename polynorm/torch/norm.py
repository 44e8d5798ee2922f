"""RMSNorm and the fused residual add for torch: autograd functions, custom ops, ``RMSNorm``.

See :mod:`polynorm.torch` for what runs where (eager autograd functions, the
custom ops under ``torch.compile``, ``torch.func`` and ``torch.jit.trace``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.forward_ad as _forward_ad

from polynorm.core.options import (
    Options,
    TorchOptions,
    make_plan,
    pack_options,
    takes_options,
)
from polynorm.ops import lean as _lean
from polynorm.ops import norm as _api
from polynorm.torch import dtensor as _dtensor
from polynorm.torch._custom_ops import (
    _NOPTS,
    _OPTS,
    _fake_add,
    _fake_checks,
    _from_op,
    _front,
    _function,
    _functorch,
    _functorch_active,
    _jit_tracing,
    _no_context,
    _op_args,
    _refuse_forward_ad,
    _refuse_second_order,
    _vmap_loop,
    _vmapped_opts,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


__all__ = ["rms_norm", "add_rms_norm", "RMSNorm"]


def _param_grads(ctx, dw, db, first: int):
    """dweight/dbias, or None where autograd does not need one (input ``first`` is weight)."""
    need = ctx.needs_input_grad
    return (dw if need[first] else None, db if need[first + 1] else None)


def _keep(ctx, x, y, weight, bias, rstd, opts: Options, save: str, check: bool) -> None:
    """Save for the backward ``x`` or, with ``save="output"``, ``y`` (polynorm.ops.lean).

    ``check``: read ``weight`` for zeros of ``weight + offset`` and keep ``x`` where
    there are (eager calls); a compiled graph cannot branch on data, so there ``y`` is
    kept and such columns give NaN gradients (documented at :func:`rms_norm`).  Nor is
    a CUDA weight read: that would wait for the device on every training step (and is
    illegal while a CUDA graph is captured).
    """
    check = check and (weight is None or not weight.is_cuda)
    lean = save == "output" and (not check or _lean.recoverable(weight, opts.offset, rstd.dtype))
    lean = lean and opts.group_size is None  # x is recovered with one rstd per slice only
    ctx.save_for_backward(y if lean else x, weight, bias, rstd)
    ctx.lean = lean
    ctx.x_dtype = x.dtype
    ctx.opts = opts._replace(out_dtype=None)


def _dx_memory(ctx, dy):
    """``dy`` itself where the backward may write ``dx`` into it (``in_place``), else None."""
    return dy if ctx.in_place and dy.dtype == ctx.x_dtype else None


def _kept_input(ctx, kept, weight, bias, rstd):
    """The forward's input: ``kept`` itself, or recovered from the kept output."""
    if not ctx.lean:
        return kept
    axes = _api._normalize_axis(ctx.opts.axis, kept.ndim)
    return _lean.recover_input(kept, weight, bias, rstd, axes, ctx.opts.offset)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, opts, save, in_place):
        y, rstd = _api.forward(x, None, weight, bias, opts, return_rstd=True)
        _keep(ctx, x, y, weight, bias, rstd, opts, save, True)
        ctx.in_place = in_place
        return y

    @staticmethod
    def backward(ctx, dy):
        kept, weight, bias, rstd = ctx.saved_tensors
        x = _kept_input(ctx, kept, weight, bias, rstd)
        if torch.is_grad_enabled():  # create_graph=True: a node that refuses a 2nd derivative
            dx, dw, db = _op_backward(ctx, x, weight, bias, rstd, dy, None, 1)
            return (dx.to(ctx.x_dtype), dw, db, None, None, None)
        dy = dy.contiguous()
        dx, dw, db = _api.backward(dy, x, weight, bias, rstd, None, ctx.opts, _dx_memory(ctx, dy))
        return (dx.to(ctx.x_dtype), *_param_grads(ctx, dw, db, 1), None, None, None)

    jvp = _refuse_forward_ad("rms_norm")


class _AddRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, opts, save, in_place):
        y, h, rstd = _api.forward(x, residual, weight, bias, opts, return_rstd=True, fused=True)
        _keep(ctx, h, y, weight, bias, rstd, opts, save, True)
        ctx.dtypes = (x.dtype, residual.dtype)
        ctx.in_place = in_place
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        kept, weight, bias, rstd = ctx.saved_tensors
        h = _kept_input(ctx, kept, weight, bias, rstd)
        if torch.is_grad_enabled():  # create_graph=True: as in _RMSNormFn
            return (*_add_op_grads(ctx, h, weight, bias, rstd, dy, dh), None, None, None)
        # dh: the gradient reaching h through the residual stream, fused into dx
        dy = dy.contiguous()
        dxh, dw, db = _api.backward(dy, h, weight, bias, rstd,
                                    None if dh is None else dh.contiguous(), ctx.opts,
                                    _dx_memory(ctx, dy))
        x_dtype, r_dtype = ctx.dtypes
        need = ctx.needs_input_grad
        gx = dxh.to(x_dtype) if need[0] else None
        gr = dxh.to(r_dtype) if need[1] else None
        return (gx, gr, *_param_grads(ctx, dw, db, 2), None, None, None)

    jvp = _refuse_forward_ad("add_rms_norm")


# torch.compile must not trace into the kernels (numba's dispatcher crashes dynamo).
# Eager calls take the autograd.Functions above through these two wrappers (the
# cheapest dispatch); under torch.compile/torch.export the same work is reached
# through the custom ops below, which the compiler keeps in its graph.
@torch.compiler.disable
def _apply_rms_norm(x, weight, bias, opts, save, in_place=False):
    return _RMSNormFn.apply(x, weight, bias, opts, save, in_place)


@torch.compiler.disable
def _apply_add_rms_norm(x, residual, weight, bias, opts, save, in_place=False):
    return _AddRMSNormFn.apply(x, residual, weight, bias, opts, save, in_place)


@torch.library.custom_op(
    "polynorm::rms_norm", mutates_args=(),
    schema=f"(Tensor x, Tensor? weight, Tensor? bias, {_OPTS}, str save) -> (Tensor, Tensor)",
)
def _rms_norm_op(x, weight, bias, *args):
    y, rstd = _api.forward(x, None, weight, bias, _from_op(args[:_NOPTS]), return_rstd=True)
    return y.contiguous(), rstd.contiguous()


@_rms_norm_op.register_fake
def _(x, weight, bias, *args):
    y_dtype, r_dtype, batch = _fake_checks(x, x.dtype, args[:_NOPTS])
    return x.new_empty(x.shape, dtype=y_dtype), x.new_empty(batch, dtype=r_dtype)


@torch.library.custom_op(
    "polynorm::add_rms_norm", mutates_args=(),
    schema=f"(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, {_OPTS}, str save) "
    "-> (Tensor, Tensor, Tensor)",
)
def _add_rms_norm_op(x, residual, weight, bias, *args):
    y, h, rstd = _api.forward(x, residual, weight, bias, _from_op(args[:_NOPTS]),
                              return_rstd=True, fused=True)
    return y.contiguous(), h.contiguous(), rstd.contiguous()


@_add_rms_norm_op.register_fake
def _(x, residual, weight, bias, *args):
    y_dtype, h_dtype, r_dtype, batch = _fake_add(x, residual, args[:_NOPTS])
    return (x.new_empty(x.shape, dtype=y_dtype), x.new_empty(x.shape, dtype=h_dtype),
            x.new_empty(batch, dtype=r_dtype))


@torch.library.custom_op(
    "polynorm::rms_norm_backward", mutates_args=(),
    schema=f"(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor? rstd, "
    f"Tensor? grad_residual, {_OPTS}) -> (Tensor, Tensor, Tensor)",
)
def _rms_norm_backward_op(dy, x, weight, bias, rstd, grad_residual, *opts):
    dx, dw, db = _api.backward(dy, x, weight, bias, rstd, grad_residual, _from_op(opts))
    # absent: a fresh empty tensor each (outputs must not alias one another)
    return (dx.contiguous(), x.new_empty(0) if dw is None else dw.contiguous(),
            x.new_empty(0) if db is None else db.contiguous())


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, bias, rstd, grad_residual, *opts):
    return (x.new_empty(x.shape),
            x.new_empty(0) if weight is None else weight.new_empty(weight.shape),
            x.new_empty(0) if bias is None else bias.new_empty(bias.shape))


def _op_backward(ctx, x, weight, bias, rstd, dy, dh, first: int):
    """The op's backward: dx (h's gradient for the fused add), dweight, dbias."""
    # grad on (create_graph=True, torch.func): a node refusing a second derivative
    bwd = _RMSNormBackwardFn.apply if torch.is_grad_enabled() else _rms_norm_backward_op
    dx, dw, db = bwd(dy.contiguous(), x, weight, bias, rstd,
                     None if dh is None else dh.contiguous(), *_op_args(ctx.opts))
    need = ctx.needs_input_grad
    return (dx, dw if weight is not None and need[first] else None,
            db if bias is not None and need[first + 1] else None)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, bias, *args = inputs
    _keep(ctx, x, output[0], weight, bias, output[1], _from_op(args[:_NOPTS]), args[_NOPTS],
          False)
    ctx.mark_non_differentiable(output[1])


def _rms_norm_op_bwd(ctx, dy, _drstd):
    kept, weight, bias, rstd = ctx.saved_tensors
    x = _kept_input(ctx, kept, weight, bias, rstd)
    dx, dw, db = _op_backward(ctx, x, weight, bias, rstd, dy, None, 1)
    return (dx.to(ctx.x_dtype), dw, db, *(None,) * (_NOPTS + 1))


_rms_norm_op.register_autograd(_rms_norm_op_bwd, setup_context=_setup_rms_norm)


def _setup_add_rms_norm(ctx, inputs, output):
    x, residual, weight, bias, *args = inputs
    _keep(ctx, output[1], output[0], weight, bias, output[2], _from_op(args[:_NOPTS]),
          args[_NOPTS], False)
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.mark_non_differentiable(output[2])


def _add_op_grads(ctx, h, weight, bias, rstd, dy, dh):
    """The fused add's gradients (x, residual, weight, bias) through the backward op."""
    dxh, dw, db = _op_backward(ctx, h, weight, bias, rstd, dy, dh, 2)
    x_dtype, r_dtype = ctx.dtypes
    need = ctx.needs_input_grad
    return (dxh.to(x_dtype) if need[0] else None, dxh.to(r_dtype) if need[1] else None, dw, db)


def _add_rms_norm_op_bwd(ctx, dy, dh, _drstd):
    kept, weight, bias, rstd = ctx.saved_tensors
    h = _kept_input(ctx, kept, weight, bias, rstd)
    return (*_add_op_grads(ctx, h, weight, bias, rstd, dy, dh), *(None,) * (_NOPTS + 1))


_add_rms_norm_op.register_autograd(_add_rms_norm_op_bwd, setup_context=_setup_add_rms_norm)


@_rms_norm_op.register_vmap
def _(info, in_dims, x, weight, bias, *args):
    if in_dims[1] is not None or in_dims[2] is not None:
        return _vmap_loop(_rms_norm_op, info, in_dims, x, weight, bias, *args)
    out = _rms_norm_op(x.movedim(in_dims[0], 0), weight, bias, *_vmapped_opts(args, x.ndim - 1))
    return out, (0, 0)


@_add_rms_norm_op.register_vmap
def _(info, in_dims, x, residual, weight, bias, *args):
    xd, rd, wd, bd = in_dims[:4]
    if wd is not None or bd is not None:
        return _vmap_loop(_add_rms_norm_op, info, in_dims, x, residual, weight, bias, *args)
    n = info.batch_size
    ndim = x.ndim - (xd is not None)
    out = _add_rms_norm_op(_front(x, xd, n), _front(residual, rd, n), weight, bias,
                           *_vmapped_opts(args, ndim))
    return out, (0, 0, 0)


_rms_norm_backward_op.register_vmap(functools.partial(_vmap_loop, _rms_norm_backward_op))
_rms_norm_backward_op.register_autograd(_refuse_second_order("rms_norm"),
                                        setup_context=_no_context)
_RMSNormBackwardFn = _function("_RMSNormBackwardFn", _rms_norm_backward_op, _no_context,
                               _refuse_second_order("rms_norm"), "rms_norm's backward")
_RMSNormFuncFn = _function("_RMSNormFuncFn", _rms_norm_op, _setup_rms_norm, _rms_norm_op_bwd,
                           "rms_norm")
_AddRMSNormFuncFn = _function("_AddRMSNormFuncFn", _add_rms_norm_op, _setup_add_rms_norm,
                              _add_rms_norm_op_bwd, "add_rms_norm")


def _records(x, a, b, c=None) -> bool:
    """Whether autograd would record this call (else the functional API does the same work)."""
    # unrolled: this runs on every eager call (a generator costs ~0.5 us)
    return torch.is_grad_enabled() and (
        getattr(x, "requires_grad", False) or getattr(a, "requires_grad", False)
        or getattr(b, "requires_grad", False) or getattr(c, "requires_grad", False)
    )


def _eager(x) -> bool:
    """Plain tensors outside a compiler, ``torch.func`` and ``torch.jit.trace`` take the
    autograd.Functions (cheapest dispatch)."""
    return not torch.compiler.is_compiling() and (
        type(x) is torch.Tensor or type(x) is torch.nn.Parameter
    ) and not _functorch_active() and not _jit_tracing()


def _check_tensors(**arrays: Any) -> None:
    """A TypeError naming the argument for anything but a tensor (the dispatcher's own
    error prints the whole array and names no argument)."""
    for argname, a in arrays.items():
        if a is not None and not isinstance(a, torch.Tensor):
            allowed = "a torch.Tensor" if argname in ("x", "residual") else "a torch.Tensor or None"
            raise TypeError(
                f"{argname} must be {allowed}, got {type(a).__module__}.{type(a).__name__}; "
                "for other array types use polynorm.rms_norm / polynorm.add_rms_norm"
            )


def _check_in_place(in_place: Any) -> bool:
    if not isinstance(in_place, bool):
        raise TypeError(f"in_place must be a bool, got {type(in_place).__name__}")
    return in_place


_EPS_DOC = (
    "eps : float or None, default 1e-6\n"
    "    As in :func:`polynorm.rms_norm`; ``None`` means torch's default, as in\n"
    "    ``torch.nn.functional.rms_norm`` and :class:`RMSNorm`: the machine epsilon\n"
    "    of the dtype torch computes in (``torch.finfo(torch.float32).eps`` for\n"
    "    float16/bfloat16/float32 input, float64's for float64 input).")
_EPS_DOC_ADD = (
    "eps : float or None, default 1e-6\n"
    "    ``None``: as in :func:`rms_norm`, for ``h``'s dtype (float64's epsilon when\n"
    "    ``x`` or ``residual`` is float64).")


def _default_eps(eps: Any, *dtypes: Any) -> Any:
    """``eps=None``: torch's default, the machine epsilon of the dtype torch computes in
    (float32 for float16/bfloat16/float32 input, float64 when an input is float64)."""
    if eps is not None:
        return eps
    return torch.finfo(torch.float64 if torch.float64 in dtypes else torch.float32).eps


@takes_options(docs={"eps": _EPS_DOC})
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    save: str = "input",
    in_place: bool = False,
    **options: Unpack[TorchOptions],
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
    save : {"input", "output"}
        What the forward keeps for the backward.  ``"output"`` keeps ``y``
        (which the next layer usually keeps anyway) instead of ``x``: one
        activation of ``x``'s size less per norm, and gradients equal to
        ``"input"``'s to ``y``'s precision (``polynorm.ops.lean``).  Where
        ``weight + offset`` has a zero, ``x`` cannot be recovered: an eager call
        with a CPU weight checks (reading the weight) and keeps ``x``; with a CUDA
        weight (where the check would wait for the device) and under
        ``torch.compile``, ``torch.func`` and ``torch.jit.trace`` it does not, and
        such columns give NaN gradients.
    in_place : bool
        The backward writes ``dx`` into the memory of the incoming gradient
        ``dy`` (when it has ``x``'s dtype), saving one allocation of ``x``'s
        size, as Liger's ``in_place``.  Off by default: it is safe only where no
        other backward reads that ``dy`` afterwards, i.e. where ``y`` feeds one
        op that hands the norm a gradient of its own (a pre-norm's
        ``y -> Linear``).  It is not safe where autograd passes one gradient
        tensor to several consumers: ``y`` used twice, or ``y`` added to a
        residual stream (a post-norm, ``h + norm(a)``, as in Gemma-2's
        ``post_*_layernorm``: Liger-Kernel#370), whose other branch would read
        ``dx``.  Under ``torch.compile`` it is ignored (``dx`` is a new tensor;
        the compiler plans memory itself), as under ``torch.func``,
        ``torch.jit.trace`` and ``create_graph=True``; on CUDA ``dx`` is computed into a
        new tensor and copied (the CUDA kernels do not write ``dx`` over ``dy``).
    {options}

    Returns
    -------
    torch.Tensor
        ``y``, with ``x``'s shape and device and ``out_dtype`` (default ``x``'s).

    Notes
    -----
    ``torch.jit.trace``, ``torch.func.vmap``, ``grad``, ``vjp`` and ``jacrev`` run the
    custom op (see the module docstring).  Second derivatives (a second backward
    through a ``create_graph=True`` gradient, ``gradgradcheck``, ``hessian``) and
    forward-mode AD (``jvp``, ``jacfwd``) raise ``NotImplementedError``.

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
    T = torch.Tensor
    if not (isinstance(x, T) and (weight is None or isinstance(weight, T))
            and (bias is None or isinstance(bias, T))):  # unrolled: runs on every call
        _check_tensors(x=x, weight=weight, bias=bias)
    opts = pack_options("rms_norm", options)
    if opts.eps is None:
        opts = opts._replace(eps=_default_eps(None, x.dtype))
    if save != "input":
        _lean.check_save(save)
    if in_place is not False:
        _check_in_place(in_place)
    if _eager(x):
        # inference: no autograd node to build (~5 us); under forward-mode AD the
        # Function, whose jvp says it is not supported (a missing tangent reads as zero)
        if not _records(x, weight, bias) and _forward_ad._current_level < 0:
            return _api.forward(x, None, weight, bias, opts)
        return _apply_rms_norm(x, weight, bias, opts, save, in_place)
    if _dtensor.is_dtensor(x):
        return _dtensor.rms_norm(x, weight, bias, opts, functools.partial(
            rms_norm, save=save, in_place=in_place, **opts._asdict()))
    if _functorch():
        return _RMSNormFuncFn.apply(x, weight, bias, *_op_args(opts), save)[0]
    return torch.ops.polynorm.rms_norm(x, weight, bias, *_op_args(opts), save)[0]


@takes_options(docs={"eps": _EPS_DOC_ADD})
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    save: str = "input",
    in_place: bool = False,
    **options: Unpack[TorchOptions],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable :func:`polynorm.add_rms_norm`: ``h = x + residual``, ``y = rms_norm(h)``.

    Returns ``(y, h)``; both carry gradients (``h`` is the residual stream a
    transformer block passes on), and the backward fuses the gradient
    arriving at ``h`` into the one it computes for ``x`` and ``residual``.

    Parameters
    ----------
    x, residual : torch.Tensor
        Same shape; ``h`` has their promoted dtype (or ``residual_dtype``).
    weight, bias : torch.Tensor, optional
    save : {"input", "output"}
        As in :func:`rms_norm`: ``"output"`` keeps ``y`` instead of ``h``.
    in_place : bool
        As in :func:`rms_norm`: the backward writes the gradient of ``x`` and
        ``residual`` into ``y``'s incoming gradient.
    {options}

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
    _check_tensors(x=x, residual=residual, weight=weight, bias=bias)
    opts = pack_options("add_rms_norm", options)
    if opts.eps is None:
        opts = opts._replace(eps=_default_eps(None, x.dtype, residual.dtype))
    if save != "input":
        _lean.check_save(save)
    if in_place is not False:
        _check_in_place(in_place)
    if _eager(x):
        if not _records(x, residual, weight, bias) and _forward_ad._current_level < 0:
            return _api.forward(x, residual, weight, bias, opts, fused=True)
        return _apply_add_rms_norm(x, residual, weight, bias, opts, save, in_place)
    if _dtensor.is_dtensor(x):
        return _dtensor.rms_norm(x, weight, bias, opts, functools.partial(
            add_rms_norm, save=save, in_place=in_place, **opts._asdict()), residual=residual)
    if _functorch():
        y, h, _ = _AddRMSNormFuncFn.apply(x, residual, weight, bias, *_op_args(opts), save)
        return y, h
    y, h, _ = torch.ops.polynorm.add_rms_norm(x, residual, weight, bias, *_op_args(opts), save)
    return y, h


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
    save : {"input", "output"}
        What the forward keeps for the backward (see :func:`rms_norm`);
        ``"output"`` saves one activation of the input's size per norm.
    in_place : bool
        The backward writes ``dx`` over the incoming gradient (see
        :func:`rms_norm` for when that is safe).  Default False.
    **options
        The keyword options of :func:`rms_norm` (``partial``, ``offset``,
        ``eps_mode``, ``casting``, ``out_dtype``, ``backend``), passed to every
        forward; the axes and ``eps`` are the module's.  With ``offset`` the
        weight is initialised to ``1 - offset``, so that a fresh module scales
        by one.

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
        save: str = "input",
        in_place: bool = False,
        **options: Unpack[TorchOptions],
    ) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        # fail at construction, not at the first forward, for a bad option
        opts = pack_options("RMSNorm", options, eps=1e-6 if eps is None else eps, axis=-1)
        make_plan(math.prod(self.normalized_shape), "float32", opts)
        _api.no_residual(opts)  # this module has no residual for residual_dtype to apply to
        self.options = dict(options)
        self.save = _lean.check_save(save)
        self.in_place = _check_in_place(in_place)
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("weight", None)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight ``1 - offset`` (a scale of one), bias zero."""
        with torch.no_grad():
            if self.weight is not None:
                self.weight.fill_(1.0 - self.options.get("offset", 0.0))
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nd = len(self.normalized_shape)
        if tuple(x.shape[x.ndim - nd:]) != self.normalized_shape:
            raise ValueError(
                f"x must end in normalized_shape {self.normalized_shape}, got shape {tuple(x.shape)}"
            )
        axis = -1 if nd == 1 else tuple(range(-nd, 0))  # an int axis takes the fast front end
        return rms_norm(x, self.weight, self.bias, eps=self.eps, axis=axis, save=self.save,
                        in_place=self.in_place, **self.options)

    def extra_repr(self) -> str:
        s = f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        if self.bias is not None:
            s += ", bias=True"
        defaults = Options()._asdict()
        for name, value in self.options.items():
            if value != defaults[name]:
                s += f", {name}={value!r}"
        for name, default in (("save", "input"), ("in_place", False)):
            if getattr(self, name) != default:
                s += f", {name}={getattr(self, name)!r}"
        return s


# Hugging Face transformers models: swap their RMSNorm modules for polynorm (polynorm/torch/hf.py)
# gated RMSNorm (polynorm/torch/gated.py, which uses the op helpers above)
