"""Gated RMSNorm's front end: :func:`rms_norm_gated` and its backward.

Validation and layout reuse :mod:`polynorm.ops.norm`'s helpers; the semantics
are :class:`polynorm.core.options.GatedPlan`.  A backend takes part when its
module has ``gated_forward``/``gated_backward`` (2-D rows, 1-D weight/bias,
``rstd`` of shape ``(n, groups)``); ``backend="auto"`` falls back to the
array-API reference for a backend without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import array_api_compat as aac
import numpy as _np

from polynorm.core.dtypes import float_dtype_name, namespace_dtype
from polynorm.core.memory import check_out_memory, host_view, partly_written
from polynorm.core.options import (
    GatedPlan,
    NormOptions,
    Options,
    make_gated_plan,
    pack_options,
    takes_options,
)
from polynorm.ops import fast as _fast
from polynorm.ops import norm as _api
from polynorm.ops.norm import Array

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["rms_norm_gated", "rms_norm_gated_backward"]


def _gated_backend(backend: Any, x: Any):
    return _api._capable_backend(backend, x, _api._backends.GatedKernels, "gated RMSNorm")


def _prepare(x, z, weight, bias, arrays, opts: Options, group_size, norm_before_gate):
    if z is None:
        raise TypeError("z must be an array (the gate), got None")
    weight, bias = _api._chunk_library_params(x, weight, bias)
    if aac.is_dask_array(x) and not aac.is_dask_array(z):
        raise TypeError(f"z must be a dask array like x, got {type(z).__name__}")
    call = _api._prepare(x=x, weight=weight, bias=bias, arrays={"z": z, **arrays},
                         opts=opts._replace(backend="array_api"))
    lay = call.lay
    _api._check_shape("z", z, lay.shape, "the shape of x")
    float_dtype_name("z", z)
    gplan = make_gated_plan(call.plan, group_size=group_size, norm_before_gate=norm_before_gate)
    mod = _gated_backend(opts.backend, x)
    return lay, gplan, mod, weight, bias


def _rstd_shape(lay, gplan: GatedPlan, group_size) -> tuple[int, ...]:
    return lay.batch_shape + (() if group_size is None else (gplan.groups,))


@takes_options()
def rms_norm_gated(  # type: ignore[misc]  # its own group_size takes the option's name
    x: Array,
    z: Array | None,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    return_rstd: bool = False,
    out: Array | None = None,
    **options: Unpack[NormOptions],
) -> Array | tuple[Array, Array]:
    """Gated RMSNorm (Mamba-2 ``RMSNormGated``, vLLM, FLA, Qwen3-Next).

    With ``silu(z) = z / (1 + exp(-z))`` and the statistic taken per group
    of ``group_size`` contiguous elements of each normalized slice::

        norm_before_gate=False:  y = rms_norm(x * silu(z)) * (weight + offset) + bias
        norm_before_gate=True:   y = (rms_norm(x) * (weight + offset) + bias) * silu(z)

    The math runs in float32 (float64 for float64 input) and rounds once to
    the output dtype, as Mamba's ``layernorm_gated`` Triton kernel does (x, z
    and weight in float32).  ``casting="llama"`` with ``norm_before_gate=True``
    is Hugging Face's ``Qwen3NextRMSNormGated`` order: the normalized value is
    rounded to ``x``'s dtype and multiplied by ``weight`` in ``weight``'s
    dtype, then by ``silu(z)`` in float32.  The full rule is
    :class:`polynorm.core.options.GatedPlan`.

    Parameters
    ----------
    x, z : array
        Same shape, library and device; float dtypes (``z`` may have another).
        ``z=None`` (Mamba's ``RMSNormGated`` without a gate) is
        :func:`polynorm.rms_norm` with ``group_size``: the same bits and ``rstd``.
    weight, bias : array, optional
        Shape of ``x`` over the normalized axes (over all ``d``, not a group).
    group_size : int, optional
        Must divide ``d`` (else ``ValueError``); ``None`` is one group of ``d``.
        With more than one group ``partial`` must be 1 (``ValueError``).
    norm_before_gate : bool
        ``False`` (Mamba-2's default) gates before the norm.
    return_rstd : bool
        Also return ``rstd``: the shape of ``x`` without the normalized axes,
        plus a trailing axis of ``d // group_size`` groups when
        ``group_size`` is given.
    out : array, optional
        As in :func:`polynorm.rms_norm`.
    {options}

    Returns
    -------
    y or (y, rstd)

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[3.0, 4.0]], dtype=np.float32)
    >>> z = np.array([[20.0, 20.0]], dtype=np.float32)   # silu(20) = 20 - 4e-8
    >>> y = pn.rms_norm_gated(x, z, eps=0.0, norm_before_gate=True)
    >>> y.dtype, np.round(y, 3)
    (dtype('float32'), array([[16.971, 22.627]], dtype=float32))
    """
    opts = pack_options("rms_norm_gated", options)
    return gated_forward(x, z, weight, bias, opts, group_size=group_size,
                         norm_before_gate=norm_before_gate, out=out, return_rstd=return_rstd)


#: decode calls: call signature -> (numba module, GatedPlan, its GatedDecode), or None (the
#: general path)
_DECODE: dict[tuple, Any] = {}


def _decode_entry(x, z, weight, bias, opts: Options, group_size, norm_before_gate):
    """``(numba module, GatedPlan, GatedDecode)`` for a serial-size numpy call the decode
    path serves (2-D rows, axis=-1, backend="auto", options of exact types, no out), else
    None."""
    mod = _fast.numba_module(opts)
    if (mod is None or not hasattr(mod, "gated_forward_decode") or x.ndim != 2
            or type(z) is not _np.ndarray or z.shape != x.shape or not _fast._exact(opts)
            or not (group_size is None or group_size.__class__ is int)
            or norm_before_gate.__class__ is not bool):
        return None
    head = _fast._rows(x, weight, bias, None, None)
    if head is None or z.dtype not in head[0]:
        return None
    names, dtype, d, n, _ = head
    if n * d >= mod.SERIAL_MAX_ELEMENTS:
        return None
    plan = _fast._plan(d, dtype, opts)
    if plan is None or plan.llama:
        return None
    try:
        gplan = make_gated_plan(plan, group_size=group_size, norm_before_gate=norm_before_gate)
    except (TypeError, ValueError):
        return None  # the general path raises it, in its own order
    return mod, gplan, mod.GatedDecode()


def _decode_forward(x, z, weight, bias, opts, group_size, norm_before_gate, return_rstd):
    """A numpy gated forward through its call signature's cached plan, or None."""
    key = (opts, x.shape, x.strides, x.dtype, z.shape, z.strides, z.dtype,
           None if weight is None else (weight.shape, weight.strides, weight.dtype),
           None if bias is None else (bias.shape, bias.strides, bias.dtype),
           group_size, norm_before_gate)
    try:
        e = _DECODE[key]
    except KeyError:
        if len(_DECODE) >= _fast.DECODE_MAX:
            _DECODE.clear()
        e = _DECODE[key] = _decode_entry(x, z, weight, bias, opts, group_size,
                                         norm_before_gate)
    except TypeError:  # unhashable: the general path says what is wrong
        return None
    # values equal to the key's but of other types (True for 1) are checked below
    if (e is None or not _fast._exact(opts) or norm_before_gate.__class__ is not bool
            or not (group_size is None or group_size.__class__ is int)):
        return None
    mod, gplan, decode = e
    y, rstd = mod.gated_forward_decode(decode, x, z, weight, bias, gplan)
    if return_rstd:
        return y, (rstd.reshape(rstd.shape[0]) if group_size is None else rstd)
    return y


