"""RMSNorm and the fused residual add for jax, with polynorm's backward as a ``custom_vjp``.

See :mod:`polynorm.jax` for what runs where (eager arrays, ``jit``, devices).
"""

from __future__ import annotations

import functools
from functools import partial as _partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from polynorm.core.options import NormOptions, Options, make_plan, pack_options, takes_options
from polynorm.jax import ffi as _jax_ffi
from polynorm.ops import lean as _lean
from polynorm.ops import norm as _api

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["rms_norm", "add_rms_norm"]


def _static(opts: Options) -> Options:
    """``opts`` hashable (an axis list as a tuple): custom_vjp's non-differentiable
    arguments are static."""
    axis = opts.axis
    return opts._replace(axis=tuple(axis)) if isinstance(axis, list) else opts


# ------------------------------------------------------------------ where the work runs
# Concrete arrays go to polynorm's front end as they are (CPU: the Numba kernels on
# zero-copy views), small CPU ones of rms_norm's plain forward through a jitted call of
# the compiled kernel call below.  Traced arrays (jit, grad of jit, vmap, scan...) have no
# data yet: rms_norm's plain forward and add_rms_norm's default take the Numba kernels
# through the compiled XLA FFI handlers (polynorm.backends.numba.xla) on a one-CPU-device
# process, where they can the kernels' rstd alone and XLA's elementwise pass; everything
# else takes the pure array-API reference with backend="auto", which XLA compiles and
# fuses like any jnp code, or with backend="numba" the kernels through the Python FFI
# handler (polynorm.jax.ffi).  The table is polynorm.jax's docstring.


def _traced(arrays) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _via_host(static, arrays) -> bool:
    """Whether traced ``arrays`` go to the Numba kernels through a host callback."""
    return static.backend == "numba" and _traced(arrays) and _api._backends.usable(
        "numba")


def _host(fn):
    """``fn`` on numpy views of the callback's (CPU, concrete) arrays: the front end's fast path."""

    def call(*arrays):
        return fn(*(None if a is None else np.asarray(a) for a in arrays))

    return call


def _host_kernel(fn, present: tuple[bool, ...], writes_y: bool):
    """``fn`` as an FFI host function: XLA's buffers in, results written into XLA's buffers."""

    def run(args, rets):
        it = iter(args)
        arrays = [next(it) if p else None for p in present]
        res = fn(*arrays, out=rets[0]) if writes_y else fn(*arrays)
        for r, dst in zip(jax.tree.leaves(res), rets, strict=True):
            if r is not dst:  # y is written in place (out=); the rest is copied in
                np.copyto(dst, r)

    return run


def _dispatch(fn, *arrays):
    """``fn(*arrays)``: directly, or for ``backend="numba"`` under tracing on the host kernels.

    ``fn`` is polynorm's front end with the options bound; on tracers it traces the
    reference, which gives the host call its result shapes and dtypes (and raises the
    front end's errors at trace time).  The host call is an XLA FFI custom call
    (:mod:`polynorm.jax.ffi`: XLA's buffers, no copies but of the results the front
    end cannot write in place), or ``jax.pure_callback`` where jax cannot take it.
    """
    if not _via_host(fn.keywords["static"], arrays):
        return fn(*arrays)
    static = fn.keywords["static"]
    ref = _partial(fn.func, **dict(fn.keywords, static=_with_backend(static)))
    shapes = jax.eval_shape(ref, *arrays)
    # on numpy arrays "auto" is the Numba backend, through the front end's fast path
    fn = _partial(fn.func, **dict(fn.keywords, static=_with_backend(static, "auto")))
    if not _jax_ffi.available():
        # sequential: under vmap one call per batch element (a batched weight/bias or the
        # per-element dweight of the backward needs a call of its own; the kernels take
        # one weight per call)
        return jax.pure_callback(_host(fn), shapes, *arrays, vmap_method="sequential")
    leaves, tree = jax.tree.flatten(shapes)
    present = tuple(a is not None for a in arrays)
    writes_y = fn.func is _forward
    index = _jax_ffi.function_index((fn.func, tuple(fn.keywords.items()), present),
                                    _host_kernel(fn, present, writes_y))
    outs = _jax_ffi.call(index, [a for a in arrays if a is not None], leaves)
    return jax.tree.unflatten(tree, outs)


# ------------------------------------------------------------------ the compiled kernel call
# backend "auto" or "numba" on a CPU process of one device: the plain forward of rms_norm runs the
# Numba kernels through a compiled XLA FFI handler (polynorm.backends.numba.xla), under
# jit and for small eager arrays; the eager call's bits at every size (batch invariance
# holds: a token's bits do not depend on the path's choice, there is one path).


def _one_cpu_device() -> bool:
    """A process whose jax sees one CPU device: several (XLA's host device count flag)
    keep the reference, which XLA partitions; the host call would be gathered."""
    return len(jax.devices("cpu")) == 1


