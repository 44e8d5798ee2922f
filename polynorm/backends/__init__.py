"""Backend registry and contract: one module per backend, imported lazily.

A backend is a module that satisfies :class:`Backend` (the required names)
and, optionally, any of the capabilities below; the front end looks for a
capability with ``hasattr`` and uses the reference where it is missing.
:mod:`polynorm.backends.reference` is the canonical, documented version.
Arrays arrive 2-D ``(n, d)`` (weight/bias 1-D ``(d,)``) in the caller's own
array type; a backend converts to its native type (DLPack, zero-copy) and
returns arrays of the caller's type.  A new backend is its module plus one
line in :data:`MODULES` and one in :data:`INSTALL_HINT`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from polynorm.core.options import GatedPlan, Plan, QuantPlan


@runtime_checkable
class Backend(Protocol):
    """What every backend module provides."""

    def available(self) -> tuple[bool, str]:
        """Whether it can run here and, if not, why and how to fix it (asked once)."""
        ...

    def accepts(self, x: Any) -> bool:
        """Whether ``backend="auto"`` may send it this array."""
        ...

    def forward(self, x: Any, residual: Any, weight: Any, bias: Any, plan: Plan,
                out: Any = None) -> tuple[Any, Any, Any]:
        """``(y, h, rstd)``; ``h`` is None without a residual; ``y`` may be ``out``."""
        ...

    def backward(self, dy: Any, x: Any, weight: Any, bias: Any, rstd: Any, grad_residual: Any,
                 plan: Plan, out: Any = None) -> tuple[Any, Any, Any]:
        """``(dx, dweight, dbias)``, the sums over rows in the row tree's order
        (:mod:`polynorm.backends.rowtree`).  ``out``: rows of ``x``'s dtype to write
        ``dx`` into, possibly ``dy`` itself (checked by the front end); a backend may
        return a new ``dx`` instead, which the front end then copies into ``out``."""
        ...


@runtime_checkable
class GatedKernels(Protocol):
    """Optional: gated RMSNorm (:func:`polynorm.rms_norm_gated`); ``rstd`` is ``(n, groups)``."""

    def gated_forward(self, x: Any, z: Any, weight: Any, bias: Any, gplan: GatedPlan,
                      out: Any = None) -> tuple[Any, Any]:
        ...

    def gated_backward(self, dy: Any, x: Any, z: Any, weight: Any, bias: Any, rstd: Any,
                       gplan: GatedPlan) -> tuple[Any, Any, Any, Any]:
        ...


@runtime_checkable
class QuantKernels(Protocol):
    """Optional: RMSNorm with quantized output (:func:`polynorm.rms_norm_quant`);
    ``scale`` is the static scale as a one-element array, or None."""

    def quant_forward(self, x: Any, residual: Any, weight: Any, bias: Any, qplan: QuantPlan,
                      scale: Any = None) -> tuple[Any, Any, Any]:
        ...


@runtime_checkable
class SmallCalls(Protocol):
    """Optional: a cheaper entry for a plain call of fewer than ``SERIAL_MAX_ELEMENTS``
    elements (no residual, no ``out``, fp32 casting), taken by the fast path."""

    SERIAL_MAX_ELEMENTS: int

    def forward_small(self, x: Any, weight: Any, bias: Any, plan: Plan) -> tuple[Any, Any]:
        ...


@runtime_checkable
class RowRangeBackward(Protocol):
    """Optional: the backward of rows ``row0 .. row0 + n`` of ``ntot`` as a partial sum
    state of the row tree, and ``finish`` of the merged state into dweight/dbias; the
    dask backend runs it per chunk so that the sums have the bits of one call."""

    def backward_range(self, dy: Any, x: Any, weight: Any, bias: Any, rstd: Any,
                       grad_residual: Any, plan: Plan, row0: int, ntot: int) -> Any:
        ...

    def finish(self, total: Any, d: int, weight_dtype: Any, bias_dtype: Any,
               empty: Any = ...) -> tuple[Any, Any]:
        ...


@runtime_checkable
class InPlaceKernels(Protocol):
    """Optional: the fused add with ``h`` written into ``h_out`` (possibly ``residual``
    itself) and ``y`` into ``out`` (possibly ``x``, or None): ``add_rms_norm_`` and
    ``residual_out=``.  Returns ``(y, h_out, rstd)``, or None where it cannot write
    into these buffers (the front end then computes apart and copies)."""

    def forward_into(self, x: Any, residual: Any, weight: Any, bias: Any, plan: Plan, out: Any,
                     h_out: Any) -> tuple[Any, Any, Any] | None:
        ...


@runtime_checkable
class QKKernels(Protocol):
    """Optional: QK-norm (+ RoPE) of ``(T, H, D)`` heads (:func:`polynorm.qk_norm`):
    each head's row as :meth:`Backend.forward`'s, then RoPE with ``rope = (cs, neox)``
    (``cs``: ``(T, rot)`` rows ``[cos | sin]`` in the compute dtype), or None.  Writes
    into ``out`` (may be ``x`` itself: in place) where it can and returns the heads."""

    def qk_forward(self, x: Any, weight: Any, plan: Plan, rope: Any, out: Any = None) -> Any:
        ...


#: name -> module path.  Order matters only for listing.
MODULES: dict[str, str] = {
    "numba": "polynorm.backends.numba",
    "cupy": "polynorm.backends.cuda",
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


def get(name: str) -> Any:
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


@runtime_checkable
class SplitKernels(Protocol):
    """Optional: the split hidden axis (:func:`polynorm.rms_norm_stats`,
    :func:`polynorm.rms_norm_from_stats`): a shard's float64 per-row sum of squares,
    and its ``(y, rstd)`` from the whole rows' sum (fp32 casting).  Without them the
    front end runs the reference's ``split_*`` functions (the backward:
    :class:`SplitBackwardKernels`)."""

    def split_stats(self, x: Any, plan: Plan) -> Any:
        ...

    def split_forward(self, x: Any, weight: Any, bias: Any, sumsq: Any, k_total: int,
                      plan: Plan) -> tuple[Any, Any]:
        ...


@runtime_checkable
class SplitBackwardKernels(Protocol):
    """Optional: the split hidden axis's backward (:func:`polynorm.rms_norm_backward_stats`,
    :func:`polynorm.rms_norm_backward_from_stats`): a shard's float64 per-row
    ``sum(g * dy * xhat)``, and its ``(dx, dweight, dbias)`` from the whole rows' sums,
    with the reference's ``split_dot`` / ``split_backward`` arithmetic.  Without them
    the front end runs those reference functions."""

    def split_dot(self, dy: Any, x: Any, weight: Any, sumsq: Any, k_total: int,
                  plan: Plan) -> Any:
        ...

    def split_backward(self, dy: Any, x: Any, weight: Any, bias: Any, sumsq: Any, dot: Any,
                       k_total: int, plan: Plan) -> tuple[Any, Any, Any]:
        ...
