"""Differentiable RMSNorm for jax: ``jax.custom_vjp`` on polynorm's hand-written backward.

:func:`polynorm.rms_norm` on jax arrays computes on their data; these
functions add the derivative, so ``jax.grad``/``jax.vjp`` use
:func:`polynorm.rms_norm_backward` instead of differentiating the forward.

Concrete CPU arrays run on the Numba kernels through zero-copy views; traced
arrays (inside ``jax.jit``) take the pure array-API reference path, which jax
compiles like any other jnp code.  Only reverse mode is defined (a
``custom_vjp`` has no forward-mode rule).  Needs ``pip install 'polynorm[jax]'``.
"""

from __future__ import annotations

from functools import partial as _partial
from typing import Any

import jax
import jax.numpy as jnp

from . import _api

__all__ = ["rms_norm", "add_rms_norm"]


def _static(eps, axis, partial, offset, eps_mode, casting, backend) -> tuple:
    # hashable: custom_vjp's non-differentiable arguments are static
    axis = tuple(axis) if isinstance(axis, (list, tuple)) else axis
    return (("eps", eps), ("axis", axis), ("partial", partial), ("offset", offset),
            ("eps_mode", eps_mode), ("casting", casting), ("backend", backend))


# ------------------------------------------------------------------ rms_norm


@_partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rms_norm(static, out_dtype, x, weight, bias):
    return _api.rms_norm(x, weight, bias, out_dtype=out_dtype, **dict(static))


def _rms_norm_fwd(static, out_dtype, x, weight, bias):
    y, rstd = _api.rms_norm(x, weight, bias, out_dtype=out_dtype, return_rstd=True,
                            **dict(static))
    return y, (x, weight, bias, rstd)


def _rms_norm_bwd(static, out_dtype, res, dy):
    x, weight, bias, rstd = res
    # cotangents may arrive as numpy arrays (jax.test_util does that)
    return _api.rms_norm_backward(jnp.asarray(dy), x, weight, bias, rstd=rstd, **dict(static))


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    axis: int | tuple[int, ...] = -1,
    partial: float = 1.0,
    offset: float = 0.0,
    eps_mode: str = "inside",
    casting: str = "fp32",
    out_dtype: Any = None,
    backend: str = "auto",
) -> jax.Array:
    """Differentiable :func:`polynorm.rms_norm` for jax arrays.

    Same arguments and result as :func:`polynorm.rms_norm` (without ``out``
    and ``return_rstd``); the vjp is polynorm's hand-written backward.

    Parameters
    ----------
    x : jax.Array
        Float array (float16, bfloat16, float32, float64).
    weight, bias : jax.Array, optional
        Shape of ``x`` over the normalized axes.
    eps, axis, partial, offset, eps_mode, casting, out_dtype, backend
        As in :func:`polynorm.rms_norm`; static (not traced).

    Returns
    -------
    jax.Array
        ``y``, with ``x``'s shape and ``out_dtype`` (default ``x``'s).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from polynorm.jax import rms_norm
    >>> x = jnp.array([[3.0, 4.0]], dtype=jnp.float32)
    >>> rms_norm(x, eps=0.0)
    Array([[0.84852815, 1.1313709 ]], dtype=float32)
    >>> jax.grad(lambda x: rms_norm(x, eps=0.0).sum())(x)
    Array([[ 0.045255, -0.033941]], dtype=float32)
    """
    static = _static(eps, axis, partial, offset, eps_mode, casting, backend)
    return _rms_norm(static, out_dtype, x, weight, bias)


# ------------------------------------------------------------------ add_rms_norm


@_partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _add_rms_norm(static, out_dtype, in_dtypes, x, residual, weight, bias):
    return _api.add_rms_norm(x, residual, weight, bias, out_dtype=out_dtype, **dict(static))


def _add_fwd(static, out_dtype, in_dtypes, x, residual, weight, bias):
    y, h, rstd = _api.add_rms_norm(x, residual, weight, bias, out_dtype=out_dtype,
                                   return_rstd=True, **dict(static))
    return (y, h), (h, weight, bias, rstd)


def _add_bwd(static, out_dtype, in_dtypes, res, cts):
    h, weight, bias, rstd = res
    x_dtype, r_dtype = in_dtypes
    dy, dh = (None if c is None else jnp.asarray(c) for c in cts)
    # the gradient reaching h through the residual stream is fused into dx
    dxh, dw, db = _api.rms_norm_backward(dy, h, weight, bias, rstd=rstd, grad_residual=dh,
                                         **dict(static))
    return dxh.astype(x_dtype), dxh.astype(r_dtype), dw, db


_add_rms_norm.defvjp(_add_fwd, _add_bwd)


def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    axis: int | tuple[int, ...] = -1,
    partial: float = 1.0,
    offset: float = 0.0,
    eps_mode: str = "inside",
    casting: str = "fp32",
    out_dtype: Any = None,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Differentiable :func:`polynorm.add_rms_norm`: returns ``(y, h)``, both differentiable.

    Parameters
    ----------
    x, residual : jax.Array
        Same shape; ``h`` has their promoted dtype.
    weight, bias : jax.Array, optional
    eps, axis, partial, offset, eps_mode, casting, out_dtype, backend
        As in :func:`polynorm.add_rms_norm`.

    Returns
    -------
    (y, h) : tuple of jax.Array
        The cotangents of ``x`` and ``residual`` come back in their own dtypes.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from polynorm.jax import add_rms_norm
    >>> x = jnp.array([[1.0, 2.0]], dtype=jnp.float32)
    >>> r = jnp.array([[2.0, 2.0]], dtype=jnp.float32)
    >>> y, h = add_rms_norm(x, r, eps=0.0)
    >>> h
    Array([[3., 4.]], dtype=float32)
    >>> g = jax.grad(lambda x: sum(a.sum() for a in add_rms_norm(x, r, eps=0.0)))(x)
    >>> [round(float(v), 4) for v in g.ravel()]
    [1.0453, 0.9661]
    """
    if residual is None:
        raise TypeError("residual must be an array, got None")
    static = _static(eps, axis, partial, offset, eps_mode, casting, backend)
    in_dtypes = (x.dtype, residual.dtype)  # each input's gradient comes back in its dtype
    return _add_rms_norm(static, out_dtype, in_dtypes, x, residual, weight, bias)
