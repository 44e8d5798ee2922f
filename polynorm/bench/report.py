"""``polynorm bench``: run the benchmark suites that can run here, then report.

Each suite module (``cpu``: Numba, ``gpu``: CuPy, ``interop``: torch/dask/jax)
exposes ``run(*, quick, dtypes, progress) -> list[Record]``.  Suites that
are missing or cannot run here are skipped with the reason; a suite that
crashes is reported and the others still run.  The ``reference`` suite below
needs nothing but numpy, so ``polynorm bench --quick`` always gives a table.

Output: a plain-text table per suite, and optionally JSON
(:func:`polynorm.bench.common.write_json`), a Markdown table and a PNG of
effective bandwidth against hidden size with the copy bandwidth as the roof.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polynorm.bench.common import Record, format_table, gbps, median_time
from polynorm.bench.roof import paired_roof

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Suite:
    name: str
    module: str | None  # None: the built-in reference suite
    backends: tuple[str, ...]  # what --backend selects it by
    needs: tuple[str, ...] = ()  # polynorm backends that must be usable (any of them)


SUITES: tuple[Suite, ...] = (
    Suite("cpu", "polynorm.bench.cpu", ("numba",), needs=("numba",)),
    Suite("gpu", "polynorm.bench.gpu", ("cupy",), needs=("cupy",)),
    Suite("interop", "polynorm.bench.interop", ("torch", "dask", "jax")),
    Suite("reference", None, ("array_api",)),
)

#: Values accepted by ``--backend``.
BACKENDS: tuple[str, ...] = tuple(dict.fromkeys(b for s in SUITES for b in s.backends))


@dataclass
class Outcome:
    """What one ``bench`` run produced."""

    records: list[Record] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    by_suite: dict[str, list[Record]] = field(default_factory=dict)


# ------------------------------------------------------------------ the built-in suite


def _reference_cases(quick: bool) -> tuple[tuple[int, ...], int, tuple[str, ...]]:
    """(hidden sizes, elements per array, ops); 16+ MB arrays, beyond the caches."""
    if quick:
        return (256, 1024, 4096), 2**22, ("fwd",)
    return (128, 256, 512, 1024, 2048, 4096, 8192), 2**23, ("fwd", "add", "bwd")


def run_reference(
    *, quick: bool = False, dtypes: list[str] | None = None, progress: Progress | None = None
) -> list[Record]:
    """The pure array-API reference on numpy, beside the copy roof (:mod:`.roof`),
    a hand-written numpy formula and torch's ``F.rms_norm`` when installed.

    Examples
    --------
    >>> from polynorm.bench import report
    >>> recs = report.run_reference(quick=True, dtypes=["float32"])
    >>> sorted({r.op for r in recs}), sorted(recs[0].ratios) in (["copy", "numpy"],
    ...                                                         ["copy", "numpy", "torch"])
    (['fwd'], True)
    """
    sizes, elems, ops = _reference_cases(quick)
    dts = dtypes or (["float32"] if quick else ["float16", "float32"])
    cases = [(op, dt, d) for dt in dts for op in ops for d in sizes]
    records: list[Record] = []
    for i, (op, dt, d) in enumerate(cases):
        if progress:
            progress(i, len(cases), f"{op} {dt} d={d}")
        records.append(_reference_case(op, dt, d, max(1, elems // d), 0.05 if quick else 0.2))
    if progress:
        progress(len(cases), len(cases), "done")
    return records


def _reference_case(op: str, dt: str, d: int, n: int, min_time: float) -> Record:
    import polynorm as pn
    from polynorm.core.dtypes import numpy_dtype

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, d), dtype=np.float32).astype(numpy_dtype(dt))
    w = np.ones(d, dtype=x.dtype)
    nb = x.nbytes
    if op == "fwd":
        fn = lambda: pn.rms_norm(x, w, backend="array_api")  # noqa: E731
        moved = 2 * nb + w.nbytes
    elif op == "add":
        r = x.copy()
        fn = lambda: pn.add_rms_norm(x, r, w, backend="array_api")  # noqa: E731
        moved = 4 * nb + w.nbytes
    else:
        dy = x.copy()
        fn = lambda: pn.rms_norm_backward(dy, x, w, backend="array_api")  # noqa: E731
        moved = 3 * nb + 2 * w.nbytes
    p = paired_roof(fn, x, min_time=min_time)
    t = p.op_s
    ratios = {"copy": p.speed * moved / (2 * nb)}
    if op == "fwd":
        ratios["numpy"] = median_time(lambda: _numpy_rms_norm(x, w), min_time=min_time) / t
        torch = _try_import("torch")
        if torch is not None:
            ratios["torch"] = _torch_time(torch, x, w, dt, min_time) / t
    return Record(
        suite="reference", op=op, backend="array_api", dtype=dt, tokens=n, d=d,
        seconds=t, bytes=moved, gbps=gbps(moved, t), ratios=ratios,
        extra={"copy_gbps": gbps(2 * nb, p.roof_s), "roof_copy": p.fastest, "device": "cpu"},
    )


def _numpy_rms_norm(x, w, eps=1e-6):
    """The usual numpy one-liner, in float32, as a peer."""
    v = x.astype(np.float32)
    return (v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * w).astype(x.dtype)


def _torch_time(torch, x, w, dt: str, min_time: float) -> float:
    f = torch.from_numpy(x.astype(np.float32))
    tdt = getattr(torch, dt)
    tx, tw = f.to(tdt), torch.from_numpy(w.astype(np.float32)).to(tdt)
    shape = (x.shape[-1],)
    return median_time(lambda: torch.nn.functional.rms_norm(tx, shape, tw, 1e-6),
                       min_time=min_time)


def _try_import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# ------------------------------------------------------------------ orchestration


def _resolve(suite: Suite) -> tuple[Callable[..., list[Record]] | None, str]:
    """The suite's ``run`` or None with the reason it cannot run here."""
    import polynorm as pn

    if suite.needs:
        report = pn.backends()
        if not any(report.get(b, (False, ""))[0] for b in suite.needs):
            why = "; ".join(f"{b}: {report.get(b, (False, 'unknown backend'))[1]}"
                            for b in suite.needs)
            return None, f"backend not usable ({why})"
    if suite.module is None:
        return run_reference, ""
    try:
        mod = importlib.import_module(suite.module)
    except ImportError as exc:
        return None, f"suite module not importable ({exc})"
    run = getattr(mod, "run", None)
    if run is None:
        return None, f"{suite.module} has no run()"
    available = getattr(mod, "available", None)
    if available is not None:
        ok, why = available()
        if not ok:
            return None, why
    return run, ""


