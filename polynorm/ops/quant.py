"""Quantized-output RMSNorm's front end: :func:`rms_norm_quant`.

Validation and layout reuse :mod:`polynorm.ops.norm`'s helpers; the semantics
are :class:`polynorm.core.options.QuantPlan` around the :class:`~polynorm.core.options.Plan`
of ``rms_norm(..., out_dtype="float32")``.  A backend takes part when its
module has ``quant_forward`` (2-D rows, 1-D weight/bias; returns
``(q, scales, h)``); ``backend="auto"`` falls back to the array-API
reference for a backend without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import array_api_compat as aac
import numpy as np

from polynorm.core.dtypes import FLOAT_DTYPES, dtype_name, float_dtype_name
from polynorm.core.options import (
    DTypeLike,
    NormOptions,
    Options,
    make_quant_plan,
    pack_options,
    parse_quant_dtype,
    promote,
    takes_options,
)
from polynorm.ops import fast as _fastpath
from polynorm.ops import norm as _api
from polynorm.ops.norm import Array

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["rms_norm_quant"]


def _quant_backend(backend: Any, x: Any):
    return _api._capable_backend(backend, x, _api._backends.QuantKernels, "quantized-output")


def _scale_arg(scale: Any) -> tuple[Any, Any]:
    """``(number or None, array or None)`` from the ``scale`` argument."""
    if scale is None:
        return None, None
    if aac.is_array_api_obj(scale) and not isinstance(scale, (int, float)):
        if getattr(scale, "ndim", None) == 0 and type(scale).__module__ == "numpy":
            # a numpy scalar or 0-d array is a host value, checked like a float; a
            # float one (ml_dtypes' bfloat16 among them, which is no numbers.Real)
            # converts exactly, anything else keeps its type for _check_real's error
            value = scale[()]
            if dtype_name(scale.dtype) in FLOAT_DTYPES:
                return float(value), None
            return value, None
        return None, scale
    return scale, None


#: decode calls: call signature -> (numba module, QuantPlan, its QuantDecode), or None (the
#: general path)
_DECODE: dict[tuple, Any] = {}


def _decode_entry(x, weight, bias, residual, qdtype, scale, group_size, scale_mode,
                  opts: Options):
    """``(numba module, QuantPlan, QuantDecode)`` for a serial-size numpy call the decode
    path serves (2-D rows, axis=-1, backend="auto", options of exact types, a number or
    no scale), else None."""
    mod = _fastpath.numba_module(opts)
    if mod is None or not hasattr(mod, "quant_decode_plan") or not _fastpath._exact(opts):
        return None
    head = _fastpath._rows(x, weight, bias, residual, None)
    if head is None:
        return None
    names, norm, d, _, _ = head
    qplan = _qplan(names, norm, d, x, residual, qdtype, scale, group_size, scale_mode, opts)
    if qplan is None:
        return None
    decode = mod.quant_decode_plan(qplan, x, residual, weight, bias)
    return None if decode is None else (mod, qplan, decode)


def _qplan(names, norm, d, x, residual, qdtype, scale, group_size, scale_mode, opts: Options):
    """The QuantPlan of a numpy call that the fast paths take (``norm``: ``x``'s dtype name,
    promoted here with a residual's), else None: the general path then raises what is
    wrong, in its own order."""
    if residual is not None:
        rname = names.get(residual.dtype)
        if rname is None or residual.shape != x.shape:
            return None
        norm = promote(norm, rname)
    plan = _fastpath._plan(d, norm, opts)
    if plan is None or _fastpath._apart(plan, residual, opts):
        return None
    try:
        return make_quant_plan(plan, qdtype=qdtype, scale=scale, scale_is_array=False,
                               group_size=group_size, scale_mode=scale_mode)
    except (TypeError, ValueError):
        return None


def _decode(x, weight, bias, residual, qdtype, scale, group_size, scale_mode, opts: Options):
    """A 2-D numpy quantized forward through its call signature's prepared call, or None."""
    key = (opts, qdtype, scale, group_size, scale_mode, x.shape, x.strides, x.dtype,
           None if weight is None else (weight.shape, weight.strides, weight.dtype),
           None if bias is None else (bias.shape, bias.strides, bias.dtype),
           None if residual is None else (residual.shape, residual.strides, residual.dtype))
    try:
        e = _DECODE[key]
    except KeyError:
        if len(_DECODE) >= _fastpath.DECODE_MAX:
            _DECODE.clear()
        e = _DECODE[key] = _decode_entry(x, weight, bias, residual, qdtype, scale,
                                         group_size, scale_mode, opts)
    except TypeError:  # unhashable: the general path says what is wrong
        return None
    # values equal to the key's but of other types (True for 1) are checked here
    if (e is None or (opts is not _fastpath._EXACT_LAST[0] and not _fastpath._exact(opts))
            or scale_mode.__class__ is not str
            or not (scale is None or scale.__class__ in (float, int))
            or not (group_size is None or group_size.__class__ is int)):
        return None
    mod, qplan, decode = e
    q, scales, h = mod.quant_forward_decode(decode, x, residual, weight, bias)
    if group_size is None and not qplan.static:
        scales = scales.reshape(x.shape[0])
    return (q, scales) if residual is None else (q, scales, h)


def _fast(x, weight, bias, residual, qdtype, scale, group_size, scale_mode, opts: Options):
    """The call on plain numpy arrays (``axis=-1``, ``backend="auto"``, a float or no
    scale) straight to the Numba backend, or None: then the generic path takes it,
    with every check and error message its own."""
    mod = _fastpath.numba_module(opts)
    if mod is None or type(x) is not np.ndarray or x.ndim == 0:
        return None
    if not _fastpath._all_numpy_or_none(weight, bias, residual, None):
        return None
    if not (scale is None or scale.__class__ in (float, int)):
        return None
    if not (group_size is None or group_size.__class__ is int):
        return None
    names = _fastpath._names()
    xname = names.get(x.dtype)
    d = x.shape[-1]
    if xname is None or d == 0 or x.size == 0:
        return None
    if not (_fastpath._vector_ok(weight, d, names) and _fastpath._vector_ok(bias, d, names)):
        return None
    qplan = _qplan(names, xname, d, x, residual, qdtype, scale, group_size, scale_mode, opts)
    if qplan is None:
        return None
    n = x.size // d
    q2, s2, h2 = mod.quant_forward(x.reshape(n, d), None if residual is None
                                   else residual.reshape(n, d), weight, bias, qplan, None)
    batch = x.shape[:-1]
    q = q2.reshape(x.shape)
    if qplan.static:
        scales = s2.reshape(())
    elif group_size is None:
        scales = s2.reshape(batch)
    else:
        scales = s2.reshape(batch + (qplan.groups,))
    return (q, scales) if residual is None else (q, scales, h2.reshape(x.shape))


@takes_options(exclude=("out_dtype",))
def rms_norm_quant(  # type: ignore[misc]  # its own group_size (the scales') takes the option's name
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    residual: Array | None = None,
    dtype: DTypeLike = "float8_e4m3fn",
    scale: float | Array | None = None,
    group_size: int | None = None,
    scale_mode: str = "divide",
    residual_out: Array | None = None,
    **options: Unpack[NormOptions],
) -> tuple[Array, Array] | tuple[Array, Array, Array]:
    """RMSNorm with quantized output (float8 e4m3 or e5m2, or int8), for serving.

    ``y`` is exactly ``rms_norm(x, weight, bias, out_dtype="float32", ...)``
    (``add_rms_norm``'s ``y`` with ``residual``), never materialized; what
    is written is ``q`` and its scales::

        static   (scale given):      s = float32(scale)               one for the tensor
        per token (scale=None):       s = max(|y|) / qmax              one per token
        per group (group_size=G):     s = max(|y[gG:(g+1)G]|) / qmax   one per group
        q = round_to_nearest_even(clip(y / s, lo, hi))               scale_mode="divide"
        q = round_to_nearest_even(clip(y * float32(1 / s), lo, hi))  scale_mode="reciprocal"

    with ``y / s`` a float32 division (``y * float32(1 / s)`` two float32
    roundings), then rounded once to the format:

    ===============  =====  ================  ==============================
    dtype            qmax   [lo, hi]          NaN in ``y / s``
    ===============  =====  ================  ==============================
    float8_e4m3fn    448    [-448, 448]       NaN (e4m3fn has no inf)
    float8_e5m2      57344  [-57344, 57344]   NaN (code 0x7e, as ml_dtypes)
    int8             127    [-128, 127]       0
    ===============  =====  ================  ==============================

    Saturation: a quotient beyond the range gives the format's bound (the
    clip comes first: ``ml_dtypes``' own cast turns 1000 into NaN, torch's
    into 448; both agree after the clip).  A dynamic scale is
    ``max(|y|) / qmax`` rounded to float32; where that is below ``2**-126``
    (an all-zero token or group, or one whose values are all below
    ``qmax * 2**-126``) the scale is 1 and ``q`` is 0 there.  ``max``
    propagates NaN: a token (group) with a NaN has scale NaN and ``q`` NaN
    (int8: 0).  ``y = q * s`` dequantizes.

    The peers' conventions (docs: "Quantized output: conventions"):
    ``scale_mode="reciprocal"`` gives the bits of vLLM's static fp8 kernels
    (``rms_norm_static_fp8_quant``, ``fused_add_rms_norm_static_fp8_quant``:
    ``scale_inv = 1.0f / *scale``), of its dynamic per-token int8 kernel
    (``1.0f / token_scale``) and of FlashInfer's ``rmsnorm_quant`` /
    ``fused_add_rmsnorm_quant``; ``"divide"`` those of vLLM's dynamic
    per-token fp8 kernel (``rms_norm_dynamic_per_token_quant``), which
    divides "for exact match with FBGemm".  The two differ only where
    ``y / s`` and ``y * float32(1 / s)`` round to opposite sides of a
    midpoint of the format (about 1 value in 3 to 33 million, one step).
    vLLM floors its fp8 dynamic scale at ``1 / (448 * 512)`` (here: a scale
    below ``2**-126`` becomes 1) and takes an upper bound ``scale_ub``;
    FlashInfer clamps to ``[-448, 448]`` also for float8_e5m2 (here: the
    format's own range).

    The options are :func:`polynorm.rms_norm`'s but ``out_dtype`` (``y`` is
    float32).  ``backend="auto"`` runs the Numba kernel for host memory, the
    CUDA kernel (``pn_quant_fwd``) for CUDA arrays and the array-API
    reference otherwise.

    Parameters
    ----------
    x : array
        Float array of any library.  For numpy the result ``q`` is an
        ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` / ``int8`` array; torch
        gives ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` / ``torch.int8``,
        jax ``jnp.float8_e4m3fn`` / ``jnp.float8_e5m2`` / ``jnp.int8``.  A library without the format (array-api-strict has
        no float8) is a ``TypeError``.
    weight, bias : array, optional
        As in :func:`polynorm.rms_norm`.
    residual : array, optional
        Fused add first: ``h = x + residual`` (promoted dtype, or
        ``residual_dtype``, as :func:`polynorm.add_rms_norm` returns it, bit for
        bit) is normalized (or the unrounded sum, ``norm_input="sum"``) and also
        returned, at full precision.
    dtype : {"float8_e4m3fn", "float8_e5m2", "int8"} or a dtype object
        The format of ``q``.
    scale : float or array, optional
        A static per-tensor scale (> 0 and finite as a float32; a numpy
        scalar or 0-d numpy array counts as the number it holds), or a
        one-element float array of ``x``'s library (shape ``()`` or ``(1,)``;
        its value is not checked).  ``None`` computes dynamic scales.
    group_size : int, optional
        Dynamic scales per group of ``group_size`` contiguous elements of the
        normalized slice (64 or 128 for DeepSeek-style block fp8; any divisor
        of ``d``); ``None`` is one scale per token.  Not with ``scale``.
    scale_mode : {"divide", "reciprocal"}
        ``"divide"`` (default): ``q`` from ``y / s``.  ``"reciprocal"``:
        from ``y * float32(1 / s)``, the bits of vLLM's static fp8 and
        per-token int8 kernels and FlashInfer's quantized norms; for static
        and dynamic scales alike (the scales returned are the same).
    residual_out : array, optional
        With ``residual``: receives ``h`` (as :func:`polynorm.add_rms_norm`'s
        ``residual_out``: ``h``'s dtype, may be ``residual`` itself for vLLM's
        ``fused_add_rms_norm_static_fp8_quant`` convention of updating the
        residual in place); the ``h`` returned is this array.  Computed apart
        and copied in.
    {options}

    Returns
    -------
    (q, scales) or (q, scales, h)
        ``q`` has ``x``'s shape.  ``scales`` is float32: the shape of ``x``
        without the normalized axes (per token), plus a trailing axis of
        ``d // group_size`` (per group), or shape ``()`` (static).

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[3.0, 4.0], [1.0, -1.0]], dtype=np.float32)
    >>> q, s = pn.rms_norm_quant(x, dtype="int8", eps=0.0)
    >>> q
    array([[  95,  127],
           [ 127, -127]], dtype=int8)
    >>> s
    array([0.00890843, 0.00787402], dtype=float32)
    """
    qdtype = parse_quant_dtype(dtype)
    opts = pack_options("rms_norm_quant", options, out_dtype="float32")
    if residual_out is not None:
        return _into_residual(x, weight, bias, residual, residual_out, opts, dict(
            dtype=dtype, scale=scale, group_size=group_size, scale_mode=scale_mode), options)
    if (type(x) is np.ndarray and x.ndim == 2
            and _fastpath._all_numpy_or_none(weight, bias, residual, None)):
        fast = _decode(x, weight, bias, residual, qdtype, scale, group_size, scale_mode, opts)
        if fast is not None:
            return fast
    scale_num, scale_arr = _scale_arg(scale)
    fast = _fast(x, weight, bias, residual, qdtype,
                 scale_num if scale_arr is None else scale_arr, group_size, scale_mode, opts)
    if fast is not None:
        return fast
    x, residual, weight, bias, scale_arr = (
        _api._native(a) for a in (x, residual, weight, bias, scale_arr))
    weight, bias = _api._chunk_library_params(x, weight, bias)
    if residual is not None and aac.is_dask_array(x) and not aac.is_dask_array(residual):
        raise TypeError(f"residual must be a dask array like x, got {type(residual).__name__}")
    if scale_arr is not None and aac.is_dask_array(x) and not aac.is_dask_array(scale_arr):
        scale_arr = _api._chunk_library_params(x, scale_arr, None)[0]
    arrays = {"residual": residual}
    if scale_arr is not None:
        arrays["scale"] = scale_arr
    call = _api._prepare(x=x, weight=weight, bias=bias, arrays=arrays,
                         opts=opts._replace(backend="array_api"))
    lay = call.lay
    if scale_arr is not None:
        float_dtype_name("scale", scale_arr)
        if tuple(scale_arr.shape) not in ((), (1,)):
            raise ValueError(
                f"scale must be a number or an array of one element (shape () or (1,)), "
                f"got shape {tuple(scale_arr.shape)}")
    qplan = make_quant_plan(call.plan, qdtype=qdtype, scale=scale_num,
                            scale_is_array=scale_arr is not None, group_size=group_size,
                            scale_mode=scale_mode)
    xp = lay.xp
    from polynorm.backends.reference import quant_dtype

    try:
        quant_dtype(xp, qdtype, x)
    except (TypeError, AttributeError):
        raise TypeError(f"dtype={qdtype!r} is not available for {type(x).__module__} arrays") \
            from None
    mod = _quant_backend(opts.backend, x)
    if residual is None:
        _api.no_residual(opts)
    elif _api.split_add(call.plan):
        # norm_input="sum" or a residual_dtype: the add apart, then the plain quantized norm
        with _api._no_autograd(x, residual=residual, weight=weight, bias=bias):
            s2, h2, plan_s = _api.add_apart(xp, lay.rows(x), lay.rows(residual), call.plan, opts,
                                            mod)
            qplan_s = make_quant_plan(plan_s, qdtype=qdtype, scale=scale_num,
                                      scale_is_array=scale_arr is not None, group_size=group_size)
            if lay.n == 0:
                from polynorm.backends import reference as mod
            q2, s2, _ = mod.quant_forward(s2, None, lay.flat(weight), lay.flat(bias), qplan_s,
                                          scale_arr)
        return _quant_result(lay, xp, q2, s2, h2, qplan, group_size)
    if lay.n == 0:
        from polynorm.backends import reference

        with _api._no_autograd(x, residual=residual, weight=weight, bias=bias):
            q2, s2, h2 = reference.quant_forward(
                lay.rows(x), lay.rows(residual), lay.flat(weight), lay.flat(bias), qplan,
                scale_arr)
    else:
        with _api._no_autograd(x, residual=residual, weight=weight, bias=bias):
            q2, s2, h2 = mod.quant_forward(lay.rows(x), lay.rows(residual), lay.flat(weight),
                                           lay.flat(bias), qplan, scale_arr)
    return _quant_result(lay, xp, q2, s2, None if residual is None else h2, qplan, group_size)


def _quant_result(lay, xp, q2, s2, h2, qplan, group_size) -> tuple:
    """``(q, scales)`` or ``(q, scales, h)`` in the caller's shapes from the rows."""
    q = lay.unrows(q2)
    if qplan.static:
        scales = xp.reshape(s2, ())
    elif group_size is None:
        scales = lay.unbatch(s2)
    else:
        scales = lay.unbatch(s2, (qplan.groups,))
    if h2 is None:
        return q, scales
    return q, scales, lay.unrows(h2)


def _into_residual(x, weight, bias, residual, residual_out, opts: Options, kw: dict,
                   options: Any) -> tuple:
    """:func:`rms_norm_quant` with ``residual_out``: checked before the kernel by
    ``out=``'s rules, the call, then ``h`` copied into it."""
    from polynorm.core.dtypes import parse_dtype

    if residual is None:
        raise TypeError("residual_out= receives h = x + residual: pass residual= too")
    h_dtype = parse_dtype("residual_dtype", opts.residual_dtype) or promote(
        float_dtype_name("x", x), float_dtype_name("residual", residual))
    _api.check_residual_out(residual_out, x, residual, h_dtype, (x, weight, bias),
                            ("x", "weight", "bias"))
    r = rms_norm_quant(x, weight, bias, residual=residual, **kw, **options)
    residual_out[...] = r[-1]
    return r[0], r[1], residual_out
