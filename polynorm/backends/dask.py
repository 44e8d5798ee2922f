"""Dask backend: lazy per-chunk dispatch to the best in-memory backend.

Nothing is computed here: every function only builds a task graph.  The rows
``(n, d)`` are rechunked so that the normalized axis ``d`` lies in one chunk
(tokens stay chunked as the caller chunked them); each row chunk then runs,
on the worker that holds it, the in-memory backend that ``backend="auto"``
would pick for the chunk (the CuPy kernels for CUDA chunks, Numba for host
chunks when Numba is usable there, the reference otherwise), so a chunk's
``y``/``h``/``rstd``/``dx`` have the same bits as an in-memory call on the
same rows.

One task per chunk computes all of a call's outputs at once (a tuple);
``y``, ``h`` and ``rstd`` are light ``getitem`` tasks on it, so computing
them together (``dask.compute(y, h)``) runs the kernel once per chunk.

The backward's ``dweight``/``dbias`` on host chunks run on Numba follow the
row tree of :mod:`polynorm.backends.rowtree`: each chunk returns the tree
nodes of its rows (it knows its global row offset), dask's tree reduction
(fan-in :data:`SPLIT_EVERY`) merges adjacent chunks' nodes, and the root is
rounded once.  The tree is fixed by the global row index, so the result has
the same bits as the in-memory Numba call on the same rows, however the rows
are chunked.  Other chunks (CuPy, or no Numba) send float64 per-chunk partial
sums through the same fan-in; those agree with the in-memory result to
accumulation accuracy only.

Rows of unknown chunk sizes (``nan``, after boolean indexing) work the same
way, block by block: their blocks are paired with those of the other
token-shaped arrays by position (each chunk task checks that the rows agree),
and the row tree learns each chunk's first row and the total from a task that
counts the rows of every chunk.

``out=`` is not supported in place: dask arrays are immutable graphs; the
front end assigns the lazy result into ``out``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polynorm.core.dtypes import numpy_dtype
from polynorm.core.options import Plan

name = "dask"

#: Partial sums of dweight/dbias reduced this many at a time (the tree's fan-in).
SPLIT_EVERY = 8


def available() -> tuple[bool, str]:
    try:
        import dask.array  # noqa: F401
    except ImportError as exc:
        return False, f"dask is not installed ({exc})"
    return True, "ok"


def accepts(x: Any) -> bool:
    return type(x).__module__.startswith("dask.")


def _inner(block: Any):
    """The in-memory backend for one chunk, chosen on the worker by the chunk's memory:
    the CuPy kernels for CUDA chunks, Numba for host chunks, else the reference."""
    from polynorm.backends import get, usable

    for name_ in ("cupy", "numba"):
        if usable(name_):
            mod = get(name_)
            if mod.accepts(block):
                return mod
    return get("array_api")


def _meta(like, ndim: int, dtype):
    """An empty array of ``like``'s chunk type (numpy, cupy, ...) for dask's bookkeeping."""
    from dask.array.utils import meta_from_array

    return meta_from_array(like, ndim=ndim, dtype=dtype)


def _unknown(size) -> bool:
    return isinstance(size, float) and np.isnan(size)


def _same_chunks(a: tuple, b: tuple) -> bool:
    """Equal chunks, an unknown size (``nan``, which is not equal to itself) matching
    an unknown one."""
    return len(a) == len(b) and all(
        len(p) == len(q) and all(u == v or (_unknown(u) and _unknown(v)) for u, v in zip(p, q, strict=True))
        for p, q in zip(a, b, strict=True))


def _rechunk(a, want):
    if _same_chunks(a.chunks, want):
        return a
    if any(_unknown(c) for cs in (*a.chunks, *want) for c in cs):
        # the front end pairs arrays of unknown chunk sizes with x's chunks; this is a guard
        raise ValueError(f"cannot rechunk an array of unknown chunk sizes {a.chunks} to {want}")
    return a.rechunk(want)


def _rows(a, chunks0):
    """2-D ``a`` with the row chunks ``chunks0`` and one chunk over ``d``."""
    if a is None:
        return None
    import dask.array as da

    a = da.asarray(a)
    if len(a.chunks[1]) > 1:
        a = a.rechunk({1: -1})
    return _rechunk(a, (chunks0, (a.shape[1],)))


def _dask_vector(a, chunks=None):
    """1-D ``a`` (weight, bias, rstd) in one chunk, or with the given chunks."""
    if a is None:
        return None
    import dask.array as da

    a = da.asarray(a)
    want = chunks or (a.shape[0],)
    want = want if isinstance(want[0], tuple) else (want,)
    return _rechunk(a, want)


def _check_rows(x, **arrays) -> None:
    """Each row-chunk of the token-shaped arrays has x's rows.  Dask pairs blocks of
    unknown sizes without knowing whether they agree (two boolean indexes of the same
    chunks); a kernel handed a shorter one would read past its end."""
    n = x.shape[0]
    for argname, a in arrays.items():
        if a is not None and a.shape[0] != n:
            raise ValueError(
                f"{argname} has {a.shape[0]} rows in a chunk where x has {n}: arrays of "
                "unknown chunk sizes must have x's sizes (e.g. the same boolean index)")


def _args(pairs):
    """blockwise's (array, index) pairs; ``None`` stays a plain argument."""
    out = []
    for a, idx in pairs:
        out += [a, idx if a is not None else None]
    return out


