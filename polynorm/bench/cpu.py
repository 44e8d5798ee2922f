"""CPU benchmark: the Numba backend against the copy roofs and its peers.

For every case of the matrix -- tokens x d in :data:`SHAPES`, dtypes in
:data:`DTYPES`, ops ``fwd``, ``fwd-out`` (``out=`` given), ``add`` (fused
residual add) and ``bwd`` (dx + dweight) -- polynorm's call through the
public API is timed (median) and reported as effective bandwidth over the
bytes the op must move (:func:`op_bytes`), beside:

``copy``
    that bandwidth over the roof's (:mod:`polynorm.bench.roof`, the one roof
    definition): the fastest of a parallel row copy, a streaming copy and
    ``np.copyto`` of one ``(tokens, d)`` array, into a freshly allocated
    array (page faults included) for the ops that allocate their output
    (``fwd``/``add``/``bwd``), into the ``out=`` array for ``fwd-out``.  The
    op and the candidate copies are timed round-robin and the ratio is the
    median of the rounds' ratios (:func:`~polynorm.bench.roof.paired_roof`),
    so both see the same machine load; the round's fastest copy is the roof.
``ort``
    ONNX Runtime's time over polynorm's (> 1: polynorm is faster), timed in
    the same rounds: the faster of ``RMSNormalization`` (opset 23) and
    ``SimplifiedLayerNormalization`` for ``fwd``/``fwd-out`` (``out=``: output
    bound to the ``out`` array through an IO binding),
    ``SkipSimplifiedLayerNormalization`` (com.microsoft; ``y`` and ``h``) for
    ``add``; none for ``bwd`` (no backward in the inference package) nor for
    a dtype ONNX Runtime's CPU provider does not run (bfloat16).  Needs the
    ``ort`` extra (``pip install 'polynorm[ort]'``); skipped without it.
``torch``
    torch's time over polynorm's (> 1: polynorm is faster): ``F.rms_norm``
    for ``fwd``/``fwd-out``, ``x + r`` then ``F.rms_norm`` for ``add``, the
    autograd backward of ``F.rms_norm`` (graph retained, backward only) for
    ``bwd``.
``compile``
    the same for ``torch.compile`` of those functions (forward ops only;
    skipped where it cannot compile, e.g. without a C++ compiler).
``numpy``
    the same for a plain numpy expression in float32.

``bwd`` is given the forward's ``rstd`` (computed outside the timing), as in
a training step; torch's autograd has it saved as well.

The targets (16384 x 4096 and 4096 x 16384): ``fwd`` float32 >= 0.90 of the
allocating roof and ``fwd-out`` >= 0.90 of the plain roof; bfloat16 /
float16 ``fwd`` and ``add`` >= 0.85; ``bwd`` >= 0.80 for 16-bit data;
``ort`` > 1 wherever ONNX Runtime runs; ``torch`` >= 5 for float32 ``fwd``;
and the (1, 4096) float32 call <= 0.5x torch's time (``torch`` >= 2).

``--threshold`` instead times the serial and the parallel forward kernel on
small inputs: how :data:`polynorm.backends.numba.SERIAL_MAX_ELEMENTS` was
chosen.  ``--stream`` times float32 ``out=`` calls with streaming stores
against ordinary ones, paired, by output size: how
:data:`polynorm.backends.numba.STREAM_MIN_BYTES` was chosen.

Run ``python bench/cpu.py`` (``--quick`` for a check in well under a
minute); wrap it in ``flock /tmp/polynorm-bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from polynorm.bench.common import (
    Record,
    format_table,
    gbps,
    median_time,
    paired_median,
    stderr_progress,
    write_json,
)
from polynorm.bench.roof import paired_roof
from polynorm.core.dtypes import numpy_dtype

SHAPES = ((1, 4096), (8, 4096), (512, 4096), (16384, 4096), (4096, 16384), (65536, 1024))
QUICK_SHAPES = ((1, 4096), (8, 4096), (512, 4096), (2048, 4096), (8192, 1024), (512, 16384))
DTYPES = ("float32", "bfloat16", "float16")
OPS = ("fwd", "fwd-out", "add", "bwd", "gated", "gated-nbg", "quant")
EPS = 1e-6

Progress = Callable[[int, int, str], None]


def available() -> tuple[bool, str]:
    import polynorm as pn

    return pn.backends()["numba"]


def op_bytes(op: str, n: int, d: int, itemsize: int) -> int:
    """Bytes the op must move, as the issue counts them (weight only for bwd).

    fwd: read x, write y; add: also read residual, write h; bwd: read x and
    dy, write dx, plus the weight; gated (``gated-nbg``: norm_before_gate=True):
    read x and z, write y; quant: read x, write the float8 q (one byte each)
    and the float32 per-token scales.

    >>> op_bytes("fwd", 2, 4, 4), op_bytes("add", 2, 4, 4), op_bytes("bwd", 2, 4, 4)
    (64, 128, 112)
    >>> op_bytes("quant", 2, 4, 2)
    32
    """
    t = n * d * itemsize
    if op == "quant":
        return t + n * d + 4 * n
    if op in ("fwd", "fwd-out"):
        return 2 * t
    if op in ("gated", "gated-nbg"):
        return 3 * t
    if op == "add":
        return 4 * t
    if op == "bwd":
        return 3 * t + d * itemsize
    raise ValueError(op)


# --------------------------------------------------------------------------- peers


def _numpy_fwd(x, w, r=None):
    xf = x.astype(np.float32)
    if r is not None:
        xf = xf + r.astype(np.float32)
    rstd = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(EPS))
    return (xf * rstd * w.astype(np.float32)).astype(x.dtype)


def _numpy_bwd(dy, x, w, rstd):
    xf = x.astype(np.float32)
    g = dy.astype(np.float32)
    rstd = rstd[:, None]
    xh = xf * rstd
    gw = g * w.astype(np.float32)
    c = np.sum(gw * xh, axis=-1, keepdims=True) / np.float32(x.shape[-1])
    dx = (rstd * (gw - xh * c)).astype(x.dtype)
    dw = np.sum(g * xh, axis=0).astype(w.dtype)
    return dx, dw


def _numpy_fn(op: str, x, w, r, dy) -> Callable[[], Any]:
    if op == "bwd":
        xf = x.astype(np.float32)
        rstd = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1) + np.float32(EPS))
        return lambda: _numpy_bwd(dy, x, w, rstd)
    if op == "gated":  # r stands in for the gate z
        def gated():
            zf = r.astype(np.float32)
            return _numpy_fwd((x.astype(np.float32) * (zf / (1 + np.exp(-zf)))).astype(x.dtype), w)
        return gated
    if op == "gated-nbg":
        def gated_nbg():
            zf = r.astype(np.float32)
            y = _numpy_fwd(x, w).astype(np.float32) * (zf / (1 + np.exp(-zf)))
            return y.astype(x.dtype)
        return gated_nbg
    if op == "quant":
        return lambda: _numpy_quant(x, w)
    return lambda: _numpy_fwd(x, w, r if op == "add" else None)


def _numpy_quant(x, w):
    import ml_dtypes

    y = _numpy_fwd(x, w).astype(np.float32)
    s = np.abs(y).max(axis=-1, keepdims=True) / np.float32(448.0)
    return np.clip(y / s, -448, 448).astype(ml_dtypes.float8_e4m3fn), s


def _torch_quant(a, g, d: int):
    import torch
    import torch.nn.functional as F

    y = F.rms_norm(a.float(), (d,), g.float(), EPS)
    s = y.abs().amax(dim=-1, keepdim=True) / 448.0
    return (y / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


def _torch_fn(op: str, x, w, r, dy) -> Callable[[], Any] | None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None

    t = _torch_tensor
    d = x.shape[-1]
    tx, tw = t(x), t(w)
    if op in ("fwd", "fwd-out"):
        return lambda: F.rms_norm(tx, (d,), tw, EPS)
    if op == "add":
        tr = t(r)
        return lambda: F.rms_norm(tx + tr, (d,), tw, EPS)
    if op == "gated":
        tz = t(r)
        return lambda: F.rms_norm(tx * F.silu(tz), (d,), tw, EPS)
    if op == "gated-nbg":
        tz = t(r)
        return lambda: F.rms_norm(tx, (d,), tw, EPS) * F.silu(tz)
    if op == "quant":
        return lambda: _torch_quant(tx, tw, d)
    txg = tx.clone().requires_grad_(True)
    twg = tw.clone().requires_grad_(True)
    y = F.rms_norm(txg, (d,), twg, EPS)
    tdy = t(dy)
    return lambda: torch.autograd.grad(y, (txg, twg), tdy, retain_graph=True)


def _torch_tensor(a):
    import torch

    if a.dtype.kind == "V":  # bfloat16 via ml_dtypes: through float32
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(a)


def _compiled_fn(op: str, x, w, r) -> Callable[[], Any] | None:
    """``torch.compile`` of the forward peers, or None where it cannot compile."""
    if op == "bwd":
        return None
    try:
        import torch
        import torch.nn.functional as F

        d = x.shape[-1]
        tx, tw = _torch_tensor(x), _torch_tensor(w)
        if op == "add":
            tr = _torch_tensor(r)
            f = torch.compile(lambda a, b, g: F.rms_norm(a + b, (d,), g, EPS))
            fn = lambda: f(tx, tr, tw)  # noqa: E731
        elif op == "quant":
            f = torch.compile(lambda a, g: _torch_quant(a, g, d))
            fn = lambda: f(tx, tw)  # noqa: E731
        else:
            f = torch.compile(lambda a, g: F.rms_norm(a, (d,), g, EPS))
            fn = lambda: f(tx, tw)  # noqa: E731
        fn()
        return fn
    except Exception:  # no C++ compiler, unsupported dtype, ...
        return None


# ONNX Runtime's element types by numpy dtype name (its CPU provider runs no bfloat16)
_ORT_TYPES = {"float32": 1, "float16": 10}
_ort_sessions: dict[tuple, Any] = {}


def _ort_missing(dt: str) -> str:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return "not installed (pip install 'polynorm[ort]')"
    return "" if dt in _ORT_TYPES else f"{dt} not run by the CPU provider"


def _ort_session(kind: str, dt: str, d: int):
    """An ONNX Runtime CPU session of one normalization node, built in memory."""
    key = (kind, dt, d)
    if key in _ort_sessions:
        return _ort_sessions[key]
    import onnxruntime as ort
    from onnx import helper

    et = _ORT_TYPES[dt]

    def vi(name, shape):
        return helper.make_tensor_value_info(name, et, shape)

    x, w = vi("X", ["N", d]), vi("W", [d])
    if kind == "skip":  # com.microsoft fused add: y, and h = x + r (output 3)
        node = helper.make_node("SkipSimplifiedLayerNormalization", ["X", "R", "W"],
                                ["Y", "", "", "H"], domain="com.microsoft", epsilon=EPS)
        ins, outs = [x, vi("R", ["N", d]), w], [vi("Y", ["N", d]), vi("H", ["N", d])]
        opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
    else:
        op = "RMSNormalization" if kind == "rms" else "SimplifiedLayerNormalization"
        node = helper.make_node(op, ["X", "W"], ["Y"], axis=-1, epsilon=EPS, stash_type=1)
        ins, outs = [x, w], [vi("Y", ["N", d])]
        opsets = [helper.make_opsetid("", 23 if kind == "rms" else 17)]
    model = helper.make_model(helper.make_graph([node], kind, ins, outs), opset_imports=opsets)
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = _nb_threads()  # the cores polynorm uses
    # no busy-waiting after a run: ORT's spinning threads would take the cores
    # from the call timed next in the round
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        sess = ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
    except Exception:  # an op this onnxruntime does not have
        sess = None
    _ort_sessions[key] = sess
    return sess


def _ort_fns(op: str, x, w, r, out) -> dict[str, Callable[[], Any]]:
    """ONNX Runtime peers of one case by node name (empty when none runs)."""
    dt = x.dtype.name
    if op in ("bwd", "gated", "gated-nbg", "quant") or dt not in _ORT_TYPES or _ort_missing(dt):
        return {}
    d = x.shape[-1]
    fns: dict[str, Callable[[], Any]] = {}
    kinds = ("skip",) if op == "add" else ("rms", "sln")
    for kind in kinds:
        sess = _ort_session(kind, dt, d)
        if sess is None:
            continue
        feeds = {"X": x, "W": w, **({"R": r} if kind == "skip" else {})}
        if op == "fwd-out":
            io = sess.io_binding()
            for k, v in feeds.items():
                io.bind_cpu_input(k, v)
            io.bind_output("Y", "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)
            # the binding holds raw pointers: the closure keeps the arrays alive
            fns[kind] = lambda s=sess, io=io, keep=(feeds, out): s.run_with_iobinding(io)
        else:
            fns[kind] = lambda s=sess, f=feeds: s.run(None, f)
    return fns


# --------------------------------------------------------------------------- the matrix


def cases(quick: bool = False, dtypes: list[str] | None = None,
          shapes: list[tuple[int, int]] | None = None) -> list[tuple[str, str, int, int]]:
    """``(op, dtype, tokens, d)`` in measurement order.

    >>> len(cases()), cases(quick=True)[0]
    (126, ('fwd', 'float32', 1, 4096))
    """
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES)
    dts = [d for d in DTYPES if dtypes is None or d in dtypes]
    return [(op, dt, n, d) for (n, d) in shapes for dt in dts for op in OPS]


def _polynorm_fn(op: str, x, w, r, dy, out) -> Callable[[], Any]:
    import polynorm as pn

    if op == "fwd":
        return lambda: pn.rms_norm(x, w, eps=EPS)
    if op == "fwd-out":
        return lambda: pn.rms_norm(x, w, eps=EPS, out=out)
    if op == "add":
        return lambda: pn.add_rms_norm(x, r, w, eps=EPS)
    if op == "gated":  # r as the gate z; Mamba-2's order (gate, then norm)
        return lambda: pn.rms_norm_gated(x, r, w, eps=EPS)
    if op == "gated-nbg":  # Qwen3-Next's order (norm, then gate)
        return lambda: pn.rms_norm_gated(x, r, w, eps=EPS, norm_before_gate=True)
    if op == "quant":  # float8 e4m3fn with a dynamic per-token scale (vLLM's serving default)
        return lambda: pn.rms_norm_quant(x, w, eps=EPS)
    # the forward's rstd, as a training step has it (torch's autograd saves it too)
    rstd = pn.rms_norm(x, w, eps=EPS, return_rstd=True)[1]
    return lambda: pn.rms_norm_backward(dy, x, w, eps=EPS, rstd=rstd)


#: Inputs of at least this many bytes are timed three times as long.
BIG_BYTES = 64 << 20


def run(
    *, quick: bool = False, dtypes: list[str] | None = None, progress: Progress | None = None,
    shapes: list[tuple[int, int]] | None = None, ops: list[str] | None = None,
    compiled: bool = False,
) -> list[Record]:
    """Time the whole matrix; one :class:`~polynorm.bench.common.Record` per case.

    ``quick=True`` takes smaller shapes and shorter timings (well under a
    minute); peers are timed with fewer repeats than polynorm itself.
    ``shapes``/``ops`` restrict the matrix; ``compiled`` adds ``torch.compile``.
    """
    todo = [c for c in cases(quick, dtypes, shapes) if ops is None or c[0] in ops]
    min_time = 0.03 if quick else 0.3
    peer_time = 0.02 if quick else 0.1
    records: list[Record] = []
    rng = np.random.default_rng(0)
    arrays: dict[tuple[str, int, int], dict[str, Any]] = {}
    for i, (op, dt, n, d) in enumerate(todo):
        if progress:
            progress(i, len(todo), f"{op} {dt} {n}x{d}")
        key = (dt, n, d)
        if key not in arrays:
            arrays.clear()  # one shape at a time in memory
            npd = numpy_dtype(dt)
            x = rng.standard_normal((n, d), dtype=np.float32).astype(npd)
            a = {
                "x": x,
                "w": (1 + 0.1 * rng.standard_normal(d, dtype=np.float32)).astype(npd),
                "r": rng.standard_normal((n, d), dtype=np.float32).astype(npd),
                "dy": rng.standard_normal((n, d), dtype=np.float32).astype(npd),
                "out": np.empty_like(x),
            }
            arrays[key] = a
        a = arrays[key]
        x, w, r, dy = a["x"], a["w"], a["r"], a["dy"]
        kind = "plain" if op == "fwd-out" else "alloc"
        # DRAM-sized cases: a longer window, over more of the machine's
        # bandwidth swings (see paired_roof)
        case_time = min_time if x.nbytes < BIG_BYTES else 3 * min_time
        ort = _ort_fns(op, x, w, r, a["out"])
        p = paired_roof(_polynorm_fn(op, x, w, r, dy, a["out"]), x, kind=kind, out=a["out"],
                        min_time=case_time, peers=ort)
        t = p.op_s
        moved = op_bytes(op, n, d, x.dtype.itemsize)
        rate = gbps(moved, t)
        # the median of the rounds' ratios (see paired_roof), in bytes per second
        ratios = {"copy": p.speed * moved / (2 * x.nbytes)}
        extra: dict[str, Any] = {
            "copy_gbps": gbps(2 * x.nbytes, p.roof_s), "roof": kind, "roof_copy": p.fastest,
            "rounds": p.rounds, "device": "cpu",
        }
        if p.peers:
            ratios["ort"] = min(p.peers.values()) / t
            extra.update({f"ort_{k}_s": v for k, v in p.peers.items()})
        elif op not in ("bwd", "gated", "gated-nbg", "quant"):
            extra["ort"] = _ort_missing(dt)
        tf = _torch_fn(op, x, w, r, dy)
        if tf is not None:
            ts = median_time(tf, min_time=peer_time, min_repeat=3)
            ratios["torch"] = ts / t
            extra["torch_s"] = ts
        tc = _compiled_fn(op, x, w, r) if compiled else None
        if tc is not None:
            ts = median_time(tc, min_time=peer_time, min_repeat=3)
            ratios["compile"] = ts / t
            extra["compile_s"] = ts
        ns = median_time(_numpy_fn(op, x, w, r, dy), min_time=peer_time, min_repeat=3)
        ratios["numpy"] = ns / t
        extra["numpy_s"] = ns
        records.append(Record("cpu", op, "numba", dt, n, d, t, moved, rate, ratios, extra))
    if progress:
        progress(len(todo), len(todo), "done")
    return records


# --------------------------------------------------------------------------- per-call overhead


def call_overhead(min_time: float = 0.2) -> dict[str, float]:
    """Microseconds per (1, 4096) float32 call, end to end and its parts.

    ``fast``: ``pn.rms_norm(x, w)`` (the front end's numpy fast path);
    ``generic``: the same through the generic front end (``axis=(1,)``);
    ``kernel``: the serial Numba kernel called directly; ``njit``: an empty
    ``njit`` function taking one array; ``torch``: ``F.rms_norm``.
    """
    from numba import njit

    import polynorm as pn
    from polynorm.backends.numba import kernels as K

    x = np.random.default_rng(0).standard_normal((1, 4096), dtype=np.float32)
    w = np.ones(4096, np.float32)
    y = np.empty_like(x)
    r = np.empty(1, np.float32)
    out = {
        "fast": median_time(lambda: pn.rms_norm(x, w), min_time=min_time),
        "generic": median_time(lambda: pn.rms_norm(x, w, axis=(1,)), min_time=min_time),
        "kernel": median_time(
            lambda: K.forward_rows(0, 1, x, None, w, None, y, None, r, K.EPS_INSIDE, 4096, EPS,
                                   0.0, None),
            min_time=min_time),
    }
    empty = njit(lambda a: 0)
    out["njit"] = median_time(lambda: empty(x), min_time=min_time)
    tf = _torch_fn("fwd", x, w, None, None)
    if tf is not None:
        out["torch"] = median_time(tf, min_time=min_time)
    return {k: v * 1e6 for k, v in out.items()}


# --------------------------------------------------------------------------- serial threshold


def threshold(ds=(512, 1024, 4096), ns=(1, 2, 4, 8, 16, 32, 64, 128), min_time=0.1):
    """Serial vs parallel forward kernel time (us) for small ``(n, d)`` float32.

    Returns ``[(n, d, serial_us, parallel_us)]``; the parallel kernel pays a
    thread-pool launch, so it wins only above some ``n * d``.
    """
    from polynorm.backends.numba import kernels as K

    _nb_threads()  # the parallel kernel runs on the layer polynorm starts (TBB first)
    rows = []
    for d in ds:
        for n in ns:
            x = np.random.default_rng(0).standard_normal((n, d), dtype=np.float32)
            w = np.ones(d, np.float32)
            y = np.empty_like(x)
            r = np.empty(n, np.float32)
            args = (x, None, w, None, y, None, r, K.EPS_INSIDE, d, EPS, 0.0, None)
            ts = median_time(lambda a=args, n=n: K.forward_rows(0, n, *a), min_time=min_time)
            tp = median_time(lambda a=args: K.forward_parallel(*a), min_time=min_time)
            rows.append((n, d, ts * 1e6, tp * 1e6))
    return rows


# --------------------------------------------------------------------------- streaming threshold


def stream_threshold(ns=(64, 256, 512, 1024, 2048, 4096, 16384), d=4096, min_time=0.2,
                     dtype="float32"):
    """``out=`` forward with streaming stores / with ordinary ones, paired.

    Returns ``[(n, d, MiB of y, time ratio)]`` (below 1: streaming is faster).
    16-bit rows stream here whatever the CPU (``STREAM_16``).  Each call writes
    the same ``out=`` array again, so a small ``y`` is still in cache for the
    next call, as it would be for a consumer reading it.
    """
    import polynorm as pn
    from polynorm.backends import numba as nb

    rows = []
    keep = nb.STREAM_MIN_BYTES, nb.STREAM_16
    try:
        for n in ns:
            x = np.random.default_rng(0).standard_normal((n, d), dtype=np.float32)
            x = x.astype(numpy_dtype(dtype))
            w = np.ones(d, x.dtype)
            y = np.empty_like(x)

            def streamed(x=x, w=w, y=y):
                nb.STREAM_MIN_BYTES, nb.STREAM_16 = 0, True  # 16-bit too, whatever the CPU
                pn.rms_norm(x, w, out=y)

            def ordinary(x=x, w=w, y=y):
                nb.STREAM_MIN_BYTES = 1 << 62
                pn.rms_norm(x, w, out=y)

            ts, to = paired_median(streamed, ordinary, min_time=min_time)
            rows.append((n, d, y.nbytes / 2**20, ts / to))
    finally:
        nb.STREAM_MIN_BYTES, nb.STREAM_16 = keep
    return rows


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m polynorm.bench.cpu [--quick] [--dtypes ...] [--json PATH] [--threshold | --stream]``."""
    p = argparse.ArgumentParser(prog="polynorm.bench.cpu", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, short timings (< 60 s)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None)
    p.add_argument("--json", help="where to write the records (default: only the table is printed)")
    p.add_argument("--note", default="", help="a note stored in the JSON (e.g. 'shared machine')")
    p.add_argument("--shapes", nargs="+", default=None, metavar="NxD",
                   help="only these shapes (tokens x d), e.g. 16384x4096 4096x16384")
    p.add_argument("--ops", nargs="+", choices=OPS, default=None, help="only these ops")
    p.add_argument("--compile", action="store_true", help="add torch.compile as a peer")
    p.add_argument("--threshold", action="store_true",
                   help="only time serial vs parallel kernels on small inputs")
    p.add_argument("--stream", action="store_true",
                   help="only time out= calls with streaming vs ordinary stores, by size")
    args = p.parse_args(argv)
    ok, why = available()
    if not ok:
        print(f"numba backend unusable: {why}", file=sys.stderr)
        return 1
    if args.threshold:
        print(f"{'n':>5} {'d':>6} {'n*d':>8} {'serial us':>10} {'parallel us':>12}")
        for n, d, ts, tp in threshold():
            print(f"{n:>5} {d:>6} {n * d:>8} {ts:>10.2f} {tp:>12.2f}" + ("  <- parallel wins"
                                                                          if tp < ts else ""))
        return 0
    if args.stream:
        print(f"{'dtype':>9} {'n':>6} {'d':>6} {'y MiB':>7} {'streamed / ordinary':>20}")
        for dt in args.dtypes or ["float32"]:
            for n, d, mib, ratio in stream_threshold(dtype=dt):
                print(f"{dt:>9} {n:>6} {d:>6} {mib:>7.0f} {ratio:>20.3f}")
        return 0
    import numba

    t0 = time.perf_counter()

    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes] if args.shapes else None
    records = run(quick=args.quick, dtypes=args.dtypes, progress=stderr_progress, shapes=shapes,
                  ops=args.ops, compiled=args.compile)
    print(file=sys.stderr)
    over = call_overhead(0.05 if args.quick else 0.3)
    print(format_table(records, ["copy", "ort", "torch", "compile", "numpy"]))
    print()
    print("(1, 4096) float32 per call, us: " + ", ".join(f"{k} {v:.2f}" for k, v in over.items()))
    if "torch" in over:
        print(f"  end to end / torch F.rms_norm = {over['fast'] / over['torch']:.2f} (target <= 0.5)")
    meta = {
        "suite": "cpu", "quick": args.quick, "note": args.note,
        "numba": numba.__version__, "numpy": np.__version__,
        "threads": _nb_threads(), "threading_layer": _threading_layer(),
        "call_overhead_us": over, "seconds": time.perf_counter() - t0,
    }
    try:
        import onnxruntime

        meta["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    if args.json:
        write_json(args.json, records, meta)
        print(f"wrote {args.json}")
    return 0


def _nb_threads() -> int:
    """Numba's thread count, its threading layer started as polynorm starts it (TBB first)."""
    from polynorm.backends import numba as nb

    return nb._threads()


def _threading_layer() -> str:
    import numba

    try:
        return numba.threading_layer()
    except ValueError:
        return "not started"


if __name__ == "__main__":
    sys.exit(main())
