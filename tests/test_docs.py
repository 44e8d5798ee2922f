"""Every public function is documented (numpydoc) with an example the test run executes.

The examples themselves run through ``--doctest-modules`` (pyproject); this
checks that each public function has one, so a new function cannot slip in
undocumented.
"""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

import polynorm as pn

#: Public modules: the package itself, the CLI, and the framework wrappers where present.
MODULES = ["polynorm", "polynorm.cli", "polynorm.torch", "polynorm.jax"]


def _public_functions():
    for modname in MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError as exc:  # polynorm.torch without torch, or not written yet
            yield pytest.param(None, None, marks=pytest.mark.skip(reason=f"{modname}: {exc}"),
                               id=modname)
            continue
        names = getattr(mod, "__all__", None) or (["main"] if modname == "polynorm.cli" else [])
        for name in names:
            obj = getattr(mod, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield pytest.param(modname, obj, id=f"{modname}.{name}")


@pytest.mark.parametrize(("modname", "obj"), list(_public_functions()))
def test_public_function_has_numpydoc_with_an_example(modname, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{modname}.{obj.__name__} has no docstring"
    assert "Examples\n--------" in doc, f"{modname}.{obj.__name__}: no numpydoc Examples section"
    tests = doctest.DocTestFinder(recurse=False).find(obj, obj.__name__, module=False)
    assert tests and tests[0].examples, f"{modname}.{obj.__name__}: no runnable >>> example"
    if inspect.isfunction(obj) and inspect.signature(obj).parameters:
        assert "Parameters\n----------" in doc or "Returns\n-------" in doc, (
            f"{modname}.{obj.__name__}: no numpydoc Parameters/Returns section"
        )


def test_the_package_exports_what_the_spec_names():
    for name in ("rms_norm", "add_rms_norm", "rms_norm_backward", "backends"):
        assert name in pn.__all__