def run_suites(
    *,
    quick: bool = False,
    backends: list[str] | None = None,
    dtypes: list[str] | None = None,
    progress: Callable[[str], Progress] | None = None,
) -> Outcome:
    """Run every suite that measures one of ``backends`` (default: all).

    ``progress(suite_name)`` returns the callback handed to that suite.
    """
    out = Outcome()
    for suite in SUITES:
        if backends is not None and not set(suite.backends) & set(backends):
            continue
        run, why = _resolve(suite)
        if run is None:
            out.skipped[suite.name] = why
            continue
        try:
            recs = run(quick=quick, dtypes=dtypes, progress=progress(suite.name) if progress else None)
        except Exception as exc:  # report and go on with the other suites
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            out.failed[suite.name] = (f"{type(exc).__name__}: {exc} "
                                      f"(at {Path(tb.filename).name}:{tb.lineno})")
            continue
        out.ran.append(suite.name)
        out.records.extend(recs)
        out.by_suite[suite.name] = recs
    return out


# ------------------------------------------------------------------ output


def text_report(outcome: Outcome) -> str:
    """One table per suite that ran, then what was skipped or failed."""
    parts = []
    for name in outcome.ran:
        recs = outcome.by_suite.get(name, [])
        parts.append(f"== {name} ({len(recs)} cases)")
        parts.append(format_table(recs) if recs else "(no records)")
        parts.append("")
    if outcome.skipped:
        parts.append("skipped suites:")
        parts += [f"  {k}: {v}" for k, v in outcome.skipped.items()]
    if outcome.failed:
        parts.append("FAILED suites:")
        parts += [f"  {k}: {v}" for k, v in outcome.failed.items()]
    parts.append("ratios: copy = GB/s over the GB/s of the copy roof (the fastest of a "
                 "parallel, a streaming and a numpy copy, timed in the same rounds: "
                 "polynorm.bench.roof); other columns = peer time / polynorm time "
                 "(>1: polynorm faster)")
    return "\n".join(parts)


