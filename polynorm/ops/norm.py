"""The public functions: validate every argument, resolve a Plan, dispatch.

Nothing here computes: arrays are checked, brought into canonical 2-D form
``(tokens, d)`` and handed to one backend module (see
:mod:`polynorm.backends`).  Every error is raised here, before a kernel runs.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import array_api_compat as aac
import numpy as _np

from polynorm import backends as _backends
from polynorm.core.dtypes import float_dtype_name, namespace_dtype
from polynorm.core.interop import jax_committed
from polynorm.core.memory import check_out_memory, host_view, partly_written
from polynorm.core.options import (
    NormOptions,
    Options,
    Plan,
    compute_dtype,
    make_plan,
    pack_options,
    promote,
    split_dtypes,
    takes_options,
)
from polynorm.core.pool import MIN_BYTES
from polynorm.ops import fast as _fast
from polynorm.ops import fast_cuda as _fast_cuda
from polynorm.ops import fast_ref as _fast_ref

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["rms_norm", "add_rms_norm", "rms_norm_backward", "backends", "add_rms_norm_"]

#: any array of a supported library (numpy, cupy, torch, jax, dask, array-api-strict, ...)
Array: TypeAlias = Any

#: auto-dispatch tries these, in order, before the reference.
_AUTO_ORDER = ("dask", "cupy", "numba")


def backends() -> dict[str, tuple[bool, str]]:
    """Which backends exist here and whether each can run.

    Returns
    -------
    dict
        ``{name: (usable, reason)}``; ``reason`` is ``"ok"`` for a usable
        backend and says what is missing otherwise.

    Examples
    --------
    >>> import polynorm as pn
    >>> usable, reason = pn.backends()["array_api"]
    >>> usable
    True
    """
    return _backends.report()


# --------------------------------------------------------------------------- checks


def _namespace(arrays: dict[str, Any]):
    """One namespace for all given arrays, or a TypeError naming the culprits."""
    present = {k: v for k, v in arrays.items() if v is not None}
    for argname, a in present.items():
        if not aac.is_array_api_obj(a):
            raise TypeError(f"{argname} must be an array, got {type(a).__name__}")
        if isinstance(a, _np.ma.MaskedArray):
            # a mask has no meaning for a norm (the statistic would count masked entries
            # as values); the fast path takes exact np.ndarray only, so all come here
            raise TypeError(
                f"{argname} must not be a masked array (numpy.ma): polynorm gives masks no "
                "meaning; pass a plain numpy array (for example a.filled(0))"
            )
    try:
        xp = aac.array_namespace(*present.values())
    except TypeError:
        kinds = ", ".join(f"{k}: {type(v).__module__}.{type(v).__name__}" for k, v in present.items())
        raise TypeError(f"arrays from different libraries cannot be mixed ({kinds})") from None
    first: tuple[str, Any] | None = None  # the first array with a placement, and it
    for argname, a in present.items():
        where = _placement(a)
        if where is None:
            continue
        if first is None:
            first = (argname, where)
        elif where != first[1]:
            raise ValueError(
                f"{first[0]} is on device {aac.device(present[first[0]])} but {argname} "
                f"is on device {aac.device(a)}; move them to one device"
            )
    return xp


def _placement(a: Any) -> Any:
    """Where ``a`` lives, for the check that a call's arrays live in one place; None
    where that is jax's to decide.

    A concrete jax array counts by the set of devices it is on: a sharded ``x`` and
    a weight replicated over the same devices go together, as in jnp.  An
    uncommitted jax array in host memory counts as nowhere: jnp moves it to the
    committed arrays' device, and the Numba kernels read host memory of every CPU
    device alike (a gradient jax makes for a result on ``cpu:1`` starts
    uncommitted on ``cpu:0``).  A traced one has no device yet (a concrete weight
    closed over by ``jit(grad(f))`` meets a traced ``x``).
    """
    if aac.is_jax_array(a):
        import jax

        if isinstance(a, jax.core.Tracer):
            return None
        try:
            devices = a.devices()
        except Exception:  # a deleted array: its use raises jax's own error later
            return aac.device(a)
        if not jax_committed(a) and all(d.platform == "cpu" for d in devices):
            return None
        return frozenset(devices)
    return aac.device(a)


def result_device(x: Any) -> Any:
    """``device=`` for results made here rather than by a kernel: ``x``'s, or None
    for an uncommitted jax ``x``, whose results jnp leaves uncommitted (``device=``
    would commit them, and a committed result cannot meet arrays on another device)."""
    if aac.is_jax_array(x) and not jax_committed(x):
        return None
    return aac.device(x)


def _chunk_library_params(x: Any, weight: Any, bias: Any) -> tuple[Any, Any]:
    """A dask ``x`` takes ``weight``/``bias`` as arrays of its chunks' library (numpy
    with numpy chunks, cupy with cupy chunks), as dask's own operations do: those
    become one-chunk dask arrays here, so that everything after sees one library."""
    if not aac.is_dask_array(x):
        return weight, bias
    meta_type = type(getattr(x, "_meta", None))

    def lift(a):
        if a is None or aac.is_dask_array(a) or type(a) is not meta_type:
            return a  # other libraries: the namespace check names them
        import dask.array as da

        return da.from_array(a, chunks=a.shape)

    return lift(weight), lift(bias)


def _normalize_axis(axis: Any, ndim: int) -> tuple[int, ...]:
    items = axis if isinstance(axis, tuple) else (axis,)
    if not items:
        raise ValueError("axis must name at least one axis, got ()")
    out = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, int):
            try:
                if isinstance(a, bool):  # True.__index__() is 1: not an axis
                    raise AttributeError
                a = int(a.__index__())
            except AttributeError:
                raise TypeError(
                    f"axis must be an int or a tuple of ints, got {axis!r}"
                ) from None
        if not -ndim <= a < ndim:
            raise ValueError(
                f"axis {a} is out of range for x with {ndim} dimensions "
                f"(allowed: {-ndim} .. {ndim - 1})"
            )
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"axis must not repeat an axis, got {axis!r}")
    return tuple(sorted(out))


def _unknown(size: Any) -> bool:
    """A size dask does not know before computing (``nan``, after boolean indexing)."""
    return size is None or (isinstance(size, float) and math.isnan(size))


def _same_sizes(a: tuple, b: tuple) -> bool:
    """Equal shapes or chunks, an unknown size matching an unknown one (``nan != nan``)."""
    return len(a) == len(b) and all(
        p == q or (_unknown(p) and _unknown(q)) for p, q in zip(a, b, strict=True))


def _check_shape(argname: str, a: Any, shape: tuple[int, ...], what: str) -> None:
    if a is not None and tuple(a.shape) != shape and not _same_sizes(tuple(a.shape), shape):
        raise ValueError(f"{argname} must have shape {shape} ({what}), got {tuple(a.shape)}")


def _choose_backend(backend: str, x: Any):
    if backend == "auto":
        for name in _AUTO_ORDER:
            if _backends.usable(name):
                mod = _backends.get(name)
                if mod.accepts(x):
                    return mod
        return _backends.get("array_api")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {backend!r}")
    mod = _backends.get(backend)  # raises for unknown / unusable
    if not mod.accepts(x):
        raise TypeError(
            f"backend {backend!r} cannot take arrays of type "
            f"{type(x).__module__}.{type(x).__name__} on device {aac.device(x)}"
        )
    return mod


_offers: dict[tuple[Any, type], bool] = {}


def _capable_backend(backend: str, x: Any, capability: type, what: str):
    """The backend for ``x`` if it offers ``capability`` (a Protocol of
    :mod:`polynorm.backends`); ``backend="auto"`` falls back to the reference."""
    mod = _choose_backend(backend, x)
    key = (mod, capability)
    offers = _offers.get(key)
    if offers is None:  # a Protocol isinstance check costs ~20 us: once per module
        offers = _offers[key] = isinstance(mod, capability)
    if offers:
        return mod
    if backend == "auto":
        return _backends.get("array_api")
    raise ValueError(f"backend {backend!r} has no {what} kernels; use backend='auto' or 'array_api'")


# --------------------------------------------------------------------------- layout


@dataclass
class _Layout:
    """How the caller's arrays map to canonical ``(n, d)`` rows and back."""

    xp: Any
    shape: tuple[int, ...]
    axes: tuple[int, ...]
    perm: tuple[int, ...] | None  # None when the normalized axes are already trailing
    n: int
    d: int
    #: a dask x of unknown chunk sizes (n is nan): the chunks of its first batch
    #: axis; dask cannot reshape such an array, so its blocks are reshaped one by one
    lead: tuple | None = None

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(s for i, s in enumerate(self.shape) if i not in self.axes)

    @property
    def norm_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.axes)

    def rows(self, a: Any) -> Any:
        """``a`` (shape of x) as ``(n, d)``; a view when the layout allows."""
        if a is None:
            return None
        xp = self.xp
        if self.perm is not None:
            a = xp.permute_dims(a, self.perm)
        if self.lead is not None:
            return _block_reshape(a, (self.d,), self._row_chunks)
        return xp.reshape(a, (self.n, self.d))

    def unrows(self, a2: Any) -> Any:
        xp = self.xp
        permuted = self.shape if self.perm is None else tuple(self.shape[p] for p in self.perm)
        if self.lead is not None:
            a = _block_reshape(a2, permuted[1:], self.lead)
        else:
            a = xp.reshape(a2, permuted)
        if self.perm is None:
            return a
        inverse = tuple(self.perm.index(i) for i in range(len(self.perm)))
        return xp.permute_dims(a, inverse)

    def unbatch(self, a: Any, tail: tuple[int, ...] = ()) -> Any:
        """Per-token ``a`` of shape ``(n, *tail)`` as ``batch_shape + tail``."""
        if self.lead is not None:
            return _block_reshape(a, self.batch_shape[1:] + tail, self.lead)
        return self.xp.reshape(a, self.batch_shape + tail)

    def batch_rows(self, a: Any, tail: tuple[int, ...] = ()) -> Any:
        """Per-token ``a`` (``batch_shape``, then any axes of ``tail``'s size) as ``(n, *tail)``."""
        if self.lead is not None:
            return _block_reshape(a, tail, self._row_chunks)
        return self.xp.reshape(a, (self.n, *tail))

    @property
    def _row_chunks(self) -> tuple:
        rest = math.prod(self.batch_shape[1:])
        return tuple(c * rest for c in self.lead or ())

    def flat(self, a: Any) -> Any:
        """weight/bias (shape over the normalized axes) as ``(d,)``."""
        if a is None or a.ndim == 1:
            return a
        return self.xp.reshape(a, (self.d,))

    def unflat(self, a: Any) -> Any:
        if a is None or len(self.axes) == 1:
            return a
        return self.xp.reshape(a, self.norm_shape)