def _pick(t, i):
    return t[i]


def _pick_partial(t, i):
    return t[i][None, :]


# ------------------------------------------------------------------ chunk functions (run on workers)


def _forward_chunk(x, residual, weight, bias, *, plan: Plan):
    _check_rows(x, residual=residual)
    if x.shape[0] == 0:  # backends never see zero tokens
        # empties of the chunk's own array type
        h = None if residual is None else x.astype(numpy_dtype(plan.norm_dtype))
        return (x.astype(numpy_dtype(plan.out_dtype)), h,
                x[:, 0].astype(numpy_dtype(plan.compute_dtype)))
    return _inner(x).forward(x, residual, weight, bias, plan, None)


def _backward_chunk(dy, x, weight, bias, rstd, grad_residual, *, plan: Plan):
    _check_rows(x, dy=dy, rstd=rstd, grad_residual=grad_residual)
    if x.shape[0] == 0:
        zeros = x.astype(np.float64).sum(axis=0)  # (d,) zeros of the chunk's array type
        return (x.copy(), None if weight is None else zeros,
                None if bias is None else zeros)
    # float64 weight/bias: the chunk's dweight/dbias come back as float64 partial sums
    w64 = None if weight is None else weight.astype(np.float64)
    b64 = None if bias is None else bias.astype(np.float64)
    return _inner(x).backward(dy, x, w64, b64, rstd, grad_residual, plan)


def _backward_chunk_tree(dy, x, weight, bias, rstd, grad_residual, row0, ntot, *,
                         plan: Plan):
    """dx of a host chunk and the row-tree state of its dweight/dbias terms.  ``row0``:
    the chunk's row numbers (known sizes) or a one-element array of its first row's
    (unknown sizes); ``ntot``: the rows in all, an int or a one-element array."""
    from polynorm.backends import numba as nb
    from polynorm.backends.rowtree import empty_state

    _check_rows(x, dy=dy, rstd=rstd, grad_residual=grad_residual)
    if x.shape[0] == 0:
        width = x.shape[1] * ((weight is not None) + (bias is not None))
        return x.copy(), empty_state(width)
    return nb.backward_range(dy, x, weight, bias, rstd, grad_residual, plan, int(row0[0]),
                             _count(ntot))


def _count(ntot) -> int:
    return ntot if isinstance(ntot, int) else int(np.asarray(ntot).reshape(-1)[0])


