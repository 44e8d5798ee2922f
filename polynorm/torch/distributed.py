"""RMSNorm over a hidden axis split across the ranks of a process group (tensor parallelism).

Each rank holds its slice of every token's hidden vector (and of the weight).  The
forward sums each token's squares on every rank (:func:`polynorm.rms_norm_stats`),
adds them over the group (one ``all_reduce`` of ``n`` floats, ``n`` the number of
tokens) and normalizes the rank's slice (:func:`polynorm.rms_norm_from_stats`); the
backward does the same with its per-token coefficient (one ``all_reduce`` of ``n``
floats), so the gradient is that of the unsplit norm.  This is vLLM's MiniMax
split-hidden norm and Megatron-LM's tensor-parallel norm; Liger-Kernel instead
gathers a ``DTensor`` whole (``full_tensor()``) and normalizes it on every rank.

Eager autograd only (no ``torch.compile`` custom op: the collective is the caller's
process group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from polynorm.core.options import Options, TorchOptions, pack_options, takes_options
from polynorm.ops import split as _split

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["rms_norm"]

_EXCLUDE = _split.NO_RESIDUAL_OPTIONS
_kw = _split.split_kwargs


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    t = t.contiguous()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class _SplitRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, d_total, opts):
        kw = _kw(opts, y=True)
        ss = _all_reduce(_split.rms_norm_stats(x, **_kw(opts, y=False)), group)
        y = _split.rms_norm_from_stats(x, weight, bias, sumsq=ss, d_total=d_total, **kw)
        ctx.save_for_backward(x, weight, bias, ss)
        ctx.group, ctx.d_total, ctx.opts = group, d_total, opts
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, ss = ctx.saved_tensors
        kw = _kw(ctx.opts, y=False)
        dot = _split.rms_norm_backward_stats(dy, x, weight, sumsq=ss, d_total=ctx.d_total, **kw)
        dot = _all_reduce(dot, ctx.group)
        dx, dw, db = _split.rms_norm_backward_from_stats(
            dy, x, weight, bias, sumsq=ss, dot=dot, d_total=ctx.d_total, **kw)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None,
                None, None, None)


def _check(x, weight, bias) -> None:
    for argname, a in (("x", x), ("weight", weight), ("bias", bias)):
        if a is not None and type(a) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{argname} must be a torch.Tensor (this rank's slice), got "
                            f"{type(a).__module__}.{type(a).__name__}")


@takes_options(exclude=_EXCLUDE, docs={"eps": "eps : float or None, default 1e-6\n"
                                              "    As in :func:`polynorm.torch.rms_norm`."})
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    group: Any = None,
    d_total: int | None = None,
    **options: Unpack[TorchOptions],
) -> torch.Tensor:
    """Differentiable RMSNorm of a hidden axis split across the ranks of ``group``.

    Every rank calls it with its own slice; the result is the rank's slice of the
    unsplit :func:`polynorm.torch.rms_norm` (within rounding: the ranks' sums are
    added in the collective's order; with one rank, its bits on the Numba backend,
    see :func:`polynorm.rms_norm_stats`).  Forward and backward each make one
    ``all_reduce`` (sum) of one float64 per token over ``group``.

    Parameters
    ----------
    x : torch.Tensor
        This rank's slice: the normalized axes hold this rank's part of each
        token's hidden vector; the token axes are the same on every rank.
    weight, bias : torch.Tensor, optional
        This rank's part of them (shape of ``x`` over the normalized axes);
        their gradients are this rank's columns' (no collective over them).
    group : torch.distributed.ProcessGroup, optional
        The ranks that share the hidden axis (``None``: the default group).
    d_total : int, optional
        The whole hidden size (all ranks together); default this rank's size
        times the group's size (equal slices).
    {options}

    Returns
    -------
    torch.Tensor
        This rank's slice of ``y``.

    Examples
    --------
    >>> import torch, torch.distributed as dist, tempfile, os
    >>> from polynorm.torch.distributed import rms_norm
    >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    >>> x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    >>> rms_norm(x, eps=0.0)
    tensor([[0.8485, 1.1314]], grad_fn=<_SplitRMSNormFnBackward>)
    >>> dist.destroy_process_group()
    """
    _check(x, weight, bias)
    opts = pack_options("rms_norm", options, **{n: getattr(Options(), n) for n in _EXCLUDE})
    if opts.eps is None:
        opts = opts._replace(eps=torch.finfo(torch.float64 if x.dtype == torch.float64
                                             else torch.float32).eps)
    if d_total is None:
        import math

        import torch.distributed as dist

        axes = opts.axis if isinstance(opts.axis, (tuple, list)) else (opts.axis,)
        try:
            d_local = math.prod(x.shape[a] for a in axes)
        except (IndexError, TypeError):  # the front end's error names the bad axis
            _split.rms_norm_stats(x, **_kw(opts, y=False))
            raise
        d_total = d_local * dist.get_world_size(group)
    return _SplitRMSNormFn.apply(x, weight, bias, group, d_total, opts)