def _layout(xp: Any, x: Any, axis: Any) -> _Layout:
    shape = tuple(x.shape)
    unknown = [i for i, s in enumerate(shape) if _unknown(s)]
    if unknown and not aac.is_dask_array(x):
        raise ValueError(f"x must have a known shape, got {shape}")
    axes = _normalize_axis(axis, len(shape))
    nd = len(shape)
    trailing = axes == tuple(range(nd - len(axes), nd))
    perm = None
    if not trailing:
        perm = tuple(i for i in range(nd) if i not in axes) + axes
    d = math.prod(shape[a] for a in axes)
    n = math.prod(s for i, s in enumerate(shape) if i not in axes)
    lead = None
    if unknown:
        lead = _unknown_layout(x, shape, axes, unknown)
        n = math.nan
    return _Layout(xp=xp, shape=shape, axes=axes, perm=perm, n=n, d=d, lead=lead)


def _unknown_layout(x: Any, shape: tuple, axes: tuple[int, ...], unknown: list[int]) -> tuple:
    """The chunks of the first batch axis of a dask ``x`` with unknown sizes (rows are
    independent, so each block is normalized on its own), or the ``ValueError`` of a
    layout that has to know them."""
    hint = "call x.compute_chunk_sizes() first"
    bad = [i for i in unknown if i in axes]
    if bad:
        raise ValueError(
            f"x must have known sizes along the normalized axes {axes}, got shape {shape} "
            f"(axis {bad[0]} unknown); {hint}")
    batch = [i for i in range(len(shape)) if i not in axes]
    for i in batch[1:]:
        # a block's shape is rebuilt from its rows and the other axes' sizes, so only
        # the first token axis may be unknown
        if i in unknown:
            raise ValueError(
                f"x may have an unknown size only along its first token axis ({batch[0]}), "
                f"got shape {shape} (axis {i} unknown); {hint}, or move axis {i} first")
        if shape[i] == 0:
            raise ValueError(
                f"x has unknown chunk sizes and a zero-size axis {i} (shape {shape}); {hint}")
    return tuple(x.chunks[batch[0]])


def _reshape_block(b: Any, rest: tuple[int, ...]) -> Any:
    return b.reshape((-1, *rest))


def _block_reshape(a: Any, rest: tuple[int, ...], lead: tuple) -> Any:
    """Dask ``a`` reshaped block by block to ``(-1, *rest)``, its first axis chunked
    ``lead``: the reshape of an array of unknown chunk sizes, which dask has not.
    The blocks follow the first axis only (the other axes are rechunked whole)."""
    from dask.array.utils import meta_from_array

    whole = {i: -1 for i in range(1, a.ndim) if len(a.chunks[i]) > 1}
    if whole:
        a = a.rechunk(whole)  # known sizes: _unknown_layout refused others
    if a.ndim == 1 + len(rest) and tuple(a.shape[1:]) == tuple(rest):
        return a
    ndim = 1 + len(rest)
    extra: dict[str, Any] = {}
    if ndim < a.ndim:
        extra["drop_axis"] = tuple(range(ndim, a.ndim))
    elif ndim > a.ndim:
        extra["new_axis"] = tuple(range(a.ndim, ndim))
    return a.map_blocks(_reshape_block, tuple(rest), chunks=(lead, *((s,) for s in rest)),
                        dtype=a.dtype, meta=meta_from_array(a, ndim=ndim), **extra)


def _check_unknown_chunks(lay: _Layout, x: Any, arrays: dict[str, Any]) -> None:
    """With unknown chunk sizes, the token-shaped arrays (and rstd) must be chunked as x
    along its first batch axis and its axes of unknown size: their blocks are paired
    with x's one by one (the chunk tasks also compare each pair's rows)."""
    batch = [i for i in range(len(lay.shape)) if i not in lay.axes]
    for argname, a in arrays.items():
        if a is None or not aac.is_dask_array(a):
            continue
        axes_of = batch if argname == "rstd" else range(len(lay.shape))
        for j, i in enumerate(axes_of):
            if j >= a.ndim or i not in batch or not (i == batch[0] or _unknown(lay.shape[i])):
                continue
            if not _same_sizes(tuple(a.chunks[j]), tuple(x.chunks[i])):
                raise ValueError(
                    f"{argname} must be chunked as x along axis {i} when x's chunk sizes are "
                    f"unknown (x: {x.chunks[i]}, {argname}: {a.chunks[j]} on its axis {j}); "
                    "index both with the same mask, or call compute_chunk_sizes() on both")


def _view_rows(lay: _Layout, out: Any) -> Any:
    """A 2-D view of ``out`` the backend can write into, or None if only a copy would do."""
    if lay.perm is not None:
        return None
    if hasattr(out, "view") and hasattr(out, "__array_interface__") or aac.is_cupy_array(out):
        v = out.view()
        try:
            v.shape = (lay.n, lay.d)  # numpy/cupy raise instead of copying
        except AttributeError:
            return None
        return v
    if aac.is_torch_array(out):
        try:
            return out.view(lay.n, lay.d)
        except RuntimeError:
            return None
    return None


_FORWARD_INPUTS = ("x", "residual", "weight", "bias")


def _check_out(out: Any, x: Any, dtype: str, inputs: tuple = (),
               names: tuple = _FORWARD_INPUTS, in_place: tuple = ("x", "residual"),
               what: str = "the output dtype") -> None:
    """``out``'s type, shape and dtype (``dtype``, ``what`` it is); for host memory
    also its byte order, writability and overlap with the ``inputs`` (called
    ``names``; ``out`` may be exactly one of those named in ``in_place``)."""
    if out is None:
        return
    if type(out) is not type(x):
        raise TypeError(f"out must be of the same type as x ({type(x).__name__}), got {type(out).__name__}")
    if aac.is_jax_array(out):
        raise TypeError("out= is not supported for jax arrays, which are immutable")
    if aac.is_dask_array(out) and any(_unknown(s) for s in out.shape):
        raise ValueError(
            f"out= is not supported for dask arrays of unknown chunk sizes (out: shape "
            f"{tuple(out.shape)}), which dask cannot assign into; use the returned array")
    _check_shape("out", out, tuple(x.shape), "the shape of x")
    got = float_dtype_name("out", out)
    if got != dtype:
        raise TypeError(f"out must have dtype {dtype} ({what}), got {got}")
    ov = host_view(out)
    if ov is not None:
        check_out_memory(ov, tuple(host_view(a) for a in inputs), names[:len(inputs)], in_place)


def _native(a: Any) -> Any:
    """``a`` in native byte order: a converted copy of an array whose numpy
    dtype is byte-swapped (``'>f4'`` on a little-endian machine), else ``a``.

    The kernels read memory in the machine's order; a swapped input would be
    read wrongly (16-bit) or not compile (float32/float64).
    """
    dt = getattr(a, "dtype", None)
    if not isinstance(dt, _np.dtype) or dt.isnative:
        return a
    return a.astype(dt.newbyteorder("="))


# --------------------------------------------------------------------------- eager jax
# jax arrays in host memory reach the kernels as numpy views (np.asarray: zero-copy,
# ~3 us) and only the results cross back: small ones copied by jnp.asarray (~20 us),
# large ones (pool memory, 4096-byte aligned) without a copy in one jax.device_put.  Without this, every jax reshape and
# every result's own device_put of the general path costs ~300 us at (1, 4096).


def _jax_host_views(x, residual, weight, bias):
    """numpy views of concrete jax ``x``/``residual``/``weight``/``bias`` that all live on
    one CPU device (committed ones on the same), else None: the general path decides."""
    if type(x).__module__.split(".")[0] not in ("jax", "jaxlib") or not aac.is_jax_array(x):
        return None
    import jax

    views = []
    committed = None
    for a in (x, residual, weight, bias):
        if a is None or type(a) is _np.ndarray:
            views.append(a)
            continue
        if not aac.is_jax_array(a) or isinstance(a, jax.core.Tracer):
            return None
        try:
            devices = a.devices()
        except Exception:  # a deleted array: the general path raises jax's error
            return None
        if len(devices) != 1:
            return None
        (dev,) = devices
        if dev.platform != "cpu":
            return None
        if jax_committed(a):
            if committed is not None and committed != dev:
                return None  # the general path's ValueError
            committed = dev
        views.append(_np.asarray(a))
    return views


def _jax_wrap(r, like):
    """The fast path's numpy result(s) as jax arrays placed as ``like`` (uncommitted on
    the default device, or committed to ``like``'s device), as jnp places results."""
    import jax

    dev = next(iter(like.devices())) if jax_committed(like) else None
    rs = r if isinstance(r, tuple) else (r,)
    if dev is None and all(a.nbytes < MIN_BYTES for a in rs):
        # jax copies these anyway (below the pool's 4096-byte-aligned sizes), and
        # jnp.asarray's copy costs half of a device_put (~20 us against ~40 us)
        import jax.numpy as jnp

        out = tuple(jnp.asarray(a) for a in rs)
        return out if isinstance(r, tuple) else out[0]
    if not isinstance(r, tuple):
        return jax.device_put(r, dev)
    return tuple(jax.device_put(list(r), dev))


# --------------------------------------------------------------------------- front end


@dataclass
class _Call:
    lay: _Layout
    plan: Plan
    backend: Any


