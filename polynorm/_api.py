"""The public functions: validate every argument, resolve a Plan, dispatch.

Nothing here computes: arrays are checked, brought into canonical 2-D form
``(tokens, d)`` and handed to one backend module (see
:mod:`polynorm.backends`).  Every error is raised here, before a kernel runs.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import array_api_compat as aac
import numpy as _np

from . import _interop
from . import backends as _backends
from ._dtypes import float_dtype_name, namespace_dtype, parse_dtype
from ._options import Plan, make_plan, promote

__all__ = ["rms_norm", "add_rms_norm", "rms_norm_backward", "backends"]

#: any array of a supported library (numpy, cupy, torch, jax, dask, array-api-strict, ...)
Array: TypeAlias = Any
#: a dtype name (``"bfloat16"``) or a dtype object of any array library
DTypeLike: TypeAlias = Any
EpsMode: TypeAlias = Literal["inside", "outside"]
Casting: TypeAlias = Literal["fp32", "llama"]

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
    first_name, first = next(iter(present.items()))
    dev = aac.device(first)
    for argname, a in present.items():
        other = aac.device(a)
        if other != dev:
            raise ValueError(
                f"{first_name} is on device {dev} but {argname} is on device {other}; "
                "move them to one device"
            )
    return xp


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


def _check_shape(argname: str, a: Any, shape: tuple[int, ...], what: str) -> None:
    if a is not None and tuple(a.shape) != shape:
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
        return xp.reshape(a, (self.n, self.d))

    def unrows(self, a2: Any) -> Any:
        xp = self.xp
        if self.perm is None:
            return xp.reshape(a2, self.shape)
        permuted = tuple(self.shape[p] for p in self.perm)
        inverse = tuple(self.perm.index(i) for i in range(len(self.perm)))
        return xp.permute_dims(xp.reshape(a2, permuted), inverse)

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
    if any(s is None or (isinstance(s, float) and math.isnan(s)) for s in shape):
        raise ValueError(f"x must have a known shape, got {shape}")
    axes = _normalize_axis(axis, len(shape))
    nd = len(shape)
    trailing = axes == tuple(range(nd - len(axes), nd))
    perm = None
    if not trailing:
        perm = tuple(i for i in range(nd) if i not in axes) + axes
    d = math.prod(shape[a] for a in axes)
    n = math.prod(s for i, s in enumerate(shape) if i not in axes)
    return _Layout(xp=xp, shape=shape, axes=axes, perm=perm, n=n, d=d)


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


def _check_out(out: Any, x: Any, plan: Plan, inputs: tuple = ()) -> None:
    """``out``'s type, shape and dtype; for host memory also its byte order,
    writability and overlap with the ``inputs`` (x, residual, weight, bias)."""
    if out is None:
        return
    if type(out) is not type(x):
        raise TypeError(f"out must be of the same type as x ({type(x).__name__}), got {type(out).__name__}")
    if aac.is_jax_array(out):
        raise TypeError("out= is not supported for jax arrays, which are immutable")
    _check_shape("out", out, tuple(x.shape), "the shape of x")
    got = float_dtype_name("out", out)
    if got != plan.out_dtype:
        raise TypeError(f"out must have dtype {plan.out_dtype} (the output dtype), got {got}")
    ov = _host_view(out)
    if ov is not None:
        names = ("x", "residual", "weight", "bias")[:len(inputs)]
        _check_out_memory(ov, tuple(_host_view(a) for a in inputs), names)


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


def _same_memory(a: _np.ndarray, b: _np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same elements: address, shape, strides, item size."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides and a.itemsize == b.itemsize)


def _self_overlaps(a: _np.ndarray) -> bool:
    """Whether two elements of ``a`` share memory (a zero stride, a broadcast view).

    Exact for every layout whose axes nest (each stride spans the axes of
    smaller strides, as any slice or transpose of one array does); an
    interleaved ``as_strided`` layout that does not nest is taken as
    overlapping.
    """
    span = a.itemsize
    for n, st in sorted(((n, abs(st)) for n, st in zip(a.shape, a.strides, strict=True) if n > 1),
                        key=lambda p: p[1]):
        if st < span:
            return True
        span = st * n
    return False


def _check_out_memory(out: _np.ndarray, inputs: tuple, names: tuple) -> None:
    """``out`` (a numpy view) must be writable, in native byte order, free of
    overlapping elements, and share no memory with an input, except being
    exactly the same elements as ``x`` or ``residual`` (an in-place call).

    Cheap for the usual calls (a (1, 4096) call is ~3 us): two arrays that
    own their memory are disjoint; else a bounds test per input
    (``numpy.may_share_memory``, ~0.3 us), and the exact test only when the
    bounds overlap.
    """
    flags = out.flags
    if not flags.writeable:
        raise ValueError("out is read-only; pass a writable array (or out=None)")
    if not out.dtype.isnative:
        raise TypeError(
            f"out must have the machine's byte order, got dtype {out.dtype.str!r}; "
            f"pass an array of dtype {out.dtype.newbyteorder('=').str!r} (or out=None)"
        )
    if not (flags.c_contiguous or flags.f_contiguous) and _self_overlaps(out):
        raise ValueError(
            f"out's elements overlap (strides {out.strides}, e.g. a broadcast view); "
            "pass an array whose elements are distinct"
        )
    owner = out.base is None
    for a, argname in zip(inputs, names, strict=True):
        if a is None or (owner and a is not out and a.base is None):
            continue  # a and out own their memory: two allocations
        if a is out and argname in ("x", "residual"):
            continue  # in place
        if not _np.may_share_memory(out, a):
            continue
        if argname in ("x", "residual") and _same_memory(out, a):
            continue  # in place: allowed
        try:
            shared = _np.shares_memory(out, a, max_work=1 << 16)  # type: ignore[arg-type]
        except _np.exceptions.TooHardError:
            shared = True
        if shared:
            allowed = "" if argname not in ("x", "residual") else (
                f" (out may be exactly {argname}: the same memory, shape and strides)")
            raise ValueError(f"out overlaps {argname}{allowed}; pass a separate array")


def _fast_out_ok(out: _np.ndarray, x, residual, weight, bias) -> bool:
    """The usual ``out=`` of the fast path, cheaply: a writable C-contiguous
    array owning its memory (no self-overlap), ``x`` and ``residual`` are
    ``out`` itself or own theirs, and so do ``weight``/``bias``: nothing
    can overlap.  False sends the call to the full :func:`_check_out_memory`.
    The fast path has already matched ``out``'s dtype (native byte order)."""
    flags = out.flags
    return (flags.writeable and flags.c_contiguous and out.base is None
            and (x is out or x.base is None)
            and (residual is None or residual is out or residual.base is None)
            and (weight is None or weight.base is None)
            and (bias is None or bias.base is None))


