"""The ``polynorm`` command line: info, check, bench, and their exit codes."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import types

import numpy as np
import pytest

import polynorm as pn
from polynorm.backends import reference
from polynorm.bench import report
from polynorm.bench.common import Record
from polynorm.cli import check as _check
from polynorm.cli import main
from polynorm.core import dtypes as _dtypes

registry = importlib.import_module("polynorm.backends")  # pn.backends is the function


# ------------------------------------------------------------------ usage and exit codes


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["bench", "--dtype", "int8"],
        ["bench", "--backend", "nosuch"],
        ["bench", "--quick", "extra-positional"],
        ["check", "--backend", "nosuch"],
        ["check", "--dtype", "complex64"],
        ["info", "--verbose"],
    ],
)
def test_bad_arguments_give_usage_and_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: polynorm" in err
    assert "error:" in err
    assert "Traceback" not in err


def test_help_and_version_exit_0(capsys):
    assert main(["--version"]) == 0
    assert pn.__version__ in capsys.readouterr().out
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "--plot" in out and "--json" in out


def test_real_process_exit_codes():
    """The installed entry point behaves like main(): exit code 2, no traceback."""
    bad = subprocess.run([sys.executable, "-m", "polynorm", "bench", "--dtype", "int8"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "usage:" in bad.stderr and "Traceback" not in bad.stderr
    ok = subprocess.run([sys.executable, "-m", "polynorm", "--version"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and pn.__version__ in ok.stdout


def test_polynorm_errors_become_exit_2(monkeypatch, capsys):
    def boom(args):
        raise ValueError("--dtype: float8 is not a float dtype polynorm knows")

    monkeypatch.setattr("polynorm.cli.cmd_info", boom)
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert "float8" in err and "Traceback" not in err


# ------------------------------------------------------------------ info


def test_info_lists_every_backend_with_a_reason(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"polynorm {pn.__version__}" in out
    for name, (usable, why) in pn.backends().items():
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name))
        assert ("not usable" not in line) == usable
        if not usable:
            assert why.split(";")[0] in line
    assert "numba:" in out and "GPU:" in out and "versions:" in out


# ------------------------------------------------------------------ check


def test_check_passes_on_the_reference(capsys):
    assert main(["check", "--backend", "array_api", "--dtype", "float32", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    assert f"{2 * len(_check.TESTS)} checks passed, 0 failed" in out


def _wrong_forward(real):
    def forward(x, residual, weight, bias, plan, out=None):
        y, h, rstd = real(x, residual, weight, bias, plan, out)
        return y + 1, h, rstd  # off by one everywhere

    return forward


def _wrong_eager(real):
    def eager(x, weight, bias, plan, want_rstd=True):
        y, rstd = real(x, weight, bias, plan, want_rstd)
        return y + 1, rstd  # off by one everywhere

    return eager


def test_check_fails_when_the_forward_is_broken(monkeypatch, capsys):
    monkeypatch.setattr(reference, "forward", _wrong_forward(reference.forward))
    # the plain call's fast path (ops/fast_ref.py) runs the reference's eager twin
    monkeypatch.setattr(reference, "eager_numpy", _wrong_eager(reference.eager_numpy))
    assert main(["check", "--backend", "array_api", "--dtype", "float64"]) == 1
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("array_api"))
    cells = dict(zip(("backend", "dtype", *_check.TESTS), row.split(), strict=False))
    for t in ("fwd", "pRMS", "llama", "add"):
        assert cells[t] == "FAIL", t
    assert cells["bwd"] == "ok"  # the backward does not use the forward
    assert "y vs float64 formula" in out


def test_check_fails_when_the_backward_is_broken(monkeypatch, capsys):
    real = reference.backward

    def backward(dy, x, weight, bias, rstd, grad_residual, plan, out=None):
        dx, dw, db = real(dy, x, weight, bias, rstd, grad_residual, plan, out)
        return dx * 1.5, dw, db

    monkeypatch.setattr(reference, "backward", backward)
    assert main(["check", "--backend", "array_api", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert "dx vs finite differences" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("array_api"))
    assert row.split()[2:6] == ["ok", "ok", "ok", "ok"]  # forward checks unaffected


def test_check_reports_a_crash_without_traceback(monkeypatch, capsys):
    def forward(*args, **kw):
        raise RuntimeError("kernel launch failed")

    monkeypatch.setattr(reference, "forward", forward)
    assert main(["check", "--backend", "array_api", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert "raised RuntimeError: kernel launch failed" in out
    assert "Traceback" not in out


@pytest.fixture
def fake_backend(monkeypatch):
    """A backend 'fake' in the registry: the reference, wrong at float16 only."""
    mod = types.ModuleType("polynorm_fake_backend")
    mod.available = lambda: (True, "ok")
    mod.accepts = lambda x: isinstance(x, np.ndarray)
    mod.backward = reference.backward
    mod.DTYPES = ("float16", "float32")

    def forward(x, residual, weight, bias, plan, out=None):
        y, h, rstd = reference.forward(x, residual, weight, bias, plan, out)
        if plan.out_dtype == "float16":
            y = y * np.float16(1.25)
        return y, h, rstd

    mod.forward = forward
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(registry.MODULES, "fake", mod.__name__)
    monkeypatch.setitem(registry.INSTALL_HINT, "fake", "-")
    yield mod
    registry._loaded.pop("fake", None)
    registry._status.pop("fake", None)


def test_check_finds_the_broken_dtype_of_a_backend(fake_backend, capsys):
    rows = _check.run(["fake"], ["float16", "float32", "float64"])
    by = {(r.dtype, r.test): r for r in rows}
    assert by["float16", "fwd"].ok is False
    assert by["float16", "bwd"].ok is True
    assert all(by["float32", t].ok for t in _check.TESTS)
    assert all(by["float64", t].ok is None for t in _check.TESTS)  # not in DTYPES: skipped
    assert _check.failed(rows)
    text = _check.format_rows(rows)
    assert "fake float16 fwd" in text and "fake has no float64" in text


def test_unusable_backend_is_skipped_with_its_reason(monkeypatch):
    monkeypatch.setattr(pn, "backends", lambda: {"array_api": (False, "switched off for the test")})
    rows = _check.run()
    assert [(r.ok, r.detail) for r in rows] == [(None, "switched off for the test")]
    assert not _check.failed(rows)
    assert "switched off for the test" in _check.format_rows(rows)


def test_check_of_a_named_unusable_backend_fails_and_says_how_to_install(monkeypatch, capsys):
    """`check --backend B` for a B that cannot run is not "0 checks passed": exit 2, why, how."""
    report_ = dict(pn.backends())
    report_["dask"] = (False, "dask is not installed (switched off for the test)")
    monkeypatch.setattr(pn, "backends", lambda: report_)
    assert main(["check", "--backend", "dask", "--dtype", "float32"]) == 2
    captured = capsys.readouterr()
    assert "checks passed" not in captured.out
    assert "'dask' is not available" in captured.err and "pip install 'polynorm[dask]'" in captured.err
    # the same with a usable backend named alongside: nothing runs
    assert main(["check", "--backend", "array_api", "--backend", "dask"]) == 2
    assert "checks passed" not in capsys.readouterr().out


def test_check_of_cupy_without_cupy_exits_nonzero(capsys):
    if pn.backends()["cupy"][0]:
        pytest.skip("cupy is usable here")
    assert main(["check", "--backend", "cupy"]) == 2
    err = capsys.readouterr().err
    assert "cupy" in err and "pip install" in err and "Traceback" not in err


# ------------------------------------------------------------------ bench


def _fake_run(suite: str, device: str, scale: float):
    def run(*, quick=False, dtypes=None, progress=None):
        recs = []
        cases = [(dt, d) for dt in (dtypes or ["float32"]) for d in (256, 1024, 4096)]
        for i, (dt, d) in enumerate(cases):
            if progress:
                progress(i, len(cases), f"{dt} d={d}")
            g = scale * d / (d + 512)
            recs.append(Record(suite, "fwd", suite, dt, 1024, d, 1e-3, int(g * 1e6), g,
                               {"copy": g / scale, "torch": 2.0}, {"device": device}))
        if progress:
            progress(len(cases), len(cases), "done")
        return recs

    return run


@pytest.fixture
def fake_suites(monkeypatch):
    fast = types.ModuleType("polynorm_fake_suite_fast")
    fast.run = _fake_run("fast", "cpu", 20.0)
    broken = types.ModuleType("polynorm_fake_suite_broken")

    def explode(**kw):
        raise RuntimeError("out of device memory")

    broken.run = explode
    for m in (fast, broken):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(report, "SUITES", (
        report.Suite("fast", fast.__name__, ("numba",)),
        report.Suite("broken", broken.__name__, ("cupy",)),
        report.Suite("absent", "polynorm_no_such_suite_module", ("torch",)),
        report.Suite("reference", None, ("array_api",)),
    ))
    monkeypatch.setattr(report, "_reference_cases", lambda quick: ((64, 256), 2**12, ("fwd",)))


def test_bench_runs_what_it_can_and_writes_everything(fake_suites, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # --plot (the bench extra)
    files = {k: tmp_path / f"out.{k}" for k in ("json", "png", "md")}
    code = main(["bench", "--quick", "--no-progress", "--dtype", "float32", "--dtype", "float16",
                 "--json", str(files["json"]), "--plot", str(files["png"]),
                 "--markdown", str(files["md"])])
    assert code == 1  # one suite crashed
    out = capsys.readouterr().out
    assert "== fast (6 cases)" in out and "== reference (4 cases)" in out
    assert "broken: RuntimeError: out of device memory" in out
    assert "absent: suite module not importable" in out
    doc = json.loads(files["json"].read_text())
    assert {r["suite"] for r in doc["records"]} == {"fast", "reference"}
    assert doc["meta"]["failed"].keys() == {"broken"}
    assert "cpu_count" in doc["machine"]
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = files["md"].read_text().splitlines()
    assert md[0].startswith("| suite | op | backend") and len(md) == 2 + 6 + 4
    ref = [r for r in doc["records"] if r["suite"] == "reference"]
    assert {r["dtype"] for r in ref} == {"float32", "float16"}
    assert all(r["gbps"] > 0 and r["ratios"]["copy"] > 0 for r in ref)


@pytest.mark.parametrize("flag", ["--json", "--plot", "--markdown"])
def test_bench_unwritable_output_is_exit_2_before_running(flag, tmp_path, fake_suites, capsys,
                                                          monkeypatch):
    ran = []
    monkeypatch.setattr(report, "run_suites", lambda **kw: ran.append(kw))
    assert main(["bench", "--quick", flag, str(tmp_path)]) == 2  # a folder, not a file
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "--quick", flag, str(blocker / "sub" / "out")]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
    assert ran == []


def test_bench_output_in_an_unwritable_place_is_exit_2_before_running(tmp_path, fake_suites,
                                                                     capsys, monkeypatch):
    """/proc passes os.access for root but takes no new file: refused before the run."""
    ran = []
    monkeypatch.setattr(report, "run_suites", lambda **kw: ran.append(kw))
    if not __import__("os").path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    assert main(["bench", "--quick", "--json", "/proc/polynorm-bench.json"]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and "Traceback" not in err
    assert ran == []


def test_a_refused_bench_creates_no_folders(tmp_path, fake_suites, capsys, monkeypatch):
    ran = []
    run_suites = report.run_suites
    monkeypatch.setattr(report, "run_suites", lambda **kw: ran.append(kw))
    new = tmp_path / "new" / "deeper"
    # refused up front: another output is a folder
    assert main(["bench", "--quick", "--json", str(new / "x.json"), "--markdown",
                 str(tmp_path)]) == 2
    assert ran == [] and not (tmp_path / "new").exists()
    # refused after the run: nothing of the named backend can run here
    monkeypatch.setattr(report, "run_suites", run_suites)
    assert main(["bench", "--quick", "--no-progress", "--backend", "torch", "--json",
                 str(new / "x.json")]) == 2
    assert not (tmp_path / "new").exists()


def test_bench_backend_selects_suites(fake_suites, capsys):
    assert main(["bench", "--quick", "--no-progress", "--backend", "numba"]) == 0
    out = capsys.readouterr().out
    assert "== fast" in out and "reference" not in out and "broken" not in out


def test_bench_progress_is_reported(fake_suites, capsys):
    seen = []

    def factory(suite):
        return lambda done, total, label: seen.append((suite, done, total))

    outcome = report.run_suites(quick=True, backends=["numba"], progress=factory)
    assert outcome.ran == ["fast"]
    assert seen[0] == ("fast", 0, 3) and seen[-1] == ("fast", 3, 3)
    with report.make_progress(True) as prog:  # the real bar (rich/tqdm) accepts the callbacks
        report.run_suites(quick=True, backends=["numba"], progress=prog)


def test_bench_explicit_backend_that_cannot_run_is_exit_2(fake_suites, capsys):
    assert main(["bench", "--quick", "--no-progress", "--backend", "torch"]) == 2
    assert "nothing can run here" in capsys.readouterr().err


def test_plot_draws_the_main_suites_roofs(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = _fake_run("cpu", "cpu", 20.0)(dtypes=["float32", "bfloat16"])
    recs += _fake_run("gpu", "gpu", 3000.0)(dtypes=["float16"])
    ref = _fake_run("reference", "cpu", 5.0)(dtypes=["float32"])
    fig, ax = plt.subplots()
    report._panel(ax, recs + ref, "d", {}, ["bfloat16", "float16", "float32"])
    labels = ax.get_legend_handles_labels()[1]
    assert [lb for lb in labels if "roof" in lb] == ["copy roof (cpu)", "copy roof (gpu)"]
    roof = next(ln for ln in ax.get_lines() if ln.get_label() == "copy roof (gpu)")
    np.testing.assert_allclose(roof.get_ydata(), 3000.0)  # gbps / ratios["copy"]
    ax.clear()
    report._panel(ax, ref, "d", {}, ["float32"])  # no main suite: the reference's own roof
    assert "copy roof (reference)" in ax.get_legend_handles_labels()[1]
    plt.close(fig)
    assert report.plot(recs + ref, tmp_path / "p.png").stat().st_size > 10_000


@pytest.mark.parametrize("inside", [True, False])
def test_check_closed_form_gradient_agrees_with_finite_differences(inside, rng):
    """The big-shape truth of `check` is itself checked against central differences."""
    x, g = rng.standard_normal((3, 11)), rng.standard_normal((3, 11))
    w, b = rng.standard_normal(11), rng.standard_normal(11)
    opts = dict(k=5, eps=1e-3, inside=inside, offset=0.5)
    for got, want in zip(_check._exact_grads(x, w, b, g, **opts),
                         _check._fd_grads(x, w, b, g, **opts), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    # an all-zero row: sqrt(ms) has a kink there (no finite differences); the spec's
    # backward takes the term with 1/s as zero, leaving dx = rstd * g * (w + offset)
    x[2] = 0.0
    dx = _check._exact_grads(x, w, b, g, **opts)[0]
    rstd0 = 1 / np.sqrt(1e-3) if inside else 1 / 1e-3
    np.testing.assert_allclose(dx[2], rstd0 * g[2] * (w + 0.5), rtol=1e-12)


def test_check_hands_dask_arrays_of_every_rank():
    pytest.importorskip("dask.array")
    arr = _check._arrays("dask")
    for a in (np.arange(6.0), np.arange(12.0).reshape(4, 3)):
        d = arr.make(a)
        assert type(d).__module__.startswith("dask")
        np.testing.assert_array_equal(arr.read(d), a)
    assert arr.make(np.zeros((4, 3))).chunks == ((2, 2), (3,))  # normalized axis whole


def test_plot_leaves_out_ops_measured_at_one_size(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    recs = _fake_run("fast", "cpu", 20.0)(dtypes=["float32"])
    recs.append(Record("interop", "dispatch", "torch-cpu", "float32", 1, 4096, 1e-6, 1, 7.0))
    assert report._swept_ops(recs) == ["fwd"]
    assert report._swept_ops(recs[-1:]) == ["dispatch"]  # nothing swept: keep everything
    report.plot(recs, tmp_path / "p.png")


def test_check_runs_on_torch_tensors_under_its_own_label():
    torch = pytest.importorskip("torch")
    arr = _check._torch_cpu_arrays()
    a = np.arange(6.0, dtype=np.float32).reshape(2, 3).astype(_dtypes.numpy_dtype("bfloat16"))
    t = arr.make(a)
    assert t.dtype == torch.bfloat16 and t.shape == (2, 3)
    np.testing.assert_array_equal(arr.read(t), a)
    rows = _check._backend_rows("array_api", ["bfloat16"], "array_api+torch", arr)
    assert {r.backend for r in rows} == {"array_api+torch"}
    assert all(r.ok for r in rows), [r.detail for r in rows if not r.ok]