def _prepare(*, x: Any, weight: Any, bias: Any, arrays: dict[str, Any], opts: Options) -> _Call:
    """Check the arrays against each other, lay them out as rows, resolve the Plan, and
    choose the backend (``opts.backend``)."""
    xp = _namespace({"x": x, **arrays, "weight": weight, "bias": bias})
    x_dtype = float_dtype_name("x", x)
    for argname, a in {"weight": weight, "bias": bias, **arrays}.items():
        if a is not None and argname != "rstd":
            float_dtype_name(argname, a)
    norm_dtype = x_dtype
    if arrays.get("residual") is not None:
        # h = x + residual lives in the promoted dtype; y = rms_norm(h)
        norm_dtype = promote(x_dtype, float_dtype_name("residual", arrays["residual"]))
    lay = _layout(xp, x, opts.axis)
    _check_shape("weight", weight, lay.norm_shape, "x's shape over the normalized axes")
    _check_shape("bias", bias, lay.norm_shape, "x's shape over the normalized axes")
    for argname in ("residual", "dy", "grad_residual"):
        _check_shape(argname, arrays.get(argname), lay.shape, "the shape of x")
    if lay.lead is not None:
        _check_unknown_chunks(lay, x, {k: v for k, v in arrays.items()
                                       if k not in ("scale", "out")})
    plan = make_plan(lay.d, norm_dtype, opts)
    if plan.out_dtype != norm_dtype:
        # e.g. out_dtype="bfloat16" for array-api-strict, which has none: say so now
        try:
            namespace_dtype(xp, plan.out_dtype, x)
        except TypeError as exc:
            raise TypeError(f"out_dtype={opts.out_dtype!r} is not available here: {exc}") from None
    mod = _choose_backend(opts.backend, x)
    return _Call(lay=lay, plan=plan, backend=mod)


def forward(x, residual, weight, bias, opts: Options, *, out=None, return_rstd: bool = False,
            fused: bool = False, residual_out=None):
    """:func:`rms_norm` (``fused=False``) or :func:`add_rms_norm` with the options packed.

    The entry of :mod:`polynorm.torch` and :mod:`polynorm.jax` too: the fast path
    when it takes the call, else the general path.  ``residual_out`` receives ``h``
    (:func:`add_rms_norm`'s keyword); per-head weights go to :func:`forward_heads`.
    """
    if (opts.backend.__class__ is str and opts.backend == "array_api" and residual is None
            and out is None and residual_out is None and not fused):
        r = _fast_ref.forward(x, weight, bias, return_rstd, opts)
        if r is not None:
            return r
    hook = EAGER_CALLS.get(type(x)) if EAGER_CALLS else None
    if hook is not None and residual is None and out is None and not return_rstd:
        y = hook(opts, x, weight, bias)
        if y is not None:
            return y
    mod = _fast.numba_module(opts) if residual_out is None else None
    if mod is not None:
        views = _jax_host_views(x, residual, weight, bias) if out is None else None
        if views is not None:
            vx, vr, vw, vb = views
            r = _fast.forward(mod, vx, vr, vw, vb, None, return_rstd, opts, fused)
            if r is not None:
                return _jax_wrap(r, x)
        if (out is None and (getattr(weight, "ndim", 0) > 1 or getattr(bias, "ndim", 0) > 1)
                and _HEADS_ONE_CALL):
            # per-head weights (forward_heads) in one kernel call
            r = _fast.forward_heads(mod, x, residual, weight, bias, return_rstd, opts, fused)
            if r is not None:
                return r
        r = _fast.forward(mod, x, residual, weight, bias, out, return_rstd, opts, fused)
        if r is not None:
            return r
    if type(x).__module__ == "torch" and residual_out is None:
        r = _fast_cuda.forward(x, residual, weight, bias, out, return_rstd, opts, fused)
        if r is not None:
            return r
    x, residual, weight, bias = _native(x), _native(residual), _native(weight), _native(bias)
    weight, bias = _chunk_library_params(x, weight, bias)
    if per_head(x, weight, bias, opts.axis):
        return forward_heads(x, residual, weight, bias, opts, out=out, return_rstd=return_rstd,
                             fused=fused, residual_out=residual_out)
    call = _prepare(x=x, weight=weight, bias=bias, arrays={"residual": residual, "out": out},
                    opts=opts)
    lay, plan = call.lay, call.plan
    if plan.cast_none:
        call.backend = _none_backend(call.backend)
    if residual is None:
        no_residual(opts)
    _check_out(out, x, plan.out_dtype, (x, residual, weight, bias))
    out2 = _view_rows(lay, out) if out is not None else None
    hout2 = None
    if residual_out is not None:
        check_residual_out(residual_out, x, residual, plan.h_dtype, (x, weight, bias, out),
                           ("x", "weight", "bias", "out"))
        hout2 = _view_rows(lay, residual_out)
    into = getattr(call.backend, "forward_into", None) if hout2 is not None else None
    done = None
    if (into is not None and lay.n != 0 and not split_add(plan) and opts.group_size is None
            and not plan.cast_none):
        # h and y written straight into the caller's buffers (add_rms_norm_)
        try:
            with _no_autograd(x, residual=residual, weight=weight, bias=bias):
                done = into(lay.rows(x), lay.rows(residual), lay.flat(weight), lay.flat(bias),
                            plan, out2, hout2)
        except Exception as exc:
            raise partly_written(exc) from exc
    if done is not None:
        y2, h2, rstd = done
    elif lay.n == 0:
        y2, h2, rstd = _empty_forward(lay, x, residual, plan)
    elif opts.group_size is not None:
        y2, h2, rstd = _grouped_forward(lay, x, residual, weight, bias, plan, opts)
    elif residual is not None and split_add(plan):
        with _no_autograd(x, residual=residual, weight=weight, bias=bias):
            try:
                y2, h2, rstd = _forward_apart(call.backend, lay, x, residual, weight, bias,
                                              plan, opts, out2)
            except Exception as exc:
                if out2 is None:
                    raise
                raise partly_written(exc) from exc
    else:
        try:
            with _no_autograd(x, residual=residual, weight=weight, bias=bias):
                y2, h2, rstd = call.backend.forward(
                    lay.rows(x), lay.rows(residual), lay.flat(weight), lay.flat(bias), plan, out2
                )
        except Exception as exc:
            if out2 is None:  # out is written below, after the kernel: untouched
                raise
            raise partly_written(exc) from exc
    if out is not None and out2 is not None and y2 is out2:
        y = out
    else:
        y = lay.unrows(y2)
        if out is not None:
            out[...] = y
            y = out
    result = [y]
    if residual_out is not None:
        if h2 is not hout2:
            residual_out[...] = lay.unrows(h2)
        result.append(residual_out)
    elif fused:
        result.append(lay.unrows(h2))
    if return_rstd:
        result.append(lay.unbatch(rstd, () if opts.group_size is None else (plan.groups,)))
    return result[0] if len(result) == 1 else tuple(result)


def no_residual(opts: Options) -> None:
    """A ``residual_dtype`` without a residual is an error: there is no ``h`` to give
    it, and ignoring it would hide a caller's mistake (QuACK returns ``x`` cast to it;
    polynorm has no such output).  ``norm_input`` needs no check: without a
    residual the sum is ``x`` itself and both conventions give the same bits."""
    if opts.residual_dtype is not None:
        raise ValueError(
            f"residual_dtype={opts.residual_dtype!r} is the dtype of h = x + residual, and "
            "this call has no residual: pass residual=, or leave residual_dtype=None")


def split_add(plan: Plan) -> bool:
    """Whether a fused add with ``plan`` runs apart (:func:`add_apart`): the backends'
    fused kernels take only the defaults ``norm_input="h"`` and ``h`` in the promoted
    dtype."""
    return plan.norm_sum or plan.h_dtype != plan.norm_dtype


def _split_dtypes(plan: Plan) -> tuple[str, str]:
    """``(dtype of the sum, dtype of the normalized value)`` of :func:`add_apart`."""
    return split_dtypes(plan.norm_dtype, plan.h_dtype, plan.norm_sum)


def add_apart(xp, x2, r2, plan: Plan, opts: Options, backend: Any = None):
    """The fused add of a non-default ``norm_input``/``residual_dtype``, as an add in
    the array library and a plain norm: ``(s, h, plan_s)``.

    ``x + residual`` is summed in the compute dtype of ``h``'s and the inputs' dtypes
    (exact for the 16-bit dtypes in float32), ``h`` is that sum rounded once to
    ``plan.h_dtype``, and ``s`` -- what the plain forward normalizes with
    ``plan_s`` -- is the unrounded sum (``norm_input="sum"``) or ``h``.  A
    ``backend`` with an ``add_apart(x, residual, sum dtype, h dtype)`` (Numba)
    does the add in one pass; otherwise the array library does it.  ``y``
    keeps ``plan.out_dtype``.  The bits are those of the one-pass formula: the
    plain kernels normalize ``s`` as the fused ones normalize ``h``.
    """
    sdt, ndt = _split_dtypes(plan)
    add = getattr(backend, "add_apart", None)
    if add is not None:  # one pass (Numba)
        total, h2 = add(x2, r2, sdt, plan.h_dtype)
    else:
        sd = namespace_dtype(xp, sdt, x2)
        total = xp.astype(x2, sd) + xp.astype(r2, sd)
        h2 = xp.astype(total, namespace_dtype(xp, plan.h_dtype, x2))
    plan_s = make_plan(plan.d, ndt, _plain_opts(plan, opts))
    return (total if plan.norm_sum else h2), h2, plan_s


def _forward_apart(backend, lay: _Layout, x, residual, weight, bias, plan: Plan, opts: Options,
                   out2):
    """``(y, h, rstd)`` of a fused add that the backend's fused kernel does not take
    (:func:`split_add`): the backend's own one-pass ``forward_apart`` (Numba) where it
    has one, else the add apart (:func:`add_apart`) and its plain forward."""
    x2, r2, w1, b1 = lay.rows(x), lay.rows(residual), lay.flat(weight), lay.flat(bias)
    plan_s = make_plan(plan.d, _split_dtypes(plan)[1], _plain_opts(plan, opts))
    one_pass = getattr(backend, "forward_apart", None)
    if one_pass is not None:
        r = one_pass(x2, r2, w1, b1, plan, plan_s, out2)
        if r is not None:
            return r
    s2, h2, plan_s = add_apart(lay.xp, x2, r2, plan, opts, backend)
    y2, _, rstd = backend.forward(s2, None, w1, b1, plan_s, out2)
    return y2, h2, rstd


