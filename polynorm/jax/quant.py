"""RMSNorm with quantized output for jax (re-exported by :mod:`polynorm.jax`).

Concrete CPU arrays run the Numba kernel; traced arrays (``jit``, ``vmap``)
run the array-API reference through ``jax.numpy``, which XLA compiles (its
``y`` may differ from the kernel's by an ulp, and so a ``q`` by one step).
XLA also compiles a division by a constant as a multiplication by its
reciprocal: under ``jit`` a float ``scale`` with ``scale_mode="divide"``
gives ``"reciprocal"``'s bits, and a dynamic scale ``amax / qmax`` may be
an ulp off ``amax * (1 / qmax)``-wise; a ``scale`` passed as an array
argument of the jitted function is divided as written.
Inference only: no derivative is defined.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax

from polynorm.core.options import NormOptions, takes_options
from polynorm.ops import quant as _quant

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["rms_norm_quant"]


@takes_options(exclude=("out_dtype",))
def rms_norm_quant(x, weight=None, bias=None, *, residual=None, dtype: Any = "float8_e4m3fn",
                   scale: Any = None, group_size: int | None = None,
                   scale_mode: str = "divide", **options: Unpack[NormOptions]):
    """:func:`polynorm.rms_norm_quant` for jax arrays, ``jit``-compatible.

    Parameters
    ----------
    x, weight, bias, residual : jax.Array
        As in :func:`polynorm.rms_norm_quant`.
    dtype, scale, scale_mode
        As in :func:`polynorm.rms_norm_quant`.
    group_size : int, optional
        As in :func:`polynorm.rms_norm_quant`.
    {options}

    All but the arrays (and an array ``scale``) are static under ``jit``.

    Returns
    -------
    (q, scales) or (q, scales, h)
        ``q`` of ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2`` or ``jnp.int8``.

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
    if options.get("backend", "auto") == "auto" and any(isinstance(a, jax.core.Tracer)
                                                       for a in arrays):
        options = {**options, "backend": "array_api"}
    return _quant.rms_norm_quant(x, weight, bias, residual=residual, dtype=dtype, scale=scale,
                                 group_size=group_size, scale_mode=scale_mode, **options)
