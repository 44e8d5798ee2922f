"""The hidden axis split across shards (tensor parallelism): the front end.

A row's ``d`` elements lie in shards (ranks of a tensor-parallel group, chunks of a
dask array).  Each shard sums the squares of its elements (:func:`rms_norm_stats`),
the caller adds the shards' sums (one all-reduce of one float per token), and each
shard normalizes its own elements with the total (:func:`rms_norm_from_stats`).  The
backward does the same with its per-token coefficient
(:func:`rms_norm_backward_stats`, then :func:`rms_norm_backward_from_stats`).  This
is vLLM's split-hidden RMSNorm (MiniMax, ``_forward_qk_tp``), Megatron-LM's
sequence/tensor-parallel norm and Flax's ``axis_name`` statistic.

Validation, layout and the from-stats calls are :mod:`polynorm.ops.norm`'s (whose
``rms_norm`` takes ``sumsq=``/``d_total=`` as the same call); the kernels are a
backend's :class:`polynorm.backends.SplitKernels` (Numba, CUDA, dask) and
:class:`polynorm.backends.SplitBackwardKernels` (CUDA), or the reference's ``split_*``
functions (every other backend, ``casting="llama"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polynorm.core.options import NormOptions, Options, pack_options, takes_options
from polynorm.ops import norm as _api
from polynorm.ops.norm import Array

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["rms_norm_stats", "rms_norm_from_stats", "rms_norm_backward_stats",
           "rms_norm_backward_from_stats"]

#: options without meaning here: no residual
_NO_RESIDUAL = ("norm_input", "residual_dtype")
#: ... and, for the functions that return no y, no output dtype
_NO_Y = (*_NO_RESIDUAL, "out_dtype")

#: options without meaning for a norm without residual: the distributed front ends
#: (polynorm.torch.distributed, polynorm.jax.distributed) take none of them
NO_RESIDUAL_OPTIONS = ("norm_input", "residual_dtype")


def split_kwargs(opts: Options, *, y: bool) -> dict[str, Any]:
    """``opts`` as the keywords of :func:`rms_norm_from_stats` (``y=True``) or of the
    stats functions (``y=False``: no ``out_dtype``), without the residual's options."""
    kw = {n: v for n, v in opts._asdict().items() if n not in NO_RESIDUAL_OPTIONS}
    if not y:
        del kw["out_dtype"]
    return kw


def _fixed(names: tuple[str, ...]) -> dict[str, Any]:
    """The excluded options at their defaults (``pack_options``: a caller's keyword for
    one of them is then a ``TypeError``)."""
    return {n: getattr(_DEFAULTS, n) for n in names}


_DEFAULTS = Options()

_SPLIT_DOCS = {
    "partial": "partial : float, default 1.0\n"
               "    Must be 1.0 (``ValueError`` otherwise): the first ``k`` elements of a whole\n"
               "    row lie in some shards only, and each shard would need its own count.",
    "partial_size": "partial_size : int, optional\n"
                    "    Must be None (``ValueError`` otherwise), as ``partial``.",
}


# The checks, layout, kernel choice and numpy fast path are polynorm.ops.norm's split
# section (rms_norm takes sumsq=/d_total= too, and norm.py cannot import this module).
_check_split = _api.split_check
_d_total = _api.split_d_total
_row_stat = _api.split_row_stat
_kernels = _api.split_kernels
_fast = _api.split_fast
_prepare = _api.split_prepare