def _host_view(a: Any) -> _np.ndarray | None:
    """A numpy view of a host array (numpy, torch/jax CPU), or None."""
    if a is None or type(a) is _np.ndarray:
        return a
    if not _interop.is_host_array(a):
        return None
    try:
        return _interop.to_numpy(a)
    except TypeError:
        return None


def _partly_written(exc: BaseException) -> RuntimeError:
    """The error of a kernel that failed after it may have written ``out``."""
    err = RuntimeError(
        f"the kernel failed ({type(exc).__name__}: {exc}); out may be partly written"
    )
    err.__cause__ = exc
    return err


# --------------------------------------------------------------------------- numpy fast path
# Plain numpy arrays, axis=-1, backend="auto": go straight to the numba
# backend with a cached Plan, skipping the array-API namespace machinery
# (~10 us of a (1, 4096) call).  Only the valid, simple case is handled here:
# anything unusual -- another axis, a non-float dtype, a wrong shape, bad
# options, zero tokens -- returns None and the generic path below runs, so
# every check and every error message stays the generic path's own.

_FAST_NAMES: dict[Any, str] = {}  # numpy dtype -> float dtype name
_fast_plans: dict[tuple, Plan] = {}
_SCALARS = (float, int)  # exact types: bool, numpy scalars etc. take the generic path


