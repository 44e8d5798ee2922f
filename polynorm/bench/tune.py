"""Launch tuning of pn_fwd_rows, pn_bwd_rows, pn_gated_rows and pn_quant_rows by measurement: a bounded sweep per case, and the table the dispatcher reads.

For each case (op fwd / add / bwd / gated / quant, dtype, tokens, d) the kernels alone (the call's
launches recorded and replayed, as ``polynorm.bench.gpu`` times them) are timed with the kernel
the dispatcher had before (``rows=False``), the rule's rows-body launch, and every
(warps per row, rows per block) of ``launch.rows_candidates`` (``launch.bwd_rows_candidates``;
the fusions: ``launch.seg_rows_candidates``, warps per segment, segments per block).
None of these change a bit of y, h, rstd, q or dx (the tree is fixed by ``d``); the backward's
dweight / dbias are the sums of each launch's partial rows.  The fastest config of each
case goes into the tuning table, ``polynorm/backends/cuda/tuning/<device>.json``
(``launch.tuning_table``); the sweep's every timing into a JSON beside it.  Both are
rewritten after every case, so a timeout keeps what was measured.

    python -m polynorm.bench.tune [--budget S] [--out DIR] [--install] [--dry-run]

``--install`` also writes the table into this checkout's ``cuda/tuning/`` (the dispatcher
reads it from the next process on, e.g. the benchmark that follows in gpu_check.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import json
import sys
import time
from pathlib import Path

from polynorm.backends.cuda import launch as cl

#: the sweep's cases, in the order they are measured (the headline shapes first)
TUNE_CASES = [(op, dt, n, d)
              for dt in ("bfloat16", "float16", "float32")
              for n in (32768, 4096)
              for d in (4096, 16384, 8192, 2048, 1024)
              for op in ("fwd", "add")] + [
              ("bwd", dt, n, d) for dt in ("bfloat16", "float16", "float32") for n in (32768, 4096)
              for d in (4096, 8192, 2048, 1024)]
# the fusions on the rows body (pn_gated_rows, pn_quant_rows: the benchmark's gated and quant
# calls, one group of d), after the forward's and backward's cases
TUNE_CASES += [(op, dt, n, d)
               for dt in ("bfloat16", "float16", "float32")
               for n in (32768, 4096)
               for d in (4096, 8192, 2048, 1024, 16384)
               for op in ("gated", "quant")]


def candidates(op: str, dtype: str, d: int) -> list[tuple[int, int] | None | str]:
    """What one case times: "before" (the kernel without pn_fwd_rows), None (the rule), the configs.

    >>> candidates("fwd", "bfloat16", 4096)[:3]
    ['before', None, (2, 1)]
    >>> candidates("fwd", "float32", 16384)
    []
    >>> candidates("bwd", "bfloat16", 8192)
    ['before', None, (16, 1)]
    """
    if op == "bwd":
        configs = cl.bwd_rows_candidates(d, dtype)
    elif op == "gated":
        configs = cl.seg_rows_candidates(d, dtype)
    elif op == "quant":
        configs = cl.seg_rows_candidates(d, dtype, cl.QUANT_ROWS_SHAPES)
    else:
        configs = cl.rows_candidates(d, dtype)
    return ["before", None, *configs] if configs else []


@contextlib.contextmanager
def forced(config, op: str = "fwd"):
    """The cupy backend's launches of ``op`` with ``config`` ("before": rows=False): the
    backward's for bwd, else the forward's, gated and quantized ones."""
    names = ("backward_launch",) if op == "bwd" else ("forward_launch", "gated_forward_launch",
                                                      "quant_launch")
    origs = {a: getattr(cl, a) for a in names}
    table = cl.tuning_table
    kw = {"rows": False} if config == "before" else {"rows_config": config}
    for a, f in origs.items():
        setattr(cl, a, functools.partial(f, **kw))
    cl.tuning_table = lambda device: {}  # type: ignore[assignment]  # None: the rule, not a table
    caches = (*origs.values(), cl.rows_launch, cl.bwd_rows_launch, cl.gated_rows_launch,
              cl.quant_rows_launch)
    for f in caches:
        f.cache_clear()
    try:
        yield
    finally:
        for a, f in origs.items():
            setattr(cl, a, f)
        cl.tuning_table = table  # type: ignore[assignment]
        for f in caches:
            f.cache_clear()


def sweep(cases, budget_s: float, on_case=None, progress=None) -> list[dict]:
    """Time every candidate of every case (until ``budget_s``); one dict per case."""
    import polynorm as pn
    from polynorm.bench.gpu import EPS, QUANT_SCALE, _kernel_time, _Lib

    lib = _Lib()
    start = time.perf_counter()
    out: list[dict] = []
    for i, (op, dt, n, d) in enumerate(cases):
        if dt not in lib.dtypes():
            continue
        if time.perf_counter() - start > budget_s:
            out.append({"op": op, "dtype": dt, "tokens": n, "d": d, "skipped": "time budget"})
            continue
        if progress:
            progress(i, len(cases), f"{op} {dt} {n}x{d}")
        row: dict = {"op": op, "dtype": dt, "tokens": n, "d": d, "timings": []}
        try:
            x = lib.randn((n, d), dt)
            w = lib.randn((d,), dt)
            r = lib.randn((n, d), dt) if op != "fwd" else None  # bwd: r is dy; gated: the gate z
            rstd = pn.rms_norm(x, w, eps=EPS, return_rstd=True)[1] if op == "bwd" else None
            if op == "fwd":
                call = lambda x=x, w=w: pn.rms_norm(x, w, eps=EPS)  # noqa: E731
            elif op == "add":
                call = lambda x=x, r=r, w=w: pn.add_rms_norm(x, r, w, eps=EPS)  # noqa: E731
            elif op == "bwd":
                call = lambda x=x, r=r, w=w, rstd=rstd: pn.rms_norm_backward(  # noqa: E731
                    r, x, w, rstd=rstd, eps=EPS)
            elif op == "gated":
                call = lambda x=x, r=r, w=w: pn.rms_norm_gated(x, r, w, eps=EPS)  # noqa: E731
            else:
                call = lambda x=x, r=r, w=w: pn.rms_norm_quant(  # noqa: E731
                    x, w, residual=r, scale=QUANT_SCALE, eps=EPS)
            for cfg in candidates(op, dt, d):
                with forced(cfg, op):
                    t, names = _kernel_time(lib, call)
                row["timings"].append({"config": cfg if cfg in ("before", None) else list(cfg),
                                       "seconds": t, "kernels": names})
            rows = [t for t in row["timings"] if isinstance(t["config"], list) and t["seconds"]]
            if rows:
                best = min(rows, key=lambda t: t["seconds"])
                row["best"] = best
        except Exception as exc:  # OOM, a launch error: the case says so, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            x = w = r = rstd = None
            lib.release()
        out.append(row)
        if on_case is not None:
            on_case(out)
    return out


def table(device: str, rows: list[dict]) -> dict:
    """The tuning table (``launch.tuning_table``'s format) from a sweep's cases."""
    cases = {}
    for row in rows:
        best = row.get("best")
        if not best:
            continue
        by = {json.dumps(t["config"]): t["seconds"] for t in row["timings"]}
        key = cl.tuning_key(row["op"], row["dtype"], row["d"], row["tokens"])
        cases[key] = {"warps_per_row": best["config"][0], "rows_per_block": best["config"][1],
                      "seconds": best["seconds"], "rule_seconds": by.get("null"),
                      "before_seconds": by.get('"before"'), "kernel": best["kernels"][0]}
    return {"device": device, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "what": "rows-body launch per case (op:x dtype:d:token bucket; ops fwd, add, bwd, gated, quant), "
                    "fastest of launch.rows_candidates / bwd_rows_candidates / seg_rows_candidates, kernels "
                    "alone (python -m polynorm.bench.tune)",
            "cases": cases}


def table_path(device: str, root: Path = cl.TUNING_DIR) -> Path:
    return root / f"{device.replace(' ', '_')}.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polynorm.bench.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=120.0, help="seconds before no new case starts")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder of the sweep JSON and table")
    p.add_argument("--install", action="store_true", help="also write the table into cuda/tuning/ here")
    p.add_argument("--dry-run", action="store_true", help="list the cases and candidates; needs no GPU")
    args = p.parse_args(argv)
    if args.dry_run:
        n = sum(len(candidates(op, dt, d)) for op, dt, _, d in TUNE_CASES)
        print(f"{len(TUNE_CASES)} cases, {n} timings, e.g. {TUNE_CASES[0]}: {candidates(*TUNE_CASES[0][:2], TUNE_CASES[0][3])}")
        return 0
    from polynorm.bench.gpu import _device_name, available

    ok, why = available()
    if not ok:
        print(f"tuning sweep cannot run: {why}", file=sys.stderr)
        return 2
    device = _device_name()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M")
    args.out.mkdir(parents=True, exist_ok=True)
    sweep_path = args.out / f"tune-{stamp}.json"

    def save(rows: list[dict]) -> None:
        doc = table(device, rows)
        sweep_path.write_text(json.dumps({"device": device, "cases": rows}, indent=1) + "\n")
        (args.out / "tuning").mkdir(exist_ok=True)
        table_path(device, args.out / "tuning").write_text(json.dumps(doc, indent=1) + "\n")
        if args.install:
            cl.TUNING_DIR.mkdir(exist_ok=True)
            table_path(device).write_text(json.dumps(doc, indent=1) + "\n")

    rows = sweep(TUNE_CASES, args.budget, on_case=save,
                 progress=lambda i, n, s: print(f"[tune {i}/{n}] {s}", file=sys.stderr, flush=True))
    save(rows)
    for row in rows:
        b = row.get("best")
        if b:
            by = {json.dumps(t["config"]): t["seconds"] for t in row["timings"]}
            print(f"{row['op']} {row['dtype']} {row['tokens']}x{row['d']}: best {b['config']} "
                  f"{b['seconds'] * 1e6:.1f} us, rule {(by.get('null') or 0) * 1e6:.1f} us, "
                  f"before {(by.get(chr(34) + 'before' + chr(34)) or 0) * 1e6:.1f} us")
    print(f"wrote {sweep_path} and {table_path(device, args.out / 'tuning')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