def _plain_opts(plan: Plan, opts: Options) -> Options:
    """The options of the plain forward of a fused add run apart."""
    return opts._replace(out_dtype=plan.out_dtype, norm_input="h", residual_dtype=None)


def _no_autograd(x, x_name: str = "x", **others):
    """torch records no history for the functional API (polynorm.torch is for training).

    Under torch.func's ``grad``/``vjp``/``jacrev`` that would be a silent zero gradient:
    an array being differentiated there is a ``TypeError`` naming it instead (``others``:
    the call's other arrays by argument name)."""
    if aac.is_torch_array(x):
        import torch

        from polynorm.core.interop import is_grad_tracked

        for name, a in ((x_name, x), *others.items()):
            if a is not None and is_grad_tracked(torch, a):
                raise TypeError(
                    f"{name} is differentiated by torch.func "
                    "(grad, vjp, jacrev): polynorm's functional API records no derivative; "
                    "use polynorm.torch, whose functions have the backward")
        return torch.no_grad()
    return contextlib.nullcontext()


def _empty_forward(lay: _Layout, x, residual, plan: Plan):
    from polynorm.core.dtypes import namespace_dtype

    xp = lay.xp
    dev = result_device(x)
    y = xp.empty((0, lay.d), dtype=namespace_dtype(xp, plan.out_dtype, x), device=dev)
    h = None
    cdt = plan.compute_dtype
    if residual is not None:
        h = xp.empty((0, lay.d), dtype=namespace_dtype(xp, plan.h_dtype, x), device=dev)
        if split_add(plan):
            cdt = compute_dtype(_split_dtypes(plan)[1])
    rstd = xp.empty((0,), dtype=namespace_dtype(xp, cdt, x), device=dev)
    return y, h, rstd


@takes_options()
def rms_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    return_rstd: bool = False,
    out: Array | None = None,
    sumsq: Array | None = None,
    d_total: int | None = None,
    **options: Unpack[NormOptions],
) -> Array | tuple[Array, Array]:
    """Root-mean-square normalization (RMSNorm, and pRMSNorm with ``partial < 1``).

    For every slice ``v`` of ``x`` over ``axis``::

        k    = floor(d * partial)                   # or k = partial_size
        rstd = 1 / sqrt(mean(v[:k]**2) + eps)       # eps_mode="inside"
        rstd = 1 / (sqrt(mean(v[:k]**2)) + eps)     # eps_mode="outside"
        y    = v * rstd * (weight + offset) + bias

    No mean is subtracted.  The math runs in float32 (float64 for float64
    input) and rounds once to the output dtype.

    Non-finite input follows the formula, as torch's ``F.rms_norm`` does: an
    Inf among the first ``k`` elements of a slice makes ``rstd = 0`` (eps
    inside or outside), so ``y = v * 0 * (weight + offset) + bias``: NaN at
    the Inf, ``bias`` (or 0) elsewhere (``[1, 2, inf, 3] -> [0, 0, nan, 0]``);
    an Inf beyond ``k`` is not in the statistic and makes only its own
    element +-Inf; a NaN among the first ``k`` makes the slice NaN.  A
    ``-0.0`` weight keeps its sign (``y = v * rstd * -0.0``, as in torch).

    Parameters
    ----------
    x : array
        Any float array (float16, bfloat16, float32, float64) of any array
        library; the result has the same type and device.  This function does
        not record autograd history: for training with torch or jax use
        :mod:`polynorm.torch` / :mod:`polynorm.jax`.  A dask ``x`` may have
        unknown chunk sizes along its first token axis (after boolean
        indexing, ``x[x[:, 0] > 0]``): each block is normalized on its own;
        unknown sizes along other axes are a ``ValueError``.
    weight, bias : array, optional
        Shape of ``x`` over the normalized axes; may have another float dtype
        than ``x``.  Without ``weight`` there is no scale and ``offset`` is
        not used.
    return_rstd : bool
        Also return ``rstd`` (shape of ``x`` without the normalized axes,
        float32, float64 for float64 input), for :func:`rms_norm_backward`.
    out : array, optional
        Preallocated result (same type, shape and dtype as ``y``; may be ``x``:
        the same memory, shape and strides).  Writable, in native byte order
        (else ``TypeError``), sharing no memory with any input in another way
        and with no two elements at one address (else ``ValueError``).
        Inputs in non-native byte order are converted (a copy).
    sumsq, d_total : array and int, optional
        The hidden axis split across shards (tensor parallelism, docs/split.rst):
        ``x`` is one shard's part of each slice, ``sumsq`` the whole slices' sums
        of squares (the shards' :func:`polynorm.rms_norm_stats` all-reduced: shape
        of ``x`` without the normalized axes) and ``d_total`` the whole slice's
        length; ``rstd`` is ``1 / sqrt(sumsq / d_total + eps)``.  The same call
        as :func:`polynorm.rms_norm_from_stats`.  Both or neither; not with
        ``out``, ``partial`` or ``partial_size``.
    {options}

    Returns
    -------
    y or (y, rstd)

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[3.0, 4.0], [1.0, -1.0]], dtype=np.float32)
    >>> pn.rms_norm(x, eps=0.0)
    array([[ 0.84852815,  1.1313709 ],
           [ 1.        , -1.        ]], dtype=float32)
    >>> halves = (x[:, :1], x[:, 1:])                 # two shards of the hidden axis
    >>> total = sum(pn.rms_norm_stats(h) for h in halves)   # the all-reduce
    >>> pn.rms_norm(halves[1], sumsq=total, d_total=2, eps=0.0)
    array([[ 1.1313709],
           [-1.       ]], dtype=float32)
    """
    if sumsq is not None or d_total is not None:
        return _rms_norm_from_stats(x, weight, bias, sumsq, d_total, return_rstd, out, options)
    opts = pack_options("rms_norm", options)
    if type(x) is _np.ndarray and bias is None:
        y = _fast.prepared(x, weight, out, return_rstd, opts)  # a decode call's prepared entry
        if y is not None:
            return y
    return forward(x, None, weight, bias, opts, out=out, return_rstd=return_rstd)


@takes_options()
def add_rms_norm(
    x: Array,
    residual: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    return_rstd: bool = False,
    out: Array | None = None,
    residual_out: Array | None = None,
    **options: Unpack[NormOptions],
) -> tuple[Array, Array] | tuple[Array, Array, Array]:
    """Fused residual add and RMSNorm: ``h = x + residual``, ``y = rms_norm(h)``.

    ``h`` has the promoted dtype of ``x`` and ``residual`` (bfloat16 + float32
    gives a float32 residual stream), or ``residual_dtype``, and ``y`` is
    exactly ``rms_norm(h, ...)`` for the ``h`` returned (``norm_input="h"``,
    Hugging Face's and Liger's bits), or the norm of the unrounded sum
    (``norm_input="sum"``: vLLM's, FlashInfer's and QuACK's).  The backward
    (:func:`rms_norm_backward` with ``x=h``) takes the ``h`` and ``rstd``
    returned; with ``"sum"`` that ``rstd`` is the sum's.

    Parameters
    ----------
    x, residual : array
        Same shape, same array library and device; float dtypes (they may
        differ: ``h`` takes the promoted one).  Dask arrays of unknown chunk
        sizes (as in :func:`rms_norm`) must have the same chunks, e.g. the
        same boolean index.
    weight, bias : array, optional
        As in :func:`rms_norm`.
    return_rstd : bool
        Also return ``rstd`` (for :func:`rms_norm_backward` with ``x=h``).
    out : array, optional
        Preallocated ``y`` (same type, shape and dtype as ``y``); may be ``x``
        or ``residual`` itself.
    residual_out : array, optional
        Preallocated ``h`` (same type and shape as ``x``, ``h``'s dtype); may be
        ``residual`` itself (the same memory, shape and strides), else it must
        not overlap an input or ``out``, with ``out=``'s other rules.  The
        returned ``h`` is this array.  The Numba backend writes ``h`` into it
        (with the default ``norm_input``/``residual_dtype``); the others, and
        layouts that do not reshape to rows without a copy, copy into it.
        :func:`add_rms_norm_` is ``out=x, residual_out=residual``.
    {options}

    Returns
    -------
    (y, h) or (y, h, rstd)
        ``h = x + residual`` rounded to its dtype, ``y = rms_norm(h)`` (or of the
        sum, ``norm_input="sum"``).

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[1.0, 2.0]], dtype=np.float32)
    >>> y, h = pn.add_rms_norm(x, np.array([[2.0, 2.0]], dtype=np.float32), eps=0.0)
    >>> h
    array([[3., 4.]], dtype=float32)
    >>> y
    array([[0.84852815, 1.1313709 ]], dtype=float32)

    A float32 residual stream from float16 inputs (QuACK's ``residual_dtype``):

    >>> h = pn.add_rms_norm(x.astype(np.float16), np.full((1, 2), 2**-12, np.float16),
    ...                     residual_dtype="float32")[1]
    >>> h
    array([[1.0002441, 2.0002441]], dtype=float32)
    """
    if residual is None:
        raise TypeError("residual must be an array, got None")
    opts = pack_options("add_rms_norm", options)
    return forward(x, residual, weight, bias, opts, out=out, return_rstd=return_rstd, fused=True,
                   residual_out=residual_out)


