"""The error matrix: one test per error of the spec's Errors section.

Each asserts the exception type and that the message names the argument,
what was given and what is allowed.  The autouse fixture replaces every
backend's ``forward``/``backward`` with a function that fails the test, so
each error is proven to be raised in the front end, before any kernel runs.
"""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest

import polynorm as pn

backends_pkg = importlib.import_module("polynorm.backends")  # pn.backends is the function


class KernelRan(AssertionError):
    """A backend was called although the arguments were invalid."""


@pytest.fixture(autouse=True)
def _no_kernel(monkeypatch):
    pn.backends()  # import every backend module that can be imported

    def boom(*args, **kwargs):
        raise KernelRan("a backend ran before the bad argument was reported")

    for mod in backends_pkg._loaded.values():
        if mod is not None:
            for entry in ("forward", "forward_small", "forward_decode", "backward",
                          "eager_numpy", "eager_torch"):
                if hasattr(mod, entry):
                    monkeypatch.setattr(mod, entry, boom)


def _x(case, shape=(3, 4), dtype="float32"):
    return case.asarray(np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 1.0, dtype)


def _raises(exc, *fragments):
    """``pytest.raises`` that also checks every fragment occurs in the message."""
    pattern = "".join(f"(?=.*{re.escape(str(f))})" for f in fragments)
    return pytest.raises(exc, match=re.compile(pattern, re.S))


def test_the_guard_works(case):
    """Sanity: a valid call does reach the (patched) backend."""
    with pytest.raises(KernelRan):
        pn.rms_norm(_x(case), backend=case.backend)


# ------------------------------------------------------------------ shapes


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_weight_bias_wrong_shape(case, which):
    kw = {which: _x(case, (5,))}
    with _raises(ValueError, which, "(4,)", "(5,)"):
        pn.rms_norm(_x(case), backend=case.backend, **kw)
    with _raises(ValueError, which, "(4,)", "(5,)"):
        pn.rms_norm_backward(_x(case), _x(case), backend=case.backend, **kw)


def test_weight_wrong_shape_for_tuple_axis(case):
    """Over several axes weight has their shape, not the flattened one."""
    with _raises(ValueError, "weight", "(3, 4)", "(12,)"):
        pn.rms_norm(_x(case, (2, 3, 4)), _x(case, (12,)), axis=(1, 2), backend=case.backend)


@pytest.mark.parametrize("which", ["residual", "dy", "grad_residual"])
def test_same_shape_as_x(case, which):
    bad = _x(case, (3, 5))
    if which == "residual":
        call = lambda: pn.add_rms_norm(_x(case), bad, backend=case.backend)  # noqa: E731
    elif which == "dy":
        call = lambda: pn.rms_norm_backward(bad, _x(case), backend=case.backend)  # noqa: E731
    else:
        call = lambda: pn.rms_norm_backward(  # noqa: E731
            _x(case), _x(case), grad_residual=bad, backend=case.backend
        )
    with _raises(ValueError, which, "(3, 4)", "(3, 5)"):
        call()


def test_zero_size_normalized_axes(case):
    with _raises(ValueError, "axis", "size 0", "at least one"):
        pn.rms_norm(_x(case, (3, 0)), backend=case.backend)
    with _raises(ValueError, "axis", "size 0"):
        pn.rms_norm(_x(case, (3, 0, 2)), axis=(1, 2), backend=case.backend)


# ------------------------------------------------------------------ axis


@pytest.mark.parametrize("axis", [2, -3, (0, 5)], ids=str)
def test_axis_out_of_range(case, axis):
    bad = axis if isinstance(axis, int) else 5
    with _raises(ValueError, "axis", str(bad), "out of range", "2 dimensions", "-2 .. 1"):
        pn.rms_norm(_x(case), axis=axis, backend=case.backend)


@pytest.mark.parametrize("axis", [(1, 1), (1, -1)], ids=str)
def test_axis_repeated(case, axis):
    with _raises(ValueError, "axis", "repeat", str(axis)):
        pn.rms_norm(_x(case), axis=axis, backend=case.backend)