@takes_options(exclude=_NO_Y, docs=_SPLIT_DOCS)
def rms_norm_stats(x: Array, **options: Unpack[NormOptions]) -> Array:
    """One shard's sum of squares per token, for a hidden axis split across shards.

    ``sumsq[t] = sum_j x[t, j]**2`` over this shard's elements of each normalized
    slice, accumulated in float64 (float32 with jax without ``jax_enable_x64``),
    where float32 and 16-bit squares neither overflow nor underflow.  Add the
    shards' ``sumsq`` (an all-reduce of one float per token) and pass the total to
    :func:`rms_norm_from_stats` on every shard.

    Bits: on the Numba backend (numpy, torch and jax CPU arrays) the sum is the
    unsplit forward's own (the same kernel code and order), so with one shard
    ``rms_norm_from_stats(x, w, sumsq=rms_norm_stats(x), d_total=d)`` gives
    :func:`rms_norm`'s ``y`` and ``rstd`` bit for bit for every token whose sum is
    in range: not zero, Inf or NaN, and, for float32 and 16-bit input, at least
    ``2**-100`` without an overflowing float32 partial
    (the rows the unsplit forward rescales from the whole slice; those agree to
    rounding).  On the CUDA backend the sum is the CUDA forward's (its tree for
    this ``d``), and one shard gives :func:`rms_norm`'s bits for every float32 and
    16-bit token (float64: within rounding).  With several shards the shards'
    sums are added in another order
    than one shard's loop: the result is within rounding of the unsplit call, not
    bit-equal.  The reference (other libraries) sums in float64 where the unsplit
    reference sums in the compute dtype: within rounding too.  float64 input whose
    squares overflow or underflow float64 (``|x| > 1e154`` or all below
    ``1e-154``) is outside the split path's range (the unsplit call rescales by the
    whole slice's largest magnitude, which no shard knows).

    Parameters
    ----------
    x : array
        This shard's elements: the normalized axes hold this shard's part of each
        slice.
    {options}

    Only ``axis`` and ``backend`` change the sums; the other options are
    accepted so that one set of options serves every function of the split.

    Returns
    -------
    sumsq : array
        Shape of ``x`` without the normalized axes.

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[3.0, 4.0, 12.0, 0.0]], dtype=np.float32)
    >>> parts = [pn.rms_norm_stats(x[:, :2]), pn.rms_norm_stats(x[:, 2:])]
    >>> parts[0], parts[1]
    (array([25.]), array([144.]))
    >>> total = parts[0] + parts[1]            # the all-reduce
    >>> y1 = pn.rms_norm_from_stats(x[:, 2:], sumsq=total, d_total=4, eps=0.0)
    >>> bool(np.allclose(y1, pn.rms_norm(x, eps=0.0)[:, 2:]))
    True
    """
    opts = pack_options("rms_norm_stats", options, **_fixed(_NO_Y))
    fast = _fast(x, None, None, opts)
    if fast is not None:
        mod, plan, n, d = fast
        return mod.split_stats(x.reshape(n, d), plan).reshape(x.shape[:-1])
    x, _, _, _, call = _prepare("rms_norm_stats", x, None, None, {}, opts)
    lay, plan = call.lay, call.plan
    with _api._no_autograd(x):
        ss = _kernels(call, plan).split_stats(lay.rows(x), plan)
    return lay.unbatch(ss)


@takes_options(exclude=_NO_RESIDUAL, docs=_SPLIT_DOCS)
def rms_norm_from_stats(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    sumsq: Array,
    d_total: int,
    return_rstd: bool = False,
    **options: Unpack[NormOptions],
) -> Array | tuple[Array, Array]:
    """RMSNorm of one shard's elements from the whole slices' sum of squares.

    With ``sumsq`` the shards' :func:`rms_norm_stats` added up (an all-reduce)::

        rstd = 1 / sqrt(sumsq / d_total + eps)      # eps_mode="inside"
        rstd = 1 / (sqrt(sumsq / d_total) + eps)    # eps_mode="outside"
        y    = x * rstd * (weight + offset) + bias  # this shard's elements

    rstd is formed in float64 from ``sumsq`` and rounded to the compute dtype;
    ``y`` then follows :func:`rms_norm` (casting, ``out_dtype``).  When bits equal
    the unsplit call: see :func:`rms_norm_stats`.  ``rms_norm(x, weight, bias,
    sumsq=, d_total=)`` is the same call.

    Parameters
    ----------
    x : array
        This shard's elements.
    weight, bias : array, optional
        This shard's part of them (shape of ``x`` over the normalized axes).
    sumsq : array
        The whole slices' sums of squares: shape of ``x`` without the normalized
        axes, a float dtype (float64 keeps the bits, see :func:`rms_norm_stats`),
        the library of ``x``.
    d_total : int
        The whole slice's length (all shards together): the mean's denominator.
    return_rstd : bool
        Also return ``rstd`` (shape of ``sumsq``, float32, float64 for float64 x).
    {options}

    Returns
    -------
    y or (y, rstd)

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[1.0, -1.0]], dtype=np.float32)   # half of a row of d = 4
    >>> pn.rms_norm_from_stats(x, np.full(2, 2.0, np.float32), sumsq=np.array([4.0]),
    ...                        d_total=4, eps=0.0)
    array([[ 2., -2.]], dtype=float32)
    """
    opts = pack_options("rms_norm_from_stats", options, **_fixed(_NO_RESIDUAL))
    return _api.from_stats("rms_norm_from_stats", x, weight, bias, sumsq, d_total, opts,
                           return_rstd)