def _fast_names() -> dict[Any, str]:
    if not _FAST_NAMES:
        import ml_dtypes

        for name in ("float16", "float32", "float64"):
            _FAST_NAMES[_np.dtype(name)] = name
        _FAST_NAMES[_np.dtype(ml_dtypes.bfloat16)] = "bfloat16"
    return _FAST_NAMES


_fast_mod: list = []  # the numba backend module once it has loaded


def _fast_module(backend: Any, axis: Any):
    """The numba backend module if this call may take the fast path."""
    if backend.__class__ is not str or backend != "auto" or axis.__class__ is not int or axis != -1:
        return None
    if _fast_mod:
        return _fast_mod[0]
    if not _backends.usable("numba"):
        return None
    _fast_mod.append(_backends._loaded["numba"])
    return _fast_mod[0]


def _fast_plan(d, dtype, eps, partial, offset, eps_mode, casting, out_dtype) -> Plan | None:
    if (
        eps.__class__ not in _SCALARS or partial.__class__ not in _SCALARS
        or offset.__class__ not in _SCALARS or eps_mode.__class__ is not str
        or casting.__class__ is not str or not (out_dtype is None or out_dtype.__class__ is str)
    ):
        return None
    key = (d, dtype, eps, partial, offset, eps_mode, casting, out_dtype)
    plan = _fast_plans.get(key)
    if plan is not None:
        return plan
    try:
        plan = make_plan(d, dtype, eps=eps, partial=partial, offset=offset, eps_mode=eps_mode,
                         casting=casting, out_dtype=parse_dtype("out_dtype", out_dtype))
    except (TypeError, ValueError):
        return None  # the generic path raises it, in its own order
    if len(_fast_plans) < 1024:
        _fast_plans[key] = plan
    return plan


def _all_numpy_or_none(a, b, c, e) -> bool:
    # spelled out: a generator over the arguments costs ~0.3 us of a (1, 4096) call
    nd = _np.ndarray
    return ((a is None or type(a) is nd) and (b is None or type(b) is nd)
            and (c is None or type(c) is nd) and (e is None or type(e) is nd))


def _fast_vector_ok(a, d: int, names: dict) -> bool:
    """weight/bias the fast path can take: absent, or shape (d,) with a float dtype."""
    return a is None or (a.ndim == 1 and a.shape[0] == d and a.dtype in names)


def _fast_forward(mod, x, residual, weight, bias, out, return_rstd, eps, partial, offset,
                  eps_mode, casting, out_dtype, fused):
    """``rms_norm``/``add_rms_norm`` on numpy arrays, or None for the generic path."""
    if type(x) is not _np.ndarray:
        # torch CPU tensors: the same path on zero-copy numpy views (polynorm._interop)
        if type(x).__module__ != "torch" or x.ndim == 0:
            return None
        views = _interop.torch_host_views((x, residual, weight, bias, out))
        if views is None:
            return None
        if out is not None:
            # in place: the same view object, which the overlap check knows at once
            if out is x:
                views[4] = views[0]
            elif out is residual:
                views[4] = views[1]
        r = _fast_forward(mod, *views, return_rstd, eps, partial, offset, eps_mode, casting,
                          out_dtype, fused)
        if r is None:
            return None
        r = [_interop.torch_from_host(a) for a in ((r,) if type(r) is _np.ndarray else r)]
        if out is not None:
            r[0] = out
        return r[0] if len(r) == 1 else tuple(r)
    if x.ndim == 0:
        return None
    if not _all_numpy_or_none(residual, weight, bias, out):
        return None
    names = _FAST_NAMES or _fast_names()
    shape = x.shape
    d = shape[-1]
    dtype = names.get(x.dtype)
    if dtype is None or d == 0:
        return None
    if not (_fast_vector_ok(weight, d, names) and _fast_vector_ok(bias, d, names)):
        return None
    if residual is not None:
        rdt = names.get(residual.dtype)
        if rdt is None or residual.shape != shape:
            return None
        dtype = promote(dtype, rdt)
    plan = _fast_plan(d, dtype, eps, partial, offset, eps_mode, casting, out_dtype)
    if plan is None:
        return None
    two_d = len(shape) == 2
    if out is not None and (
        not two_d or out.shape != shape or names.get(out.dtype) != plan.out_dtype
    ):
        return None
    n = shape[0] if two_d else x.size // d
    if n == 0:
        return None
    if out is not None and not _fast_out_ok(out, x, residual, weight, bias):
        _check_out_memory(out, (x, residual, weight, bias), ("x", "residual", "weight", "bias"))
    if (two_d and residual is None and out is None and n * d < mod.SERIAL_MAX_ELEMENTS
            and not plan.llama):
        y, rstd = mod.forward_small(x, weight, bias, plan)
        return (y, rstd) if return_rstd else y
    if two_d:
        try:
            y, h, rstd = mod.forward(x, residual, weight, bias, plan, out)
        except Exception as exc:
            if out is None:
                raise
            raise _partly_written(exc) from exc
    else:
        r2 = None if residual is None else residual.reshape(n, d)
        y, h, rstd = mod.forward(x.reshape(n, d), r2, weight, bias, plan, None)
        y = y.reshape(shape)
        h = None if h is None else h.reshape(shape)
        rstd = rstd.reshape(shape[:-1])
    if out is not None:
        y = out
    if fused:
        return (y, h, rstd) if return_rstd else (y, h)
    return (y, rstd) if return_rstd else y


