"""The front end's fast path: numpy arrays and torch CPU tensors, straight to Numba.

Plain numpy arrays (and torch CPU tensors, as zero-copy numpy views),
``axis=-1`` and ``backend="auto"`` skip the array-API namespace machinery
(~10 us of a (1, 4096) call) and go to the Numba backend with the cached
:class:`~polynorm.core.options.Plan`.  Only the valid, simple case is handled
here: anything unusual -- another axis, a non-float dtype, a wrong shape, bad
options, zero tokens -- returns ``None`` and the general path of
:mod:`polynorm.ops.norm` runs, so that every check and every error message stays
the general path's own.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from polynorm import backends as _backends
from polynorm.core import interop as _interop
from polynorm.core.memory import check_out_memory, partly_written, plain_out_ok
from polynorm.core.options import Options, Plan, make_plan, promote

__all__ = ["numba_module", "forward", "backward", "inplace", "prepared"]

_NAMES: dict[Any, str] = {}  # numpy dtype -> float dtype name
_MODULE: list = []  # the numba backend module once it has loaded


def _names() -> dict[Any, str]:
    # bfloat16 only once ml_dtypes is imported (by the caller: an array of it
    # cannot exist before); its import is slow, and a float32 call needs none
    if not _NAMES:
        for name in ("float16", "float32", "float64"):
            _NAMES[np.dtype(name)] = name
    ml_dtypes = sys.modules.get("ml_dtypes")
    if ml_dtypes is not None:
        _NAMES[np.dtype(ml_dtypes.bfloat16)] = "bfloat16"
    return _NAMES


def numba_module(opts: Options):
    """The numba backend module if a call with ``opts`` may take the fast path, else None."""
    backend, axis = opts.backend, opts.axis
    if backend.__class__ is not str or backend != "auto" or axis.__class__ is not int or axis != -1:
        return None
    if _MODULE:
        return _MODULE[0]
    if not _backends.usable("numba"):
        return None
    _MODULE.append(_backends.get("numba"))
    return _MODULE[0]


def _plan(d: int, dtype: str, opts: Options) -> Plan | None:
    if opts.group_size is not None:
        return None  # the general path runs the groups (ops.norm._grouped_forward)
    try:
        plan = make_plan(d, dtype, opts)
    except (TypeError, ValueError):
        return None  # the general path raises it, in its own order
    if plan.cast_none:
        return None  # the general path chooses the backend that has it (ops.norm._none_backend)
    return plan


def _apart(plan: Plan, residual, opts: Options) -> bool:
    """A call the general path takes: a fused add run apart (``norm_input="sum"``, a
    ``residual_dtype``), or a ``residual_dtype`` without a residual (its error)."""
    return opts.residual_dtype is not None or (residual is not None and plan.norm_sum)


def _one_pass(mod, plan: Plan, opts: Options):
    """``forward(x, r, w, b, plan, out)`` of a fused add with a non-default
    ``norm_input``/``residual_dtype`` in Numba's one pass (``forward_apart``), or
    None where that takes the general path's add apart."""
    from polynorm.core.options import compute_dtype, split_dtypes

    sdt, ndt = split_dtypes(plan.norm_dtype, plan.h_dtype, plan.norm_sum)
    if sdt != compute_dtype(plan.norm_dtype):
        return None
    plan_s = _plan(plan.d, ndt, opts._replace(out_dtype=plan.out_dtype, norm_input="h",
                                             residual_dtype=None))
    if plan_s is None:
        return None

    def forward(x, r, w, b, plan, out):
        return mod.forward_apart(x, r, w, b, plan, plan_s, out)

    return forward


def _all_numpy_or_none(a, b, c, e) -> bool:
    # spelled out: a generator over the arguments costs ~0.3 us of a (1, 4096) call
    nd = np.ndarray
    return ((a is None or type(a) is nd) and (b is None or type(b) is nd)
            and (c is None or type(c) is nd) and (e is None or type(e) is nd))