def _merge_states(states, ntot, compute_dtype):
    from polynorm.backends.rowtree import merge

    return merge(list(states), _count(ntot), compute_dtype)


def _finish_tree(state, ntot, d: int, wdt, bdt):
    from polynorm.backends import numba as nb
    from polynorm.backends.rowtree import root

    ntot = _count(ntot)
    if ntot == 0:  # every chunk empty (known only now with unknown chunk sizes)
        width = d * ((wdt is not None) + (bdt is not None))
        return nb.finish(np.zeros(width), d, wdt, bdt)
    return nb.finish(root(state, ntot), d, wdt, bdt)


def _block_rows(x):
    return np.array([x.shape[0]], np.int64)


def _unknown_row_numbers(x):
    """For row chunks of unknown sizes: each chunk's first row number and the number of
    rows in all, as dask arrays of one element per chunk (known only when computed),
    and the latter as one 0-d array."""
    import dask.array as da

    nb = len(x.chunks[0])
    sizes = da.map_blocks(_block_rows, x, drop_axis=1, chunks=((1,) * nb,), dtype=np.int64,
                          meta=np.empty((0,), np.int64))
    total = sizes.sum()
    row0 = da.cumsum(sizes) - sizes
    ntot = da.broadcast_to(total, (nb,), chunks=((1,) * nb,))
    return row0, ntot, total


def _uses_rowtree(x) -> bool:
    """Host chunks with Numba usable: the bit-exact row tree."""
    from polynorm.backends import usable

    return isinstance(x._meta, np.ndarray) and usable("numba")


def _tree_reduce(parts, ntot, d: int, wdt, bdt, cdt):
    """``(dweight, dbias)`` as dask arrays: the chunks' row-tree states merged
    ``SPLIT_EVERY`` adjacent ones at a time, then rounded."""
    import dask
    import dask.array as da

    # optimize_graph=False: an optimized graph would carry the caller's keys with other
    # (fused) specs, and distributed warns about, and can deadlock on, a key with two specs
    level = [dask.delayed(_pick)(blk, 1)
             for blk in parts.to_delayed(optimize_graph=False).ravel()]
    if not isinstance(ntot, int):  # a 0-d dask array: counted when the chunks are
        ntot = ntot.to_delayed(optimize_graph=False).ravel()[0]
    while len(level) > 1:
        level = [dask.delayed(_merge_states)(level[i:i + SPLIT_EVERY], ntot, cdt)
                 for i in range(0, len(level), SPLIT_EVERY)]
    fin = dask.delayed(_finish_tree, nout=2)(level[0], ntot, d, wdt, bdt)
    return tuple(None if dt is None else da.from_delayed(fin[i], (d,), dtype=dt,
                                                         meta=np.empty((0,), dt))
                 for i, dt in enumerate((wdt, bdt)))


# ------------------------------------------------------------------ the backend contract


def forward(x, residual, weight, bias, plan: Plan, out=None):
    """Forward on 2-D dask rows; lazy.  See :mod:`polynorm.backends.reference`.

    Returns dask arrays ``y`` (n, d), ``h`` (n, d) or None, ``rstd`` (n,),
    chunked like ``x``'s rows.  ``out`` is ignored (the front end assigns).
    """
    import dask.array as da

    x = _rows(x, da.asarray(x).chunks[0])
    rows = x.chunks[0]
    residual = _rows(residual, rows)
    weight, bias = _dask_vector(weight), _dask_vector(bias)
    ydt, xdt, cdt = (numpy_dtype(plan.out_dtype), numpy_dtype(plan.norm_dtype),
                     numpy_dtype(plan.compute_dtype))
    # one task per row chunk; its block is the tuple (y, h, rstd), indexed by
    # rows only (dask cannot concatenate tuples over a dropped axis)
    parts = da.blockwise(
        _forward_chunk, "i",
        *_args([(x, "ij"), (residual, "ij"), (weight, "j"), (bias, "j")]),
        plan=plan,
        dtype=object, meta=np.empty((0,), object), concatenate=True,
    )
    chunks2 = (rows, (x.shape[1],))
    y = da.map_blocks(_pick, parts, 0, new_axis=1, chunks=chunks2, dtype=ydt,
                      meta=_meta(x, 2, ydt))
    h = None
    if residual is not None:
        h = da.map_blocks(_pick, parts, 1, new_axis=1, chunks=chunks2, dtype=xdt,
                          meta=_meta(x, 2, xdt))
    rstd = da.map_blocks(_pick, parts, 2, dtype=cdt, meta=_meta(x, 1, cdt))
    return y, h, rstd


