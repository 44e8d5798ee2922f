"""Zero-copy views between the caller's arrays and a backend's native arrays.

The compiled backends work on numpy arrays (CPU, the Numba kernels) and cupy
arrays (CUDA).  These helpers turn the caller's array into such a view
without copying and wrap results back into the caller's type, so that each
backend module converts in exactly one place.

Host memory: torch CPU tensors through torch's numpy bridge (the same
zero-copy buffer sharing as DLPack, at a third of the per-call cost), jax CPU
arrays through their buffer (read-only views) and results back to jax with
``jax.device_put`` (zero-copy, onto the caller's device).  CUDA memory: DLPack
into cupy.

bfloat16 has no numpy dtype of its own (numpy's DLPack import rejects it); it
travels as an int16 view and is represented by ``ml_dtypes.bfloat16`` arrays,
and the Numba kernels take integer views (``uint16`` bfloat16, ``int16`` float16).  Tensors that require grad are
detached: the views carry no autograd history.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polynorm.core.pool import output_pool


def _lib(a: Any) -> str:
    return type(a).__module__.partition(".")[0]


def is_host_array(a: Any) -> bool:
    """True for arrays in CPU memory that :func:`to_numpy` can view without a copy:
    numpy arrays, torch CPU tensors and (concrete, single-device) jax CPU arrays.

    >>> import numpy as np
    >>> is_host_array(np.zeros(3)), is_host_array([0.0])
    (True, False)
    """
    if type(a) is np.ndarray:
        return True
    lib = _lib(a)
    if lib == "torch":
        import torch

        # the default (strided) layout only; sparse, meta and CUDA tensors are not views,
        # nor the storage-less wrappers of torch.func's transforms (grad, vmap)
        return (isinstance(a, torch.Tensor) and a.device.type == "cpu"
                and a.layout == torch.strided and not is_functorch_wrapped(torch, a))
    if lib in ("jax", "jaxlib"):
        return _is_jax_host(a)
    return False


def is_functorch_wrapped(torch, a: Any) -> bool:
    """Whether torch tensor ``a`` is a torch.func transform's wrapper (grad, vmap): it has
    no storage to view, and ``bool()`` of its values is not allowed.

    >>> import torch
    >>> is_functorch_wrapped(torch, torch.ones(2))
    False
    """
    is_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                         None)
    return is_wrapped is not None and bool(is_wrapped(a))


def is_grad_tracked(torch, a: Any) -> bool:
    """Whether torch tensor ``a`` is being differentiated by torch.func (``grad``, ``vjp``,
    ``jacrev``): then a result without history would be a silent zero gradient.

    >>> import torch
    >>> is_grad_tracked(torch, torch.ones(2))
    False
    """
    is_tracked = getattr(getattr(torch._C, "_functorch", None), "is_gradtrackingtensor", None)
    # grad wraps every argument; those it does not differentiate (argnums) and what is
    # computed from them alone do not require grad
    return is_tracked is not None and bool(is_tracked(a)) and bool(a.requires_grad)


def _is_jax_host(a: Any) -> bool:
    import jax

    # tracers (inside jit/grad) have no buffer; they take the reference path
    if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer):
        return False
    try:
        devs = a.devices()
    except Exception:  # deleted or not yet materialised arrays
        return False
    return len(devs) == 1 and next(iter(devs)).platform == "cpu"


def to_numpy(a: Any) -> np.ndarray | None:
    """A numpy view of a host array (``None`` passes through); never a copy.

    torch tensors are detached first (the view carries no autograd history)
    and bfloat16 comes back as an ``ml_dtypes.bfloat16`` view of the same
    memory.  jax arrays come back read-only.

    >>> import torch
    >>> t = torch.ones(2, 3, dtype=torch.bfloat16, requires_grad=True)
    >>> v = to_numpy(t)
    >>> v.dtype.name, v.ctypes.data == t.data_ptr()
    ('bfloat16', True)
    """
    if a is None or type(a) is np.ndarray:
        return a
    lib = _lib(a)
    if lib == "torch":
        return _torch_to_numpy(a)
    if lib in ("jax", "jaxlib") and _is_jax_host(a):
        # jax CPU arrays export their buffer (read-only); ml_dtypes covers bfloat16
        v = np.asarray(a)
        return v
    raise TypeError(f"cannot view {type(a).__module__}.{type(a).__name__} as a numpy array")


def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    if t.device.type != "cpu":
        raise TypeError(f"cannot view a torch tensor on {t.device} as a numpy array")
    t = t.detach()
    # Tensor.numpy() shares the storage like DLPack does, at a third of the cost
    # per call (it matters for one-token calls); numpy has no bfloat16, so bf16
    # goes through an int16 view and comes back as ml_dtypes.bfloat16.
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bf16())
    return t.numpy()


_BF16: list[np.dtype] = []


def _bf16() -> np.dtype:
    if not _BF16:
        import ml_dtypes

        _BF16.append(np.dtype(ml_dtypes.bfloat16))
    return _BF16[0]


def from_numpy(a: np.ndarray | None, like: Any) -> Any:
    """Wrap numpy result ``a`` into the array type of ``like``.

    torch: a CPU tensor sharing ``a``'s memory (bfloat16 included).  jax: an
    array placed as ``like`` is (``jax.device_put``): on ``like``'s device if
    ``like`` is committed to one (``cpu:1`` as ``cpu:0``), else uncommitted on
    the default device, as a jnp operation places its result; zero-copy when
    ``a`` is 64-byte aligned (see :func:`empty`) and a copy otherwise (jax's
    rule), bfloat16 included.

    >>> import numpy as np, torch
    >>> y = np.arange(3, dtype=np.float32)
    >>> t = from_numpy(y, torch.zeros(1))
    >>> t, t.data_ptr() == y.ctypes.data
    (tensor([0., 1., 2.]), True)
    """
    if a is None or type(like) is np.ndarray:
        return a
    lib = _lib(like)
    if lib == "torch":
        import torch

        if a.dtype == _bf16():
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    if lib in ("jax", "jaxlib"):
        import jax

        # DLPack import would land on the device numbered 0 whatever like's device; a
        # result on another device than its inputs' fails in the next jnp operation
        # or gradient (and device_put takes ml_dtypes' bfloat16 as it is)
        return jax.device_put(a, next(iter(like.devices())) if jax_committed(like) else None)
    raise TypeError(f"cannot wrap a numpy array as {type(like).__module__}.{type(like).__name__}")


def jax_committed(a: Any) -> bool:
    """Whether jax array ``a`` is committed to its devices (``jax.Array.committed``;
    jax versions without the public property have ``_committed``; unknown: True).
    A tracer is not: its placement is the traced program's, which jnp leaves to jit."""
    import jax

    if isinstance(a, jax.core.Tracer):
        return False
    c = getattr(a, "committed", None)
    return bool(getattr(a, "_committed", True) if c is None else c)


