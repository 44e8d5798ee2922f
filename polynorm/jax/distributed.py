"""RMSNorm over a hidden axis split across the devices of a mesh axis (``shard_map``).

Inside ``jax.shard_map`` each device holds its slice of every token's hidden vector;
:func:`rms_norm` sums the slice's squares (:func:`polynorm.rms_norm_stats`), adds them
over ``axis_name`` (``lax.psum`` of one float per token) and normalizes the slice
(:func:`polynorm.rms_norm_from_stats`).  Its ``custom_vjp`` backward does the same
with the per-token coefficient (:func:`polynorm.rms_norm_backward_stats`, one
``psum``), so the gradient is the unsplit norm's.  Flax's ``nn.RMSNorm(axis_name=...)``
reduces its statistic over a named axis the same way (there for batch statistics).
"""

from __future__ import annotations

from functools import partial as _partial
from typing import TYPE_CHECKING, Any

import jax

from polynorm.core.options import NormOptions, Options, pack_options, takes_options
from polynorm.ops import split as _split

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["rms_norm"]

_EXCLUDE = _split.NO_RESIDUAL_OPTIONS
_kw = _split.split_kwargs


def _forward(x, weight, bias, axis_name, d_total, opts):
    ss = jax.lax.psum(_split.rms_norm_stats(x, **_kw(opts, y=False)), axis_name)
    y = _split.rms_norm_from_stats(x, weight, bias, sumsq=ss, d_total=d_total,
                                   **_kw(opts, y=True))
    return y, ss


@_partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _split_norm(x, weight, bias, axis_name, d_total, opts):
    return _forward(x, weight, bias, axis_name, d_total, opts)[0]


def _split_fwd(x, weight, bias, axis_name, d_total, opts):
    y, ss = _forward(x, weight, bias, axis_name, d_total, opts)
    return y, (x, weight, bias, ss)


def _split_bwd(axis_name, d_total, opts, res, dy):
    x, weight, bias, ss = res
    kw = _kw(opts, y=False)
    dot = _split.rms_norm_backward_stats(dy, x, weight, sumsq=ss, d_total=d_total, **kw)
    dot = jax.lax.psum(dot, axis_name)
    return _split.rms_norm_backward_from_stats(dy, x, weight, bias, sumsq=ss, dot=dot,
                                               d_total=d_total, **kw)


_split_norm.defvjp(_split_fwd, _split_bwd)


@takes_options(exclude=_EXCLUDE)
def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    axis_name: Any,
    d_total: int | None = None,
    **options: Unpack[NormOptions],
) -> jax.Array:
    """Differentiable RMSNorm of a hidden axis split over the mesh axis ``axis_name``.

    Call it inside ``jax.shard_map`` (or anything that binds ``axis_name``) on the
    device's slice; the result is the device's slice of the unsplit
    :func:`polynorm.jax.rms_norm` (within rounding, see
    :func:`polynorm.rms_norm_stats`).  Forward and backward each make one
    ``lax.psum`` of one float per token (float32 without ``jax_enable_x64``, else
    float64).  Runs the array-API reference (traced), which XLA compiles.

    Parameters
    ----------
    x : jax.Array
        This device's slice: the normalized axes hold its part of each token's
        hidden vector.
    weight, bias : jax.Array, optional
        This device's part of them (shard them like ``x``'s hidden axis).
    axis_name : hashable
        The mesh axis the hidden axis is split over.
    d_total : int, optional
        The whole hidden size; default this slice's size times the axis size.
    {options}

    Returns
    -------
    jax.Array
        This device's slice of ``y``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import PartitionSpec as P
    >>> from polynorm.jax.distributed import rms_norm
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    >>> f = jax.jit(jax.shard_map(lambda x: rms_norm(x, axis_name="tp", eps=0.0), mesh=mesh,
    ...                           in_specs=P(None, "tp"), out_specs=P(None, "tp")))
    >>> np.round(np.asarray(f(jnp.array([[3.0, 4.0]], jnp.float32))), 4)
    array([[0.8485, 1.1314]], dtype=float32)
    """
    opts = pack_options("rms_norm", options, **{n: getattr(Options(), n) for n in _EXCLUDE})
    if isinstance(opts.axis, list):
        opts = opts._replace(axis=tuple(opts.axis))
    # traced arrays run the reference (XLA compiles it); concrete ones could take
    # the Numba kernels, but a psum needs a trace anyway
    opts = opts._replace(backend="array_api") if opts.backend == "auto" else opts
    if d_total is None:
        import math

        axes = opts.axis if isinstance(opts.axis, tuple) else (opts.axis,)
        try:
            d_local = math.prod(x.shape[a] for a in axes)
        except (IndexError, TypeError):  # the front end's error names the bad axis
            _split.rms_norm_stats(x, **_kw(opts, y=False))
            raise
        d_total = d_local * jax.lax.axis_size(axis_name)
    return _split_norm(x, weight, bias, axis_name, int(d_total), opts)