def _kernel_plan(static: Options, x, weight, bias):
    """The Plan of a call that the compiled kernel call takes, else None."""
    if (static.backend not in ("auto", "numba") or static.group_size is not None or x.ndim < 1
            or (weight is not None and weight.shape != x.shape[-1:])
            or (bias is not None and bias.shape != x.shape[-1:])):
        return None
    from polynorm.core.dtypes import dtype_name

    try:
        names = [dtype_name(a.dtype) for a in (x, weight, bias) if a is not None]
        if any(n not in _FLOATS for n in names):
            return None
        if _api._normalize_axis(static.axis, x.ndim) != (x.ndim - 1,) or x.shape[-1] == 0:
            return None
        plan = make_plan(x.shape[-1], names[0], static)
    except (TypeError, ValueError):
        return None  # the general path raises it, with its own message
    if plan.llama or plan.cast_none or not _api._backends.usable("numba"):
        return None
    if not (_jax_ffi.available() and _one_cpu_device()):
        return None
    return plan


_FLOATS = ("float16", "bfloat16", "float32", "float64")

#: x dtypes whose jitted default (backend "auto") is the compiled kernel call (its rstd
#: alone where :func:`_xla_elementwise`): every float dtype.  Not a size rule: a token's
#: bits would then depend on the batch, and the reference's do anyway (its row sums are
#: XLA's, whose order follows the shape).
JIT_KERNEL_DTYPES = _FLOATS


def _kernel_forward(static: Options, plan, x, weight, bias):
    """``(y, rstd)`` of the plain forward: the compiled kernel call on CPU, the
    reference on other platforms (``lax.platform_dependent``: decided at lowering)."""
    from polynorm.backends import numba as _numba

    flags, y_dt, _, cdt = _numba._info(plan)
    d = x.shape[-1]
    offset = 0.0 if weight is None else plan.offset  # as the backend's _affine
    if _xla_elementwise(plan, bias, x.size):
        return _statistic_forward(plan, flags, cdt, offset, x, weight, static)
    target = _jax_ffi.compiled_target(plan.norm_dtype, plan.out_dtype, plan.compute_dtype,
                                      bias is not None)
    call = jax.ffi.ffi_call(
        target, (jax.ShapeDtypeStruct(x.shape, y_dt), jax.ShapeDtypeStruct(x.shape[:-1], cdt)),
        vmap_method="expand_dims")

    def cpu(x, weight, bias):
        w = _numba._ones(d, cdt) if weight is None else weight.astype(cdt)
        ops = (x, w) if bias is None else (x, w, bias.astype(cdt))
        if x.size * np.dtype(y_dt).itemsize >= XLA_ASYNC_MIN_BYTES:  # y's bytes
            ops = (*ops, _counted_flops(x))
        return tuple(call(*ops, a_flags=np.int64(flags), b_k=np.int64(plan.k),
                          c_eps=np.float64(plan.eps), d_offset=np.float64(offset)))

    def other(x, weight, bias):
        if static.backend == "numba":  # the host call, which names the platform it lacks
            return tuple(_dispatch(_partial(_forward, static=static), x, None, weight, bias))
        return tuple(_forward(x, None, weight, bias, static=_with_backend(static)))

    return jax.lax.platform_dependent(x, weight, bias, cpu=cpu, default=other)


#: The smallest ``eps`` of a call whose elementwise pass XLA runs (:func:`_xla_elementwise`):
#: rstd (at most ``1 / sqrt(eps)``, ``1 / eps`` outside) then fits float32, where the
#: kernel would otherwise finish the row in float64 (its ``_fwd_row_wide``).
XLA_PASS_MIN_EPS = 1e-30


#: bfloat16 calls of ``x`` at least this many bytes take the whole kernel call (see
#: :func:`_xla_elementwise`).
BF16_KERNEL_PASS_MIN_BYTES = 32 << 20


def _xla_elementwise(plan, bias, size: int) -> bool:
    """Whether the kernels compute only ``rstd`` and XLA the elementwise pass
    ``y = x * rstd * (weight + offset)``, fused with the program's neighbouring ops,
    for a call of ``size`` elements.

    Calls without bias whose ``y`` has ``x``'s dtype: there the kernel's output pass is
    these two products in the compute dtype, each rounded (no fused multiply-add), and
    one rounding to ``y``'s dtype, which XLA's ops give bit for bit, so the call keeps
    the eager kernels' bits (batch invariance included).  Inside a jitted program the
    custom call's own output pass (and the pass that then reads its ``y``) cost more
    than XLA's fused one (``bench/jax_jit.py``'s graph rows); a jitted call of the norm
    alone costs about the same either way.

    Not bfloat16 from ``BF16_KERNEL_PASS_MIN_BYTES``: from there XLA compiles the jnp
    formula into one YNNPACK fusion, where its loop fusion of the elementwise pass
    converts bfloat16 slower than the kernel's pass does, which then wins the call
    alone and the fused add (1.77x and 1.27x the formula at 4096 x 4096, against the
    statistic's 1.10x and 0.97x; ``python bench/jax_consumers.py --dtype bfloat16``).
    The choice is a matter of speed: both give the eager kernels' bits.
    """
    if plan.norm_dtype == "bfloat16" and 2 * size >= BF16_KERNEL_PASS_MIN_BYTES:
        return False
    return bias is None and _statistic_plan_ok(plan)


def _statistic_plan_ok(plan) -> bool:
    """The plan's output pass is ``y = v * rstd * (weight + offset)`` in the compute dtype,
    rounded once to ``y``'s dtype, which XLA's ops give bit for bit (see
    :func:`_statistic_forward`)."""
    return (plan.out_dtype == plan.norm_dtype and not plan.llama and not plan.cast_none
            and plan.eps >= XLA_PASS_MIN_EPS)


