"""``polynorm warmup``: compile the CPU kernels ahead of the first real call.

Numba compiles a kernel at its first call for each argument type and keeps it in
the on-disk cache (:mod:`polynorm.core.cache`); later processes load it in well under
a second.  A first call in a fresh environment therefore pays the compile (several
seconds per dtype and path); this runs the calls that compile each path once.  Where
jax is installed, the XLA FFI handlers that ``polynorm.jax`` lowers jitted calls to
(:mod:`polynorm.backends.numba.xla`) are compiled and cached too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

from polynorm.core.dtypes import FLOAT_DTYPES

__all__ = ["warmup"]

#: (tokens, d): a serial-size call and one large enough for the threaded path
_SHAPES = ((2, 64), (64, 2048))


def _array(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    from polynorm.core.dtypes import namespace_dtype

    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(namespace_dtype(np, dtype))


def _compile(what: str, dtype: str) -> None:
    """One op at one dtype, on every shape of ``_SHAPES`` (the serial and threaded paths)."""
    from polynorm import add_rms_norm, rms_norm, rms_norm_backward

    wdt = "float64" if dtype == "float64" else "float32"
    for n, d in _SHAPES:
        x = _array((n, d), dtype, 0)
        w = _array((d,), wdt, 1)
        if what == "forward":
            rms_norm(x, w, backend="numba")
        elif what == "add":
            add_rms_norm(x, x, w, backend="numba")
        else:
            rms_norm_backward(x, x, w, backend="numba")


def _jax_usable(dtype: str) -> bool:
    """Whether jax is installed and holds ``dtype`` (float64 only with jax_enable_x64)."""
    try:
        import jax
    except ImportError:
        return False
    return dtype != "float64" or bool(jax.config.read("jax_enable_x64"))


def _compile_jax(dtype: str, backward: bool) -> None:
    """The handlers of jitted ``polynorm.jax`` calls at one dtype: forward, fused add
    and, with ``backward``, their gradients."""
    import jax
    import jax.numpy as jnp

    from polynorm.jax import add_rms_norm, rms_norm

    def loss(x, w):
        return rms_norm(x, w).astype(jnp.float32).sum()

    def add_loss(x, w):
        return sum(a.astype(jnp.float32).sum() for a in add_rms_norm(x, x, w))

    wdt = "float64" if dtype == "float64" else "float32"
    calls = [jax.jit(rms_norm), jax.jit(lambda x, w: add_rms_norm(x, x, w))]
    if backward:
        calls += [jax.jit(jax.grad(loss, argnums=(0, 1))), jax.jit(jax.grad(add_loss, (0, 1)))]
    for n, d in _SHAPES:
        x, w = jnp.asarray(_array((n, d), dtype, 0)), jnp.asarray(_array((d,), wdt, 1))
        for f in calls:
            jax.block_until_ready(f(x, w))


def warmup(
    dtypes: Iterable[str] | None = None,
    *,
    backward: bool = True,
    jax: bool = True,
    report: Callable[[str, float], None] | None = None,
) -> list[tuple[str, float]]:
    """Compile the Numba kernels for the given dtypes (forward, add, backward), and
    where jax is installed the handlers of jitted ``polynorm.jax`` calls.

    Parameters
    ----------
    dtypes : iterable of str, optional
        Activation dtypes to compile for (default: all four). The weight is float32
        (float64 for float64 activations), the common pairing.
    backward : bool, default True
        Also compile the backward.
    jax : bool, default True
        Also compile the XLA FFI handlers of jitted ``polynorm.jax`` calls (skipped
        where jax is not installed, and for float64 without ``jax_enable_x64``).
    report : callable, optional
        Called as ``report(what, seconds)`` after each step.

    Returns
    -------
    list of (str, float)
        Each step and the seconds it took (compile plus a tiny run).

    Examples
    --------
    >>> from polynorm.cli.warmup import warmup
    >>> steps = warmup(["float32"], backward=False, jax=False)
    >>> [what for what, _ in steps]
    ['float32 forward', 'float32 add']
    """
    steps: list[tuple[str, float]] = []
    for dtype in dtypes or FLOAT_DTYPES:
        whats = ["forward", "add", "backward"][: 3 if backward else 2]
        if jax and _jax_usable(dtype):
            whats.append("jax")
        for what in whats:
            t0 = time.perf_counter()
            if what == "jax":
                _compile_jax(dtype, backward)
            else:
                _compile(what, dtype)
            seconds = time.perf_counter() - t0
            steps.append((f"{dtype} {what}", seconds))
            if report is not None:
                report(f"{dtype} {what}", seconds)
    return steps
