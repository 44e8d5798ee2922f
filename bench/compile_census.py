"""Where a test run spends its Numba compile time: a pytest plugin.

Most of the default test run's CPU is Numba compiling kernel specialisations
(one per dtype, layout and set of optional arrays); a test that hits a new one
pays for it.  This plugin listens to Numba's compile events and, at the end of
the run, prints the compile seconds per test file, per test and per kernel.
Run it on an empty kernel cache, or it sees only what the cache lacks::

    POLYNORM_CACHE_DIR=$(mktemp -d) PYTHONPATH=bench python -m pytest -q -p compile_census

A test's seconds are those of the kernels it was the first to need: taking
it out of the run moves them to the next test that needs the same kernel.
"""

from __future__ import annotations

import collections
import time

import pytest
from numba.core import event

_current = ["(collection)"]
_open: list[float] = []  # start times of the compiles in progress (nested: callees)
per_test: collections.Counter[str] = collections.Counter()
per_kernel: collections.Counter[str] = collections.Counter()
compiles: collections.Counter[str] = collections.Counter()
# the argument types of each top-level compile: which ones make a kernel's specialisations
# (and the test that needed each: the one to look at for a specialisation only it uses)
signatures: collections.defaultdict[str, list[tuple[float, str, str]]] = collections.defaultdict(list)


class _Listener(event.Listener):
    def on_start(self, ev):
        _open.append(time.perf_counter())

    def on_end(self, ev):
        dt = time.perf_counter() - _open.pop()
        if _open:  # a callee, compiled inside its caller's compile
            return
        d = ev.data.get("dispatcher")
        name = f"{d.py_func.__module__}.{d.py_func.__qualname__}" if d else "?"
        per_test[_current[0]] += dt
        per_kernel[name] += dt
        compiles[name] += 1
        signatures[name].append((dt, ", ".join(map(str, ev.data.get("args", ()))), _current[0]))


event.register("numba:compile", _Listener())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    yield


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    by_file: collections.Counter[str] = collections.Counter()
    for test, s in per_test.items():
        by_file[test.split("::")[0]] += s
    tr.section("Numba compile time (top-level compiles, seconds)")
    tr.write_line(f"{sum(per_test.values()):8.1f}  in all, {sum(compiles.values())} compiles")
    tr.write_line("-- by file")
    for f, s in by_file.most_common(25):
        tr.write_line(f"{s:8.1f}  {f}")
    tr.write_line("-- by kernel (compiles)")
    for k, s in per_kernel.most_common(25):
        tr.write_line(f"{s:8.1f}  {k} ({compiles[k]})")
    tr.write_line("-- argument types of the top kernels' compiles (seconds)")
    for k, _ in per_kernel.most_common(6):
        tr.write_line(k)
        for dt, sig, test in signatures[k]:
            tr.write_line(f"{dt:8.1f}  ({sig})  <- {test}")
    tr.write_line("-- by test")
    for t, s in per_test.most_common(40):
        tr.write_line(f"{s:8.1f}  {t}")