@takes_options()
def rms_norm_backward(
    dy: Array,
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    rstd: Array | None = None,
    grad_residual: Array | None = None,
    return_rstd: bool = False,
    out: Array | None = None,
    sumsq: Array | None = None,
    dot: Array | None = None,
    d_total: int | None = None,
    **options: Unpack[NormOptions],
) -> tuple[Array, Array | None, Array | None]:
    """Hand-written backward of :func:`rms_norm` (no autograd).

    With ``g = weight + offset``, ``xhat = x * rstd`` and
    ``c = sum(g * dy * xhat)`` per slice::

        dx      = rstd * (g*dy - [i < k] * xhat * c / k)        (eps inside)
        dweight = sum over tokens of dy * xhat
        dbias   = sum over tokens of dy

    For ``eps_mode="outside"`` the second term of ``dx`` is multiplied by
    ``(s + eps) / s`` with ``s = sqrt(mean(x[:k]**2))``.  The reductions are
    in a fixed order: the same input gives the same bits on every run.

    Beyond ``k`` the masked term is ``xhat * 0``, not left out: NaN where
    ``xhat`` is not finite.  A slice with an Inf among its first ``k``
    elements (``rstd = 0``, see :func:`rms_norm`) gets ``dx`` NaN on its
    first ``k`` elements (``c`` holds ``Inf * 0``; SPEC's
    ``x * rstd**3 / k * sum(g*dy*x)`` is ``0 * Inf`` there, and torch's
    autograd gives NaN too), and beyond ``k`` ``rstd * g * dy = 0`` plus
    ``grad_residual`` (NaN at an Inf); its ``dweight`` terms ``dy * xhat``
    are 0 except NaN in the Inf's column.

    Parameters
    ----------
    dy : array
        Gradient of the loss with respect to ``y``; shape of ``x``.
    x : array
        The forward's input (``h`` for :func:`add_rms_norm`).  A dask ``x``
        may have unknown chunk sizes as in :func:`rms_norm`; ``dy``,
        ``grad_residual`` and ``rstd`` then have its chunks along the token
        axes, and ``dweight`` has the in-memory bits all the same (the
        chunks' rows are counted when they are computed).  ``out`` is not
        supported for such arrays.
    weight, bias : array, optional
        As in the forward; ``dweight``/``dbias`` are ``None`` without them.
    rstd : array, optional
        The forward's ``rstd`` (``return_rstd=True``); saves recomputing it.
        Must have the shape of ``x`` without the normalized axes and dtype
        float32 (float64 for float64 ``x``).  A dask ``x`` takes it, like
        ``weight``, also as an array of its chunks' library.
    grad_residual : array, optional
        Added into ``dx``: the gradient reaching ``h`` through the residual
        stream, for the backward of :func:`add_rms_norm` (whose ``dx`` is the
        gradient of both ``x`` and ``residual``).
    return_rstd : bool
        Accepted for a signature uniform with the forward's; must be False.
    out : array, optional
        Where to write ``dx``: the type and shape of ``x``, ``x``'s dtype.  It
        may be exactly ``dy`` or ``grad_residual`` (the same memory, shape and
        strides), which saves an allocation of ``x``'s size (Liger's
        ``in_place``); ``dy`` then holds ``dx`` afterwards, so only pass it
        where nothing else reads ``dy`` later.  Otherwise it must not overlap
        an input.  The Numba backend writes into it; the others copy into it.
    sumsq, dot, d_total : arrays and int, optional
        The hidden axis split across shards (docs/split.rst): the backward of
        ``rms_norm(x, ..., sumsq=, d_total=)`` on one shard, with ``dot`` the
        shards' :func:`polynorm.rms_norm_backward_stats` all-reduced; the same
        call as :func:`polynorm.rms_norm_backward_from_stats` (``dweight`` /
        ``dbias`` are this shard's columns').  All three or none; not with
        ``rstd``, ``grad_residual`` or ``out``.
    {options}

    The options are the forward's.  ``casting`` does not change the backward
    (the derivative of the unrounded function); ``out_dtype`` is accepted for a
    uniform signature and must be left at its default.

    Returns
    -------
    (dx, dweight, dbias)
        ``dx`` has ``x``'s dtype; ``dweight``/``dbias`` have the dtypes of
        ``weight``/``bias``.

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[3.0, 4.0]])
    >>> dx, dw, db = pn.rms_norm_backward(np.ones_like(x), x, np.ones(2), eps=0.0)
    >>> dx
    array([[ 0.04525483, -0.03394113]])
    >>> dw
    array([0.84852814, 1.13137085])
    """
    opts = pack_options("rms_norm_backward", options)
    if return_rstd or opts.out_dtype is not None:
        bad = "return_rstd" if return_rstd else "out_dtype"
        raise ValueError(f"{bad} is not used by rms_norm_backward; leave it at its default")
    if sumsq is not None or dot is not None or d_total is not None:
        split_given("rms_norm_backward", {"sumsq": sumsq, "dot": dot, "d_total": d_total})
        for name, v in (("rstd", rstd), ("grad_residual", grad_residual), ("out", out)):
            if v is not None:
                raise ValueError(f"rms_norm_backward: {name}= is not supported with sumsq=/dot= "
                                 "(the split hidden axis); leave it None")
        return backward_from_stats("rms_norm_backward", dy, x, weight, bias, sumsq, dot, d_total,
                                   opts)
    return backward(dy, x, weight, bias, rstd, grad_residual, opts, out)


def backward(dy, x, weight, bias, rstd, grad_residual, opts: Options, out=None):
    """:func:`rms_norm_backward` with the options packed (``opts.out_dtype`` is None)."""
    mod = _fast.numba_module(opts) if out is None else None
    if mod is not None:
        r = _fast.backward(mod, dy, x, weight, bias, rstd, grad_residual, opts)
        if r is not None:
            return r
    if out is None and type(x).__module__ == "torch":
        r = _fast_cuda.backward(dy, x, weight, bias, rstd, grad_residual, opts)
        if r is not None:
            return r
    dy, x, weight, bias, rstd, grad_residual = (
        _native(a) for a in (dy, x, weight, bias, rstd, grad_residual))
    # rstd, like weight: a dask x's forward run in memory (or saved) gives it in the
    # chunks' library
    weight, bias = _chunk_library_params(x, weight, bias)
    rstd = _chunk_library_params(x, rstd, None)[0]
    if per_head(x, weight, bias, opts.axis):
        return backward_heads(dy, x, weight, bias, rstd, grad_residual, opts, out)
    call = _prepare(x=x, weight=weight, bias=bias,
                    arrays={"dy": dy, "rstd": rstd, "grad_residual": grad_residual}, opts=opts)
    lay, plan = call.lay, call.plan
    rstd1 = None
    tail = () if opts.group_size is None else (plan.groups,)
    if rstd is not None:
        _check_shape("rstd", rstd, lay.batch_shape + tail, "x's shape without the normalized axes"
                     + ("" if opts.group_size is None else ", plus the groups"))
        got = float_dtype_name("rstd", rstd)
        if got != plan.rstd_dtype:
            raise TypeError(f"rstd must have dtype {plan.rstd_dtype}, got {got}")
        rstd1 = lay.batch_rows(rstd, tail)
    if plan.cast_none and rstd1 is None and lay.n and opts.group_size is None:
        # the backends' backward recomputes the "fp32" rstd; "none" has its own
        rstd1 = _backends.get("array_api").none_rstd(lay.xp, lay.rows(x), plan)
    _check_out(out, x, float_dtype_name("x", x), (dy, grad_residual, x, weight, bias, rstd),
               ("dy", "grad_residual", "x", "weight", "bias", "rstd"), ("dy", "grad_residual"),
               "x's dtype, that of dx")
    out2 = _view_rows(lay, out) if out is not None else None
    if lay.n == 0:
        xp = lay.xp
        dev = result_device(x)
        dx = xp.empty(lay.shape, dtype=x.dtype, device=dev) if out is None else out
        dw = None if weight is None else xp.zeros(weight.shape, dtype=weight.dtype, device=dev)
        db = None if bias is None else xp.zeros(bias.shape, dtype=bias.dtype, device=dev)
        return dx, dw, db
    try:
        if opts.group_size is not None:
            dx2, dw, db = _grouped_backward(lay, dy, x, weight, bias, rstd1, grad_residual,
                                            plan, opts)
        else:
            with _no_autograd(x, dy=dy, weight=weight, bias=bias, grad_residual=grad_residual):
                dx2, dw, db = call.backend.backward(
                    lay.rows(dy), lay.rows(x), lay.flat(weight), lay.flat(bias), rstd1,
                    lay.rows(grad_residual), plan, out2,
                )
    except Exception as exc:
        if out2 is None:
            raise
        raise partly_written(exc) from exc
    if out is None:
        dx = lay.unrows(dx2)
    else:
        if out2 is None or dx2 is not out2:
            out[...] = lay.unrows(dx2)
        dx = out
    return dx, lay.unflat(dw), lay.unflat(db)


# --------------------------------------------------------------------------- in place


def check_residual_out(residual_out: Any, x: Any, residual: Any, h_dtype: str, others: tuple,
                       names: tuple) -> None:
    """``residual_out`` (where ``h`` goes) by ``out=``'s rules: the type and shape of
    ``x``, dtype ``h_dtype``, writable, native byte order, and no overlap with
    ``others`` (called ``names``) or with ``residual`` other than being it exactly."""
    if type(residual_out) is not type(x):
        raise TypeError(f"residual_out must be of the same type as x ({type(x).__name__}), "
                        f"got {type(residual_out).__name__}")
    if aac.is_jax_array(residual_out):
        raise TypeError("residual_out= is not supported for jax arrays, which are immutable")
    if aac.is_dask_array(residual_out) and any(_unknown(s) for s in residual_out.shape):
        raise ValueError("residual_out= is not supported for dask arrays of unknown chunk sizes")
    _check_shape("residual_out", residual_out, tuple(x.shape), "the shape of x")
    got = float_dtype_name("residual_out", residual_out)
    if got != h_dtype:
        raise TypeError(f"residual_out must have dtype {h_dtype} (that of h = x + residual), "
                        f"got {got}")
    ov = host_view(residual_out)
    if ov is not None:
        check_out_memory(ov, tuple(host_view(a) for a in (residual, *others)),
                         ("residual", *names), ("residual",), name="residual_out")