def _vector_ok(a, d: int, names: dict) -> bool:
    """weight/bias the fast path can take: absent, or shape (d,) with a float dtype."""
    return a is None or (a.ndim == 1 and a.shape[0] == d and a.dtype in names)


def _rows(x, weight, bias, a, b) -> tuple | None:
    """``(names, dtype name, d, n, two_d)`` of a numpy ``x`` of ``n`` tokens of
    ``d`` that the fast path takes, with weight/bias fit for it and the other
    arrays ``a``, ``b`` numpy or absent; else None."""
    if x.ndim == 0 or not _all_numpy_or_none(weight, bias, a, b):
        return None
    names = _NAMES if len(_NAMES) == 4 else _names()
    shape = x.shape
    d = shape[-1]
    dtype = names.get(x.dtype)
    if dtype is None or d == 0:
        return None
    if not (_vector_ok(weight, d, names) and _vector_ok(bias, d, names)):
        return None
    two_d = len(shape) == 2
    n = shape[0] if two_d else x.size // d
    if n == 0:
        return None
    return names, dtype, d, n, two_d


# --------------------------------------------------------------------------- decode calls
# A serving loop calls with the same shapes, dtypes, strides and options every
# time.  Per such call signature the first call works out the kernel and its
# constant arguments (``decode_plan`` of the numba backend); later calls look the signature up and
# do only what depends on the arrays' contents and memory: the outputs, the
# 16-bit weight's widening, the writability and overlap checks.  What the
# signature cannot prove (a read-only or overlapping array, options of
# inexact types) takes the path below, which raises as the general path does.

#: call signature -> the backend's prepared call, or None where the path below runs
_DECODE: dict[tuple, Any] = {}
#: signatures kept at most (a process that calls with ever new shapes clears it)
DECODE_MAX = 512
_EXACT = (float, int)


#: the last Options object found exact (held: its identity stays its own)
_EXACT_LAST: list = [None]


def _exact(opts: Options) -> bool:
    """Options of exact scalar types (:func:`~polynorm.core.options.make_plan`'s own test):
    only those may be matched by value; ``True == 1`` and ``Decimal(1) == 1`` must
    not find an entry made for ``1``."""
    if opts is _EXACT_LAST[0]:
        return True  # an Options is immutable: the same object, the same types
    if _exact_types(opts):
        _EXACT_LAST[0] = opts
        return True
    return False


def _exact_types(opts: Options) -> bool:
    # the decode entries know nothing of norm_input / residual_dtype (the add apart, or
    # residual_dtype's error without a residual): only their defaults take them
    out_dtype = opts.out_dtype
    return (opts.norm_input.__class__ is str and opts.norm_input == "h"
            and opts.residual_dtype is None
            and opts.eps.__class__ in _EXACT and opts.partial.__class__ in _EXACT
            and (opts.partial_size is None or opts.partial_size.__class__ is int)
            and opts.offset.__class__ in _EXACT and opts.eps_mode.__class__ is str
            and opts.casting.__class__ is str and (out_dtype is None or out_dtype.__class__ is str))


def _decode_entry(mod, x, residual, weight, bias, out, opts: Options):
    """The backend's prepared call (``mod.decode_plan``) of a call signature, or None
    where the signature is not one the decode path serves."""
    if x.ndim != 2 or not _exact(opts):
        return None
    head = _rows(x, weight, bias, residual, out)
    if head is None:
        return None
    names, dtype, d, n, _ = head
    if n * d >= mod.SERIAL_MAX_ELEMENTS:
        return None  # parallel and streamed launches: the general fast path
    if residual is None and d > 1 and x.strides[1] != x.itemsize:
        return None  # copied to unit columns first: the general fast path
    for a in (weight, bias):
        if a is not None and a.strides[0] != a.itemsize and d > 1:
            return None  # copied to one layout: the general fast path
    if residual is not None:
        rdt = names.get(residual.dtype)
        if rdt is None or residual.shape != x.shape:
            return None
        dtype = promote(dtype, rdt)
    plan = _plan(d, dtype, opts)
    if plan is None or plan.llama:
        return None
    if out is not None and (out.shape != x.shape or names.get(out.dtype) != plan.out_dtype):
        return None
    return mod.decode_plan(plan, x, residual, weight, bias)


