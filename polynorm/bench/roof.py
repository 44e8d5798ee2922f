"""The copy roof: the one definition every CPU benchmark measures its ops against.

The roof of an op on ``(n, d)`` array ``x`` is the fastest copy of ``x``'s
bytes, of these candidates (:func:`copies`):

``row``
    a parallel Numba copy, rows over the threads (as the kernels split them);
``stream``
    the same with streaming (non-temporal) stores, which do not read a
    destination line before writing it (:mod:`polynorm.backends.numba.stream`);
``numpy``
    ``np.copyto``.

For an op that allocates its output (``kind="alloc"``) each copy goes into a
freshly allocated array of the output's size (page faults included); for
``out=`` (``kind="plain"``) into an existing array, the ``out`` array itself
when given.  Without a usable Numba only ``numpy`` is left.

The op and every candidate are timed round-robin (:func:`paired_roof`): each
round times the op, then each copy, and its roof is the fastest copy of that
round, so the op and its roof always see the same machine state (this
machine's copy bandwidth was seen to change 2x from one second to the next);
the ratio is the median of the rounds' ratios.  ``polynorm bench`` and
``bench/cpu.py`` both measure their ratios this way, and the README quotes
them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

KINDS = ("alloc", "plain")

_kernels: dict[str, Any] = {}


def _numba_copiers() -> dict[str, Any]:
    """The compiled copies ``{"row": fn(src, dst), "stream": fn(src, dst, parts)}``, or
    ``{}`` when Numba cannot run here."""
    if "row" in _kernels or "none" in _kernels:
        return {k: v for k, v in _kernels.items() if k != "none"}
    try:
        from numba import njit, prange

        from polynorm.backends.numba.stream import LINE, line_gap, stream_copy, stream_fence
    except ImportError:
        _kernels["none"] = True
        return {}

    @njit(parallel=True, cache=False)
    def row(src, dst):  # pragma: no cover - compiled
        # rows in parallel, like the kernels (a flat chunked loop measured 4x slower)
        for i in prange(src.shape[0]):
            for j in range(src.shape[1]):
                dst[i, j] = src[i, j]

    @njit(parallel=True, cache=False)
    def stream(src, dst, parts):  # pragma: no cover - compiled
        n, d = src.shape
        per_line = LINE // dst.itemsize
        for p in prange(parts):
            for i in range(p * n // parts, (p + 1) * n // parts):
                h = min(d, line_gap(dst, i))
                e = h + (d - h) // per_line * per_line
                for j in range(h):
                    dst[i, j] = src[i, j]
                stream_copy(dst, i, h, src[i:i + 1, h:e], e - h)
                for j in range(e, d):
                    dst[i, j] = src[i, j]
            stream_fence()

    _kernels.update(row=row, stream=stream)
    return {"row": row, "stream": stream}


def _bits(a: np.ndarray) -> np.ndarray:
    """Numba takes no float16/bfloat16: copy their bytes as uint16."""
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def copies(x: np.ndarray, kind: str = "alloc", out: np.ndarray | None = None
           ) -> dict[str, Callable[[], Any]]:
    """The roof's candidate copies of 2-D array ``x``, by name (see the module docstring).

    ``kind="alloc"``: each call copies into a fresh array; ``"plain"``: into
    ``out`` (an array of ``x``'s shape and itemsize), or one allocated here once.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.arange(12, dtype=np.float32).reshape(3, 4)
    >>> fns = copies(x, "alloc")
    >>> "numpy" in fns and all(np.array_equal(f(), x) for f in fns.values())
    True
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    src = _bits(np.ascontiguousarray(x))
    k = _numba_copiers()
    if src.ndim != 2:
        k = {}
    import os

    parts = 4 * (os.cpu_count() or 1)
    if kind == "alloc":
        def fresh():
            return np.empty_like(src)

        def view(a):
            return a.view(x.dtype)

        fns: dict[str, Callable[[], Any]] = {}
        if "row" in k:
            fns["row"] = lambda: view(_run(k["row"], src, fresh()))
            fns["stream"] = lambda: view(_run(k["stream"], src, fresh(), parts))
        fns["numpy"] = lambda: view(_copyto(fresh(), src))
        return fns
    dst = _bits(out) if out is not None else np.empty_like(src)
    fns = {}
    if "row" in k:
        fns["row"] = lambda: _run(k["row"], src, dst)
        fns["stream"] = lambda: _run(k["stream"], src, dst, parts)
    fns["numpy"] = lambda: _copyto(dst, src)
    return fns


def _run(fn, src, dst, *more):
    fn(src, dst, *more)
    return dst


def _copyto(dst, src):
    np.copyto(dst, src)
    return dst


@dataclass
class Paired:
    """An op timed round-robin with its roof (:func:`paired_roof`)."""

    op_s: float  # median time of the op
    roof_s: float  # median over the rounds of the fastest copy's time
    speed: float  # median over the rounds of roof time / op time (1: as fast as the roof)
    fastest: str  # the candidate that was the fastest in most rounds
    rounds: int
    peers: dict[str, float]  # median time of each peer timed in the same rounds


def paired_roof(op: Callable[[], Any], x: np.ndarray, *, kind: str = "alloc",
                out: np.ndarray | None = None, min_time: float = 0.3, min_repeat: int = 5,
                peers: dict[str, Callable[[], Any]] | None = None) -> Paired:
    """Time ``op`` round-robin with every roof candidate of ``x`` (:func:`copies`).

    Each round calls ``op``, then every candidate copy (and every ``peers``
    callable, e.g. torch or ONNX Runtime on the same data, so that their
    ratios to ``op`` are paired too); rounds repeat for ``min_time`` seconds
    (at least ``min_repeat`` rounds), after one warm-up call of each.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.ones((64, 256), np.float32)
    >>> p = paired_roof(lambda: x * 2, x, min_time=0.01)
    >>> p.rounds >= 5 and p.fastest in ("row", "stream", "numpy") and p.speed > 0
    True
    """
    cands = copies(x, kind, out)
    others = dict(peers or {})
    for f in (op, *cands.values(), *others.values()):
        f()
    t_op: list[float] = []
    t_roof: list[float] = []
    ratio: list[float] = []
    wins: Counter[str] = Counter()
    t_peer: dict[str, list[float]] = {k: [] for k in others}
    start = time.perf_counter()
    while len(t_op) < min_repeat or time.perf_counter() - start < (2 + len(cands)) * min_time:
        t0 = time.perf_counter()
        op()
        t_op.append(time.perf_counter() - t0)
        best, name = float("inf"), ""
        for k, f in cands.items():
            t0 = time.perf_counter()
            f()
            t = time.perf_counter() - t0
            if t < best:
                best, name = t, k
        t_roof.append(best)
        wins[name] += 1
        ratio.append(best / t_op[-1])
        for k, f in others.items():
            t0 = time.perf_counter()
            f()
            t_peer[k].append(time.perf_counter() - t0)
        if len(t_op) >= 10_000:
            break
    return Paired(_median(t_op), _median(t_roof), _median(ratio), wins.most_common(1)[0][0],
                  len(t_op), {k: _median(v) for k, v in t_peer.items()})


def _median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2]
