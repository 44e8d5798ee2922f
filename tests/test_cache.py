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

    assert main(["warmup", "--dtype", "float32", "--no-backward", "--no-jax"]) == 0
    out = capsys.readouterr().out
    assert "float32 forward" in out and "float32 add" in out and "backward" not in out
    assert "jax" not in out
    assert str(_cache.cache_dir() / "numba") in out


@pytest.mark.slow  # two processes, each importing jax; the first compiles the handlers
def test_jax_handlers_compiled_by_warmup_load_in_the_next_process(tmp_path):
    """``polynorm warmup`` writes the XLA FFI handlers to the cache; a later process
    loads every one of them from disk (each compiled handler reports a cache hit) and
    its jitted calls keep the eager bits."""
    pytest.importorskip("jax")
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NUMBA_CACHE_DIR")}
    env["POLYNORM_CACHE_DIR"] = str(tmp_path / "pc")
    warm = subprocess.run([sys.executable, "-m", "polynorm", "warmup", "--dtype", "float32"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert "float32 jax" in warm.stdout
    code = """
import jax, jax.numpy as jnp, numpy as np
import polynorm as pn
from polynorm.backends.numba import xla
from polynorm.jax import rms_norm
x = np.random.default_rng(0).standard_normal((256, 2048)).astype(np.float32)  # pooled calls
w = np.random.default_rng(1).standard_normal(2048).astype(np.float32)
y = jax.jit(rms_norm)(x, w)
gx, gw = jax.jit(jax.grad(lambda x, w: rms_norm(x, w).sum(), argnums=(0, 1)))(x, w)
assert np.array_equal(np.asarray(y), pn.rms_norm(x, w))
_, rstd = pn.rms_norm(x, w, return_rstd=True)
ex, ew, _ = pn.rms_norm_backward(np.ones_like(x), x, w, rstd=rstd)
assert np.array_equal(np.asarray(gx), ex) and np.array_equal(np.asarray(gw), ew)
hits = [f.cache_hits for f in xla._keep]
assert hits and all(h == 1 for h in hits), hits
print("handlers", len(hits))
"""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "handlers" in res.stdout
