"""Memory rules of ``out=``: writable, native byte order, no overlap with an input.

Host arrays (numpy, and torch/jax CPU tensors through zero-copy views) are
checked here, before any kernel runs; device memory is the backend's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polynorm.core import interop as _interop

__all__ = ["check_out_memory", "host_view", "partly_written", "plain_out_ok"]


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same elements: address, shape, strides, item size."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides and a.itemsize == b.itemsize)


def self_overlaps(a: np.ndarray) -> bool:
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


def check_out_memory(out: np.ndarray, inputs: tuple, names: tuple,
                     in_place: tuple = ("x", "residual"), name: str = "out") -> None:
    """``out`` (a numpy view) must be writable, in native byte order, free of
    overlapping elements, and share no memory with an input, except being
    exactly the same elements as one named in ``in_place`` (an in-place call).

    Cheap for the usual calls (a (1, 4096) call is ~3 us): two arrays that
    own their memory are disjoint; else a bounds test per input
    (``numpy.may_share_memory``, ~0.3 us), and the exact test only when the
    bounds overlap.
    """
    flags = out.flags
    if not flags.writeable:
        hint = f" (or {name}=None)" if name.endswith("out") else ""
        raise ValueError(f"{name} is read-only; pass a writable array{hint}")
    if not out.dtype.isnative:
        raise TypeError(
            f"{name} must have the machine's byte order, got dtype {out.dtype.str!r}; "
            f"pass an array of dtype {out.dtype.newbyteorder('=').str!r}"
            + (f" (or {name}=None)" if name.endswith("out") else "")
        )
    if not (flags.c_contiguous or flags.f_contiguous) and self_overlaps(out):
        raise ValueError(
            f"{name}'s elements overlap (strides {out.strides}, e.g. a broadcast view); "
            "pass an array whose elements are distinct"
        )
    owner = out.base is None
    for a, argname in zip(inputs, names, strict=True):
        if a is None or (owner and a is not out and a.base is None):
            continue  # a and out own their memory: two allocations
        if a is out and argname in in_place:
            continue  # in place
        if not np.may_share_memory(out, a):
            continue
        if argname in in_place and same_memory(out, a):
            continue  # in place: allowed
        try:
            shared = np.shares_memory(out, a, max_work=1 << 16)  # type: ignore[arg-type]
        except np.exceptions.TooHardError:
            shared = True
        if shared:
            allowed = "" if argname not in in_place else (
                f" ({name} may be exactly {argname}: the same memory, shape and strides)")
            raise ValueError(f"{name} overlaps {argname}{allowed}; pass a separate array")


def plain_out_ok(out: np.ndarray, x, residual, weight, bias) -> bool:
    """The usual ``out=`` of the fast path, cheaply: a writable, aligned, C-contiguous
    array owning its memory (no self-overlap), ``x`` and ``residual`` are
    ``out`` itself or own theirs, and so do ``weight``/``bias``: nothing
    can overlap.  False sends the call to the full :func:`check_out_memory`.
    The fast path has already matched ``out``'s dtype (native byte order)."""
    flags = out.flags
    return (flags.writeable and flags.c_contiguous and flags.aligned and out.base is None
            and (x is out or x.base is None)
            and (residual is None or residual is out or residual.base is None)
            and (weight is None or weight.base is None)
            and (bias is None or bias.base is None))


def host_view(a: Any) -> np.ndarray | None:
    """A numpy view of a host array (numpy, torch/jax CPU), or None."""
    if a is None or type(a) is np.ndarray:
        return a
    if not _interop.is_host_array(a):
        return None
    try:
        return _interop.to_numpy(a)
    except TypeError:
        return None


def partly_written(exc: BaseException) -> RuntimeError:
    """The error of a kernel that failed after it may have written ``out``."""
    err = RuntimeError(
        f"the kernel failed ({type(exc).__name__}: {exc}); out may be partly written"
    )
    err.__cause__ = exc
    return err