def _decode_forward(mod, x, residual, weight, bias, out, return_rstd, opts, fused):
    """A numpy forward through its call signature's prepared call, or None."""
    if bias is None and residual is None:
        # the usual decode call, its key flat (no nested tuples to build); an absent
        # array is one None, never a shape, so no two signatures share a key
        if out is None:
            key = (opts, x.shape, x.strides, x.dtype, None if weight is None else weight.shape,
                   None if weight is None else weight.strides,
                   None if weight is None else weight.dtype)
        else:
            key = (opts, x.shape, x.strides, x.dtype, None if weight is None else weight.shape,
                   None if weight is None else weight.strides,
                   None if weight is None else weight.dtype, out.shape, out.strides, out.dtype)
    else:
        key = (opts, x.shape, x.strides, x.dtype,
               None if weight is None else (weight.shape, weight.strides, weight.dtype),
               None if bias is None else (bias.shape, bias.strides, bias.dtype),
               None if residual is None else (residual.shape, residual.strides, residual.dtype),
               None if out is None else (out.shape, out.strides, out.dtype))
    try:
        e = _DECODE[key]
    except KeyError:
        if len(_DECODE) >= DECODE_MAX:
            _DECODE.clear()
        e = _DECODE[key] = _decode_entry(mod, x, residual, weight, bias, out, opts)
    except TypeError:  # an unhashable option: the general path says what is wrong
        return None
    if e is None or (opts is not _EXACT_LAST[0] and not _exact(opts)):
        return None
    if out is not None and not plain_out_ok(out, x, residual, weight, bias):
        return None  # overlap, a read-only out...: the checks below
    lean = e.lean
    if lean is not None:
        try:
            r = lean(x, weight, out, return_rstd)
        except Exception as exc:
            if out is None:
                raise
            raise partly_written(exc) from exc
        if r is not None:
            return r
    try:
        y, h, rstd = mod.forward_decode(e, x, residual, weight, bias, out)
    except Exception as exc:
        if out is None:
            raise
        raise partly_written(exc) from exc
    if fused:
        return (y, h, rstd) if return_rstd else (y, h)
    return (y, rstd) if return_rstd else y


def _inplace_entry(mod, x, residual, weight, opts: Options):
    """The backend's prepared in-place fused add (``mod.decode_into_plan``) of a call
    signature, or None where ``polynorm.ops.norm._inplace_fast``'s own checks decide."""
    if (x.ndim != 2 or residual.shape != x.shape or residual.dtype != x.dtype
            or residual.strides != x.strides or not x.flags.c_contiguous
            or not x.dtype.isnative or not _exact(opts)):
        return None
    head = _rows(x, weight, None, None, None)
    if head is None:
        return None
    _, dtype, d, n, _ = head
    if n * d >= mod.SERIAL_MAX_ELEMENTS:
        return None
    if weight is not None and d > 1 and weight.strides[0] != weight.itemsize:
        return None
    plan = _plan(d, dtype, opts)
    if (plan is None or plan.llama or plan.norm_sum or plan.h_dtype != plan.norm_dtype
            or plan.out_dtype != dtype):
        return None
    return mod.decode_into_plan(plan, x, weight)


