"""Timing, result records and output shared by every benchmark.

Ratios are what the benchmarks report: each case is timed beside its roofs
(a copy of the same bytes) and its peers in the same run, because absolute
times on shared machines are noisy.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def median_time(
    fn: Callable[[], Any],
    *,
    min_time: float = 0.2,
    min_repeat: int = 5,
    max_repeat: int = 10_000,
    sync: Callable[[], Any] | None = None,
) -> float:
    """Median wall time of ``fn()`` in seconds, after one warm-up call.

    Calls are repeated until ``min_time`` has passed (and at least
    ``min_repeat`` times); ``sync`` (e.g. a device synchronize) runs after
    each call inside the timed region.
    """
    fn()
    if sync:
        sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_repeat and (
        len(times) < min_repeat or time.perf_counter() - start < min_time
    ):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _paired_times(fa, fb, min_time: float, min_repeat: int) -> tuple[list[float], list[float]]:
    fa()
    fb()
    ta: list[float] = []
    tb: list[float] = []
    start = time.perf_counter()
    while len(ta) < min_repeat or time.perf_counter() - start < 2 * min_time:
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        fb()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
        if len(ta) >= 10_000:
            break
    return ta, tb


def _median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2]


def paired_median(
    fa: Callable[[], Any], fb: Callable[[], Any], *, min_time: float, min_repeat: int = 5
) -> tuple[float, float]:
    """Median times of ``fa`` and ``fb`` called alternately (after one warm-up each).

    On a shared machine the load changes from second to second; timing an op
    and its baseline interleaved exposes both to the same load, so their
    ratio is far steadier than that of two separate medians.
    """
    ta, tb = _paired_times(fa, fb, min_time, min_repeat)
    return _median(ta), _median(tb)


def paired_ratio(
    fa: Callable[[], Any], fb: Callable[[], Any], *, min_time: float, min_repeat: int = 5
) -> tuple[float, float, float]:
    """``(median time of fa, of fb, median of the per-pair ratios tb / ta)``.

    The ratio of each back-to-back pair, then their median: a pair sees one
    machine state (this machine's copy bandwidth was seen to change 2x from
    one second to the next), and the median drops the pairs that straddle a
    change.  Timed as :func:`paired_median`.
    """
    ta, tb = _paired_times(fa, fb, min_time, min_repeat)
    return _median(ta), _median(tb), _median([b / a for a, b in zip(ta, tb, strict=True)])


@dataclass
class Record:
    """One timed case.  ``ratios`` maps a baseline name to ``baseline_time / time``
    for peers (>1: polynorm faster) and ``gbps / roof_gbps`` for roofs."""

    suite: str  # "cpu" | "gpu" | "interop" | ...
    op: str  # "fwd" | "add" | "bwd" | ...
    backend: str
    dtype: str
    tokens: int
    d: int
    seconds: float
    bytes: int
    gbps: float
    ratios: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def stderr_progress(done: int, total: int, label: str) -> None:
    """The scripts' progress callback: one line on stderr, rewritten in place."""
    print(f"\r[{done}/{total}] {label:<40}", end="", file=sys.stderr, flush=True)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def write_json(path: str | Path, records: list[Record], meta: dict[str, Any] | None = None) -> None:
    """Write records plus machine description to ``path`` (folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine_info(), "meta": meta or {}, "records": [asdict(r) for r in records]}
    path.write_text(json.dumps(doc, indent=1, default=float) + "\n")


def format_table(records: list[Record], ratio_keys: list[str] | None = None) -> str:
    """A plain-text table: one row per record, GB/s and every ratio."""
    if ratio_keys is None:
        ratio_keys = sorted({k for r in records for k in r.ratios})
    head = ["op", "backend", "dtype", "tokens", "d", "time", "GB/s", *ratio_keys]
    rows = [head]
    for r in records:
        rows.append(
            [r.op, r.backend, r.dtype, str(r.tokens), str(r.d), _fmt_time(r.seconds),
             f"{r.gbps:.1f}", *(f"{r.ratios[k]:.2f}" if k in r.ratios else "-" for k in ratio_keys)]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def _fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f}us"
    if s < 1:
        return f"{s * 1e3:.2f}ms"
    return f"{s:.2f}s"
