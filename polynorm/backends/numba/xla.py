"""The plain forward as a compiled XLA FFI handler: a Numba ``cfunc``, no Python per call.

:mod:`polynorm.jax.ffi`'s handler is Python (ctypes): each call takes the GIL,
wraps XLA's buffers as numpy arrays and runs the front end, ~15-60 us before
the kernel starts, several times a (1, 4096) forward.  The handler here is
machine code that reads the call frame (``xla/ffi/api/c_api.h``, API 0.1
fields only, the layout :mod:`polynorm.jax.ffi` declares with ctypes) and runs
the same serial or parallel driver as :func:`polynorm.backends.numba.forward`
(the size rule :func:`~polynorm.backends.numba._parallel`) on XLA's own
buffers: the eager call's bits, at the cost of the custom call itself.

:func:`rstd_handler` is the same for ``rstd`` alone (:func:`~polynorm.backends.numba.kernels.rstd_rows`),
for calls whose elementwise pass XLA runs (``polynorm.jax.norm._xla_elementwise``), and
:func:`huge_page_handler` a buffer on huge pages that XLA gives that pass for a large
output (``polynorm.jax.norm._on_huge_pages``).  :func:`row_sum_handler`,
:func:`row_stats_handler` and :func:`row_dot_handler` are the jitted reference's row sums,
row statistics and backward row dots, in a fixed order (``polynorm.backends.reference``'s
``ROW_SUMS``, ``ROW_STATS``, ``ROW_DOTS``).

:func:`handler` takes the plain forward only (no residual, not llama, not
``casting="none"``, no ``group_size``), ``x`` as 2-D rows, ``weight`` and
``bias`` as ``(d,)`` vectors already in the compute dtype (absent: ones / none),
results ``y`` (``(n, d)``, any float dtype the kernels store) and ``rstd``
(``(n,)``, the compute dtype); ``flags``, ``k``, ``eps`` and ``offset`` are the
call's attributes, in this order (XLA sorts them by name: ``a_flags``,
``b_k``, ``c_eps``, ``d_offset``).  One handler per (x, y, compute dtype,
bias or not), compiled on first use and cached on disk (:func:`_compiled`).  A
handler's kernels are compiled once, into its row-chunk function, which the handler
and the pool's tasks call by address (:func:`_pool`).

Threads: a call of at least ``POOL_MIN_ELEMENTS`` is cut into row chunks that the
handler's thread and tasks scheduled on XLA's own thread pool (the FFI
``ThreadPool_Schedule`` API) claim one at a time, so the work runs on the
threads that run the rest of the computation, not on an OpenMP team beside
them, whose spinning threads and XLA's descheduled each other.  The handler waits only for chunks
that a running task has claimed (XLA may run a task late, or on the caller's
thread), yielding a few times, then asleep on a futex that the task finishing the
last chunk wakes (``_YIELDS_BEFORE_SLEEP``); the job record is freed by whoever
leaves it last.  A row's bits do not depend on the chunking (the serial and
parallel drivers' rule).
"""

from __future__ import annotations

import functools
import hashlib
import platform
import sys

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import caching, cgutils
from numba.extending import intrinsic

from polynorm.backends import numba as _nb

_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_METADATA = 1  # XLA_FFI_Extension_Metadata

#: byte offsets in XLA_FFI_CallFrame (64-bit)
_EXT, _API, _CTX, _STAGE = 8, 16, 24, 32
_ARGS_PTRS, _RETS_PTRS, _ATTRS_PTRS = 72, 112, 160
#: in XLA_FFI_Buffer
_DATA, _RANK, _DIMS = 24, 32, 40
#: in XLA_FFI_Api: its struct_size, Error_Destroy, ThreadPool_Schedule, ThreadPool_NumThreads
_API_SIZE, _ERROR_DESTROY, _SCHEDULE, _NUM_THREADS = 0, 64, 136, 144