@takes_options()
def add_rms_norm_(
    x: Array,
    residual: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    **options: Unpack[NormOptions],
) -> tuple[Array, Array]:
    """In-place fused add and RMSNorm: ``residual <- x + residual``, ``x <- y``.

    The bits of :func:`add_rms_norm` (``residual`` receives its ``h``, ``x``
    its ``y``), written over the inputs: vLLM's ``fused_add_rms_norm`` and
    FlashInfer's ``fused_add_rmsnorm`` (both ``(input, residual, weight,
    eps)``, mutating both).  The Numba backend allocates no token-sized array
    (the kernel reads each row of ``x`` and ``residual`` whole before it
    writes that row); the other backends, and layouts that do not reshape to
    rows without a copy, compute apart and copy.

    Parameters
    ----------
    x : array
        The block's output; receives ``y``.  Writable, native byte order, not
        overlapping ``residual``, ``weight`` or ``bias``.  ``y`` must have
        ``x``'s dtype: ``y``'s default dtype is ``h``'s, so bfloat16 ``x``
        with a float32 ``residual`` needs ``out_dtype="bfloat16"``.
    residual : array
        The residual stream; receives ``h``, so ``h``'s dtype (the promoted
        dtype of ``x`` and ``residual``, or ``residual_dtype``) must be
        ``residual``'s own: float32 ``x`` with a bfloat16 ``residual`` needs
        ``residual_dtype="bfloat16"``.
    weight, bias : array, optional
        As in :func:`rms_norm`.
    {options}

    Returns
    -------
    (x, residual)
        The two arrays passed, now holding ``y`` and ``h`` (torch's ``add_``
        returns its tensor too; vLLM's and FlashInfer's ops return None, and
        ignoring the result gives their usage).  jax arrays are immutable: a
        ``TypeError`` that points to :func:`add_rms_norm` (under ``jax.jit``
        with ``donate_argnums`` XLA reuses the donated buffers for ``y`` and
        ``h``).  Dask arrays are a ``TypeError`` too: a dask graph has no
        memory to reuse.

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[1.0, 2.0]], dtype=np.float32)
    >>> residual = np.array([[2.0, 2.0]], dtype=np.float32)
    >>> _ = pn.add_rms_norm_(x, residual, eps=0.0)
    >>> residual
    array([[3., 4.]], dtype=float32)
    >>> x
    array([[0.84852815, 1.1313709 ]], dtype=float32)
    """
    if residual is None:
        raise TypeError("residual must be an array, got None")
    opts = pack_options("add_rms_norm_", options)
    if _inplace_fast(x, residual, weight, bias, opts):
        return x, residual
    xp = _namespace({"x": x, "residual": residual, "weight": weight, "bias": bias})
    for argname, a in (("x", x), ("residual", residual)):
        if aac.is_jax_array(a):
            raise TypeError(
                f"{argname} is a jax array, which is immutable: use add_rms_norm (under jax.jit "
                "with donate_argnums, XLA may reuse the donated buffers for y and h)")
        if aac.is_dask_array(a):
            raise TypeError(f"{argname} is a dask array, whose graph has no memory to update in "
                            "place: use add_rms_norm")
    x_dt = float_dtype_name("x", x)
    r_dt = float_dtype_name("residual", residual)
    _check_shape("residual", residual, tuple(x.shape), "the shape of x")
    for argname, a, rest, names in (
            ("x", x, (residual, weight, bias), ("residual", "weight", "bias")),
            ("residual", residual, (weight, bias), ("weight", "bias"))):
        view = host_view(a)
        if view is not None:
            check_out_memory(view, tuple(host_view(b) for b in rest), names, (), name=argname)
    lay = _layout(xp, x, opts.axis)
    plan = make_plan(lay.d, promote(x_dt, r_dt), opts)
    if plan.out_dtype != x_dt:
        raise TypeError(f"x receives y, whose dtype is {plan.out_dtype}; x has {x_dt} (pass "
                        f"out_dtype={x_dt!r} to round y to it)")
    if plan.h_dtype != r_dt:
        raise TypeError(
            f"residual receives h = x + residual, whose dtype is {plan.h_dtype}; residual has "
            f"{r_dt} (pass residual_dtype={r_dt!r} to round h to it)")
    forward(x, residual, weight, bias, opts, out=x, fused=True, residual_out=residual)
    return x, residual


def _inplace_fast(x, residual, weight, bias, opts: Options) -> bool:
    """:func:`add_rms_norm_` of the serving loop's call (numpy or torch CPU, 2-D,
    C-contiguous, writable, one dtype, default conventions) straight to the Numba
    backend's ``forward_into``; False where the general path decides (and raises)."""
    mod = _fast.numba_module(opts)
    if mod is None:
        return False
    if type(x) is _np.ndarray and _fast.inplace(mod, x, residual, weight, bias, opts):
        return True  # a decode call signature's prepared entry
    if type(x) is not _np.ndarray:
        if type(x).__module__ != "torch" or type(residual) is not type(x):
            return False
        views = _interop_torch_views((x, residual, weight, bias))
        if views is None:
            return False
        x, residual, weight, bias = views
    if type(residual) is not _np.ndarray or x.ndim != 2 or residual.shape != x.shape:
        return False
    if residual.dtype != x.dtype or not (x.flags.c_contiguous and x.flags.writeable
                                         and residual.flags.c_contiguous
                                         and residual.flags.writeable):
        return False
    head = _fast._rows(x, weight, bias, None, None)
    if head is None or not x.dtype.isnative:
        return False
    names, dtype, d, _, _ = head
    plan = _fast._plan(d, dtype, opts)
    if plan is None or plan.llama or split_add(plan) or plan.out_dtype != dtype:
        return False
    share = _np.may_share_memory
    for a in (weight, bias):  # a bounds test, as check_out_memory's first
        if a is not None and (share(a, x) or share(a, residual)):
            return False
    if share(x, residual):
        return False
    mod.forward_into(x, residual, weight, bias, plan, x, residual)
    return True


def _interop_torch_views(arrays: tuple) -> Any:
    from polynorm.core.interop import torch_host_views

    return torch_host_views(arrays)


# --------------------------------------------------------------------------- per-head weights


def per_head(x: Any, weight: Any, bias: Any, axis: Any) -> bool:
    """Whether ``weight`` or ``bias`` has more axes than the normalized ones (per-head
    weights, :func:`forward_heads`); their shapes are checked there."""
    nax = len(axis) if isinstance(axis, (tuple, list)) else 1
    return ((weight is not None and getattr(weight, "ndim", 0) > nax)
            or (bias is not None and getattr(bias, "ndim", 0) > nax))


@dataclass
class _Heads:
    """``x`` as ``(t, heads, d)``: each head a ``(t, d)`` strided view with its own
    weight row."""

    xp: Any
    shape: tuple[int, ...]
    wshape: tuple[int, ...]
    t: int
    heads: int
    d: int
    nax: int

    def split(self, a: Any) -> Any:
        return None if a is None else self.xp.reshape(a, (self.t, self.heads, self.d))

    def params(self, a: Any) -> Any:
        return None if a is None else self.xp.reshape(a, (self.heads, self.d))

    def view(self, a: Any) -> Any:
        """``a`` (shape of x) as ``(t, heads, d)`` without a copy, or None."""
        if a is None:
            return None
        if aac.is_torch_array(a):
            try:
                return a.view(self.t, self.heads, self.d)
            except RuntimeError:
                return None
        if hasattr(a, "__array_interface__") or aac.is_cupy_array(a):
            v = a.view()
            try:
                v.shape = (self.t, self.heads, self.d)
            except AttributeError:
                return None
            return v
        return None

    def join(self, parts: list, tail: tuple[int, ...]) -> Any:
        return self.xp.reshape(self.xp.stack(parts, axis=1), tail)


def _heads(x: Any, weight: Any, bias: Any, axis: Any) -> _Heads:
    """The per-head layout, or the ``ValueError`` of weights that do not span x's
    trailing axes that way."""
    xp = _namespace({"x": x, "weight": weight, "bias": bias})
    shape = tuple(x.shape)
    if any(_unknown(s) for s in shape):
        raise ValueError(f"per-head weights need x of known sizes, got shape {shape}; "
                         "call x.compute_chunk_sizes() first")
    nd = len(shape)
    axes = _normalize_axis(axis, nd)
    nax = len(axes)
    wide = weight if weight is not None and weight.ndim > nax else bias
    argname = "weight" if wide is weight else "bias"
    wshape = tuple(wide.shape)
    if axes != tuple(range(nd - nax, nd)):
        raise ValueError(
            f"{argname} of shape {wshape} spans axes besides the normalized ones (per-head "
            f"weights), which needs the normalized axes last; got axis={axis!r} for x of shape "
            f"{shape}")
    wn = len(wshape)
    if wn > nd or wshape != shape[nd - wn:]:
        norm = shape[nd - nax:]
        raise ValueError(
            f"{argname} must have shape {norm} (x's shape over the normalized axes) or, for "
            f"per-head weights, a trailing part of x's shape longer than that (e.g. "
            f"{shape[max(0, nd - nax - 1):]}), got {wshape}")
    for other, name in ((weight, "weight"), (bias, "bias")):
        if other is not None and tuple(other.shape) != wshape:
            raise ValueError(f"{name} must have the shape of {argname} ({wshape}) with per-head "
                             f"weights, got {tuple(other.shape)}")
    return _Heads(xp=xp, shape=shape, wshape=wshape, t=math.prod(shape[:nd - wn]),
                  heads=math.prod(shape[nd - wn:nd - nax]), d=math.prod(shape[nd - nax:]),
                  nax=nax)