def _fast_backward(mod, dy, x, weight, bias, rstd, grad_residual, eps, partial, offset,
                   eps_mode, casting):
    """``rms_norm_backward`` on numpy arrays, or None for the generic path."""
    if type(x) is not _np.ndarray and type(x).__module__ == "torch" and x.ndim != 0:
        views = _interop.torch_host_views((dy, x, weight, bias, rstd, grad_residual))
        if views is None:
            return None
        r = _fast_backward(mod, *views, eps, partial, offset, eps_mode, casting)
        return None if r is None else tuple(_interop.torch_from_host(a) for a in r)
    if type(x) is not _np.ndarray or type(dy) is not _np.ndarray or x.ndim == 0:
        return None
    if not _all_numpy_or_none(weight, bias, rstd, grad_residual):
        return None
    names = _FAST_NAMES or _fast_names()
    shape = x.shape
    d = shape[-1]
    dtype = names.get(x.dtype)
    if dtype is None or d == 0 or dy.shape != shape or dy.dtype not in names:
        return None
    if not (_fast_vector_ok(weight, d, names) and _fast_vector_ok(bias, d, names)):
        return None
    if grad_residual is not None and (
        grad_residual.shape != shape or grad_residual.dtype not in names
    ):
        return None
    plan = _fast_plan(d, dtype, eps, partial, offset, eps_mode, casting, None)
    if plan is None:
        return None
    if rstd is not None and (rstd.shape != shape[:-1] or names.get(rstd.dtype) != plan.rstd_dtype):
        return None
    two_d = len(shape) == 2
    n = shape[0] if two_d else x.size // d
    if n == 0:
        return None
    if two_d:
        return mod.backward(dy, x, weight, bias, rstd, grad_residual, plan)
    gr = None if grad_residual is None else grad_residual.reshape(n, d)
    r1 = None if rstd is None else rstd.reshape(n)
    dx, dw, db = mod.backward(dy.reshape(n, d), x.reshape(n, d), weight, bias, r1, gr, plan)
    return dx.reshape(shape), dw, db


# --------------------------------------------------------------------------- front end


@dataclass
class _Call:
    lay: _Layout
    plan: Plan
    backend: Any