#: the job record shared by a call's handler and tasks (int64 words; see _pool): _NEXT is
#: the share of the next task to start (see _MAX_SHARES), _DONE the chunks run
_NEXT, _DONE, _REFS, _CHUNKS, _PER, _N, _D = 0, 1, 2, 3, 4, 5, 6
_X, _W, _B, _Y, _R, _FLAGS, _K, _EPS, _OFFSET = 7, 8, 9, 10, 11, 12, 13, 14, 15
_SCRATCH = 16  # five words: the argument structs of the FFI calls
_WAITING = 21  # non-zero once the handler sleeps until the last chunk is done
_SHARES = 22  # the number of shares (0: a serial run's record)
_CHUNK_FN = 23  # the address of the handler's compiled chunk function (see _pool)
_JOB_WORDS = 24  # then a pool's job record has one counter a share: its chunks not yet claimed
#: madvise's MADV_HUGEPAGE (Linux), the huge page size, and numpy's size rule for asking it
_MADV_HUGEPAGE, _HUGE, _HUGE_MIN_BYTES = 14, 2 << 20, 4 << 20
#: calls of at least this many elements run on XLA's thread pool (read when a handler is
#: compiled): the backend's rule for its own threads.  Smaller calls lose more waiting
#: for a sleeping pool thread to wake than the split saves.
POOL_MIN_ELEMENTS = _nb.SERIAL_MAX_ELEMENTS
#: the same for the row statistics (:func:`rstd_handler`, :func:`row_sum_handler`): they
#: read each element once and write one value per row, a quarter of the forward's work per
#: element, so a split pays from four times the size (float32, d = 4096: from 64 rows;
#: bench/results/jax-stat-pool-2026-12-06.txt)
STAT_POOL_MIN_ELEMENTS = 4 * POOL_MIN_ELEMENTS
#: elements per chunk at least: the 16-bit drivers prepare the weight once per call
_CHUNK_MIN_ELEMENTS = 1 << 14
#: row chunks per pool thread: small enough that a thread scheduled late finds work left
_CHUNKS_PER_THREAD = 8
#: The chunks are dealt in contiguous shares, one a thread (the handler's thread the
#: first), as XLA partitions a loop fusion over its pool; a thread runs its own share's
#: chunks last first, then takes the others' from their far ends.  A handler's input is
#: often such a fusion's output (``h`` of a residual stream), so a thread reads rows
#: that it wrote, from its own cache, and a late thread's work still gets done.  With
#: chunks claimed in one sequence by all threads, half the rows came from the other
#: core's cache, several times slower where the cores' caches are apart (the ``g_``
#: columns of ``python bench/jax_stat_pool.py``).  At most this many shares (threads
#: beyond them start on a share modulo this; 1: every thread claims from one sequence):
_MAX_SHARES = 64
#: the handler's waits for chunks that pool tasks run: yields first, then (Linux) a futex
#: sleep on the job's ``_DONE`` word, which the task finishing the last chunk wakes.  A
#: yielding thread keeps its core busy, so a task preempted there (XLA's threads
#: outnumber the cores when executions overlap) is not pulled to it; a sleeping one
#: frees the core.  The sleep is capped (``_WAIT_NS``) so that a missed wake costs that
#: much, never a hang.
_YIELDS_BEFORE_SLEEP = 64
_WAIT_NS = 1_000_000
#: ``SYS_futex`` of the machine (0: none known, the handler only yields)
_SYS_FUTEX = ({"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower(), 0) if sys.platform == "linux" else 0)
_FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE = 128, 129

@intrinsic
def _word(typingctx, addr):
    """The int64 at address ``addr``."""
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load(p)

    return types.int64(types.int64), codegen


@intrinsic
def _int32(typingctx, addr):
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        return builder.sext(builder.load(p), ir.IntType(64))

    return types.int64(types.int64), codegen


@intrinsic
def _double(typingctx, addr):
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.DoubleType().as_pointer())
        return builder.load(p)

    return types.float64(types.int64), codegen


@intrinsic
def _put_int32(typingctx, addr, v):
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        builder.store(builder.trunc(args[1], ir.IntType(32)), p)
        return context.get_dummy_value()

    return types.none(types.int64, types.int64), codegen


@intrinsic
def _address(typingctx, p):
    def codegen(context, builder, sig, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return types.int64(types.voidptr), codegen


@intrinsic
def _pointer(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


def _store(llvm_type, numba_type):
    """An intrinsic ``(addr, v)`` that stores ``v`` as ``llvm_type`` at address ``addr``."""
    @intrinsic
    def put(typingctx, addr, v):
        def codegen(context, builder, sig, args):
            builder.store(args[1], builder.inttoptr(args[0], llvm_type.as_pointer()))
            return context.get_dummy_value()

        return types.none(types.int64, numba_type), codegen

    return put


_put_word = _store(ir.IntType(64), types.int64)
_put_double = _store(ir.DoubleType(), types.float64)


@intrinsic
def _fetch_add(typingctx, addr, v):
    """Atomically add ``v`` to the int64 at ``addr``; the value before."""
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", p, args[1], "seq_cst")

    return types.int64(types.int64, types.int64), codegen


@intrinsic
def _load_acquire(typingctx, addr):
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load_atomic(p, "acquire", 8)

    return types.int64(types.int64), codegen


@intrinsic
def _load_seq_cst(typingctx, addr):
    """The int64 at ``addr``, sequentially consistent (the futex handshake's loads: each
    side's store then load must not both miss the other's store)."""
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load_atomic(p, "seq_cst", 8)

    return types.int64(types.int64), codegen


@intrinsic
def _futex(typingctx, addr, op, val, timeout_ns):
    """``futex(addr, op, val, timeout)`` (Linux ``syscall(SYS_futex, ...)``) on the low 32
    bits of the int64 at ``addr``; ``timeout_ns`` bounds a wait (relative)."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_i64, [_i64], var_arg=True), "syscall")
        ts = cgutils.alloca_once(builder, ir.ArrayType(_i64, 2))
        builder.store(builder.sdiv(args[3], ir.Constant(_i64, 1_000_000_000)),
                      builder.gep(ts, [ir.Constant(i32, 0), ir.Constant(i32, 0)]))
        builder.store(builder.srem(args[3], ir.Constant(_i64, 1_000_000_000)),
                      builder.gep(ts, [ir.Constant(i32, 0), ir.Constant(i32, 1)]))
        builder.call(fn, [ir.Constant(_i64, _SYS_FUTEX), builder.inttoptr(args[0], _i8p),
                          builder.trunc(args[1], i32), builder.trunc(args[2], i32),
                          builder.bitcast(ts, _i8p), ir.Constant(_i8p, None),
                          ir.Constant(i32, 0)])
        return context.get_dummy_value()

    return types.none(types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def _call_ffi(typingctx, fn, arg):
    """``fn(arg)`` for an XLA FFI API function (``XLA_FFI_Error* (Args*)``); the error's address."""
    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        f = builder.inttoptr(args[0], ir.FunctionType(i8p, [i8p]).as_pointer())
        return builder.ptrtoint(builder.call(f, [builder.inttoptr(args[1], i8p)]),
                                ir.IntType(64))

    return types.int64(types.int64, types.int64), codegen


_i64 = ir.IntType(64)
_i8p = ir.IntType(8).as_pointer()


@intrinsic
def _call_chunk(typingctx, fn, job, lo, hi):
    """``fn(job, lo, hi)`` for a compiled row-chunk function (``void (int64, int64, int64)``,
    see :func:`_pool`): a call, never inlined, so the kernels compile once per handler."""
    def codegen(context, builder, sig, args):
        f = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [_i64] * 3).as_pointer())
        builder.call(f, list(args[1:]))
        return context.get_dummy_value()

    return types.none(types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def _job_record(typingctx):
    """The address of a job record (``_JOB_WORDS`` words) in the calling function's frame."""
    def codegen(context, builder, sig, args):
        rec = cgutils.alloca_once(builder, ir.ArrayType(_i64, _JOB_WORDS))
        return builder.ptrtoint(rec, _i64)

    return types.int64(), codegen


@intrinsic
def _malloc(typingctx, size):
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_i8p, [_i64]),
                                            "malloc")
        return builder.ptrtoint(builder.call(fn, [args[0]]), _i64)

    return types.int64(types.int64), codegen


@intrinsic
def _free(typingctx, addr):
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module,
                                            ir.FunctionType(ir.VoidType(), [_i8p]), "free")
        builder.call(fn, [builder.inttoptr(args[0], _i8p)])
        return context.get_dummy_value()

    return types.none(types.int64), codegen


@intrinsic
def _madvise(typingctx, addr, size, advice):
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), [_i8p, _i64, ir.IntType(32)]),
            "madvise")
        builder.call(fn, [builder.inttoptr(args[0], _i8p), args[1],
                          builder.trunc(args[2], ir.IntType(32))])
        return context.get_dummy_value()

    return types.none(types.int64, types.int64, types.int64), codegen


@njit(nogil=True)
def _huge_pages(addr, size):
    """Ask for transparent huge pages under the 2 MiB-aligned interior of ``[addr, addr +
    size)``: an output that XLA's allocator hands out as fresh pages on every call then
    faults in once per 2 MiB, not once per 4 KiB (numpy's rule for its own arrays)."""
    if size < _HUGE_MIN_BYTES:
        return
    lo = (addr + _HUGE - 1) // _HUGE * _HUGE
    hi = (addr + size) // _HUGE * _HUGE
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_HUGEPAGE)


@intrinsic
def _yield_cpu(typingctx):
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                            "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@njit(nogil=True)
def _int_attr(attrs, i):
    """The ``i``-th attribute (by name) of a call frame's ``attrs``, an int64
    (XLA_FFI_Scalar {dtype, value*})."""
    return _word(_word(_word(attrs + 8 * i) + 8))


@njit(nogil=True)
def _float_attr(attrs, i):
    """The ``i``-th attribute (by name) of a call frame's ``attrs``, a float64."""
    return _double(_word(_word(attrs + 8 * i) + 8))


@njit(nogil=True)
def _rows(buf):
    """The product of an XLA_FFI_Buffer's dimensions but the last (1 for a vector)."""
    dims = _word(buf + _DIMS)
    r = 1
    for i in range(_word(buf + _RANK) - 1):
        r *= _word(dims + 8 * i)
    return r


@njit(nogil=True)
def _last_dim(buf):
    return _word(_word(buf + _DIMS) + 8 * (_word(buf + _RANK) - 1))


