"""Where a test run spends its Numba compile time: a pytest plugin.

Most of the default test run's CPU is Numba compiling kernel specialisations
(one per dtype, layout and set of optional arrays); a test that hits a new one
pays for it.  This plugin listens to Numba's compile events and, at the end of
the run, prints the compile seconds per test file, per test and per kernel.
Run it on an empty kernel cache, or it sees only what the cache lacks::

    POLYNORM_CACHE_DIR=$(mktemp -d) PYTHONPATH=bench python -m pytest -q -p compile_census

A test's seconds are those of the kernels it was the first to need: taking
it out of the run moves them to the next test that needs the same kernel.

It also prints each test's CPU (this process) and its child processes' CPU
(g++ building the CUDA emulator's libraries when ``POLYNORM_EMUL_CACHE`` is
empty, subprocess and multi-process tests): the compile events do not see them.
With ``COMPILE_CENSUS_TSV`` set to a path it also writes every test's row there
(test, CPU self, CPU children, compile seconds; tab-separated), for sums over
groups of tests that the printed top lists leave out, and every top-level compile
to the same path plus ``.compiles`` (seconds, kernel, argument types, the test).
"""

from __future__ import annotations

import collections
import os
import resource
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


# CPU seconds per test: this process (user + sys) and its waited-for children (g++, subprocesses)
cpu_self: collections.Counter[str] = collections.Counter()
cpu_children: collections.Counter[str] = collections.Counter()


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    s0, c0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    cpu_self[item.nodeid] += _cpu(resource.RUSAGE_SELF) - s0
    cpu_children[item.nodeid] += _cpu(resource.RUSAGE_CHILDREN) - c0


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
    tr.section("CPU seconds per test (this process + child processes such as g++)")
    tr.write_line(f"{sum(cpu_self.values()):8.1f}  this process, {sum(cpu_children.values()):.1f} children,"
                  f" in {len(cpu_self)} tests")
    files_self: collections.Counter[str] = collections.Counter()
    files_children: collections.Counter[str] = collections.Counter()
    for t in cpu_self:
        files_self[t.split("::")[0]] += cpu_self[t]
        files_children[t.split("::")[0]] += cpu_children[t]
    tr.write_line("-- by file (self + children = total)")
    for f, _ in (files_self + files_children).most_common(40):
        tr.write_line(f"{files_self[f]:8.1f} + {files_children[f]:6.1f} = {files_self[f] + files_children[f]:7.1f}  {f}")
    tr.write_line("-- by test, children (g++ builds, subprocesses)")
    for t, s in cpu_children.most_common(40):
        if s >= 0.5:
            tr.write_line(f"{s:8.1f}  {t}")
    tr.write_line("-- by test, total")
    for t, s in (cpu_self + cpu_children).most_common(80):
        tr.write_line(f"{s:8.1f}  {t} (compile {per_test[t]:.1f}, children {cpu_children[t]:.1f})")
    path = os.environ.get("COMPILE_CENSUS_TSV")
    if path:
        with open(path, "w") as fh:
            fh.write("test\tcpu_self\tcpu_children\tcompile\n")
            for t in cpu_self:
                fh.write(f"{t}\t{cpu_self[t]:.3f}\t{cpu_children[t]:.3f}\t{per_test[t]:.3f}\n")
        with open(path + ".compiles", "w") as fh:
            fh.write("seconds\tkernel\targs\ttest\n")
            for k, sigs in signatures.items():
                for dt, sig, test in sigs:
                    fh.write(f"{dt:.3f}\t{k}\t{sig}\t{test}\n")
        tr.write_line(f"every test's row: {path} (every compile: {path}.compiles)")
