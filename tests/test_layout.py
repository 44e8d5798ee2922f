"""Layouts: any axis (tuple, non-last), any rank, any strides, out=, zero tokens, read-only input.

All results are float64 and compared with the oracle at float64 tolerance,
so a layout mistake (a wrong permutation, a slice taken in the wrong order,
a stride ignored) shows up as a gross error.
"""

from __future__ import annotations

import _oracle as oracle
import numpy as np
import pytest
from _oracle import assert_close, batch_shape

import polynorm as pn

LAYOUTS = [
    ((7,), -1),
    ((2, 3, 4), -1),
    ((2, 3, 4), 1),
    ((2, 3, 4), 0),
    ((2, 3, 4), (0, 2)),
    ((2, 3, 4), (2, 0)),  # unsorted: the slice is still taken in sorted (C) order
    ((2, 3, 4), (1, 2)),
    ((2, 3, 4), (-3, -1)),
    ((2, 3, 4, 5), (1, 3)),
    ((3, 4), (0, 1)),  # every axis: one token
]


def _norm_shape(shape, axis):
    axes = sorted(a % len(shape) for a in (axis if isinstance(axis, tuple) else (axis,)))
    return tuple(shape[a] for a in axes)


def _opt(case, a):
    return None if a is None else case.asarray(a)


@pytest.mark.parametrize("shape, axis", LAYOUTS, ids=lambda p: str(p).replace(" ", ""))
def test_axis_layouts_and_rstd_round_trip(case, shape, axis, rng):
    kw = dict(axis=axis, partial=0.5 if np.prod(_norm_shape(shape, axis)) > 1 else 1.0,
              eps=1e-3, offset=0.5)
    A = case.asarray
    x, r, dy = (rng.standard_normal(shape) for _ in range(3))
    w, b = rng.standard_normal(_norm_shape(shape, axis)), rng.standard_normal(_norm_shape(shape, axis))

    y, rstd = pn.rms_norm(A(x), A(w), A(b), return_rstd=True, backend=case.backend, **kw)
    want_y, want_rstd = oracle.forward(x, w, b, **kw)
    assert tuple(rstd.shape) == batch_shape(shape, axis)
    assert_close(case.to_numpy(y), want_y, "float64", "y")
    assert_close(case.to_numpy(rstd), want_rstd, "float64", "rstd")

    y2, h, rstd2 = pn.add_rms_norm(A(x), A(r), A(w), A(b), return_rstd=True,
                                   backend=case.backend, **kw)
    assert_close(case.to_numpy(h), x + r, "float64", "h")
    assert_close(case.to_numpy(y2), oracle.forward(x + r, w, b, **kw)[0], "float64", "add y")
    assert tuple(rstd2.shape) == batch_shape(shape, axis)

    want = oracle.backward(dy, x, w, b, **kw)
    for passed in (None, rstd):  # the forward's rstd is accepted as is
        dx, dw, db = pn.rms_norm_backward(A(dy), A(x), A(w), A(b), rstd=passed,
                                          backend=case.backend, **kw)
        tag = "rstd passed" if passed is not None else "rstd recomputed"
        assert_close(case.to_numpy(dx), want[0], "float64", f"dx ({tag})")
        assert_close(case.to_numpy(dw), want[1], "float64", f"dweight ({tag})")
        assert_close(case.to_numpy(db), want[2], "float64", f"dbias ({tag})")


def _slice(case, big_np, index):
    """``big[index]`` made in the case's library, or a skip where it cannot slice so."""
    big = case.asarray(big_np)
    try:
        return big[index]
    except (ValueError, IndexError, TypeError) as exc:  # torch: no negative steps
        pytest.skip(f"{case.name} cannot take {index}: {exc}")


STRIDES = {
    "every-other": (slice(None, None, 2), slice(1, None, 2)),
    "reversed-last": (slice(None), slice(None, None, -1)),
    "reversed-both": (slice(None, None, -1), slice(None, None, -2)),
    "offset-window": (slice(1, 4), slice(2, 9)),
}


