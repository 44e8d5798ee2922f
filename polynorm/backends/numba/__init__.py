"""Numba CPU backend: parallel kernels over tokens for host arrays.

Takes anything :mod:`polynorm.core.interop` can view as a numpy array without a
copy (numpy; torch/jax CPU tensors through DLPack) and returns results in
the caller's array type.  float16 and bfloat16 data are handed to the
kernels as integer views (``int16`` and ``uint16``: the view's type is the
format, a compile-time constant) and converted in registers
(:mod:`polynorm.backends.numba.codec`).

Layouts: any row stride is taken as is (padded, negative, zero).  Rows
whose elements are not adjacent (a strided last axis, e.g. Fortran order)
are copied first: the row reductions (sum of squares, the backward's dot)
take one row at a time as a contiguous ``(1, d)`` array
(:func:`.numba.refs.row_of`) and are compiled once for all layouts, so
a token's bits do not depend on the strides or memory order it comes in
(SPEC's batch invariance).  LLVM vectorizes a reduction over a C-contiguous
array and one over a strided array in different orders.

Small work runs in a serial kernel: a parallel launch costs more than it
saves below :data:`SERIAL_MAX_ELEMENTS` elements (measured with
``python bench/cpu.py --threshold``).  Parallel launches are serialised by a lock,
because Numba's ``workqueue`` threading layer must not be entered from two
threads at once; the serial kernels release the GIL and need no lock.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Any

import numpy as np

from polynorm.core import interop as _interop
from polynorm.core.dtypes import numpy_dtype
from polynorm.core.options import Plan
from polynorm.core.pool import output_pool

name = "numba"

#: Below this many elements (tokens x d) one thread does the work
#: (``python bench/cpu.py --threshold`` times both sides).  A parallel launch
#: costs a few microseconds when a core is idle and far more on a loaded
#: machine, so the crossover is taken high.
SERIAL_MAX_ELEMENTS = 1 << 16

#: A forward output (``out=`` or its own) of at least this many bytes is written with streaming
#: (non-temporal) stores, which skip reading each line before writing it
#: (see :mod:`.numba.stream`; rows of unit column stride;
#: ``python bench/cpu.py --stream`` times both by size).  Streamed lines leave
#: the cache, and whoever reads a y that would have fit in L3 next pays for
#: it, so only arrays of about half a typical L3 or more stream.
STREAM_MIN_BYTES = 16 << 20
#: 16-bit rows stream (two passes per row, instead of the pipelined
#: forward's one) only from this many bytes on: shorter rows are faster
#: pipelined and stored (the stage's flush per row costs more than the reads
#: it saves).
STREAM_MIN_ROW_BYTES_16 = 8192
#: Whether 16-bit rows stream at all; None: decided at the first forward, from
#: the CPU (:func:`_streams_16`).
STREAM_16: bool | None = None
#: Elements per stage (the L1 buffer streamed rows pass through); whole lines
#: for every dtype.
_STAGE = 256

#: Row blocks of the backward (the parallel tasks) per thread, and a cap on
#: the float64 partials they leave (elements).  Speed only: the sums' order
#: is the row tree's (polynorm/backends/rowtree.py), whatever the blocks.
#: Fewer, longer blocks leave a smaller node array to sum.
_BWD_BLOCKS_PER_THREAD = 8
_BWD_SCRATCH = 1 << 22

_launch_lock = threading.Lock()
_kernels = None  # the compiled-kernel modules, imported on first use
_bwd_kernels = None


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
        from polynorm.backends.numba import kernels as _numba_kernels

        _kernels = _numba_kernels
    return _kernels


def _kb():
    global _bwd_kernels
    if _bwd_kernels is None:
        from polynorm.backends.numba import backward_kernels as _numba_backward

        _bwd_kernels = _numba_backward
    return _bwd_kernels


_BF16_BITS = np.dtype(np.uint16)
_F16_BITS = np.dtype(np.int16)
_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)


def _empty_for(caller):
    """Allocation for results that go back to ``caller``'s library: the output
    pool (:mod:`polynorm.core.pool`) for numpy, aligned memory for jax."""
    if type(caller) is np.ndarray:
        return output_pool.empty

    def empty(shape, dtype):
        return _interop.host_empty(shape, dtype, caller)

    return empty


class _Alias:
    """A writable numpy view of a read-only array's memory (see :func:`_kview`)."""

    def __init__(self, a: np.ndarray):
        iface = dict(a.__array_interface__)
        iface["data"] = (iface["data"][0], False)
        self.__array_interface__ = iface
        self._owner = a  # keeps the memory alive as long as the view


def _writable_alias(a: np.ndarray) -> np.ndarray:
    return np.asarray(_Alias(a))


def _bits(a: np.ndarray) -> np.ndarray:
    """``a``, its 16-bit floats as their bits (:func:`_kview` without the writable alias: for
    a compiled entry point, which takes read-only arrays)."""
    if a.dtype.itemsize == 2:
        return a.view(_BF16_BITS if _bf(a) else _F16_BITS)
    return a


def _kview(a: np.ndarray) -> np.ndarray:
    """What the kernels take: the bits of the 16-bit floats, else ``a`` itself.

    bfloat16 as ``uint16``, float16 as ``int16``: the view's type carries the
    format into the kernels (see ``numba.codec.load``).  A read-only
    array (a jax array's buffer, ``np.broadcast_to``) is passed as a writable
    alias of the same memory: Numba types read-only arrays apart and would
    compile every kernel again for them, and the kernels never write their
    inputs.
    """
    a = _bits(a)
    return a if a.flags.writeable else _writable_alias(a)


def _bf(a: np.ndarray) -> bool:
    # among the four float dtypes only ml_dtypes' bfloat16 is not of kind "f"
    return a.dtype.kind == "V"


def _streams_16() -> bool:
    """:data:`STREAM_16`, or where unset: whether the CPU has AVX-512.

    Streamed 16-bit rows take two passes over each row where the pipelined
    forward takes one: that paid off on a CPU with AVX-512 and lost at every
    size on one with AVX2 only (``python bench/cpu.py --stream --dtypes
    bfloat16 float16`` times both; bench/results/stream-*.txt).
    """
    global STREAM_16
    if STREAM_16 is None:
        from polynorm.backends.numba.codec import host_has

        STREAM_16 = host_has("avx512f")
    return STREAM_16


def _streamable(a: np.ndarray) -> bool:
    """Whether rows of 2-D ``a`` may be written with streaming stores: large enough
    to leave the caches, unit column stride, and every row on a multiple of the
    element size (the kernels' line arithmetic, ``line_gap``, counts whole elements:
    a row off that grid would take the aligned streaming stores at a misaligned
    address, and fault)."""
    return (a.nbytes >= STREAM_MIN_BYTES and a.ndim == 2 and a.strides[1] == a.itemsize
            and a.ctypes.data % a.itemsize == 0 and a.strides[0] % a.itemsize == 0)


def _streams(y: np.ndarray, x: np.ndarray) -> bool:
    """Whether the forward output ``y`` (``out=`` or its own; of input ``x``) is written with
    streaming stores."""
    return _streamable(y) and (
        x.itemsize > 2 or (x.shape[1] * 2 >= STREAM_MIN_ROW_BYTES_16 and _streams_16()))


def _streams_dx(dx: np.ndarray) -> bool:
    """Whether the backward writes ``dx`` with streaming stores (rows with a weight,
    in whole 64-byte lines: the kernel checks the rest).

    float32 and float64 only: on an AVX2 CPU float32 took 0.76-0.82x the time
    through the stage, while 16-bit dx passes, bound in the core, gained
    nothing dependable (float16 0.92-1.07x by shape, bfloat16 1.09x)
    (``python bench/compare.py --rev REV --ops bwd``, 16384 x 4096 / 4096 x 16384).
    """
    return dx.itemsize >= 4 and _streamable(dx)


def _stage(yk: np.ndarray, stream: bool) -> np.ndarray | None:
    """The buffer that streamed rows of ``yk`` pass through (None: not streamed)."""
    return np.empty((1, _STAGE), yk.dtype) if stream else None


def _parallel(n: int, d: int) -> bool:
    # by size only: the thread count must never change which code runs
    # (and the serial and parallel drivers give the same bits)
    return n >= 2 and n * d >= SERIAL_MAX_ELEMENTS and not _forked_after_omp


# Fork safety.  Numba picks its threading layer at the first parallel launch:
# tbb where libtbb is installed (start_threads loads pip's), else GNU OpenMP
# ("omp"), else its own workqueue.  A process forked after an OpenMP parallel
# region is killed by libgomp the moment it enters one ("fork() called from a
# process already using GNU OpenMP"), e.g. multiprocessing's fork start method
# and torch DataLoader workers.  So a child forked after this process ran a
# parallel kernel on the omp layer runs the serial kernels (the same bits: the
# drivers do not change a row's code); the parent keeps the omp layer, and
# nothing changes for processes that do not fork.  (Numba's tbb layer shuts
# TBB down before a fork from the main thread and restarts it after.)  The
# launch lock is made anew in the child (a fork while another thread held it
# would leave it locked forever).
_omp_used = False
_forked_after_omp = False


def _note_layer() -> None:
    """After a parallel launch: remember whether it ran on GNU OpenMP."""
    global _omp_used
    if not _omp_used:
        import numba

        try:
            _omp_used = numba.threading_layer() == "omp"
        except ValueError:  # no parallel launch yet
            pass


_threads_started = False

#: Where pip's ``tbb`` wheel puts the TBB runtime: the environment's ``lib/``, which the
#: dynamic loader does not search, so Numba (which asks for it by name) misses it.
_TBB_LIBS = {"linux": "libtbb.so.12", "darwin": "libtbb.12.dylib"}


