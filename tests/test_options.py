"""The keyword options: one :class:`~polynorm.core.options.Options`, written once, reaches every
public function's signature, docstring and type (``**options: Unpack[NormOptions]``)."""

import inspect
import math

import numpy as np
import pytest

import polynorm as pn
from polynorm.core.options import (
    OPTION_DOCS,
    NormOptions,
    Options,
    TorchOptions,
    make_plan,
    pack_options,
    partial_k,
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
    if func.__module__.startswith("polynorm.torch"):
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


# --------------------------------------------------------------------------- partial = k / d


def _float_floor_below_k(dmax: int) -> list[tuple[int, int]]:
    """Every ``(d, k)``, ``d <= dmax``, where ``floor(d * fl(k / d))`` is ``k - 1``."""
    pairs = []
    for d in range(1, dmax + 1):
        k = np.arange(1, d + 1)
        pairs += [(d, int(b)) for b in k[np.floor(d * (k / d)) != k]]
    return pairs


def _k(d: int, partial: float) -> int:
    return make_plan(d, "float32", Options(partial=partial)).k


def test_partial_written_as_k_over_d_selects_k():
    """``partial=k/d`` gives ``k`` where the float product ``d * (k/d)`` is below k (every
    such pair with d <= 1024; the slow run goes to 4096), for every pair with d <= 128,
    and for random pairs of d up to 2**31."""
    below = _float_floor_below_k(1024)
    assert len(below) > 10_000 and (22, 15) in below
    assert [(d, k) for d, k in below if _k(d, k / d) != k] == []
    assert [(d, k) for d in range(1, 129) for k in range(1, d + 1) if _k(d, k / d) != k] == []
    rng = np.random.default_rng(0)
    for d in rng.integers(1025, 2**31, 300):
        d = int(d)
        for k in (1, d, *(int(v) for v in rng.integers(1, d + 1, 5))):
            assert _k(d, k / d) == k, (d, k)


def test_partial_one_ulp_off_k_over_d_keeps_the_floor():
    """Only the float nearest to k/d means k: one ulp below it gives k - 1 (the floor of
    its exact value), one ulp above gives k -- no tolerance beyond that."""
    for d in range(2, 200):
        for k in range(2, d + 1):
            below = math.nextafter(k / d, 0.0)
            assert _k(d, below) == k - 1, (d, k)
            if k < d:
                assert _k(d, math.nextafter(k / d, 1.0)) == k, (d, k)


@pytest.mark.slow
def test_partial_written_as_k_over_d_selects_k_to_4096():
    below = _float_floor_below_k(4096)
    assert [(d, k) for d, k in below if _k(d, k / d) != k] == []
    for d in range(1, 4097):  # make_plan's rule itself on every pair
        assert all(partial_k(d, k / d) == k for k in range(1, d + 1)), d


def test_partial_size_reaches_every_front_end():
    """``partial_size`` is carried whole by the Options: torch's autograd Functions and
    custom ops (schema argument ``int?``, forced as torch.compile runs them), the
    quantized op, and jax's static arguments under jit."""
    x = np.random.default_rng(1).standard_normal((3, 22)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 22).astype(np.float32)
    want = pn.rms_norm(x, w, partial_size=15)
    np.testing.assert_array_equal(pn.rms_norm(x, w, partial=15 / 22), want)
    want_dx = pn.rms_norm_backward(np.ones_like(x), x, w, partial_size=15)[0]
    want_s = pn.rms_norm_quant(x, dtype="int8", partial_size=5)[1]
    assert not np.array_equal(want_s, pn.rms_norm_quant(x, dtype="int8")[1])
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt
    from polynorm.torch import norm as torch_norm

    for eager in (True, False):
        xt = torch.from_numpy(x).requires_grad_()
        with pytest.MonkeyPatch.context() as mp:
            if not eager:
                mp.setattr(torch_norm, "_eager", lambda x: False)
            y = pt.rms_norm(xt, torch.from_numpy(w), partial_size=np.int64(15))
            y.sum().backward()
        np.testing.assert_array_equal(y.detach().numpy(), want)
        np.testing.assert_allclose(xt.grad.numpy(), want_dx, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(
        pt.rms_norm_quant(torch.from_numpy(x), dtype="int8", partial_size=5)[1].numpy(), want_s)
    jax = pytest.importorskip("jax")
    import polynorm.jax as pj

    y = jax.jit(lambda a, b: pj.rms_norm(a, b, partial_size=15))(x, w)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-6)
    s = jax.jit(lambda a: pj.rms_norm_quant(a, dtype="int8", partial_size=5))(x)[1]
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=1e-6)