#: jax takes host memory without a copy only at this alignment.
ALIGN = 64


def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous numpy array whose data is ``ALIGN``-byte aligned.

    numpy's own allocations are 16-byte aligned; results meant for jax
    (:func:`from_numpy`) avoid a copy when allocated here.

    >>> empty((3, 5), np.float32).ctypes.data % ALIGN
    0
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(nbytes + ALIGN, np.uint8)
    start = -buf.ctypes.data % ALIGN
    return buf[start:start + nbytes].view(dtype).reshape(shape)


# ------------------------------------------------------------------ CUDA arrays (cupy backend)
# cupy has no bfloat16 dtype: bfloat16 data travels as an int16 view of the
# same memory and the kernels get its address; `dtype` names the real dtype.


def is_cuda_array(a: Any) -> bool:
    """True for cupy arrays and torch/jax arrays in CUDA memory.

    >>> import numpy as np
    >>> is_cuda_array(np.zeros(3))
    False
    """
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        return True
    if mod == "torch":
        return getattr(a, "is_cuda", False)
    if mod in ("jax", "jaxlib"):
        try:
            return all(dev.platform in ("gpu", "cuda") for dev in a.devices())
        except Exception:
            return False
    return False


def to_cupy(a: Any) -> Any:
    """A zero-copy cupy view (DLPack) of a CUDA array (``None`` passes through).

    bfloat16 torch tensors come back as int16 views of the same memory; jax
    bfloat16 arrays as an int16 bit-cast made on the device.
    """
    if a is None:
        return None
    import cupy

    if isinstance(a, cupy.ndarray):
        return a
    mod = type(a).__module__.split(".")[0]
    if mod == "torch":
        import torch

        if a.dtype == torch.bfloat16:
            a = a.view(torch.int16)
        return cupy.from_dlpack(a)
    if mod in ("jax", "jaxlib"):
        import jax
        import jax.numpy as jnp

        if a.dtype == jnp.bfloat16:
            a = jax.lax.bitcast_convert_type(a, jnp.int16)
        return cupy.from_dlpack(a)
    raise TypeError(f"cannot view {type(a).__name__} as a cupy array")