def inplace(mod, x, residual, weight, bias, opts: Options) -> bool:
    """``add_rms_norm_`` of numpy arrays at decode size through the call signature's
    prepared entry (as :func:`forward`'s decode calls): True where done, False
    where ``polynorm.ops.norm._inplace_fast`` takes the call, with its checks."""
    if (bias is not None or type(residual) is not np.ndarray
            or (weight is not None and type(weight) is not np.ndarray)):
        return False
    key = ("inplace", opts, x.shape, x.strides, x.dtype, residual.shape, residual.strides,
           residual.dtype, None if weight is None else weight.shape,
           None if weight is None else weight.strides, None if weight is None else weight.dtype)
    try:
        e = _DECODE[key]
    except KeyError:
        if len(_DECODE) >= DECODE_MAX:
            _DECODE.clear()
        e = _DECODE[key] = _inplace_entry(mod, x, residual, weight, opts)
    except TypeError:
        return False
    if e is None or (opts is not _EXACT_LAST[0] and not _exact(opts)):
        return False
    # writable, and nothing can overlap: x and residual two arrays owning their memory
    # (plain_out_ok's test), the weight too
    if (x is residual or x.base is not None or residual.base is not None
            or not x.flags.writeable or not residual.flags.writeable
            or (weight is not None and weight.base is not None)):
        return False
    mod.forward_into_decode(e, x, residual, weight)
    return True


def prepared(x, weight, out, return_rstd: bool, opts: Options):
    """``rms_norm(x, weight, out=out)`` of a numpy ``x`` whose call signature already has
    its lean call (:func:`_decode_forward` made it), or None: :func:`forward` then
    runs, and prepares it.  ``rms_norm``'s first step: a decode loop's call skips the
    front end's dispatch, from the options to the backend module."""
    if type(weight) is not np.ndarray:
        return None  # absent (no lean call), or another array type
    if out is None:
        key = (opts, x.shape, x.strides, x.dtype, weight.shape, weight.strides, weight.dtype)
    elif type(out) is np.ndarray:
        key = (opts, x.shape, x.strides, x.dtype, weight.shape, weight.strides, weight.dtype,
               out.shape, out.strides, out.dtype)
    else:
        return None
    try:
        e = _DECODE.get(key)
    except TypeError:  # an unhashable option: the general path says what is wrong
        return None
    if e is None or (opts is not _EXACT_LAST[0] and not _exact(opts)):
        return None
    lean = e.lean
    if lean is None or (out is not None and not plain_out_ok(out, x, None, weight, None)):
        return None
    try:
        return lean(x, weight, out, return_rstd)
    except Exception as exc:
        if out is None:
            raise
        raise partly_written(exc) from exc


def forward(mod, x, residual, weight, bias, out, return_rstd: bool, opts: Options, fused: bool):
    """``rms_norm``/``add_rms_norm`` on numpy arrays, or None for the general path."""
    if type(x) is np.ndarray and (
            (weight is None or type(weight) is np.ndarray) and (bias is None or type(bias) is np.ndarray)
            and (residual is None or type(residual) is np.ndarray)
            and (out is None or type(out) is np.ndarray)):
        r = _decode_forward(mod, x, residual, weight, bias, out, return_rstd, opts, fused)
        if r is not None:
            return r
    if type(x) is not np.ndarray:
        # torch CPU tensors: the same path on zero-copy numpy views (polynorm.core.interop)
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
        r = forward(mod, *views, return_rstd, opts, fused)
        if r is None:
            return None
        r = [_interop.torch_from_host(a) for a in ((r,) if type(r) is np.ndarray else r)]
        if out is not None:
            r[0] = out
        return r[0] if len(r) == 1 else tuple(r)
    head = _rows(x, weight, bias, residual, out)
    if head is None:
        return None
    names, dtype, d, n, two_d = head
    shape = x.shape
    if residual is not None:
        rdt = names.get(residual.dtype)
        if rdt is None or residual.shape != shape:
            return None
        dtype = promote(dtype, rdt)
    plan = _plan(d, dtype, opts)
    if plan is None:
        return None
    forward_rows = mod.forward
    if _apart(plan, residual, opts):
        if residual is None or plan.llama:
            return None  # the general path's error, or its add apart
        forward_rows = _one_pass(mod, plan, opts)
        if forward_rows is None:
            return None
    if out is not None and (
        not two_d or out.shape != shape or names.get(out.dtype) != plan.out_dtype
    ):
        return None
    if out is not None and not plain_out_ok(out, x, residual, weight, bias):
        check_out_memory(out, (x, residual, weight, bias), ("x", "residual", "weight", "bias"))
    if (two_d and residual is None and out is None and n * d < mod.SERIAL_MAX_ELEMENTS
            and not plan.llama):
        y, rstd = mod.forward_small(x, weight, bias, plan)
        return (y, rstd) if return_rstd else y
    if two_d:
        try:
            y, h, rstd = forward_rows(x, residual, weight, bias, plan, out)
        except Exception as exc:
            if out is None:
                raise
            raise partly_written(exc) from exc
    else:
        r2 = None if residual is None else residual.reshape(n, d)
        y, h, rstd = forward_rows(x.reshape(n, d), r2, weight, bias, plan, None)
        y = y.reshape(shape)
        h = None if h is None else h.reshape(shape)
        rstd = rstd.reshape(shape[:-1])
    if out is not None:
        y = out
    if fused:
        return (y, h, rstd) if return_rstd else (y, h)
    return (y, rstd) if return_rstd else y


