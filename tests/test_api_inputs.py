"""Valid ways of spelling an argument that the front end must accept, with the same result."""

from __future__ import annotations

import numpy as np
import pytest

import polynorm as pn


def _x():
    return np.linspace(-2.0, 3.0, 24, dtype=np.float32).reshape(3, 8)


def _dtype_spellings():
    import ml_dtypes

    yield "float16", [np.float16, np.dtype(np.float16)]
    yield "bfloat16", [ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16)]
    yield "float32", [np.float32, np.dtype("float32")]
    yield "float64", [np.float64, np.dtype("<f8")]


@pytest.mark.parametrize(("name", "spellings"), list(_dtype_spellings()), ids=lambda v: str(v))
def test_out_dtype_as_a_scalar_type_or_dtype_object(name, spellings):
    x = _x()
    want = pn.rms_norm(x, out_dtype=name)
    for spelling in spellings:
        for backend in ("auto", "array_api"):
            got = pn.rms_norm(x, out_dtype=spelling, backend=backend)
            assert got.dtype == want.dtype, spelling
            assert np.array_equal(got.view(np.uint8), pn.rms_norm(
                x, out_dtype=name, backend=backend).view(np.uint8))


def test_out_dtype_of_other_libraries():
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(_x())
    for spelling, want in ((torch.bfloat16, torch.bfloat16), (torch.half, torch.float16),
                           (np.float16, torch.float16), ("float64", torch.float64)):
        assert pn.rms_norm(t, out_dtype=spelling).dtype == want
    jnp = pytest.importorskip("jax.numpy")
    assert pn.rms_norm(jnp.asarray(_x()), out_dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_dtype_names_are_cached_per_class_only_where_a_class_has_one_name():
    """numpy dtype names are cached by class; parametric classes (datetime units,
    strings, raw bytes, structured) name each instance on its own."""
    import ml_dtypes

    from polynorm.core.dtypes import dtype_name

    cases = ["float32", ">f4", "float16", "float64", ml_dtypes.bfloat16, "int8",
             "M8[s]", "M8[ms]", "U3", "U5", "V2", "V10", [("a", "f4")]]
    for _ in range(2):  # the second round reads the cache
        assert [dtype_name(np.dtype(c)) for c in cases] == [
            "float32", "float32", "float16", "float64", "bfloat16", "int8",
            "datetime64[s]", "datetime64[ms]", "str96", "str160", "void16", "void80", "void32"]
    with pytest.raises(TypeError, match="weight must have a floating dtype.*datetime64\\[ms\\]"):
        pn.rms_norm(np.ones((2, 4), np.float32), np.ones(4, "M8[ms]"))