def from_cupy(a: Any, like: Any, dtype: str | None = None) -> Any:
    """Wrap cupy result ``a`` into the array type of ``like`` (DLPack, zero-copy
    for cupy and torch).  ``dtype="bfloat16"``: ``a`` holds bfloat16 bits."""
    if a is None or type(a).__module__.split(".", 1)[0] == "torch":
        return a  # the cupy backend's torch-allocated results need no wrapping
    mod = type(like).__module__.split(".")[0]
    if mod == "cupy":
        return _cupy_bfloat16(a) if dtype == "bfloat16" else a
    if mod == "torch":
        import torch

        t = torch.from_dlpack(a)
        return t.view(torch.bfloat16) if dtype == "bfloat16" else t
    if mod in ("jax", "jaxlib"):
        import jax
        import jax.numpy as jnp

        j = jnp.from_dlpack(a)
        return jax.lax.bitcast_convert_type(j, jnp.bfloat16) if dtype == "bfloat16" else j
    raise TypeError(f"cannot wrap a cupy array as {type(like).__name__}")


def _cupy_bfloat16(a: Any) -> Any:
    """bfloat16 bits in an int16 cupy array as a bfloat16 cupy array where cupy has
    the dtype (cupy >= 14, through ml_dtypes), else the int16 array itself."""
    try:
        return a.view(_bf16())
    except (TypeError, ValueError):
        return a


def host_empty(shape: tuple[int, ...], dtype: Any, like: Any) -> np.ndarray:
    """An array from the output pool (:mod:`polynorm.core.pool`), or :func:`empty`
    (64-byte aligned, not pooled) when the result goes back to jax.

    For backends allocating results for :func:`from_numpy`: jax takes only
    aligned host memory without a copy (whether it keeps the numpy array
    alive is jax's business, so jax results are never pooled); a torch
    tensor from ``torch.from_numpy`` holds its array, as the pool needs.

    >>> host_empty((2, 3), np.float32, np.zeros(1)).shape
    (2, 3)
    """
    if _lib(like) in ("jax", "jaxlib"):
        return empty(shape, dtype)
    return output_pool.empty(shape, dtype)


# ------------------------------------------------------------------ the front end's fast path

_TORCH: list[Any] = []  # [torch, {float dtype: None}, strided, Parameter], filled on first use


def torch_host_views(arrays: tuple[Any, ...]) -> list[np.ndarray | None] | None:
    """numpy views of torch CPU float tensors (``None`` kept), or ``None`` if any
    array is something else -- then the generic front end handles the call.

    Lets a (1, 4096) torch call take the front end's numpy fast path: about
    1 us per tensor instead of the array-API machinery's ~10 us.

    >>> import torch
    >>> [v.shape for v in torch_host_views((torch.ones(2, 3), None)) if v is not None]
    [(2, 3)]
    >>> torch_host_views((torch.ones(2), torch.ones(2, dtype=torch.int32))) is None
    True
    """
    if not _TORCH:
        import torch

        floats = dict.fromkeys((torch.float16, torch.bfloat16, torch.float32, torch.float64))
        _TORCH.extend((torch, floats, torch.strided, torch.nn.Parameter))
    torch, floats, strided, param = _TORCH
    views: list[np.ndarray | None] = []
    for a in arrays:
        if a is None:
            views.append(None)
            continue
        # exact types: subclasses (fake/functional tensors under tracing) have no data to view
        if not ((type(a) is torch.Tensor or type(a) is param) and a.is_cpu and a.layout is strided):
            return None
        dt = a.dtype
        if dt not in floats:
            return None
        if a.requires_grad:
            a = a.detach()
        try:
            if dt is torch.bfloat16:
                views.append(a.view(torch.int16).numpy().view(_bf16()))
            else:
                views.append(a.numpy())
        except RuntimeError:  # no storage: a torch.func transform's wrapper (grad, vmap)
            return None
    return views


def torch_from_host(a: np.ndarray | None) -> Any:
    """:func:`from_numpy` for a torch CPU result, minus the dispatch (fast path).

    >>> import numpy as np
    >>> import torch
    >>> torch_from_host(np.zeros(2, np.float16)).dtype
    torch.float16
    """
    if a is None:
        return None
    if not _TORCH:
        torch_host_views(())
    torch = _TORCH[0]
    if a.dtype.itemsize == 2 and a.dtype.char != "e":  # bfloat16 (float16 is "e")
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