def backward(mod, dy, x, weight, bias, rstd, grad_residual, opts: Options):
    """``rms_norm_backward`` on numpy arrays, or None for the general path."""
    if type(x) is not np.ndarray and type(x).__module__ == "torch" and x.ndim != 0:
        views = _interop.torch_host_views((dy, x, weight, bias, rstd, grad_residual))
        if views is None:
            return None
        r = backward(mod, *views, opts)
        return None if r is None else tuple(_interop.torch_from_host(a) for a in r)
    if type(x) is not np.ndarray or type(dy) is not np.ndarray:
        return None
    if x.ndim == 2:
        r = _decode_backward(mod, dy, x, weight, bias, rstd, grad_residual, opts)
        if r is not None:
            return r
    return _backward(mod, dy, x, weight, bias, rstd, grad_residual, opts)


def _backward_plan(dy, x, weight, bias, rstd, grad_residual, opts: Options):
    """``(plan, n, d, two_d)`` of a numpy backward the fast path takes, else None."""
    head = _rows(x, weight, bias, rstd, grad_residual)
    if head is None:
        return None
    names, dtype, d, n, two_d = head
    shape = x.shape
    if dy.shape != shape or dy.dtype not in names:
        return None
    if grad_residual is not None and (
        grad_residual.shape != shape or grad_residual.dtype not in names
    ):
        return None
    plan = _plan(d, dtype, opts)
    if plan is None:
        return None
    if rstd is not None and (rstd.shape != shape[:-1] or names.get(rstd.dtype) != plan.rstd_dtype):
        return None
    return plan, n, d, two_d


def _decode_backward_entry(mod, dy, x, weight, bias, rstd, grad_residual, opts):
    if not _exact(opts) or not _all_numpy_or_none(dy, grad_residual, None, None):
        return None
    got = _backward_plan(dy, x, weight, bias, rstd, grad_residual, opts)
    if got is None:
        return None
    plan, n, d, _ = got
    for a in (dy, x, grad_residual):
        if a is not None and d > 1 and a.strides[1] != a.itemsize:
            return None  # copied to unit columns: the general entry
    if weight is not None and d > 1 and weight.strides[0] != weight.itemsize:
        return None
    return mod.decode_backward_plan(plan, x, weight, bias, rstd)


def _decode_backward(mod, dy, x, weight, bias, rstd, grad_residual, opts):
    """A numpy backward through its call signature's prepared constants, or None."""
    key = ("bwd", opts, x.shape, x.strides, x.dtype, dy.shape, dy.strides, dy.dtype,
           None if weight is None else (weight.shape, weight.strides, weight.dtype),
           None if bias is None else (bias.shape, bias.strides, bias.dtype),
           None if rstd is None else (rstd.shape, rstd.strides, rstd.dtype),
           None if grad_residual is None else (grad_residual.shape, grad_residual.strides,
                                               grad_residual.dtype))
    try:
        e = _DECODE[key]
    except KeyError:
        if len(_DECODE) >= DECODE_MAX:
            _DECODE.clear()
        e = _DECODE[key] = _decode_backward_entry(mod, dy, x, weight, bias, rstd,
                                                  grad_residual, opts)
    except TypeError:
        return None
    if e is None or not _exact(opts):
        return None
    return mod.backward_decode(e, dy, x, weight, bias, rstd, grad_residual)


