"""QK-norm (+ RoPE) for torch: an in-place custom op for serving, a functional one for training.

- ``torch.ops.polynorm.qk_norm_`` (:func:`qk_norm_`): in place on ``qkv``
  (``mutates_args``), as vLLM's ``fused_qk_norm_rope``; no autograd (an in-place op
  overwrites the input its backward needs).
- ``torch.ops.polynorm.qk_norm`` (:func:`qk_norm`): returns a new ``qkv`` and is
  differentiable (``register_autograd``): the gradient of ``qkv`` (the v slice
  passes through), ``q_weight`` and ``k_weight``; the positions and the cache get
  none.  The backward is the inverse rotation and then
  :func:`polynorm.rms_norm_backward` of the heads' rows
  (:func:`polynorm.ops.qk.qk_backward`); the rounding to ``qkv``'s dtype between
  the norm and the rotation passes the gradient through.

Both run :func:`polynorm.qk_norm` (the same bits) and have fake implementations
for ``torch.compile``.
"""

from __future__ import annotations

import torch

import polynorm.ops.qk as _qk
from polynorm.core.options import Options

__all__ = ["qk_norm", "qk_norm_"]

_ARGS = ("Tensor? q_weight, Tensor? k_weight, int num_heads_q, int num_heads_k, int head_dim, "
         "Tensor? cos_sin_cache, Tensor? positions, bool is_neox, float eps, float offset, "
         "str eps_mode, str casting, str backend")


def _rope(cache, positions, is_neox):
    return None if cache is None else (cache, positions, is_neox, None)


def _call(qkv, q_weight, k_weight, hq, hk, d, cache, positions, is_neox, eps, offset,
          eps_mode, casting, backend):
    _qk.qk_norm(qkv, q_weight, k_weight, num_heads_q=hq, num_heads_k=hk, head_dim=d,
                rope=_rope(cache, positions, is_neox), eps=eps, offset=offset,
                eps_mode=eps_mode, casting=casting, backend=backend)


@torch.library.custom_op("polynorm::qk_norm_", mutates_args=("qkv",),
                         schema=f"(Tensor(a!) qkv, {_ARGS}) -> ()")
def _qk_norm_inplace_op(qkv, *args) -> None:
    _call(qkv, *args)


@_qk_norm_inplace_op.register_fake
def _(qkv, *args) -> None:
    return None


@torch.library.custom_op("polynorm::qk_norm", mutates_args=(),
                         schema=f"(Tensor qkv, {_ARGS}) -> Tensor")
def _qk_norm_op(qkv, *args):
    out = qkv.contiguous().clone()
    _call(out, *args)
    return out


@_qk_norm_op.register_fake
def _(qkv, *args):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    qkv, qw, kw, hq, hk, d, cache, positions, is_neox, *opts = inputs
    ctx.save_for_backward(qkv, qw, kw, cache, positions)
    ctx.meta = (hq, hk, d, is_neox, opts)


def _bwd(ctx, grad):
    qkv, qw, kw, cache, positions = ctx.saved_tensors
    hq, hk, d, is_neox, (eps, offset, eps_mode, casting, backend) = ctx.meta
    opts = _qk._opts("qk_norm", dict(eps=eps, offset=offset, eps_mode=eps_mode,
                                      casting=casting, backend=backend))
    t = qkv.shape[0]
    from polynorm.core.dtypes import float_dtype_name
    from polynorm.core.options import make_plan

    plan = make_plan(d, float_dtype_name("qkv", qkv), opts)
    cs = None
    if cache is not None:
        cdt = torch.float64 if plan.compute_dtype == "float64" else torch.float32
        cs = (cache[positions].to(cdt), is_neox)
    grad = grad.contiguous()
    parts, dws = [], []
    with torch.no_grad():
        for lo, h, w in ((0, hq, qw), (hq * d, hk, kw)):
            g3 = grad[:, lo:lo + h * d].reshape(t, h, d)
            x3 = qkv[:, lo:lo + h * d].reshape(t, h, d)
            dx, dw = _qk.qk_backward(g3, x3, w, plan, cs, opts)
            parts.append(dx.reshape(t, h * d))
            dws.append(dw)
        parts.append(grad[:, (hq + hk) * d:])
        dqkv = torch.cat(parts, dim=1)
    need = ctx.needs_input_grad
    return (dqkv if need[0] else None, dws[0] if need[1] else None,
            dws[1] if need[2] else None, *(None,) * 11)


_qk_norm_op.register_autograd(_bwd, setup_context=_setup)


def _args(q_weight, k_weight, num_heads_q, num_heads_k, head_dim, rope, options):
    opts: Options = _qk._opts("qk_norm", options)
    cache = positions = None
    is_neox = True
    if rope is not None:
        cache, positions, is_neox, rot = rope
        if rot is not None and cache is not None and rot != cache.shape[-1]:
            raise ValueError(f"rope's rotary_dim={rot} must equal cos_sin_cache's width "
                             f"{cache.shape[-1]}")
    return (q_weight, k_weight, num_heads_q, num_heads_k, head_dim, cache, positions,
            is_neox, float(opts.eps), float(opts.offset), opts.eps_mode, opts.casting,
            opts.backend)


def qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, *,
            num_heads_q: int, num_heads_k: int, head_dim: int, rope: tuple | None = None,
            **options) -> torch.Tensor:
    """Differentiable :func:`polynorm.qk_norm`: a new ``qkv`` (``qkv`` is not modified).

    The same arguments, options and bits as :func:`polynorm.qk_norm`; gradients
    reach ``qkv``, ``q_weight`` and ``k_weight``.

    Examples
    --------
    >>> import torch
    >>> import polynorm.torch as pnt
    >>> qkv = torch.randn(3, 4 * 8, dtype=torch.float64, requires_grad=True)
    >>> w = torch.ones(8, dtype=torch.float64, requires_grad=True)
    >>> y = pnt.qk_norm(qkv, w, w, num_heads_q=2, num_heads_k=1, head_dim=8)
    >>> y.sum().backward()
    >>> qkv.grad.shape, bool((qkv.grad[:, 24:] == 1).all())
    (torch.Size([3, 32]), True)
    """
    return _qk_norm_op(qkv, *_args(q_weight, k_weight, num_heads_q, num_heads_k, head_dim,
                                   rope, options))


def qk_norm_(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, *,
             num_heads_q: int, num_heads_k: int, head_dim: int, rope: tuple | None = None,
             **options) -> torch.Tensor:
    """In-place :func:`polynorm.qk_norm` as the custom op ``torch.ops.polynorm.qk_norm_``
    (``torch.compile`` keeps it in its graph); returns ``qkv``.  Not differentiable.

    Examples
    --------
    >>> import torch
    >>> import polynorm.torch as pnt
    >>> qkv = torch.full((1, 3 * 4), 2.0)
    >>> _ = pnt.qk_norm_(qkv, None, None, num_heads_q=1, num_heads_k=1, head_dim=4, eps=0.0)
    >>> qkv
    tensor([[1., 1., 1., 1., 1., 1., 1., 1., 2., 2., 2., 2.]])
    """
    torch.ops.polynorm.qk_norm_(qkv, *_args(q_weight, k_weight, num_heads_q, num_heads_k,
                                            head_dim, rope, options))
    return qkv
