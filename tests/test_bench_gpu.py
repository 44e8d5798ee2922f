"""The GPU benchmark's bookkeeping, run on the CPU with numpy standing in for the device.

The real suite needs a GPU (bench/gpu_check.sh); here the case loop, byte
counts, roofs, records and JSON output are exercised with a CPU "library".
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

import polynorm as pn
from polynorm.bench import gpu, gpu_cases
from polynorm.bench.common import median_time


class _CpuLib(gpu._Lib):
    def __init__(self) -> None:
        self.torch = None
        self.cupy = None

    @property
    def name(self) -> str:
        return "numpy"

    def dtypes(self):
        return ("float16", "float32")

    def randn(self, shape, dtype):
        return np.random.default_rng(0).standard_normal(shape).astype(dtype)

    def empty_bytes(self, nbytes):
        return np.empty(nbytes, np.uint8)

    def copy_fn(self, nbytes):
        src, dst = self.empty_bytes(max(1, nbytes // 2)), self.empty_bytes(max(1, nbytes // 2))
        return lambda: np.copyto(dst, src)

    def free_bytes(self):
        return 1 << 30

    def release(self):
        pass

    def time(self, fn, target=0.0):
        return median_time(fn, min_time=0.0, min_repeat=2)


@pytest.fixture
def cpu_suite(monkeypatch):
    monkeypatch.setattr(gpu, "_Lib", _CpuLib)
    # the ops on the reference backend: the bookkeeping under test needs no Numba kernel
    # (compiling the suite's variants was most of these tests' CPU)
    for name in ("rms_norm", "add_rms_norm", "rms_norm_gated", "rms_norm_quant", "rms_norm_backward"):
        monkeypatch.setattr(pn, name, functools.partial(getattr(pn, name), backend="array_api"))
    small = [(op, dt, 16, 96) for dt in ("float16", "float32") for op in gpu_cases.OPS] + [("fwd", "float32", 1 << 20, 1 << 20)]
    monkeypatch.setattr(gpu, "cases", lambda quick=False, dtypes=None: [c for c in small if dtypes is None or c[1] in dtypes])


def test_bench_gpu_records(cpu_suite):
    skipped: list[str] = []
    seen = []
    recs = gpu.run(progress=lambda i, n, label: seen.append((i, n)), skipped=skipped)
    assert [(r.op, r.dtype) for r in recs] == [(op, dt) for dt in ("float16", "float32") for op in gpu_cases.OPS]
    for r in recs:
        assert r.suite == "gpu" and r.bytes == gpu_cases.op_bytes(r.op, r.dtype, r.tokens, r.d)
        assert r.seconds > 0 and r.gbps > 0 and r.ratios["copy"] > 0
        # numpy arrays: no cupy launch to replay, no kernel-only time
        assert r.extra["launches"] == [] and "copy_kernel" not in r.ratios
    assert len(skipped) == 1 and "needs" in skipped[0]  # the case that does not fit
    assert seen[-1][0] == seen[-1][1]  # progress ends at n/n


def test_bench_gpu_main_writes_json(cpu_suite, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu, "available", lambda: (True, "ok"))
    out = tmp_path / "gpu.json"
    assert gpu.main(["--quick", "--no-peers", "--dtypes", "float32", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {r["dtype"] for r in doc["records"]} == {"float32"}
    assert doc["meta"]["targets"]["bwd"] == 0.75 and "device" in doc["meta"]


def test_bench_gpu_dry_run(capsys):
    assert gpu.main(["--dry-run"]) == 0
    assert f"{len(gpu_cases.cases())} cases" in capsys.readouterr().out
    # the per-head QK-norm shape and few rows of a huge d are measured too
    assert {(n, d) for _, _, n, d in gpu_cases.cases()} >= {(1 << 21, 128), (8, 262144)}
