"""Every backend module keeps the contract written in ``polynorm/backends/__init__.py``."""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest

import polynorm  # noqa: F401  (registers polynorm.backends)

registry = sys.modules["polynorm.backends"]
CAPABILITIES = (registry.Backend, registry.GatedKernels, registry.QuantKernels,
                registry.SmallCalls, registry.RowRangeBackward, registry.SplitKernels,
                registry.SplitBackwardKernels, registry.QKKernels)
CAPABILITIES += (registry.InPlaceKernels,)


def _members(proto) -> dict[str, inspect.Signature | None]:
    """The names a Protocol declares: its methods (with signatures) and annotated attributes."""
    out: dict[str, inspect.Signature | None] = {
        name: None for name in getattr(proto, "__annotations__", {})}
    for name, attr in vars(proto).items():
        if not name.startswith("_") and callable(attr):
            out[name] = inspect.signature(attr)
    return out


@pytest.mark.parametrize("name", list(registry.MODULES))
def test_backend_module_keeps_the_contract(name):
    try:
        mod = importlib.import_module(registry.MODULES[name])
    except ImportError as exc:
        pytest.skip(f"{name} is not installed here: {exc}")
    assert isinstance(mod, registry.Backend), f"{name} lacks a required name"
    assert name in registry.INSTALL_HINT
    for proto in CAPABILITIES:
        members = _members(proto)
        present = [m for m in members if hasattr(mod, m)]
        if proto is not registry.Backend and not present:
            continue  # an optional capability it does not offer
        assert len(present) == len(members), (
            f"{name} offers {proto.__name__} only in part: {sorted(present)} of {sorted(members)}")
        for member, sig in members.items():
            if sig is None:
                continue
            want = [p for p in sig.parameters if p != "self"]
            got = list(inspect.signature(getattr(mod, member)).parameters)
            assert got == want, f"{name}.{member}{got} does not match the contract's {want}"


def test_auto_order_names_registered_backends():
    from polynorm.ops import norm as _api

    assert set(_api._AUTO_ORDER) <= set(registry.MODULES)