@pytest.mark.parametrize("axis", [1.0, "0", [0, 1], None, (), True, (0, False)], ids=repr)
def test_axis_not_ints(case, axis):
    exc = ValueError if axis == () else TypeError
    with _raises(exc, "axis", repr(axis)):
        pn.rms_norm(_x(case), axis=axis, backend=case.backend)


# ------------------------------------------------------------------ scalars


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf"), -float("inf")], ids=repr)
def test_eps_out_of_range(case, eps):
    with _raises(ValueError, "eps", repr(eps), ">= 0"):
        pn.rms_norm(_x(case), eps=eps, backend=case.backend)


@pytest.mark.parametrize("name", ["eps", "partial", "offset"])
@pytest.mark.parametrize("value", ["0.1", None, True, np.array([0.1]), 1j], ids=repr)
def test_scalar_not_a_real_number(case, name, value):
    with _raises(TypeError, name, "real number", type(value).__name__):
        pn.rms_norm(_x(case), backend=case.backend, **{name: value})


@pytest.mark.parametrize("partial", [0.0, -0.5, 1.5, float("nan")], ids=repr)
def test_partial_out_of_range(case, partial):
    with _raises(ValueError, "partial", repr(partial), "(0, 1]"):
        pn.rms_norm(_x(case), partial=partial, backend=case.backend)


def test_partial_gives_k_zero(case):
    """d = 4, partial = 0.2: floor(0.8) = 0 elements -- an error, not a division by zero."""
    with _raises(ValueError, "partial=0.2", "k = floor(4 * 0.2) = 0", "at least 1/d = 0.25"):
        pn.rms_norm(_x(case), partial=0.2, backend=case.backend)
    with _raises(ValueError, "partial=0.2", "= 0"):
        pn.rms_norm_backward(_x(case), _x(case), partial=0.2, backend=case.backend)


@pytest.mark.parametrize("size", [0, -1, 5], ids=repr)
def test_partial_size_out_of_range(case, size):
    """d = 4: partial_size must be in [1, 4]."""
    with _raises(ValueError, "partial_size", "[1, 4]", f"got {size}"):
        pn.rms_norm(_x(case), partial_size=size, backend=case.backend)
    with _raises(ValueError, "partial_size", "[1, 4]"):
        pn.rms_norm_backward(_x(case), _x(case), partial_size=size, backend=case.backend)


@pytest.mark.parametrize("size", [2.0, True, "2", np.array([2])], ids=repr)
def test_partial_size_not_an_int(case, size):
    with _raises(TypeError, "partial_size", "int"):
        pn.rms_norm(_x(case), partial_size=size, backend=case.backend)


def test_partial_and_partial_size_together(case):
    with _raises(ValueError, "partial=0.5", "partial_size=2", "one of them"):
        pn.rms_norm(_x(case), partial=0.5, partial_size=2, backend=case.backend)


@pytest.mark.parametrize("offset", [float("nan"), float("inf")], ids=repr)
def test_offset_not_finite(case, offset):
    with _raises(ValueError, "offset", repr(offset), "finite"):
        pn.rms_norm(_x(case), _x(case, (4,)), offset=offset, backend=case.backend)


@pytest.mark.parametrize("name, allowed", [("eps_mode", "'inside', 'outside'"),
                                           ("casting", "'fp32', 'llama'")])
@pytest.mark.parametrize("value", ["Inside", "fp16", ""], ids=repr)
def test_unknown_choice(case, name, allowed, value):
    with _raises(ValueError, name, repr(value), allowed):
        pn.rms_norm(_x(case), backend=case.backend, **{name: value})


@pytest.mark.parametrize("name, allowed", [("eps_mode", "'inside', 'outside'"),
                                           ("casting", "'fp32', 'llama'")])
@pytest.mark.parametrize("value", [None, 1, ["inside"]], ids=repr)
def test_choice_not_a_string(case, name, allowed, value):
    with _raises(TypeError, name, repr(value), allowed):
        pn.rms_norm(_x(case), backend=case.backend, **{name: value})


