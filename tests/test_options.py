"""The keyword options: one :class:`~polynorm.core.options.Options`, written once, reaches every
public function's signature, docstring and type (``**options: Unpack[NormOptions]``)."""

import inspect

import numpy as np
import pytest

import polynorm as pn
from polynorm.core.options import (
    OPTION_DOCS,
    NormOptions,
    Options,
    TorchOptions,
    pack_options,
    takes_options,
)


def _functions():
    """(function, the options it does not take) for every public function with options."""
    found = [(pn.rms_norm, ()), (pn.add_rms_norm, ()), (pn.rms_norm_backward, ()),
             (pn.rms_norm_gated, ()), (pn.rms_norm_gated_backward, ()),
             (pn.rms_norm_quant, ("out_dtype",))]
    try:
        import polynorm.torch as pt
    except ImportError:
        pass
    else:
        found += [(pt.rms_norm, ()), (pt.add_rms_norm, ()), (pt.rms_norm_gated, ()),
                  (pt.rms_norm_quant, ("out_dtype",))]
    try:
        import polynorm.jax as pj
    except ImportError:
        pass
    else:
        found += [(pj.rms_norm, ()), (pj.add_rms_norm, ()), (pj.rms_norm_gated, ()),
                  (pj.rms_norm_quant, ("out_dtype",))]
    return [pytest.param(f, ex, id=f"{f.__module__}.{f.__name__}") for f, ex in found]


def test_the_typed_options_are_the_options_fields():
    assert set(NormOptions.__annotations__) == set(Options._fields)
    assert set(TorchOptions.__annotations__) == set(Options._fields)
    assert set(OPTION_DOCS) == set(Options._fields)


@pytest.mark.parametrize(("func", "exclude"), _functions())
def test_signature_lists_every_option_with_its_default(func, exclude):
    params = inspect.signature(func).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    defaults = Options()._asdict()
    for name in Options._fields:
        if name in exclude:
            assert name not in params
            continue
        p = params[name]
        assert p.kind is p.KEYWORD_ONLY
        assert p.default == defaults[name], (name, p.default)


@pytest.mark.parametrize(("func", "exclude"), _functions())
def test_docstring_documents_every_option(func, exclude):
    doc = inspect.getdoc(func)
    assert "{options}" not in doc
    for name in Options._fields:
        assert (f"\n{name} :" in doc) is (name not in exclude), name


@pytest.mark.parametrize(("func", "exclude"), _functions())
def test_an_unknown_or_excluded_option_is_a_type_error_naming_the_function(func, exclude):
    required = [p for p in inspect.signature(func).parameters.values()
                if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    arrays = [np.ones((2, 4), np.float32) for _ in required]
    if func.__module__.startswith("polynorm._torch") or func.__module__ == "polynorm.torch":
        import torch

        arrays = [torch.from_numpy(a) for a in arrays]
    for bad in ("epsilon", *exclude):
        msg = rf"{func.__name__}\(\) got an unexpected keyword argument '{bad}'"
        with pytest.raises(TypeError, match=msg):
            func(*arrays, **{bad: 1.0})


def test_each_option_is_passed_down_unchanged():
    got = pack_options("f", {"eps": 0.5, "partial": 0.25, "casting": "llama", "backend": "numba"})
    assert got == Options(eps=0.5, partial=0.25, casting="llama", backend="numba")
    assert pack_options("f", {}) == Options()
    assert pack_options("f", {"eps": 0.5}, out_dtype="float32") == Options(eps=0.5, out_dtype="float32")


def test_options_by_keyword_give_the_same_bits_as_the_defaults_spelled_out():
    x = np.random.default_rng(0).standard_normal((5, 12)).astype(np.float32)
    spelled = {name: value for name, value in Options()._asdict().items()}
    np.testing.assert_array_equal(pn.rms_norm(x, **spelled), pn.rms_norm(x))
    a = pn.rms_norm(x, eps=1e-2, partial=0.5, eps_mode="outside")
    b = pn.rms_norm(x, eps_mode="outside", partial=0.5, eps=1e-2)
    np.testing.assert_array_equal(a, b)


def test_takes_options_needs_one_marker_line():
    def f(x, **options):
        """No marker."""

    with pytest.raises(AssertionError, match="needs one"):
        takes_options()(f)