def _prepare(
    *,
    x: Any,
    weight: Any,
    bias: Any,
    arrays: dict[str, Any],
    eps: Any,
    axis: Any,
    partial: Any,
    offset: Any,
    eps_mode: Any,
    casting: Any,
    out_dtype: Any,
    backend: Any,
) -> _Call:
    xp = _namespace({"x": x, **arrays, "weight": weight, "bias": bias})
    x_dtype = float_dtype_name("x", x)
    for argname, a in {"weight": weight, "bias": bias, **arrays}.items():
        if a is not None and argname != "rstd":
            float_dtype_name(argname, a)
    norm_dtype = x_dtype
    if arrays.get("residual") is not None:
        # h = x + residual lives in the promoted dtype; y = rms_norm(h)
        norm_dtype = promote(x_dtype, float_dtype_name("residual", arrays["residual"]))
    lay = _layout(xp, x, axis)
    _check_shape("weight", weight, lay.norm_shape, "x's shape over the normalized axes")
    _check_shape("bias", bias, lay.norm_shape, "x's shape over the normalized axes")
    for argname in ("residual", "dy", "grad_residual"):
        _check_shape(argname, arrays.get(argname), lay.shape, "the shape of x")
    plan = make_plan(
        lay.d,
        norm_dtype,
        eps=eps,
        partial=partial,
        offset=offset,
        eps_mode=eps_mode,
        casting=casting,
        out_dtype=parse_dtype("out_dtype", out_dtype),
    )
    if plan.out_dtype != norm_dtype:
        # e.g. out_dtype="bfloat16" for array-api-strict, which has none: say so now
        try:
            namespace_dtype(xp, plan.out_dtype, x)
        except TypeError as exc:
            raise TypeError(f"out_dtype={out_dtype!r} is not available here: {exc}") from None
    mod = _choose_backend(backend, x)
    return _Call(lay=lay, plan=plan, backend=mod)


def _forward(x, residual, weight, bias, out, return_rstd, options, *, fused: bool):
    weight, bias = _chunk_library_params(x, weight, bias)
    call = _prepare(
        x=x, weight=weight, bias=bias, arrays={"residual": residual, "out": out}, **options
    )
    lay, plan = call.lay, call.plan
    _check_out(out, x, plan, (x, residual, weight, bias))
    out2 = _view_rows(lay, out) if out is not None else None
    if lay.n == 0:
        y2, h2, rstd = _empty_forward(lay, x, residual, plan)
    else:
        try:
            with _no_autograd(x):
                y2, h2, rstd = call.backend.forward(
                    lay.rows(x), lay.rows(residual), lay.flat(weight), lay.flat(bias), plan, out2
                )
        except Exception as exc:
            if out2 is None:  # out is written below, after the kernel: untouched
                raise
            raise _partly_written(exc) from exc
    if out is not None and out2 is not None and y2 is out2:
        y = out
    else:
        y = lay.unrows(y2)
        if out is not None:
            out[...] = y
            y = out
    result = [y]
    if fused:
        result.append(lay.unrows(h2))
    if return_rstd:
        result.append(lay.xp.reshape(rstd, lay.batch_shape))
    return result[0] if len(result) == 1 else tuple(result)


def _no_autograd(x):
    """torch records no history for the functional API (polynorm.torch is for training)."""
    if aac.is_torch_array(x):
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def _empty_forward(lay: _Layout, x, residual, plan: Plan):
    from ._dtypes import namespace_dtype

    xp = lay.xp
    dev = aac.device(x)
    y = xp.empty((0, lay.d), dtype=namespace_dtype(xp, plan.out_dtype, x), device=dev)
    h = None
    if residual is not None:
        h = xp.empty((0, lay.d), dtype=namespace_dtype(xp, plan.x_dtype, x), device=dev)
    rstd = xp.empty((0,), dtype=namespace_dtype(xp, plan.compute_dtype, x), device=dev)
    return y, h, rstd


