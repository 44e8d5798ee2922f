"""Backend registry: one module per backend, imported lazily.

Every backend module provides the same three names (see
:mod:`polynorm.backends.reference` for the canonical, documented version):

``available() -> tuple[bool, str]``
    Whether the backend can run here and, if not, why (and how to fix it).
``forward(x, residual, weight, bias, plan, out) -> (y, h, rstd)``
    ``x``/``residual``/``out``: 2-D ``(n, d)``; ``weight``/``bias``: 1-D
    ``(d,)`` or ``None``; ``h`` is ``None`` when ``residual`` is ``None``.
``backward(dy, x, weight, bias, rstd, grad_residual, plan) -> (dx, dweight, dbias)``

Arrays arrive in the caller's own array type; a backend converts to its
native type (DLPack, zero-copy) and returns arrays of the caller's type.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: name -> module path.  Order matters only for listing.
MODULES: dict[str, str] = {
    "numba": "polynorm.backends.numba",
    "cupy": "polynorm.backends.cupy",
    "dask": "polynorm.backends.dask",
    "array_api": "polynorm.backends.reference",
}

#: How to get each backend, for error messages.
INSTALL_HINT: dict[str, str] = {
    "numba": "pip install 'polynorm[numba]'",
    "cupy": "pip install 'polynorm[cupy]' (needs an NVIDIA GPU and driver)",
    "dask": "pip install 'polynorm[dask]'",
    "array_api": "pip install array-api-compat",
}

_loaded: dict[str, ModuleType | None] = {}
_status: dict[str, tuple[bool, str]] = {}


def _module(name: str) -> ModuleType | None:
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(MODULES[name])
        except ImportError as exc:
            _loaded[name] = None
            _status[name] = (False, f"{exc}; {INSTALL_HINT[name]}")
    return _loaded[name]


def status(name: str) -> tuple[bool, str]:
    """``(usable, reason)`` for one backend; computed once per process."""
    if name not in _status:
        mod = _module(name)
        if mod is not None:
            _status[name] = mod.available()
    return _status[name]


def get(name: str) -> ModuleType:
    """The module of a usable backend, or a ``ValueError`` saying how to install it."""
    if name not in MODULES:
        raise ValueError(f"backend must be 'auto' or one of {tuple(MODULES)}, got {name!r}")
    usable, reason = status(name)
    if not usable:
        if INSTALL_HINT[name] not in reason:  # a backend's own reason may not say how
            reason = f"{reason}; to install: {INSTALL_HINT[name]}"
        raise ValueError(f"backend {name!r} is not usable here: {reason}")
    return _loaded[name]  # type: ignore[return-value]


def usable(name: str) -> bool:
    return status(name)[0]


def report() -> dict[str, tuple[bool, str]]:
    """Every backend with ``(usable, reason)``; ``reason`` is ``"ok"`` when usable.

    >>> import polynorm as pn
    >>> pn.backends()["array_api"]
    (True, 'ok')
    """
    return {name: status(name) for name in MODULES}
