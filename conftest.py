"""Collection rules for the whole tree (the doctest run covers polynorm/).

A module of polynorm that imports an optional library (torch, jax, numba, ...)
cannot even be imported without it, so its doctests are left out when the
library is absent (its tests in tests/ skip themselves).  One rule decides,
for every module and package alike, with no list to keep up to date: a module
is left out when a library it imports at import time is missing here.  "At
import time" is read from the sources (:func:`needs`): the unconditional
top-level imports of the module, of every polynorm module it imports that way,
and of its parent packages; imports inside functions, ``try`` blocks or
``if TYPE_CHECKING:`` do not count.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parent
PACKAGE = "polynorm"


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # e.g. sys.modules[module] is None
        return True


def module_name(path: Path, root: Path = ROOT, package: str = PACKAGE) -> str | None:
    """The dotted name of a module file or package directory under ``root/package``."""
    try:
        rel = Path(path).resolve().relative_to((root / package).resolve())
    except ValueError:
        return None
    parts = [package, *rel.parts]
    if parts[-1].endswith(".py"):
        parts[-1] = parts[-1][:-3]
        if parts[-1] == "__init__":
            parts.pop()
    elif not (Path(path) / "__init__.py").is_file():
        return None
    return ".".join(parts)


def _source(name: str, root: Path) -> Path | None:
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


_GUARDS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _guarded(node: ast.Try) -> bool:
    """Whether a ``try`` survives a failed import in its body."""
    for handler in node.handlers:
        if handler.type is None:
            return True
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(ast.unparse(k).rsplit(".", 1)[-1] in _GUARDS for k in kinds):
            return True
    return False


def _eager_imports(body: list[ast.stmt]):
    """The import statements a module body runs when imported, unless they are only
    for type checkers or in a ``try`` that catches their failure (function bodies
    run later; class bodies and other blocks run now)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _eager_imports(node.orelse)
        elif isinstance(node, ast.Try) and _guarded(node):
            yield from _eager_imports(node.finalbody)
        else:
            for field in ("body", "orelse", "finalbody"):
                yield from _eager_imports(getattr(node, field, None) or [])
            for handler in getattr(node, "handlers", None) or []:
                yield from _eager_imports(handler.body)


@cache
def _edges(name: str, root: Path, package: str) -> tuple[frozenset[str], frozenset[str]]:
    """``(polynorm modules, outside libraries)`` that importing ``name`` imports itself."""
    path = _source(name, root)
    inner: set[str] = set()
    outer: set[str] = set()
    if path is None:
        return frozenset(), frozenset()
    parts = name.split(".")
    inner |= {".".join(parts[:i]) for i in range(1, len(parts))}  # the parent packages
    here = parts if path.name == "__init__.py" else parts[:-1]
    for node in _eager_imports(ast.parse(path.read_text(encoding="utf-8")).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif node.level:
            base = here[:len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            targets = [".".join(base)] + [".".join([*base, a.name]) for a in node.names]
        else:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for target in targets:
            if target.split(".")[0] != package:
                outer.add(target.split(".")[0])
            elif _source(target, root) is not None:  # a module, not a name in one
                inner.add(target)
    inner.discard(name)
    return frozenset(inner), frozenset(outer)


def needs(name: str, root: Path = ROOT, package: str = PACKAGE) -> frozenset[str]:
    """The outside libraries (top-level names) that importing module ``name`` imports."""
    seen, todo, libs = {name}, [name], set()
    while todo:
        inner, outer = _edges(todo.pop(), root, package)
        libs |= outer
        for mod in inner - seen:
            seen.add(mod)
            todo.append(mod)
    return frozenset(libs)


def missing_for(path: Path, root: Path = ROOT, package: str = PACKAGE) -> list[str]:
    """The libraries, missing here, without which the module or package at ``path``
    cannot be imported ([] for anything else)."""
    name = module_name(path, root, package)
    if name is None:
        return []
    return sorted(lib for lib in needs(name, root, package) if _missing(lib))


def example_needs(text: str, root: Path = ROOT, package: str = PACKAGE) -> frozenset[str]:
    """The outside libraries that the ``>>>`` examples of a text file import (polynorm
    modules counted by what importing them needs, as for modules)."""
    lines = [ln.strip()[4:] for ln in text.splitlines() if ln.strip().startswith((">>> ", "... "))]
    libs: set[str] = set()
    for line in lines:
        try:
            nodes = ast.parse(line).body
        except SyntaxError:  # a line of a multi-line statement
            continue
        for node in _eager_imports(nodes):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            for name in names:
                if name == package or name.startswith(package + "."):
                    libs |= needs(name, root, package)
                elif name:
                    libs.add(name.split(".")[0])
    return frozenset(libs)


def pytest_ignore_collect(collection_path, config):
    if missing_for(collection_path):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    # a doctest (a docstring's examples, or README.md's, which run as one item) is skipped,
    # with the reason, when a library its examples import is missing: the rule above,
    # for examples
    import pytest

    for item in items:
        test = getattr(item, "dtest", None)
        if test is None:
            continue
        text = "\n".join(">>> " + line for ex in test.examples for line in ex.source.splitlines())
        missing = sorted(lib for lib in example_needs(text) if _missing(lib))
        if missing:
            item.add_marker(pytest.mark.skip(
                reason=f"its examples import {', '.join(missing)}, missing here"))
