"""Collection rules for the whole tree (the doctest run covers polynorm/).

Modules for optional array libraries cannot even be imported without them;
their doctests are left out when the library is absent (their tests in
tests/ skip themselves).
"""

from __future__ import annotations

import importlib.util


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # e.g. sys.modules[module] is None
        return True


collect_ignore = [
    path
    for module, path in (("jax", "polynorm/jax/__init__.py"), ("torch", "polynorm/torch/__init__.py"),
                         ("transformers", "polynorm/torch/hf.py"))
    if _missing(module)
]


def pytest_collect_file(file_path, parent):
    # polynorm/_torch_*.py import polynorm.torch, which imports them back at its end:
    # a doctest run that collects one of them first would enter the cycle from the
    # wrong side, so polynorm.torch is imported first
    if file_path.name.startswith("_torch_") and file_path.parent.name == "polynorm" \
            and not _missing("torch"):
        import polynorm.torch  # noqa: F401
    return None