def backward(dy, x, weight, bias, rstd, grad_residual, plan: Plan, out=None):
    """Backward on 2-D dask rows; lazy.  See :mod:`polynorm.backends.reference`.

    ``dx`` is chunked like ``x``'s rows; ``dweight``/``dbias`` are the tree
    reduction (fan-in :data:`SPLIT_EVERY`) of the chunks' row-tree states
    (host chunks on Numba: the in-memory bits), or of float64 per-chunk
    partial sums (other chunks), rounded once to the dtype of ``weight``/``bias``.
    ``out`` is ignored (dask arrays are immutable; the front end assigns into it).
    """
    import dask.array as da

    x = _rows(x, da.asarray(x).chunks[0])
    rows = x.chunks[0]
    dy = _rows(dy, rows)
    grad_residual = _rows(grad_residual, rows)
    rstd = _dask_vector(rstd, rows)
    wdt = None if weight is None else weight.dtype
    bdt = None if bias is None else bias.dtype
    weight, bias = _dask_vector(weight), _dask_vector(bias)
    d = x.shape[1]
    if _uses_rowtree(x):
        if any(_unknown(c) for c in rows):
            # the row numbers are known only when the chunks are: one task counts each
            # chunk's rows, and the chunks take their offsets block by block (no
            # alignment of chunks: the arrays have one block per row chunk each)
            row0, ntot_arr, ntot = _unknown_row_numbers(x)
            counts = [(ntot_arr, "i")]
            align = False
        else:
            ntot = x.shape[0]
            # each chunk learns its global row offset from its slice of the row numbers
            row0 = da.arange(ntot, chunks=(rows,), dtype=np.int64)
            counts = [(ntot, None)]
            align = True
        parts = da.blockwise(
            _backward_chunk_tree, "i",
            *_args([(dy, "ij"), (x, "ij"), (weight, "j"), (bias, "j"), (rstd, "i"),
                    (grad_residual, "ij"), (row0, "i")]), *counts[0],
            plan=plan, align_arrays=align,
            dtype=object, meta=np.empty((0,), object), concatenate=True,
        )
        dx = da.map_blocks(_pick, parts, 0, new_axis=1, chunks=(rows, (d,)), dtype=x.dtype,
                           meta=_meta(x, 2, x.dtype))
        if wdt is None and bdt is None:
            return dx, None, None
        cdt = numpy_dtype(plan.compute_dtype)
        dweight, dbias = _tree_reduce(parts, ntot, d, wdt, bdt, cdt)
        return dx, dweight, dbias
    parts = da.blockwise(
        _backward_chunk, "i",
        *_args([(dy, "ij"), (x, "ij"), (weight, "j"), (bias, "j"), (rstd, "i"),
                (grad_residual, "ij")]),
        plan=plan,
        dtype=object, meta=np.empty((0,), object), concatenate=True,
    )
    dx = da.map_blocks(_pick, parts, 0, new_axis=1, chunks=(rows, (d,)), dtype=x.dtype,
                       meta=_meta(x, 2, x.dtype))
    nchunks = len(rows)

    def reduce(i, dtype):
        partial = da.map_blocks(
            _pick_partial, parts, i, new_axis=1, chunks=((1,) * nchunks, (d,)),
            dtype=np.float64, meta=_meta(x, 2, np.float64),
        )
        return partial.sum(axis=0, split_every=SPLIT_EVERY).astype(dtype)

    dweight = None if weight is None else reduce(1, wdt)
    dbias = None if bias is None else reduce(2, bdt)
    return dx, dweight, dbias


