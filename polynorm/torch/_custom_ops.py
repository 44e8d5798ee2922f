"""What every polynorm custom op for torch shares.

The options as schema arguments (one per field of
:class:`polynorm.core.options.Options`), the fake implementations' checks, and
the ``torch.func`` support: ``autograd.Function`` classes with
``setup_context`` built around an op, vmap rules that loop over slices, and
the refusal of second derivatives.  The op families (:mod:`polynorm.torch.norm`,
:mod:`~polynorm.torch.gated`, :mod:`~polynorm.torch.quant`) build on it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from polynorm.core.options import (
    OPTION_TYPES,
    Options,
    make_plan,
)
from polynorm.ops import norm as _api

if TYPE_CHECKING:
    pass



# ------------------------------------------------------------------ custom ops (torch.compile)
# polynorm::rms_norm, polynorm::add_rms_norm and polynorm::rms_norm_backward: opaque to
# the compiler (it sees only the fake implementations: shapes and dtypes), differentiable
# through register_autograd with the same hand-written backward as the eager Functions.
# Results are C-contiguous (the fake implementations say so); absent dweight/dbias come
# back as empty tensors, since an op cannot return an optional tensor.

#: the options, one schema argument per field of polynorm.core.options.Options
_OPTS = ", ".join(f"{kind} {name}" for name, kind in OPTION_TYPES.items())
_NOPTS = len(OPTION_TYPES)
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float32": torch.float32, "float64": torch.float64}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def _op_args(opts: Options) -> Options:
    """The options as the ops' schema takes them: axis a list of ints, out_dtype a name."""
    from polynorm.core.dtypes import parse_dtype

    axis = opts.axis
    return opts._replace(axis=list(axis) if isinstance(axis, (tuple, list)) else [axis],
                         out_dtype=parse_dtype("out_dtype", opts.out_dtype),
                         residual_dtype=parse_dtype("residual_dtype", opts.residual_dtype))


def _from_op(args) -> Options:
    """The ops' schema arguments back as :class:`Options` (one axis as an int: the front
    end's fast path takes only an int axis)."""
    opts = Options(*args)
    axis = opts.axis
    return opts._replace(axis=axis[0] if len(axis) == 1 else tuple(axis))


