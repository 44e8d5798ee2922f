"""Where compiled kernels live (:mod:`polynorm.core.cache`) and ``polynorm warmup``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polynorm.core import cache as _cache

nb = pytest.importorskip("numba")


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYNORM_CACHE_DIR", str(tmp_path / "pc"))
    assert _cache.cache_dir() == tmp_path / "pc"
    monkeypatch.delenv("POLYNORM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _cache.cache_dir() == tmp_path / "xdg" / "polynorm"


def test_numba_kernels_cache_outside_the_package():
    from polynorm.backends.numba import kernels as nbk

    if os.environ.get("NUMBA_CACHE_DIR"):
        pytest.skip("NUMBA_CACHE_DIR set: Numba's own rule applies")
    path = Path(nbk.forward_rows._cache._cache_path)
    assert path.is_relative_to(_cache.cache_dir() / "numba")
    assert not path.is_relative_to(Path(nbk.__file__).parent)


def test_locator_answers_only_for_polynorm(monkeypatch):
    from numba.core import caching

    from polynorm.backends.numba import kernels as nbk

    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    locator = impl._locator_classes[0]
    assert locator.__name__ == "PolynormCacheLocator"

    def foreign():  # a function outside the package
        return 1

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    assert locator.from_function(foreign, __file__) is None
    fn = nbk.forward_rows.py_func
    assert locator.from_function(fn, nbk.__file__) is not None
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere")
    assert locator.from_function(fn, nbk.__file__) is None


def test_kernel_stamp_covers_every_kernel_source():
    names = {name for name, _, _ in _cache._kernel_stamp()}
    assert {"backends/numba/__init__.py", "backends/numba/kernels.py", "backends/numba/codec.py",
            "backends/numba/backward_kernels.py", "backends/rowtree.py"} <= names


def test_warmup_command(capsys):
    from polynorm.cli import main

    assert main(["warmup", "--dtype", "float32", "--no-backward"]) == 0
    out = capsys.readouterr().out
    assert "float32 forward" in out and "float32 add" in out and "backward" not in out
    assert str(_cache.cache_dir() / "numba") in out
