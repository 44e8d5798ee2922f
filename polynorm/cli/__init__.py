"""The ``polynorm`` command: ``info``, ``check`` and ``bench``.

Exit codes: 0 success, 1 a check or benchmark suite failed, 2 bad arguments
(a usage message, never a traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from polynorm.core.dtypes import FLOAT_DTYPES


def _backend_names() -> tuple[str, ...]:
    # the package, not the function pn.backends that shadows it as an attribute
    return tuple(importlib.import_module("polynorm.backends").MODULES)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so :func:`main` returns the code."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise _UsageError(2)


class _UsageError(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _parser() -> argparse.ArgumentParser:
    from polynorm.bench.report import BACKENDS as BENCH_BACKENDS

    p = _Parser(prog="polynorm", description="RMSNorm / pRMSNorm for every array library.")
    from polynorm import __version__

    p.add_argument("--version", action="version", version=f"polynorm {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{info,check,bench,warmup}",
                           parser_class=_Parser)

    sub.add_parser("info", help="version, backends and why not, threads, GPU")

    c = sub.add_parser("check", help="self-test every usable backend (exit 1 on any failure)")
    c.add_argument("--backend", action="append", choices=_backend_names(),
                   help="check only this backend (repeatable; default: all)")
    c.add_argument("--dtype", action="append", choices=FLOAT_DTYPES,
                   help="check only this dtype (repeatable; default: all four)")

    w = sub.add_parser("warmup", help="compile the CPU kernels now (cached for later processes)")
    w.add_argument("--dtype", action="append", choices=FLOAT_DTYPES,
                   help="compile only for this dtype (repeatable; default: all four)")
    w.add_argument("--no-backward", action="store_true", help="skip the backward")
    w.add_argument("--no-jax", action="store_true",
                   help="skip the handlers of jitted polynorm.jax calls (compiled where jax "
                        "is installed)")
    w.add_argument("--cuda", metavar="ARCH",
                   help="instead: compile every CUDA kernel for ARCH (e.g. sm_90) with NVRTC, "
                        "one process per core; needs no GPU")

    b = sub.add_parser("bench", help="benchmark the installed backends")
    b.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    b.add_argument("--backend", action="append", choices=BENCH_BACKENDS,
                   help="run only the suites measuring this backend (repeatable)")
    b.add_argument("--dtype", action="append", choices=FLOAT_DTYPES,
                   help="only this dtype (repeatable; default: each suite's own)")
    b.add_argument("--json", metavar="FILE", help="write the records and machine as JSON")
    b.add_argument("--plot", metavar="FILE", help="write a PNG: GB/s against hidden size")
    b.add_argument("--markdown", metavar="FILE", help="write the results as a Markdown table")
    b.add_argument("--readme", metavar="README", nargs="?", const="README.md",
                   help="measure nothing: write the performance tables of README (default "
                        "README.md, between its perf markers) and docs/performance.rst from "
                        "the newest full run per device committed in bench/results/")
    b.add_argument("--check", action="store_true",
                   help="with --readme: write nothing, exit 1 when either file is stale")
    b.add_argument("--results", metavar="DIR",
                   help="with --readme: the record files (default: bench/results beside README)")
    b.add_argument("--docs", metavar="FILE",
                   help="with --readme: the page to write (default: docs/performance.rst "
                        "beside README)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--gpu-model", action="store_true",
                   help="measure nothing: the CUDA launch model calibrated on the H200 records, its "
                        "error and its prediction beside each measurement (--json: write them); "
                        "needs no GPU")
    return p


# ------------------------------------------------------------------ info


#: module -> distributions that may provide it (cupy ships under several names)
_DISTS = {
    "numpy": ("numpy",), "numba": ("numba",), "torch": ("torch",), "dask": ("dask",),
    "jax": ("jax",), "array_api_compat": ("array-api-compat",), "ml_dtypes": ("ml_dtypes",),
    "cupy": ("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy"),
}


def _version(module: str) -> str:
    """Installed version from package metadata: no import (jax alone takes seconds)."""
    from importlib import metadata

    for dist in _DISTS.get(module, (module,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "-"


def _numba_threads() -> str:
    try:
        import numba
    except ImportError:
        return "numba not installed"
    layer: str
    try:
        from polynorm.backends import numba as nb

        nb.start_threads()  # the layer polynorm's parallel kernels get (TBB where installed)
        layer = numba.threading_layer()
    except ValueError:
        # numba picks the layer (tbb, omp, workqueue) at the first parallel launch: probe one
        try:
            @numba.njit(parallel=True)
            def probe(n):
                s = 0
                for i in numba.prange(n):
                    s += i
                return s

            probe(8)
            layer = numba.threading_layer()
        except Exception as exc:  # no usable threading layer at all
            layer = f"none usable ({type(exc).__name__}: {exc})"
    return f"{numba.get_num_threads()} threads, threading layer {layer}"


def _gpu() -> str:
    try:
        import cupy
    except Exception:
        return "cupy not installed"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        if n == 0:
            return "no CUDA device"
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        rt = cupy.cuda.runtime.runtimeGetVersion()
        drv = cupy.cuda.runtime.driverGetVersion()
        return (f"{name} (x{n}), compute capability {props['major']}.{props['minor']}, "
                f"CUDA runtime {rt // 1000}.{rt % 1000 // 10}, driver {drv // 1000}.{drv % 1000 // 10}")
    except Exception as exc:  # no driver, no device, broken install
        return f"unavailable ({type(exc).__name__}: {exc})"


def cmd_info(args: argparse.Namespace) -> int:
    import polynorm as pn

    print(f"polynorm {pn.__version__}  (python {sys.version.split()[0]})")
    print("backends:")
    for name, (ok, why) in pn.backends().items():
        print(f"  {name:<10} {'usable' if ok else 'not usable'}" + ("" if ok else f": {why}"))
    print(f"numba:    {_numba_threads()}")
    print(f"GPU:      {_gpu()}")
    print("versions: " + ", ".join(f"{m} {_version(m)}" for m in _DISTS))
    return 0


# ------------------------------------------------------------------ check


def cmd_check(args: argparse.Namespace) -> int:
    import polynorm as pn
    from polynorm.cli import check as _check

    backends = args.backend
    if backends:
        report = pn.backends()
        unknown = [b for b in backends if b not in report]
        if unknown:
            raise ValueError(f"--backend: unknown backend {unknown[0]!r}")
        # a backend asked for by name must run: "0 checks passed" would read as a pass
        hints = importlib.import_module("polynorm.backends").INSTALL_HINT
        for b in backends:
            usable, reason = report[b]
            if not usable:
                if hints[b] not in reason:
                    reason = f"{reason}; to install: {hints[b]}"
                raise ValueError(f"--backend {b}: backend {b!r} is not available here: {reason}")
    rows = _check.run(backends, args.dtype)
    print(_check.format_rows(rows))
    return 1 if _check.failed(rows) else 0


# ------------------------------------------------------------------ warmup


def cmd_warmup(args: argparse.Namespace) -> int:
    import polynorm as pn
    from polynorm.cli.warmup import warmup
    from polynorm.core.cache import cache_dir

    if args.cuda:
        import time

        from polynorm.backends.cuda import nvrtc as _nvrtc

        ok, why = _nvrtc.available()
        if not ok:
            raise ValueError(f"--cuda compiles with NVRTC, which is not usable here: {why}")
        t0 = time.perf_counter()
        count = _nvrtc.warm_cache(args.cuda)
        print(f"{count} CUDA kernels for {args.cuda} cached in {cache_dir() / 'cubin'} "
              f"({time.perf_counter() - t0:.1f} s)")
        return 0
    ok, why = pn.backends()["numba"]
    if not ok:
        raise ValueError(f"warmup compiles the Numba kernels, which are not usable here: {why}")
    print(f"compiling into {cache_dir() / 'numba'}")
    steps = warmup(args.dtype, backward=not args.no_backward, jax=not args.no_jax,
                   report=lambda what, s: print(f"  {what:<20} {s:6.2f} s", flush=True))
    print(f"done in {sum(s for _, s in steps):.1f} s")
    return 0


# ------------------------------------------------------------------ bench


def _check_output(flag: str, path: str | None) -> None:
    """Fail before minutes of benchmarking, not after, on an output path that cannot be written.

    Nothing is created here: the file's folder is made when the file is written, after the
    run, so a refused run leaves the file system as it was.  Writability is probed with a
    temporary file in the nearest existing folder (``os.access`` says yes to root even on
    ``/proc``), removed at once.
    """
    import tempfile
    from pathlib import Path

    if path is None:
        return
    target = Path(path).absolute()
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, not a file path")
    if target.exists() and not target.is_file():
        raise ValueError(f"{flag} {path}: not a regular file")
    folder = target.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is not a folder")
    try:
        if target.exists():
            with open(target, "ab"):  # appends nothing: checks the file itself is writable
                pass
        else:
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None


def _write_text(path: str, text: str) -> None:
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def cmd_bench(args: argparse.Namespace) -> int:
    from polynorm.bench import common, report

    if args.readme is not None:
        return _bench_readme(args)
    for flag in ("check", "results", "docs"):
        if getattr(args, flag):
            raise ValueError(f"--{flag} goes with --readme")
    if args.gpu_model:
        from polynorm.bench import model

        _check_output("--json", args.json)
        text, doc = model.report()
        print(text)
        if args.json:
            import json
            from pathlib import Path

            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        return 0

    for flag in ("json", "plot", "markdown"):
        _check_output(f"--{flag}", getattr(args, flag))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'polynorm[bench]'") from None
    info = common.machine_info()
    machine = f"{info.get('cpu_model', info['processor'])}, {info['cpu_count']} CPUs"
    try:  # a busy machine gives noisy numbers: say how busy it was
        machine += f" (load average {os.getloadavg()[0]:.1f} at start)"
    except (AttributeError, OSError):  # not on every platform
        pass
    gpu = _gpu()
    if not gpu.startswith(("cupy not", "no CUDA", "unavailable")):
        machine += f"; GPU {gpu}"
    print(f"machine: {machine}")
    with report.make_progress(not args.no_progress) as progress:
        outcome = report.run_suites(quick=args.quick, backends=args.backend, dtypes=args.dtype,
                                    progress=progress)
    print(report.text_report(outcome))
    if args.backend and not outcome.ran and not outcome.failed:
        raise ValueError(f"--backend {' '.join(args.backend)}: nothing can run here "
                         f"({'; '.join(f'{k}: {v}' for k, v in outcome.skipped.items())})")
    meta = {"argv": args.argv, "quick": args.quick, "ran": outcome.ran,
            "skipped": outcome.skipped, "failed": outcome.failed, "machine_summary": machine}
    if args.json:
        common.write_json(args.json, outcome.records, meta)
        print(f"wrote {args.json}")
    if args.markdown:
        _write_text(args.markdown, report.markdown_table(outcome.records) + "\n")
        print(f"wrote {args.markdown}")
    if args.plot:
        if outcome.records:
            report.plot(outcome.records, args.plot, title=f"polynorm bench: {machine}")
            print(f"wrote {args.plot}")
        else:
            print("no records: no plot written", file=sys.stderr)
    return 1 if outcome.failed else 0


def _bench_readme(args: argparse.Namespace) -> int:
    """``bench --readme [--check]``: the tables from the committed records; runs no suite."""
    from polynorm.bench import readme

    runs = [f for f in ("quick", "backend", "dtype", "json", "plot", "markdown", "gpu_model")
            if getattr(args, f)]
    if runs:
        raise ValueError(f"--readme measures nothing and takes no --{runs[0].replace('_', '-')}"
                         ": run the benchmark with --json into bench/results/ first")
    if not args.check:
        for flag, path in (("--readme", args.readme), ("--docs", args.docs)):
            _check_output(flag, path)
    files = readme.update(args.readme, args.results, args.docs, check=args.check)
    for path in files:
        print(f"{'stale' if args.check else 'wrote'}: {path}")
    if args.check and files:
        print(f"run `polynorm bench --readme` to regenerate {len(files)} file(s)",
              file=sys.stderr)
        return 1
    if not files:
        print("up to date")
    return 0


# ------------------------------------------------------------------ entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``polynorm`` command line.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments after ``polynorm``; default ``sys.argv[1:]``.

    Returns
    -------
    int
        0 on success, 1 when a check or a benchmark suite failed, 2 for bad
        arguments (after printing a usage message to stderr).

    Examples
    --------
    >>> from polynorm.cli import main
    >>> main(["info"])  # doctest: +ELLIPSIS
    polynorm ...
    0
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        return e.code
    except SystemExit as e:  # --help / --version
        return int(e.code or 0)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("polynorm: error: a command is required (info, check, bench or warmup)",
              file=sys.stderr)
        return 2
    command = {"info": cmd_info, "check": cmd_check, "bench": cmd_bench,
               "warmup": cmd_warmup}[args.command]
    try:
        return command(args)
    except (ValueError, TypeError) as exc:
        # polynorm's own argument errors (they name the argument); a bug elsewhere would
        # also land here, so the message says what happened rather than hiding it
        parser.print_usage(sys.stderr)
        print(f"polynorm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
