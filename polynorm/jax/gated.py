"""Differentiable gated RMSNorm for jax (re-exported by :mod:`polynorm.jax`).

A ``jax.custom_vjp`` on :func:`polynorm.rms_norm_gated_backward`.  Concrete
CPU arrays run the Numba kernels; traced arrays (``jit``, ``vmap``,
``grad`` of ``jit``) run the pure array-API reference, which XLA compiles
(other bits than the kernels: within the dtype's tolerance).
"""

from __future__ import annotations

from functools import partial as _partial
from typing import TYPE_CHECKING

import jax

from polynorm.core.options import NormOptions, Options, pack_options, takes_options
from polynorm.jax.norm import _static
from polynorm.jax.norm import rms_norm as _rms_norm
from polynorm.ops import gated as _gated

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["rms_norm_gated"]


def _opts(static: tuple, *arrays) -> Options:
    """The options of ``static = (group_size, norm_before_gate, opts)``; ``backend="auto"``
    runs the reference on tracers (the kernels need concrete arrays)."""
    opts = static[2]
    if opts.backend == "auto" and any(isinstance(a, jax.core.Tracer) for a in arrays):
        return opts._replace(backend="array_api")
    return opts


@_partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated_fn(static, x, z, weight, bias):
    return _gated.gated_forward(x, z, weight, bias, _opts(static, x, z, weight, bias),
                                group_size=static[0], norm_before_gate=static[1])


def _fwd(static, x, z, weight, bias):
    y, rstd = _gated.gated_forward(x, z, weight, bias, _opts(static, x, z, weight, bias),
                                   group_size=static[0], norm_before_gate=static[1],
                                   return_rstd=True)
    return y, (x, z, weight, bias, rstd)


def _bwd(static, res, dy):
    x, z, weight, bias, rstd = res
    opts = _opts(static, dy, x, z, rstd)._replace(out_dtype=None)
    dx, dz, dw, db = _gated.gated_backward(dy, x, z, weight, bias, rstd, opts,
                                           group_size=static[0], norm_before_gate=static[1])
    return dx, dz, dw, db


_gated_fn.defvjp(_fwd, _bwd)


@takes_options()
def rms_norm_gated(x, z, weight=None, bias=None, *, group_size: int | None = None,
                   norm_before_gate: bool = False, **options: Unpack[NormOptions]):
    """Differentiable :func:`polynorm.rms_norm_gated` for jax (reverse mode).

    Parameters
    ----------
    x, z, weight, bias : jax.Array
        As in :func:`polynorm.rms_norm_gated`.
    group_size : int, optional
        As in :func:`polynorm.rms_norm_gated`.
    norm_before_gate : bool
        As in :func:`polynorm.rms_norm_gated`.
    {options}

    All but the arrays are static: they select the computation.

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

    opts = pack_options("rms_norm_gated", options)
    if z is None:  # Mamba's RMSNormGated(z=None): the grouped norm, no gate
        return _rms_norm(x, weight, bias,
                        **_gated.ungated_options(opts, group_size, norm_before_gate)._asdict())
    return _gated_fn((group_size, bool(norm_before_gate), _static(opts)), x, z, weight, bias)