def _statistic_forward(plan, flags, cdt, offset, x, weight, static: Options):
    """``(y, rstd)`` of the plain forward: ``rstd`` from the kernels, ``y`` from XLA, on the
    CPU; the reference on other platforms."""

    def cpu(x, weight):
        return _statistic_y(plan, flags, cdt, offset, x, weight)

    def other(x, weight):
        if static.backend == "numba":  # the host call, which names the platform it lacks
            return tuple(_dispatch(_partial(_forward, static=static), x, None, weight, None))
        return tuple(_forward(x, None, weight, None, static=_with_backend(static)))

    return jax.lax.platform_dependent(x, weight, cpu=cpu, default=other)


def _statistic_y(plan, flags, cdt, offset, v, weight):
    """``(y, rstd)`` of rows ``v`` (the normalized input): ``rstd`` from the kernels
    (:func:`polynorm.backends.numba.xla.rstd_handler`, the forward's bits), ``y`` from
    XLA as the kernels' output pass computes it."""
    call = jax.ffi.ffi_call(_jax_ffi.compiled_rstd_target(plan.norm_dtype, plan.compute_dtype),
                            jax.ShapeDtypeStruct(v.shape[:-1], cdt), vmap_method="expand_dims")
    r = call(v, a_flags=np.int64(flags), b_k=np.int64(plan.k), c_eps=np.float64(plan.eps))
    y = v.astype(cdt) * r[..., None]
    if weight is not None:  # absent: the kernel's ones, and y * (1 + -0.0) is y
        y = y * (weight.astype(cdt) + np.asarray(offset, cdt))
    return _on_huge_pages(y.astype(plan.out_dtype)), r


#: glibc's largest dynamic mmap threshold: XLA's buffers of at least this many bytes are
#: fresh pages on every call, faulted in 4 KiB at a time where nothing asks for more.
FRESH_PAGES_MIN_BYTES = 32 << 20


def _on_huge_pages(y):
    """``y``, its fused pass writing a buffer that asks for huge pages, from
    ``FRESH_PAGES_MIN_BYTES`` on (smaller: ``y`` itself).

    ``select(flag, y, buffer)`` with the buffer and the flag (always 1) from
    :func:`polynorm.backends.numba.xla.huge_page_handler`: XLA gives the fused pass the
    buffer for its output, as it gives any elementwise pass an operand's buffer that
    nothing reads after it, so where ``y`` is the program's output the pass faults in
    one page per 2 MiB instead of one per 4 KiB, the jnp formula's cost (the call
    alone: 1.7x it, where ``y`` otherwise costs it a pass more; ``python
    bench/jax_consumers.py``).  Where XLA fuses ``y`` into a later op the select goes
    with it, and the buffer's untouched pages read as the zero page.  The same bits.
    """
    nbytes = y.size * y.dtype.itemsize
    if nbytes < FRESH_PAGES_MIN_BYTES:
        return y
    call = jax.ffi.ffi_call(_jax_ffi.compiled_huge_page_target(),
                            (jax.ShapeDtypeStruct(y.shape, y.dtype),
                             jax.ShapeDtypeStruct((), jnp.int32)))
    buffer, flag = call(a_bytes=np.int64(nbytes))
    return jax.lax.select(jnp.broadcast_to(flag != 0, y.shape), y, buffer)


def _add_statistic(static: Options, x, residual, weight, bias):
    """``(y, h, rstd)`` of a traced fused add on the CPU that the kernels' statistic takes
    (``h = x + residual`` and ``y`` from XLA, as the fused kernel computes them), else None.

    The jitted reference's row sums are XLA's, whose order follows the array's shape
    (no batch invariance); the kernels' ``rstd`` of ``h`` keeps the eager bits.
    """
    if (bias is not None or residual.shape != x.shape or residual.dtype != x.dtype
            or not _traced((x, residual, weight))):
        return None
    plan = _kernel_plan(static, x, weight, None)
    if plan is None or plan.norm_sum or plan.h_dtype != plan.norm_dtype:
        return None
    if not _statistic_plan_ok(plan):
        return None
    from polynorm.backends import numba as _numba

    flags, _, _, cdt = _numba._info(plan)
    offset = 0.0 if weight is None else plan.offset

    def cpu(x, residual, weight):
        h = _on_huge_pages((x.astype(cdt) + residual.astype(cdt)).astype(plan.norm_dtype))
        y, r = _statistic_y(plan, flags, cdt, offset, h, weight)
        return y, h, r

    def other(x, residual, weight):
        return tuple(_dispatch(_partial(_forward, static=static), x, residual, weight, None))

    return jax.lax.platform_dependent(x, residual, weight, cpu=cpu, default=other)


#: Calls whose ``y`` has at least this many bytes give the custom call an operand that the
#: handler ignores, :func:`_counted_flops`.  XLA's CPU client runs a computation that its
#: cost analysis counts under 1000 flops inline on the caller's thread (a custom call
#: counts -1), and a jitted function of the kernel call alone then gets its output as
#: fresh pages on many calls (page faults on every call, from 64 x 4096 float32 on),
#: where the same call run asynchronously, as XLA runs the jnp formula, reuses the
#: buffer.  Below it, the inline path spares the thread handoff.
XLA_ASYNC_MIN_BYTES = 256 << 10