def _available_cpus() -> int:
    """The CPUs this process may run on: its affinity, capped by a cgroup CPU quota
    (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), as TBB counts them."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
                                     "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            with open(quota_file) as fh:
                fields = fh.read().split()
            if period_file is not None:
                with open(period_file) as fh:
                    fields.append(fh.read().strip())
            quota, period = int(fields[0]), int(fields[1])
        except (OSError, ValueError, IndexError):  # absent, or "max": no quota
            continue
        if quota > 0 and period > 0:
            n = min(n, -(-quota // period))
    return max(1, n)


def _preload_tbb() -> None:
    """Load pip's TBB runtime (where installed) so that Numba's default layer order
    (tbb, omp, workqueue) finds it.

    TBB's caller runs the tasks no worker has taken: a call on a busy machine
    costs at most about the serial time, where OpenMP's caller waits at the
    region's end for a worker that the scheduler has not run yet.

    Not with a single available CPU (unless ``NUMBA_THREADING_LAYER`` asks for TBB):
    TBB then starts no worker, and a layer started from a thread other than the main
    one leaves the task Numba's start posts where the main thread's wait at exit
    cannot take it, so the process hangs at exit (numba#10556, oneTBB#2056).  One CPU
    has no worker to wait for either: another layer costs nothing there.
    """
    import ctypes

    if _available_cpus() < 2 and os.environ.get("NUMBA_THREADING_LAYER", "").lower() != "tbb":
        return
    name = _TBB_LIBS.get(sys.platform)
    path = os.path.join(sys.prefix, "lib", name) if name else ""
    if path and os.path.exists(path):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:  # unusable: Numba falls back to omp or workqueue
            pass


def start_threads() -> None:
    """Start Numba's threading layer: TBB where pip installed it (:func:`_preload_tbb`).

    The first parallel kernel calls it; call it first where other Numba code of the
    process may start a layer before polynorm does (Numba keeps the first one).

    >>> import numba
    >>> from polynorm.backends import numba as nb
    >>> nb.start_threads()
    >>> numba.threading_layer() in ("tbb", "omp", "workqueue")
    True
    """
    global _threads_started
    from numba.np.ufunc import parallel

    _preload_tbb()
    parallel._launch_threads()
    _threads_started = True


def _launch_parallel(kernel, *args):
    """Run a parallel kernel (one launch at a time), then note its threading layer."""
    with _launch_lock:
        if not _threads_started:
            start_threads()
        result = kernel(*args)
    if not _omp_used:
        _note_layer()
    return result


def _run_rows(parallel_kernel, rows_kernel, n: int, d: int, args: tuple) -> None:
    """All ``n`` rows: ``parallel_kernel(*args)`` where :func:`_parallel`, else
    ``rows_kernel(0, n, *args)`` (the same bits either way)."""
    if _parallel(n, d):
        _launch_parallel(parallel_kernel, *args)
    else:
        rows_kernel(0, n, *args)


#: Positions of the forward drivers' row arrays ``x, r, y, h`` in their ``args``
#: (:func:`forward`), and of ``eps, offset``.
_FWD_ROWS, _FWD_FLOATS = (0, 1, 4, 5), (9, 10)


def _run_fwd_rows(parallel_kernel, rows_kernel, n: int, d: int, args: tuple) -> None:
    """:func:`_run_rows` of the forward drivers; strided rows (any of ``x``,
    ``residual``, ``y``, ``h`` not C-contiguous) through :func:`_any_layout_entry`."""
    if _contiguous(args, _FWD_ROWS):
        _run_rows(parallel_kernel, rows_kernel, n, d, args)
    elif _parallel(n, d):
        _launch_parallel(_any_layout_entry(parallel_kernel, args, _FWD_ROWS, _FWD_FLOATS), *args)
    else:
        call = (0, n, *args)
        _any_layout_entry(rows_kernel, call, tuple(p + 2 for p in _FWD_ROWS),
                          tuple(p + 2 for p in _FWD_FLOATS))(*call)


def _after_fork_in_child() -> None:
    global _forked_after_omp, _launch_lock
    _launch_lock = threading.Lock()
    if _omp_used:
        _forked_after_omp = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _param_vector(a: np.ndarray, cdt: np.dtype, exact: bool = False) -> np.ndarray:
    """Weight/bias as the kernels take them: contiguous, in the compute dtype.

    This is the reference's own ``astype(weight, compute dtype)``; with
    ``exact`` (llama weights, whose own rounding matters) a weight wider than
    the compute dtype is kept as float64 instead.  A ``(d,)`` copy at most
    (a strided one is copied too: one compiled layout); a read-only one is
    aliased as :func:`_kview` does.
    """
    target = _F64 if exact and a.dtype.itemsize > cdt.itemsize else cdt
    if a.dtype.itemsize == 2 and target is _F32 and a.ndim == 1:
        # exact either way; the kernel is several times numpy's 16-bit casts
        w = np.empty(a.shape[0], _F32)
        (_kernels or _k()).widen_bits(_kview(a if a.flags.c_contiguous else a.copy()), w)
        return w
    if a.dtype != target or not a.flags.c_contiguous:
        return np.ascontiguousarray(a, target)
    return a if a.flags.writeable else _writable_alias(a)


@functools.lru_cache(maxsize=32)
def _ones(d: int, cdt: np.dtype) -> np.ndarray:
    """The weight of a call without one: ones, with no offset.

    ``v * (1 + 0)`` is ``v`` bit for bit (-0.0, Inf and NaN included), so a
    call without a weight runs the kernel compiled for calls with one: half
    the specialisations (compile time), at a load from L1 and a multiply per
    element for weightless calls.  An absent bias stays ``None``: a stand-in
    would cost the common weight-only call an add per element and a larger
    first compile.  Shared and never written (the kernels only read w);
    writable, as the callers' weights are (:func:`_param_vector`), so the
    kernels' types match.
    """
    return np.ones(d, cdt)


@functools.lru_cache(maxsize=4)
def _no_rstd(cdt: np.dtype) -> np.ndarray:
    """The backward's ``rstd`` when none is given (``HAS_RSTD`` unset): never read,
    of the type a given one has (the compute dtype, contiguous), so that calls
    with and without one run the same compiled kernel."""
    return np.zeros(1, cdt)


_NO_GR: dict[np.dtype, np.ndarray] = {}


def _no_grad_residual(dt: np.dtype) -> np.ndarray:
    """The backward's ``grad_residual`` when none is given (``HAS_GR`` unset): never
    read, a ``(1, 1)`` array of dy's kernel dtype (as a given one usually has), so that
    calls with and without one run the same compiled kernel (shared, never written)."""
    a = _NO_GR.get(dt)
    if a is None:
        a = _NO_GR[dt] = np.zeros((1, 1), dt)
    return a


def _affine(weight, bias, cdt: np.dtype, d: int, offset: float, exact: bool = False) -> tuple:
    """``(w, b, offset)`` as the forward kernels take them: weight/bias in the
    compute dtype (:func:`_param_vector`), :func:`_ones` for an absent weight
    (then with offset 0), ``None`` for an absent bias."""
    to_numpy = _interop.to_numpy
    if weight is None:
        w, offset = _ones(d, cdt), 0.0
    else:
        w = _param_vector(to_numpy(weight), cdt, exact)
    b = None if bias is None else _param_vector(to_numpy(bias), cdt)
    return w, b, offset


def _info(plan: Plan) -> tuple:
    """``(flags, y dtype, h dtype, compute dtype)`` for a plan, derived once (``plan.memo``)."""
    info = plan.memo.get("numba")
    if info is None:
        kernels = _k()
        flags = (kernels.EPS_INSIDE if plan.eps_inside else 0) | (kernels.LLAMA if plan.llama else 0)
        info = (flags, numpy_dtype(plan.out_dtype), numpy_dtype(plan.norm_dtype),
                numpy_dtype(plan.compute_dtype))
        plan.memo["numba"] = info
    return info


def _llama_codes(plan: Plan, weight: np.ndarray | None) -> int:
    """Rounding formats of llama casting: xhat to x's dtype, g to weight's, product to both's.

    Without a weight (a stand-in of ones, :func:`_affine`) both are x's format:
    1 rounds to 1, and ``xhat * 1`` rounded again to x's format is xhat.
    """
    from polynorm.backends.numba.codec import FORMAT_CODE as code
    from polynorm.core.options import promote

    kernels = _k()
    xname = plan.norm_dtype
    wname = xname if weight is None else "bfloat16" if _bf(weight) else weight.dtype.name
    return ((code[xname] << kernels.XCODE_SHIFT) | (code[wname] << kernels.WCODE_SHIFT)
            | (code[promote(xname, wname)] << kernels.PCODE_SHIFT))


def forward(x, residual, weight, bias, plan: Plan, out=None):
    """Forward on 2-D rows; see :mod:`polynorm.backends.reference` for the contract.

    ``out`` (an ``(n, d)`` array of ``plan.out_dtype``, possibly ``x``
    itself) receives ``y`` in place; then no token-sized array is allocated
    besides ``h`` for the fused add.
    """
    if plan.cast_none:
        return none_forward(x, residual, weight, bias, plan, out)
    kernels = _kernels or _k()
    caller = x
    to_numpy = _interop.to_numpy
    x = to_numpy(x)
    if residual is None and x.shape[1] > 1 and x.strides[1] != x.itemsize:
        x = np.ascontiguousarray(x)  # _unit_columns: the row reductions take adjacent elements
    n, d = x.shape
    flags, y_dt, h_dt, cdt = _info(plan)
    empty = _empty_for(caller)
    y = empty((n, d), y_dt) if out is None else to_numpy(out)
    rstd = empty(n, cdt)
    xk = _kview(x)
    yk = _kview(y)
    h = r = hk = None
    if residual is not None:
        h = empty((n, d), h_dt)
        r = _kview(to_numpy(residual))
        hk = _kview(h)
    w, b, offset = _affine(weight, bias, cdt, d, plan.offset, exact=plan.llama)
    if plan.llama:
        flags |= _llama_codes(plan, None if weight is None else to_numpy(weight))
    stream = residual is None and not plan.llama and _streams(y, x)
    args = (xk, r, w, b, yk, hk, rstd, flags, plan.k, plan.eps, offset, _stage(yk, stream))
    if plan.llama:
        _run_fwd_rows(kernels.forward_llama_parallel, kernels.forward_llama_rows, n, d, args)
    else:
        drivers = kernels.forward_kernels(residual is not None, xk.dtype.itemsize == 2, stream)
        _run_fwd_rows(*drivers, n, d, args)
    from_numpy = _interop.from_numpy
    return (out if out is not None else from_numpy(y, caller),
            None if h is None else from_numpy(h, caller), from_numpy(rstd, caller))


def forward_into(x, residual, weight, bias, plan: Plan, out, h_out):
    """The fused add of :func:`forward` with ``h`` written into ``h_out`` (an
    ``(n, d)`` array of ``plan.norm_dtype``, possibly ``residual`` itself) and
    ``y`` into ``out`` (possibly ``x``, or None): the in-place
    ``add_rms_norm_`` allocates no token-sized array.  None (the front end
    computes apart and copies) for an ``h_out`` of non-adjacent columns.

    Alias-safe by the row order of the fused kernels: each row's ``h`` is
    summed element by element (``h[i, j]`` from ``x[i, j]`` and ``r[i, j]``
    only) before that row's ``y`` is written, and ``y`` is computed from
    ``h``, never from ``x`` again; a row touches no other row's memory (the
    prefetch of the next row is a hint, no read of a value).
    """
    to_numpy = _interop.to_numpy
    hn = to_numpy(h_out)
    if hn.shape[1] > 1 and hn.strides[1] != hn.itemsize:
        return None  # the row reductions read h's adjacent elements (_unit_columns)
    kernels = _kernels or _k()
    caller = x
    x = to_numpy(x)
    n, d = x.shape
    flags, y_dt, _, cdt = _info(plan)
    empty = _empty_for(caller)
    y = empty((n, d), y_dt) if out is None else to_numpy(out)
    rstd = empty(n, cdt)
    xk, yk = _kview(x), _kview(y)
    r = _kview(to_numpy(residual))
    hk = _kview(hn)
    w, b, offset = _affine(weight, bias, cdt, d, plan.offset, exact=plan.llama)
    args = (xk, r, w, b, yk, hk, rstd, flags | (_llama_codes(
        plan, None if weight is None else to_numpy(weight)) if plan.llama else 0),
        plan.k, plan.eps, offset, None)
    if plan.llama:
        _run_rows(kernels.forward_llama_parallel, kernels.forward_llama_rows, n, d, args)
    elif xk.dtype.itemsize == 2 and r.dtype == hk.dtype and _same_memory(r, hk):
        # h over the residual, 16-bit: the drivers that see one pointer (numba/inplace.py)
        from polynorm.backends.numba import inplace as _inplace

        args = args[:5] + (None,) + args[6:]
        _run_rows(_inplace.forward_add_inplace_parallel, _inplace.forward_add_inplace_rows, n, d,
                  args)
    else:
        _run_rows(*kernels.forward_kernels(True, xk.dtype.itemsize == 2, False), n, d, args)
    from_numpy = _interop.from_numpy
    return (out if out is not None else from_numpy(y, caller), h_out, from_numpy(rstd, caller))


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides)


def forward_apart(x, residual, weight, bias, plan: Plan, plan_s: Plan, out=None):
    """A fused add with a non-default ``norm_input``/``residual_dtype`` in one pass,
    or None where it takes the front end's add apart (:func:`add_apart`).

    ``plan_s`` is the plain forward's plan of :func:`polynorm.ops.norm.add_apart`
    (its ``norm_dtype`` the normalized value's).  ``norm_input="h"``: the fused
    kernel with ``h`` in ``plan.h_dtype`` where it sums in the same type as the
    add apart (not a float64 ``h`` from narrower inputs).  ``"sum"``: the rows
    summed into a compute-type scratch row, ``h`` rounded from it, y its plain
    forward.  The bits of the two passes either way.
    """
    from polynorm.core.options import compute_dtype, split_dtypes

    sdt, ndt = split_dtypes(plan.norm_dtype, plan.h_dtype, plan.norm_sum)
    if sdt != compute_dtype(plan.norm_dtype) or plan_s.llama:
        return None
    if not plan.norm_sum:
        return forward(x, residual, weight, bias, plan_s, out)
    kernels = _kernels or _k()
    caller = x
    to_numpy = _interop.to_numpy
    xn, rn = to_numpy(x), to_numpy(residual)
    n, d = xn.shape
    flags, y_dt, _, cdt = _info(plan_s)
    empty = _empty_for(caller)
    y = empty((n, d), y_dt) if out is None else to_numpy(out)
    rstd = empty(n, cdt)
    h = empty((n, d), numpy_dtype(plan.h_dtype))
    w, b, offset = _affine(weight, bias, cdt, d, plan_s.offset)
    stage = np.empty((1, d), cdt)
    args = (_kview(xn), _kview(rn), w, b, _kview(y), _kview(h), rstd, flags, plan_s.k,
            plan_s.eps, offset, stage)
    _run_rows(kernels.forward_add_sum_parallel, kernels.forward_add_sum_rows, n, d, args)
    from_numpy = _interop.from_numpy
    return (out if out is not None else from_numpy(y, caller), from_numpy(h, caller),
            from_numpy(rstd, caller))


def add_apart(x, residual, sum_dtype: str, h_dtype: str):
    """The add of a fused add run apart (:func:`polynorm.ops.norm.add_apart`):
    ``(s, h)``, ``s = x + residual`` in ``sum_dtype`` (a compute dtype) and ``h``
    that sum rounded once to ``h_dtype``; one pass, in the caller's array type."""
    kernels = _kernels or _k()
    caller = x
    to_numpy = _interop.to_numpy
    xn, rn = to_numpy(x), to_numpy(residual)
    n, d = xn.shape
    empty = _empty_for(caller)
    s = empty((n, d), numpy_dtype(sum_dtype))
    h = empty((n, d), numpy_dtype(h_dtype))
    _run_rows(kernels.add_split_parallel, kernels.add_split_rows, n, d,
              (_kview(xn), _kview(rn), s, _kview(h)))
    from_numpy = _interop.from_numpy
    return from_numpy(s, caller), from_numpy(h, caller)


def forward_small(x: np.ndarray, weight, bias, plan: Plan):
    """:func:`forward` of a small plain numpy ``(n, d)`` array (serial size, no
    residual, no ``out``, not llama) into new arrays: ``(y, rstd)``.

    The same kernel and arguments as :func:`forward`, less its Python: this
    is most of a (1, 4096) call's time (the front end's numpy fast path).
    """
    kernels = _kernels or _k()
    flags, y_dt, _, cdt = _info(plan)
    n, d = x.shape
    if d > 1 and x.strides[1] != x.itemsize:
        x = np.ascontiguousarray(x)  # as _unit_columns
    y = np.empty((n, d), y_dt)
    rstd = np.empty(n, cdt)
    w, b, offset = _affine(weight, bias, cdt, d, plan.offset)
    # _kview's own test, here without the call for the float32/float64 arrays
    xk = x if x.dtype.itemsize != 2 and x.flags.writeable else _kview(x)
    yk = y if y_dt.itemsize != 2 else _kview(y)
    rows = kernels.forward_bits_rows if xk.dtype.itemsize == 2 else kernels.forward_rows
    rows(0, n, xk, None, w, b, yk, None, rstd, flags, plan.k, plan.eps, offset, None)
    return y, rstd


class Decode:
    """A decode call signature's serial forward kernel and constant arguments
    (:func:`decode_plan`), for :func:`forward_decode`."""

    __slots__ = ("kernel", "entry", "y_dt", "h_dt", "cdt", "n", "d", "xv", "rv", "yv", "hv",
                 "wv", "bv", "ones", "flags", "k", "eps", "offset", "wide", "wpool", "lean",
                 "raw")

    def __init__(self, **kw):
        self.entry = None  # the compiled entry point, once known (False: none)
        # widen_bits's compiled entry point for a 16-bit weight (False: none), and
        # float32 buffers the widened weight is written to: popped and put back
        # around the call (atomic list operations), so that calls from two threads
        # (the kernels release the GIL) never share one
        self.wide = None
        self.wpool: list = []
        self.lean = None  # forward_lean's closure, where the signature has one
        # whether the compiled entry points take the 16-bit arrays themselves in place
        # of their integer views (_resolve_wide's probe): a view costs more than a
        # (1, 4096) float16 kernel's conversions
        self.raw = False
        for k, v in kw.items():
            setattr(self, k, v)


_U16, _I16 = np.dtype(np.uint16), np.dtype(np.int16)


def _bits_view(dt: np.dtype):
    """The integer view the kernels take for a 16-bit dtype (:func:`_kview`), else None."""
    if dt.itemsize != 2:
        return None
    return _U16 if dt.kind == "V" else _I16


def decode_plan(plan: Plan, x: np.ndarray, residual, weight, bias) -> Decode | None:
    """The prepared serial forward of a call signature: 2-D numpy rows of unit column
    stride (or a residual), below :data:`SERIAL_MAX_ELEMENTS`, not llama, contiguous
    weight/bias; None where a weight/bias cast is not :func:`_param_vector`'s widening.

    ``polynorm.ops.fast`` keeps one per (shapes, strides, dtypes, options) and calls
    :func:`forward_decode` with it: the same kernel and arguments as :func:`forward`.
    """
    kernels = _kernels or _k()
    flags, y_dt, h_dt, cdt = _info(plan)
    if residual is not None:
        kernel = kernels.forward_add_rows
    elif x.itemsize == 2:
        kernel = kernels.forward_bits_rows
    else:
        kernel = kernels.forward_rows
    views = []
    for a in (weight, bias):
        # a vector in the compute dtype goes in as it is, a 16-bit one is widened
        # (_param_vector); other casts are numpy's: forward
        if a is None or a.dtype == cdt:
            views.append(None)
        elif a.itemsize == 2 and cdt is _F32:
            views.append(_bits_view(a.dtype))
        else:
            return None
    n, d = x.shape
    e = Decode(
        kernel=kernel, y_dt=y_dt, h_dt=h_dt, cdt=cdt, n=n, d=d, xv=_bits_view(x.dtype),
        rv=None if residual is None else _bits_view(residual.dtype), yv=_bits_view(y_dt),
        hv=_bits_view(h_dt), wv=views[0], bv=views[1],
        ones=_ones(d, cdt) if weight is None else None, flags=flags,
        k=plan.k, eps=plan.eps, offset=0.0 if weight is None else plan.offset)
    if residual is None and bias is None and weight is not None:
        e.lean = _lean(e)
    return e


def _plain(a: np.ndarray, read_only_ok: bool = False) -> bool:
    """Aligned, and writable unless ``read_only_ok``: the arrays a compiled entry point
    takes (a read-only input once the entry point is known: it checks dtype and rank,
    not writability, and the kernels never write their inputs; the dispatcher would
    type it apart and compile the kernel again)."""
    f = a.flags
    return f.aligned and (read_only_ok or f.writeable)


def _decode_vector(a: np.ndarray, view, cdt: np.dtype, d: int) -> np.ndarray:
    """weight/bias as the kernel takes it: itself, or widened from 16 bits (as
    :func:`_param_vector`)."""
    if view is None:
        return a if a.flags.writeable else _writable_alias(a)
    v = np.empty(d, cdt)
    (_kernels or _k()).widen_bits(a.view(view) if a.flags.writeable else _kview(a), v)
    return v


def forward_decode(e: Decode, x: np.ndarray, residual, weight, bias, out):
    """:func:`forward` of a call whose signature ``e`` was prepared for: ``(y, h, rstd)``.

    The key ``e`` was found by proves each array's dtype, shape and strides, so
    the kernel's compiled entry point can be called without Numba's type
    dispatch where every array is also aligned (and, until the entry point is
    known, writable: the two facts of its type the key does not fix); else the
    dispatcher runs, on :func:`_kview`'s writable aliases.
    """
    n, d, cdt = e.n, e.d, e.cdt
    # out: writable, C-contiguous and aligned (plain_out_ok, the caller's check).  Once
    # the entry point is known, read-only inputs go to it as they are (see _lean);
    # ``aligned``: the arrays as the entry point takes them, read-only or not
    entry = bool(e.entry)
    aligned = _plain(x, True) and (residual is None or _plain(residual, True))
    plain = _plain(x, entry) and (residual is None or _plain(residual, entry))
    if bias is None:
        b = None
    else:
        b = _decode_vector(bias, e.bv, cdt, d)
        if e.bv is None:  # the bias itself (else a widened copy)
            aligned = aligned and _plain(bias, True)
            plain = plain and _plain(bias)
    if weight is None:
        w = e.ones
    elif e.wv is None:
        aligned = aligned and _plain(weight, True)
        plain = plain and _plain(weight, entry)
        w = weight if weight.flags.writeable or plain else _writable_alias(weight)
    elif e.wide and weight.flags.aligned:
        # the weight's widening through its compiled entry point (a read-only weight as
        # it is) into a pooled buffer: the same values as _decode_vector, without the
        # dispatcher and the allocation
        pool = e.wpool
        w = pool.pop() if pool else np.empty(d, cdt)
        e.wide(weight.view(e.wv), w)
    else:
        w = _decode_vector(weight, e.wv, cdt, d)
        if e.wide is None:
            _resolve_wide(e, weight, w)
    y = np.empty((n, d), e.y_dt) if out is None else out
    rstd = np.empty(n, cdt)
    xv = e.xv
    xk = (x if xv is None else x.view(xv)) if plain else _kview(x)
    yk = y if e.yv is None else y.view(e.yv)
    if residual is None:
        h = hk = rk = None
    else:
        rv = e.rv
        rk = (residual if rv is None else residual.view(rv)) if plain else _kview(residual)
        h = np.empty((n, d), e.h_dt)
        hk = h if e.hv is None else h.view(e.hv)
    args = (0, n, xk, rk, w, b, yk, hk, rstd, e.flags, e.k, e.eps, e.offset, None)
    if plain and e.entry:
        e.entry(*args)
    else:
        e.kernel(*args)
        if aligned and e.entry is None:
            # the arrays' types (their writable aliases' where read-only): the entry
            # point's, so that read-only arrays from the first call on find it too
            _resolve(e, args)
    if e.wide and weight is not None and w.base is None and len(e.wpool) < 4:
        e.wpool.append(w)  # not before the kernel has returned: it reads w
    return y, h, rstd


def _lean(e: Decode):
    """``run(x, weight, out, return_rstd)``: :func:`forward_decode` of a signature with a
    weight and neither residual nor bias (``y`` or ``(y, rstd)``, as ``rms_norm``
    returns them), once its entry points are known, with the constants
    bound in the closure (a decode call's Python work is most of its time).  It
    returns None, having done nothing, where an array is unaligned or an entry point
    is not known yet: :func:`forward_decode` runs then.  A read-only ``x`` or
    ``weight`` (a jax array's buffer, safetensors' ``frombuffer``) goes to the entry
    point as it is: the entry point checks dtype and rank, not writability, and the
    kernels never write their inputs (Numba's dispatcher would type it apart,
    :func:`_kview`).  ``out``: writable, aligned and C-contiguous (the caller's
    ``plain_out_ok``)."""
    n, d, cdt, y_dt, xv, yv, wv = e.n, e.d, e.cdt, e.y_dt, e.xv, e.yv, e.wv
    flags, k, eps, offset = e.flags, e.k, e.eps, e.offset
    pool = e.wpool
    empty = np.empty
    shape = (n, d)

    rpool: list = []  # rstd buffers of calls that do not return it (as pool)

    def run(x, weight, out, return_rstd):
        entry, wide = e.entry, e.wide
        if not entry or (wv is not None and not wide):
            return None
        if not (x.flags.aligned and weight.flags.aligned):
            return None
        y = empty(shape, y_dt) if out is None else out
        rstd = empty(n, cdt) if return_rstd or not rpool else rpool.pop()
        raw = e.raw
        if wv is None:
            w = weight
        else:
            w = pool.pop() if pool else empty(d, cdt)
            wide(weight if raw else weight.view(wv), w)
        if raw:  # the 16-bit arrays themselves: their views cost more than the conversions
            entry(0, n, x, None, w, None, y, None, rstd, flags, k, eps, offset, None)
        else:
            entry(0, n, x if xv is None else x.view(xv), None, w, None,
                  y if yv is None else y.view(yv), None, rstd, flags, k, eps, offset, None)
        # the buffers back only now: the kernel has read / written them
        if wv is not None and len(pool) < 4:
            pool.append(w)
        if return_rstd:
            return y, rstd
        if len(rpool) < 4:
            rpool.append(rstd)
        return y

    return run


def decode_into_plan(plan: Plan, x: np.ndarray, weight) -> Decode | None:
    """The prepared serial in-place fused add of a call signature (``add_rms_norm_``:
    ``h`` over the residual, ``y`` over ``x``; residual of ``x``'s dtype, shape and
    strides, no bias), for :func:`forward_into_decode`: :func:`forward_into`'s
    kernel and arguments, or None as :func:`decode_plan`."""
    e = decode_plan(plan, x, x, weight, None)
    if e is not None and x.itemsize == 2:
        from polynorm.backends.numba import inplace as _inplace

        e.kernel = _inplace.forward_add_inplace_rows  # forward_into's 16-bit driver
    return e


def forward_into_decode(e: Decode, x: np.ndarray, residual: np.ndarray, weight) -> None:
    """:func:`forward_into` with ``out=x`` and ``h_out=residual`` of a call whose
    signature ``e`` was prepared for (:func:`decode_into_plan`): the same kernel
    and arguments, through its compiled entry point where every array is
    writable and aligned (as :func:`forward_decode`).  ``x`` and ``residual``:
    writable, C-contiguous, not overlapping each other or the weight (the caller's
    checks)."""
    n, d, cdt = e.n, e.d, e.cdt
    plain = _plain(x) and _plain(residual)
    if weight is None:
        w = e.ones
    elif e.wv is None:
        f = weight.flags
        w = weight if f.writeable else _writable_alias(weight)
        plain = plain and f.writeable and f.aligned
    elif e.wide and weight.flags.aligned:
        pool = e.wpool
        w = pool.pop() if pool else np.empty(d, cdt)
        e.wide(weight if e.raw else weight.view(e.wv) if weight.flags.writeable
               else _kview(weight), w)
    else:
        w = _decode_vector(weight, e.wv, cdt, d)
        if e.wide is None:
            _resolve_wide(e, weight, w)
    rstd = np.empty(n, cdt)
    xv = e.xv
    entry = e.entry if plain else None
    if xv is None or (entry and e.raw):  # the arrays themselves: entry points only
        xk, rk = x, residual
    else:
        xk, rk = x.view(xv), residual.view(xv)
    # the 16-bit driver writes h over r itself (numba/inplace.py); the others take it as h
    hk = None if xv is not None else rk
    args = (0, n, xk, rk, w, None, xk, hk, rstd, e.flags, e.k, e.eps, e.offset, None)
    if entry:
        entry(*args)
    else:
        e.kernel(*args)
        if plain and e.entry is None:
            _resolve(e, args)
    if e.wide and weight is not None and w.base is None and len(e.wpool) < 4:
        e.wpool.append(w)


def _resolve_wide(e: Decode, weight: np.ndarray, w: np.ndarray) -> None:
    """``e.wide``: widen_bits's compiled entry point for this weight's bits into
    ``w`` (False: none, and :func:`_decode_vector` stays)."""
    if e.wv is None or not weight.flags.aligned:
        return
    widen = (_kernels or _k()).widen_bits
    e.wide = _entry_point(widen, (_kview(weight), w))  # its bits, as _decode_vector passes them
    if e.wide and e.xv == e.wv and (e.yv is None or e.yv == e.wv):
        e.raw = _takes_raw(e.wide, weight, w)


def _takes_raw(entry, a: np.ndarray, widened: np.ndarray) -> bool:
    """Whether ``entry`` (widen_bits's, typed for ``a``'s integer bits) takes the 16-bit
    array ``a`` itself and reads the same bits: Numba's array unboxing checks the
    item size only, so one entry point serves the array and its view.  Proved on
    ``a`` (``widened``: its widening through the view) once per signature: a Numba
    that checked the dtype would raise here, and the views stay."""
    got = np.empty_like(widened)
    try:
        entry(a, got)
    except TypeError:
        return False
    return got.tobytes() == widened.tobytes()


def _resolve(e: Decode, args: tuple) -> None:
    """``e.entry``: the compiled entry point the dispatcher chose for ``args`` (False: none)."""
    e.entry = _entry_point(e.kernel, args)


def _entry_point(kernel, args: tuple):
    """The compiled entry point of ``kernel`` (a Numba dispatcher) for ``args``' types, or
    False where it has none (the dispatcher then stays)."""
    ov = kernel.overloads.get(tuple(kernel.typeof_pyval(a) for a in args))
    return False if ov is None else ov.entry_point


def _threads() -> int:
    import numba

    if not _threads_started:
        start_threads()  # Numba's thread count starts its threading layer: ours first
    return numba.get_num_threads()


def _block_level(n: int, width: int, threads: int = 1) -> int:
    """log2 of the rows per backward block.

    About :data:`_BWD_BLOCKS_PER_THREAD` blocks per thread, at least
    ``2**TREE_G`` rows each, and at most :data:`_BWD_SCRATCH` float64
    partials in all.  The block size is
    a matter of speed only: the row tree (:mod:`.rowtree`) fixes the sums'
    order whatever the blocks are.
    """
    from polynorm.backends.rowtree import TREE_G

    per_block = max(n // (_BWD_BLOCKS_PER_THREAD * threads), n * width // _BWD_SCRATCH, 1)
    return max(TREE_G, (per_block - 1).bit_length())


def _unit_columns(a: np.ndarray) -> np.ndarray:
    """``a`` if its rows' elements are adjacent (any row stride), else a contiguous copy."""
    if a.shape[1] > 1 and a.strides[1] != a.itemsize:
        return np.ascontiguousarray(a)
    return a


def _out_rows(out) -> np.ndarray | None:
    """A numpy view of ``out`` (rows of ``x``'s dtype, checked by the front end)
    if its rows' elements are adjacent, else None (the kernels write such rows)."""
    if out is None:
        return None
    a = _interop.to_numpy(out)
    return a if a.shape[1] <= 1 or a.strides[1] == a.itemsize else None


def _backward_prepare(dy, x, weight, bias, rstd, grad_residual, plan: Plan, dx=None):
    """Kernel arguments for the backward: ``(caller, xn, dx, wn, bn, width, flags, args)``.

    ``dx``: a numpy array to write into (:func:`_out_rows`), else a new one.  It
    may be ``dy`` itself: every kernel reads an element of ``dy`` before it
    writes that element of ``dx``, and no kernel reads it after.
    """
    kernels = _kernels or _k()
    caller = x
    to_numpy = _interop.to_numpy
    # the dot's float32 partials are summed in the order LLVM vectorizes
    # them in, another for strided elements: such rows are made contiguous,
    # so that a row's bits do not depend on its layout (any row stride is fine)
    xn = _unit_columns(to_numpy(x))
    dyn = _unit_columns(to_numpy(dy))
    n, d = xn.shape
    info = _info(plan)
    cdt = info[3]
    # casting does not change the backward: no llama bit
    flags = info[0] & ~kernels.LLAMA
    dyk = _kview(dyn)
    # absent weight and bias are None: the kernels compile without their terms; an
    # absent grad_residual is a stand-in (HAS_GR unset): one kernel with and without
    w = wn = bn = None
    if weight is not None:
        wn = to_numpy(weight)
        w = _param_vector(wn, cdt)
    if bias is not None:
        bn = to_numpy(bias)
        flags |= kernels.HAS_B
    if rstd is None:
        # a placeholder of the given rstd's type: one compiled kernel either way
        rs = _no_rstd(cdt)
    else:
        flags |= kernels.HAS_RSTD
        rs = _kview(np.ascontiguousarray(to_numpy(rstd)))
    if grad_residual is not None:
        gr = _kview(to_numpy(grad_residual))
        flags |= kernels.HAS_GR
    else:
        gr = _no_grad_residual(dyk.dtype)
    if dx is None:
        empty = _empty_for(caller)
        dx = empty((n, d), xn.dtype)
    if _streams_dx(dx):
        flags |= kernels.STREAM_DX
    width = d * ((wn is not None) + (bn is not None))
    args = (dyk, _kview(xn), w, rs, gr, _kview(dx), flags, plan.k, plan.eps, plan.offset)
    return caller, xn, dx, wn, bn, width, args


def _pools(m: int, width: int, cdt: np.dtype, per_thread: bool = False):
    """Scratch pools of the backward kernel: one pair, or one per Numba thread."""
    import numba

    bwd_kernels = _bwd_kernels or _kb()
    spc, s64 = bwd_kernels.pool_shapes(m, width)
    lead = (numba.config.NUMBA_NUM_THREADS,) if per_thread else ()
    return np.empty(lead + spc, cdt), np.empty(lead + s64, np.float64)


#: Kernels' entry points for strided rows (:func:`_any_layout_entry`).
_STRIDED: dict[tuple, Any] = {}


def _any_layout_entry(kernel, call: tuple, rows: tuple[int, ...], floats: tuple[int, ...]):
    """``kernel``'s compiled entry point for the arguments ``call``, with the
    arrays at positions ``rows`` (absent ones: None) typed as any layout ("A").

    The dispatcher compiles a kernel for each mix of C and A layouts of its
    row arrays (seconds each); a call with strided rows takes this one kernel
    per dtype and option set instead (C-contiguous calls keep the
    dispatcher's, typed for C arrays).  The other scalars are typed int64,
    those at ``floats`` float64 (the entry point converts the values).
    """
    key = (kernel, *(
        (a.dtype, a.ndim, a.flags.aligned, p in rows or a.flags.c_contiguous)
        if isinstance(a, np.ndarray) else a is None for p, a in enumerate(call)))
    entry = _STRIDED.get(key)
    if entry is None:
        from numba import types

        tys = [kernel.typeof_pyval(a) if isinstance(a, np.ndarray) or a is None
               else types.float64 if p in floats else types.int64 for p, a in enumerate(call)]
        for p in rows:
            if call[p] is not None:
                tys[p] = tys[p].copy(layout="A")
        sig = tuple(tys)
        kernel.compile(sig)
        entry = _STRIDED[key] = kernel.overloads[sig].entry_point
    return entry


def _contiguous(call: tuple, rows: tuple[int, ...], lead: int = 0) -> bool:
    """Whether every array of ``call`` at positions ``lead + rows`` is C-contiguous (or None)."""
    for p in rows:
        a = call[lead + p]
        if a is not None and not a.flags.c_contiguous:
            return False
    return True


#: Positions of the backward kernels' row arrays ``dy, x, grad_residual, dx`` after their
#: ``lead`` arguments (:func:`_bwd_call`), and of ``eps, offset``.
_BWD_ROWS, _BWD_FLOATS = (0, 1, 4, 5), (8, 9)


def _bwd_call(kernel, lead: int, *call):
    """``kernel(*call)``, a backward kernel whose ``dy, x, w, rstd, grad_residual,
    dx`` start at position ``lead``; strided rows (any of ``dy``, ``x``,
    ``grad_residual``, ``dx`` not C-contiguous) through :func:`_any_layout_entry`."""
    if _contiguous(call, _BWD_ROWS, lead):
        return kernel(*call)
    return _any_layout_entry(kernel, call, tuple(lead + p for p in _BWD_ROWS),
                             tuple(lead + p for p in _BWD_FLOATS))(*call)


def backward(dy, x, weight, bias, rstd, grad_residual, plan: Plan, out=None):
    """Hand-written backward on 2-D rows (formula in :mod:`polynorm.core.options`).

    ``dweight``/``dbias`` are summed over the row tree of :mod:`.rowtree`:
    aligned blocks of ``2**m`` rows in parallel (one tree node each), then the
    block nodes pairwise.  The bits depend neither on the thread count nor
    on the blocks, and equal those of any split of the rows into ranges
    (:func:`backward_range`, used by the dask backend).
    """
    bwd_kernels = _bwd_kernels or _kb()
    dx_out = _out_rows(out)
    caller, xn, dx, wn, bn, width, args = _backward_prepare(
        dy, x, weight, bias, rstd, grad_residual, plan, dx_out)
    n, d = xn.shape
    m = _block_level(n, width, _threads())
    nb = ((n - 1) >> m) + 1
    lvl = np.empty(nb, np.int64)
    idx = np.empty(nb, np.int64)
    vals = np.empty((nb, width), np.float64)
    par = _parallel(n, d)
    cdt = _info(plan)[3]
    if par and nb > 1:
        _launch_parallel(_bwd_call, bwd_kernels.backward_blocks_parallel, 6, 0, nb, m, 0, n, n,
                         *args, lvl, idx, vals, *_pools(m, width, cdt, True))
    else:
        _bwd_call(bwd_kernels.backward_range, 5, 0, n, 0, n, m, *args, lvl, idx, vals, 0,
                  *_pools(m, width, cdt))
    dw = db = None
    if width:
        if par and width >= 4096 and nb > 1:
            _launch_parallel(bwd_kernels.tree_parallel, vals, nb)
        else:
            bwd_kernels.tree_cols(0, width, vals, nb)
        empty = _empty_for(caller)
        dw, db = finish(vals[0], d, None if wn is None else wn.dtype,
                        None if bn is None else bn.dtype, empty)
    from_numpy = _interop.from_numpy
    return (out if dx_out is not None else from_numpy(dx, caller),
            None if dw is None else from_numpy(dw, caller),
            None if db is None else from_numpy(db, caller))


class DecodeBackward:
    """A decode call signature's serial backward (:func:`decode_backward_plan`)."""

    __slots__ = ("n", "d", "m", "nb", "width", "cdt", "wv", "wdt", "bdt", "flags", "k", "eps",
                 "offset", "pc", "p64", "entry", "wide")

    def __init__(self, **kw):
        self.entry = None  # backward_range's compiled entry point (False: none), once known
        self.wide = None  # widen_bits's for a 16-bit weight (False: none), once known
        for k, v in kw.items():
            setattr(self, k, v)


def decode_backward_plan(plan: Plan, x: np.ndarray, weight, bias, rstd) -> DecodeBackward | None:
    """The constants of :func:`backward` for a serial-size call signature of 2-D numpy rows
    of unit column stride, a contiguous weight and rstd (or none), whose block level
    does not depend on the thread count; else None (:func:`backward` runs)."""
    import numba

    n, d = x.shape
    if _parallel(n, d) or _streams_dx(x):
        return None
    kernels = _kernels or _k()
    flags, _, _, cdt = _info(plan)
    flags &= ~kernels.LLAMA
    if bias is not None:
        flags |= kernels.HAS_B
    if rstd is not None:
        if not rstd.flags.c_contiguous:
            return None
        flags |= kernels.HAS_RSTD
    wv = None
    if weight is not None and weight.dtype != cdt:
        if weight.itemsize != 2 or cdt is not _F32:
            return None  # numpy's cast (_param_vector)
        wv = _bits_view(weight.dtype)
    width = d * ((weight is not None) + (bias is not None))
    m = _block_level(n, width, 1)
    if m != _block_level(n, width, numba.config.NUMBA_NUM_THREADS):
        return None
    spc, s64 = (_bwd_kernels or _kb()).pool_shapes(m, width)
    return DecodeBackward(
        n=n, d=d, m=m, nb=((n - 1) >> m) + 1, width=width, cdt=cdt, wv=wv,
        wdt=None if weight is None else weight.dtype, bdt=None if bias is None else bias.dtype,
        flags=flags, k=plan.k, eps=plan.eps, offset=plan.offset, pc=spc, p64=s64)


def backward_decode(e: DecodeBackward, dy, x, weight, bias, rstd, grad_residual):
    """:func:`backward` of a call whose signature ``e`` was prepared for: the same
    kernels and arguments, without working them out again."""
    bwd_kernels = _bwd_kernels or _kb()
    n, d, cdt, width, nb = e.n, e.d, e.cdt, e.width, e.nb
    arrays = (dy, x, grad_residual, rstd, None if e.wv is not None else weight)
    # the compiled entry point takes the arrays as they are, read-only ones too (see
    # _lean): contiguous and aligned ones, once it is known
    direct = e.entry is not False and all(
        a is None or (a.flags.c_contiguous and a.flags.aligned) for a in arrays)
    view = _bits if direct and e.entry else _kview
    if weight is None:
        w = None
    elif e.wv is None:
        w = weight if weight.flags.writeable or view is _bits else _writable_alias(weight)
    else:
        w = np.empty(d, cdt)
        if e.wide and _entry_rows(weight):
            e.wide(_bits(weight), w)  # a read-only weight as it is
        else:
            (_kernels or _k()).widen_bits(_kview(weight), w)
            if e.wide is None:
                e.wide = _widen_entry(weight, w)
    rs = _no_rstd(cdt) if rstd is None else view(rstd)
    dyk = view(dy)
    flags = e.flags
    if grad_residual is None:
        gr = _no_grad_residual(dyk.dtype)
    else:
        gr = view(grad_residual)
        flags |= (_kernels or _k()).HAS_GR
    dx = np.empty((n, d), x.dtype)
    lvl = np.empty(nb, np.int64)
    idx = np.empty(nb, np.int64)
    vals = np.empty((nb, width), np.float64)
    call = (0, n, 0, n, e.m, dyk, view(x), w, rs, gr, _bits(dx), flags, e.k, e.eps, e.offset,
            lvl, idx, vals, 0, np.empty(e.pc, cdt), np.empty(e.p64, np.float64))
    if view is _bits:
        e.entry(*call)
    else:
        kernel = bwd_kernels.backward_range
        _bwd_call(kernel, 5, *call)
        if direct:  # every array contiguous and aligned: the kernel's entry point
            e.entry = _entry_point(kernel, call)
    dw = db = None
    if width:
        bwd_kernels.tree_cols(0, width, vals, nb)
        dw, db = finish(vals[0], d, e.wdt, e.bdt)
    return dx, dw, db


def backward_range(dy, x, weight, bias, rstd, grad_residual, plan: Plan, row0: int, ntot: int):
    """The backward of rows ``row0 .. row0 + n - 1`` of ``ntot`` rows in all.

    Returns ``(dx, state)``: ``dx`` as :func:`backward` gives it, and the
    row-tree state (:mod:`.rowtree`) of this range's ``[dweight | dbias]``
    terms, which :func:`polynorm.backends.rowtree.merge` joins with the
    other ranges' and :func:`finish` rounds: the same bits as one
    :func:`backward` call on all rows.
    """
    from polynorm.backends.rowtree import TREE_G, empty_state, merge

    if weight is None and bias is None:  # nothing to sum
        return backward(dy, x, None, None, rstd, grad_residual, plan)[0], empty_state(0)
    bwd_kernels = _bwd_kernels or _kb()
    caller, xn, dx, wn, bn, width, args = _backward_prepare(
        dy, x, weight, bias, rstd, grad_residual, plan)
    n, d = xn.shape
    m = _block_level(n, width, _threads())
    mask = (1 << m) - 1
    lo, hi = row0, row0 + n
    # blocks wholly inside [lo, hi) (the last block ends at ntot), and the partial ends
    ib0 = (lo + mask) >> m
    ib1 = max(ib0, (hi >> m) if hi < ntot else ((hi + mask) >> m))
    head = (lo, min(hi, ib0 << m))
    tail = (max(ib1 << m, head[1]), hi)
    cap = 2 * (max(m, TREE_G) + 2) + 2
    cdt = _info(plan)[3]
    pools = _pools(m, width, cdt)
    states = []
    for a, b in (head, tail):
        if b > a:
            lv = np.empty(cap, np.int64)
            ix = np.empty(cap, np.int64)
            va = np.empty((cap, width), np.float64)
            cnt = _bwd_call(bwd_kernels.backward_range, 5, a, b, row0, ntot, m, *args, lv, ix,
                            va, 0, *pools)
            states.append((lv[:cnt], ix[:cnt], va[:cnt]))
    nb = ib1 - ib0
    if nb:
        lv = np.empty(nb, np.int64)
        ix = np.empty(nb, np.int64)
        va = np.empty((nb, width), np.float64)
        if _parallel(n, d) and nb > 1:
            _launch_parallel(_bwd_call, bwd_kernels.backward_blocks_parallel, 6, ib0, nb, m, row0,
                             n, ntot, *args, lv, ix, va, *_pools(m, width, cdt, True))
        else:
            for t in range(nb):
                b = ib0 + t
                _bwd_call(bwd_kernels.backward_range, 5, b << m, min(hi, (b + 1) << m), row0,
                          ntot, m, *args, lv, ix, va, t, *pools)
        states.append((lv, ix, va))
    state = merge(states, ntot, cdt)
    return _interop.from_numpy(dx, caller), state


def finish(total: np.ndarray, d: int, weight_dtype, bias_dtype, empty=np.empty):
    """``(dweight, dbias)`` from the row tree's root ``[dweight | dbias]`` (float64),
    each rounded once (by the Numba codec: no double rounding) to the given
    numpy dtype; None for an absent one."""
    bwd_kernels = _bwd_kernels or _kb()
    out = []
    col = 0
    for dt in (weight_dtype, bias_dtype):
        if dt is None:
            out.append(None)
            continue
        a = empty(d, dt)
        bwd_kernels.round_into(total[col:col + d], _kview(a))
        out.append(a)
        col += d
    return tuple(out)


# --------------------------------------------------------------------------- gated RMSNorm


#: The gated forward prefetches the next row's x and z during a row's silu pass.
GATED_PREFETCH = True


def _gated_in(a) -> np.ndarray:
    """x or z as the gated forward takes it: C-contiguous rows, 16-bit floats as bits."""
    return _kview(np.ascontiguousarray(_interop.to_numpy(a)))


class GatedDecode:
    """A gated decode call signature's compiled entry points, once known
    (:func:`gated_forward_decode`): ``entry``, the serial driver's; ``wide``,
    widen_bits's for a 16-bit weight (None: not known yet; False: none)."""

    __slots__ = ("entry", "wide")

    def __init__(self):
        self.entry = None
        self.wide = None


def _entry_rows(a) -> bool:
    """A numpy array that a compiled entry point typed for C rows takes as it is (read-only
    too: see :func:`_plain`); the entry point does not check the layout, so this does."""
    return type(a) is np.ndarray and a.flags.c_contiguous and a.flags.aligned


def _widen_entry(weight, w: np.ndarray):
    """widen_bits's compiled entry point for a 16-bit (d,) C ``weight`` widened into ``w``
    (after a call through the dispatcher has compiled it), else False."""
    if weight is None or weight.dtype.itemsize != 2 or weight.ndim != 1 or not _entry_rows(weight):
        return False
    return _entry_point((_kernels or _k()).widen_bits, (_kview(weight), w))


def _entry_vector(a: np.ndarray, cdt: np.dtype, wide) -> np.ndarray:
    """A weight as :func:`_param_vector` gives it, without a writable alias of a read-only
    one: itself in the compute dtype, a 16-bit one widened through ``wide``
    (widen_bits's entry point)."""
    if a.dtype == cdt and _entry_rows(a):
        return a
    if wide and a.dtype.itemsize == 2 and a.ndim == 1 and _entry_rows(a):
        w = np.empty(a.shape[0], cdt)
        wide(_bits(a), w)
        return w
    return _param_vector(a, cdt)


def gated_forward(x, z, weight, bias, gplan, out=None):
    """Gated forward on 2-D rows; the contract is :func:`.reference.gated_forward`.

    ``casting="llama"`` runs the reference (its three roundings are not in
    these kernels).  ``out`` of unit-stride C rows is written in place.
    """
    return _gated_forward(x, z, weight, bias, gplan, out, None)


def gated_forward_decode(decode: GatedDecode, x, z, weight, bias, gplan):
    """:func:`gated_forward` of a serial-size numpy call whose signature ``decode`` was
    made for (``polynorm.ops.gated`` keeps one per signature): its first call finds the
    driver's entry points, later calls of aligned C rows go to them with read-only
    inputs as they are (no writable alias, no dispatcher).  ``(y, rstd)``."""
    return _gated_forward(x, z, weight, bias, gplan, None, decode)


def _gated_forward(x, z, weight, bias, gplan, out, decode: GatedDecode | None):
    plan = gplan.plan
    if plan.llama:
        from polynorm.backends import reference

        return reference.gated_forward(x, z, weight, bias, gplan, out)
    from polynorm.backends.numba import gated as G

    kernels = _kernels or _k()
    caller = x
    flags, y_dt, _, cdt = _info(plan)
    flags &= kernels.EPS_INSIDE
    if gplan.norm_before_gate:
        flags |= G.NBG
    if GATED_PREFETCH:
        flags |= G.PREFETCH
    entry = (decode is not None and decode.entry and out is None and _entry_rows(x)
             and _entry_rows(z) and (weight is None or type(weight) is np.ndarray))
    if entry:
        xk, zk = _bits(x), _bits(z)
    else:
        xk, zk = _gated_in(x), _gated_in(z)
    n, d = xk.shape
    empty = _empty_for(caller)
    o = None if out is None else _interop.to_numpy(out)
    direct = o is not None and o.flags.c_contiguous and o.dtype == y_dt
    y = o if direct else empty((n, d), y_dt)
    rstd = empty((n, gplan.groups), cdt)
    if entry and weight is not None:
        w, offset = _entry_vector(weight, cdt, decode.wide), plan.offset
        b = None if bias is None else _param_vector(_interop.to_numpy(bias), cdt)
    else:
        w, b, offset = _affine(weight, bias, cdt, d, plan.offset)
    u = np.empty((1, d), cdt)  # the gated row buffer (per task in the parallel driver)
    args = (xk, zk, w, b, _kview(y), rstd, u, flags, gplan.group_size, gplan.k, plan.eps,
            offset)
    if entry:
        decode.entry(0, n, *args)
    else:
        _run_rows(G.forward_parallel, G.forward_rows, n, d, args)
        if decode is not None and decode.entry is None and not _parallel(n, d):
            decode.entry = _entry_point(G.forward_rows, (0, n, *args))
            decode.wide = _widen_entry(weight, w)
    from_numpy = _interop.from_numpy
    if o is not None:
        if not direct:
            o[...] = y
        return out, from_numpy(rstd, caller)
    return from_numpy(y, caller), from_numpy(rstd, caller)


def gated_backward(dy, x, z, weight, bias, rstd, gplan):
    """Gated backward on 2-D rows; ``dweight``/``dbias`` in the row tree's order."""
    from polynorm.backends.numba import gated as G

    kernels = _kernels or _k()
    plan = gplan.plan
    caller = x
    cdt = numpy_dtype(plan.compute_dtype)
    xn, zn = _interop.to_numpy(x), _interop.to_numpy(z)
    xk, zk, dyk = _gated_in(xn), _gated_in(zn), _gated_in(dy)
    n, d = xk.shape
    empty = _empty_for(caller)
    dx = empty((n, d), xn.dtype)
    dz = empty((n, d), zn.dtype)
    lw = np.empty((n, d), cdt)  # written also without weight (then dropped): one kernel variant
    lb = np.empty((n, d) if bias is not None else (1, 1), cdt)
    flags = kernels.EPS_INSIDE if plan.eps_inside else 0
    if gplan.norm_before_gate:
        flags |= G.NBG
    if weight is not None:
        flags |= kernels.HAS_W
    if bias is not None:
        flags |= kernels.HAS_B
    # absent weight/bias as ones/zeros: they change no value, and one loop serves all cases
    w = np.ones(d, cdt) if weight is None else _param_vector(_interop.to_numpy(weight), cdt)
    b = np.zeros(d, cdt) if bias is None else _param_vector(_interop.to_numpy(bias), cdt)
    if rstd is None:
        r = np.empty((1, 1), cdt)
    else:
        flags |= kernels.HAS_RSTD
        r = _kview(np.ascontiguousarray(_interop.to_numpy(rstd), dtype=cdt))
    buf = np.empty((4, d), cdt)
    # offset scales only a weight: ones stand in for an absent one, with no offset
    args = (dyk, xk, zk, w, b, r, _kview(dx), _kview(dz), lw, lb, buf, flags, gplan.group_size,
            gplan.k, plan.eps, plan.offset if weight is not None else 0.0)
    _run_rows(G.backward_parallel, G.backward_rows, n, d, args)
    from_numpy = _interop.from_numpy
    dw = db = None
    if weight is not None:
        dw = from_numpy(G.tree_sum(lw).astype(_interop.to_numpy(weight).dtype), caller)
    if bias is not None:
        db = from_numpy(G.tree_sum(lb).astype(_interop.to_numpy(bias).dtype), caller)
    return from_numpy(dx, caller), from_numpy(dz, caller), dw, db


# --------------------------------------------------------------------------- quantized output


def _wrap_q(q: np.ndarray, caller, qdtype: str):
    """``q`` (uint8 bits) as the caller's array of the quantized format."""
    if qdtype == "int8":
        return _interop.from_numpy(q.view(np.int8), caller)
    if type(caller) is np.ndarray:
        import ml_dtypes

        return q.view(getattr(ml_dtypes, qdtype))
    lib = type(caller).__module__.split(".")[0]
    if lib == "torch":
        import torch

        return torch.from_numpy(q).view(getattr(torch, qdtype))
    import jax
    import jax.numpy as jnp

    return jax.lax.bitcast_convert_type(_interop.from_numpy(q, caller), getattr(jnp, qdtype))


_NO_H: dict[np.dtype, np.ndarray] = {}


def _stand_in_h(dt: np.dtype) -> np.ndarray:
    a = _NO_H.get(dt)
    if a is None:
        a = _NO_H[dt] = np.empty((1, 1), dt)
    return a


#: The serial quantized driver's compiled entry points (and widen_bits's for a 16-bit
#: weight) for calls with read-only inputs, by the facts of the arguments' Numba types
#: that vary (:func:`quant_forward`): such inputs then go to it as they are (no writable
#: alias, no dispatcher).
_QUANT_ENTRIES: dict = {}


def _layout_key(a) -> tuple:
    """The facts of an array's Numba type besides its rank: dtype and layout."""
    f = a.flags
    return a.dtype, a.ndim, f.c_contiguous, f.f_contiguous


def _all_writable(*arrays) -> bool:
    return all(a is None or a.flags.writeable for a in arrays)


def _aligned(*arrays) -> bool:
    return all(a is None or a.flags.aligned for a in arrays)


def quant_forward(x, residual, weight, bias, qplan, scale=None):
    """Quantized forward on 2-D rows; the contract is :func:`.reference.quant_forward`.

    One kernel pass per token (:mod:`.numba.quant`); ``casting="llama"``
    runs :func:`forward` into float32 rows first and quantizes those.
    """
    from polynorm.backends.numba import quant as Q

    kernels = _kernels or _k()
    plan = qplan.plan
    caller = x
    n, d = x.shape
    empty = _empty_for(caller)
    if qplan.static:
        s = qplan.scale if scale is None else float(np.asarray(_interop.to_numpy(scale)
                                                              ).reshape(()))
        s32 = np.float32(s)
    else:
        s32 = np.float32(1.0)
    q = empty((n, d), np.uint8)
    sc = np.empty((n, qplan.groups), np.float32) if not qplan.static else np.empty((1, 1),
                                                                                   np.float32)
    qargs = (s32, qplan.group_size, np.float32(qplan.qmax), Q.FMT[qplan.qdtype],
             qplan.reciprocal, qplan.static)
    h = None
    if plan.llama:
        y, h, _ = forward(x, residual, weight, bias, plan)
        yn = np.ascontiguousarray(_interop.to_numpy(y))
        Q.quantize_y_rows(0, n, yn, q, sc, *qargs)
    else:
        xn = _interop.to_numpy(x)
        if xn.shape[1] > 1 and xn.strides[1] != xn.itemsize:
            xn = np.ascontiguousarray(xn)
        flags, _, h_dt, cdt = _info(plan)
        rn = None
        if residual is not None:
            rn = _interop.to_numpy(residual)
            if rn.shape[1] > 1 and rn.strides[1] != rn.itemsize:
                rn = np.ascontiguousarray(rn)
        # read-only inputs: the serial driver's entry point for their types, once known
        key = entry = None
        wn = None if weight is None else _interop.to_numpy(weight)
        bn = None if bias is None else _interop.to_numpy(bias)
        if not _parallel(n, d) and not _all_writable(xn, rn, wn, bn):
            key = (_layout_key(xn), None if rn is None else _layout_key(rn),
                   None if wn is None else _layout_key(wn), bn is None,
                   qplan.group_size is None, cdt)
            entry = _QUANT_ENTRIES.get(key)
            if entry and not _aligned(xn, rn, wn):
                entry = None
        xk = _bits(xn) if entry else _kview(xn)
        rk, hk = xk, _stand_in_h(xk.dtype)  # h must be writable (a jax x is not)
        if rn is not None:
            h = empty((n, d), h_dt)
            flags |= kernels.HAS_R
            rk, hk = (_bits(rn) if entry else _kview(rn)), _kview(h)
        if entry and wn is not None:
            w, offset = _entry_vector(wn, cdt, entry[1]), plan.offset
            b = None if bn is None else _param_vector(bn, cdt)
        else:
            w, b, offset = _affine(wn, bn, cdt, d, plan.offset)
        args = (xk, rk, w, b, hk, q, sc, np.empty(d, np.float32), np.empty(1, cdt), flags,
                plan.k, plan.eps, offset, *qargs)
        if entry:
            entry[0](0, n, *args)
        else:
            _run_rows(Q.quant_parallel, Q.quant_rows, n, d, args)
            if key is not None and _aligned(xn, rn, wn):
                _QUANT_ENTRIES[key] = (_entry_point(Q.quant_rows, (0, n, *args)),
                                       _widen_entry(wn, w))
        h = None if h is None else _interop.from_numpy(h, caller)
    if qplan.static:
        scales = _interop.from_numpy(np.asarray(s32, np.float32).reshape(()), caller)
    else:
        scales = _interop.from_numpy(sc, caller)
    return _wrap_q(q, caller, qplan.qdtype), scales, h


class QuantDecode:
    """A quantized decode call signature's constant arguments and compiled entry points
    (:func:`quant_decode_plan`), for :func:`quant_forward_decode`."""

    __slots__ = ("n", "d", "cdt", "h_dt", "flags", "k", "eps", "offset", "qargs", "q_dt",
                 "groups", "ones", "no_h", "static_scale", "entry", "wide")

    def __init__(self, **kw):
        self.entry = None  # quant_rows's compiled entry point, once known (False: none)
        self.wide = None  # widen_bits's for a 16-bit weight (False: none), once known
        for k, v in kw.items():
            setattr(self, k, v)


def quant_decode_plan(qplan, x: np.ndarray, residual, weight, bias) -> QuantDecode | None:
    """The prepared serial quantized forward of a call signature: 2-D numpy rows of unit
    column stride below :data:`SERIAL_MAX_ELEMENTS`, not llama, a number or no scale,
    weight/bias of unit stride in the compute dtype or 16-bit (widened); else None
    (:func:`quant_forward` runs).  ``polynorm.ops.quant`` keeps one per signature."""
    from polynorm.backends.numba import quant as Q

    plan = qplan.plan
    n, d = x.shape
    if plan.llama or (qplan.static and qplan.scale is None) or _parallel(n, d):
        return None  # casting="llama", an array scale, a parallel call: quant_forward
    flags, _, h_dt, cdt = _info(plan)
    for a in (x, residual):
        if a is not None and d > 1 and a.strides[1] != a.itemsize:
            return None  # copied to unit columns first: quant_forward
    for a in (weight, bias):
        if a is not None and ((d > 1 and a.strides[0] != a.itemsize)
                              or (a.dtype != cdt and (a.itemsize != 2 or cdt is not _F32))):
            return None  # another cast or layout: quant_forward's _param_vector
    if residual is not None:
        flags |= (_kernels or _k()).HAS_R
    s32 = np.float32(qplan.scale if qplan.static else 1.0)
    return QuantDecode(
        n=n, d=d, cdt=cdt, h_dt=h_dt, flags=flags, k=plan.k, eps=plan.eps,
        offset=0.0 if weight is None else plan.offset,
        q_dt=_wrap_q(np.empty(0, np.uint8), x, qplan.qdtype).dtype, groups=qplan.groups,
        no_h=_stand_in_h(_kview(x).dtype), ones=_ones(d, cdt) if weight is None else None,
        static_scale=np.asarray(s32, np.float32).reshape(()) if qplan.static else None,
        qargs=(s32, qplan.group_size, np.float32(qplan.qmax), Q.FMT[qplan.qdtype],
               qplan.reciprocal, qplan.static))


def quant_forward_decode(e: QuantDecode, x, residual, weight, bias):
    """:func:`quant_forward` of a numpy call whose signature ``e`` was prepared for:
    ``(q, scales, h)``.  Its first call runs the serial driver through the dispatcher
    and finds its entry point; later calls of aligned C rows go to that with every input
    as it is (read-only too: no writable alias), without working the constants out
    again."""
    n, d, cdt = e.n, e.d, e.cdt
    entry = e.entry
    if entry and not (_entry_rows(x) and (residual is None or _entry_rows(residual))
                      and (weight is None or type(weight) is np.ndarray)):
        entry = None
    view = _bits if entry else _kview
    xk = view(x)
    rk, hk, h = xk, e.no_h, None  # h must be writable (a jax x is not)
    if residual is not None:
        h = np.empty((n, d), e.h_dt)
        rk, hk = view(residual), _kview(h)
    if weight is None:
        w = e.ones
    elif entry:
        w = _entry_vector(weight, cdt, e.wide)
    else:
        w = _param_vector(weight, cdt)
    b = None if bias is None else _param_vector(bias, cdt)
    q = np.empty((n, d), np.uint8)
    static = e.static_scale is not None
    sc = np.empty((1, 1) if static else (n, e.groups), np.float32)
    args = (xk, rk, w, b, hk, q, sc, np.empty(d, np.float32), np.empty(1, cdt), e.flags,
            e.k, e.eps, e.offset, *e.qargs)
    if entry:
        entry(0, n, *args)
    else:
        from polynorm.backends.numba import quant as Q

        Q.quant_rows(0, n, *args)
        if e.entry is None and _entry_rows(x) and (residual is None or _entry_rows(residual)):
            e.entry = _entry_point(Q.quant_rows, (0, n, *args))
            e.wide = _widen_entry(weight, w)
    return q.view(e.q_dt), (e.static_scale.copy() if static else sc), h  # the caller's own


# --------------------------------------------------------------------------- split hidden axis

_split_kernels = None


def _ks():
    global _split_kernels
    if _split_kernels is None:
        from polynorm.backends.numba import split as _numba_split

        _split_kernels = _numba_split
    return _split_kernels


def _unit_rows(x: np.ndarray) -> np.ndarray:
    if x.shape[1] > 1 and x.strides[1] != x.itemsize:
        return np.ascontiguousarray(x)  # the row reductions take adjacent elements
    return x


def split_stats(x, plan: Plan):
    """One shard's per-row float64 sum of squares (:mod:`.numba.split`), in ``x``'s library."""
    caller = x
    x = _unit_rows(_interop.to_numpy(x))
    n, d = x.shape
    ss = _empty_for(caller)(n, _F64)
    ks = _ks()
    # every element of the shard (the split refuses pRMSNorm): d, not plan.k, so that a
    # dask block of a wider row sums its own columns
    _run_rows(ks.stats_parallel, ks.stats_rows, n, d, (_kview(x), ss, d))
    return _interop.from_numpy(ss, caller)


def split_forward(x, weight, bias, sumsq, k_total: int, plan: Plan):
    """``(y, rstd)`` of one shard's rows from the whole rows' float64 ``sumsq``
    (fp32 casting; the front end sends llama casting to the reference)."""
    caller = x
    to_numpy = _interop.to_numpy
    x = _unit_rows(to_numpy(x))
    n, d = x.shape
    flags, y_dt, _, cdt = _info(plan)
    empty = _empty_for(caller)
    y = empty((n, d), y_dt)
    rstd = empty(n, cdt)
    ss = np.ascontiguousarray(to_numpy(sumsq), _F64)
    w, b, offset = _affine(weight, bias, cdt, d, plan.offset)
    ks = _ks()
    args = (_kview(x), w, b, _kview(y), rstd, _kview(ss), flags, k_total, plan.eps, offset)
    _run_rows(ks.given_parallel, ks.given_rows, n, d, args)
    from_numpy = _interop.from_numpy
    return from_numpy(y, caller), from_numpy(rstd, caller)


# --------------------------------------------------------------------------- casting="none"

#: this backend runs ``casting="none"`` (:mod:`.numba.none`); the front end sends such
#: calls of a backend without it to the reference
CASTING_NONE = True


def none_forward(x, residual, weight, bias, plan: Plan, out=None):
    """``casting="none"`` forward on 2-D rows (:data:`polynorm.core.options.NONE_CASTING`).

    The fused add runs on the reference (``h``, then the mode's steps).  ``out`` of
    C rows and ``plan.out_dtype`` is written in place.
    """
    from polynorm.backends import reference
    from polynorm.backends.numba import none as N
    from polynorm.backends.numba.codec import FORMAT_CODE
    from polynorm.core.dtypes import dtype_name
    from polynorm.core.options import compute_dtype, promote

    if residual is not None:
        return reference.forward(x, residual, weight, bias, plan, out)
    caller = x
    to_numpy = _interop.to_numpy
    xn = np.ascontiguousarray(to_numpy(x))
    n, d = xn.shape
    _, y_dt, _, cdt = _info(plan)
    tname = plan.norm_dtype
    pname = bname = tname
    g = bb = None
    flags = N.EPS_INSIDE if plan.eps_inside else 0
    if weight is not None:
        wn = to_numpy(weight)
        pname = bname = promote(tname, dtype_name(wn.dtype))
        pc = numpy_dtype(compute_dtype(pname))
        off = float(np.asarray(plan.offset, numpy_dtype(tname)))
        g = (wn.astype(pc) + pc.type(off)).astype(numpy_dtype(pname))
    if bias is not None:
        bn = to_numpy(bias)
        bname = promote(pname, dtype_name(bn.dtype))
        flags |= N.HAS_B
    # the row's product and bias sum in one type: float64 where either needs it
    wide = numpy_dtype(compute_dtype(promote(compute_dtype(tname), compute_dtype(bname))))
    g = np.ones(d, wide) if g is None else np.ascontiguousarray(g, wide)
    bb = np.zeros(1, wide) if bias is None else np.ascontiguousarray(bn, wide)
    o = None if out is None else to_numpy(out)
    direct = o is not None and o.flags.c_contiguous and o.dtype == y_dt
    y = o if direct else _empty_for(caller)((n, d), y_dt)
    rstd = _empty_for(caller)(n, cdt)
    eps = float(np.asarray(plan.eps, numpy_dtype(tname)))
    args = (_kview(xn), g, bb, _kview(y), rstd, plan.k, cdt.type(plan.k), cdt.type(1),
            cdt.type(eps), FORMAT_CODE[tname], FORMAT_CODE[pname], FORMAT_CODE[bname], flags)
    _run_rows(N.forward_parallel, N.forward_rows, n, d, args)
    from_numpy = _interop.from_numpy
    if o is not None:
        if not direct:
            o[...] = y
        return out, None, from_numpy(rstd, caller)
    return from_numpy(y, caller), None, from_numpy(rstd, caller)


# --------------------------------------------------------------------------- QK-norm (+ RoPE)

_qk_kernels = None


def _kq():
    global _qk_kernels
    if _qk_kernels is None:
        from polynorm.backends.numba import qk as _numba_qk

        _qk_kernels = _numba_qk
    return _qk_kernels


def qk_forward(x, weight, plan: Plan, rope, out=None):
    """QK-norm (+ RoPE) of ``(T, H, D)`` heads (:class:`polynorm.backends.QKKernels`).

    ``out`` may be ``x`` itself (any strides): the kernel runs in place on it;
    a last axis that is not contiguous runs on a contiguous copy written back.
    Without ``out`` the heads are copied first and the copy returned.
    """
    kq = _kq()
    caller = x
    to_numpy = _interop.to_numpy
    xn = to_numpy(x)
    t, h, d = xn.shape
    flags, _, _, cdt = _info(plan)
    inplace = out is not None and xn.strides[2] == xn.itemsize
    if inplace:
        y = to_numpy(out)
    else:
        y = np.empty((t, h, d), xn.dtype)
        y[...] = xn
    w, _, offset = _affine(weight, None, cdt, d, plan.offset, exact=plan.llama)
    if plan.llama:
        flags |= _llama_codes(plan, None if weight is None else to_numpy(weight))
    if rope is None:
        cs, neox = np.empty((0, 0), cdt), True
    else:
        cs, neox = np.ascontiguousarray(to_numpy(rope[0]), cdt), bool(rope[1])
    yk, h0, h1 = _qk_c_view(_kview(y))
    args = (yk, h0, h1, w, np.empty(yk.shape[1], cdt), flags, plan.k, plan.eps, offset, cs, neox)
    if plan.llama:
        _run_rows(kq.qk_llama_parallel, kq.qk_llama_rows, t, h * d, args)
    elif xn.dtype.itemsize == 2:
        _run_rows(kq.qk_bits_parallel, kq.qk_bits_rows, t, h * d, args)
    else:
        _run_rows(kq.qk_parallel, kq.qk_rows, t, h * d, args)
    if out is not None:
        if not inplace:
            to_numpy(out)[...] = y
        return out
    return _interop.from_numpy(y, caller)


def _qk_c_view(y: np.ndarray) -> tuple:
    """``(x, h0, h1)``: heads ``[h0, h1)`` of a C-contiguous ``(T, H', D)`` array over the
    memory of ``y``'s ``(T, H, D)`` heads where its token stride is a whole number of
    heads (a packed qkv's q or k view), else ``y`` itself with ``[0, H)``.

    Numba compiles the row loops for a C-contiguous array with unit strides known
    (vectorized, as the plain forward's rows); on the strided view's "A" layout they
    run about twice as long.  The wider view reaches past ``y``'s last token by
    ``H' - H`` heads, which the kernels never read or write (their head range is
    ``[0, H)``; a prefetch of the next row does not fault).
    """
    t, h, d = y.shape
    it = y.itemsize
    st, sh, sd = y.strides
    if t < 2 or d < 1 or sd != it or sh != d * it or st < h * d * it or st % (d * it):
        return y, 0, h
    wide = st // (d * it)
    return np.lib.stride_tricks.as_strided(y, (t, wide, d), (st, sh, sd)), 0, h


@functools.lru_cache(maxsize=8)
def _ones_heads(heads: int, d: int, cdt: np.dtype) -> np.ndarray:
    """:func:`_ones` for per-head weights: the ``(heads, d)`` weight of a call with
    only a per-head bias (shared, never written)."""
    return np.ones((heads, d), cdt)


def _param_rows(a, cdt: np.dtype) -> np.ndarray:
    """An ``(heads, d)`` weight/bias as :func:`_param_vector` makes a ``(d,)`` one (the
    same values: one conversion of the flattened array)."""
    a = _interop.to_numpy(a)
    if a.dtype == cdt and a.flags.c_contiguous and a.flags.writeable:
        return a
    return _param_vector(a.reshape(-1), cdt).reshape(a.shape)


_heads_module: list = []


def _heads_kernels():
    """:mod:`.numba.heads`, imported on first use (its drivers compile only when called)."""
    if not _heads_module:
        from polynorm.backends.numba import heads

        _heads_module.append(heads)
    return _heads_module[0]


def forward_heads_small(x: np.ndarray, residual, weight, bias, plan: Plan):
    """:func:`forward_heads` of small C-contiguous numpy rows (serial size, not llama,
    not ``casting="none"``) into new arrays: the same kernel and arguments, less
    the Python (the front end's numpy fast path for per-head decode calls)."""
    kh = _heads_module[0] if _heads_module else _heads_kernels()
    flags, y_dt, h_dt, cdt = _info(plan)
    n, d = x.shape
    y = np.empty((n, d), y_dt)
    rstd = np.empty(n, cdt)
    offset = plan.offset
    if weight is None:
        w, offset = _ones_heads(bias.shape[0], d, cdt), 0.0
    else:
        w = _param_rows(weight, cdt)
    b = None if bias is None else _param_rows(bias, cdt)
    xk = x if x.dtype.itemsize != 2 and x.flags.writeable else _kview(x)
    yk = y if y_dt.itemsize != 2 else _kview(y)
    if residual is None:
        h = hk = r = None
        rows = kh.forward_heads_bits_rows if xk.dtype.itemsize == 2 else kh.forward_heads_rows
    else:
        h = np.empty((n, d), h_dt)
        hk, r = _kview(h), _kview(residual)
        rows = kh.forward_heads_add_rows
    rows(0, n, xk, r, w, b, yk, hk, rstd, flags, plan.k, plan.eps, offset, None)
    return y, h, rstd


def forward_heads(x, residual, weight, bias, plan: Plan, out=None, h_out=None):
    """:func:`forward` with per-head weights in one kernel call: ``x`` (and
    ``residual``, ``out``) ``(t * heads, d)`` rows, ``weight``/``bias`` ``(heads, d)``
    (either may be None); row ``i`` takes weight row ``i % heads``
    (:mod:`.numba.heads`), the bits of :func:`forward` on that row with that
    weight row.  ``h_out`` (rows of ``plan.norm_dtype``, possibly ``residual``
    itself) receives ``h`` as in :func:`forward_into` (alias-safe by the same row
    order).  Returns ``(y, h, rstd)``; None, before any write, for plans the
    per-head drivers do not take (llama casting, ``casting="none"``) and an
    ``h_out`` of non-adjacent columns: the caller runs head by head."""
    if plan.llama or plan.cast_none:
        return None
    hn = None if h_out is None else _interop.to_numpy(h_out)
    if hn is not None and hn.shape[1] > 1 and hn.strides[1] != hn.itemsize:
        return None
    kh = _heads_kernels()
    caller = x
    to_numpy = _interop.to_numpy
    x = to_numpy(x)
    if residual is None and x.shape[1] > 1 and x.strides[1] != x.itemsize:
        x = np.ascontiguousarray(x)  # _unit_columns, as forward
    n, d = x.shape
    flags, y_dt, h_dt, cdt = _info(plan)
    empty = _empty_for(caller)
    y = empty((n, d), y_dt) if out is None else to_numpy(out)
    rstd = empty(n, cdt)
    xk, yk = _kview(x), _kview(y)
    h = r = hk = None
    if residual is not None:
        h = empty((n, d), h_dt) if hn is None else hn
        r = _kview(to_numpy(residual))
        hk = _kview(h)
    wide = weight if weight is not None else bias
    heads = wide.shape[0]
    offset = plan.offset
    if weight is None:
        w, offset = _ones_heads(heads, d, cdt), 0.0
    else:
        w = _param_rows(weight, cdt)
    b = None if bias is None else _param_rows(bias, cdt)
    args = (xk, r, w, b, yk, hk, rstd, flags, plan.k, plan.eps, offset, None)
    _run_rows(*kh.forward_heads_kernels(residual is not None, xk.dtype.itemsize == 2), n, d,
              args)
    from_numpy = _interop.from_numpy
    return (out if out is not None else from_numpy(y, caller),
            h_out if h_out is not None else None if h is None else from_numpy(h, caller),
            from_numpy(rstd, caller))