def rms_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    eps: float = 1e-6,
    axis: int | tuple[int, ...] = -1,
    partial: float = 1.0,
    offset: float = 0.0,
    eps_mode: EpsMode = "inside",
    casting: Casting = "fp32",
    out_dtype: DTypeLike | None = None,
    return_rstd: bool = False,
    out: Array | None = None,
    backend: str = "auto",
) -> Array | tuple[Array, Array]:
    """Root-mean-square normalization (RMSNorm, and pRMSNorm with ``partial < 1``).

    For every slice ``v`` of ``x`` over ``axis``::

        k    = floor(d * partial)
        rstd = 1 / sqrt(mean(v[:k]**2) + eps)       # eps_mode="inside"
        rstd = 1 / (sqrt(mean(v[:k]**2)) + eps)     # eps_mode="outside"
        y    = v * rstd * (weight + offset) + bias

    No mean is subtracted.  The math runs in float32 (float64 for float64
    input) and rounds once to the output dtype.

    Parameters
    ----------
    x : array
        Any float array (float16, bfloat16, float32, float64) of any array
        library; the result has the same type and device.  This function does
        not record autograd history: for training with torch or jax use
        :mod:`polynorm.torch` / :mod:`polynorm.jax`.
    weight, bias : array, optional
        Shape of ``x`` over the normalized axes; may have another float dtype
        than ``x``.  Without ``weight`` there is no scale and ``offset`` is
        not used.
    eps : float
        ``>= 0`` and finite.
    axis : int or tuple of int
        The normalized axes (sorted; the slice is taken in C order).
    partial : float
        In ``(0, 1]``; ``k = floor(d * partial)`` must be at least 1.
    offset : float
        Added to ``weight`` (``offset=1.0`` is Gemma's ``1 + w``).
    eps_mode : {"inside", "outside"}
    casting : {"fp32", "llama"}
        ``"llama"`` rounds the normalized value to ``x``'s dtype before the
        weight multiply, as Hugging Face Llama does.
    out_dtype : dtype or str, optional
        Defaults to ``x``'s dtype.
    return_rstd : bool
        Also return ``rstd`` (shape of ``x`` without the normalized axes,
        float32, float64 for float64 input), for :func:`rms_norm_backward`.
    out : array, optional
        Preallocated result (same type, shape and dtype as ``y``; may be ``x``:
        the same memory, shape and strides).  Writable, in native byte order
        (else ``TypeError``), sharing no memory with any input in another way
        and with no two elements at one address (else ``ValueError``).
        Inputs in non-native byte order are converted (a copy).
    backend : {"auto", "numba", "cupy", "dask", "array_api"}

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
    """
    mod = _fast_module(backend, axis)
    if mod is not None:
        r = _fast_forward(mod, x, None, weight, bias, out, return_rstd, eps, partial, offset,
                          eps_mode, casting, out_dtype, False)
        if r is not None:
            return r
    options = dict(eps=eps, axis=axis, partial=partial, offset=offset, eps_mode=eps_mode,
                   casting=casting, out_dtype=out_dtype, backend=backend)
    x, weight, bias = _native(x), _native(weight), _native(bias)
    return _forward(x, None, weight, bias, out, return_rstd, options, fused=False)


def add_rms_norm(
    x: Array,
    residual: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    eps: float = 1e-6,
    axis: int | tuple[int, ...] = -1,
    partial: float = 1.0,
    offset: float = 0.0,
    eps_mode: EpsMode = "inside",
    casting: Casting = "fp32",
    out_dtype: DTypeLike | None = None,
    return_rstd: bool = False,
    out: Array | None = None,
    backend: str = "auto",
) -> tuple[Array, Array] | tuple[Array, Array, Array]:
    """Fused residual add and RMSNorm: ``h = x + residual``, ``y = rms_norm(h)``.

    ``h`` has the promoted dtype of ``x`` and ``residual`` (bfloat16 + float32
    gives a float32 residual stream) and ``y`` is exactly ``rms_norm(h, ...)``
    for the ``h`` returned.

    Parameters
    ----------
    x, residual : array
        Same shape, same array library and device; float dtypes (they may
        differ: ``h`` takes the promoted one).
    weight, bias : array, optional
        As in :func:`rms_norm`.
    eps, axis, partial, offset, eps_mode, casting, backend
        As in :func:`rms_norm`.
    out_dtype : dtype or str, optional
        ``y``'s dtype; defaults to ``h``'s.
    return_rstd : bool
        Also return ``rstd`` (for :func:`rms_norm_backward` with ``x=h``).
    out : array, optional
        Preallocated ``y`` (same type, shape and dtype as ``y``); may be ``x``
        or ``residual`` itself.

    Returns
    -------
    (y, h) or (y, h, rstd)
        ``h = x + residual`` rounded to its dtype, ``y = rms_norm(h)``.

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
    """
    if residual is None:
        raise TypeError("residual must be an array, got None")
    mod = _fast_module(backend, axis)
    if mod is not None:
        r = _fast_forward(mod, x, residual, weight, bias, out, return_rstd, eps, partial, offset,
                          eps_mode, casting, out_dtype, True)
        if r is not None:
            return r
    options = dict(eps=eps, axis=axis, partial=partial, offset=offset, eps_mode=eps_mode,
                   casting=casting, out_dtype=out_dtype, backend=backend)
    x, residual, weight, bias = _native(x), _native(residual), _native(weight), _native(bias)
    return _forward(x, residual, weight, bias, out, return_rstd, options, fused=True)