def _counted_flops(x):
    """A scalar that XLA's cost analysis counts at 1024 flops, which moves the computation
    off the inline path (see ``XLA_ASYNC_MIN_BYTES``); ~1 us on 4 KiB of ``x``."""
    return jnp.sum(x.reshape(-1)[:1024].astype(jnp.float32))


#: Eager jax arrays of fewer bytes than this take the compiled kernel call through a
#: jitted function (jax's dispatch plus ~1 us); larger ones the front end (the kernels on
#: zero-copy views, y from the backend's buffer pool).  From 32 MiB on, glibc's largest
#: dynamic mmap threshold, XLA's output buffer is fresh pages on every call (float32
#: 2048 x 4096: 43 ms jitted vs 17 ms through the front end; bfloat16's 16 MiB: 8 vs 15
#: ms; bench/results/jax-jit-2026-12-06c.json).  The same kernel and bits either way.
EAGER_JIT_MAX_BYTES = FRESH_PAGES_MIN_BYTES


def _eager_kernel_call(opts: Options, x, weight, bias):
    """``y`` of a small eager call on CPU jax arrays through the jitted kernel call, else None.

    The call's signature (options, dtypes, ranks, hidden size) is looked up in
    ``_eager_fns``: its jitted function (None: the front end takes it); a
    repeated call costs that lookup and jax's dispatch (and, where jax has
    devices other than the CPU, the arrays' platform check).
    """
    if bias is None and x.__class__ is _ARRAY_IMPL and (
            weight is None or weight.__class__ is _ARRAY_IMPL):
        return _plain_eager_call(opts, x, weight)
    fn = _eager_kernel_fn(opts, x, weight, bias)
    return None if fn is None else fn(x, weight, bias)


def _eager_kernel_fn(opts: Options, x, weight, bias):
    """The jitted kernel call that :func:`_eager_kernel_call` makes, else None."""
    if not (isinstance(x, jax.Array) and (weight is None or isinstance(weight, jax.Array))
            and (bias is None or isinstance(bias, jax.Array))):
        return None
    shape = x.shape
    if not shape:
        return None
    try:
        key = (opts, x.dtype, len(shape), shape[-1],
               None if weight is None else (weight.dtype, weight.ndim),
               None if bias is None else (bias.dtype, bias.ndim))
        fn = _eager_fns.get(key, _UNSEEN)
    except TypeError:  # an unhashable option (an axis list): the front end
        return None
    if fn is _UNSEEN:
        fn = _eager_fns[key] = _eager_fn(opts, x, weight, bias)
    if fn is None or x.size * x.dtype.itemsize >= EAGER_JIT_MAX_BYTES:
        return None
    if not _cpu_only():
        for a in (x, weight, bias):
            if a is not None and (not a.is_fully_addressable
                                  or next(iter(a.devices())).platform != "cpu"):
                return None
    return fn


@functools.cache
def _cpu_only() -> bool:
    """Whether jax's only devices are the CPU's (then every jax array is on it)."""
    return {d.platform for d in jax.devices()} == {"cpu"} and jax.default_backend() == "cpu"


def _eager_fn(opts: Options, x, weight, bias):
    static = _static(opts)
    if _kernel_plan(static, x, weight, bias) is None:
        return None
    return jax.jit(_partial(_kernel_y, static))


_UNSEEN = object()


def _kernel_y(static, x, weight, bias):
    return _kernel_forward(static, _kernel_plan(static, x, weight, bias), x, weight, bias)[0]


_eager_fns: dict = {}
#: :func:`rms_norm`'s calls on eager CPU jax arrays without bias or ``save``, by options
#: and the avals of ``x`` and ``weight``: their jitted kernel call (None: the front end);
#: a repeated decode call then costs a dict lookup and jax's dispatch.  Only where jax's
#: devices are all CPUs (the avals name no device); cleared past ``_EAGER_PLAIN_MAX``.
_eager_plain: dict = {}
_EAGER_PLAIN_MAX = 1024


def _plain_eager_call(opts: Options, x, weight):
    """``y`` of :func:`rms_norm`'s plain eager call through :data:`_eager_plain`, else None."""
    try:
        key = (opts, x.aval, None if weight is None else weight.aval)
        fn = _eager_plain.get(key, _UNSEEN)
    except TypeError:  # an unhashable option (an axis list): the general path
        return None
    if fn is _UNSEEN:
        if len(_eager_plain) >= _EAGER_PLAIN_MAX:
            _eager_plain.clear()
        fn = _eager_plain[key] = (_eager_kernel_fn(opts, x, weight, None) if _cpu_only()
                                  else None)
    return None if fn is None else fn(x, weight, None)


def _with_backend(static: Options, backend="array_api") -> Options:
    return static._replace(backend=backend)


def _forward(x, residual, weight, bias, *, static, out=None):
    return _api.forward(x, residual, weight, bias, static, out=out, return_rstd=True,
                        fused=residual is not None)


def _backward(dy, x, weight, bias, rstd, grad_residual, *, static):
    return _api.backward(dy, x, weight, bias, rstd, grad_residual,
                         static._replace(out_dtype=None))


# ------------------------------------------------------------------ rms_norm