@pytest.mark.parametrize("value", ["int32", "float8", np.int64, "complex64"], ids=repr)
def test_bad_out_dtype(case, value):
    with _raises(TypeError, "out_dtype", "float32", str(value) if isinstance(value, str) else "int64"):
        pn.rms_norm(_x(case), out_dtype=value, backend=case.backend)


# ------------------------------------------------------------------ dtypes


NON_FLOAT = {"int64": np.int64, "int32": np.int32, "bool": np.bool_, "complex64": np.complex64}


@pytest.mark.parametrize("dtype", list(NON_FLOAT))
@pytest.mark.parametrize("which", ["x", "weight", "bias", "residual", "dy", "grad_residual"])
def test_non_float_dtype(case, which, dtype):
    bad_shape = (4,) if which in ("weight", "bias") else (3, 4)
    bad = case.make(np.ones(bad_shape, dtype=NON_FLOAT[dtype]))
    x = _x(case)
    with _raises(TypeError, which, "floating", dtype):
        if which == "residual":
            pn.add_rms_norm(x, bad, backend=case.backend)
        elif which in ("dy", "grad_residual"):
            args = dict(dy=x, grad_residual=None)
            args[which] = bad
            pn.rms_norm_backward(args["dy"], x, grad_residual=args["grad_residual"],
                                 backend=case.backend)
        elif which == "x":
            pn.rms_norm(bad, backend=case.backend)
        else:
            pn.rms_norm(x, backend=case.backend, **{which: bad})


def test_not_an_array(case):
    with _raises(TypeError, "x", "must be an array", "list"):
        pn.rms_norm([[1.0, 2.0]], backend=case.backend)
    with _raises(TypeError, "weight", "must be an array", "list"):
        pn.rms_norm(_x(case), [1.0, 2.0, 3.0, 4.0], backend=case.backend)
    with _raises(TypeError, "residual", "None"):
        pn.add_rms_norm(_x(case), None, backend=case.backend)


# ------------------------------------------------------------------ rstd


def test_rstd_wrong_shape(case):
    x = _x(case, (2, 3, 4))
    for bad in ((6,), (3, 2), (2, 3, 1)):
        with _raises(ValueError, "rstd", "(2, 3)", str(bad)):
            pn.rms_norm_backward(x, x, rstd=case.asarray(np.ones(bad), "float32"),
                                 backend=case.backend)


@pytest.mark.parametrize("xdt, rdt", [("float32", "float64"), ("float64", "float32"),
                                      ("float16", "float16"), ("float32", "int32")])
def test_rstd_wrong_dtype(case, xdt, rdt):
    case.skip_unless_dtype(xdt)
    x = _x(case, dtype=xdt)
    want = "float64" if xdt == "float64" else "float32"
    if rdt == "int32":
        rstd = case.make(np.ones(3, dtype=np.int32))
    else:
        case.skip_unless_dtype(rdt)
        rstd = case.asarray(np.ones(3), rdt)
    with _raises(TypeError, "rstd", rdt, *(() if rdt == "int32" else (want,))):
        pn.rms_norm_backward(x, x, rstd=rstd, backend=case.backend)


# ------------------------------------------------------------------ out= and backward-only keywords


def test_out_wrong(case):
    if not case.mutable:
        pytest.skip(f"{case.name} arrays are immutable")
    x = _x(case)
    with _raises(ValueError, "out", "(3, 4)", "(4, 3)"):
        pn.rms_norm(x, out=_x(case, (4, 3)), backend=case.backend)
    with _raises(TypeError, "out", "float32", "float64"):
        pn.rms_norm(x, out=_x(case, dtype="float64"), backend=case.backend)
    with _raises(TypeError, "out", "float64"):
        pn.rms_norm(x, out_dtype="float64", out=x, backend=case.backend)


def test_out_other_type():
    torch = pytest.importorskip("torch")
    x = np.ones((3, 4), np.float32)
    with _raises(TypeError, "torch", "numpy"):
        pn.rms_norm(x, out=torch.ones(3, 4))


@pytest.mark.parametrize("kw", [dict(out_dtype="float32"), dict(return_rstd=True)], ids=str)
def test_backward_rejects_forward_only_keywords(case, kw):
    name = next(iter(kw))
    with _raises(ValueError, name, "rms_norm_backward"):
        pn.rms_norm_backward(_x(case), _x(case), backend=case.backend, **kw)


