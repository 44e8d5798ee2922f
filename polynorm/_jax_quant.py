"""RMSNorm with quantized output for jax (re-exported by :mod:`polynorm.jax`).

Concrete CPU arrays run the Numba kernel; traced arrays (``jit``, ``vmap``)
run the array-API reference through ``jax.numpy``, which XLA compiles (its
``y`` may differ from the kernel's by an ulp, and so a ``q`` by one step).
Inference only: no derivative is defined.
"""

from __future__ import annotations

from typing import Any

import jax

from . import _quant

__all__ = ["rms_norm_quant"]


def rms_norm_quant(x, weight=None, bias=None, *, residual=None, dtype: Any = "float8_e4m3fn",
                   scale: Any = None, group_size: int | None = None, eps: float = 1e-6,
                   axis: int | tuple[int, ...] = -1, partial: float = 1.0, offset: float = 0.0,
                   eps_mode: str = "inside", casting: str = "fp32", backend: str = "auto"):
    """:func:`polynorm.rms_norm_quant` for jax arrays, ``jit``-compatible.

    Parameters
    ----------
    x, weight, bias, residual : jax.Array
        As in :func:`polynorm.rms_norm_quant`.
    dtype, scale, group_size, eps, axis, partial, offset, eps_mode, casting, backend
        As in :func:`polynorm.rms_norm_quant`; all but an array ``scale`` are
        static under ``jit``.

    Returns
    -------
    (q, scales) or (q, scales, h)
        ``q`` of ``jnp.float8_e4m3fn`` or ``jnp.int8``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import polynorm.jax as pj
    >>> q, s = jax.jit(lambda a: pj.rms_norm_quant(a, dtype="int8", eps=0.0))(
    ...     jnp.array([[3.0, 4.0]]))
    >>> q
    Array([[ 95, 127]], dtype=int8)
    """
    arrays = (x, weight, bias, residual, scale)
    if backend == "auto" and any(isinstance(a, jax.core.Tracer) for a in arrays):
        backend = "array_api"
    return _quant.rms_norm_quant(x, weight, bias, residual=residual, dtype=dtype, scale=scale,
                                 group_size=group_size, eps=eps, axis=axis, partial=partial,
                                 offset=offset, eps_mode=eps_mode, casting=casting,
                                 backend=backend)