def _keeps_output(save: str, weight, static: Options, rstd) -> bool:
    """Whether the forward keeps ``y`` for the backward (``save="output"``, polynorm.ops.lean).

    The same answer in the forward and the backward: a concrete weight is read for
    zeros of ``weight + offset`` (then ``x`` is kept); a traced one cannot be, and
    ``y`` is kept (such columns give NaN gradients, as documented at :func:`rms_norm`).
    """
    if save != "output" or static.group_size is not None:
        # x is recovered with one rstd per slice only: grouped calls keep x
        return False
    return (isinstance(weight, jax.core.Tracer)
            or _lean.recoverable(weight, static.offset, rstd.dtype))


def _kept_input(kept, weight, bias, rstd, static: Options, lean: bool):
    if not lean:
        return kept
    axes = _api._normalize_axis(static.axis, kept.ndim)
    return _lean.recover_input(kept, weight, bias, rstd, axes, static.offset)


@_partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rms_norm(static, keep, x, weight, bias):
    return _rms_norm_fwd(static, keep, x, weight, bias)[0]


def _rms_norm_fwd(static, keep, x, weight, bias):
    # concrete arrays (an eager grad's primal computation): the front end, as eager calls
    plan = _kernel_plan(static, x, weight, bias) if _traced((x, weight, bias)) else None
    if plan is not None and static.backend == "auto" and plan.norm_dtype not in JIT_KERNEL_DTYPES:
        plan = None  # the reference, which XLA fuses: see JIT_KERNEL_DTYPES
    if plan is not None:
        y, rstd = _kernel_forward(static, plan, x, weight, bias)
    else:
        y, rstd = _dispatch(_partial(_forward, static=static), x, None, weight, bias)
        if static.backend != "numba" and _traced((x, weight, bias)):
            y = _reference_y(static, x, weight, bias, rstd, y)
    return y, (y if _keeps_output(keep[0], weight, static, rstd) else x, weight, bias, rstd)


#: bfloat16 rows of the jitted reference from this many bytes take its elementwise pass
#: from a compiled call (:func:`_reference_y`), as the kernels take theirs from
#: ``BF16_KERNEL_PASS_MIN_BYTES``
REFERENCE_SCALE_MIN_BYTES = BF16_KERNEL_PASS_MIN_BYTES


def _reference_y(static: Options, x, weight, bias, rstd, y):
    """The jitted reference's ``y``: XLA's (:func:`_reference_pages`), or for bfloat16
    rows from ``REFERENCE_SCALE_MIN_BYTES`` without a bias the same values from
    :func:`polynorm.backends.numba.xla.scale_handler`, given the reference's own ``rstd``
    (XLA then drops its own pass).  There XLA's loop fusion of ``(x * r) * g`` converts
    bfloat16 several times slower than the compiled pass does; the bits are XLA's."""
    plan = None
    if (bias is None and x.dtype == jnp.bfloat16 and y.dtype == jnp.bfloat16
            and x.size * 2 >= REFERENCE_SCALE_MIN_BYTES and rstd.shape == x.shape[:-1]
            and rstd.dtype == jnp.float32):
        plan = _kernel_plan(static._replace(backend="auto"), x, weight, None)
    if plan is None or plan.compute_dtype != "float32":
        return _reference_pages(y)
    call = jax.ffi.ffi_call(
        _jax_ffi.compiled_scale_target("bfloat16", "float32", weight is not None),
        jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")
    # g as the reference's _affine forms it: weight in the compute dtype, plus the offset
    gs = () if weight is None else (weight.astype(jnp.float32) + plan.offset,)
    return jax.lax.platform_dependent(x, rstd, y, *gs,
                                      cpu=lambda x, r, y, *g: call(x, r, *g),
                                      default=lambda x, r, y, *g: y)


def _reference_pages(y):
    """The jitted reference's ``y`` on huge pages from ``FRESH_PAGES_MIN_BYTES``, as the
    kernels' (:func:`_on_huge_pages`), on a CPU process of one device."""
    if (y.size * y.dtype.itemsize < FRESH_PAGES_MIN_BYTES or not _api._backends.usable("numba")
            or not (_jax_ffi.available() and _one_cpu_device())):
        return y
    return jax.lax.platform_dependent(y, cpu=_on_huge_pages, default=lambda y: y)


def _rms_norm_bwd(static, keep, res, dy):
    kept, weight, bias, rstd = res
    lean = _keeps_output(keep[0], weight, static, rstd)
    x = _kept_input(kept, weight, bias, rstd, static, lean)
    # cotangents may arrive as numpy arrays (jax.test_util does that)
    dx, dw, db = _vjp_backward(static, jnp.asarray(dy), x, weight, bias, rstd, None)
    return dx.astype(keep[1]), dw, db


def _vjp_backward(static: Options, dy, x, weight, bias, rstd, grad_residual):
    """``(dx, dweight, dbias)`` of a vjp: :func:`_kernel_backward` where it applies, else
    the front end (or the host kernels, :func:`_dispatch`)."""
    grads = _kernel_backward(static, dy, x, weight, bias, rstd, grad_residual)
    if grads is None:
        grads = _dispatch(_partial(_backward, static=static), dy, x, weight, bias, rstd,
                          grad_residual)
    return grads


def _kernel_backward(static: Options, dy, x, weight, bias, rstd, grad_residual):
    """``(dx, dweight, dbias)`` of a traced backward: the Numba kernels through the
    compiled handler (:func:`polynorm.backends.numba.xla.backward_handler`: the eager
    backward's bits, batch invariance included) on the CPU, the path it replaces on
    other platforms; None where the forward's compiled kernel call does not apply."""
    if (dy is None or not _traced((dy, x, weight, bias, rstd, grad_residual)) or x.size == 0
            or dy.shape != x.shape or dy.dtype != x.dtype or rstd.shape != x.shape[:-1]
            or (grad_residual is not None and (grad_residual.shape != x.shape
                                               or grad_residual.dtype != x.dtype))):
        return None  # the front end's dtype rules for mixed cotangents stay its own
    plan = _kernel_plan(static, x, weight, bias)
    if plan is None:
        return None
    from polynorm.backends import numba as _numba
    from polynorm.backends.numba import xla as _xla

    kernels = _numba._k()
    flags, _, _, cdt = _numba._info(plan)
    flags = (flags & ~kernels.LLAMA) | kernels.HAS_RSTD | (kernels.HAS_B if bias is not None else 0)
    if grad_residual is not None:
        flags |= kernels.HAS_GR
    n, d = x.size // x.shape[-1], x.shape[-1]
    if x.dtype.itemsize >= 4 and x.size * x.dtype.itemsize >= _numba.STREAM_MIN_BYTES:
        flags |= kernels.STREAM_DX  # as the backend's _streams_dx for XLA's aligned buffers
    width = d * ((weight is not None) + (bias is not None))
    m = _xla.backward_level(n, width)
    names = [None if a is None else jnp.dtype(a.dtype).name for a in (weight, bias)]
    target = _jax_ffi.compiled_backward_target(jnp.dtype(x.dtype).name, jnp.dtype(dy.dtype).name,
                                               np.dtype(cdt).name, *names)
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    results += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (weight, bias) if a is not None]
    results.append(jax.ShapeDtypeStruct(
        (_xla.backward_scratch_bytes(n, d, width, m, np.dtype(cdt).name, names[0]),), jnp.uint8))
    call = jax.ffi.ffi_call(target, results, vmap_method="sequential")
    # a 16-bit weight goes as it is: the handler widens it (no convert pass before the call)
    raw_weight = _xla.widens_weight(names[0])

    def cpu(dy, x, weight, bias, rstd, grad_residual):
        if weight is not None and not raw_weight:
            weight = weight.astype(cdt)
        ops = (dy, x, *(() if weight is None else (weight,)), rstd.astype(cdt),
               *(() if grad_residual is None else (grad_residual,)))
        res = iter(call(*ops, a_flags=np.int64(flags), b_k=np.int64(plan.k),
                        c_eps=np.float64(plan.eps), d_offset=np.float64(plan.offset),
                        e_level=np.int64(m)))
        dx = next(res)
        return (dx, None if weight is None else next(res), None if bias is None else next(res))

    def other(dy, x, weight, bias, rstd, grad_residual):
        return tuple(_dispatch(_partial(_backward, static=static), dy, x, weight, bias, rstd,
                               grad_residual))

    return jax.lax.platform_dependent(dy, x, weight, bias, rstd, grad_residual, cpu=cpu,
                                      default=other)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@takes_options()