@takes_options(exclude=_NO_Y, docs=_SPLIT_DOCS)
def rms_norm_backward_stats(
    dy: Array,
    x: Array,
    weight: Array | None = None,
    *,
    sumsq: Array,
    d_total: int,
    **options: Unpack[NormOptions],
) -> Array:
    """One shard's part of the backward's per-token coefficient, for the all-reduce.

    ``dot[t] = sum_j (g * dy * xhat)[t, j]`` over this shard's elements, with
    ``g = weight + offset`` (1 without a weight) and ``xhat = x * rstd`` (rstd from
    ``sumsq`` as in :func:`rms_norm_from_stats`), in float64 (float32 with jax
    without x64).  Add the shards' ``dot`` and pass the total to
    :func:`rms_norm_backward_from_stats`.

    Parameters
    ----------
    dy, x : array
        This shard's gradient of ``y`` and input.
    weight : array, optional
        This shard's part of it.
    sumsq, d_total
        As in :func:`rms_norm_from_stats` (the forward's total).
    {options}

    Returns
    -------
    dot : array
        Shape of ``x`` without the normalized axes.

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[3.0, 4.0]])
    >>> pn.rms_norm_backward_stats(np.ones_like(x), x, sumsq=np.array([25.0]), d_total=2,
    ...                            eps=0.0)
    array([1.97989899])
    """
    opts = pack_options("rms_norm_backward_stats", options, **_fixed(_NO_Y))
    func = "rms_norm_backward_stats"
    x, weight, _, arrays, call = _prepare(func, x, weight, None, {"dy": dy, "sumsq": sumsq}, opts)
    lay, plan = call.lay, call.plan
    ss = _row_stat(func, "sumsq", arrays["sumsq"], lay)
    kt = _d_total(func, d_total, lay.d)
    with _api._no_autograd(x, dy=arrays["dy"], weight=weight, sumsq=arrays["sumsq"]):
        dot = _api.split_bwd_kernels(call).split_dot(lay.rows(arrays["dy"]), lay.rows(x),
                                                     lay.flat(weight), ss, kt, plan)
    return lay.unbatch(dot)


@takes_options(exclude=_NO_Y, docs=_SPLIT_DOCS)
def rms_norm_backward_from_stats(
    dy: Array,
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    sumsq: Array,
    dot: Array,
    d_total: int,
    **options: Unpack[NormOptions],
) -> tuple[Array, Array | None, Array | None]:
    """Backward of :func:`rms_norm_from_stats` on one shard, from the all-reduced sums.

    :func:`rms_norm_backward`'s formula with the whole slice's ``c = dot`` (the
    shards' :func:`rms_norm_backward_stats` added up) and ``k = d_total``::

        dx      = rstd * (g*dy - xhat * dot / d_total)   (eps inside; outside: times
                                                          (s + eps) / s, s = rstd's rms)
        dweight = sum over tokens of dy * xhat           (this shard's columns)
        dbias   = sum over tokens of dy

    ``dweight``/``dbias`` of a shard are its own columns' gradients: no
    all-reduce over the hidden axis (a data-parallel reduction over tokens is
    the caller's, as for any weight).  The array-API reference's arithmetic;
    on CUDA its kernels (``dx`` bit for bit, ``dweight``/``dbias`` summed in
    double).
    ``rms_norm_backward(dy, x, weight, bias, sumsq=, dot=, d_total=)`` is the
    same call.

    Parameters
    ----------
    dy, x : array
        This shard's gradient of ``y`` and input.
    weight, bias : array, optional
        This shard's part of them; ``dweight``/``dbias`` are None without them.
    sumsq, d_total
        As in :func:`rms_norm_from_stats`.
    dot : array
        The shards' :func:`rms_norm_backward_stats` added up.
    {options}

    Returns
    -------
    (dx, dweight, dbias)

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x, dy = np.array([[3.0, 4.0]]), np.ones((1, 2))
    >>> ss = np.array([25.0])
    >>> dot = pn.rms_norm_backward_stats(dy, x, sumsq=ss, d_total=2, eps=0.0)
    >>> dx, _, _ = pn.rms_norm_backward_from_stats(dy, x, sumsq=ss, dot=dot, d_total=2,
    ...                                            eps=0.0)
    >>> bool(np.allclose(dx, pn.rms_norm_backward(dy, x, eps=0.0)[0]))
    True
    """
    opts = pack_options("rms_norm_backward_from_stats", options, **_fixed(_NO_Y))
    return _api.backward_from_stats("rms_norm_backward_from_stats", dy, x, weight, bias, sumsq,
                                    dot, d_total, opts)