def rms_norm_backward(
    dy: Array,
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    rstd: Array | None = None,
    grad_residual: Array | None = None,
    eps: float = 1e-6,
    axis: int | tuple[int, ...] = -1,
    partial: float = 1.0,
    offset: float = 0.0,
    eps_mode: EpsMode = "inside",
    casting: Casting = "fp32",
    out_dtype: DTypeLike | None = None,
    return_rstd: bool = False,
    out: Array | None = None,
    backend: str = "auto",
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

    Parameters
    ----------
    dy : array
        Gradient of the loss with respect to ``y``; shape of ``x``.
    x : array
        The forward's input (``h`` for :func:`add_rms_norm`).
    weight, bias : array, optional
        As in the forward; ``dweight``/``dbias`` are ``None`` without them.
    rstd : array, optional
        The forward's ``rstd`` (``return_rstd=True``); saves recomputing it.
        Must have the shape of ``x`` without the normalized axes and dtype
        float32 (float64 for float64 ``x``).
    grad_residual : array, optional
        Added into ``dx``: the gradient reaching ``h`` through the residual
        stream, for the backward of :func:`add_rms_norm` (whose ``dx`` is the
        gradient of both ``x`` and ``residual``).
    eps, axis, partial, offset, eps_mode, casting, backend
        As in the forward.  ``casting`` does not change the backward (the
        derivative of the unrounded function); ``out_dtype``, ``return_rstd``
        and ``out`` are accepted for a uniform signature and must be left at
        their defaults.

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
    if out is not None or return_rstd or out_dtype is not None:
        bad = "out" if out is not None else ("return_rstd" if return_rstd else "out_dtype")
        raise ValueError(f"{bad} is not used by rms_norm_backward; leave it at its default")
    mod = _fast_module(backend, axis)
    if mod is not None:
        r = _fast_backward(mod, dy, x, weight, bias, rstd, grad_residual, eps, partial, offset,
                           eps_mode, casting)
        if r is not None:
            return r
    options = dict(eps=eps, axis=axis, partial=partial, offset=offset, eps_mode=eps_mode,
                   casting=casting, out_dtype=None, backend=backend)
    dy, x, weight, bias, rstd, grad_residual = (
        _native(a) for a in (dy, x, weight, bias, rstd, grad_residual))
    weight, bias = _chunk_library_params(x, weight, bias)
    call = _prepare(
        x=x, weight=weight, bias=bias,
        arrays={"dy": dy, "rstd": rstd, "grad_residual": grad_residual}, **options,
    )
    lay, plan = call.lay, call.plan
    rstd1 = None
    if rstd is not None:
        _check_shape("rstd", rstd, lay.batch_shape, "x's shape without the normalized axes")
        got = float_dtype_name("rstd", rstd)
        if got != plan.rstd_dtype:
            raise TypeError(f"rstd must have dtype {plan.rstd_dtype}, got {got}")
        rstd1 = lay.xp.reshape(rstd, (lay.n,))
    if lay.n == 0:
        xp = lay.xp
        dx = xp.empty(lay.shape, dtype=x.dtype, device=aac.device(x))
        dw = None if weight is None else xp.zeros(weight.shape, dtype=weight.dtype, device=aac.device(x))
        db = None if bias is None else xp.zeros(bias.shape, dtype=bias.dtype, device=aac.device(x))
        return dx, dw, db
    with _no_autograd(x):
        dx2, dw, db = call.backend.backward(
            lay.rows(dy), lay.rows(x), lay.flat(weight), lay.flat(bias), rstd1,
            lay.rows(grad_residual), plan,
        )
    return lay.unrows(dx2), lay.unflat(dw), lay.unflat(db)