def markdown_table(records: list[Record]) -> str:
    """The records as a GitHub Markdown table (for the README).

    >>> from polynorm.bench.common import Record
    >>> r = Record("cpu", "fwd", "numba", "float32", 256, 4096, 1e-3, 8_388_608, 8.4, {"copy": 0.9})
    >>> print(markdown_table([r]))
    | suite | op | backend | dtype | tokens | d | GB/s | copy |
    |---|---|---|---|---:|---:|---:|---:|
    | cpu | fwd | numba | float32 | 256 | 4096 | 8.4 | 0.90 |
    """
    first = {"copy": 0, "ort": 1, "torch": 2, "compile": 3, "numpy": 4}
    keys = sorted({k for r in records for k in r.ratios}, key=lambda k: (first.get(k, 5), k))
    head = ["suite", "op", "backend", "dtype", "tokens", "d", "GB/s", *keys]
    align = ["---"] * 4 + ["---:"] * (len(head) - 4)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in records:
        cells = [r.suite, r.op, r.backend, r.dtype, str(r.tokens), str(r.d), f"{r.gbps:.1f}",
                 *(f"{r.ratios[k]:.2f}" if k in r.ratios else "-" for k in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline(records: list[Record]) -> list[Record]:
    """Per (suite, op, backend, dtype) the record of the largest problem (tokens x d).

    >>> from polynorm.bench.common import Record
    >>> rs = [Record("cpu", "fwd", "numba", "float32", n, 4096, 1.0, 1, 1.0) for n in (1, 512, 8)]
    >>> [r.tokens for r in headline(rs)]
    [512]
    """
    best: dict[tuple[str, str, str, str], Record] = {}
    for r in records:
        key = (r.suite, r.op, r.backend, r.dtype)
        if key not in best or (r.tokens * r.d, r.d) > (best[key].tokens * best[key].d, best[key].d):
            best[key] = r
    return list(best.values())


def _roof(r: Record) -> float | None:
    if "copy_gbps" in r.extra:
        return float(r.extra["copy_gbps"])
    c = r.ratios.get("copy")
    return r.gbps / c if c else None


def plot(records: list[Record], path: str | Path, title: str = "") -> Path:
    """PNG of effective bandwidth: one column per op, one line per
    (backend, dtype), the copy bandwidth as a dashed roof (the cpu and gpu
    suites' own copies where they ran).

    Top row: against hidden size ``d`` (at each ``d`` the largest token
    count measured, the bandwidth-bound regime).  Bottom row, when a suite
    swept the token count: against tokens at the ``d`` measured most often.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ops = _swept_ops(records) or ["-"]
    d_common = statistics.mode([r.d for r in records]) if records else 0
    sweep = [r for r in records if r.d == d_common]
    rows = [("d", records, "hidden size d")]
    if len({r.tokens for r in sweep}) > 1:
        rows.append(("tokens", sweep, f"tokens (d = {d_common})"))
    fig, axes = plt.subplots(len(rows), len(ops), figsize=(5 * len(ops), 4 * len(rows)),
                             squeeze=False, sharey=True)
    colours: dict[tuple[str, str], str] = {}
    dtypes = sorted({r.dtype for r in records})
    for i, (xkey, recs, xlabel) in enumerate(rows):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            _panel(ax, [r for r in recs if r.op == op], xkey, colours, dtypes)
            ax.set_xlabel(xlabel)
            ax.set_title(op)
        axes[i][0].set_ylabel("effective bandwidth (GB/s)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _swept_ops(records: list[Record]) -> list[str]:
    """Ops worth a panel: some (suite, backend, dtype) of it was measured at two or more
    sizes (single-point measurements such as call overhead stay in the table); all ops
    when none was swept."""
    sizes: dict[tuple[str, str, str, str], set[tuple[int, int]]] = {}
    for r in records:
        sizes.setdefault((r.op, r.suite, r.backend, r.dtype), set()).add((r.tokens, r.d))
    ops = list(dict.fromkeys(r.op for r in records))
    swept = [op for op in ops if any(len(v) > 1 for k, v in sizes.items() if k[0] == op)]
    return swept or ops


def _panel(ax, recs: list[Record], xkey: str, colours: dict, dtypes: list[str]) -> None:
    """One axis: a line per (suite, backend, dtype) against ``xkey``, roofs dashed."""
    other = "tokens" if xkey == "d" else "d"
    best: dict[tuple[str, str, str, int], Record] = {}
    for r in recs:  # per x value keep the largest problem in the other dimension
        key = (r.suite, r.backend, r.dtype, getattr(r, xkey))
        if key not in best or getattr(r, other) > getattr(best[key], other):
            best[key] = r
    lines: dict[tuple[str, str, str], list[Record]] = {}
    for (suite, be, dt, _), r in best.items():
        lines.setdefault((suite, be, dt), []).append(r)
    styles = [("-", "o"), (":", "s"), ("-.", "^"), ((0, (1, 3)), "D")]  # "--": the roof
    for (suite, be, dt), rs in sorted(lines.items()):
        rs.sort(key=lambda r: getattr(r, xkey))
        label = f"{be} {dt}" if suite in ("cpu", "gpu", "reference") else f"{be} {dt} ({suite})"
        # colour: who (suite, backend); line style and marker: dtype
        ls, marker = styles[dtypes.index(dt) % len(styles)]
        ax.plot([getattr(r, xkey) for r in rs], [r.gbps for r in rs], marker=marker, ms=4,
                color=colours.setdefault((suite, be), f"C{len(colours) % 10}"), ls=ls,
                label=label)
    # the CPU suites share one roof definition (polynorm.bench.roof), the gpu suite has a
    # device copy: draw the main suites' roofs, the others only without them
    roofs: dict[str, dict[int, list[float]]] = {}
    for r in best.values():
        roof = _roof(r)
        if roof:
            roofs.setdefault(r.suite, {}).setdefault(getattr(r, xkey), []).append(roof)
    if set(roofs) & {"cpu", "gpu"}:
        roofs = {k: v for k, v in roofs.items() if k in ("cpu", "gpu")}
    for i, (suite, by_x) in enumerate(sorted(roofs.items())):
        xs = sorted(by_x)
        ax.plot(xs, [statistics.median(by_x[x]) for x in xs], color=("black", "gray")[i % 2],
                lw=1.5, ls="--", label=f"copy roof ({suite})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    if lines:
        ax.legend(fontsize=7)


# ------------------------------------------------------------------ progress


def make_progress(enabled: bool = True):
    """A context manager yielding ``factory(suite) -> callback`` (or None).

    rich if installed, else tqdm, else a line on stderr per tenth.  Written to
    stderr, so stdout holds only the report.
    """
    import contextlib

    if not enabled:
        return contextlib.nullcontext(None)
    rich_progress = _try_import("rich.progress")
    if rich_progress is not None:
        return _rich_progress(rich_progress)
    tqdm = _try_import("tqdm")
    if tqdm is not None:
        return _tqdm_progress(tqdm)
    return contextlib.nullcontext(_plain_factory)


def _plain_factory(suite: str) -> Progress:
    last = [-1]

    def cb(done: int, total: int, label: str) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth != last[0]:
            last[0] = tenth
            print(f"[{suite}] {done}/{total} {label}", file=sys.stderr, flush=True)

    return cb


class _rich_progress:
    def __init__(self, mod: Any):
        from rich.console import Console

        self.bar = mod.Progress(
            mod.TextColumn("{task.description}"), mod.BarColumn(), mod.MofNCompleteColumn(),
            mod.TimeElapsedColumn(), console=Console(stderr=True), transient=False,
        )

    def __enter__(self):
        self.bar.__enter__()

        def factory(suite: str) -> Progress:
            task = self.bar.add_task(suite, total=None)

            def cb(done: int, total: int, label: str) -> None:
                self.bar.update(task, completed=done, total=total, description=f"{suite}: {label}")

            return cb

        return factory

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)


class _tqdm_progress:
    def __init__(self, mod: Any):
        self.mod, self.bars = mod, []

    def __enter__(self):
        def factory(suite: str) -> Progress:
            bar = self.mod.tqdm(desc=suite, file=sys.stderr)
            self.bars.append(bar)

            def cb(done: int, total: int, label: str) -> None:
                bar.total = total
                bar.n = done
                bar.set_postfix_str(label)

            return cb

        return factory

    def __exit__(self, *exc):
        for b in self.bars:
            b.close()
        return False
