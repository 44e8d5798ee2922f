"""``polynorm warmup``: compile the CPU kernels ahead of the first real call.

Numba compiles a kernel at its first call for each argument type and keeps it in
the on-disk cache (:mod:`polynorm.core.cache`); later processes load it in well under
a second.  A first call in a fresh environment therefore pays the compile (several
seconds per dtype and path); this runs the calls that compile each path once.
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


def warmup(
    dtypes: Iterable[str] | None = None,
    *,
    backward: bool = True,
    report: Callable[[str, float], None] | None = None,
) -> list[tuple[str, float]]:
    """Compile the Numba kernels for the given dtypes (forward, add, backward).

    Parameters
    ----------
    dtypes : iterable of str, optional
        Activation dtypes to compile for (default: all four). The weight is float32
        (float64 for float64 activations), the common pairing.
    backward : bool, default True
        Also compile the backward.
    report : callable, optional
        Called as ``report(what, seconds)`` after each step.

    Returns
    -------
    list of (str, float)
        Each step and the seconds it took (compile plus a tiny run).

    Examples
    --------
    >>> from polynorm.cli.warmup import warmup
    >>> steps = warmup(["float32"], backward=False)
    >>> [what for what, _ in steps]
    ['float32 forward', 'float32 add']
    """
    steps: list[tuple[str, float]] = []
    for dtype in dtypes or FLOAT_DTYPES:
        for what in ("forward", "add", "backward")[: 3 if backward else 2]:
            t0 = time.perf_counter()
            _compile(what, dtype)
            seconds = time.perf_counter() - t0
            steps.append((f"{dtype} {what}", seconds))
            if report is not None:
                report(f"{dtype} {what}", seconds)
    return steps