def _bits_type(dt: np.dtype):
    """The element type the kernels take for ``dt`` (16-bit floats as their bits)."""
    view = _nb._bits_view(dt)
    return np.dtype(view if view is not None else dt)


@njit(nogil=True)
def _pool_threads(f, api, scratch):
    """The size of XLA's thread pool for this call (0: no pool, or an older API);
    ``scratch``: five words for the call's argument struct and result."""
    if _word(api + _API_SIZE) < _NUM_THREADS + 8:
        return 0
    _put_word(scratch, 32)  # XLA_FFI_ThreadPool_NumThreads_Args
    _put_word(scratch + 8, 0)
    _put_word(scratch + 16, _word(f + _CTX))
    _put_word(scratch + 24, scratch + 32)
    _put_word(scratch + 32, 0)
    err = _call_ffi(_word(api + _NUM_THREADS), scratch)
    if err != 0:
        _destroy(api, scratch, err)
        return 0
    return _word(scratch + 32)


@njit(nogil=True)
def _wait_done(job, chunks):
    """Until ``job``'s ``_DONE`` word reaches ``chunks``: yields, then futex sleeps (see
    ``_YIELDS_BEFORE_SLEEP``)."""
    yields = 0
    while _load_acquire(job + 8 * _DONE) < chunks:
        if yields < _YIELDS_BEFORE_SLEEP or _SYS_FUTEX == 0:
            _yield_cpu()
            yields += 1
            continue
        _fetch_add(job + 8 * _WAITING, 1)  # a full barrier before the load, as the task's
        done = _load_seq_cst(job + 8 * _DONE)  # _DONE increment before its _WAITING load
        if done >= chunks:
            break
        _futex(job + 8 * _DONE, _FUTEX_WAIT_PRIVATE, done, _WAIT_NS)


@njit(nogil=True)
def _claim(job, share):
    """The next chunk of ``job`` for the thread of ``share`` (see ``_MAX_SHARES``), -1 when
    every chunk is claimed."""
    chunks, shares = _word(job + 8 * _CHUNKS), _word(job + 8 * _SHARES)
    for t in range(shares):
        q = (share + t) % shares
        left = _fetch_add(job + 8 * (_JOB_WORDS + q), -1)
        if left > 0:
            return _share_start(q, chunks, shares) + left - 1
    return -1


@njit(nogil=True)
def _share_start(q, chunks, shares):
    """The first chunk of share ``q`` of ``chunks`` dealt in ``shares``."""
    return q * chunks // shares


def _pool(chunk, key: tuple):
    """``(run_pooled, run_serial, run_chunk, compiled)`` for the row-chunk function
    ``chunk(job, lo, hi)`` (njit) of the handler ``key`` (:func:`_compiled`):

    - ``run_pooled(f, n, d, x, w, b, y, r, flags, k, eps, offset)`` runs rows ``[0, n)``
      in chunks on XLA's pool and the calling thread (the job record's words, see the
      module; the chunks in shares, see ``_MAX_SHARES``), False where there is no pool
      of two threads or more (or no memory for the job record);
    - ``run_serial(n, d, x, w, b, y, r, flags, k, eps, offset)`` runs them on the calling
      thread (a job record of ``_SHARES`` 0 in its frame);
    - ``run_chunk(job, lo, hi)`` calls the compiled ``chunk``;
    - ``compiled``: the cfuncs to keep alive with the handler.

    ``chunk`` is compiled once, as a function of its own that the handler and the
    pool's task (one for every handler, :func:`_pool_runtime`) call by address: linked
    into both, its kernels would compile twice.
    """
    def chunk_entry(job, lo, hi):
        chunk(job, lo, hi)

    chunk_fn = _compiled(chunk_entry, types.void(types.int64, types.int64, types.int64),
                         ("chunk", *key))
    chunk_address = _symbol_address("polynorm_xla_chunk_" + _digest(key)[:32], chunk_fn)
    pooled, task_fn = _pool_runtime(_knobs())

    @njit(nogil=True)
    def run_chunk(job, lo, hi):
        _call_chunk(chunk_address(), job, lo, hi)

    @njit(nogil=True)
    def run_serial(n, d, xd, wd, bd, yd, rd, flags, kk, eps, offset):
        job = _job_record()
        for i, v in ((_N, n), (_D, d), (_X, xd), (_W, wd), (_B, bd), (_Y, yd), (_R, rd),
                     (_FLAGS, flags), (_K, kk), (_SHARES, 0)):
            _put_word(job + 8 * i, v)
        _put_double(job + 8 * _EPS, eps)
        _put_double(job + 8 * _OFFSET, offset)
        run_chunk(job, 0, n)

    @njit(nogil=True)
    def run_pooled(f, n, d, xd, wd, bd, yd, rd, flags, kk, eps, offset):
        return pooled(f, chunk_address(), n, d, xd, wd, bd, yd, rd, flags, kk, eps, offset)

    return run_pooled, run_serial, run_chunk, (chunk_fn, task_fn)


def _symbol_address(name: str, fn):
    """An intrinsic ``() -> int64`` of the compiled ``fn``'s address, given to LLVM as the
    symbol ``name``: the address reaches a handler's code by name, resolved when that code
    is loaded (a number compiled in would be stale in the next process that loads it
    from disk)."""
    llvm.add_symbol(name, fn.address)
    return _function_address(name)


