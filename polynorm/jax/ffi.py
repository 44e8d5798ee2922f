"""Host kernels inside ``jax.jit``: an XLA FFI custom call whose handler is Python (ctypes).

``jax.pure_callback`` copies every operand into a fresh jax array and every
result into XLA's buffer, copies that cost many times a memory-bound
kernel's own time.  An XLA FFI handler instead gets
XLA's own buffers: here one handler, a ctypes callback, reads the call frame
(``xla/ffi/api/c_api.h``, API 0.1 fields only), wraps the buffers as numpy
arrays without a copy and calls a registered Python function with them, which
writes its results into the result buffers (polynorm's ``out=`` writes ``y``
in place; other results are copied in).

The handler holds the GIL while it runs (ctypes acquires it); jax releases
the GIL while a computation executes, as it must for ``pure_callback`` too.
An exception becomes an XLA error (a ``JaxRuntimeError`` naming it), never a
silent wrong result.  Only the CPU platform is registered.
"""

from __future__ import annotations

import ctypes as c
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

TARGET = "polynorm_host_kernel"

# ------------------------------------------------------------------ the C API's structs

_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_METADATA = 1  # XLA_FFI_Extension_Metadata
_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL


class _Buffer(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("ext", c.c_void_p), ("dtype", c.c_int),
                ("data", c.c_void_p), ("rank", c.c_int64), ("dims", c.POINTER(c.c_int64))]


class _Span(c.Structure):  # XLA_FFI_Args and XLA_FFI_Rets share this layout
    _fields_ = [("struct_size", c.c_size_t), ("ext", c.c_void_p), ("size", c.c_int64),
                ("types", c.c_void_p), ("ptrs", c.POINTER(c.POINTER(_Buffer)))]


class _Attrs(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("ext", c.c_void_p), ("size", c.c_int64),
                ("types", c.POINTER(c.c_int)), ("names", c.c_void_p),
                ("ptrs", c.POINTER(c.c_void_p))]


class _CallFrame(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("ext", c.c_void_p), ("api", c.c_void_p),
                ("ctx", c.c_void_p), ("stage", c.c_int), ("args", _Span), ("rets", _Span),
                ("attrs", _Attrs), ("future", c.c_void_p)]


class _ExtBase(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("type", c.c_int), ("next", c.c_void_p)]


class _ApiVersion(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("ext", c.c_void_p), ("major", c.c_int),
                ("minor", c.c_int)]


class _Metadata(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("api_version", _ApiVersion),
                ("traits", c.c_uint32)]


class _MetadataExt(c.Structure):
    _fields_ = [("base", _ExtBase), ("metadata", c.POINTER(_Metadata))]


class _Scalar(c.Structure):
    _fields_ = [("dtype", c.c_int), ("value", c.c_void_p)]


class _ErrorArgs(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("ext", c.c_void_p), ("message", c.c_char_p),
                ("errc", c.c_int)]


_ERROR_CREATE = c.CFUNCTYPE(c.c_void_p, c.POINTER(_ErrorArgs))


class _Api(c.Structure):
    _fields_ = [("struct_size", c.c_size_t), ("ext", c.c_void_p), ("api_version", _ApiVersion),
                ("internal", c.c_void_p), ("error_create", _ERROR_CREATE)]


_U64 = c.POINTER(c.c_uint64)

# ------------------------------------------------------------------ registry and handler

#: index -> function(args, rets) of numpy arrays; an index is baked into each call site
_functions: list[Callable[[list[np.ndarray], list[np.ndarray]], None]] = []
_index: dict[Any, int] = {}
_lock = threading.Lock()
_dtypes: dict[int, np.dtype] = {}


def _numpy_dtypes() -> dict[int, np.dtype]:
    if not _dtypes:
        import ml_dtypes

        # XLA_FFI_DataType codes of the float dtypes polynorm takes
        _dtypes.update({10: np.dtype(np.float16), 11: np.dtype(np.float32),
                        12: np.dtype(np.float64), 16: np.dtype(ml_dtypes.bfloat16)})
    return _dtypes


def _array(bp: Any) -> np.ndarray:
    """A numpy view of an XLA buffer (row-major: ffi_call's default layouts)."""
    b = bp.contents
    shape = tuple(b.dims[i] for i in range(b.rank))
    dtype = _dtypes[b.dtype]
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    return np.frombuffer((c.c_char * nbytes).from_address(b.data), dtype).reshape(shape)


def _error(frame: Any, message: str) -> int | None:
    api = c.cast(frame.api, c.POINTER(_Api)).contents
    args = _ErrorArgs(c.sizeof(_ErrorArgs), None, message.encode("utf-8", "replace"), _INTERNAL)
    return api.error_create(c.byref(args))


def _handle(frame_p: Any) -> int | None:
    frame = frame_p.contents
    if frame.ext:
        ext = c.cast(frame.ext, c.POINTER(_ExtBase)).contents
        if ext.type == _METADATA:  # XLA asks which API version the handler speaks
            md = c.cast(frame.ext, c.POINTER(_MetadataExt)).contents.metadata.contents
            md.api_version.major, md.api_version.minor = 0, 1
            md.traits = 0
            return None
    if frame.stage != _EXECUTE:
        return None
    try:
        scalar = c.cast(frame.attrs.ptrs[0], c.POINTER(_Scalar)).contents
        fn = _functions[c.cast(scalar.value, _U64)[0]]
        args = [_array(frame.args.ptrs[i]) for i in range(frame.args.size)]
        rets = [_array(frame.rets.ptrs[i]) for i in range(frame.rets.size)]
        fn(args, rets)
    except BaseException as exc:  # an XLA error, never a silent wrong result
        return _error(frame, f"polynorm host kernel: {type(exc).__name__}: {exc}")
    return None


