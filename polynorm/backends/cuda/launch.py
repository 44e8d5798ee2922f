"""Which generated CUDA kernel to launch, and how: pure Python, no cupy.

Shared by the cupy backend, the NVRTC compile test and the CPU emulator
harness (tests/emulator), so that all three exercise the same choices.  The
kernels and their arguments are described in ``codegen/ABI.md``.

Dtype rules (all exact with respect to :mod:`polynorm.backends.reference`):

* The kernels are specialised for the dtype combinations in
  :data:`FWD_TYPES` / :data:`BWD_TYPES` / :data:`COLSUM_TYPES`.
* Residual: a ``(x, residual)`` pair without a kernel is cast to
  ``h = promote(x, residual)`` first (exact: ``h`` holds both).
* Weight: in ``fp32`` casting (and in the backward) the weight only enters as
  ``astype(weight, compute)``, so an unlisted weight dtype is cast to the
  compute dtype; ``llama`` casting with an unlisted weight dtype has no kernel
  (``None``: the backend runs the reference on the device instead).
* Bias always enters in the compute dtype: it is passed cast to it.
* Output: an unlisted out dtype is written in the compute dtype, then cast
  (one rounding either way).

>>> fl = forward_launch(4096, 4096, "bfloat16", weight="float32", rows=False)
>>> fl.name, fl.block, fl.tpr
('pn_fwd<__nv_bfloat16, __nv_bfloat16, float, __nv_bfloat16, 2>', 256, 256)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

from polynorm.core.dtypes import FLOAT_DTYPES
from polynorm.core.options import compute_dtype, promote

CTYPE = {
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
    "float64": "double",
}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
#: elements per 16-byte chunk, by x dtype
VEC = {t: 16 // ITEMSIZE[t] for t in FLOAT_DTYPES}

FWD_ITEMS = (1, 2, 4)  # register chunks per thread, pn_fwd (the union over dtypes)
#: pn_fwd's chunks per thread by x dtype: at most 16 float32 values of a row
#: per thread (float64: 4), which keeps pn_fwd within 64 registers (two
#: 512-thread blocks per SM, 50% occupancy) without spilling; longer rows go
#: to pn_fwd_big
FWD_ITEMS_BY_X = {"float16": (1, 2), "bfloat16": (1, 2), "float32": (1, 2, 4), "float64": (1, 2)}
#: pn_bwd's chunks per lane.  The body sums every row over the ITEMS=1 tree
#: for any ITEMS, but ITEMS=2 spills within the 64 registers
BWD_ITEMS = (1,)
REG_THREADS = 512  # __launch_bounds__ of pn_fwd / pn_bwd
#: rows up to this long go to pn_fwd_small (several rows per warp)
SMALL_D = 256
#: pn_fwd_small's chunks (pn_fwd threads it stands for) per lane: 4 spill
#: within its 64 registers (16-bit x; float32 on sm_80; float64 rows of 128
#: chunks, d > 128, which stay with pn_fwd)
SMALL_ITEMS = 2
SMALL_THREADS = 256  # __launch_bounds__ of pn_fwd_small and pn_bwd_small
BIG_THREADS = 1024  # __launch_bounds__ of the *_big kernels
COLSUM_THREADS = 256  # __launch_bounds__ of pn_colsum
ROW_BLOCK = 256  # target threads per block when several rows share one
#: resident backward threads per SM: more hides latency, fewer means fewer
#: dweight/dbias partial rows to write and reduce
BWD_THREADS_PER_SM = 1024
DEFAULT_SMS = 132  # H100/H200 SXM; the backend passes the real count
DEFAULT_SMEM = 227 * 1024  # opt-in shared memory per block, sm_90
#: static shared memory of the *_big kernels (red[32] doubles) plus slack: the
#: opt-in limit covers static + dynamic
STATIC_SMEM = 1024
#: the row slices of the *_big kernels (common.cu.j2 pn_slice_span): at least
#: this many passes of the block over the row per slice, at most this many slices
SLICE_MIN_PASSES = 2
SLICE_MAX = 32


def _options(h: str) -> tuple[str, ...]:
    """Weight / output dtypes with a kernel for normalized dtype ``h``."""
    c = compute_dtype(h)
    return (h,) if c == h else (h, c)


#: (x, residual, weight, out) dtypes of pn_fwd / pn_fwd_big.  The plain
#: forward uses residual == x with a null residual pointer.
FWD_TYPES: tuple[tuple[str, str, str, str], ...] = tuple(
    [(t, t, w, o) for t in FLOAT_DTYPES for w in _options(t) for o in _options(t)]
    + [(t, "float32", "float32", "float32") for t in ("bfloat16", "float16")]
)
#: (x, dy, weight) dtypes of pn_bwd / pn_bwd_big (grad_residual has dy's dtype)
BWD_TYPES: tuple[tuple[str, str, str], ...] = tuple(
    (t, g, w) for t in FLOAT_DTYPES for g in _options(t) for w in _options(t)
)
#: (compute, out) dtypes of pn_colsum
COLSUM_TYPES: tuple[tuple[str, str], ...] = (
    ("float32", "float16"), ("float32", "bfloat16"), ("float32", "float32"),
    ("float64", "float32"), ("float64", "float64"),
)


def _ct(*names: str) -> str:
    return ", ".join(CTYPE[n] for n in names)


def fwd_name(x: str, res: str, w: str, out: str, items: int | None) -> str:
    if items is None:
        return f"pn_fwd_big<{_ct(x, res, w, out)}>"
    return f"pn_fwd<{_ct(x, res, w, out)}, {items}>"


def fwd_split_name(x: str, res: str, w: str, out: str, phase: int) -> str:
    return f"pn_fwd_split<{_ct(x, res, w, out)}, {phase}>"


def fwd_small_name(x: str, res: str, w: str, out: str, items: int, wide: bool) -> str:
    return f"pn_fwd_small<{_ct(x, res, w, out)}, {items}, {'true' if wide else 'false'}>"


def small_shapes(x: str) -> list[tuple[int, bool]]:
    """The (ITEMS, WIDE) instantiations of pn_fwd_small some d <= SMALL_D needs for x dtype ``x``."""
    shapes = (small_shape(d, x) for d in range(1, SMALL_D + 1))
    return sorted({s[1:] for s in shapes if s is not None})


def _pn_fwd_tpr(d: int, vec: int) -> int:
    """pn_fwd's threads per row at ITEMS 1 (what the dispatcher picks for d <= SMALL_D)."""
    return max(vec, _pow2ceil(d // vec))


@lru_cache(maxsize=4096)
def small_shape(d: int, x: str) -> tuple[int, int, bool] | None:
    """(lanes per row, ITEMS, WIDE) of pn_fwd_small, or None where pn_fwd keeps the row.

    The lanes stand for pn_fwd's threads (see forward.cu.j2), ITEMS each; a row
    of more than 32 such threads takes one warp, one item per 32 of them.

    >>> small_shape(128, "bfloat16"), small_shape(128, "float32"), small_shape(256, "float32")
    ((8, 2, False), (16, 2, False), (32, 2, True))
    >>> small_shape(256, "float64") is None
    True
    """
    return None if d > SMALL_D else _small_lanes(_pn_fwd_tpr(d, VEC[x]), SMALL_ITEMS)


def _small_lanes(t: int, items: int) -> tuple[int, int, bool] | None:
    """(lanes per row, ITEMS, WIDE) standing for ``t`` threads of the one-row kernel:
    ``items`` each within a warp, or one warp with one item per 32 threads."""
    if t > 32 * items:
        return None
    if t > 32:
        return 32, t // 32, True
    return max(1, t // items), items, False


def _tf(v: bool) -> str:
    return "true" if v else "false"


def bwd_name(x: str, dy: str, w: str, items: int | None, has_w: bool = True, has_g: bool = False) -> str:
    if items is None:
        return f"pn_bwd_big<{_ct(x, dy, w)}>"
    return f"pn_bwd<{_ct(x, dy, w)}, {items}, {_tf(has_w)}, {_tf(has_g)}>"


def bwd_small_name(x: str, dy: str, w: str, items: int, lpr: int, has_w: bool = True,
                   has_g: bool = False) -> str:
    return f"pn_bwd_small<{_ct(x, dy, w)}, {items}, {_tf(has_w)}, {_tf(has_g)}, {lpr}>"


#: pn_bwd_small's chunks (pn_bwd threads it stands for) per lane: 4 holds too
#: many of a row's chunks (x, dy and the weight factor) for its 64 registers
SMALL_BWD_ITEMS = 2


def _pn_bwd_tpr(d: int, vec: int) -> int:
    """pn_bwd's threads per row (ITEMS 1) for d <= SMALL_D."""
    return max(2 * vec, _pow2ceil(d // vec))


@lru_cache(maxsize=4096)
def small_bwd_shape(d: int, x: str) -> tuple[int, int, bool] | None:
    """(lanes per row, ITEMS, WIDE) of pn_bwd_small, or None where pn_bwd keeps the row.

    The lanes stand for pn_bwd's threads, ITEMS each; a row of more than 32
    such threads takes one warp, one item per 32 of them (float32 d > 128,
    float64 d > 64).  float64 rows of 128 pn_bwd threads (d > 129) stay with pn_bwd.

    >>> small_bwd_shape(128, "bfloat16"), small_bwd_shape(128, "float32"), small_bwd_shape(256, "float32")
    ((8, 2, False), (16, 2, False), (32, 2, True))
    >>> small_bwd_shape(3, "float64"), small_bwd_shape(256, "float64") is None
    ((2, 2, False), True)
    """
    return None if d > SMALL_D else _small_lanes(_pn_bwd_tpr(d, VEC[x]), SMALL_BWD_ITEMS)


def takes_small_bwd(d: int, x: str, dy: str) -> bool:
    """Whether pn_bwd_small takes rows of ``d`` (kernel dtypes x, dy): where it has a shape
    and dy's chunks are as wide as x's (float32 dy with 16-bit x, twice the registers per
    chunk, spills within its 64 registers: those rows stay with pn_bwd, the same dx bits).

    >>> takes_small_bwd(128, "bfloat16", "bfloat16"), takes_small_bwd(128, "bfloat16", "float32")
    (True, False)
    """
    return ITEMSIZE[dy] == ITEMSIZE[x] and small_bwd_shape(d, x) is not None


def small_bwd_shapes(x: str) -> list[tuple[int, int]]:
    """The (ITEMS, lanes per row) instantiations of pn_bwd_small some d <= SMALL_D needs for x dtype ``x``."""
    shapes = (small_bwd_shape(d, x) for d in range(1, SMALL_D + 1))
    return sorted({(s[1], s[0]) for s in shapes if s is not None})


def bwd_split_name(x: str, dy: str, w: str, phase: int) -> str:
    return f"pn_bwd_split<{_ct(x, dy, w)}, {phase}>"


def colsum_name(ct: str, out: str) -> str:
    return f"pn_colsum<{_ct(ct, out)}>"


def specialisations() -> list[str]:
    """Every kernel name expression the dispatcher can request.

    >>> names = specialisations()
    >>> len(names) == len(set(names)), "pn_colsum<float, __nv_bfloat16>" in names
    (True, True)
    """
    names = []
    for t in FWD_TYPES:
        names += [fwd_name(*t, items) for items in (*FWD_ITEMS_BY_X[t[0]], None)]
        names += [fwd_small_name(*t, items, wide) for items, wide in small_shapes(t[0])]
        if compute_dtype(promote(t[0], t[1])) == "float32":
            names += [fwd_split_name(*t, phase) for phase in (1, 2)]
            if rows_types(t):
                names += [fwd_rows_name(*t, it, mw) for it, mw in ROWS_SHAPES[t[0]]]
    for t in BWD_TYPES:
        for hw in (False, True):
            for hg in (False, True):
                names += [bwd_name(*t, items, hw, hg) for items in BWD_ITEMS]
                if ITEMSIZE[t[1]] == ITEMSIZE[t[0]]:  # see takes_small_bwd
                    names += [bwd_small_name(*t, items, lpr, hw, hg) for items, lpr in small_bwd_shapes(t[0])]
        names.append(bwd_name(*t, None))
        if compute_dtype(t[0]) == "float32":
            names += [bwd_split_name(*t, phase) for phase in (1, 2)]
    names += [colsum_name(*t) for t in COLSUM_TYPES]
    names += [gated_fwd_name(*t) for t in GATED_FWD_TYPES]
    names += [gated_bwd_name(*t) for t in GATED_BWD_TYPES]
    names += gated_rows_specialisations()
    names += quant_rows_specialisations()
    names += [quant_name(t, q) for t in FLOAT_DTYPES for q in QUANT_FMT]
    names += split_specialisations()
    names += [qk_name(t, nx) for t in FLOAT_DTYPES for nx in (False, True)]
    names += [none_fwd_name(*t) for t in NONE_FWD_TYPES]
    names += bwd_rows_specialisations()
    return names


# ------------------------------------------------------------------ dtype decisions


@dataclass(frozen=True)
class FwdTypes:
    """Kernel dtypes for one forward call; ``cast_*`` say what to convert first."""

    x: str  # kernel x dtype (cast x to it when different)
    res: str  # kernel residual dtype (== x when there is no residual)
    weight: str  # kernel weight dtype (== h when there is no weight)
    out: str  # dtype the kernel writes y in (cast to the requested one after)
    h: str  # normalized dtype = promote(x, residual)


@lru_cache(maxsize=4096)  # called per kernel launch: keep the Python overhead small
def forward_types(x: str, res: str | None, weight: str | None, out: str, llama: bool) -> FwdTypes | None:
    """Kernel dtypes for a forward, or ``None`` when no kernel computes it exactly.

    >>> forward_types("bfloat16", None, "float32", "bfloat16", False)
    FwdTypes(x='bfloat16', res='bfloat16', weight='float32', out='bfloat16', h='bfloat16')
    >>> forward_types("float32", "bfloat16", None, "float32", False).x
    'float32'
    >>> forward_types("bfloat16", None, "float16", "bfloat16", True) is None
    True
    """
    h = x if res is None else promote(x, res)
    kx, kr = x, (x if res is None else res)
    if (kx, kr) not in {(t[0], t[1]) for t in FWD_TYPES}:
        kx = kr = h
    opts = _options(h)
    if weight is None or weight in opts:
        kw = h if weight is None else weight
    elif not llama:
        kw = compute_dtype(h)
    else:
        return None
    ko = out if out in opts else compute_dtype(h)
    return FwdTypes(x=kx, res=kr, weight=kw, out=ko, h=h)


@dataclass(frozen=True)
class BwdTypes:
    x: str
    dy: str  # dtype of dy and grad_residual in the kernel
    weight: str  # kernel weight dtype (== x when there is no weight)
    compute: str


@lru_cache(maxsize=4096)  # called per kernel launch: keep the Python overhead small
def backward_types(x: str, dy: str, grad_residual: str | None, weight: str | None) -> BwdTypes:
    """Kernel dtypes for a backward (every combination has one, after casts).

    >>> backward_types("bfloat16", "bfloat16", None, "float32")
    BwdTypes(x='bfloat16', dy='bfloat16', weight='float32', compute='float32')
    >>> backward_types("bfloat16", "float16", None, None).dy
    'float32'
    """
    c = compute_dtype(x)
    kdy = x if dy == x and grad_residual in (None, x) else c
    if weight is None:
        kw = x
    else:
        kw = weight if weight in _options(x) else c
    return BwdTypes(x=x, dy=kdy, weight=kw, compute=c)


def colsum_out(compute: str, out: str) -> str:
    """The dtype pn_colsum writes for a requested ``out`` (cast after if different)."""
    return out if (compute, out) in COLSUM_TYPES else compute


# ------------------------------------------------------------------ launch shapes


@dataclass(frozen=True)
class Launch:
    """One kernel launch: name expression, grid, block, dynamic shared bytes and
    the launch-dependent scalar arguments (``tpr`` or ``stash``; ``ldp`` and
    ``partial_rows`` for the backward's partial-sum buffers)."""

    name: str
    grid: int
    block: int
    shared: int
    tpr: int
    big: bool
    stash: int = 0
    partial_rows: int = 0
    ldp: int = 0
    #: split-row launch (pn_fwd_split): ``name`` is phase 1, ``name2`` phase 2, both on
    #: ``grid = n * slices`` blocks, with an ``n * slices`` float64 partial buffer
    slices: int = 0
    name2: str = ""


def _pow2ceil(v: int) -> int:
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def _reg_shape(d: int, vec: int, items_choices: tuple[int, ...], min_tpr: int = 0) -> tuple[int, int] | None:
    """(items, tpr) for the register kernels, or None when the row is too long."""
    chunks = d // vec
    for items in items_choices:
        tpr = max(vec, min_tpr, _pow2ceil(math.ceil(chunks / items)))
        limit = ROW_BLOCK if items == items_choices[0] and len(items_choices) > 1 else REG_THREADS
        if tpr <= limit:
            return items, tpr
    return None


def big_block(d: int, x: str) -> int:
    """The block (threads per row) of pn_fwd_big / pn_bwd_big for rows of ``d``."""
    chunks = d // VEC[x]
    return BIG_THREADS if chunks >= BIG_THREADS else max(32, _pow2ceil(chunks))


def slice_span(d: int, x: str) -> int:
    """Chunks per row slice of the *_big kernels' statistic (mirror of ``pn_slice_span``).

    >>> slice_span(262144, "bfloat16"), slice_span(8192, "bfloat16")
    (2048, 2048)
    >>> slice_span(1 << 24, "bfloat16") // big_block(1 << 24, "bfloat16")  # 2048 passes, 32 slices
    64
    """
    tpr = big_block(d, x)
    passes = -(-(d // VEC[x]) // tpr)
    return max(SLICE_MIN_PASSES, -(-passes // SLICE_MAX)) * tpr


def slice_count(d: int, x: str) -> int:
    """Slices of a row of ``d`` (1 when one slice holds the whole row).

    >>> slice_count(262144, "bfloat16"), slice_count(65536, "bfloat16"), slice_count(16389, "bfloat16")
    (16, 4, 1)
    """
    body, span = d // VEC[x], slice_span(d, x)
    return -(-body // span) if body > span else 1


def takes_split(n: int, d: int, x: str, h: str, num_sms: int = DEFAULT_SMS) -> bool:
    """Whether a big forward row goes to pn_fwd_split instead of pn_fwd_big.

    pn_fwd_big runs one 1024-thread block per row and one such block per SM
    (64 registers), so fewer rows than SMs leave SMs idle; the split launch
    gives each (row, slice) a block.  Float compute only, and only rows of at
    least two slices.

    >>> takes_split(8, 262144, "bfloat16", "bfloat16"), takes_split(4096, 65536, "bfloat16", "bfloat16")
    (True, False)
    >>> takes_split(8, 262144, "float64", "float64"), takes_split(8, 16389, "bfloat16", "bfloat16")
    (False, False)
    """
    return compute_dtype(h) == "float32" and n < num_sms and slice_count(d, x) >= 2


def _row_block(n: int, tpr: int) -> int:
    rpb = max(1, min(ROW_BLOCK // tpr, _pow2ceil(n)))
    block = tpr * rpb
    while block < 32:  # whole warps: the shuffles use a full mask
        block *= 2
    return block


@lru_cache(maxsize=4096)  # called per kernel launch: keep the Python overhead small
def forward_launch(
    n: int,
    d: int,
    x: str,
    res: str | None = None,
    weight: str | None = None,
    out: str | None = None,
    *,
    max_smem: int = DEFAULT_SMEM,
    force_big: bool = False,
    small: bool = True,
    num_sms: int = DEFAULT_SMS,
    split: bool = True,
    rows: bool = True,
    rows_config: tuple[int, int] | None = None,
    device: str = "",
    has_res: bool = False,
) -> Launch:
    """Launch of pn_fwd_small / pn_fwd_rows / pn_fwd / pn_fwd_big for ``n`` rows of ``d`` (kernel dtypes given).

    ``res``/``weight``/``out`` default to ``x`` (as the kernels need a type
    even when the array is absent).  Rows of ``d <= SMALL_D`` go to
    pn_fwd_small (the same bits as pn_fwd, which ``small=False`` requests).
    Big rows go to pn_fwd_split where :func:`takes_split` says so (the same
    bits as pn_fwd_big, which ``split=False`` requests).  Rows of ``d > SMALL_D``
    whose tree :func:`fwd_tree` describes go to pn_fwd_rows (:func:`rows_launch`:
    the same bits as pn_fwd / pn_fwd_big, which ``rows=False`` requests;
    ``rows_config`` = (warps per row, rows per block) overrides the rule and the
    tuning table of ``device``, whose entries ``has_res`` picks: the fused add's or
    the plain forward's).

    >>> forward_launch(8, 3, "float32").block, forward_launch(8, 3, "float32", small=False).tpr
    (32, 4)
    >>> fl = forward_launch(1 << 21, 128, "bfloat16")
    >>> fl.name.split("<")[0], fl.block, fl.tpr, fl.grid
    ('pn_fwd_small', 256, 8, 65536)
    >>> forward_launch(2, 262144, "bfloat16", split=False).big
    True
    >>> fl = forward_launch(32768, 4096, "bfloat16")
    >>> fl.name, fl.block, fl.grid, rows_shape(fl.tpr)
    ('pn_fwd_rows<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 2, 4>', 256, 8192, (8, False, 2))
    >>> fl = forward_launch(2, 262144, "bfloat16")
    >>> fl.name, fl.grid, fl.block, fl.slices
    ('pn_fwd_split<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 1>', 32, 1024, 16)
    """
    res = res or x
    weight = weight or promote(x, res)
    out = out or promote(x, res)
    vec = VEC[x]
    sshape = small_shape(d, x) if small and not force_big else None
    if sshape is not None:
        lpr, items, wide = sshape
        rpb = max(1, min(SMALL_THREADS // lpr, _pow2ceil(n)))
        block = max(32, lpr * rpb)  # whole warps: the shuffles use a full mask
        rows = block // lpr
        return Launch(fwd_small_name(x, res, weight, out, items, wide), grid=math.ceil(n / rows),
                      block=block, shared=0, tpr=lpr, big=False)
    rl = None if force_big or not rows or d <= SMALL_D else rows_launch(
        n, d, x, res, weight, out, num_sms=num_sms, config=rows_config, device=device, has_res=has_res)
    if rl is not None:
        return rl
    shape = None if force_big else _reg_shape(d, vec, FWD_ITEMS_BY_X[x])
    if shape is not None:
        items, tpr = shape
        block = _row_block(n, tpr)
        rows = block // tpr
        return Launch(fwd_name(x, res, weight, out, items), grid=math.ceil(n / rows),
                      block=block, shared=0, tpr=tpr, big=False)
    h = promote(x, res)
    block = big_block(d, x)
    if split and takes_split(n, d, x, h, num_sms):
        s = slice_count(d, x)
        return Launch(fwd_split_name(x, res, weight, out, 1), grid=n * s, block=block, shared=0,
                      tpr=block, big=False, slices=s, name2=fwd_split_name(x, res, weight, out, 2))
    chunks = d // vec
    per_chunk = vec * ITEMSIZE[h]
    stash = max(0, min(chunks, (max_smem - STATIC_SMEM) // per_chunk))
    return Launch(fwd_name(x, res, weight, out, None), grid=n, block=block,
                  shared=stash * per_chunk, tpr=block, big=True, stash=stash)


@lru_cache(maxsize=4096)  # called per kernel launch: keep the Python overhead small
def backward_launch(
    n: int,
    d: int,
    x: str,
    dy: str | None = None,
    weight: str | None = None,
    *,
    partials: bool = True,
    num_sms: int = DEFAULT_SMS,
    max_smem: int = DEFAULT_SMEM,
    force_big: bool = False,
    has_w: bool = True,
    has_g: bool = False,
    split: bool = True,
    small: bool = True,
    rows: bool = True,
    rows_config: tuple[int, int] | None = None,
    device: str = "",
) -> Launch:
    """Launch of pn_bwd_small / pn_bwd_rows / pn_bwd / pn_bwd_big (persistent grid) / pn_bwd_split for ``n`` rows of ``d``.

    ``partials``: whether dweight or dbias partial sums are wanted (the
    caller allocates ``partial_rows x ldp`` buffers of the compute dtype,
    zero-filled for the big kernel).  ``has_w`` / ``has_g``: whether a weight /
    grad_residual is passed (compile-time parameters of pn_bwd).  Big rows go to pn_bwd_split where
    :func:`takes_split` says so (``split=False``: pn_bwd_big, the same bits):
    its partial rows are one per row, written once (no zero fill), and it
    needs a ``2 * n * slices`` float64 buffer.  Rows of ``d <= SMALL_D`` go to
    pn_bwd_small where :func:`small_bwd_shape` has a shape (``dx`` with
    pn_bwd's bits, which ``small=False`` requests; dweight / dbias rounded
    over its own partial rows).  Rows of ``d > SMALL_D`` whose tree :func:`bwd_tree`
    describes go to pn_bwd_rows (:func:`bwd_rows_launch`: pn_bwd's / pn_bwd_big's dx bits,
    which ``rows=False`` requests; ``rows_config`` = (warps per row, rows per block)
    overrides the rule and the tuning table of ``device``).

    >>> bl = backward_launch(4096, 4096, "bfloat16", num_sms=132)
    >>> bl.name, bl.grid, bl.block
    ('pn_bwd_rows<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 1, 2, true, false>', 264, 256)
    >>> bl = backward_launch(8, 262144, "bfloat16")
    >>> bl.name2, bl.grid, bl.partial_rows, bl.slices
    ('pn_bwd_split<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 2>', 128, 8, 16)

    >>> bl = backward_launch(4096, 4096, "bfloat16", num_sms=132, rows=False)
    >>> bl.name, bl.grid, bl.partial_rows, bl.ldp
    ('pn_bwd<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 1, true, false>', 264, 264, 4096)
    >>> backward_launch(8, 128, "float32", has_w=False, has_g=True, small=False).name
    'pn_bwd<float, float, float, 1, false, true>'
    >>> bl = backward_launch(1 << 21, 128, "bfloat16", num_sms=132)
    >>> bl.name, bl.block, bl.tpr, bl.grid, bl.shared
    ('pn_bwd_small<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 2, true, false, 8>', 256, 8, 528, 32768)
    """
    dy = dy or x
    weight = weight or x
    vec = VEC[x]
    ldp = math.ceil(d / vec) * vec
    sshape = small_bwd_shape(d, x) if small and not force_big and takes_small_bwd(d, x, dy) else None
    if sshape is not None:
        lpr, items, wide = sshape
        rpb = max(1, min(SMALL_THREADS // lpr, _pow2ceil(n)))
        block = max(32, lpr * rpb)  # whole warps: the shuffles use a full mask
        rows = block // lpr
        grid = max(1, min(math.ceil(n / rows), num_sms * max(1, BWD_THREADS_PER_SM // block)))
        shared = 2 * rows * ldp * ITEMSIZE[compute_dtype(x)] if partials else 0
        return Launch(bwd_small_name(x, dy, weight, items, lpr, has_w, has_g), grid=grid, block=block,
                      shared=shared, tpr=lpr, big=False, partial_rows=grid if partials else 0, ldp=ldp)
    rl = None if force_big or not rows else bwd_rows_launch(
        n, d, x, dy, weight, partials=partials, has_w=has_w, has_g=has_g, num_sms=num_sms, max_smem=max_smem,
        config=rows_config, device=device)
    if rl is not None:
        return rl
    # pn_bwd gives each thread at most one head or tail element: tpr >= 2 * VEC
    shape = None if force_big else _reg_shape(d, vec, BWD_ITEMS, min_tpr=2 * vec)
    if shape is not None:
        _, tpr = shape
        block = _row_block(n, tpr)
        rows = block // tpr
        grid = max(1, min(math.ceil(n / rows), num_sms * max(1, BWD_THREADS_PER_SM // block)))
        shared = bwd_shared(n, x, dy, partials, grid, block, tpr, ldp)
        return Launch(bwd_name(x, dy, weight, 1, has_w, has_g), grid=grid, block=block, shared=shared,
                      tpr=tpr, big=False, partial_rows=grid if partials else 0, ldp=ldp)
    if split and takes_split(n, d, x, x, num_sms):
        s = slice_count(d, x)
        block = big_block(d, x)
        return Launch(bwd_split_name(x, dy, weight, 1), grid=n * s, block=block, shared=0, tpr=block,
                      big=False, partial_rows=n if partials else 0, ldp=ldp, slices=s,
                      name2=bwd_split_name(x, dy, weight, 2))
    chunks = d // vec
    per_chunk = vec * (ITEMSIZE[x] + ITEMSIZE[dy])
    # the dy stash starts at the next 16-byte boundary after the x stash
    stash = max(0, min(chunks, (max_smem - STATIC_SMEM - 16) // per_chunk))
    shared = -(-stash * vec * ITEMSIZE[x] // 16) * 16 + stash * vec * ITEMSIZE[dy]
    block = big_block(d, x)
    grid = max(1, min(n, num_sms))
    return Launch(bwd_name(x, dy, weight, None), grid=grid, block=block, shared=shared,
                  tpr=block, big=True, stash=stash, partial_rows=grid if partials else 0, ldp=ldp)


def bwd_ring(x: str, dy: str, has_g: bool) -> tuple[int, int]:
    """(stages S, 16-byte pieces per lane and row) of pn_bwd's row ring (mirror of
    ``pn_bwd_ring`` in codegen/templates/backward.cu.j2).

    A row's pieces are x's chunk, dy's (one or two pieces) and grad_residual's
    when it is one piece; ``S * pieces * 16`` bytes per thread keep two
    512-thread (four 256-thread) blocks per SM on sm_80.

    >>> bwd_ring("bfloat16", "bfloat16", False), bwd_ring("bfloat16", "bfloat16", True)
    ((4, 2), (3, 3))
    >>> bwd_ring("bfloat16", "float32", True), bwd_ring("float64", "float64", True)
    ((3, 3), (3, 3))
    """
    dyn = ITEMSIZE[dy] * VEC[x] // 16
    units = 1 + dyn + (dyn if has_g and dyn == 1 else 0)
    return (4 if units == 2 else 3), units


def bwd_shared(n: int, x: str, dy: str, partials: bool, grid: int, block: int, tpr: int, ldp: int) -> int:
    """Dynamic shared memory of a pn_bwd launch (codegen/ABI.md): the tail elements'
    partial sums and the row ring (as many stages as a block's lanes have rows, at
    most S; sized for the larger of the rings with and without grad_residual, so the
    launch is the same for every HAS_W / HAS_G), or the dweight / dbias accumulator
    rows where they are larger (they alias both once the rows are done).

    >>> bwd_shared(4096, "bfloat16", "bfloat16", True, 264, 512, 512, 4096)
    73792
    >>> bwd_shared(1, "bfloat16", "bfloat16", True, 1, 32, 16, 128)
    2048
    """
    rows = block // tpr
    ct = ITEMSIZE[compute_dtype(x)]
    iters = -(-n // (grid * rows))
    per_row = max(min(s, iters) * u for s, u in (bwd_ring(x, dy, False), bwd_ring(x, dy, True)))
    ring = -(-2 * rows * VEC[x] * ct // 16) * 16 + per_row * 16 * block
    return max(ring, 2 * rows * ldp * ct if partials else 0)


@lru_cache(maxsize=4096)  # called per kernel launch: keep the Python overhead small
def colsum_launch(d: int, compute: str, out: str) -> Launch:
    """Launch of pn_colsum (``out`` as returned by :func:`colsum_out`)."""
    return Launch(colsum_name(compute, out), grid=math.ceil(d / 32), block=COLSUM_THREADS, shared=0,
                  tpr=0, big=False)


# ------------------------------------------------------------------ source and compiler options

#: the generated translation unit (see codegen/)
SOURCE_PATH = Path(__file__).resolve().parent / "polynorm.cu"
#: NVRTC options every compile uses (plus -I include_dirs() and the arch).  No FMA
#: contraction (``--fmad=false``): ptxas would fuse a product into an add in some
#: kernels and not in others (pn_bwd_big and pn_bwd_split, which n chooses between),
#: so a token's bits would depend on the launch; without it the GPU rounds every
#: operation as the source (and the CPU emulator) writes it.
NVRTC_OPTIONS = ("-std=c++17", "--fmad=false")


def source() -> str:
    """The generated CUDA source, exactly as compiled."""
    return SOURCE_PATH.read_text()


def include_dirs() -> list[str]:
    """The first directory holding cuda_fp16.h and cuda_bf16.h, as a list (empty if none).

    Looked for in the NVIDIA wheels (``nvidia-cuda-runtime``: ``nvidia/cu13/include``
    for CUDA 13, ``nvidia/cuda_runtime/include`` for CUDA 12), then in
    ``$CUDA_PATH``, ``$CUDA_HOME`` and ``/usr/local/cuda``.
    """
    import importlib.util
    import os

    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cuda_runtime", "cu12", "cuda_nvrtc"):
            candidates.append(Path(loc) / sub / "include")
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for inc in candidates:
        if (inc / "cuda_fp16.h").exists() and (inc / "cuda_bf16.h").exists():
            return [str(inc)]
    return []


# ------------------------------------------------------------------ fusions (gated, quant)
# One kernel per dtype combination for every d: a "segment" (a group of the
# gated norm, a row of the quantized one) is handled by `tpr` threads that
# loop over its chunks; tpr depends only on the segment's length and x's
# dtype (pn_fwd's choice for a row of that length, or FUSE_THREADS beyond),
# never on n, so a token's bits do not depend on the other tokens.

#: (x, z, out) dtypes of pn_gated_fwd: z and out in x's dtype or the compute dtype
GATED_FWD_TYPES: tuple[tuple[str, str, str], ...] = tuple(
    (t, zt, o) for t in FLOAT_DTYPES for zt in _options(t) for o in _options(t))
#: (x, z, dy) dtypes of pn_gated_bwd
GATED_BWD_TYPES: tuple[tuple[str, str, str], ...] = tuple(
    (t, zt, g) for t in FLOAT_DTYPES for zt in _options(t) for g in _options(t))
#: __launch_bounds__ of the fusion kernels, and the most threads of one segment
FUSE_THREADS = 1024


def gated_fwd_name(x: str, z: str, out: str) -> str:
    return f"pn_gated_fwd<{_ct(x, z, out)}>"


def gated_bwd_name(x: str, z: str, dy: str) -> str:
    return f"pn_gated_bwd<{_ct(x, z, dy)}>"


#: pn_quant_fwd's FMT template argument per quantized format
QUANT_FMT = {"int8": 0, "float8_e4m3fn": 1, "float8_e5m2": 2}


def quant_name(x: str, qdtype: str | bool = "float8_e4m3fn") -> str:
    """pn_quant_fwd's instance for ``x`` and a format (``True``/``False``: e4m3fn/int8).

    >>> quant_name("bfloat16", "float8_e5m2")
    'pn_quant_fwd<__nv_bfloat16, 2>'
    """
    if isinstance(qdtype, bool):
        qdtype = "float8_e4m3fn" if qdtype else "int8"
    return f"pn_quant_fwd<{_ct(x)}, {QUANT_FMT[qdtype]}>"


def kernel_dtype(x: str, other: str | None) -> str:
    """The dtype a fusion kernel takes an operand in: ``x``'s when it has it, else
    the compute dtype (an exact cast either way: it holds every value of ``other``).

    >>> kernel_dtype("bfloat16", "float16"), kernel_dtype("bfloat16", "bfloat16")
    ('float32', 'bfloat16')
    """
    return x if other in (None, x) else compute_dtype(x)


def segment_tpr(length: int, x: str) -> int:
    """Threads of one segment of ``length`` columns: pn_fwd's tpr for a row of that
    length where pn_fwd holds it (the same float runs and tree: the same sums),
    else :data:`FUSE_THREADS`.

    >>> segment_tpr(4096, "bfloat16"), segment_tpr(64, "float32"), segment_tpr(1 << 20, "float32")
    (256, 16, 1024)
    """
    shape = _reg_shape(length, VEC[x], FWD_ITEMS_BY_X[x])
    return FUSE_THREADS if shape is None else shape[1]


def _segment_launch(name: str, segments: int, length: int, x: str) -> Launch:
    tpr = segment_tpr(length, x)
    block = _row_block(segments, tpr)
    return Launch(name, grid=max(1, math.ceil(segments / (block // tpr))), block=block, shared=0,
                  tpr=tpr, big=False)


@lru_cache(maxsize=4096)
def gated_forward_launch(n: int, d: int, group_size: int, x: str, z: str | None = None,
                         out: str | None = None, *, rows: bool = True, num_sms: int = DEFAULT_SMS,
                         rows_config: tuple[int, int] | None = None, device: str = "") -> Launch:
    """Launch of the gated forward, kernel dtypes given: pn_gated_rows where
    :func:`gated_rows_launch` takes the segments (``rows_config``, ``device``: its knobs),
    else pn_gated_fwd (``rows=False`` requests it: the same bits), one segment per (row, group).

    >>> gl = gated_forward_launch(8, 4096, 1024, "bfloat16", rows=False)
    >>> gl.name, gl.tpr, gl.block, gl.grid
    ('pn_gated_fwd<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16>', 128, 256, 16)
    >>> gated_forward_launch(8, 4096, 1024, "bfloat16").name.split("<")[0]
    'pn_gated_rows'
    """
    if rows:
        rl = gated_rows_launch(n, d, group_size, x, z, out, num_sms=num_sms, config=rows_config, device=device)
        if rl is not None:
            return rl
    return _segment_launch(gated_fwd_name(x, z or x, out or x), n * (d // group_size),
                           group_size, x)


@lru_cache(maxsize=4096)
def gated_backward_launch(n: int, d: int, group_size: int, x: str, z: str | None = None,
                          dy: str | None = None) -> Launch:
    """Launch of pn_gated_bwd (the segments of :func:`gated_forward_launch`)."""
    return _segment_launch(gated_bwd_name(x, z or x, dy or x), n * (d // group_size),
                           group_size, x)


@lru_cache(maxsize=4096)
def quant_launch(n: int, d: int, x: str, fp8: str | bool = True, *, group_size: int | None = None,
                 rows: bool = True, num_sms: int = DEFAULT_SMS, rows_config: tuple[int, int] | None = None,
                 device: str = "") -> Launch:
    """Launch of the quantized forward: pn_quant_rows where :func:`quant_rows_launch` takes
    the rows (``group_size == d``: one scale group per row, or a static scale; ``rows_config``,
    ``device``: its knobs), else pn_quant_fwd, one segment per row (``rows=False`` or
    ``group_size`` None request it: the same bits).

    >>> quant_launch(3, 4096, "float32").tpr == forward_launch(3, 4096, "float32", rows=False).tpr
    True
    >>> quant_launch(3, 4096, "float32", group_size=4096).name
    'pn_quant_rows<float, 1, 2, 2>'
    """
    if rows and group_size is not None:
        rl = quant_rows_launch(n, d, x, fp8, group_size=group_size, num_sms=num_sms, config=rows_config,
                               device=device)
        if rl is not None:
            return rl
    return _segment_launch(quant_name(x, fp8), n, d, x)


# ------------------------------------------------------------------ hidden axis split across shards
# pn_split_stats sums a shard's squares over the forward's tree for that d (the same
# tpr, slices and tail order as the forward kernel forward_launch picks, pn_fwd_small
# standing for pn_fwd), so one shard's sum is the forward's; pn_split_fwd writes y
# from the all-reduced sum.  See codegen/templates/split_stats.cu.j2.


def split_stats_name(x: str) -> str:
    return f"pn_split_stats<{_ct(x)}>"


def split_fwd_name(x: str, w: str, out: str) -> str:
    return f"pn_split_fwd<{_ct(x, w, out)}>"


def split_specialisations() -> list[str]:
    """pn_split_stats for every x dtype, pn_split_fwd for the plain forward's (x, weight,
    out) dtypes (fp32 casting: the front end runs llama casting on the reference)."""
    return ([split_stats_name(t) for t in FLOAT_DTYPES]
            + [split_fwd_name(t[0], t[2], t[3]) for t in FWD_TYPES if t[0] == t[1]]
            + [f(t, g) for f in (split_dot_name, split_bwd_name) for t in FLOAT_DTYPES
               for g in _options(t)])


@dataclass(frozen=True)
class SplitStatsLaunch(Launch):
    """A :class:`Launch` of pn_split_stats plus its tree: ``span`` chunks per slice and
    whether the tail element opens slice 0 (``pn_fwd_big``) or closes it (``pn_fwd``)."""

    span: int = 0
    tail_first: bool = False


@lru_cache(maxsize=4096)
def split_stats_launch(n: int, d: int, x: str) -> SplitStatsLaunch:
    """Launch of pn_split_stats for ``n`` rows of ``d`` (kernel dtype ``x``): the tree
    of the forward kernel :func:`forward_launch` gives rows of ``d`` (pn_fwd's for the
    rows pn_fwd_small takes, pn_fwd_big's for pn_fwd_split's).

    >>> sl = split_stats_launch(3, 4096, "bfloat16")
    >>> sl.name, sl.tpr == forward_launch(3, 4096, "bfloat16", rows=False).tpr, sl.span, sl.tail_first
    ('pn_split_stats<__nv_bfloat16>', True, 512, False)
    >>> sl = split_stats_launch(2, 262144, "bfloat16")
    >>> sl.block, sl.tpr, sl.span == slice_span(262144, "bfloat16"), sl.tail_first, sl.grid
    (1024, 1024, True, True, 2)
    """
    fl = forward_launch(n, d, x, small=False, split=False, rows=False)  # the tree pn_fwd_rows keeps too
    body = d // VEC[x]
    if fl.big:
        tpr = block = fl.block
        passes = max(1, -(-body // tpr))
        span = slice_span(d, x) if compute_dtype(x) == "float32" else passes * tpr
        tail_first = True
    else:
        tpr, span, tail_first = fl.tpr, max(1, body), False
        block = _row_block(n, tpr)
    return SplitStatsLaunch(split_stats_name(x), grid=math.ceil(n / (block // tpr)), block=block,
                            shared=0, tpr=tpr, big=False, span=span, tail_first=tail_first)


@lru_cache(maxsize=4096)
def split_forward_launch(n: int, d: int, x: str, weight: str | None = None,
                         out: str | None = None) -> Launch:
    """Launch of pn_split_fwd (elementwise once rstd is known: ``tpr`` threads per row,
    at most :data:`ROW_BLOCK`, looping over its chunks).

    >>> fl = split_forward_launch(4, 4096, "float32")
    >>> fl.name, fl.tpr, fl.block, fl.grid
    ('pn_split_fwd<float, float, float>', 256, 256, 4)
    """
    tpr = min(ROW_BLOCK, _pow2ceil(-(-d // VEC[x])))
    block = _row_block(n, tpr)
    return Launch(split_fwd_name(x, weight or x, out or x), grid=math.ceil(n / (block // tpr)),
                  block=block, shared=0, tpr=tpr, big=False)


def split_dot_name(x: str, dy: str) -> str:
    return f"pn_split_dot<{_ct(x, dy)}>"


def split_bwd_name(x: str, dy: str) -> str:
    return f"pn_split_bwd<{_ct(x, dy)}>"


@lru_cache(maxsize=4096)
def split_backward_launch(n: int, d: int, x: str, dy: str | None = None, phase: int = 1) -> Launch:
    """Launch of pn_split_dot (``phase`` 1) or pn_split_bwd (2): ``tpr`` threads per row
    (a power of two, at most :data:`ROW_BLOCK`) looping over its columns.  ``dy`` is the
    kernel's dy dtype (``backward_types(...).dy``: x's or the compute dtype).

    >>> bl = split_backward_launch(4, 4096, "bfloat16", "float32", 2)
    >>> bl.name, bl.tpr, bl.block, bl.grid
    ('pn_split_bwd<__nv_bfloat16, float>', 256, 256, 4)
    """
    tpr = min(ROW_BLOCK, _pow2ceil(d))
    block = _row_block(n, tpr)
    name = (split_dot_name if phase == 1 else split_bwd_name)(x, dy or x)
    return Launch(name, grid=math.ceil(n / (block // tpr)), block=block, shared=0, tpr=tpr,
                  big=False)


# ------------------------------------------------------------------ QK-norm (+ RoPE)


def qk_name(x: str, neox: bool = True) -> str:
    """pn_qk_fwd's instance for heads of dtype ``x`` and a RoPE style (NeoX or GPT-J;
    either without RoPE).

    >>> qk_name("bfloat16")
    'pn_qk_fwd<__nv_bfloat16, 1>'
    """
    return f"pn_qk_fwd<{_ct(x)}, {int(neox)}>"


#: __launch_bounds__ of pn_qk_fwd: heads whose tree (pn_fwd's threads per row for a row
#: of ``d``) fits 256 threads, every head size in use (bfloat16 up to d = 4096); 1024
#: would leave 64 registers, and ptxas spills on sm_80
QK_THREADS = 256


def qk_takes(d: int, x: str) -> bool:
    """Whether pn_qk_fwd takes heads of ``d`` (dtype ``x``): its tree fits
    :data:`QK_THREADS` (longer heads run the reference on the device).

    >>> qk_takes(128, "bfloat16"), qk_takes(4096, "bfloat16"), qk_takes(1 << 16, "float32")
    (True, True, False)
    """
    return segment_tpr(d, x) <= QK_THREADS


@lru_cache(maxsize=4096)
def qk_launch(segments: int, d: int, x: str, neox: bool = True) -> Launch:
    """Launch of pn_qk_fwd: one segment per (token, head) of ``d`` columns; ``tpr``
    is pn_fwd's for a row of ``d`` (:func:`segment_tpr`), whatever the token count.

    >>> ql = qk_launch(40, 128, "bfloat16")
    >>> ql.name, ql.tpr == segment_tpr(128, "bfloat16"), ql.grid * ql.block // ql.tpr >= 40
    ('pn_qk_fwd<__nv_bfloat16, 1>', True, True)
    """
    return _segment_launch(qk_name(x, neox), segments, d, x)


# ------------------------------------------------------------------ pn_fwd_rows

#: __launch_bounds__ of pn_fwd_rows (with 2 blocks per SM: at most 128 registers)
ROWS_THREADS = 256
#: doubles of pn_fwd_rows' static shared memory (tree-warp sums: rows per block x tree warps)
ROWS_RED = 256
#: pn_fwd_rows' (IT, MW) instantiations by x dtype: IT chunks of one tree thread,
#: MW tree warps per lane (IT * MW register chunks of 16 bytes per lane; warps per row
#: = tree warps / MW)
ROWS_SHAPES = {
    "float16": ((1, 2), (1, 4), (1, 8), (2, 2), (2, 4)),
    "bfloat16": ((1, 2), (1, 4), (1, 8), (2, 2), (2, 4)),
    "float32": ((1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)),
    "float64": (),
}


def rows_types(t: tuple[str, str, str, str]) -> bool:
    """Whether pn_fwd_rows is instantiated for (x, residual, weight, out) dtypes ``t``:
    16-bit or float32 x with h of x's dtype (a float32 h of 16-bit x, whose chunk of h takes
    32 bytes, keeps pn_fwd: the same bits)."""
    x, res, _, _ = t
    return x != "float64" and res == x


#: most 16-byte chunks of h a lane holds (IT * MW of ROWS_SHAPES): 8 compile to 88-115
#: registers without spills (sm_90), 16 spill within the 128 of two 256-thread blocks per SM
ROWS_CHUNKS = 8
#: the tuning tables (device name -> case -> config), written by bench/gpu_check.sh
TUNING_DIR = Path(__file__).resolve().parent / "tuning"


def fwd_rows_name(x: str, res: str, w: str, out: str, it: int, mw: int) -> str:
    return f"pn_fwd_rows<{_ct(x, res, w, out)}, {it}, {mw}>"


@lru_cache(maxsize=4096)
def fwd_tree(d: int, x: str) -> tuple[int, int, bool] | None:
    """(T, IT, tail_first) of the tree the statistic of a row of ``d`` is summed over
    (d > SMALL_D, float compute): pn_fwd's threads per row and ITEMS, or pn_fwd_big's
    block and passes for rows of one slice; None for float64 and multi-slice rows.

    >>> fwd_tree(4096, "bfloat16"), fwd_tree(16384, "bfloat16"), fwd_tree(8192, "float32")
    ((256, 2, False), (1024, 2, True), (512, 4, False))
    >>> fwd_tree(32768, "bfloat16") is None, fwd_tree(4096, "float64") is None
    (True, True)
    """
    if compute_dtype(x) != "float32":
        return None
    vec = VEC[x]
    shape = _reg_shape(d, vec, FWD_ITEMS_BY_X[x])
    if shape is not None:
        items, tpr = shape
        return tpr, items, False
    if slice_count(d, x) != 1:
        return None
    t = big_block(d, x)
    return t, -(-(d // vec) // t), True


def rows_shape(shape: int) -> tuple[int, bool, int]:
    """(tree warps, tail first, warps per row) packed in pn_fwd_rows' ``shape`` argument.

    >>> rows_shape(pack_rows_shape(32, True, 4))
    (32, True, 4)
    """
    return shape & 255, bool((shape >> 12) & 1), (shape >> 16) & 255


def pack_rows_shape(tree_warps: int, tail_first: bool, warps_per_row: int) -> int:
    return tree_warps | (int(tail_first) << 12) | (warps_per_row << 16)


def _knob_pairs(nw: int, threads: int, instantiated, rpb_max: int | None = None) -> list[tuple[int, int]]:
    """Every (warps per row R, rows per block) of a rows-body kernel over a tree of ``nw``
    warps: R a power of two whose ``nw // R`` tree warps per lane are ``instantiated``, rows
    per block powers of two within ``threads`` and the block's reduction slots (ROWS_RED)."""
    out = []
    r = 1
    while r <= min(nw, threads // 32):
        if instantiated(nw // r):
            rpb = 1
            while (32 * r * rpb <= threads and rpb * nw <= ROWS_RED
                   and (rpb_max is None or rpb <= rpb_max)):
                out.append((r, rpb))
                rpb *= 2
        r *= 2
    return out


def rows_candidates(d: int, x: str, res: str | None = None) -> list[tuple[int, int]]:
    """Every (warps per row, rows per block) pn_fwd_rows has an instantiation for (the
    tuning sweep's candidates); [] where it does not take rows of ``d``.

    >>> rows_candidates(4096, "bfloat16")
    [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]
    """
    tree = fwd_tree(d, x) if d > SMALL_D else None
    if tree is None:
        return []
    t, it, _ = tree
    nw = t // 32
    return _knob_pairs(nw, ROWS_THREADS, lambda mw: _rows_inst(x, it, mw) is not None)


def _rows_inst(x: str, it: int, mw: int) -> tuple[int, int] | None:
    """The (IT, MW) instantiation holding ``it`` chunks of ``mw`` tree warps, if any."""
    return (it, mw) if (it, mw) in ROWS_SHAPES[x] else None


def _rows_rule(n: int, d: int, x: str, num_sms: int) -> tuple[int, int] | None:
    """(warps per row, rows per block) by rule: the fewest warps per row whose lanes hold
    at most ROWS_CHUNKS chunks, more while fewer than 4 warps per SM would have a row,
    rows per block up to ROWS_THREADS."""
    tree = fwd_tree(d, x)
    if tree is None:
        return None
    t, it, _ = tree
    nw = t // 32
    cap = ROWS_CHUNKS
    most = min(nw, ROWS_THREADS // 32)
    r = 1
    while r < most and ((nw // r) * it > cap or _rows_inst(x, it, nw // r) is None):
        r *= 2
    if (nw // r) * it > cap or _rows_inst(x, it, nw // r) is None:
        return None
    while 2 * r <= most and n * r < 4 * num_sms and _rows_inst(x, it, nw // (2 * r)) is not None:
        r *= 2
    rpb = max(1, min(ROWS_THREADS // (32 * r), _pow2ceil(n), ROWS_RED // nw))
    return r, rpb


def _rows_fits(x: str, d: int, r: int, rpb: int) -> bool:
    """Whether pn_fwd_rows has a launch of ``r`` warps per row and ``rpb`` rows per block."""
    return (r, rpb) in rows_candidates(d, x)


@cache
def tuning_table(device: str) -> dict:
    """The committed tuning table of ``device`` (``tuning/<device>.json``, spaces as '_'):
    case key (:func:`tuning_key`) -> {"warps_per_row", "rows_per_block", ...}; {} when none."""
    import json

    if not device:
        return {}
    path = TUNING_DIR / f"{device.replace(' ', '_')}.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc.get("cases", {}) if doc.get("device") == device else {}


def tuning_key(op: str, x: str, d: int, n: int) -> str:
    """A tuning table's case key: the op (fwd / add), x dtype, d and the row-count bucket
    (the power of two at or above n, capped at 2^15).

    >>> tuning_key("fwd", "bfloat16", 4096, 30000)
    'fwd:bfloat16:4096:32768'
    """
    return f"{op}:{x}:{d}:{min(_pow2ceil(n), 1 << 15)}"


@lru_cache(maxsize=4096)
def rows_launch(n: int, d: int, x: str, res: str | None = None, weight: str | None = None,
                out: str | None = None, *, num_sms: int = DEFAULT_SMS, config: tuple[int, int] | None = None,
                device: str = "", has_res: bool = False) -> Launch | None:
    """Launch of pn_fwd_rows, or None where it does not take the rows.

    ``config`` (warps per row, rows per block) when given, else the tuning table's
    entry for ``device`` and the case (``has_res``: the fused add), else :func:`_rows_rule`.  None of these change
    a bit of the result: the tree is fixed by ``d`` (:func:`fwd_tree`).

    >>> rl = rows_launch(4096, 16384, "bfloat16")
    >>> rl.name.split(", ")[-2:], rl.block, rl.grid, rows_shape(rl.tpr)
    (['2', '4>'], 256, 4096, (32, True, 8))
    """
    res = res or x
    weight = weight or promote(x, res)
    out = out or promote(x, res)
    tree = fwd_tree(d, x) if d > SMALL_D and rows_types((x, res, weight, out)) else None
    if tree is None:
        return None
    t, it, tail_first = tree
    nw = t // 32
    if config is None and device:
        # the entry of n's bucket, else of the nearest measured bucket below it
        tab = tuning_table(device)
        b = min(_pow2ceil(n), 1 << 15)
        while b >= 1 and config is None:
            e = tab.get(tuning_key("add" if has_res else "fwd", x, d, b))
            if e is not None and _rows_fits(x, d, int(e["warps_per_row"]), int(e["rows_per_block"])):
                config = (int(e["warps_per_row"]), int(e["rows_per_block"]))
            b //= 2
    if config is None:
        config = _rows_rule(n, d, x, num_sms)
        if config is None:
            return None
    r, rpb = config
    inst = _rows_inst(x, it, nw // r) if r <= nw and nw % r == 0 else None
    if inst is None or not _rows_fits(x, d, r, rpb):
        raise ValueError(f"pn_fwd_rows has no launch of {r} warps per row and {rpb} rows per block for d={d} {x}")
    return Launch(fwd_rows_name(x, res, weight, out, *inst), grid=max(1, math.ceil(n / rpb)),
                  block=32 * r * rpb, shared=0, tpr=pack_rows_shape(nw, tail_first, r), big=False)


# ------------------------------------------------------------------ casting="none"
# pn_none_fwd: one segment per row (the fusions' split, tpr = segment_tpr(d, x)),
# so a row's bits do not depend on the batch.


#: pn_none_fwd's ``pcode``/``bcode`` per format (pn_fmt; numba.codec.FORMAT_CODE)
FORMAT_CODE = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}


def none_wide(x: str) -> tuple[str, ...]:
    """The types pn_none_fwd computes the weight product and bias sum in for ``x``:
    x's compute type, and float64 (a float64 weight or bias).

    >>> none_wide("bfloat16"), none_wide("float64")
    (('float32', 'float64'), ('float64',))
    """
    return tuple(dict.fromkeys((compute_dtype(x), "float64")))


#: (x, wide, out) dtypes of pn_none_fwd: y written in any float dtype (one rounding)
NONE_FWD_TYPES: tuple[tuple[str, str, str], ...] = tuple(
    (t, g, o) for t in FLOAT_DTYPES for g in none_wide(t) for o in FLOAT_DTYPES)


def none_fwd_name(x: str, wide: str, out: str) -> str:
    """pn_none_fwd's instance.

    >>> none_fwd_name("bfloat16", "float32", "bfloat16")
    'pn_none_fwd<__nv_bfloat16, float, __nv_bfloat16>'
    """
    return f"pn_none_fwd<{_ct(x, wide, out)}>"


@lru_cache(maxsize=4096)
def none_launch(n: int, d: int, x: str, wide: str | None = None, out: str | None = None) -> Launch:
    """Launch of pn_none_fwd (``casting="none"``): one segment per row.

    >>> none_launch(3, 4096, "bfloat16").tpr == quant_launch(3, 4096, "bfloat16").tpr
    True
    """
    return _segment_launch(none_fwd_name(x, wide or compute_dtype(x), out or x), n, d, x)


# ------------------------------------------------------------------ pn_bwd_rows

#: __launch_bounds__ of pn_bwd_rows (with one block per SM: at most 128 registers)
BWD_ROWS_THREADS = 512
#: resident pn_bwd_rows threads per SM the persistent grid is sized for (128 registers each)
BWD_ROWS_THREADS_PER_SM = 512
#: pn_bwd_rows' (IT, MW) instantiations by x dtype: IT chunks of one tree thread, MW tree
#: warps per lane (IT * MW register chunks of x and of dy per lane).  16-bit x: at most 2
#: chunks (4 spill within 128 registers: float16 hundreds of bytes, bfloat16 without a
#: weight); MW 1 with IT 2 would need 32 warps per row (pn_bwd_big's 1024 tree threads)
BWD_ROWS_SHAPES = {
    "float16": ((1, 1), (1, 2)),
    "bfloat16": ((1, 1), (1, 2)),
    "float32": ((1, 1), (1, 2), (1, 4), (2, 2)),
    "float64": (),
}
#: most 16-byte chunks of x (and as many of dy) a pn_bwd_rows lane holds
BWD_ROWS_CHUNKS = 4
#: most rows per pn_bwd_rows block (row slots, each with two accumulator rows in shared memory)
BWD_ROWS_RPB = 8


def bwd_rows_name(x: str, dy: str, w: str, it: int, mw: int, has_w: bool = True, has_g: bool = False) -> str:
    return f"pn_bwd_rows<{_ct(x, dy, w)}, {it}, {mw}, {_tf(has_w)}, {_tf(has_g)}>"


def bwd_rows_types(x: str, dy: str) -> bool:
    """Whether pn_bwd_rows is instantiated for kernel dtypes x, dy: float compute and dy
    as wide as x (a float32 dy of 16-bit x keeps pn_bwd / pn_bwd_big: the same dx bits).

    >>> bwd_rows_types("bfloat16", "bfloat16"), bwd_rows_types("bfloat16", "float32")
    (True, False)
    """
    return x != "float64" and ITEMSIZE[dy] == ITEMSIZE[x]


@lru_cache(maxsize=4096)
def bwd_tree(d: int, x: str) -> tuple[int, int, bool] | None:
    """(T, IT, big) of the tree a backward row of ``d`` is summed over (float compute):
    pn_bwd's threads per row (IT 1), or pn_bwd_big's block and passes for single-slice
    rows (``big``: pn_bwd_big's arithmetic); None for float64 and multi-slice rows.

    >>> bwd_tree(4096, "bfloat16"), bwd_tree(8192, "bfloat16"), bwd_tree(16384, "bfloat16")
    ((512, 1, False), (1024, 1, True), (1024, 2, True))
    >>> bwd_tree(32768, "bfloat16") is None, bwd_tree(4096, "float64") is None
    (True, True)
    """
    if compute_dtype(x) != "float32":
        return None
    vec = VEC[x]
    shape = _reg_shape(d, vec, BWD_ITEMS, min_tpr=2 * vec)
    if shape is not None:
        return shape[1], 1, False
    if slice_count(d, x) != 1:
        return None
    t = big_block(d, x)
    return t, -(-(d // vec) // t), True


def _bwd_rows_inst(x: str, it: int, mw: int) -> tuple[int, int] | None:
    return (it, mw) if (it, mw) in BWD_ROWS_SHAPES[x] and it * mw <= BWD_ROWS_CHUNKS else None


def bwd_rows_candidates(d: int, x: str) -> list[tuple[int, int]]:
    """Every (warps per row, rows per block) pn_bwd_rows has an instantiation for; [] where
    it does not take rows of ``d``.

    >>> bwd_rows_candidates(4096, "bfloat16")
    [(8, 1), (8, 2), (16, 1)]
    """
    tree = bwd_tree(d, x) if d > SMALL_D else None
    if tree is None:
        return []
    t, it, _ = tree
    nw = t // 32
    return _knob_pairs(nw, BWD_ROWS_THREADS, lambda mw: _bwd_rows_inst(x, it, mw) is not None,
                       BWD_ROWS_RPB)


def _bwd_rows_rule(n: int, d: int, x: str) -> tuple[int, int] | None:
    """(warps per row, rows per block) by rule: the fewest warps per row whose lanes hold at
    most BWD_ROWS_CHUNKS chunks, rows per block up to a 256-thread block."""
    cands = bwd_rows_candidates(d, x)
    if not cands:
        return None
    r = min(c[0] for c in cands)
    rpb = max(1, min(ROW_BLOCK // (32 * r), _pow2ceil(n)))
    while (r, rpb) not in cands:
        rpb //= 2
    return r, rpb


def bwd_rows_shared(d: int, x: str, rpb: int, partials: bool) -> int:
    """pn_bwd_rows' dynamic shared memory: two accumulator rows (dweight, dbias) of ``ldp``
    compute-dtype values per row slot when partial sums are wanted, else 0."""
    ldp = math.ceil(d / VEC[x]) * VEC[x]
    return 2 * rpb * ldp * ITEMSIZE[compute_dtype(x)] if partials else 0


@lru_cache(maxsize=4096)
def bwd_rows_launch(n: int, d: int, x: str, dy: str | None = None, weight: str | None = None, *,
                    partials: bool = True, has_w: bool = True, has_g: bool = False,
                    num_sms: int = DEFAULT_SMS, max_smem: int = DEFAULT_SMEM,
                    config: tuple[int, int] | None = None, grid: int | None = None,
                    device: str = "") -> Launch | None:
    """Launch of pn_bwd_rows, or None where it does not take the rows.

    ``config`` (warps per row, rows per block) when given, else the tuning table's "bwd"
    entry for ``device``, else :func:`_bwd_rows_rule`; ``grid`` (persistent: blocks stride
    over row groups) when given, else as many blocks as fit the SMs
    (:data:`BWD_ROWS_THREADS_PER_SM`, shared memory), at most one per row group.  dx does
    not depend on any of these (the tree is fixed by ``d``: :func:`bwd_tree`); dweight /
    dbias are the sums of this launch's partial rows (``partial_rows = grid``).

    >>> bl = bwd_rows_launch(32768, 8192, "bfloat16")
    >>> bl.name, bl.block, bl.grid, rows_shape(bl.tpr), bl.shared
    ('pn_bwd_rows<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 1, 2, true, false>', 512, 132, (32, True, 16), 65536)
    """
    dy = dy or x
    weight = weight or x
    tree = bwd_tree(d, x) if d > SMALL_D and bwd_rows_types(x, dy) else None
    if tree is None:
        return None
    t, it, big = tree
    nw = t // 32
    if config is None and device:
        tab = tuning_table(device)
        b = min(_pow2ceil(n), 1 << 15)
        while b >= 1 and config is None:
            e = tab.get(tuning_key("bwd", x, d, b))
            if e is not None and (int(e["warps_per_row"]), int(e["rows_per_block"])) in bwd_rows_candidates(d, x):
                config = (int(e["warps_per_row"]), int(e["rows_per_block"]))
            b //= 2
    if config is None:
        config = _bwd_rows_rule(n, d, x)
        if config is None:
            return None
    r, rpb = config
    if config not in bwd_rows_candidates(d, x):
        raise ValueError(f"pn_bwd_rows has no launch of {r} warps per row and {rpb} rows per block for d={d} {x}")
    inst = _bwd_rows_inst(x, it, nw // r)
    assert inst is not None
    block = 32 * r * rpb
    shared = bwd_rows_shared(d, x, rpb, partials)
    if shared + STATIC_SMEM > max_smem:
        return None
    if grid is None:
        per_sm = max(1, BWD_ROWS_THREADS_PER_SM // block)
        if shared:
            per_sm = max(1, min(per_sm, max_smem // (shared + STATIC_SMEM)))
        grid = max(1, min(math.ceil(n / rpb), num_sms * per_sm))
    ldp = math.ceil(d / VEC[x]) * VEC[x]
    return Launch(bwd_rows_name(x, dy, weight, *inst, has_w, has_g), grid=grid, block=block, shared=shared,
                  tpr=pack_rows_shape(nw, big, r), big=False, partial_rows=grid if partials else 0, ldp=ldp)


def bwd_rows_specialisations() -> list[str]:
    """Every pn_bwd_rows instantiation the dispatcher can request."""
    names = []
    for t in BWD_TYPES:
        if bwd_rows_types(t[0], t[1]):
            for it, mw in BWD_ROWS_SHAPES[t[0]]:
                if it * mw <= BWD_ROWS_CHUNKS:
                    names += [bwd_rows_name(*t, it, mw, hw, hg) for hw in (False, True) for hg in (False, True)]
    return names


# ------------------------------------------------------------------ pn_gated_rows
# The gated forward on pn_fwd_rows' body: a segment (row, group) in a row's place, its
# statistic over pn_gated_fwd's tree (segment_tpr's threads, the tail after the chunks), so
# the bits are pn_gated_fwd's for every launch of it.

#: pn_gated_rows' (IT, MW) instantiations by x dtype (IT chunks of one tree thread, MW tree
#: warps per lane): a lane holds x and z (or u = x * silu(z)) of IT * MW chunks, at most 4
#: (8 spill 32-624 bytes within the 128 registers of two 256-thread blocks per SM, sm_90)
SEG_ROWS_SHAPES = {
    "float16": ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2)),
    "bfloat16": ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2)),
    "float32": ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)),
    "float64": (),
}


def gated_rows_name(x: str, z: str, out: str, it: int, mw: int) -> str:
    return f"pn_gated_rows<{_ct(x, z, out)}, {it}, {mw}>"


def gated_rows_types(t: tuple[str, str, str]) -> bool:
    """Whether pn_gated_rows is instantiated for (x, z, out) dtypes ``t``: float compute, z in
    x's dtype (a float32 z of 16-bit x keeps pn_gated_fwd)."""
    x, z, _ = t
    return x != "float64" and z == x


@lru_cache(maxsize=4096)
def segment_tree(length: int, x: str) -> tuple[int, int] | None:
    """(T, IT) of the tree a segment of ``length`` columns is summed over by the fusions
    (:func:`segment_tpr` threads, ``IT`` chunks of each, the tail after them), where the rows
    body takes it: float compute and at least one whole warp of tree threads.

    >>> segment_tree(4096, "bfloat16"), segment_tree(16384, "bfloat16"), segment_tree(128, "bfloat16")
    ((256, 2), (1024, 2), None)
    """
    if compute_dtype(x) != "float32":
        return None
    t = segment_tpr(length, x)
    if t < 32:
        return None
    return t, max(1, -(-(length // VEC[x]) // t))


def seg_rows_candidates(length: int, x: str, shapes: dict | None = None) -> list[tuple[int, int]]:
    """Every (warps per segment, segments per block) the rows body has an instantiation for,
    segments of ``length`` columns (the tuning sweep's candidates); [] where it takes none.

    >>> seg_rows_candidates(4096, "bfloat16")
    [(4, 1), (4, 2), (8, 1)]
    """
    shapes = SEG_ROWS_SHAPES if shapes is None else shapes
    tree = segment_tree(length, x)
    if tree is None:
        return []
    t, it = tree
    nw = t // 32
    return _knob_pairs(nw, ROWS_THREADS, lambda mw: _seg_inst(shapes, x, it, mw) is not None)


def _seg_inst(shapes: dict, x: str, it: int, mw: int) -> tuple[int, int] | None:
    """The instantiation (IT', MW) with the fewest slots IT' >= ``it`` (slots beyond the
    segment's chunks are skipped: the tree and the bits are the same), if any."""
    its = sorted(i for i, m in shapes[x] if m == mw and i >= it)
    return (its[0], mw) if its else None


def _seg_rows_config(op: str, segments: int, length: int, x: str, shapes: dict, num_sms: int,
                     config: tuple[int, int] | None, device: str) -> tuple[str, int, int, int, int] | None:
    """(it, mw, warps per segment, segments per block, tree warps) of a rows-body launch:
    ``config``, else the tuning table's entry of ``device`` for (op, x, length, segments),
    else the rule of :func:`_rows_rule` (the fewest warps whose lanes hold at most
    ROWS_CHUNKS chunks, more while fewer than 4 warps per SM would have a segment)."""
    tree = segment_tree(length, x)
    if tree is None:
        return None
    t, it = tree
    nw = t // 32
    cands = seg_rows_candidates(length, x, shapes)
    if config is None and device:
        tab = tuning_table(device)
        b = min(_pow2ceil(segments), 1 << 15)
        while b >= 1 and config is None:
            e = tab.get(tuning_key(op, x, length, b))
            if e is not None and (int(e["warps_per_row"]), int(e["rows_per_block"])) in cands:
                config = (int(e["warps_per_row"]), int(e["rows_per_block"]))
            b //= 2
    if config is None:
        most = min(nw, ROWS_THREADS // 32)
        r = 1
        while r < most and _seg_inst(shapes, x, it, nw // r) is None:
            r *= 2
        if _seg_inst(shapes, x, it, nw // r) is None:
            return None
        while 2 * r <= most and segments * r < 4 * num_sms and _seg_inst(shapes, x, it, nw // (2 * r)) is not None:
            r *= 2
        config = (r, max(1, min(ROWS_THREADS // (32 * r), _pow2ceil(segments), ROWS_RED // nw)))
    if config not in cands:
        raise ValueError(f"the rows body has no launch of {config[0]} warps per segment and {config[1]} "
                         f"segments per block for {op} segments of {length} {x}")
    r, rpb = config
    inst = _seg_inst(shapes, x, it, nw // r)
    assert inst is not None  # config is a candidate
    return x, inst[0], nw // r, r, rpb


@lru_cache(maxsize=4096)
def gated_rows_launch(n: int, d: int, group_size: int, x: str, z: str | None = None, out: str | None = None,
                      *, num_sms: int = DEFAULT_SMS, config: tuple[int, int] | None = None,
                      device: str = "") -> Launch | None:
    """Launch of pn_gated_rows, or None where it does not take the segments (float64,
    a z dtype other than x's, segments of fewer than 32 tree threads, too many chunks).

    ``config`` (warps per segment, segments per block) when given, else the tuning table's
    "gated" entry for ``device``, else the rule; none of these change a bit (the tree is
    fixed by ``group_size``: :func:`segment_tree`).

    >>> gl = gated_rows_launch(32768, 4096, 4096, "bfloat16")
    >>> gl.name, gl.block, gl.grid, rows_shape(gl.tpr)
    ('pn_gated_rows<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 2, 2>', 256, 16384, (8, False, 4))
    """
    z, out = z or x, out or x
    if not gated_rows_types((x, z, out)) or (x, z, out) not in GATED_FWD_TYPES:
        return None
    segments = n * (d // group_size)
    got = _seg_rows_config("gated", segments, group_size, x, SEG_ROWS_SHAPES, num_sms, config, device)
    if got is None:
        return None
    _, it, mw, r, rpb = got
    return Launch(gated_rows_name(x, z, out, it, mw), grid=max(1, math.ceil(segments / rpb)),
                  block=32 * r * rpb, shared=0, tpr=pack_rows_shape(r * mw, False, r), big=False)


def gated_rows_specialisations() -> list[str]:
    return [gated_rows_name(*t, it, mw) for t in GATED_FWD_TYPES if gated_rows_types(t)
            for it, mw in SEG_ROWS_SHAPES[t[0]]]


# ------------------------------------------------------------------ pn_quant_rows
# The quantized forward on pn_fwd_rows' body, one group per row (per-token or static
# scales): the row's statistic over pn_quant_fwd's tree (segment_tree(d)), so the bits are
# pn_quant_fwd's for every launch of it.

#: pn_quant_rows' (IT, MW) instantiations by x dtype: a lane holds h's words, then y as
#: floats, of IT * MW chunks; 8 chunks compile to 94-128 registers without spills (sm_80, sm_90)
QUANT_ROWS_SHAPES = {
    "float16": (*SEG_ROWS_SHAPES["float16"], (2, 4)),
    "bfloat16": (*SEG_ROWS_SHAPES["bfloat16"], (2, 4)),
    "float32": (*SEG_ROWS_SHAPES["float32"], (4, 2)),
    "float64": (),
}


def quant_rows_name(x: str, qdtype: str, it: int, mw: int) -> str:
    return f"pn_quant_rows<{_ct(x)}, {QUANT_FMT[qdtype]}, {it}, {mw}>"


@lru_cache(maxsize=4096)
def quant_rows_launch(n: int, d: int, x: str, fp8: str | bool = True, *, group_size: int | None = None,
                      num_sms: int = DEFAULT_SMS, config: tuple[int, int] | None = None,
                      device: str = "") -> Launch | None:
    """Launch of pn_quant_rows, or None where it does not take the rows (float64, several
    scale groups per row, rows of fewer than 32 tree threads or too many chunks).

    ``config`` (warps per row, rows per block) when given, else the tuning table's "quant"
    entry for ``device``, else the rule; none of these change a bit.

    >>> ql = quant_rows_launch(32768, 4096, "bfloat16")
    >>> ql.name, ql.block, rows_shape(ql.tpr)
    ('pn_quant_rows<__nv_bfloat16, 1, 2, 4>', 256, (8, False, 2))
    >>> quant_rows_launch(32768, 4096, "bfloat16", group_size=128) is None
    True
    """
    if isinstance(fp8, bool):
        fp8 = "float8_e4m3fn" if fp8 else "int8"
    if group_size not in (None, d) or x not in QUANT_ROWS_SHAPES:
        return None
    got = _seg_rows_config("quant", n, d, x, QUANT_ROWS_SHAPES, num_sms, config, device)
    if got is None:
        return None
    _, it, mw, r, rpb = got
    return Launch(quant_rows_name(x, fp8, it, mw), grid=max(1, math.ceil(n / rpb)),
                  block=32 * r * rpb, shared=0, tpr=pack_rows_shape(r * mw, False, r), big=False)


def quant_rows_specialisations() -> list[str]:
    return [quant_rows_name(t, q, it, mw) for t in FLOAT_DTYPES for q in QUANT_FMT
            for it, mw in QUANT_ROWS_SHAPES[t]]
