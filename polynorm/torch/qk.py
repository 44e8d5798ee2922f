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

__all__ = ["qk_norm", "qk_norm_", "qk_norm_pair"]

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
    hq, hk, d, is_neox, opts = ctx.meta
    t = qkv.shape[0]
    qe, ke = hq * d, (hq + hk) * d

    def heads(a, lo, hi, h):
        return a[:, lo:hi].reshape(t, h, d)

    dxq, dxk, dwq, dwk = _qk_norm_pair_backward_op(
        heads(grad, 0, qe, hq), heads(grad, qe, ke, hk), heads(qkv, 0, qe, hq),
        heads(qkv, qe, ke, hk), qw, kw, cache, positions, is_neox, *opts)
    dqkv = torch.cat([dxq.reshape(t, qe), dxk.reshape(t, ke - qe), grad[:, ke:]], dim=1)
    need = ctx.needs_input_grad
    return (dqkv if need[0] else None, dwq if qw is not None and need[1] else None,
            dwk if kw is not None and need[2] else None, *(None,) * 11)




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

    Parameters
    ----------
    qkv, q_weight, k_weight, num_heads_q, num_heads_k, head_dim, rope, **options
        As in :func:`polynorm.qk_norm` (``rope``'s cache and positions as tensors).

    Returns
    -------
    torch.Tensor
        The new ``qkv`` (C-contiguous), differentiable.

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

    Parameters
    ----------
    qkv, q_weight, k_weight, num_heads_q, num_heads_k, head_dim, rope, **options
        As in :func:`polynorm.qk_norm`.

    Returns
    -------
    torch.Tensor
        ``qkv``, modified.

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


# ------------------------------------------------------------------ q and k apart (the HF patch)

_PAIR_ARGS = ("Tensor? q_weight, Tensor? k_weight, Tensor? cos_sin_cache, Tensor? positions, "
              "bool is_neox, float eps, float offset, str eps_mode, str casting, str backend")


@torch.library.custom_op("polynorm::qk_norm_pair", mutates_args=(),
                         schema=f"(Tensor q, Tensor k, {_PAIR_ARGS}) -> (Tensor, Tensor)")
def _qk_norm_pair_op(q, k, q_weight, k_weight, cache, positions, is_neox, eps, offset, eps_mode,
                     casting, backend):
    q2, k2 = q.contiguous().clone(), k.contiguous().clone()
    _qk.qk_norm_pair(q2, k2, q_weight, k_weight, rope=_rope(cache, positions, is_neox), eps=eps,
                     offset=offset, eps_mode=eps_mode, casting=casting, backend=backend)
    return q2, k2


@_qk_norm_pair_op.register_fake
def _(q, k, *args):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


def _setup_pair(ctx, inputs, output):
    q, k, qw, kw, cache, positions, is_neox, *opts = inputs
    ctx.save_for_backward(q, k, qw, kw, cache, positions)
    ctx.meta = (is_neox, opts)


def _pair_grads(dq, dk, q, k, qw, kw, cache, positions, is_neox, eps, offset, eps_mode,
                casting, backend):
    opts = _qk._opts("qk_norm_pair", dict(eps=eps, offset=offset, eps_mode=eps_mode,
                                           casting=casting, backend=backend))
    from polynorm.core.dtypes import float_dtype_name
    from polynorm.core.options import make_plan

    plan = make_plan(q.shape[-1], float_dtype_name("q", q), opts)
    cs = None
    if cache is not None:
        cdt = torch.float64 if plan.compute_dtype == "float64" else torch.float32
        cs = (cache[positions].to(cdt), is_neox)
    with torch.no_grad():
        dxq, dwq = _qk.qk_backward(dq.contiguous(), q, qw, plan, cs, opts)
        dxk, dwk = _qk.qk_backward(dk.contiguous(), k, kw, plan, cs, opts)
    return dxq, dxk, dwq, dwk


@torch.library.custom_op(
    "polynorm::qk_norm_pair_backward", mutates_args=(),
    schema=f"(Tensor dq, Tensor dk, Tensor q, Tensor k, {_PAIR_ARGS}) "
    "-> (Tensor, Tensor, Tensor, Tensor)")
def _qk_norm_pair_backward_op(dq, dk, q, k, qw, kw, *args):
    dxq, dxk, dwq, dwk = _pair_grads(dq, dk, q, k, qw, kw, *args)
    return (dxq.contiguous(), dxk.contiguous(),
            q.new_empty(0) if dwq is None else dwq.contiguous(),
            q.new_empty(0) if dwk is None else dwk.contiguous())


@_qk_norm_pair_backward_op.register_fake
def _(dq, dk, q, k, qw, kw, *args):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            q.new_empty(0) if qw is None else torch.empty_like(qw),
            q.new_empty(0) if kw is None else torch.empty_like(kw))


def _bwd_pair(ctx, dq, dk):
    q, k, qw, kw, cache, positions = ctx.saved_tensors
    is_neox, opts = ctx.meta
    dxq, dxk, dwq, dwk = _qk_norm_pair_backward_op(dq, dk, q, k, qw, kw, cache, positions,
                                                   is_neox, *opts)
    need = ctx.needs_input_grad
    return (dxq if need[0] else None, dxk if need[1] else None,
            dwq if qw is not None and need[2] else None,
            dwk if kw is not None and need[3] else None, *(None,) * 8)


_qk_norm_pair_op.register_autograd(_bwd_pair, setup_context=_setup_pair)


def qk_norm_pair(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, *, rope: tuple | None = None,
                 **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable :func:`polynorm.qk_norm_pair`: new ``(q, k)`` from ``(T, H, D)`` heads.

    Parameters
    ----------
    q, k, q_weight, k_weight, rope, **options
        As in :func:`polynorm.qk_norm_pair`.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        New C-contiguous ``q`` and ``k``; gradients reach q, k and the weights.

    Examples
    --------
    >>> import torch
    >>> import polynorm.torch as pnt
    >>> q, k = torch.full((1, 2, 4), 3.0), torch.full((1, 1, 4), -2.0)
    >>> pnt.qk_norm_pair(q, k, None, None, eps=0.0)[1]
    tensor([[[-1., -1., -1., -1.]]])
    """
    a = _args(q_weight, k_weight, 0, 0, 0, rope, options)
    return _qk_norm_pair_op(q, k, a[0], a[1], *a[5:])


_qk_norm_op.register_autograd(_bwd, setup_context=_setup)
