"""The array-API reference's eager path (``reference.eager_forward``, taken by
``backend="array_api"`` for plain numpy / torch CPU calls) against the reference's general
``forward``: the same bits, the same errors, the inputs untouched."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn
from polynorm.backends import reference as ref
from polynorm.core.options import Options, make_plan

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
      "float64": np.float64}

#: option sets: the default, a Gemma offset with a bias, eps outside, eps 0 with partial,
#: a float32 y from 16-bit input, a tiny eps (sqrt(eps) below float32's range)
COMBOS = [
    dict(wdt="float32"),
    dict(wdt="x", bdt="float32", offset=1.0),
    dict(wdt="float32", eps_mode="outside", eps=1e-5),
    dict(wdt="float16", partial=0.5, eps=0.0),
    dict(wdt="bfloat16", out_dtype="float32"),
    dict(eps=1e-90, offset=0.25, wdt="float32"),
]


def _rows(rng, n, d, kind):
    x = rng.standard_normal((n, d)) * 10.0 ** rng.integers(-3, 4, size=(n, 1))
    if kind == "special":
        # rows the plain sum of squares cannot serve (scaled pass), and non-finite rows
        x[0] = 1e25 * rng.standard_normal(d)
        if n > 2:
            x[1], x[2, d // 2] = 1e-30, np.inf
        if n > 4:
            x[3, 0], x[4] = np.nan, 0.0
    return x


def _bits(a):
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _np_case(rng, n, d, kind, xdt, combo):
    c = dict(combo)
    wdt, bdt = c.pop("wdt", None), c.pop("bdt", None)
    wdt = xdt if wdt == "x" else wdt
    with np.errstate(over="ignore"):
        x = _rows(rng, n, d, kind).astype(NP[xdt])
    w = None if wdt is None else (1 + 0.1 * rng.standard_normal(d)).astype(NP[wdt])
    b = None if bdt is None else (0.1 * rng.standard_normal(d)).astype(NP[bdt])
    return x, w, b, c


@pytest.mark.parametrize("kind", ["normal", "special"])
@pytest.mark.parametrize("shape", [(1, 7), (1, 300), (3, 127), (9, 64)])
def test_numpy_bits_equal_general_forward(shape, kind, monkeypatch):
    """Every dtype and option set; (9, 64) runs in blocks of 2 to 4 rows."""
    monkeypatch.setattr(ref, "EAGER_BLOCK", 128)
    rng = np.random.default_rng(sum(shape))
    for xdt in NP:
        for combo in COMBOS:
            x, w, b, c = _np_case(rng, *shape, kind, xdt, combo)
            plan = make_plan(shape[1], xdt, Options(**c))
            x0 = x.copy()
            with np.errstate(all="ignore"):
                y0, _, r0 = ref.forward(x, None, w, b, plan)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the general path's silence, kept
                y1, r1 = ref.eager_forward(x, w, b, plan)
            assert y1.dtype == y0.dtype and r1.dtype == r0.dtype
            np.testing.assert_array_equal(_bits(y1), _bits(y0), err_msg=f"{xdt} {combo}")
            np.testing.assert_array_equal(_bits(r1), _bits(r0), err_msg=f"{xdt} {combo}")
            np.testing.assert_array_equal(_bits(x), _bits(x0))


@pytest.mark.parametrize("shape", [(1, 300), (9, 64)])
def test_torch_bits_equal_general_forward(shape, monkeypatch):
    """torch's own sqrt (not the correctly rounded one) is what the per-row math uses."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(ref, "EAGER_BLOCK", 128)
    rng = np.random.default_rng(7)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "float64": torch.float64}
    for kind in ("normal", "special"):
        for xdt in NP:
            for combo in COMBOS:
                x, w, b, c = _np_case(rng, *shape, kind, "float64", combo)
                x = torch.from_numpy(x).to(tdt[xdt])
                w = None if w is None else torch.from_numpy(w.astype(np.float32)).to(
                    tdt[combo["wdt"] if combo["wdt"] != "x" else xdt])
                b = None if b is None else torch.from_numpy(b.astype(np.float32))
                plan = make_plan(shape[1], xdt, Options(**c))
                y0, _, r0 = ref.forward(x, None, w, b, plan)
                y1, r1 = ref.eager_forward(x, w, b, plan)
                assert y1.dtype == y0.dtype and r1.dtype == r0.dtype
                assert torch.equal(y1.view(torch.int16 if y1.element_size() == 2 else
                                           {4: torch.int32, 8: torch.int64}[y1.element_size()]),
                                   y0.view(torch.int16 if y0.element_size() == 2 else
                                           {4: torch.int32, 8: torch.int64}[y0.element_size()])
                                   ), (xdt, combo, kind)
                assert torch.equal(r1.view(torch.int32 if r1.element_size() == 4 else
                                           torch.int64),
                                   r0.view(torch.int32 if r0.element_size() == 4 else
                                           torch.int64)), (xdt, combo, kind)


