"""Differentiable QK-norm (+ RoPE) for jax (re-exported by :mod:`polynorm.jax`).

A ``jax.custom_vjp`` around :func:`polynorm.qk_norm`, functional (jax arrays are
immutable): it returns the new ``qkv``.  Concrete CPU arrays run the Numba kernel,
traced ones (``jit``, ``grad`` of ``jit``) the array-API reference.  The backward
is :func:`polynorm.ops.qk.qk_backward`: the inverse rotation, then
:func:`polynorm.rms_norm_backward` of the heads' rows; the v slice's gradient
passes through, the cache and positions get none.
"""

from __future__ import annotations

from functools import partial as _partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

import polynorm.ops.qk as _qk
from polynorm.core.options import NormOptions, Options, make_plan, takes_options

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["qk_norm"]


def _opts(opts: Options, *arrays) -> Options:
    if opts.backend == "auto" and any(isinstance(a, jax.core.Tracer) for a in arrays):
        return opts._replace(backend="array_api")
    return opts


def _forward(static, qkv, qw, kw, cache, positions):
    hq, hk, d, neox, opts = static
    rope = None if cache is None else (cache, positions, neox, None)
    return _qk.packed(qkv, qw, kw, hq, hk, d, rope, _opts(opts, qkv, qw, kw, cache, positions))


@_partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qk_fn(static, qkv, qw, kw, cache, positions):
    return _forward(static, qkv, qw, kw, cache, positions)


def _fwd(static, qkv, qw, kw, cache, positions):
    return _forward(static, qkv, qw, kw, cache, positions), (qkv, qw, kw, cache, positions)


def _bwd(static, res, dy):
    qkv, qw, kw, cache, positions = res
    hq, hk, d, neox, opts = static
    dy = jnp.asarray(dy)  # a concrete cotangent may arrive as numpy
    opts = _opts(opts, dy, qkv, qw, kw)
    plan = make_plan(d, jnp.dtype(qkv.dtype).name, opts)
    cs = None
    if cache is not None:
        cdt = jnp.float64 if plan.compute_dtype == "float64" else jnp.float32
        cs = (jnp.take(cache, positions, axis=0).astype(cdt), neox)
    t = qkv.shape[0]
    parts, dws = [], []
    for lo, h, w in ((0, hq, qw), (hq * d, hk, kw)):
        g3 = jnp.reshape(dy[:, lo:lo + h * d], (t, h, d))
        x3 = jnp.reshape(qkv[:, lo:lo + h * d], (t, h, d))
        dx, dw = _qk.qk_backward(g3, x3, w, plan, cs, opts)
        parts.append(jnp.reshape(dx, (t, h * d)))
        dws.append(dw)
    parts.append(dy[:, (hq + hk) * d:])
    return jnp.concatenate(parts, axis=1), dws[0], dws[1], None, None


_qk_fn.defvjp(_fwd, _bwd)


@takes_options(exclude=_qk.EXCLUDED)
def qk_norm(qkv, q_weight, k_weight, *, num_heads_q: int, num_heads_k: int, head_dim: int,
            rope: tuple | None = None, **options: Unpack[NormOptions]):
    """Differentiable :func:`polynorm.qk_norm` for jax (reverse mode): the new ``qkv``.

    The arguments, options and bits of :func:`polynorm.qk_norm`; gradients reach
    ``qkv``, ``q_weight`` and ``k_weight``.  Positions out of the cache's range are
    not checked for traced arrays (``jnp.take`` fills them with NaN).

    Parameters
    ----------
    qkv, q_weight, k_weight, num_heads_q, num_heads_k, head_dim, rope
        As in :func:`polynorm.qk_norm`.
    {options}

    Returns
    -------
    jax.Array
        The new ``qkv``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import polynorm.jax as pj
    >>> qkv = jnp.arange(12.0, dtype=jnp.float32).reshape(1, 12)
    >>> f = lambda a: pj.qk_norm(a, None, None, num_heads_q=1, num_heads_k=1, head_dim=4).sum()
    >>> jax.grad(f)(qkv)[0, 8:]
    Array([1., 1., 1., 1.], dtype=float32)
    """
    opts = _qk._opts("qk_norm", options)
    neox = True
    cache = positions = None
    if rope is not None:
        if not isinstance(rope, (tuple, list)) or len(rope) != 4:
            raise TypeError("rope must be a tuple (cos_sin_cache, positions, is_neox, "
                            f"rotary_dim), got {type(rope).__name__}")
        cache, positions, neox, rot = rope
        if rot is not None and rot != cache.shape[-1]:
            raise ValueError(f"rope's rotary_dim={rot} must equal cos_sin_cache's width "
                             f"{cache.shape[-1]}")
        if not isinstance(neox, bool):
            raise TypeError(f"rope's is_neox must be True or False, got {neox!r}")
    static = (num_heads_q, num_heads_k, head_dim, neox, opts)
    return _qk_fn(static, qkv, q_weight, k_weight, cache, positions)