@pytest.mark.parametrize("strides", list(STRIDES))
def test_strided_and_negatively_strided_inputs(case, strides, rng):
    index = STRIDES[strides]
    big = rng.standard_normal((6, 14))
    big_dy = rng.standard_normal((6, 14))
    want_x = big[index]
    d = want_x.shape[1]
    wbig = rng.standard_normal(2 * d)
    windex = slice(None, None, -2) if "reversed" in strides else slice(None, None, 2)
    x, dy = _slice(case, big, index), _slice(case, big_dy, index)
    w = _slice(case, wbig, windex)
    kw = dict(partial=0.5, eps=1e-3)
    y = pn.rms_norm(x, w, backend=case.backend, **kw)
    assert_close(case.to_numpy(y), oracle.forward(want_x, wbig[windex], **kw)[0], "float64", "y")
    dx, dw, _ = pn.rms_norm_backward(dy, x, w, backend=case.backend, **kw)
    want = oracle.backward(big_dy[index], want_x, wbig[windex], **kw)
    assert_close(case.to_numpy(dx), want[0], "float64", "dx")
    assert_close(case.to_numpy(dw), want[1], "float64", "dweight")
    # and the transposed view, normalized over its first axis
    xt = x.T if hasattr(x, "T") else None
    if xt is not None:
        yt = pn.rms_norm(xt, w, axis=0, backend=case.backend, **kw)
        np.testing.assert_allclose(case.to_numpy(yt), case.to_numpy(y).T, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("kind", ["broadcast", "readonly"])
def test_read_only_and_zero_stride_input(case, kind, rng):
    """numpy only: a read-only array, or a stride-0 broadcast, is a valid input."""
    if type(case.asarray(np.zeros(1))) is not np.ndarray:
        pytest.skip("numpy-specific array flags")
    row = rng.standard_normal(9)
    if kind == "broadcast":
        x = np.broadcast_to(row, (5, 9))
    else:
        x = np.tile(row, (5, 1))
        x.setflags(write=False)
    w = np.broadcast_to(np.float64(1.5), (9,))
    y = pn.rms_norm(x, w, backend=case.backend)
    assert_close(y, oracle.forward(np.array(x), np.array(w))[0], "float64", "y")
    y2, h = pn.add_rms_norm(x, x, w, backend=case.backend)
    assert_close(h, 2 * np.array(x), "float64", "h")
    dy = np.broadcast_to(rng.standard_normal(9), (5, 9))
    dx, dw, _ = pn.rms_norm_backward(dy, x, w, backend=case.backend)
    want = oracle.backward(np.array(dy), np.array(x), np.array(w))
    assert_close(dx, want[0], "float64", "dx")
    assert_close(dw, want[1], "float64", "dweight")


# ------------------------------------------------------------------ out=


def _mutable(case):
    if not case.mutable:
        pytest.skip(f"{case.name} arrays are immutable: no out=")


@pytest.mark.parametrize("axis", [-1, 0, (0, 1)], ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_out_preallocated(case, axis, dtype, rng):
    _mutable(case)
    A = case.asarray
    x, r = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    w = rng.standard_normal(_norm_shape((4, 6), axis))
    ref = case.to_numpy(pn.rms_norm(A(x, dtype), A(w, dtype), axis=axis, backend=case.backend))
    out = A(np.zeros((4, 6)), dtype)
    got = pn.rms_norm(A(x, dtype), A(w, dtype), axis=axis, out=out, backend=case.backend)
    assert got is out
    np.testing.assert_array_equal(case.to_numpy(out), ref)

    out = A(np.zeros((4, 6)), dtype)
    y, h = pn.add_rms_norm(A(x, dtype), A(r, dtype), A(w, dtype), axis=axis, out=out,
                           backend=case.backend)
    assert y is out
    ref_add = case.to_numpy(pn.rms_norm(h, A(w, dtype), axis=axis, backend=case.backend))
    np.testing.assert_array_equal(case.to_numpy(out), ref_add)


def test_out_non_contiguous(case, rng):
    """out may be a strided view; the rest of its buffer is left alone."""
    _mutable(case)
    x = rng.standard_normal((4, 6))
    buf = case.asarray(np.full((4, 12), 7.0))
    out = buf[:, ::2]
    got = pn.rms_norm(case.asarray(x), out=out, backend=case.backend)
    assert got is out
    b = case.to_numpy(buf)
    assert_close(b[:, ::2], oracle.forward(x)[0], "float64", "y in the view")
    np.testing.assert_array_equal(b[:, 1::2], 7.0)


@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_out_is_x_in_place(case, fused, rng):
    _mutable(case)
    x_np, r_np = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    w_np = rng.standard_normal(8)
    x, w = case.asarray(x_np), case.asarray(w_np)
    if fused:
        y, h = pn.add_rms_norm(x, case.asarray(r_np), w, out=x, backend=case.backend)
        assert_close(case.to_numpy(h), x_np + r_np, "float64", "h (from x before it was overwritten)")
        want = oracle.forward(x_np + r_np, w_np)[0]
    else:
        y = pn.rms_norm(x, w, out=x, backend=case.backend)
        want = oracle.forward(x_np, w_np)[0]
    assert y is x
    assert_close(case.to_numpy(x), want, "float64", "x now holds y")


@pytest.mark.parametrize("into", ["dy", "grad_residual", "separate", "strided"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_backward_out(case, into, dtype, rng):
    """``rms_norm_backward(out=...)``: dx written into ``out`` (may be exactly ``dy`` or
    ``grad_residual``, Liger's in-place), the same bits as a new dx; dweight/dbias unchanged."""
    _mutable(case)
    case.skip_unless_dtype(dtype)
    A = case.asarray
    x_np, dy_np, gr_np = (rng.standard_normal((9, 40)) for _ in range(3))
    w_np, b_np = rng.standard_normal(40), rng.standard_normal(40)
    kw = dict(partial=0.5, offset=0.5, backend=case.backend)
    x, w, b = A(x_np, dtype), A(w_np, "float32"), A(b_np, "float32")
    want = pn.rms_norm_backward(A(dy_np, dtype), x, w, b, grad_residual=A(gr_np, dtype), **kw)
    dy, gr = A(dy_np, dtype), A(gr_np, dtype)
    buf = None
    if into == "strided":
        buf = A(np.full((9, 80), 7.0), dtype)
        out = buf[:, ::2]
    else:
        out = {"dy": dy, "grad_residual": gr}.get(into, A(np.zeros((9, 40)), dtype))
    got = pn.rms_norm_backward(dy, x, w, b, grad_residual=gr, out=out, **kw)
    assert got[0] is out
    np.testing.assert_array_equal(case.to_numpy(out), case.to_numpy(want[0]))
    for g, e in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(case.to_numpy(g), case.to_numpy(e))
    if buf is not None:
        np.testing.assert_array_equal(case.to_numpy(buf)[:, 1::2].astype(np.float64), 7.0)


def test_backward_out_refused(case, rng):
    """The backward's out must have x's dtype and may overlap no input but dy/grad_residual."""
    _mutable(case)
    A = case.asarray
    x, dy, w = A(rng.standard_normal((4, 8))), A(rng.standard_normal((4, 8))), A(np.ones(8))
    with pytest.raises(TypeError, match="out must have dtype float64"):
        pn.rms_norm_backward(dy, x, w, out=A(np.zeros((4, 8)), "float32"), backend=case.backend)
    with pytest.raises(ValueError, match="out must have shape|shape"):
        pn.rms_norm_backward(dy, x, w, out=A(np.zeros((4, 9))), backend=case.backend)
    if case.module in ("numpy", "torch"):  # host memory: overlap is checked
        with pytest.raises(ValueError, match="out overlaps x"):
            pn.rms_norm_backward(dy, x, w, out=x, backend=case.backend)


# ------------------------------------------------------------------ zero tokens, types, purity


@pytest.mark.parametrize("shape, axis", [((0, 5), -1), ((2, 0, 5), -1), ((5, 0), 0),
                                         ((0, 2, 3), (1, 2))], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_zero_tokens(case, shape, axis, dtype):
    case.skip_unless_dtype(dtype)
    A = case.asarray
    nshape = _norm_shape(shape, axis)
    x, w = A(np.zeros(shape), dtype), A(np.ones(nshape), dtype)
    compute = "float64" if dtype == "float64" else "float32"
    y, rstd = pn.rms_norm(x, w, w, axis=axis, return_rstd=True, backend=case.backend)
    assert tuple(y.shape) == shape and tuple(rstd.shape) == batch_shape(shape, axis)
    assert oracle.dtype_name(case.to_numpy(y)) == dtype
    assert oracle.dtype_name(case.to_numpy(rstd)) == compute
    y, h, rstd = pn.add_rms_norm(x, x, w, axis=axis, return_rstd=True, out_dtype="float32",
                                 backend=case.backend)
    assert tuple(y.shape) == tuple(h.shape) == shape
    assert oracle.dtype_name(case.to_numpy(y)) == "float32"
    assert oracle.dtype_name(case.to_numpy(h)) == dtype
    dx, dw, db = pn.rms_norm_backward(x, x, w, w, rstd=rstd, axis=axis, backend=case.backend)
    assert tuple(dx.shape) == shape and oracle.dtype_name(case.to_numpy(dx)) == dtype
    assert oracle.dtype_name(case.to_numpy(dw)) == dtype
    np.testing.assert_array_equal(case.to_numpy(dw).astype(np.float64), np.zeros(nshape))
    if case.mutable:
        out = A(np.ones(shape), dtype)
        assert pn.rms_norm(x, out=out, axis=axis, backend=case.backend) is out


def test_results_have_the_input_type(case, rng):
    x = case.asarray(rng.standard_normal((3, 4)))
    w = case.asarray(rng.standard_normal(4))
    y, h, rstd = pn.add_rms_norm(x, x, w, w, return_rstd=True, backend=case.backend)
    dx, dw, db = pn.rms_norm_backward(x, x, w, w, backend=case.backend)
    for name, a in dict(y=y, h=h, rstd=rstd, dx=dx, dweight=dw, dbias=db).items():
        assert type(a) is type(x), f"{name} is {type(a).__name__}, not {type(x).__name__}"


def test_inputs_are_never_modified(case, rng):
    A = case.asarray
    arrays = {k: rng.standard_normal((4, 7)) for k in ("x", "residual", "dy", "grad_residual")}
    arrays["weight"], arrays["bias"] = rng.standard_normal(7), rng.standard_normal(7)
    arrays["x"][1] = 0.0  # a zero token
    arrays["x"][2, 3] = np.nan  # a NaN token
    a = {k: A(v) for k, v in arrays.items()}
    kw = dict(partial=0.5, offset=1.0, eps_mode="outside", backend=case.backend)
    _, _, rstd = pn.add_rms_norm(a["x"], a["residual"], a["weight"], a["bias"],
                                 return_rstd=True, **kw)
    pn.rms_norm(a["x"], a["weight"], a["bias"], casting="llama", **kw)
    rstd_before = case.to_numpy(rstd).copy()
    pn.rms_norm_backward(a["dy"], a["x"], a["weight"], a["bias"], rstd=rstd,
                         grad_residual=a["grad_residual"], **kw)
    for k, v in arrays.items():
        np.testing.assert_array_equal(case.to_numpy(a[k]), v, err_msg=f"{k} was modified")
    np.testing.assert_array_equal(case.to_numpy(rstd), rstd_before, err_msg="rstd was modified")