def _fake_checks(x, dtype: torch.dtype, args):
    """The plan's checks at trace time, and ``(y dtype, rstd dtype, rstd shape)``."""
    from polynorm.ops.norm import _normalize_axis

    opts = Options(*args)
    axes = _normalize_axis(tuple(opts.axis), x.ndim)
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise TypeError(f"x must have a floating dtype ({', '.join(_TORCH_DTYPES)}), got {dtype}")
    d = math.prod(x.shape[a] for a in axes)
    if isinstance(d, int):  # symbolic sizes are checked when the op runs
        make_plan(d, name, opts)
    rstd_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    batch = [s for i, s in enumerate(x.shape) if i not in axes]
    if opts.group_size is not None:  # grouped rstd: one per group, on a trailing axis
        batch.append(d // opts.group_size)
    y_dtype = dtype if opts.out_dtype is None else _TORCH_DTYPES[opts.out_dtype]
    return y_dtype, rstd_dtype, batch


def _fake_add(x, residual, args):
    """The fused add's checks at trace time: ``(y, h, rstd dtypes, rstd shape)``, ``h`` in
    ``residual_dtype`` (default the promoted dtype) and ``rstd`` as :func:`split_dtypes`."""
    from polynorm.core.dtypes import parse_dtype
    from polynorm.core.options import compute_dtype, promote, split_dtypes

    hn = promote(_DTYPE_NAMES.get(x.dtype, str(x.dtype)),
                 _DTYPE_NAMES.get(residual.dtype, str(residual.dtype)))
    y_dtype, r_dtype, batch = _fake_checks(x, _TORCH_DTYPES[hn], args)
    opts = Options(*args)
    h_name = parse_dtype("residual_dtype", opts.residual_dtype) or hn
    if h_name != hn or opts.norm_input == "sum":
        r_dtype = _TORCH_DTYPES[compute_dtype(split_dtypes(hn, h_name, opts.norm_input == "sum")[1])]
    return y_dtype, _TORCH_DTYPES[h_name], r_dtype, batch


_NO_FORWARD_AD = (
    "polynorm.torch: forward-mode AD (torch.func.jvp, jacfwd, hessian, "
    "torch.autograd.forward_ad) is not supported by {op}; reverse mode is "
    "(backward, torch.func.grad, vjp, jacrev)"
)


def _refuse_forward_ad(op: str):
    def jvp(ctx, *tangents):
        raise NotImplementedError(_NO_FORWARD_AD.format(op=op))

    return staticmethod(jvp)


# ------------------------------------------------------------------ torch.func, second derivatives
#: raised by every backward's own backward (reached only by a second derivative)
_NO_SECOND_ORDER = (
    "polynorm.torch: second derivatives are not supported: {op}'s backward is "
    "hand-written and not itself differentiable (double backward through "
    "create_graph=True, gradgradcheck, torch.func.hessian, nested torch.func.grad/jacrev)"
)


def _refuse_second_order(op: str):
    def backward(ctx, *grads):
        raise NotImplementedError(_NO_SECOND_ORDER.format(op=op))

    return backward


def _no_context(ctx, inputs, output):
    pass


def _function(name: str, op, setup_context, backward, opname: str) -> type:
    """An ``autograd.Function`` running ``op`` with the given formula, for ``torch.func``.

    The autograd that ``register_autograd`` gives an op has no ``setup_context``
    staticmethod, which ``torch.func.grad``/``vjp``/``jacrev`` require; this one
    has, and vmaps through the op's own vmap rule (``generate_vmap_rule``).
    """
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(lambda *args: op(*args)),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "jvp": _refuse_forward_ad(opname),
        "generate_vmap_rule": True,
        "__module__": __name__,
    })


def _vmap_loop(op, info, in_dims, *args):
    """``op`` once per vmapped slice, the results stacked on dim 0.

    For batched weights or biases and for every backward: ``dweight`` is a sum over
    the tokens of one slice, so slices cannot share a kernel call.
    """
    if info.batch_size == 0:  # no slices: one slice of ones gives the shapes and dtypes
        one = op(*(a.new_ones(a.shape[:d] + a.shape[d + 1:]) if isinstance(d, int) else a
                   for a, d in zip(args, in_dims, strict=True)))
        return tuple(r.new_empty((0, *r.shape)) for r in one), (0,) * len(one)
    # in_dims of a list argument (axis) is a list of Nones
    outs = [op(*(a.select(d, i) if isinstance(d, int) else a
                 for a, d in zip(args, in_dims, strict=True)))
            for i in range(info.batch_size)]
    return tuple(torch.stack(r) for r in zip(*outs, strict=True)), (0,) * len(outs[0])


def _front(a, d, n: int):
    """``a`` with its vmapped dim ``d`` first, or broadcast to ``n`` there if unbatched."""
    if a is None:
        return None
    return a.expand(n, *a.shape) if d is None else a.movedim(d, 0)


def _vmapped_opts(args, ndim: int) -> list:
    """The op's options for a slice of ``ndim`` dims, its axes moved one to the right
    (the vmapped dim comes first; the tokens of all slices go to one kernel call)."""
    opts = Options(*args[:_NOPTS])
    axes = _api._normalize_axis(tuple(opts.axis), ndim)
    return [*opts._replace(axis=[a + 1 for a in axes]), *args[_NOPTS:]]


# Under torch.func transforms (tensors without storage) or torch.jit.trace (a tracer
# that would record the kernels' results as constants) calls take the ops; bound
# once, as these run on every eager call.
_functorch_active = torch._C._are_functorch_transforms_active
_jit_tracing = torch._C._is_tracing


def _functorch() -> bool:
    """Under ``torch.func`` transforms (outside a compiler, which handles them itself)."""
    return not torch.compiler.is_compiling() and _functorch_active()