@functools.cache
def _pool_runtime(knobs: tuple):
    """``(pooled, task cfunc)``, every handler's (compiled once for the module's knob
    values, :func:`_knobs`): ``pooled(f, chunk, n, d, x, w, b, y, r, flags, k, eps,
    offset)`` is :func:`_pool`'s ``run_pooled`` of the compiled chunk function at address
    ``chunk`` (the job record's ``_CHUNK_FN``), which the pool's tasks call."""

    @njit(nogil=True)
    def run_chunks(job, share):
        """Claim and run row chunks of ``job``, ``share``'s first, until none is left."""
        n, per, chunks = _word(job + 8 * _N), _word(job + 8 * _PER), _word(job + 8 * _CHUNKS)
        fn = _word(job + 8 * _CHUNK_FN)
        c = _claim(job, share)
        while c >= 0:
            lo = c * per
            _call_chunk(fn, job, lo, min(lo + per, n))
            if (_fetch_add(job + 8 * _DONE, 1) == chunks - 1 and _SYS_FUTEX != 0
                    and _load_seq_cst(job + 8 * _WAITING) != 0):
                _futex(job + 8 * _DONE, _FUTEX_WAKE_PRIVATE, 1, 0)
            c = _claim(job, share)

    def task(data):
        job = _address(data)
        run_chunks(job, _fetch_add(job + 8 * _NEXT, 1))
        if _fetch_add(job + 8 * _REFS, -1) == 1:
            _free(job)

    task_fn = _compiled(task, types.void(types.voidptr), ("task",))
    task_address = _symbol_address("polynorm_xla_task_" + _digest(knobs)[:32], task_fn)

    @njit(nogil=True)
    def pooled(f, chunk_fn, n, d, xd, wd, bd, yd, rd, flags, kk, eps, offset):
        job = _malloc(8 * (_JOB_WORDS + _MAX_SHARES))
        if job == 0:
            return False
        api = _word(f + _API)
        threads = _pool_threads(f, api, job + 8 * _SCRATCH)
        if threads < 2:
            _free(job)
            return False
        chunks = max(1, min(n, _CHUNKS_PER_THREAD * threads, n * d // _CHUNK_MIN_ELEMENTS))
        per = (n + chunks - 1) // chunks
        chunks = (n + per - 1) // per
        shares = min(threads, chunks, _MAX_SHARES)
        tasks = min(threads - 1, chunks - 1)
        for i, v in ((_NEXT, 1), (_DONE, 0), (_WAITING, 0), (_REFS, 1 + tasks), (_CHUNKS, chunks),
                     (_PER, per), (_N, n), (_D, d), (_X, xd), (_W, wd), (_B, bd), (_Y, yd),
                     (_R, rd), (_FLAGS, flags), (_K, kk), (_SHARES, shares),
                     (_CHUNK_FN, chunk_fn)):
            _put_word(job + 8 * i, v)
        for q in range(shares):
            _put_word(job + 8 * (_JOB_WORDS + q), _share_start(q + 1, chunks, shares)
                      - _share_start(q, chunks, shares))
        _put_double(job + 8 * _EPS, eps)
        _put_double(job + 8 * _OFFSET, offset)
        args = job + 8 * _SCRATCH  # XLA_FFI_ThreadPool_Schedule_Args
        for _ in range(tasks):
            _put_word(args, 40)
            _put_word(args + 8, 0)
            _put_word(args + 16, _word(f + _CTX))
            _put_word(args + 24, task_address())
            _put_word(args + 32, job)
            err = _call_ffi(_word(api + _SCHEDULE), args)
            if err != 0:  # not scheduled: its reference is dropped here
                _destroy(api, args, err)
                _fetch_add(job + 8 * _REFS, -1)
        run_chunks(job, 0)
        # every chunk is claimed; the ones still running finish on their threads
        _wait_done(job, chunks)
        if _fetch_add(job + 8 * _REFS, -1) == 1:
            _free(job)
        return True

    return pooled, task_fn


@functools.cache
def handler(x_dtype: str, y_dtype: str, compute_dtype: str, has_bias: bool) -> int:
    """The address of the compiled handler for these dtypes (see the module)."""
    from polynorm.core.dtypes import numpy_dtype

    k = _nb._k()
    xt = _bits_type(numpy_dtype(x_dtype))
    yt = _bits_type(numpy_dtype(y_dtype))
    ct = numpy_dtype(compute_dtype)
    rows = k.forward_bits_rows if xt.itemsize == 2 else k.forward_rows
    pool_min = POOL_MIN_ELEMENTS
    huge_pages = sys.platform == "linux"
    xsize, ysize, csize = xt.itemsize, yt.itemsize, ct.itemsize

    @njit(nogil=True)
    def chunk(job, lo, hi):
        n, d = _word(job + 8 * _N), _word(job + 8 * _D)
        x = carray(_pointer(_word(job + 8 * _X)), (n, d), xt)
        w = carray(_pointer(_word(job + 8 * _W)), (d,), ct)
        y = carray(_pointer(_word(job + 8 * _Y)), (n, d), yt)
        rstd = carray(_pointer(_word(job + 8 * _R)), (n,), ct)
        flags, kk = _word(job + 8 * _FLAGS), _word(job + 8 * _K)
        eps, offset = _double(job + 8 * _EPS), _double(job + 8 * _OFFSET)
        bd = _word(job + 8 * _B)
        if bd != 0:
            b = carray(_pointer(bd), (d,), ct)
            rows(lo, hi, x, None, w, b, y, None, rstd, flags, kk, eps, offset, None)
        else:
            rows(lo, hi, x, None, w, None, y, None, rstd, flags, kk, eps, offset, None)

    key = ("forward", x_dtype, y_dtype, compute_dtype, has_bias)
    run_pooled, run_serial, _, compiled = _pool(chunk, key)

    def run(frame):
        f = _address(frame)
        if not _executes(f):
            return _pointer(0)
        args = _word(f + _ARGS_PTRS)
        rets = _word(f + _RETS_PTRS)
        attrs = _word(f + _ATTRS_PTRS)
        xb, wb, yb = _word(args), _word(args + 8), _word(rets)
        d = _last_dim(xb)
        rx, bw, ry = _rows(xb), _rows(wb), _rows(yb)
        if ry == 0:
            return _pointer(0)
        bb = _rows(_word(args + 16)) if has_bias else 1
        # attributes by name: a_flags, b_k, c_eps, d_offset
        flags, kk = _int_attr(attrs, 0), _int_attr(attrs, 1)
        eps, offset = _float_attr(attrs, 2), _float_attr(attrs, 3)
        # under vmap ("expand_dims") every batched operand leads with the batch axis:
        # batch element i is rows [i*c, (i+1)*c) of y, of x where x is batched (else
        # all of x), and row i of a batched weight or bias
        nb = max(bw, bb, ry // rx)
        c = ry // nb
        xd, wd, yd = _word(xb + _DATA), _word(wb + _DATA), _word(yb + _DATA)
        rd = _word(_word(rets + 8) + _DATA)
        bd = _word(_word(args + 16) + _DATA) if has_bias else 0
        if huge_pages:
            _huge_pages(yd, ry * d * ysize)
        if nb == 1 and c >= 2 and c * d >= pool_min and run_pooled(
                f, c, d, xd, wd, bd, yd, rd, flags, kk, eps, offset):
            return _pointer(0)
        for i in range(nb):
            run_serial(c, d, xd + (i * c * d * xsize if rx == ry else 0),
                       wd + (i * d * csize if bw > 1 else 0),
                       bd + (i * d * csize if has_bias and bb > 1 else 0),
                       yd + i * c * d * ysize, rd + i * c * csize, flags, kk, eps, offset)
        return _pointer(0)

    return _handler_address(run, key, compiled)


@njit(nogil=True)
def _executes(f):
    """Whether the call frame at ``f`` asks for the computation; else it is XLA's question
    of the API version (answered here: 0.1, no traits) or another stage."""
    ext = _word(f + _EXT)
    if ext != 0 and _int32(ext + 8) == _METADATA:
        md = _word(ext + 24)  # XLA_FFI_Metadata*: api_version {size, ext, major, minor}
        _put_int32(md + 24, 0)
        _put_int32(md + 28, 1)
        _put_int32(md + 32, 0)  # traits
        return False
    return _int32(f + _STAGE) == _EXECUTE


def _row_stat_handler(stat, attrs: int, key: tuple) -> int:
    """The address of a compiled handler of one value per row: argument ``x`` (rows: every
    axis but the last, also under ``vmap``), result ``(rows,)``; ``stat(lo, hi, x address,
    result address, rows, d, flags, k, eps, extra)`` (njit) fills rows ``[lo, hi)``, with
    the first ``attrs`` of the attributes ``a_flags``, ``b_k``, ``c_eps``, ``d_`` (a float:
    ``extra``), else 0.  Calls of ``STAT_POOL_MIN_ELEMENTS`` and more in row chunks on
    XLA's pool, as :func:`handler`'s."""
    pool_min = STAT_POOL_MIN_ELEMENTS

    @njit(nogil=True)
    def chunk(job, lo, hi):
        stat(lo, hi, _word(job + 8 * _X), _word(job + 8 * _R), _word(job + 8 * _N),
             _word(job + 8 * _D), _word(job + 8 * _FLAGS), _word(job + 8 * _K),
             _double(job + 8 * _EPS), _double(job + 8 * _OFFSET))

    run_pooled, run_serial, _, compiled = _pool(chunk, key)

    def run(frame):
        f = _address(frame)
        if not _executes(f):
            return _pointer(0)
        xb, rb = _word(_word(f + _ARGS_PTRS)), _word(_word(f + _RETS_PTRS))
        n, d = _rows(xb), _last_dim(xb)
        flags, kk, eps, extra = 0, 0, 0.0, 0.0
        if attrs:
            a = _word(f + _ATTRS_PTRS)
            flags, kk, eps = _int_attr(a, 0), _int_attr(a, 1), _float_attr(a, 2)
            if attrs > 3:
                extra = _float_attr(a, 3)
        xd, rd = _word(xb + _DATA), _word(rb + _DATA)
        if n == 0 or (n >= 2 and n * d >= pool_min and run_pooled(
                f, n, d, xd, 0, 0, 0, rd, flags, kk, eps, extra)):
            return _pointer(0)
        run_serial(n, d, xd, 0, 0, 0, rd, flags, kk, eps, extra)
        return _pointer(0)

    return _handler_address(run, key, compiled)


@functools.cache
def rstd_handler(x_dtype: str, compute_dtype: str) -> int:
    """The address of the compiled handler of ``rstd`` alone
    (:func:`polynorm.backends.numba.kernels.rstd_rows`, the forward's bits): argument
    ``x``, result ``rstd`` in the compute dtype; attributes ``a_flags``, ``b_k``,
    ``c_eps`` (:func:`_row_stat_handler`)."""
    from polynorm.core.dtypes import numpy_dtype

    rows = _nb._k().rstd_rows
    xt = _bits_type(numpy_dtype(x_dtype))
    ct = numpy_dtype(compute_dtype)

    @njit(nogil=True)
    def stat(lo, hi, xd, rd, n, d, flags, kk, eps, extra):
        rows(lo, hi, carray(_pointer(xd), (n, d), xt), carray(_pointer(rd), (n,), ct),
             flags, kk, eps)

    return _row_stat_handler(stat, 3, ("rstd", x_dtype, compute_dtype))


@functools.cache
def row_sum_handler(dtype: str, square: bool) -> int:
    """The address of the compiled handler of row sums in a fixed order
    (:func:`polynorm.backends.numba.kernels.row_sum_rows`): argument ``a`` (float32 or
    float64), result its row sums, of its squares where ``square``, in ``a``'s dtype
    (:func:`_row_stat_handler`)."""
    from polynorm.core.dtypes import numpy_dtype

    rows = _nb._k().row_sum_rows
    t = numpy_dtype(dtype)

    @njit(nogil=True)
    def stat(lo, hi, ad, od, n, d, flags, kk, eps, extra):
        out = carray(_pointer(od), (n,), t)
        if d == 0:
            out[lo:hi] = 0
        else:
            rows(lo, hi, carray(_pointer(ad), (n, d), t), out, square)

    return _row_stat_handler(stat, 0, ("row_sum", dtype, square))


@functools.cache
def scale_handler(x_dtype: str, compute_dtype: str, has_weight: bool) -> int:
    """The address of the compiled handler of the jitted reference's elementwise pass
    (:func:`polynorm.backends.numba.kernels.scale_rows`): arguments ``x`` (rows: every
    axis but the last; 16-bit), ``r`` (``(rows,)``) and, where ``has_weight``, ``g``
    (``(d,)``: ``weight + offset``), both in the compute dtype; result ``y`` (``x``'s
    dtype), asked for huge pages as :func:`handler`'s.  Calls of ``POOL_MIN_ELEMENTS``
    and more in row chunks on XLA's pool."""
    from polynorm.core.dtypes import numpy_dtype

    rows = _nb._k().scale_rows
    xt = _bits_type(numpy_dtype(x_dtype))
    ct = numpy_dtype(compute_dtype)
    pool_min = POOL_MIN_ELEMENTS
    huge_pages = sys.platform == "linux"
    xsize = xt.itemsize

    @njit(nogil=True)
    def chunk(job, lo, hi):
        n, d = _word(job + 8 * _N), _word(job + 8 * _D)
        x = carray(_pointer(_word(job + 8 * _X)), (n, d), xt)
        r = carray(_pointer(_word(job + 8 * _R)), (n,), ct)
        y = carray(_pointer(_word(job + 8 * _Y)), (n, d), xt)
        if has_weight:
            rows(lo, hi, x, r, carray(_pointer(_word(job + 8 * _W)), (d,), ct), y)
        else:
            rows(lo, hi, x, r, None, y)

    key = ("scale", x_dtype, compute_dtype, has_weight)
    run_pooled, run_serial, _, compiled = _pool(chunk, key)

    def run(frame):
        f = _address(frame)
        if not _executes(f):
            return _pointer(0)
        args = _word(f + _ARGS_PTRS)
        xb = _word(args)
        n, d = _rows(xb), _last_dim(xb)
        if n == 0:
            return _pointer(0)
        xd, rd = _word(xb + _DATA), _word(_word(args + 8) + _DATA)
        wd = _word(_word(args + 16) + _DATA) if has_weight else 0
        yd = _word(_word(_word(f + _RETS_PTRS)) + _DATA)
        if huge_pages:
            _huge_pages(yd, n * d * xsize)
        if n >= 2 and n * d >= pool_min and run_pooled(
                f, n, d, xd, wd, 0, yd, rd, 0, 0, 0.0, 0.0):
            return _pointer(0)
        run_serial(n, d, xd, wd, 0, yd, rd, 0, 0, 0.0, 0.0)
        return _pointer(0)

    return _handler_address(run, key, compiled)


@functools.cache
def row_stats_handler(dtype: str) -> int:
    """The address of the compiled handler of the jitted reference's row statistics
    (:func:`polynorm.backends.numba.kernels.row_stats_rows`): argument ``a`` (rows: every
    axis but the last, also under ``vmap``; float32/float64, or 16-bit), results ``ss``,
    ``m``, ``ss2`` (float64 for float64 ``a``, else float32); attribute ``a_floor``.
    Calls of ``STAT_POOL_MIN_ELEMENTS`` and more in row chunks on XLA's pool, as
    :func:`handler`'s."""
    from polynorm.core.dtypes import numpy_dtype

    rows = _nb._k().row_stats_rows
    t = _bits_type(numpy_dtype(dtype))
    ct = np.dtype(np.float64 if t == np.float64 else np.float32)
    pool_min = STAT_POOL_MIN_ELEMENTS

    @njit(nogil=True)
    def stats(lo, hi, n, d, ad, sd, md, s2d, floor):
        rows(lo, hi, carray(_pointer(ad), (n, d), t), carray(_pointer(sd), (n,), ct),
             carray(_pointer(md), (n,), ct), carray(_pointer(s2d), (n,), ct), floor)

    @njit(nogil=True)
    def chunk(job, lo, hi):
        stats(lo, hi, _word(job + 8 * _N), _word(job + 8 * _D), _word(job + 8 * _X),
              _word(job + 8 * _R), _word(job + 8 * _Y), _word(job + 8 * _W),
              _double(job + 8 * _EPS))

    key = ("row_stats", dtype)
    run_pooled, run_serial, _, compiled = _pool(chunk, key)

    def run(frame):
        f = _address(frame)
        if not _executes(f):
            return _pointer(0)
        ab = _word(_word(f + _ARGS_PTRS))
        rets = _word(f + _RETS_PTRS)
        n, d = _rows(ab), _last_dim(ab)
        if n == 0:
            return _pointer(0)
        floor = _float_attr(_word(f + _ATTRS_PTRS), 0)
        ad = _word(ab + _DATA)
        sd, md = _word(_word(rets) + _DATA), _word(_word(rets + 8) + _DATA)
        s2d = _word(_word(rets + 16) + _DATA)
        if n >= 2 and n * d >= pool_min and run_pooled(
                f, n, d, ad, s2d, 0, md, sd, 0, 0, floor, 0.0):
            return _pointer(0)
        run_serial(n, d, ad, s2d, 0, md, sd, 0, 0, floor, 0.0)
        return _pointer(0)

    return _handler_address(run, key, compiled)


@functools.cache
def reference_rstd_handler(dtype: str) -> int:
    """The address of the compiled handler of the jitted reference's ``rstd``
    (:func:`polynorm.backends.numba.kernels.reference_rstd_rows`): argument ``a`` as
    :func:`row_stats_handler` takes it (its first ``k`` columns), result ``rstd``
    (float64 for float64 ``a``, else float32); attributes ``a_flags`` (``EPS_INSIDE``),
    ``b_k``, ``c_eps``, ``d_floor`` (:func:`_row_stat_handler`)."""
    from polynorm.core.dtypes import numpy_dtype

    rows = _nb._k().reference_rstd_rows
    t = _bits_type(numpy_dtype(dtype))
    ct = np.dtype(np.float64 if t == np.float64 else np.float32)

    @njit(nogil=True)
    def stat(lo, hi, ad, rd, n, d, flags, kk, eps, floor):
        rows(lo, hi, carray(_pointer(ad), (n, d), t), carray(_pointer(rd), (n,), ct),
             flags, kk, eps, floor)

    return _row_stat_handler(stat, 4, ("reference_rstd", dtype))


@functools.cache
def row_dot_handler(dy_dtype: str, x_dtype: str, compute_dtype: str, has_scale: bool) -> int:
    """The address of the compiled handler of the jitted reference backward's row dots
    (:func:`polynorm.backends.numba.kernels.row_dot_rows`): arguments ``dy``, ``x``
    (rows), ``r`` (``(rows,)``) and, where ``has_scale``, ``wo`` (``(d,)``), the last two
    in the compute dtype; result ``(rows,)`` in the compute dtype (one ``wo`` for all
    rows: a ``vmap`` loops over calls).  Calls of ``STAT_POOL_MIN_ELEMENTS`` and more in row chunks
    on XLA's pool, as :func:`handler`'s."""
    from polynorm.core.dtypes import numpy_dtype

    rows = _nb._k().row_dot_rows
    dyt, xt = _bits_type(numpy_dtype(dy_dtype)), _bits_type(numpy_dtype(x_dtype))
    ct = numpy_dtype(compute_dtype)
    pool_min = STAT_POOL_MIN_ELEMENTS

    @njit(nogil=True)
    def dots(lo, hi, n, d, dyd, xd, rd, wd, od):
        dy = carray(_pointer(dyd), (n, d), dyt)
        x = carray(_pointer(xd), (n, d), xt)
        r = carray(_pointer(rd), (n,), ct)
        out = carray(_pointer(od), (n,), ct)
        if has_scale:
            rows(lo, hi, dy, x, r, carray(_pointer(wd), (d,), ct), out)
        else:
            rows(lo, hi, dy, x, r, None, out)

    @njit(nogil=True)
    def chunk(job, lo, hi):
        dots(lo, hi, _word(job + 8 * _N), _word(job + 8 * _D), _word(job + 8 * _B),
             _word(job + 8 * _X), _word(job + 8 * _Y), _word(job + 8 * _W),
             _word(job + 8 * _R))

    key = ("row_dot", dy_dtype, x_dtype, compute_dtype, has_scale)
    run_pooled, run_serial, _, compiled = _pool(chunk, key)

    def run(frame):
        f = _address(frame)
        if not _executes(f):
            return _pointer(0)
        args = _word(f + _ARGS_PTRS)
        dyb, xb, rb = _word(args), _word(args + 8), _word(args + 16)
        n, d = _rows(xb), _last_dim(xb)
        if n == 0:
            return _pointer(0)
        dyd, xd, rd = _word(dyb + _DATA), _word(xb + _DATA), _word(rb + _DATA)
        wd = _word(_word(args + 24) + _DATA) if has_scale else 0
        od = _word(_word(_word(f + _RETS_PTRS)) + _DATA)
        if n >= 2 and n * d >= pool_min and run_pooled(
                f, n, d, xd, wd, dyd, rd, od, 0, 0, 0.0, 0.0):
            return _pointer(0)
        run_serial(n, d, xd, wd, dyd, rd, od, 0, 0, 0.0, 0.0)
        return _pointer(0)

    return _handler_address(run, key, compiled)


@functools.cache
def huge_page_handler() -> int:
    """The address of the compiled handler that asks for huge pages under its first
    result, ``a_bytes`` (attribute) bytes that it leaves unwritten, and sets its second,
    an int32 scalar, to 1.

    XLA gives a fused elementwise pass that reads such a buffer (``select(flag, y,
    buffer)``, ``polynorm.jax.norm._on_huge_pages``) that buffer for its output, so
    the pass writes ``y`` on huge pages (:func:`_huge_pages`), where the program's output
    is otherwise fresh 4 KiB pages on every call; its reads of the buffer before that
    find the zero page.
    """
    linux = sys.platform == "linux"

    def run(frame):
        f = _address(frame)
        if not _executes(f):
            return _pointer(0)
        rets = _word(f + _RETS_PTRS)
        if linux:
            _huge_pages(_word(_word(rets) + _DATA), _int_attr(_word(f + _ATTRS_PTRS), 0))
        _put_int32(_word(_word(rets + 8) + _DATA), 1)
        return _pointer(0)

    return _handler_address(run, ("huge_pages",))


#: words at the head of the backward's scratch (:func:`backward_handler`; its job record's
#: ``_B`` word points to it): rows, block level, ``[dweight | dbias]`` width, dy, the
#: row-tree slots (levels, indices, values) of the call's blocks, the serial run's pools,
#: a flag set by a chunk that found no memory for its pools (its blocks then run again,
#: serially, on those), and grad_residual
_BN, _BM, _BWIDTH, _BDY, _BLVL, _BIDX, _BVALS, _BPC, _BP64, _BUNDONE, _BGR = range(11)
_BWORDS = 11


def backward_level(n: int, width: int) -> int:
    """The block level of :func:`backward_handler`'s rows (the backend's rule for its own
    threads, :func:`polynorm.backends.numba._block_level`: a matter of speed only)."""
    return _nb._block_level(n, width, numba.config.NUMBA_NUM_THREADS)


def _backward_pools(m: int, width: int, csize: int) -> tuple[int, int, int, int]:
    """``(rows of pc, rows of p64, columns)`` of the backward kernels' scratch pools and
    their bytes in all (``pool_shapes``)."""
    (pc_rows, cols), (p64_rows, _) = _nb._kb().pool_shapes(m, width)
    return pc_rows, p64_rows, cols, _up64(pc_rows * cols * csize) + p64_rows * cols * 8


@njit(nogil=True)
def _up64(nbytes):
    """``nbytes`` rounded up to a whole 64-byte line (the float64 pool's start)."""
    return (nbytes + 63) // 64 * 64


def backward_scratch_bytes(n: int, d: int, width: int, m: int, compute_dtype: str,
                           weight_dtype: str | None = None) -> int:
    """The bytes of :func:`backward_handler`'s scratch result for ``n`` rows of ``d``
    (and a weight of ``weight_dtype``: a 16-bit one is widened there)."""
    from polynorm.core.dtypes import numpy_dtype

    nb = ((n - 1) >> m) + 1
    csize = numpy_dtype(compute_dtype).itemsize
    pools = _backward_pools(m, width, csize)[3]
    wide = _up64(d * csize) if widens_weight(weight_dtype) else 0
    return _up64(8 * (_BWORDS + _JOB_WORDS) + 16 * nb + 8 * nb * width) + _up64(pools) + wide


def widens_weight(weight_dtype: str | None) -> bool:
    """Whether :func:`backward_handler` takes the weight in ``weight_dtype`` and widens it
    to the compute dtype itself (16-bit weights: exact, and one XLA pass fewer than a
    convert before the call), rather than in the compute dtype."""
    from polynorm.core.dtypes import numpy_dtype

    return weight_dtype is not None and numpy_dtype(weight_dtype).itemsize == 2


@functools.cache
def backward_handler(x_dtype: str, dy_dtype: str, compute_dtype: str, weight_dtype,
                     bias_dtype) -> int:
    """The address of the compiled handler of the plain backward
    (:func:`polynorm.backends.numba.backward`'s kernels and row tree: its bits).

    Arguments ``dy``, ``x`` (rows: every axis but the last), ``weight`` (``(d,)`` in
    the compute dtype, or in its own where :func:`widens_weight`; only where
    ``weight_dtype``), the forward's ``rstd`` and, where
    the flags have ``HAS_GR``, ``grad_residual`` (``dy``'s dtype: one compiled handler
    with and without); results
    ``dx`` (``x``'s dtype), ``dweight`` and ``dbias`` in their dtypes where given, and a
    scratch buffer of :func:`backward_scratch_bytes`; attributes ``a_flags``
    (``HAS_RSTD``, ``HAS_B``, ``HAS_GR`` set as the backend sets them), ``b_k``, ``c_eps``,
    ``d_offset``, ``e_level`` (:func:`backward_level`).  The rows' aligned blocks
    (:mod:`polynorm.backends.rowtree`) run in chunks on XLA's pool from
    ``POOL_MIN_ELEMENTS`` on; their nodes are summed pairwise after, and the bits
    depend on neither.
    """
    from polynorm.core.dtypes import numpy_dtype

    kb = _nb._kb()
    range_kernel, tree_cols, round_into = kb.backward_range, kb.tree_cols, kb.round_into
    xt = _bits_type(numpy_dtype(x_dtype))
    dyt = _bits_type(numpy_dtype(dy_dtype))
    ct = numpy_dtype(compute_dtype)
    has_w, has_b = weight_dtype is not None, bias_dtype is not None
    has_gr_flag = _nb._k().HAS_GR
    wt = _bits_type(numpy_dtype(weight_dtype)) if has_w else ct
    bt = _bits_type(numpy_dtype(bias_dtype)) if has_b else ct
    wide = widens_weight(weight_dtype)
    widen = _nb._k().widen_bits
    pool_min = POOL_MIN_ELEMENTS
    csize = ct.itemsize
    # the pools' shapes as numba-compiled arithmetic: pool_shapes(m, width)
    pc_rows, _, pad, _ = _backward_pools(0, 0, csize)
    tree_g = _nb._kb().TREE_G

    @njit(nogil=True)
    def p64_rows(m):
        return max(m, tree_g) - tree_g + 2

    @njit(nogil=True)
    def run_blocks(job, lo, hi, pcd, p64d):
        """Blocks ``[lo, hi)`` of the call: their dx and one row-tree node each."""
        rec, d = _word(job + 8 * _B), _word(job + 8 * _D)
        n, m, width = _word(rec + 8 * _BN), _word(rec + 8 * _BM), _word(rec + 8 * _BWIDTH)
        nb = ((n - 1) >> m) + 1
        dy = carray(_pointer(_word(rec + 8 * _BDY)), (n, d), dyt)
        x = carray(_pointer(_word(job + 8 * _X)), (n, d), xt)
        dx = carray(_pointer(_word(job + 8 * _Y)), (n, d), xt)
        rstd = carray(_pointer(_word(job + 8 * _R)), (n,), ct)
        if _word(rec + 8 * _BGR) != 0:
            gr = carray(_pointer(_word(rec + 8 * _BGR)), (n, d), dyt)
        else:  # HAS_GR unset: never read
            gr = carray(_pointer(_word(rec + 8 * _BDY)), (1, 1), dyt)
        lvl = carray(_pointer(_word(rec + 8 * _BLVL)), (nb,), np.int64)
        idx = carray(_pointer(_word(rec + 8 * _BIDX)), (nb,), np.int64)
        vals = carray(_pointer(_word(rec + 8 * _BVALS)), (nb, width), np.float64)
        cols = width + pad
        pc = carray(_pointer(pcd), (pc_rows, cols), ct)
        p64 = carray(_pointer(p64d), (p64_rows(m), cols), np.float64)
        flags, kk = _word(job + 8 * _FLAGS), _word(job + 8 * _K)
        eps, offset = _double(job + 8 * _EPS), _double(job + 8 * _OFFSET)
        for b in range(lo, hi):
            if has_w:
                w = carray(_pointer(_word(job + 8 * _W)), (d,), ct)
                range_kernel(b << m, min(n, (b + 1) << m), 0, n, m, dy, x, w, rstd, gr, dx,
                             flags, kk, eps, offset, lvl, idx, vals, b, pc, p64)
            else:
                range_kernel(b << m, min(n, (b + 1) << m), 0, n, m, dy, x, None, rstd, gr, dx,
                             flags, kk, eps, offset, lvl, idx, vals, b, pc, p64)

    @njit(nogil=True)
    def chunk(job, lo, hi):
        """Blocks ``[lo, hi)``: the serial run's (``_SHARES`` 0) on the pools of the scratch
        buffer, a pool task's on pools of its own."""
        rec = _word(job + 8 * _B)
        if _word(job + 8 * _SHARES) == 0:
            run_blocks(job, lo, hi, _word(rec + 8 * _BPC), _word(rec + 8 * _BP64))
            return
        cols = _word(rec + 8 * _BWIDTH) + pad
        pcd = _malloc(pc_rows * cols * csize)
        p64d = _malloc(p64_rows(_word(rec + 8 * _BM)) * cols * 8)
        if pcd != 0 and p64d != 0:
            run_blocks(job, lo, hi, pcd, p64d)
        else:
            _put_word(rec + 8 * _BUNDONE, 1)
        _free(pcd)
        _free(p64d)

    key = ("backward", x_dtype, dy_dtype, compute_dtype, weight_dtype, bias_dtype)
    run_pooled, _, run_chunk, compiled = _pool(chunk, key)

    def run(frame):
        f = _address(frame)
        if not _executes(f):
            return _pointer(0)
        args = _word(f + _ARGS_PTRS)
        rets = _word(f + _RETS_PTRS)
        attrs = _word(f + _ATTRS_PTRS)
        dyb, xb = _word(args), _word(args + 8)
        xd = _word(xb + _DATA)
        wd = _word(_word(args + 16) + _DATA) if has_w else 0
        rd = _word(_word(args + (24 if has_w else 16)) + _DATA)
        n, d = _rows(xb), _last_dim(xb)
        dxd = _word(_word(rets) + _DATA)
        rec = _word(_word(rets + 8 * (1 + has_w + has_b)) + _DATA)
        flags, kk = _int_attr(attrs, 0), _int_attr(attrs, 1)
        eps, offset = _float_attr(attrs, 2), _float_attr(attrs, 3)
        m = _int_attr(attrs, 4)
        grd = 0
        if flags & has_gr_flag:
            grd = _word(_word(args + (32 if has_w else 24)) + _DATA)
        width = d * (has_w + has_b)
        if n == 0:
            return _pointer(0)
        # dx is not asked for huge pages (the forward's y is): where the kernel compacts
        # memory at a madvised fault (THP defrag "madvise"), that made the jitted grad step
        # slower than the jnp formula's (bench/jax_jit.py's grad rows)
        nb = ((n - 1) >> m) + 1
        job = rec + 8 * _BWORDS  # the serial run's job record, as the pool's
        lvl_at = job + 8 * _JOB_WORDS  # then the row-tree slots, the pools from a whole line
        vals_at = lvl_at + 16 * nb
        pcd = rec + _up64(vals_at + 8 * nb * width - rec)
        p64d = pcd + _up64(pc_rows * (width + pad) * csize)
        if wide:  # the weight's bits widened after the pools (backward_scratch_bytes)
            at = rec + _up64(p64d + p64_rows(m) * (width + pad) * 8 - rec)
            widen(carray(_pointer(wd), (d,), wt), carray(_pointer(at), (d,), ct))
            wd = at
        for i, v in ((_BN, n), (_BM, m), (_BWIDTH, width), (_BDY, _word(dyb + _DATA)),
                     (_BLVL, lvl_at), (_BIDX, lvl_at + 8 * nb), (_BVALS, vals_at),
                     (_BPC, pcd), (_BP64, p64d),
                     (_BUNDONE, 0), (_BGR, grd)):
            _put_word(rec + 8 * i, v)
        for i, v in ((_N, nb), (_D, d), (_X, xd), (_W, wd), (_B, rec), (_Y, dxd), (_R, rd),
                     (_FLAGS, flags), (_K, kk), (_SHARES, 0)):
            _put_word(job + 8 * i, v)
        _put_double(job + 8 * _EPS, eps)
        _put_double(job + 8 * _OFFSET, offset)
        pooled = nb >= 2 and n * d >= pool_min and run_pooled(
            f, nb, d, xd, wd, rec, dxd, rd, flags, kk, eps, offset)
        if not pooled or _word(rec + 8 * _BUNDONE) != 0:
            # every block again where a chunk had no pools: dx and the nodes are rewritten
            run_chunk(job, 0, nb)
        if width:
            vals = carray(_pointer(vals_at), (nb, width), np.float64)
            tree_cols(0, width, vals, nb)
            if has_w:
                dw = _word(_word(rets + 8) + _DATA)
                round_into(vals[0, :d], carray(_pointer(dw), (d,), wt))
            if has_b:
                db = _word(_word(rets + (16 if has_w else 8)) + _DATA)
                round_into(vals[0, width - d:], carray(_pointer(db), (d,), bt))
        return _pointer(0)

    return _handler_address(run, key, compiled)


def _knobs() -> tuple:
    """This module's values that the handlers compile in (part of every cache key: a
    changed value, e.g. a test's, compiles anew instead of loading the other one)."""
    return (POOL_MIN_ELEMENTS, STAT_POOL_MIN_ELEMENTS, _CHUNK_MIN_ELEMENTS, _CHUNKS_PER_THREAD,
            _MAX_SHARES, _YIELDS_BEFORE_SLEEP, _WAIT_NS, _SYS_FUTEX, sys.platform)


def _compiled(fn, sig, key: tuple):
    """``cfunc(sig)(fn)``, kept in polynorm's on-disk cache (:mod:`polynorm.core.cache`:
    dropped with any edit of the kernel sources) under ``key`` and :func:`_knobs`.

    Numba keys a closure's entry on the pickle of what it captures, which holds every
    captured dispatcher's per-process id: an entry written by one process is never
    found by the next.  The handlers capture only what their key names (dtypes,
    flags) and module values, so the key is stable and complete.  Without a
    writable cache the handler compiles as before.
    """
    from numba.core import ccallback, sigutils

    cf = ccallback.CFunc(fn, sigutils.normalize_signature(sig), locals={},
                         options={"nogil": True, "error_model": "numpy"})
    try:
        cf._cache = _KeyedCache(fn, (key, _knobs()))
    except RuntimeError:  # no cache locator answers (no writable directory)
        pass
    cf.compile()
    return cf


def _handler_address(run, key: tuple, compiled: tuple = ()) -> int:
    """The address of the compiled handler ``run`` (:func:`_compiled`), kept alive with the
    cfuncs it calls (``compiled``: its pool's, see :func:`_pool`)."""
    fn = _compiled(run, types.voidptr(types.voidptr), key)
    _keep.extend((fn, *compiled))
    return fn.address


class _KeyedCache(caching.FunctionCache):
    """Numba's function cache with the closure's part of the index key replaced by ``key``."""

    def __init__(self, py_func, key: tuple):
        super().__init__(py_func)
        self._key = key

    def _index_key(self, sig, codegen):
        code = hashlib.sha256(self._py_func.__code__.co_code).hexdigest()
        return sig, codegen.magic_tuple(), (code, _digest(self._key))


def _digest(key: tuple) -> str:
    """A handler key's hash (its repr: dtypes as names, flags, numbers), stable across
    processes."""
    return hashlib.sha256(repr(key).encode()).hexdigest()


def _function_address(name: str):
    """An intrinsic ``() -> int64``: the address of the external function ``name`` (a
    symbol given to LLVM with ``llvmlite.binding.add_symbol``)."""

    @intrinsic
    def address(typingctx):
        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [_i8p]), name)
            return builder.ptrtoint(fn, _i64)

        return types.int64(), codegen

    return address


@njit(nogil=True)
def _destroy(api, scratch, err):
    """Free an XLA_FFI_Error (a failed optional call: the handler goes on without it)."""
    _put_word(scratch, 24)  # XLA_FFI_Error_Destroy_Args
    _put_word(scratch + 8, 0)
    _put_word(scratch + 16, err)
    _call_ffi(_word(api + _ERROR_DESTROY), scratch)


_keep: list = []  # the compiled handlers stay alive with the process