def forward_heads(x, residual, weight, bias, opts: Options, *, out=None,
                  return_rstd: bool = False, fused: bool = False, residual_out=None):
    """:func:`forward` with per-head weights (QuACK's ``(H, N)`` weight, Flax's
    ``feature_axes``): ``weight``/``bias`` of shape ``x.shape[-m:]`` with ``m`` more
    than the normalized axes (the last ones).  Each head's ``(t, d)`` rows -- a
    strided view of ``x`` -- run the plain kernels with that head's weight row, so
    every row has the bits of :func:`rms_norm` of that row with that weight row
    (the kernels keep their speed and specialisations; a call pays per head).
    ``out``/``residual_out`` are written through per-head views where they reshape
    without a copy, else copied into."""
    hd = _heads(x, weight, bias, opts.axis)
    xp = hd.xp
    _check_shape("residual", residual, hd.shape, "the shape of x")
    if type(x).__module__ == "torch" and hd.t * hd.heads != 0:
        r = _heads_on_host(x, (residual, weight, bias, out, residual_out), opts, return_rstd,
                           fused)
        if r is not None:
            return r
    if hd.t * hd.heads == 0 or hd.d == 0:
        # nothing per head to run: the shapes, dtypes and errors of one plain call
        w0 = None if weight is None else xp.reshape(weight, (-1,))[:hd.d]
        b0 = None if bias is None else xp.reshape(bias, (-1,))[:hd.d]
        if w0 is not None and w0.shape[0] != hd.d or b0 is not None and b0.shape[0] != hd.d:
            w0 = b0 = None
        return forward(x, residual, w0, b0, opts, out=out, return_rstd=return_rstd,
                       fused=fused, residual_out=residual_out)
    if _HEADS_ONE_CALL:
        r = _heads_one_call(hd, x, residual, weight, bias, opts, out, return_rstd, fused,
                            residual_out)
        if r is not None:
            return r
    ho = opts._replace(axis=-1)
    x3, r3, w2, b2 = hd.split(x), hd.split(residual), hd.params(weight), hd.params(bias)
    out3, hout3 = hd.view(out), hd.view(residual_out)
    ys, hs, rs = [], [], []
    for j in range(hd.heads):
        r = forward(x3[:, j, :], None if r3 is None else r3[:, j, :],
                    None if w2 is None else w2[j, :], None if b2 is None else b2[j, :], ho,
                    out=None if out3 is None else out3[:, j, :], return_rstd=True, fused=fused,
                    residual_out=None if hout3 is None else hout3[:, j, :])
        ys.append(r[0])
        if fused:
            hs.append(r[1])
        rs.append(r[-1])
    y = out if out3 is not None else hd.join(ys, hd.shape)
    if out is not None and out3 is None:
        out[...] = y
        y = out
    result = [y]
    if fused:
        h = residual_out if hout3 is not None else hd.join(hs, hd.shape)
        if residual_out is not None and hout3 is None:
            residual_out[...] = h
            h = residual_out
        result.append(h)
    if return_rstd:
        result.append(hd.join(rs, hd.shape[:len(hd.shape) - hd.nax]))
    return result[0] if len(result) == 1 else tuple(result)


#: Per-head calls in one kernel call where the backend has ``forward_heads`` (Numba);
#: False runs every call head by head (the tests compare the two bit for bit).
_HEADS_ONE_CALL = True


def _heads_one_call(hd: _Heads, x, residual, weight, bias, opts: Options, out, return_rstd: bool,
                    fused: bool, residual_out=None):
    """:func:`forward_heads` as one call of the backend's ``forward_heads`` on ``x`` as
    ``(t * heads, d)`` rows (row ``i`` takes weight row ``i % heads``), or None where
    the backend has none or the call needs the per-head loop (groups, a fused add
    run apart, llama casting, ``casting="none"``, a ``residual_out`` that is no
    rows view)."""
    if opts.group_size is not None:
        return None
    mod = _choose_backend(opts.backend, x)
    one = getattr(mod, "forward_heads", None)
    if one is None:
        return None
    xp = hd.xp
    rows = (hd.t * hd.heads, hd.d)
    x2 = xp.reshape(x, rows)
    r2 = None if residual is None else xp.reshape(residual, rows)
    w2, b2 = hd.params(weight), hd.params(bias)
    ho = opts._replace(axis=-1)
    call = _prepare(x=x2, weight=None if w2 is None else w2[0, :],
                    bias=None if b2 is None else b2[0, :], arrays={"residual": r2, "out": out},
                    opts=ho)
    plan = call.plan
    if call.backend is not mod or plan.cast_none or plan.llama:
        return None
    if residual is None:
        no_residual(opts)
    elif split_add(plan):
        return None
    _check_out(out, x, plan.out_dtype, (x, residual, weight, bias))
    hout2 = None
    if residual_out is not None:
        check_residual_out(residual_out, x, residual, plan.h_dtype, (x, weight, bias, out),
                           ("x", "weight", "bias", "out"))
        h3 = hd.view(residual_out)
        if h3 is None:
            return None
        hout2 = xp.reshape(h3, rows)
    o3 = hd.view(out)
    out2 = None if o3 is None else xp.reshape(o3, rows)
    try:
        with _no_autograd(x, residual=residual, weight=weight, bias=bias):
            done = one(x2, r2, w2, b2, plan, out2, hout2)
    except Exception as exc:
        if out2 is None and hout2 is None:
            raise
        raise partly_written(exc) from exc
    if done is None:
        return None
    y2, h2, rstd = done
    if out is not None and out2 is not None:
        y = out
    else:
        y = xp.reshape(y2, hd.shape)
        if out is not None:
            out[...] = y
            y = out
    result = [y]
    if residual_out is not None:
        result.append(residual_out)
    elif fused:
        result.append(xp.reshape(h2, hd.shape))
    if return_rstd:
        result.append(xp.reshape(rstd, hd.shape[:len(hd.shape) - hd.nax]))
    return result[0] if len(result) == 1 else tuple(result)


def _heads_on_host(x, others: tuple, opts: Options, return_rstd: bool, fused: bool):
    """:func:`forward_heads` of torch CPU tensors on their zero-copy numpy views (each
    head's call then takes the numpy fast path, not the tensor's), the results back
    as tensors (``out``/``residual_out``: the caller's own); None where the views
    cannot be had (the per-tensor path runs)."""
    from polynorm.core.interop import torch_from_host, torch_host_views

    views = torch_host_views((x, *others))
    if views is None:
        return None
    vx, vr, vw, vb, vo, vh = views
    r = forward_heads(vx, vr, vw, vb, opts, out=vo, return_rstd=return_rstd, fused=fused,
                      residual_out=vh)
    rs = list(r) if isinstance(r, tuple) else [r]
    back = [torch_from_host(a) for a in rs]
    if others[3] is not None:
        back[0] = others[3]
    if fused and others[4] is not None:
        back[1] = others[4]
    return tuple(back) if len(back) > 1 else back[0]


def backward_heads(dy, x, weight, bias, rstd, grad_residual, opts: Options, out=None):
    """:func:`backward` with per-head weights (:func:`forward_heads`): each head's rows
    run the plain backward, so ``dweight[h]``/``dbias[h]`` are summed over that
    head's tokens in the row tree's fixed order (``backends/rowtree.py``), the
    bits of ``rms_norm_backward`` on that head's rows alone."""
    hd = _heads(x, weight, bias, opts.axis)
    xp = hd.xp
    for argname in ("dy", "grad_residual"):
        _check_shape(argname, {"dy": dy, "grad_residual": grad_residual}[argname], hd.shape,
                     "the shape of x")
    batch = hd.shape[:len(hd.shape) - hd.nax]
    _check_shape("rstd", rstd, batch, "x's shape without the normalized axes")
    if hd.t * hd.heads == 0 or hd.d == 0:
        dev = result_device(x)
        dx = xp.zeros(hd.shape, dtype=x.dtype, device=dev) if out is None else out
        dw = None if weight is None else xp.zeros(weight.shape, dtype=weight.dtype, device=dev)
        db = None if bias is None else xp.zeros(bias.shape, dtype=bias.dtype, device=dev)
        return dx, dw, db
    ho = opts._replace(axis=-1)
    dy3, x3, g3 = hd.split(dy), hd.split(x), hd.split(grad_residual)
    w2, b2 = hd.params(weight), hd.params(bias)
    r2 = None if rstd is None else xp.reshape(rstd, (hd.t, hd.heads))
    out3 = hd.view(out)
    dxs, dws, dbs = [], [], []
    for j in range(hd.heads):
        dx, dw, db = backward(
            dy3[:, j, :], x3[:, j, :], None if w2 is None else w2[j, :],
            None if b2 is None else b2[j, :], None if r2 is None else r2[:, j],
            None if g3 is None else g3[:, j, :], ho,
            out=None if out3 is None else out3[:, j, :])
        dxs.append(dx)
        dws.append(dw)
        dbs.append(db)
    dx = out if out3 is not None else hd.join(dxs, hd.shape)
    if out is not None and out3 is None:
        out[...] = dx
        dx = out
    dw = None if weight is None else hd.join([xp.reshape(a, (1, hd.d)) for a in dws],
                                             hd.wshape)
    db = None if bias is None else hd.join([xp.reshape(a, (1, hd.d)) for a in dbs], hd.wshape)
    return dx, dw, db


# --------------------------------------------------------------------------- grouped RMSNorm
# ``group_size`` (Mamba's RMSNormGated without a gate): every group of ``group_size``
# consecutive columns is normalized as rows of ``group_size`` elements, by the same front
# end and backend as any plain call.  A group's rstd, y, h and dx are then the bits
# rms_norm gives those columns as rows (the statistic of a row depends on that row only),
# and each dweight/dbias column is summed over the same row tree as in an ungrouped call:
# batch invariance and the fixed reduction order carry over unchanged.


def _group_slices(lay: _Layout, plan: Plan) -> list[slice]:
    g = lay.d // plan.groups
    return [slice(i * g, (i + 1) * g) for i in range(plan.groups)]


def _cols(a: Any, sl: slice) -> Any:
    return None if a is None else a[:, sl]


def _grouped_forward(lay: _Layout, x, residual, weight, bias, plan: Plan, opts: Options):
    """``(y, h, rstd)`` rows of a grouped call, ``rstd`` of shape ``(n, groups)``."""
    xp = lay.xp
    sub = opts._replace(axis=-1, group_size=None)
    x2, r2, w1, b1 = lay.rows(x), lay.rows(residual), lay.flat(weight), lay.flat(bias)
    ys, hs, rs = [], [], []
    for sl in _group_slices(lay, plan):
        w, b = (None if a is None else a[sl] for a in (w1, b1))
        if r2 is None:
            y, r = forward(x2[:, sl], None, w, b, sub, return_rstd=True)
        else:
            y, h, r = forward(x2[:, sl], r2[:, sl], w, b, sub, return_rstd=True, fused=True)
            hs.append(h)
        ys.append(y)
        rs.append(r)
    h2 = xp.concat(hs, axis=1) if hs else None
    return xp.concat(ys, axis=1), h2, xp.stack(rs, axis=1)