def test_fast_path_taken_and_equal_to_strided_general_path(monkeypatch):
    """A contiguous call never reaches reference.forward; a Fortran-order copy (the general
    path) gives the same bits, also per token (batch invariance)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 48)).astype(np.float16)
    w = rng.standard_normal(48).astype(np.float32)
    yf, rf = pn.rms_norm(np.asfortranarray(x), w, return_rstd=True, backend="array_api")

    def general(*args, **kwargs):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(ref, "forward", general)
    y, r = pn.rms_norm(x, w, return_rstd=True, backend="array_api")
    np.testing.assert_array_equal(_bits(y), _bits(yf))
    np.testing.assert_array_equal(_bits(r), _bits(rf))
    y3 = pn.rms_norm(x.reshape(5, 1, 48), w, backend="array_api")
    assert y3.shape == (5, 1, 48)
    for i in range(5):
        yi, ri = pn.rms_norm(x[i], w, return_rstd=True, backend="array_api")
        assert yi.shape == (48,) and ri.shape == ()
        np.testing.assert_array_equal(_bits(yi), _bits(y[i]))
        np.testing.assert_array_equal(_bits(ri), _bits(r[i]))


@pytest.mark.parametrize("call, exc, match", [
    (lambda x, w: pn.rms_norm(x, w[:-1], backend="array_api"), ValueError, "weight"),
    (lambda x, w: pn.rms_norm(x.astype(np.int32), w, backend="array_api"), TypeError, "x must"),
    (lambda x, w: pn.rms_norm(x, w.astype(np.int8), backend="array_api"), TypeError, "weight"),
    (lambda x, w: pn.rms_norm(x, w, residual_dtype="float32", backend="array_api"),
     ValueError, "residual_dtype"),
    (lambda x, w: pn.rms_norm(x, w, eps=-1.0, backend="array_api"), ValueError, "eps"),
    (lambda x, w: pn.rms_norm(x, w, partial=0.01, backend="array_api"), ValueError, "partial"),
])
def test_errors_are_the_general_paths(call, exc, match):
    x = np.ones((2, 8), np.float32)
    with pytest.raises(exc, match=match):
        call(x, np.ones(8, np.float32))


def test_torch_weight_with_grad_records_no_history(monkeypatch):
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 16)
    w = torch.nn.Parameter(torch.randn(16))
    y = pn.rms_norm(x, w, backend="array_api")
    assert y.grad_fn is None and not y.requires_grad
    from polynorm.ops import fast_ref

    monkeypatch.setattr(fast_ref, "forward", lambda *args: None)
    assert torch.equal(y, pn.rms_norm(x, w, backend="array_api"))  # the general path


def test_float16_table_is_numpys_cast():
    h = np.arange(65536, dtype=np.uint16).view(np.float16).reshape(256, 256)
    got = ref._widen_f16(np, h)
    np.testing.assert_array_equal(_bits(got), _bits(h.astype(np.float32)))
    out = np.empty((256, 256), np.float32)
    ref._widen_f16(np, h, out)
    np.testing.assert_array_equal(_bits(out), _bits(got))


def test_torch_func_transforms_take_the_general_path():
    """torch.func's wrapped tensors have no memory for numpy to view: the general path runs
    them, as before the fast path existed."""
    torch = pytest.importorskip("torch")
    x, w = torch.randn(2, 8), torch.randn(8)
    y = torch.func.vmap(lambda a: pn.rms_norm(a, w, backend="array_api"))(x)
    torch.testing.assert_close(y, pn.rms_norm(x, w, backend="array_api"))
    # grad: the functional API records no derivative, which would be a zero gradient
    with pytest.raises(TypeError, match="differentiated by torch.func"):
        torch.func.grad(lambda a: pn.rms_norm(a, w, backend="array_api").sum())(x)
