"""The root conftest's rule: a module of polynorm whose imports need a library
missing here is left out of the doctest run, and nothing else is.

The rule reads the sources; these tests check it on a package written for
the purpose (every form of import it must follow or ignore) and against the
truth on polynorm itself: in a fresh interpreter where the optional libraries
cannot be imported, exactly the modules the rule leaves out fail to import.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _rule():
    spec = importlib.util.spec_from_file_location("_root_conftest", ROOT / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FAKE = "polynorm_test_no_such_library"

PACKAGE = {
    "pkg/__init__.py": "from . import core\n",
    "pkg/core.py": "import math\n",
    "pkg/direct.py": f"import {FAKE}.sub as s\n",
    "pkg/from_fake.py": f"from {FAKE} import thing\n",
    "pkg/through.py": "from .direct import s\n",
    "pkg/through_dot.py": "from . import direct\n",
    "pkg/absolute.py": "import pkg.through\n",
    "pkg/cycle_a.py": "from . import cycle_b\nimport math\n",
    "pkg/cycle_b.py": f"from . import cycle_a\nimport {FAKE}\n",
    "pkg/conditional.py": f"import sys\nif sys.version_info > (3,):\n    import {FAKE}\n",
    "pkg/guarded.py": textwrap.dedent(f"""\
        from typing import TYPE_CHECKING
        try:
            import {FAKE}
        except ImportError:
            {FAKE} = None
        if TYPE_CHECKING:
            import {FAKE}
        def f():
            import {FAKE}
        from .core import math
        """),
    "pkg/in_class.py": f"class C:\n    import {FAKE}\n",
    "pkg/try_other.py": f"try:\n    import {FAKE}\nexcept KeyError:\n    pass\n",
    "pkg/late.py": "x = 1\nfrom .direct import s  # noqa: E402\n",
    "pkg/sub/__init__.py": f"import {FAKE}\n",
    "pkg/sub/leaf.py": "x = 1\n",
    "pkg/other/__init__.py": "",
    "pkg/other/up.py": "from .. import direct\n",
    "pkg/other/fine.py": "from ..core import math\n",
    "pkg/data/notes.txt": "",
}
NEEDS_FAKE = {"pkg/direct.py", "pkg/from_fake.py", "pkg/through.py", "pkg/through_dot.py",
              "pkg/absolute.py", "pkg/cycle_a.py", "pkg/cycle_b.py", "pkg/conditional.py",
              "pkg/late.py", "pkg/sub", "pkg/sub/__init__.py", "pkg/sub/leaf.py",
              "pkg/other/up.py", "pkg/in_class.py", "pkg/try_other.py"}


def test_rule_follows_the_imports_made_at_import_time(tmp_path):
    rule = _rule()
    for rel, text in PACKAGE.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    paths = {*PACKAGE, "pkg", "pkg/sub", "pkg/other", "pkg/data"}
    got = {rel for rel in paths if rule.missing_for(tmp_path / rel, tmp_path, "pkg") == [FAKE]}
    assert got == NEEDS_FAKE
    assert rule.module_name(tmp_path / "pkg/data", tmp_path, "pkg") is None  # not a package
    assert rule.module_name(tmp_path / "elsewhere.py", tmp_path, "pkg") is None


_BLOCK = textwrap.dedent("""
    import importlib, json, pkgutil, sys

    BLOCKED = set(json.loads(sys.argv[1]))

    class Block:
        # as if not installed (a None in sys.modules would break libraries that
        # look a module up there)
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Block())
""")

_PROBE = _BLOCK + textwrap.dedent("""
    import conftest
    import polynorm

    names = ["polynorm"] + [m.name for m in pkgutil.walk_packages(polynorm.__path__, "polynorm.")
                            if not m.name.endswith(".__main__")]
    failed = {}
    for _ in range(2):  # a second pass imports what an import cycle entered from the wrong side
        for name in names:
            try:
                importlib.import_module(name)
                failed.pop(name, None)
            except ImportError as exc:
                failed[name] = repr(exc)
    files = {name: importlib.util.find_spec(name).origin for name in names}
    ignored = sorted(n for n, f in files.items() if conftest.pytest_ignore_collect(f, None))
    print(json.dumps({"failed": failed, "names": names, "ignored": ignored}))
""")

_COLLECT = _BLOCK + textwrap.dedent("""
    import pytest

    sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "polynorm"]))
""")


def _optional_libraries() -> list[str]:
    """The outside libraries polynorm imports at import time that it does not require."""
    tomllib = pytest.importorskip("tomllib")
    rule = _rule()
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    required = {d.split(">")[0].split("=")[0].split("<")[0].strip().replace("-", "_") for d in deps}
    libs = set()
    for path in (ROOT / "polynorm").rglob("*.py"):
        libs |= rule.needs(rule.module_name(path))
    return sorted(libs - set(sys.stdlib_module_names) - required - {"polynorm"})


def _run(script: str, blocked: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, json.dumps(blocked)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _probe(blocked: list[str]) -> dict:
    out = _run(_PROBE, blocked)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _check(blocked: list[str]) -> dict:
    got = _probe(blocked)
    for name, err in got["failed"].items():  # each failure is a blocked library's absence
        assert any(repr(lib) in err for lib in blocked), (name, err)
    assert sorted(got["failed"]) == got["ignored"]
    return got


def test_rule_leaves_out_exactly_what_cannot_be_imported_without_the_optional_libraries():
    libs = _optional_libraries()
    assert {"torch", "jax", "numba"} <= set(libs)  # the rule sees the imports it must
    got = _check(libs)
    assert {"polynorm.torch", "polynorm.jax",
            "polynorm.backends.numba.kernels"} <= set(got["ignored"])
    assert "polynorm" not in got["ignored"] and "polynorm.backends.numba" not in got["ignored"]


def test_doctest_collection_without_the_optional_libraries():
    out = _run(_COLLECT, _optional_libraries())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _requirements(dist: str) -> set[str]:
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires(dist) or []
    except PackageNotFoundError:
        return set()
    return {re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0].lower().replace("-", "_")
            for r in reqs if "extra ==" not in r}


@pytest.mark.slow
def test_rule_for_each_optional_library_alone():
    libs = [lib for lib in _optional_libraries() if importlib.util.find_spec(lib) is not None]
    # a library another one requires (numba's llvmlite) is never missing alone
    required = set().union(*(_requirements(lib) for lib in libs))
    for lib in libs:
        if lib not in required:
            _check([lib])


def test_example_needs_reads_the_imports_of_a_texts_examples():
    rule = _rule()
    text = textwrap.dedent("""
        Some prose mentioning import os.

        >>> import numpy as np
        >>> import polynorm.torch as pnt
        >>> from dask import array as da
        >>> for i in range(2):
        ...     import json
    """)
    got = rule.example_needs(text)
    assert {"numpy", "torch", "dask"} <= got  # polynorm.torch counted by what it imports
    assert "polynorm" not in got


def test_readme_examples_are_left_out_without_their_libraries():
    script = _BLOCK + textwrap.dedent("""
        import pytest

        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "README.md"]))
    """)
    out = _run(script, _optional_libraries())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 skipped" in out.stdout