# ------------------------------------------------------------------ gated RMSNorm
# One task per row chunk, on the chunk's in-memory backend (its gated kernels,
# or the reference where it has none).  dweight/dbias: the chunks' sums added
# in chunk order, so their bits depend on the row chunks (y, rstd, dx and dz
# do not).


def _gated_inner(block):
    mod = _inner(block)
    if not hasattr(mod, "gated_forward"):
        from polynorm.backends import get

        mod = get("array_api")
    return mod


def _gated_forward_chunk(x, z, weight, bias, *, gplan):
    _check_rows(x, z=z)
    if x.shape[0] == 0:
        p = gplan.plan
        return (x.astype(numpy_dtype(p.out_dtype)),
                x[:, :gplan.groups].astype(numpy_dtype(p.compute_dtype)))
    return _gated_inner(x).gated_forward(x, z, weight, bias, gplan, None)


def _gated_backward_chunk(dy, x, z, weight, bias, rstd, *, gplan):
    _check_rows(x, dy=dy, z=z, rstd=rstd)
    if x.shape[0] == 0:
        def zero(a):
            return None if a is None else (a * 0).astype(a.dtype)

        return x.copy(), z.copy(), zero(weight), zero(bias)
    return _gated_inner(x).gated_backward(dy, x, z, weight, bias, rstd, gplan)


def gated_forward(x, z, weight, bias, gplan, out=None):
    """Gated forward on 2-D dask rows; lazy.  ``(y (n, d), rstd (n, groups))``."""
    import dask.array as da

    x = _rows(x, da.asarray(x).chunks[0])
    rows = x.chunks[0]
    z = _rows(z, rows)
    weight, bias = _dask_vector(weight), _dask_vector(bias)
    p = gplan.plan
    ydt, cdt = numpy_dtype(p.out_dtype), numpy_dtype(p.compute_dtype)
    parts = da.blockwise(
        _gated_forward_chunk, "i",
        *_args([(x, "ij"), (z, "ij"), (weight, "j"), (bias, "j")]),
        gplan=gplan, dtype=object, meta=np.empty((0,), object), concatenate=True,
    )
    y = da.map_blocks(_pick, parts, 0, new_axis=1, chunks=(rows, (x.shape[1],)), dtype=ydt,
                      meta=_meta(x, 2, ydt))
    rstd = da.map_blocks(_pick, parts, 1, new_axis=1, chunks=(rows, (gplan.groups,)),
                         dtype=cdt, meta=_meta(x, 2, cdt))
    return y, rstd


def gated_backward(dy, x, z, weight, bias, rstd, gplan):
    """Gated backward on 2-D dask rows; lazy ``(dx, dz, dweight, dbias)``."""
    import dask.array as da

    x = _rows(x, da.asarray(x).chunks[0])
    rows = x.chunks[0]
    dy, z = _rows(dy, rows), _rows(z, rows)
    if rstd is not None:
        rstd = _rows(rstd, rows)
    weight, bias = _dask_vector(weight), _dask_vector(bias)
    parts = da.blockwise(
        _gated_backward_chunk, "i",
        *_args([(dy, "ij"), (x, "ij"), (z, "ij"), (weight, "j"), (bias, "j"), (rstd, "ik")]),
        gplan=gplan, dtype=object, meta=np.empty((0,), object), concatenate=True,
    )
    chunks2 = (rows, (x.shape[1],))
    dx = da.map_blocks(_pick, parts, 0, new_axis=1, chunks=chunks2, dtype=x.dtype,
                       meta=_meta(x, 2, x.dtype))
    dz = da.map_blocks(_pick, parts, 1, new_axis=1, chunks=chunks2, dtype=z.dtype,
                       meta=_meta(x, 2, z.dtype))
    out = [dx, dz]
    for i, v in ((2, weight), (3, bias)):
        if v is None:
            out.append(None)
            continue
        part = da.map_blocks(_pick_partial, parts, i, new_axis=1,
                             chunks=(tuple(1 for _ in rows), (v.shape[0],)),
                             dtype=np.float64, meta=_meta(x, 2, np.float64))
        blocks = [part.blocks[j].astype(np.float64) for j in range(len(rows))]
        total = blocks[0]
        for b_ in blocks[1:]:
            total = total + b_
        out.append(total[0].astype(v.dtype))
    return tuple(out)