def _backward(mod, dy, x, weight, bias, rstd, grad_residual, opts: Options):
    got = _backward_plan(dy, x, weight, bias, rstd, grad_residual, opts)
    if got is None:
        return None
    plan, n, d, two_d = got
    if two_d:
        return mod.backward(dy, x, weight, bias, rstd, grad_residual, plan)
    shape = x.shape
    gr = None if grad_residual is None else grad_residual.reshape(n, d)
    r1 = None if rstd is None else rstd.reshape(n)
    dx, dw, db = mod.backward(dy.reshape(n, d), x.reshape(n, d), weight, bias, r1, gr, plan)
    return dx.reshape(shape), dw, db


# --------------------------------------------------------------------------- per-head weights
# weight/bias of shape x.shape[-m:] with m >= 2 (QuACK's (H, D) weight): a contiguous
# numpy x (or a torch CPU tensor's view) as (t * heads, d) rows, one call of the
# backend's forward_heads (row i takes weight row i % heads).  Anything else -- out=,
# strided arrays, options the kernels do not take -- returns None: the general
# path (ops.norm.forward_heads) runs, with its checks and errors.


def forward_heads(mod, x, residual, weight, bias, return_rstd: bool, opts: Options,
                  fused: bool):
    """Per-head ``rms_norm``/``add_rms_norm`` on numpy arrays or torch CPU tensors in
    one kernel call, or None for the general path."""
    if type(x) is not np.ndarray:
        if type(x).__module__ != "torch" or x.ndim == 0:
            return None
        views = _interop.torch_host_views((x, residual, weight, bias))
        if views is None:
            return None
        r = forward_heads(mod, *views, return_rstd, opts, fused)
        if r is None:
            return None
        if type(r) is np.ndarray:
            return _interop.torch_from_host(r)
        return tuple(_interop.torch_from_host(a) for a in r)
    if not _all_numpy_or_none(weight, bias, residual, None):
        return None
    wide = weight if weight is not None else bias
    if wide is None or wide.ndim < 2 or wide.ndim > x.ndim or not x.flags.c_contiguous:
        return None
    shape, wshape = x.shape, wide.shape
    if shape[x.ndim - wide.ndim:] != wshape or x.size == 0:
        return None
    names = _NAMES if len(_NAMES) == 4 else _names()
    dtype = names.get(x.dtype)
    if dtype is None:
        return None
    for a in (weight, bias):
        if a is not None and (a.shape != wshape or a.dtype not in names):
            return None
    d = shape[-1]
    n = x.size // d
    if residual is not None:
        rdt = names.get(residual.dtype)
        if rdt is None or residual.shape != shape or not residual.flags.c_contiguous:
            return None
        dtype = promote(dtype, rdt)
    plan = _plan(d, dtype, opts)
    if plan is None or plan.llama or _apart(plan, residual, opts):
        return None
    heads = wide.size // d
    w2 = None if weight is None else weight.reshape(heads, d)
    b2 = None if bias is None else bias.reshape(heads, d)
    r2 = None if residual is None else residual.reshape(n, d)
    if n * d < mod.SERIAL_MAX_ELEMENTS:
        done = mod.forward_heads_small(x.reshape(n, d), r2, w2, b2, plan)
    else:
        done = mod.forward_heads(x.reshape(n, d), r2, w2, b2, plan, None)
    if done is None:
        return None
    y, h, rstd = done
    y = y.reshape(shape)
    rstd = rstd.reshape(shape[:-1])
    if fused:
        h = h.reshape(shape)
        return (y, h, rstd) if return_rstd else (y, h)
    return (y, rstd) if return_rstd else y