def ungated_options(opts: Options, group_size: Any, norm_before_gate: Any) -> Options:
    """The options of :func:`polynorm.rms_norm` that a call with ``z=None`` is (Mamba's
    ``RMSNormGated(x, z=None)``: the grouped norm without a gate; ``norm_before_gate``
    has nothing to order and is only checked)."""
    if not isinstance(norm_before_gate, (bool, int)) or norm_before_gate not in (0, 1):
        raise TypeError(f"norm_before_gate must be True or False, got {norm_before_gate!r}")
    return opts._replace(group_size=group_size)


def gated_forward(x, z, weight, bias, opts: Options, *, group_size, norm_before_gate,
                  out=None, return_rstd: bool = False):
    """:func:`rms_norm_gated` with the options packed (the entry of torch and jax)."""
    if z is None:
        return _api.forward(x, None, weight, bias,
                            ungated_options(opts, group_size, norm_before_gate), out=out,
                            return_rstd=return_rstd)
    if (out is None and type(x) is _np.ndarray and type(z) is _np.ndarray
            and (weight is None or type(weight) is _np.ndarray)
            and (bias is None or type(bias) is _np.ndarray)):
        r = _decode_forward(x, z, weight, bias, opts, group_size, norm_before_gate, return_rstd)
        if r is not None:
            return r
    x, z, weight, bias = (_api._native(a) for a in (x, z, weight, bias))
    lay, gplan, mod, weight, bias = _prepare(x, z, weight, bias, {"out": out}, opts,
                                             group_size, norm_before_gate)
    plan = gplan.plan
    _api.no_residual(opts)  # the gated norm has no residual for residual_dtype
    _api._check_out(out, x, plan.out_dtype)
    if out is not None:
        ov = host_view(out)
        if ov is not None:
            check_out_memory(ov, tuple(host_view(a) for a in (x, z, weight, bias)),
                             ("x", "z", "weight", "bias"))
    xp = lay.xp
    if lay.n == 0:
        dev = _api.result_device(x)
        y2 = xp.empty((0, lay.d), dtype=namespace_dtype(xp, plan.out_dtype, x), device=dev)
        rstd = xp.empty((0, gplan.groups), dtype=namespace_dtype(xp, plan.compute_dtype, x),
                        device=dev)
    else:
        out2 = _api._view_rows(lay, out) if out is not None else None
        try:
            with _api._no_autograd(x, z=z, weight=weight, bias=bias):
                y2, rstd = mod.gated_forward(lay.rows(x), lay.rows(z), lay.flat(weight),
                                             lay.flat(bias), gplan, out2)
        except Exception as exc:
            if out2 is None:
                raise
            raise partly_written(exc) from exc
        if out2 is not None and y2 is out2:
            y2 = None
    if y2 is None:
        y = out
    else:
        y = lay.unrows(y2)
        if out is not None:
            out[...] = y
            y = out
    if return_rstd:
        return y, lay.unbatch(rstd, () if group_size is None else (gplan.groups,))
    return y