# ------------------------------------------------------------------ backends, libraries, devices


@pytest.mark.parametrize("backend", ["foo", "Numba", "torch", ""], ids=repr)
def test_unknown_backend(case, backend):
    with _raises(ValueError, "backend", repr(backend), "'auto'", "'array_api'", "'numba'"):
        pn.rms_norm(_x(case), backend=backend)


@pytest.mark.parametrize("backend", [None, 1, ("numba",)], ids=repr)
def test_backend_not_a_string(case, backend):
    with _raises(TypeError, "backend", repr(backend)):
        pn.rms_norm(_x(case), backend=backend)


def test_unusable_backend_says_how_to_install(monkeypatch):
    """Every backend unusable here names itself and how to get it; one is simulated too."""
    x = np.ones((3, 4), np.float32)
    for name, (usable, _reason) in pn.backends().items():
        if usable:
            continue
        with _raises(ValueError, repr(name), "not usable") as info:
            pn.rms_norm(x, backend=name)
        msg = str(info.value)
        assert "pip install" in msg or "GPU" in msg or "CUDA" in msg, msg
    monkeypatch.setitem(backends_pkg._status, "numba",
                        (False, "No module named 'numba'; pip install 'polynorm[numba]'"))
    with _raises(ValueError, "'numba'", "not usable", "pip install 'polynorm[numba]'"):
        pn.rms_norm(x, backend="numba")


def test_mixed_libraries_name_both():
    torch = pytest.importorskip("torch")
    x = np.ones((3, 4), np.float32)
    with _raises(TypeError, "different libraries", "x: numpy", "weight: torch"):
        pn.rms_norm(x, torch.ones(4))
    with _raises(TypeError, "x: torch", "residual: numpy"):
        pn.add_rms_norm(torch.ones(3, 4), x)
    with _raises(TypeError, "dy: torch", "x: numpy"):
        pn.rms_norm_backward(torch.ones(3, 4), x)


def test_mixed_devices_name_both():
    xs = pytest.importorskip("array_api_strict")
    x = xs.asarray(np.ones((3, 4), np.float32))
    other = xs.Device("device1")
    w = xs.asarray(np.ones(4, np.float32), device=other)
    with _raises(ValueError, "x is on device", "weight is on device", "device1"):
        pn.rms_norm(x, w)
    r = xs.asarray(np.ones((3, 4), np.float32), device=other)
    with _raises(ValueError, "residual", "device1"):
        pn.add_rms_norm(x, r)


def test_out_dtype_missing_from_the_library():
    """array-api-strict has no bfloat16: reported up front, naming out_dtype."""
    xs = pytest.importorskip("array_api_strict")
    x = xs.asarray(np.ones((3, 4), np.float32))
    with _raises(TypeError, "out_dtype='bfloat16'", "array-api-strict"):
        pn.rms_norm(x, out_dtype="bfloat16")


# ------------------------------------------------------------------ masked arrays


@pytest.mark.parametrize("which", ["x", "residual", "weight", "bias", "dy", "grad_residual",
                                   "rstd", "out"])
def test_masked_arrays_are_refused_by_name(which):
    """numpy.ma is a subclass of ndarray: without a check its mask would be ignored."""
    x = np.arange(1.0, 13.0, dtype=np.float32).reshape(3, 4)
    shapes = {"weight": (4,), "bias": (4,), "rstd": (3,)}
    plain = np.ones(shapes.get(which, (3, 4)), np.float32)
    bad = np.ma.masked_array(plain, mask=np.zeros(plain.shape, bool))
    args = {which: bad}
    with _raises(TypeError, which, "masked"):
        if which in ("dy", "grad_residual", "rstd"):
            pn.rms_norm_backward(args.get("dy", x), args.get("x", x), rstd=args.get("rstd"),
                                 grad_residual=args.get("grad_residual"))
        elif which == "residual":
            pn.add_rms_norm(x, bad)
        elif which == "x":
            pn.rms_norm(bad)
        else:
            pn.rms_norm(x, **args)