# ------------------------------------------------------------------ quantized output
# One task per row chunk, on the chunk's in-memory backend (its quant_forward,
# or the reference's): q, the scales and h have the in-memory call's bits.


def _quant_forward_chunk(x, residual, weight, bias, scale, *, qplan):
    _check_rows(x, residual=residual)
    mod = _gated_inner(x) if x.shape[0] else None
    if mod is None or not hasattr(mod, "quant_forward"):
        from polynorm.backends import get

        mod = get("array_api")
    return mod.quant_forward(x, residual, weight, bias, qplan, scale)


def quant_forward(x, residual, weight, bias, qplan, scale=None):
    """Quantized forward on 2-D dask rows; lazy ``(q (n, d), scales, h or None)``."""
    import dask.array as da

    from polynorm.backends.reference import quant_dtype

    x = _rows(x, da.asarray(x).chunks[0])
    rows = x.chunks[0]
    residual = _rows(residual, rows)
    weight, bias = _dask_vector(weight), _dask_vector(bias)
    s1 = None if scale is None else da.reshape(da.asarray(scale), (1,)).rechunk((1,))
    p = qplan.plan
    parts = da.blockwise(
        _quant_forward_chunk, "i",
        *_args([(x, "ij"), (residual, "ij"), (weight, "j"), (bias, "j"), (s1, "k")]),
        qplan=qplan, dtype=object, meta=np.empty((0,), object), concatenate=True,
    )
    qdt = np.dtype(quant_dtype(np, qplan.qdtype, np.empty(0)))
    chunks2 = (rows, (x.shape[1],))
    q = da.map_blocks(_pick, parts, 0, new_axis=1, chunks=chunks2, dtype=qdt,
                      meta=_meta(x, 2, qdt))
    if qplan.static:
        scales = (da.asarray(np.float32(qplan.scale)) if s1 is None
                  else da.reshape(s1.astype(np.float32), ()))
    else:
        scales = da.map_blocks(_pick, parts, 1, new_axis=1, chunks=(rows, (qplan.groups,)),
                               dtype=np.float32, meta=_meta(x, 2, np.float32))
    h = None
    if residual is not None:
        hdt = numpy_dtype(p.norm_dtype)
        h = da.map_blocks(_pick, parts, 2, new_axis=1, chunks=chunks2, dtype=hdt,
                          meta=_meta(x, 2, hdt))
    return q, scales, h


# ------------------------------------------------------------------ split hidden axis
# rms_norm_stats / rms_norm_from_stats on dask rows: each block (row chunk, column
# chunk) sums its squares, the column chunks' sums are added (dask's tree reduction,
# fixed by the chunks), and each block is normalized with its rows' total.  The
# hidden axis is never rechunked whole (rms_norm itself does, for the in-memory
# bits; here the sum order follows the column chunks).


def _split_mod(block, plan: Plan):
    from polynorm.backends import SplitKernels, get

    mod = _inner(block)
    return mod if not plan.llama and isinstance(mod, SplitKernels) else get("array_api")