def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    save: str = "input",
    **options: Unpack[NormOptions],
) -> jax.Array:
    """Differentiable :func:`polynorm.rms_norm` for jax arrays.

    Same arguments and result as :func:`polynorm.rms_norm` (without ``out``
    and ``return_rstd``); the vjp is polynorm's hand-written backward.

    Parameters
    ----------
    x : jax.Array
        Float array (float16, bfloat16, float32, float64).
    weight, bias : jax.Array, optional
        Shape of ``x`` over the normalized axes.
    save : {"input", "output"}
        What the vjp keeps as its residual: ``x``, or ``y`` (which the next
        layer keeps anyway: one activation of ``x``'s size less), from which
        the backward recovers ``x`` (``polynorm.ops.lean``; gradients equal to
        ``y``'s precision).  A concrete weight with a zero in ``weight +
        offset`` keeps ``x``; a traced one (``jit``, ``grad`` over the
        parameters) cannot be checked, and such columns give NaN gradients.
    {options}

    The options are static (not traced).

    Returns
    -------
    jax.Array
        ``y``, with ``x``'s shape and ``out_dtype`` (default ``x``'s).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from polynorm.jax import rms_norm
    >>> x = jnp.array([[3.0, 4.0]], dtype=jnp.float32)
    >>> rms_norm(x, eps=0.0)
    Array([[0.84852815, 1.1313709 ]], dtype=float32)
    >>> jax.grad(lambda x: rms_norm(x, eps=0.0).sum())(x)
    Array([[ 0.04525483, -0.03394116]], dtype=float32)
    """
    opts = pack_options("rms_norm", options)
    if (bias is None and x.__class__ is _ARRAY_IMPL and save == "input"
            and (weight is None or weight.__class__ is _ARRAY_IMPL)):
        y = _plain_eager_call(opts, x, weight)
        if y is not None:
            return y
    _lean.check_save(save)
    if not _traced((x, weight, bias)):
        # concrete arrays: no transformation is differentiating this call, and the
        # custom_vjp machinery would cost ~200 us in eager mode
        # small CPU arrays: the jitted kernel call (EAGER_CALLS, registered below)
        return _api.forward(x, None, weight, bias, opts)
    return _rms_norm(_static(opts), (save, jnp.dtype(x.dtype)), x, weight,
                     bias)


# ------------------------------------------------------------------ add_rms_norm