def _grouped_backward(lay: _Layout, dy, x, weight, bias, rstd1, grad_residual, plan: Plan,
                      opts: Options):
    """``(dx rows, dweight, dbias)`` of a grouped call; ``rstd1`` is ``(n, groups)`` or None."""
    xp = lay.xp
    sub = opts._replace(axis=-1, group_size=None)
    dy2, x2, g2 = lay.rows(dy), lay.rows(x), lay.rows(grad_residual)
    w1, b1 = lay.flat(weight), lay.flat(bias)
    dxs, dws, dbs = [], [], []
    for i, sl in enumerate(_group_slices(lay, plan)):
        dx, dw, db = backward(dy2[:, sl], x2[:, sl], None if w1 is None else w1[sl],
                              None if b1 is None else b1[sl],
                              None if rstd1 is None else rstd1[:, i], _cols(g2, sl), sub)
        dxs.append(dx)
        dws.append(dw)
        dbs.append(db)
    dw = None if w1 is None else xp.concat(dws, axis=0)
    db = None if b1 is None else xp.concat(dbs, axis=0)
    return xp.concat(dxs, axis=1), dw, db


# --------------------------------------------------------------------------- casting="none"


def _none_backend(backend: Any) -> Any:
    """The backend that runs a ``casting="none"`` forward: ``backend`` where it has the
    mode's kernels (``CASTING_NONE``), else the array-API reference on the same arrays."""
    if getattr(backend, "CASTING_NONE", False):
        return backend
    return _backends.get("array_api")


# --------------------------------------------------------------------------- split hidden axis
# ``rms_norm(x, w, sumsq=, d_total=)`` and ``rms_norm_backward(..., sumsq=, dot=, d_total=)``:
# one shard's normalize / backward from the all-reduced per-token sums.  The front-end
# core lives here so that rms_norm can take the keywords; polynorm.ops.split (the stats
# functions and the explicit names rms_norm_from_stats / rms_norm_backward_from_stats)
# builds on it.  Kernels: a backend's SplitKernels, else the reference's split_* functions.


def split_check(func: str, opts: Options) -> None:
    """pRMSNorm has no split form: a whole row's first ``k`` elements lie in some shards."""
    if opts.partial != 1.0 or opts.partial_size is not None:
        raise ValueError(
            f"{func}: partial={opts.partial!r}, partial_size={opts.partial_size!r}: pRMSNorm "
            "is not supported with a split hidden axis (the statistic's first k elements of "
            "a whole row lie in some shards only); leave partial=1.0 and partial_size=None")
    if opts.group_size is not None:
        raise ValueError(
            f"{func}: group_size={opts.group_size!r}: a grouped norm has no split form here "
            "(each group's statistic is its own; shard along whole groups and call rms_norm "
            "with group_size on each shard instead); leave group_size=None")
    if opts.casting == "none":
        raise ValueError(f"{func}: casting='none' has no split form (its sum is rounded to "
                         "x's dtype per step, not summed across shards); use 'fp32' or 'llama'")


def split_d_total(func: str, d_total: Any, d: int) -> int:
    """``d_total`` checked: an int of at least this shard's ``d``."""
    if isinstance(d_total, bool):
        raise TypeError(f"{func}: d_total must be an int, got {d_total!r}")
    try:
        value = operator.index(d_total)
    except TypeError:
        raise TypeError(f"{func}: d_total must be an int, got {d_total!r}") from None
    if value < d:
        raise ValueError(f"{func}: d_total must be at least this shard's d = {d} (the whole "
                         f"row's size, all shards together), got {value}")
    return value


def split_row_stat(func: str, argname: str, a: Any, lay) -> Any:
    """``sumsq``/``dot`` checked (shape of x without the normalized axes, a float dtype)
    and laid out as ``(n,)``."""
    if a is None:
        raise TypeError(f"{func}: {argname} must be an array (the shards' sums, all-reduced), "
                        "got None")
    _check_shape(argname, a, lay.batch_shape, "x's shape without the normalized axes")
    float_dtype_name(argname, a)
    return lay.batch_rows(a)


def split_given(func: str, given: dict[str, Any]) -> None:
    """The split keywords come together: a ``TypeError`` naming the missing ones."""
    missing = [k for k, v in given.items() if v is None]
    if missing and len(missing) < len(given):
        have = [k for k in given if k not in missing]
        raise TypeError(f"{func}: {', '.join(have)} given without {', '.join(missing)}: the "
                        f"split hidden axis needs all of {', '.join(given)} (or none)")


_split_offers: dict[Any, bool] = {}


def split_kernels(call, plan) -> Any:
    """The backend's split kernels, or the reference's (llama casting, no SplitKernels)."""
    from polynorm.backends import reference

    mod = call.backend
    offers = _split_offers.get(mod)
    if offers is None:  # a Protocol isinstance check costs ~20 us: once per module
        offers = _split_offers[mod] = isinstance(mod, _backends.SplitKernels)
    return mod if offers and not plan.llama else reference


def split_fast(x, weight, bias, opts: Options, sumsq=None):
    """numpy rows, axis=-1, backend="auto": straight to the Numba split kernels, as
    ops/fast.py does for rms_norm (a decode step's split norm is a (1, d) call, where
    the general path's checks cost several times the kernel); None for anything else
    (the general path takes the call, with its own checks and errors)."""
    mod = _fast.numba_module(opts)
    if mod is None or type(x) is not _np.ndarray or (
            sumsq is not None and type(sumsq) is not _np.ndarray):
        return None
    head = _fast._rows(x, weight, bias, None, None)
    if head is None or opts.partial != 1.0 or opts.partial_size is not None:
        return None
    names, dtype, d, n, _ = head
    if sumsq is not None and (sumsq.shape != x.shape[:-1] or sumsq.dtype not in names):
        return None
    plan = _fast._plan(d, dtype, opts)
    if plan is None or plan.llama or opts.residual_dtype is not None:
        return None
    return mod, plan, n, d


def split_prepare(func: str, x, weight, bias, arrays: dict, opts: Options):
    """Validation and layout of a split call (:func:`_prepare`'s, pRMSNorm refused)."""
    split_check(func, opts)
    x, weight, bias = _native(x), _native(weight), _native(bias)
    arrays = {k: _native(v) for k, v in arrays.items()}
    weight, bias = _chunk_library_params(x, weight, bias)
    call = _prepare(x=x, weight=weight, bias=bias,
                    arrays={k: v for k, v in arrays.items() if v is not None}, opts=opts)
    return x, weight, bias, arrays, call


def from_stats(func: str, x, weight, bias, sumsq, d_total, opts: Options, return_rstd: bool):
    """One shard's ``y`` (and ``rstd``) from the whole rows' ``sumsq``: the core of
    ``rms_norm(sumsq=, d_total=)`` and :func:`polynorm.rms_norm_from_stats`."""
    fast = None if sumsq is None else split_fast(x, weight, bias, opts, sumsq)
    if fast is not None and d_total.__class__ is int and d_total >= fast[3]:
        mod, plan, n, d = fast
        y2, r = mod.split_forward(x.reshape(n, d), weight, bias, sumsq.reshape(n), d_total, plan)
        y = y2.reshape(x.shape)
        return (y, r.reshape(x.shape[:-1])) if return_rstd else y
    x, weight, bias, arrays, call = split_prepare(func, x, weight, bias, {"sumsq": sumsq}, opts)
    lay, plan = call.lay, call.plan
    ss = split_row_stat(func, "sumsq", arrays["sumsq"], lay)
    kt = split_d_total(func, d_total, lay.d)
    with _no_autograd(x, weight=weight, bias=bias):
        y2, r = split_kernels(call, plan).split_forward(lay.rows(x), lay.flat(weight),
                                                        lay.flat(bias), ss, kt, plan)
    y = lay.unrows(y2)
    return (y, lay.unbatch(r)) if return_rstd else y


def backward_from_stats(func: str, dy, x, weight, bias, sumsq, dot, d_total, opts: Options):
    """One shard's ``(dx, dweight, dbias)`` from the whole rows' ``sumsq`` and ``dot``: the
    core of ``rms_norm_backward(sumsq=, dot=, d_total=)`` and
    :func:`polynorm.rms_norm_backward_from_stats`."""
    x, weight, bias, arrays, call = split_prepare(
        func, x, weight, bias, {"dy": dy, "sumsq": sumsq, "dot": dot}, opts)
    lay, plan = call.lay, call.plan
    ss = split_row_stat(func, "sumsq", arrays["sumsq"], lay)
    dt = split_row_stat(func, "dot", arrays["dot"], lay)
    kt = split_d_total(func, d_total, lay.d)
    with _no_autograd(x):
        dx2, dw, db = split_bwd_kernels(call).split_backward(
            lay.rows(arrays["dy"]), lay.rows(x), lay.flat(weight), lay.flat(bias), ss, dt, kt,
            plan)
    return lay.unrows(dx2), lay.unflat(dw), lay.unflat(db)


def split_bwd_kernels(call) -> Any:
    """The backend's split backward kernels (CUDA), else the reference's."""
    from polynorm.backends import reference

    mod = call.backend
    key = ("bwd", mod)
    offers = _split_offers.get(key)
    if offers is None:
        offers = _split_offers[key] = isinstance(mod, _backends.SplitBackwardKernels)
    return mod if offers else reference


def _rms_norm_from_stats(x, weight, bias, sumsq, d_total, return_rstd, out, options):
    """:func:`rms_norm` with ``sumsq=``/``d_total=``: :func:`from_stats`."""
    split_given("rms_norm", {"sumsq": sumsq, "d_total": d_total})
    if out is not None:
        raise ValueError("rms_norm: out= is not supported with sumsq=/d_total= (the split "
                         "hidden axis); leave it None")
    opts = pack_options("rms_norm", options)
    no_residual(opts)
    return from_stats("rms_norm", x, weight, bias, sumsq, d_total, opts, return_rstd)


#: ``type(x) -> call(opts, x, weight, bias)``: a framework's own route for the plain
#: forward of its eager arrays (``y``, or None where it does not take the call), which
#: :func:`forward` tries first.  ``polynorm.jax`` adds jax's array type on import (a
#: jitted kernel call for small CPU arrays): ops does not import the frameworks.
EAGER_CALLS: dict = {}
