"""The README is a manual: its performance tables are generated, its examples and the docs' run.

``polynorm bench --readme`` writes the README's tables (between its perf markers) and
``docs/performance.rst`` from the newest full run per device in ``bench/results/``; the first
test fails when either is stale, so a new committed result (or a hand edit of the tables) must
be followed by ``polynorm bench --readme``.  Only the command line is used here, so these tests
do not depend on where the generator's module lives.
"""

from __future__ import annotations

import doctest
import json
import re
import shutil
from pathlib import Path

import pytest

from polynorm.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"


def _markers() -> tuple[str, str]:
    text = README.read_text()
    begin = re.search(r"<!-- perf:begin.*?-->", text)
    end = re.search(r"<!-- perf:end -->", text)
    assert begin and end and begin.start() < end.start(), "README: no perf markers"
    return begin.group(0), end.group(0)


def test_readme_and_performance_page_are_generated_from_the_committed_results(capsys):
    code = main(["bench", "--readme", str(README), "--check"])
    out = capsys.readouterr()
    assert code == 0, f"stale, run `polynorm bench --readme`:\n{out.out}{out.err}"


def test_readme_is_a_short_manual():
    # a manual with one short example per feature; the details live in docs/
    lines = README.read_text().splitlines()
    assert len(lines) <= 360
    text = "\n".join(lines)
    for section in ("## Set-up", "## Install", "## Quick start", "## API", "## Semantics",
                    "## What serving and training stacks use", "## Performance", "## Documentation"):
        assert section in text
    # the two set-up commands, exactly
    assert "\nbash .ci/run " in text and "\n.ci-venv/bin/polynorm bench --quick " in text


def _tree(tmp_path: Path, *files: str) -> tuple[Path, Path, Path]:
    begin, end = _markers()
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n\n{begin}\nold table\n{end}\n\nafter\n")
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    for name in files:
        shutil.copy(RESULTS / name, results / name)
    return readme, results, tmp_path / "docs" / "performance.rst"


def test_bench_readme_writes_then_check_passes(tmp_path, capsys):
    readme, _, page = _tree(tmp_path, "cpu-2026-12-05g-avx2.json", "gpu-2026-12-04b-h200.json")
    argv = ["bench", "--readme", str(readme)]
    assert main([*argv, "--check"]) == 1  # stale: old table, no page
    assert "stale" in capsys.readouterr().out
    assert not page.exists()  # --check writes nothing
    assert main(argv) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "old table" not in text
    assert "[`cpu-2026-12-05g-avx2.json`](bench/results/cpu-2026-12-05g-avx2.json)" in text
    assert "| fwd | 16384 x 4096 | 17.1 ms; 1.55 |" in text  # time; fraction of the copy roof
    assert "**GPU: NVIDIA H200**" in text and "| add 32768 x 4096 | 0.86 | 0.85 | 1.14 |" in text
    assert "slower than torch eager in" in text
    rst = page.read_text()
    assert rst.startswith(".. This page is generated") and "cpu-2026-12-05g-avx2.json" in rst
    assert main([*argv, "--check"]) == 0  # idempotent
    assert main(argv) == 0 and readme.read_text() == text
    assert "up to date" in capsys.readouterr().out


def _record_file(src: str, dst: Path, **changes) -> None:
    data = json.loads((RESULTS / src).read_text())
    for key, value in changes.items():
        if key == "date":
            data["machine"]["date"] = value
        elif key == "ops":
            data["records"] = [r for r in data["records"] if r["op"] in value]
        else:
            data["meta"][key] = value
    dst.write_text(json.dumps(data))


def test_the_current_table_is_the_newest_full_run(tmp_path):
    readme, results, _ = _tree(tmp_path, "cpu-2026-12-04e-avx2.json")
    # newer, but a run of one op and a quick run: neither becomes the table
    _record_file("cpu-2026-12-05f-bwd-avx2.json", results / "cpu-2099-01-01-bwd.json")
    _record_file("cpu-2026-12-05g-avx2.json", results / "cpu-2099-01-02.json", quick=True)
    assert main(["bench", "--readme", str(readme)]) == 0
    assert "cpu-2026-12-04e-avx2.json`](" in readme.read_text()
    _record_file("cpu-2026-12-05g-avx2.json", results / "cpu-2099-01-03.json")
    assert main(["bench", "--readme", str(readme), "--check"]) == 1  # a newer full run: stale
    assert main(["bench", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "cpu-2099-01-03.json`](" in text and "cpu-2026-12-04e" not in text
    # every file is indexed on the page, the current ones or not
    page = (tmp_path / "docs" / "performance.rst").read_text()
    assert all(f in page for f in ("cpu-2099-01-01-bwd.json", "cpu-2099-01-02.json",
                                   "cpu-2026-12-04e-avx2.json"))


@pytest.mark.parametrize("argv", [
    ["bench", "--readme", "--quick"],
    ["bench", "--readme", "--json", "x.json"],
    ["bench", "--check"],
    ["bench", "--quick", "--results", "bench/results"],
])
def test_bench_readme_measures_nothing_and_takes_no_run_options(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: polynorm" in err and "Traceback" not in err


def test_bench_readme_without_markers_is_exit_2_and_writes_nothing(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    assert main(["bench", "--readme", str(readme)]) == 2
    assert "markers" in capsys.readouterr().err
    assert readme.read_text() == "# no markers\n"
    assert not (tmp_path / "docs").exists()


# ------------------------------------------------------------------ the docs' examples run


DOC_PAGES = sorted(p.name for p in DOCS.glob("*.rst") if ">>> " in p.read_text())


@pytest.mark.parametrize("name", DOC_PAGES)
def test_docs_examples_run(name):
    text = (DOCS / name).read_text()
    for lib in ("torch", "jax", "dask"):
        if re.search(rf">>> import {lib}\b|>>> import .*\b{lib}\b", text):
            pytest.importorskip(lib)
    failed, tried = doctest.testfile(str(DOCS / name), module_relative=False, verbose=False,
                                     optionflags=doctest.NORMALIZE_WHITESPACE)
    assert tried and failed == 0
