"""Differentiable gated RMSNorm for jax (re-exported by :mod:`polynorm.jax`).

A ``jax.custom_vjp`` on :func:`polynorm.rms_norm_gated_backward`.  Concrete
CPU arrays run the Numba kernels; traced arrays (``jit``, ``vmap``,
``grad`` of ``jit``) run the pure array-API reference, which XLA compiles
(other bits than the kernels: within the dtype's tolerance).
"""

from __future__ import annotations

from functools import partial as _partial
from typing import Any

import jax

from . import _gated

__all__ = ["rms_norm_gated"]


def _backend(static: tuple, *arrays) -> str:
    backend = static[-1]
    if backend == "auto" and any(isinstance(a, jax.core.Tracer) for a in arrays):
        return "array_api"
    return backend


def _kw(static: tuple, *arrays) -> dict[str, Any]:
    group_size, nbg, eps, axis, partial, offset, eps_mode, casting, _ = static
    return dict(group_size=group_size, norm_before_gate=nbg, eps=eps, axis=axis,
                partial=partial, offset=offset, eps_mode=eps_mode, casting=casting,
                backend=_backend(static, *arrays))


@_partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gated_fn(static, out_dtype, x, z, weight, bias):
    return _gated.rms_norm_gated(x, z, weight, bias, out_dtype=out_dtype,
                                 **_kw(static, x, z, weight, bias))


def _fwd(static, out_dtype, x, z, weight, bias):
    y, rstd = _gated.rms_norm_gated(x, z, weight, bias, out_dtype=out_dtype, return_rstd=True,
                                    **_kw(static, x, z, weight, bias))
    return y, (x, z, weight, bias, rstd)


def _bwd(static, out_dtype, res, dy):
    x, z, weight, bias, rstd = res
    dx, dz, dw, db = _gated.rms_norm_gated_backward(dy, x, z, weight, bias, rstd=rstd,
                                                    **_kw(static, dy, x, z, rstd))
    return dx, dz, dw, db


_gated_fn.defvjp(_fwd, _bwd)


def rms_norm_gated(x, z, weight=None, bias=None, *, group_size: int | None = None,
                   norm_before_gate: bool = False, eps: float = 1e-6,
                   axis: int | tuple[int, ...] = -1, partial: float = 1.0, offset: float = 0.0,
                   eps_mode: str = "inside", casting: str = "fp32", out_dtype: Any = None,
                   backend: str = "auto"):
    """Differentiable :func:`polynorm.rms_norm_gated` for jax (reverse mode).

    Parameters
    ----------
    x, z, weight, bias : jax.Array
        As in :func:`polynorm.rms_norm_gated`.
    group_size, norm_before_gate, eps, axis, partial, offset, eps_mode, casting, out_dtype, backend
        As in :func:`polynorm.rms_norm_gated` (static: they select the computation).

    Returns
    -------
    jax.Array
        ``y``, with a ``jax.custom_vjp`` whose backward is
        :func:`polynorm.rms_norm_gated_backward`.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import polynorm.jax as pj
    >>> x, z = jnp.ones((2, 4)), jnp.zeros((2, 4))
    >>> f = lambda a, b: pj.rms_norm_gated(a, b, norm_before_gate=True, eps=0.0).sum()
    >>> dx, dz = jax.grad(f, argnums=(0, 1))(x, z)
    >>> dz.shape, float(dz[0, 0])     # silu'(0) = 1/2, xhat = 1
    ((2, 4), 0.5)
    """
    ax = tuple(axis) if isinstance(axis, (tuple, list)) else axis
    static = (group_size, bool(norm_before_gate), float(eps), ax, float(partial), float(offset),
              eps_mode, casting, backend)
    if out_dtype is not None and not isinstance(out_dtype, str):
        from ._dtypes import parse_dtype

        out_dtype = parse_dtype("out_dtype", out_dtype)
    return _gated_fn(static, out_dtype, x, z, weight, bias)