@_partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _add_rms_norm(static, save, in_dtypes, x, residual, weight, bias):
    return _add_fwd(static, save, in_dtypes, x, residual, weight, bias)[0]


def _add_fwd(static, save, in_dtypes, x, residual, weight, bias):
    fused = _add_statistic(static, x, residual, weight, bias)
    y, h, rstd = fused if fused is not None else _dispatch(
        _partial(_forward, static=static), x, residual, weight, bias)
    return (y, h), (y if _keeps_output(save, weight, static, rstd) else h, weight, bias, rstd)


def _add_bwd(static, save, in_dtypes, res, cts):
    kept, weight, bias, rstd = res
    h = _kept_input(kept, weight, bias, rstd, static, _keeps_output(save, weight, static, rstd))
    x_dtype, r_dtype = in_dtypes
    dy, dh = (None if c is None else jnp.asarray(c) for c in cts)
    # the gradient reaching h through the residual stream is fused into dx
    dxh, dw, db = _vjp_backward(static, dy, h, weight, bias, rstd, dh)
    return dxh.astype(x_dtype), dxh.astype(r_dtype), dw, db


_add_rms_norm.defvjp(_add_fwd, _add_bwd)


@takes_options()
def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    save: str = "input",
    **options: Unpack[NormOptions],
) -> tuple[jax.Array, jax.Array]:
    """Differentiable :func:`polynorm.add_rms_norm`: returns ``(y, h)``, both differentiable.

    Parameters
    ----------
    x, residual : jax.Array
        Same shape; ``h`` has their promoted dtype (or ``residual_dtype``).
    weight, bias : jax.Array, optional
    save : {"input", "output"}
        As in :func:`rms_norm`: ``"output"`` keeps ``y`` instead of ``h``.
    {options}

    Returns
    -------
    (y, h) : tuple of jax.Array
        The cotangents of ``x`` and ``residual`` come back in their own dtypes.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from polynorm.jax import add_rms_norm
    >>> x = jnp.array([[1.0, 2.0]], dtype=jnp.float32)
    >>> r = jnp.array([[2.0, 2.0]], dtype=jnp.float32)
    >>> y, h = add_rms_norm(x, r, eps=0.0)
    >>> h
    Array([[3., 4.]], dtype=float32)
    >>> g = jax.grad(lambda x: sum(a.sum() for a in add_rms_norm(x, r, eps=0.0)))(x)
    >>> [round(float(v), 4) for v in g.ravel()]
    [1.0453, 0.9661]
    """
    if residual is None:
        raise TypeError("residual must be an array, got None")
    opts = pack_options("add_rms_norm", options)
    _lean.check_save(save)
    if not _traced((x, residual, weight, bias)):
        return _api.forward(x, residual, weight, bias, opts, fused=True)
    in_dtypes = (x.dtype, residual.dtype)  # each input's gradient comes back in its dtype
    return _add_rms_norm(_static(opts), save, in_dtypes, x, residual, weight,
                         bias)


def _jit_kernel_call(opts: Options, x, weight, bias):
    """``y`` of pn.rms_norm on arrays that ``jax.jit`` traces, through the kernels as
    :func:`rms_norm` under ``jit`` (no derivative: pn.rms_norm records none), else None."""
    static = _static(opts)
    try:
        plan = _kernel_plan(static, x, weight, bias)
    except TypeError:  # an unhashable option (an axis list): the front end
        return None
    if plan is None or not all(a is None or isinstance(a, jax.Array) for a in (weight, bias)):
        return None
    return _kernel_forward(static, plan, x, weight, bias)[0]


def _row_sum(a, square: bool):
    """Row sums (of squares where ``square``) of a traced 2-D float32/float64 ``a`` on the
    CPU in the kernels' fixed order (:func:`polynorm.backends.numba.xla.row_sum_handler`):
    the jitted reference's, whose own (XLA's) follow the array's shape; else None."""
    name = a.dtype.name
    if (a.ndim != 2 or name not in ("float32", "float64") or not _api._backends.usable("numba")
            or not (_jax_ffi.available() and _one_cpu_device())):
        return None
    call = jax.ffi.ffi_call(_jax_ffi.compiled_row_sum_target(name, square),
                            jax.ShapeDtypeStruct(a.shape[:-1], a.dtype), vmap_method="expand_dims")
    return jax.lax.platform_dependent(
        a, cpu=call, default=lambda a: jnp.sum(a * a if square else a, axis=1))


def _stats_source(vk, raw):
    """The rows that the jitted reference's compiled row statistics read for ``vk`` (2-D,
    at least one column; a 16-bit ``raw``, whose cast ``vk`` is, in its place), else
    None (another layout or dtype, or no compiled call here)."""
    src = raw if (raw is not None and raw.ndim == 2 and vk.dtype.name == "float32"
                  and raw.dtype.name in ("bfloat16", "float16")) else vk
    if (vk.ndim != 2 or vk.shape[1] == 0
            or src.dtype.name not in ("float32", "float64", "bfloat16", "float16")
            or not _api._backends.usable("numba")
            or not (_jax_ffi.available() and _one_cpu_device())):
        return None
    return src


