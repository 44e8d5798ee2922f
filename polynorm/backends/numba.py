"""Numba CPU backend: parallel kernels over tokens for host arrays.

Takes anything :mod:`polynorm._interop` can view as a numpy array without a
copy (numpy; torch/jax CPU tensors through DLPack) and returns results in
the caller's array type.  float16 and bfloat16 data are handed to the
kernels as ``uint16`` views and converted in registers
(:mod:`polynorm.backends._numba_codec`).

Small work runs in a serial kernel: a parallel launch costs more than it
saves below :data:`SERIAL_MAX_ELEMENTS` elements (measured with
``python -m polynorm._bench.cpu --threshold``; see the module docstring of
:mod:`polynorm._bench.cpu`).  Parallel launches are serialised by a lock,
because Numba's ``workqueue`` threading layer must not be entered from two
threads at once; the serial kernels release the GIL and need no lock.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .. import _interop
from .._options import Plan

name = "numba"

#: Below this many elements (tokens x d) one thread does the work.
SERIAL_MAX_ELEMENTS = 1 << 15

#: Target number of row blocks for the dweight/dbias partial sums, and a cap on
#: the float64 scratch they take (elements); both depend on (n, d) only, never
#: on the thread count, which keeps the reduction order fixed.
_BWD_BLOCKS = 256
_BWD_SCRATCH = 1 << 22

_CODE = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
_launch_lock = threading.Lock()
_kernels = None  # the compiled-kernel module, imported on first use
_np_dtypes: dict[str, np.dtype] = {}


def available() -> tuple[bool, str]:
    try:
        import numba  # noqa: F401
    except ImportError as exc:
        return False, f"numba is not installed ({exc})"
    return True, "ok"


def accepts(x: Any) -> bool:
    return _interop.is_host_array(x)


def _k():
    global _kernels
    if _kernels is None:
        from . import _numba_kernels

        _kernels = _numba_kernels
    return _kernels


def _np_dtype(dtype_name: str) -> np.dtype:
    dt = _np_dtypes.get(dtype_name)
    if dt is None:
        if dtype_name == "bfloat16":
            import ml_dtypes

            dt = np.dtype(ml_dtypes.bfloat16)
        else:
            dt = np.dtype(dtype_name)
        _np_dtypes[dtype_name] = dt
    return dt


_DUMMY2 = np.zeros((1, 1), np.float32)
_DUMMY1 = np.zeros(1, np.float32)


def _is_bf16(a: np.ndarray) -> bool:
    return a.dtype.itemsize == 2 and a.dtype != np.float16


def _view16(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def _parallel(n: int, d: int) -> bool:
    if n < 2 or n * d < SERIAL_MAX_ELEMENTS:
        return False
    import numba

    return numba.get_num_threads() > 1


def _base_flags(plan: Plan, weight: np.ndarray | None) -> int:
    K = _k()
    flags = K.EPS_INSIDE if plan.eps_inside else 0
    if plan.llama:
        wcode = _CODE[_dtype_name(weight)] if weight is not None else 3
        from .._options import promote

        pcode = _CODE[promote(plan.x_dtype, _dtype_name(weight))] if weight is not None else 3
        flags |= K.LLAMA
        flags |= _CODE[plan.x_dtype] << K.XCODE_SHIFT
        flags |= wcode << K.WCODE_SHIFT
        flags |= pcode << K.PCODE_SHIFT
    return flags


def _dtype_name(a: np.ndarray) -> str:
    return "bfloat16" if _is_bf16(a) else a.dtype.name


def forward(x, residual, weight, bias, plan: Plan, out=None):
    """Forward on 2-D rows; see :mod:`polynorm.backends.reference` for the contract.

    ``out`` (an ``(n, d)`` array of ``plan.out_dtype``, possibly ``x``
    itself) receives ``y`` in place; then no token-sized array is allocated
    besides ``h`` for the fused add.
    """
    K = _k()
    like = x
    x = _interop.to_numpy(x)
    n, d = x.shape
    flags = _base_flags(plan, _interop.to_numpy(weight))
    y = _interop.to_numpy(out) if out is not None else np.empty((n, d), _np_dtype(plan.out_dtype))
    rstd = np.empty(n, _np_dtype(plan.compute_dtype))
    h = None
    r = _DUMMY2
    hk = _DUMMY2
    if residual is not None:
        rn = _interop.to_numpy(residual)
        h = np.empty((n, d), _np_dtype(plan.x_dtype))
        flags |= K.HAS_R | (K.BF_R if _is_bf16(rn) else 0) | (K.BF_H if _is_bf16(h) else 0)
        r = _view16(rn)
        hk = _view16(h)
    w = _DUMMY1
    if weight is not None:
        wn = _interop.to_numpy(weight)
        flags |= K.HAS_W | (K.BF_W if _is_bf16(wn) else 0)
        w = _view16(wn)
    b = _DUMMY1
    if bias is not None:
        bn = _interop.to_numpy(bias)
        flags |= K.HAS_B | (K.BF_B if _is_bf16(bn) else 0)
        b = _view16(bn)
    if _is_bf16(x):
        flags |= K.BF_X
    if _is_bf16(y):
        flags |= K.BF_Y
    args = (_view16(x), r, w, b, _view16(y), hk, rstd, flags, plan.k, plan.eps, plan.offset)
    if _parallel(n, d):
        with _launch_lock:
            K.forward_parallel(*args)
    else:
        K.forward_serial(*args)
    y_out = out if out is not None else _interop.from_numpy(y, like)
    return y_out, _interop.from_numpy(h, like), _interop.from_numpy(rstd, like)


def _blocks(n: int, d: int) -> tuple[int, int]:
    """``(rows per block, number of blocks)`` for the backward: a function of (n, d) only."""
    nblk = max(1, min(_BWD_BLOCKS, n, _BWD_SCRATCH // (2 * d)))
    rows = -(-n // nblk)
    return rows, -(-n // rows)


def backward(dy, x, weight, bias, rstd, grad_residual, plan: Plan):
    """Hand-written backward on 2-D rows (formula in :mod:`polynorm._options`)."""
    K = _k()
    like = x
    xn = _interop.to_numpy(x)
    dyn = _interop.to_numpy(dy)
    n, d = xn.shape
    flags = _base_flags(plan, None) & ~K.LLAMA  # casting does not change the backward
    if _is_bf16(xn):
        flags |= K.BF_X
    if _is_bf16(dyn):
        flags |= K.BF_Y
    w = _DUMMY1
    wn = None
    if weight is not None:
        wn = _interop.to_numpy(weight)
        flags |= K.HAS_W | (K.BF_W if _is_bf16(wn) else 0)
        w = _view16(wn)
    bn = None
    if bias is not None:
        bn = _interop.to_numpy(bias)
        flags |= K.HAS_B | (K.BF_B if _is_bf16(bn) else 0)
    rs = _DUMMY1
    if rstd is not None:
        rs = _interop.to_numpy(rstd)
        flags |= K.HAS_RSTD
    gr = _DUMMY2
    if grad_residual is not None:
        grn = _interop.to_numpy(grad_residual)
        flags |= K.HAS_GR | (K.BF_H if _is_bf16(grn) else 0)
        gr = _view16(grn)
    dx = np.empty((n, d), xn.dtype)
    rows, nblk = _blocks(n, d)
    need_part = weight is not None or bias is not None
    part = np.zeros((nblk, 2 * d)) if need_part else np.empty((nblk, 0))
    par = _parallel(n, d)
    args = (_view16(dyn), _view16(xn), w, rs, gr, _view16(dx), part, rows, flags,
            plan.k, plan.eps, plan.offset)
    if par and nblk > 1:
        with _launch_lock:
            K.backward_parallel(*args)
    else:
        K.backward_serial(*args)
    dw = db = None
    if need_part:
        dw = np.empty(d, wn.dtype) if wn is not None else None
        db = np.empty(d, bn.dtype) if bn is not None else None
        rargs = (part, _DUMMY1 if dw is None else _view16(dw),
                 _DUMMY1 if db is None else _view16(db), flags)
        if par and d >= 4096:
            with _launch_lock:
                K.reduce_parallel(*rargs)
        else:
            K.reduce_serial(*rargs)
    return (_interop.from_numpy(dx, like), _interop.from_numpy(dw, like),
            _interop.from_numpy(db, like))