def _stats_chunk(x, *, plan: Plan):
    if x.shape[0] == 0:
        return x.astype(np.float64)[:, :1]
    return _split_mod(x, plan).split_stats(x, plan)[:, None]


def _split_y_chunk(x, weight, bias, sumsq, *, plan: Plan, k_total: int):
    _check_rows(x, sumsq=sumsq)
    if x.shape[0] == 0:
        return x.astype(numpy_dtype(plan.out_dtype))
    return _split_mod(x, plan).split_forward(x, weight, bias, sumsq, k_total, plan)[0]


def _split_rstd_chunk(sumsq, *, plan: Plan, k_total: int):
    from polynorm.backends import reference

    # numpy float64 does the Numba kernel's operations in its order: its rstd bits
    r = reference.split_rstd(np, np.asarray(sumsq, np.float64), k_total, plan)
    return r.astype(numpy_dtype(plan.compute_dtype))


def split_stats(x, plan: Plan):
    """Per-row float64 sum of squares of 2-D dask rows, one task per block and a sum over
    the column chunks; lazy."""
    import dask.array as da

    x = da.asarray(x)
    parts = da.map_blocks(_stats_chunk, x, plan=plan,
                          chunks=(x.chunks[0], (1,) * len(x.chunks[1])),
                          dtype=np.float64, meta=_meta(x, 2, np.float64))
    return parts.sum(axis=1, split_every=SPLIT_EVERY)


def split_forward(x, weight, bias, sumsq, k_total: int, plan: Plan):
    """``(y, rstd)`` of 2-D dask rows from the rows' total ``sumsq``, block by block
    (x's chunks kept, columns included); lazy."""
    import dask.array as da

    x = da.asarray(x)
    cols = x.chunks[1]
    weight = _dask_vector(weight, cols)
    bias = _dask_vector(bias, cols)
    sumsq = _dask_vector(sumsq, x.chunks[0])
    ydt = numpy_dtype(plan.out_dtype)
    y = da.blockwise(
        _split_y_chunk, "ij",
        *_args([(x, "ij"), (weight, "j"), (bias, "j"), (sumsq, "i")]),
        plan=plan, k_total=k_total, dtype=ydt, meta=_meta(x, 2, ydt),
    )
    cdt = numpy_dtype(plan.compute_dtype)
    rstd = da.map_blocks(_split_rstd_chunk, sumsq, plan=plan, k_total=k_total, dtype=cdt,
                         meta=_meta(x, 1, cdt))
    return y, rstd


# --------------------------------------------------------------------------- QK-norm (+ RoPE)


def _qk_chunk(x, weight, cs, *, plan: Plan, neox: bool):
    if x.shape[0] == 0 or x.shape[1] == 0:
        return x.copy()
    mod = _inner(x)
    if not hasattr(mod, "qk_forward"):
        from polynorm.backends import get

        mod = get("array_api")
    return mod.qk_forward(x, weight, plan, None if cs is None else (cs, neox), None)


def qk_forward(x, weight, plan: Plan, rope, out=None):
    """QK-norm (+ RoPE) of dask ``(T, H, D)`` heads: blockwise over token chunks (heads
    and head_dim in one chunk), each chunk by its memory's backend; ``rope``'s
    ``(T, rot)`` rows chunked as the tokens.  A new dask array (``out`` is ignored)."""
    import dask.array as da

    x = x.rechunk({1: -1, 2: -1})
    args: list = [x, "thd"]
    args += [None, None] if weight is None else [weight.rechunk(-1), "d"]
    neox = True
    if rope is None:
        args += [None, None]
    else:
        cs, neox = rope
        args += [cs.rechunk((x.chunks[0], -1)), "tr"]

    def block(xb, wb, csb):
        return _qk_chunk(xb, wb, csb, plan=plan, neox=neox)

    return da.blockwise(block, "thd", *args, dtype=x.dtype, concatenate=True,
                        meta=_meta(x, 3, x.dtype))