def _row_stats(vk, raw, floor: float):
    """The jitted reference's row statistics
    (:data:`polynorm.backends.reference.ROW_STATS`) of traced 2-D rows on the CPU, in one
    call (:func:`polynorm.backends.numba.xla.row_stats_handler`; a 16-bit ``raw``, whose
    cast ``vk`` is, read in its place), else None."""
    src = _stats_source(vk, raw)
    if src is None:
        return None
    out = jax.ShapeDtypeStruct(vk.shape[:-1], vk.dtype)
    call = jax.ffi.ffi_call(_jax_ffi.compiled_row_stats_target(src.dtype.name), (out,) * 3,
                            vmap_method="expand_dims")

    def default(_):  # not taken on the CPU; elsewhere the plain sums and the scaled pass's
        m = jnp.max(jnp.abs(vk), axis=1)
        scaled = vk / jnp.where(m == 0, jnp.ones_like(m), m)[:, None]
        return jnp.sum(vk * vk, axis=1), m, jnp.sum(scaled * scaled, axis=1)

    return tuple(jax.lax.platform_dependent(
        src, cpu=lambda a: tuple(call(a, a_floor=np.float64(floor))), default=default))


def _row_rstd(vk, raw, floor: float, plan):
    """The jitted reference's ``rstd`` (:data:`polynorm.backends.reference.ROW_RSTD`) of
    traced 2-D rows on the CPU, in one call
    (:func:`polynorm.backends.numba.xla.reference_rstd_handler`; the rows as
    :func:`_row_stats` reads them), else None."""
    src = _stats_source(vk, raw)
    if src is None:
        return None
    call = jax.ffi.ffi_call(_jax_ffi.compiled_reference_rstd_target(src.dtype.name),
                            jax.ShapeDtypeStruct(vk.shape[:-1], vk.dtype),
                            vmap_method="expand_dims")

    def default(_):  # not taken on the CPU; elsewhere the reference's own steps
        from polynorm.backends import reference as ref

        return ref._rstd_from_rms(jnp, ref._rms(jnp, vk, plan), plan)

    from polynorm.backends import numba as _numba

    flags = _numba._k().EPS_INSIDE if plan.eps_inside else 0
    return jax.lax.platform_dependent(
        src, cpu=lambda a: call(a, a_flags=np.int64(flags), b_k=np.int64(plan.k),
                                c_eps=np.float64(plan.eps), d_floor=np.float64(floor)),
        default=default)


#: The jitted reference backward's row dots take the compiled call from this many elements
#: of ``x``; smaller products' arrays stay in cache, and there the call cost more than it
#: saved (bfloat16 (1, 4096): 72 against 50 us a gradient step).  The same bits either way.
ROW_DOT_MIN_ELEMENTS = 1 << 16


def _row_dot(dy, x, r, wo):
    """The jitted reference backward's row dots (:data:`polynorm.backends.reference.ROW_DOTS`)
    of traced 2-D rows on the CPU (:func:`polynorm.backends.numba.xla.row_dot_handler`),
    else None."""
    floats = ("float32", "float64", "bfloat16", "float16")
    if (x.ndim != 2 or x.size < ROW_DOT_MIN_ELEMENTS or dy.shape != x.shape
            or r.shape != x.shape[:1]
            or dy.dtype.name not in floats or x.dtype.name not in floats
            or r.dtype.name not in ("float32", "float64")
            or (wo is not None and (wo.shape != x.shape[1:] or wo.dtype != r.dtype))
            or not _api._backends.usable("numba")
            or not (_jax_ffi.available() and _one_cpu_device())):
        return None
    target = _jax_ffi.compiled_row_dot_target(dy.dtype.name, x.dtype.name, r.dtype.name,
                                              wo is not None)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(r.shape, r.dtype),
                            vmap_method="sequential")

    def default(dy, x, r, *wo):
        g = dy.astype(r.dtype) * wo[0] if wo else dy.astype(r.dtype)
        return jnp.sum(g * (x.astype(r.dtype) * r[:, None]), axis=1)

    ops = (dy, x, r) if wo is None else (dy, x, r, wo)
    return jax.lax.platform_dependent(*ops, cpu=call, default=default)


try:
    from jax._src.array import ArrayImpl as _ARRAY_IMPL  # eager arrays' concrete type
except ImportError:  # another jax layout: no plain eager fast path
    _ARRAY_IMPL = None


def _register_eager_call() -> None:
    """pn.rms_norm on eager jax arrays, and on the ones ``jax.jit`` traces, takes the same
    route (polynorm.ops.norm.forward)."""
    try:
        from jax._src.array import ArrayImpl  # the concrete type: a dict key, no array made
        from jax._src.interpreters.partial_eval import DynamicJaxprTracer
    except ImportError:  # another jax layout: pn.rms_norm keeps the front end's path
        return
    _api.EAGER_CALLS[ArrayImpl] = _eager_kernel_call
    _api.EAGER_CALLS[DynamicJaxprTracer] = _jit_kernel_call
    try:
        from jax._src.interpreters.batching import BatchTracer
    except ImportError:
        BatchTracer = None
    from polynorm.backends import reference as _ref

    for tracer in (DynamicJaxprTracer, BatchTracer):
        if tracer is not None:
            _ref.ROW_SUMS[tracer] = _row_sum
            _ref.ROW_STATS[tracer] = _row_stats
            _ref.ROW_RSTD[tracer] = _row_rstd
    # jit's tracers only (vmap's batch a weight per example); a jitted call under vmap
    # loops over the batch (vmap_method "sequential")
    _ref.ROW_DOTS[DynamicJaxprTracer] = _row_dot


_register_eager_call()
