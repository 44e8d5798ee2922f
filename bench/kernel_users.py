"""Which tests call each Numba kernel specialisation: a pytest plugin.

compile_census.py names the first test that needs a specialisation (it pays the
compile); taking that test out of the run only moves the compile to the next
user.  This plugin records every test that calls each specialisation from
Python, so the specialisations that only one test (or one group of tests)
needs show, and what leaving those tests out of a run saves.  Run it on a warm
kernel cache (the calls are what it records, not the compiles)::

    PYTHONPATH=bench python -m pytest -q -p kernel_users tests/test_numba.py ...

Set ``KERNEL_USERS_COST`` to a compile_census.py output file to weigh each
specialisation by its compile seconds there (its signature lines); others count
``--`` seconds.  Calls from inside jitted code are compiled into their caller and
are not seen.  ``KERNEL_USERS_JSON`` set to a path writes every specialisation's
users there (``[[kernel, signature, [tests...]], ...]``), for questions the
printed tables do not answer (which tests a layout's or dtype's kernels serve).
"""

from __future__ import annotations

import collections
import json
import os
import re

import pytest
from numba.core import dispatcher

_current = ["(collection)"]
users: collections.defaultdict[tuple[str, str], set[str]] = collections.defaultdict(set)
_base_call = dispatcher._dispatcher.Dispatcher.__call__


def _call(self, *args, **kws):
    try:
        sig = ", ".join(str(self.typeof_pyval(a)) for a in args)
        name = f"{self.py_func.__module__}.{self.py_func.__qualname__}"
        users[(name, sig)].add(_current[0])
    except Exception:  # a type Numba cannot name: the call itself reports it
        pass
    return _base_call(self, *args, **kws)


dispatcher.Dispatcher.__call__ = _call  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    yield


def _costs() -> dict[tuple[str, str], float]:
    """``{(kernel, signature): compile seconds}`` from a compile_census.py output."""
    path = os.environ.get("KERNEL_USERS_COST")
    if not path:
        return {}
    out: dict[tuple[str, str], float] = {}
    kernel = None
    for line in open(path, errors="replace"):
        line = line.rstrip("\n")
        if re.match(r"^[\w.<>]+$", line):
            kernel = line
            continue
        m = re.match(r"^\s+([\d.]+)\s+\((.*)\)\s+<- ", line)
        if m and kernel:
            sig = re.sub(r"Literal\[\w+\]\((\w+)\)", "int64", m.group(2))
            out[(kernel, sig)] = float(m.group(1))
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    cost = _costs()
    tr.section("Numba specialisations by their users")
    tr.write_line(f"{len(users)} specialisations called from Python")
    only: collections.defaultdict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    groups: collections.defaultdict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    for key, tests in users.items():
        if len(tests) == 1:
            only[next(iter(tests))].append(key)
        funcs = {t.split("[")[0] for t in tests}
        if len(funcs) == 1:  # every user is a case of one parametrised test
            groups[next(iter(funcs))].append(key)

    def secs(keys):
        return sum(cost.get(k, 0.0) for k in keys)

    def show(title, table):
        tr.write_line(title)
        for who, keys in sorted(table.items(), key=lambda kv: (-secs(kv[1]), -len(kv[1]))):
            tr.write_line(f"{secs(keys):6.1f} s  {len(keys)} specialisation(s)  {who}")
            for k in keys:
                c = cost.get(k)
                tr.write_line(f"          {'--' if c is None else f'{c:.1f}'}  {k[0]} ({k[1]})")
                if table is groups:
                    tr.write_line(f"             users: {', '.join(sorted(users[k]))}")

    show("-- specialisations that one test alone calls (compile seconds where known)", only)
    show("-- specialisations that only the cases of one parametrised test call", groups)
    path = os.environ.get("KERNEL_USERS_JSON")
    if path:
        with open(path, "w") as fh:
            json.dump([[k, sig, sorted(tests)] for (k, sig), tests in sorted(users.items())], fh, indent=0)
        tr.write_line(f"every specialisation's users: {path}")