_HANDLER = c.CFUNCTYPE(c.c_void_p, c.POINTER(_CallFrame))(_handle)  # kept alive here
_registered: list[bool] = []


def available() -> bool:
    """Register the handler with jax once; False if this jax cannot take it."""
    if not _registered:
        try:
            import jax

            _numpy_dtypes()
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_HANDLER), platform="cpu")
            _registered.append(True)
        except Exception:  # an older jax without jax.ffi, or another FFI API
            _registered.append(False)
    return _registered[0]


def function_index(key: Any, fn: Callable[[list[np.ndarray], list[np.ndarray]], None]) -> int:
    """The index of ``fn`` for the call's ``index`` attribute; one per ``key`` (hashable)."""
    with _lock:
        i = _index.get(key)
        if i is None:
            i = _index[key] = len(_functions)
            _functions.append(fn)
        return i


def call(index: int, operands: list[Any], result_shapes: list[Any]) -> list[Any]:
    """Run function ``index`` on ``operands`` (jax arrays or tracers) inside the computation.

    Under ``vmap`` the function runs once per batch element (``"sequential"``).
    """
    import jax

    return jax.ffi.ffi_call(TARGET, result_shapes, vmap_method="sequential")(
        *operands, index=np.uint64(index))


# ------------------------------------------------------------------ the compiled forward

_targets: set[str] = set()  # the targets registered with jax


def _compiled(name: str, handler: str, *args: Any) -> str:
    """FFI target ``name``: :mod:`polynorm.backends.numba.xla`'s ``handler(*args)``,
    registered (and compiled) on first use."""
    with _lock:
        if name not in _targets:
            import jax

            from polynorm.backends.numba import xla

            address = getattr(xla, handler)(*args)
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(address), platform="cpu")
            _targets.add(name)
        return name


def compiled_target(x_dtype: str, y_dtype: str, compute_dtype: str, has_bias: bool) -> str:
    """The FFI target of :mod:`polynorm.backends.numba.xla`'s compiled plain forward for
    these dtypes."""
    key = (x_dtype, y_dtype, compute_dtype, has_bias)
    return _compiled("polynorm_forward_" + "_".join(map(str, key)), "handler", *key)


def compiled_rstd_target(x_dtype: str, compute_dtype: str) -> str:
    """The FFI target of :func:`polynorm.backends.numba.xla.rstd_handler` for these dtypes."""
    return _compiled(f"polynorm_rstd_{x_dtype}_{compute_dtype}", "rstd_handler", x_dtype,
                     compute_dtype)


def compiled_row_stats_target(dtype: str) -> str:
    """The FFI target of :func:`polynorm.backends.numba.xla.row_stats_handler` for ``dtype``."""
    return _compiled(f"polynorm_row_stats_{dtype}", "row_stats_handler", dtype)


def compiled_reference_rstd_target(dtype: str) -> str:
    """The FFI target of :func:`polynorm.backends.numba.xla.reference_rstd_handler` for
    ``dtype``."""
    return _compiled(f"polynorm_reference_rstd_{dtype}", "reference_rstd_handler", dtype)


def compiled_scale_target(x_dtype: str, compute_dtype: str, has_weight: bool) -> str:
    """The FFI target of :func:`polynorm.backends.numba.xla.scale_handler`."""
    key = (x_dtype, compute_dtype, has_weight)
    return _compiled("polynorm_scale_" + "_".join(map(str, key)), "scale_handler", *key)


def compiled_row_dot_target(dy_dtype: str, x_dtype: str, compute_dtype: str,
                            has_scale: bool) -> str:
    """The FFI target of :func:`polynorm.backends.numba.xla.row_dot_handler`."""
    key = (dy_dtype, x_dtype, compute_dtype, has_scale)
    return _compiled("polynorm_row_dot_" + "_".join(map(str, key)), "row_dot_handler", *key)


def compiled_huge_page_target() -> str:
    """The FFI target of :func:`polynorm.backends.numba.xla.huge_page_handler`."""
    return _compiled("polynorm_huge_pages", "huge_page_handler")


def compiled_row_sum_target(dtype: str, square: bool) -> str:
    """The FFI target of :func:`polynorm.backends.numba.xla.row_sum_handler` for ``dtype``
    (of squares where ``square``)."""
    return _compiled(f"polynorm_row_sum{'sq' if square else ''}_{dtype}", "row_sum_handler",
                     dtype, square)


def compiled_backward_target(x_dtype: str, dy_dtype: str, compute_dtype: str,
                             weight_dtype: str | None, bias_dtype: str | None) -> str:
    """The FFI target of :func:`polynorm.backends.numba.xla.backward_handler` for these
    dtypes (None: no weight, no bias)."""
    key = (x_dtype, dy_dtype, compute_dtype, weight_dtype, bias_dtype)
    return _compiled("polynorm_backward_" + "_".join(map(str, key)), "backward_handler", *key)