@takes_options()
def rms_norm_gated_backward(  # type: ignore[misc]  # as rms_norm_gated
    dy: Array,
    x: Array,
    z: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    rstd: Array | None = None,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    return_rstd: bool = False,
    out: Array | None = None,
    **options: Unpack[NormOptions],
) -> tuple[Array, Array, Array | None, Array | None]:
    """Hand-written backward of :func:`rms_norm_gated` (no autograd).

    The formulas are in :class:`polynorm.core.options.GatedPlan`; reductions run
    in a fixed order (the same bits on every run).

    Parameters
    ----------
    dy : array
        Gradient of the loss with respect to ``y``; shape of ``x``.
    x, z, weight, bias : array
        The forward's inputs.
    rstd : array, optional
        The forward's ``rstd`` (``return_rstd=True``), of its shape and dtype
        (float32, float64 for float64 ``x``); saves recomputing it.
    group_size : int, optional
        As in the forward.
    norm_before_gate : bool
        As in the forward.
    return_rstd, out
        Accepted for a signature uniform with the forward's; must be left at
        their defaults.
    {options}

    The options are the forward's.  ``casting`` does not change the backward
    (the derivative of the unrounded function); ``out_dtype`` must be left at
    its default.

    Returns
    -------
    (dx, dz, dweight, dbias)
        ``dx``/``dz`` have the dtypes of ``x``/``z``; ``dweight``/``dbias``
        those of ``weight``/``bias``, or ``None`` without them.  ``dz`` is
        ``None`` for ``z=None``.

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[3.0, 4.0]])
    >>> z = np.zeros_like(x)        # silu(0) = 0, silu'(0) = 1/2
    >>> dx, dz, dw, db = pn.rms_norm_gated_backward(np.ones_like(x), x, z, np.ones(2),
    ...                                             eps=0.0, norm_before_gate=True)
    >>> dx
    array([[0., 0.]])
    >>> dz
    array([[0.42426407, 0.56568542]])
    """
    opts = pack_options("rms_norm_gated_backward", options)
    if out is not None or return_rstd or opts.out_dtype is not None:
        bad = "out" if out is not None else ("return_rstd" if return_rstd else "out_dtype")
        raise ValueError(f"{bad} is not used by rms_norm_gated_backward; leave it at its default")
    if dy is None:
        raise TypeError("dy must be an array, got None")
    return gated_backward(dy, x, z, weight, bias, rstd, opts, group_size=group_size,
                          norm_before_gate=norm_before_gate)


def gated_backward(dy, x, z, weight, bias, rstd, opts: Options, *, group_size,
                   norm_before_gate):
    """:func:`rms_norm_gated_backward` with the options packed."""
    if z is None:
        dx, dw, db = _api.backward(dy, x, weight, bias, rstd, None,
                                   ungated_options(opts, group_size, norm_before_gate))
        return dx, None, dw, db
    dy, x, z, weight, bias, rstd = (_api._native(a) for a in (dy, x, z, weight, bias, rstd))
    lay, gplan, mod, weight, bias = _prepare(x, z, weight, bias, {"dy": dy, "rstd": rstd},
                                             opts, group_size, norm_before_gate)
    _api._check_shape("dy", dy, lay.shape, "the shape of x")
    float_dtype_name("dy", dy)
    xp = lay.xp
    rstd2 = None
    if rstd is not None:
        _api._check_shape("rstd", rstd, _rstd_shape(lay, gplan, group_size),
                          "x's shape without the normalized axes"
                          + ("" if group_size is None else ", plus the groups"))
        got = float_dtype_name("rstd", rstd)
        if got != gplan.plan.rstd_dtype:
            raise TypeError(f"rstd must have dtype {gplan.plan.rstd_dtype}, got {got}")
        rstd2 = lay.batch_rows(rstd, (gplan.groups,))
    if lay.n == 0:
        dev = _api.result_device(x)
        dx = xp.empty(lay.shape, dtype=x.dtype, device=dev)
        dz = xp.empty(lay.shape, dtype=z.dtype, device=dev)
        dw = None if weight is None else xp.zeros(weight.shape, dtype=weight.dtype, device=dev)
        db = None if bias is None else xp.zeros(bias.shape, dtype=bias.dtype, device=dev)
        return dx, dz, dw, db
    with _api._no_autograd(x, dy=dy, z=z, weight=weight, bias=bias):
        dx2, dz2, dw, db = mod.gated_backward(
            lay.rows(dy), lay.rows(x), lay.rows(z), lay.flat(weight), lay.flat(bias), rstd2, gplan)
    return lay.unrows(dx2), lay.unrows(dz2), lay.unflat(dw), lay.unflat(db)
