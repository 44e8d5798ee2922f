"""RMSNorm with quantized output: an independent quantizer (float64 division,
the issue's clip, ``ml_dtypes``' cast / ``np.rint``), the float64 oracle of
``y``, every scale mode, saturation, NaN, zero rows, the fused residual,
batch invariance, the errors and the torch/jax/dask front ends.

``q`` is checked bit for bit against :func:`oracle_quantize` applied to the
same backend's ``rms_norm(..., out_dtype="float32")``: the quantization is
exact given ``y``.  ``y`` itself is checked against the extended-precision
oracle of ``tests/_oracle.py`` through the dequantized ``q * scale``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _oracle import LD

import polynorm as pn

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
QMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
QNP = {"float8_e4m3fn": FP8, "float8_e5m2": E5M2, "int8": np.dtype(np.int8)}
BACKENDS = ["array_api", "numba"]
EPS = 1e-5


def oracle_quantize(y32, qdtype, scale=None, group_size=None, reciprocal=False):
    """``(q, scales)`` of float32 rows ``y32`` (n, d), written from the docstring's rule."""
    y = np.asarray(y32, np.float32)
    n, d = y.shape
    if scale is not None:
        s = np.full((n, 1), np.float32(scale), np.float32)
        gs = d
    else:
        gs = d if group_size is None else group_size
        with np.errstate(invalid="ignore"):
            amax = np.abs(y.reshape(n, d // gs, gs).astype(np.float64)).max(axis=2)
            s = (amax / QMAX[qdtype]).astype(np.float32)  # float64 quotient, rounded once
        s = np.where(s < np.float32(2.0**-126), np.float32(1.0), s).astype(np.float32)
    srep = np.repeat(s.astype(np.float64), gs, axis=1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if reciprocal:  # y * float32(1 / s), each a float32 operation
            inv = (1.0 / srep).astype(np.float32).astype(np.float64)
            v = (y.astype(np.float64) * inv).astype(np.float32)
        else:
            v = (y.astype(np.float64) / srep).astype(np.float32)  # float32 division, correctly rounded
    if qdtype != "int8":
        top = QMAX[qdtype]
        q = np.clip(v, -top, top).astype(QNP[qdtype])  # ml_dtypes: 1000 -> NaN without the clip
    else:
        v = np.where(np.isnan(v), np.float32(0), v)
        q = np.rint(np.clip(v, -128.0, 127.0)).astype(np.int8)
    return q, (np.float32(scale) if scale is not None else
               (s[:, 0] if group_size is None else s))


def qbits(q):
    """``q`` as int16 codes, with every float8 NaN (e4m3fn 0x7F, 0xFF; e5m2 0x7D-0x7F
    and 0xFD-0xFF) as one code."""
    a = np.asarray(q)
    if a.dtype == FP8:
        u = a.view(np.uint8).astype(np.int16)
        return np.where((u & 0x7F) == 0x7F, 0x7F, u)
    if a.dtype == E5M2:
        u = a.view(np.uint8).astype(np.int16)
        return np.where((u & 0x7F) > 0x7C, 0x7F, u)
    return a.astype(np.int16)


def assert_q_equal(got, want, what=""):
    g, w = np.asarray(got), np.asarray(want)
    assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
    np.testing.assert_array_equal(qbits(g), qbits(w), err_msg=what)


def assert_scales_equal(got, want):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32) if np.asarray(got).ndim
                                  else np.asarray(got), np.asarray(want).view(np.uint32)
                                  if np.asarray(want).ndim else np.asarray(want))


def _data(n=5, d=64, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.1, 10, (n, 1))).astype(dtype)
    w = (1 + 0.3 * rng.standard_normal(d)).astype(np.float32)
    b = (0.1 * rng.standard_normal(d)).astype(np.float32)
    return x, w, b


MODES = [dict(scale=0.02), dict(), dict(group_size=16)]
MODE_IDS = ["static", "token", "group"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_q_is_the_quantized_float32_y(backend, qdtype, mode):
    x, w, b = _data()
    kw = dict(eps=EPS, offset=0.5, backend=backend)
    q, s = pn.rms_norm_quant(x, w, b, dtype=qdtype, **mode, **kw)
    y = pn.rms_norm(x, w, b, out_dtype="float32", **kw)
    want_q, want_s = oracle_quantize(y, qdtype, **mode)
    assert_q_equal(q, want_q, "q")
    assert s.dtype == np.float32
    assert s.shape == (() if "scale" in mode else (5,) if not mode else (5, 4))
    assert_scales_equal(s, want_s)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", ["float8_e4m3fn", "int8"])
def test_dequantized_matches_float64_oracle(backend, qdtype):
    x, w, b = _data(d=128, dtype=np.float64, seed=1)
    xl = x.astype(LD)
    y64 = (xl / np.sqrt(np.mean(xl**2, axis=1, keepdims=True) + LD(EPS)) * w.astype(LD)
           + b.astype(LD)).astype(np.float64)
    q, s = pn.rms_norm_quant(x, w, b, dtype=qdtype, group_size=64, eps=EPS, backend=backend)
    amax = np.abs(y64.reshape(5, 2, 64)).max(axis=2)
    np.testing.assert_allclose(s, amax / QMAX[qdtype], rtol=2e-7)
    deq = q.astype(np.float64) * np.repeat(s, 64, axis=1)
    # half a step of the format (e4m3: 3 fraction bits, relative; int8: half a unit) + rounding of s
    if qdtype == "int8":
        bound = 0.5 * np.repeat(s, 64, axis=1) * (1 + 1e-6) + 1e-7 * np.abs(y64)
    else:
        bound = (2.0**-4 * np.abs(y64) + 2.0**-10 * np.repeat(s, 64, axis=1)) * (1 + 1e-6)
    assert np.all(np.abs(deq - y64) <= bound)


def test_bfloat16_input_and_axis():
    x, w, _ = _data(n=6, d=32, dtype=ml_dtypes.bfloat16, seed=2)
    x3 = np.ascontiguousarray(x.reshape(2, 3, 32).transpose(0, 2, 1))  # normalized axis 1
    for backend in BACKENDS:
        q, s = pn.rms_norm_quant(x3, w, axis=1, group_size=8, backend=backend, eps=EPS)
        assert q.shape == (2, 32, 3) and s.shape == (2, 3, 4)
        y = pn.rms_norm(x3, w, axis=1, out_dtype="float32", backend=backend, eps=EPS)
        rows = np.moveaxis(y, 1, -1).reshape(6, 32)
        want_q, want_s = oracle_quantize(rows, "float8_e4m3fn", group_size=8)
        assert_q_equal(np.moveaxis(q, 1, -1).reshape(6, 32), want_q, backend)
        assert_scales_equal(s.reshape(6, 4), want_s)


# --------------------------------------------------------------------------- the encoders


def _encoder_inputs():
    """float32 values around every float8 and int8 code: the codes, their midpoints
    and one float32 ulp either side, beyond the ranges, subnormals, signed zeros, NaN."""
    parts = []
    for fmt in (FP8, E5M2):
        codes = np.arange(256, dtype=np.uint8).view(fmt).astype(np.float32)
        srt = np.unique(codes[np.isfinite(codes)])
        parts += [srt, ((srt[:-1].astype(np.float64) + srt[1:]) / 2).astype(np.float32)]
    ints = np.arange(-130, 131, dtype=np.float64)
    base = np.concatenate([*parts, (ints + 0.5).astype(np.float32),
                           ints.astype(np.float32),
                           np.array([449, 463.9, 464, 465, 479.9, 480, 1000, 1e30, 3e38, 2**-10,
                                     2**-12, 1e-40, 1e-45, -0.0, 0.0, 57344, 61439.996, 61440,
                                     65536, 2**-16, 2**-17, 3 * 2**-18], np.float32)])
    base = np.concatenate([base, -base])
    near = np.concatenate([np.nextafter(base, np.float32(np.inf)),
                           np.nextafter(base, np.float32(-np.inf))])
    rnd = np.random.default_rng(0).integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([base, near, rnd.view(np.float32),
                           np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32)])


@pytest.mark.parametrize("width", [64, 71])
def test_numba_encoders_are_the_casts(width):
    """The kernel's bit-level encoders against ml_dtypes (after the clip) and rint:
    rows of 64 go through the 32-lane block encoder only, rows of 71 put 7 of
    every 71 values through the scalar tail (bench/encoders_exhaustive.py runs
    all 2**32 float32 patterns)."""
    from polynorm.backends.numba import quant as Q

    v = _encoder_inputs()
    v = np.ascontiguousarray(v[: v.size // width * width].reshape(-1, width))
    for qdtype in ("float8_e4m3fn", "float8_e5m2", "int8"):
        q = np.empty(v.shape, np.uint8)
        sc = np.empty((1, 1), np.float32)
        Q.quantize_y_rows(0, v.shape[0], v, q, sc, np.float32(1.0), width,
                          np.float32(QMAX[qdtype]), Q.FMT[qdtype], False, True)
        want, _ = oracle_quantize(v, qdtype, scale=1.0)
        got = q.view(QNP[qdtype])
        assert_q_equal(got, want, qdtype)
        if qdtype != "int8":  # NaN keeps its sign and ml_dtypes' code (0x7f, 0x7e)
            np.testing.assert_array_equal(q[np.isnan(v)], want.view(np.uint8)[np.isnan(v)])


_SCALES = (3.0, 0.1, 2.0**-80, 2.0**100, 2.5e35, 1e-39,
           float(np.float32(7.0) / np.float32(448.0)),
           float(np.nextafter(np.float32(2.0), np.float32(0.0)) * np.float32(2.0**-40)))


@pytest.mark.parametrize("scale", _SCALES)
@pytest.mark.parametrize("reciprocal", [False, True], ids=["divide", "reciprocal"])
def test_numba_encoder_quotients_are_divisions(scale, reciprocal):
    """The block encoder's codes are those of the correctly rounded ``y / s`` for static
    scales of any size (a subnormal one, a significand of all ones among them), for
    quotients on every code, midpoint and their float32 neighbours (``y`` the float32
    nearest ``t * s`` and one ulp either side), random bit patterns and signed zeros:
    a kernel that multiplied by ``1 / s`` instead (as vLLM's static kernels do) fails it.
    With ``reciprocal`` (``scale_mode="reciprocal"``) they are those of ``y * float32(1 / s)``."""
    from polynorm.backends.numba import quant as Q

    s = np.float32(scale)
    t = _encoder_inputs()
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        y0 = (t.astype(np.float64) * np.float64(s)).astype(np.float32)
    y = np.concatenate([y0, np.nextafter(y0, np.float32(np.inf)),
                        np.nextafter(y0, np.float32(-np.inf)), t])
    y = np.ascontiguousarray(y[: y.size // 64 * 64].reshape(-1, 64))
    for qdtype in ("float8_e4m3fn", "float8_e5m2", "int8"):
        q = np.empty(y.shape, np.uint8)
        sc = np.empty((1, 1), np.float32)
        Q.quantize_y_rows(0, y.shape[0], y, q, sc, s, 64, np.float32(QMAX[qdtype]),
                          Q.FMT[qdtype], reciprocal, True)
        want, _ = oracle_quantize(y, qdtype, scale=s, reciprocal=reciprocal)
        got = q.view(QNP[qdtype])
        assert_q_equal(got, want, f"{qdtype}, scale {s!r}")
        if qdtype != "int8":  # the zeros' signs too
            np.testing.assert_array_equal(q[y == 0], want.view(np.uint8)[y == 0])


# --------------------------------------------------------------------------- special values


@pytest.mark.parametrize("backend", BACKENDS)
def test_saturation(backend):
    x = np.array([[1.0, -1.0, 0.5, -0.25]], np.float32)  # rms = 0.70..: y = x * 1.4..
    q8, _ = pn.rms_norm_quant(x, scale=1e-3, eps=0.0, backend=backend)
    np.testing.assert_array_equal(q8.astype(np.float32), [[448, -448, 448, -320]])
    qi, _ = pn.rms_norm_quant(x, dtype="int8", scale=1e-2, eps=0.0, backend=backend)
    np.testing.assert_array_equal(qi, [[127, -128, 66, -33]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", ["float8_e4m3fn", "int8"])
def test_nan_and_zero_rows(backend, qdtype):
    x, w, _ = _data(n=4, d=32, seed=3)
    x[1, 5] = np.nan
    x[2] = 0.0
    for mode in ({}, dict(group_size=8), dict(scale=0.01)):
        q, s = pn.rms_norm_quant(x, w, dtype=qdtype, eps=EPS, backend=backend, **mode)
        qb = qbits(q)
        nan_code = 0x7F if qdtype == "float8_e4m3fn" else 0
        assert np.all(qb[1] == nan_code)  # the NaN token only
        assert np.all(qb[2] == 0)  # a zero token stays zero
        ok, _ = pn.rms_norm_quant(x[[0, 3]], w, dtype=qdtype, eps=EPS, backend=backend, **mode)
        assert_q_equal(q[[0, 3]], ok, "other tokens")
        if "scale" not in mode:
            s2 = s.reshape(4, -1)
            assert np.all(np.isnan(s2[1])) and np.all(s2[2] == 1.0)
            assert np.all(s2[[0, 3]] > 0) and np.all(np.isfinite(s2[[0, 3]]))
    # eps = 0: an all-zero token is NaN (SPEC), its scale too
    q, s = pn.rms_norm_quant(x, w, dtype=qdtype, eps=0.0, backend=backend)
    assert np.all(qbits(q)[2] == (0x7F if qdtype == "float8_e4m3fn" else 0)) and np.isnan(s[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_and_subnormal_rows(backend):
    # y itself is tiny (weight 1e-38): the dynamic scale would be subnormal, so it is 1
    x, _, _ = _data(n=3, d=16, seed=4)
    w = np.full(16, 1e-38, np.float32)
    q, s = pn.rms_norm_quant(x, w, eps=EPS, backend=backend)
    np.testing.assert_array_equal(s, [1.0, 1.0, 1.0])
    assert not np.any(qbits(q) & 0x7F)
    # a float32 row of 1e-42 with eps=0: rstd overflows float32 (the kernels' wide path)
    xs = np.full((2, 16), 1e-42, np.float32)
    xs[1, ::2] = -1e-42
    q, s = pn.rms_norm_quant(xs, eps=0.0, backend=backend)
    y = pn.rms_norm(xs, eps=0.0, out_dtype="float32", backend=backend)
    want_q, want_s = oracle_quantize(y, "float8_e4m3fn")
    assert_q_equal(q, want_q)
    assert_scales_equal(s, want_s)


# --------------------------------------------------------------------------- residual, invariance


@pytest.mark.parametrize("backend", BACKENDS)
def test_residual(backend):
    x, w, b = _data(n=6, d=64, dtype=ml_dtypes.bfloat16, seed=5)
    r = np.random.default_rng(6).standard_normal((6, 64)).astype(np.float32)
    q, s, h = pn.rms_norm_quant(x, w, b, residual=r, eps=EPS, backend=backend, group_size=32)
    y_add, h_add = pn.add_rms_norm(x, r, w, b, eps=EPS, out_dtype="float32", backend=backend)
    assert h.dtype == np.float32
    np.testing.assert_array_equal(h, h_add)  # full precision, add_rms_norm's bits
    want_q, want_s = oracle_quantize(y_add, "float8_e4m3fn", group_size=32)
    assert_q_equal(q, want_q)
    assert_scales_equal(s, want_s)
    np.testing.assert_array_equal(x, _data(n=6, d=64, dtype=ml_dtypes.bfloat16, seed=5)[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_batch_invariance(backend, mode):
    x, w, b = _data(n=9, d=64, seed=7)
    q, s = pn.rms_norm_quant(x, w, b, eps=EPS, backend=backend, **mode)
    qf, sf = pn.rms_norm_quant(np.asfortranarray(x), w, b, eps=EPS, backend=backend, **mode)
    assert_q_equal(qf, q, "Fortran order")
    assert_scales_equal(sf, s)
    for i in (0, 4, 8):
        qi, si = pn.rms_norm_quant(x[i:i + 1], w, b, eps=EPS, backend=backend, **mode)
        assert_q_equal(qi[0], q[i], f"token {i}")
        if "scale" not in mode:
            assert_scales_equal(si[0], s[i])


def test_parallel_equals_serial():
    # a parallel launch (n * d above the serial threshold) against one-token calls
    from polynorm.backends import numba as nb

    n = nb.SERIAL_MAX_ELEMENTS // 256 + 3
    x, w, b = _data(n=n, d=256, seed=8)
    q, s = pn.rms_norm_quant(x, w, b, group_size=128, eps=EPS)
    for i in (0, n // 2, n - 1):
        qi, si = pn.rms_norm_quant(x[i:i + 1], w, b, group_size=128, eps=EPS)
        assert_q_equal(qi[0], q[i])
        assert_scales_equal(si[0], s[i])


def test_llama_casting():
    x, w, _ = _data(n=3, d=32, dtype=ml_dtypes.bfloat16, seed=9)
    wb = w.astype(ml_dtypes.bfloat16)
    for backend in BACKENDS:
        q, s = pn.rms_norm_quant(x, wb, casting="llama", eps=EPS, backend=backend)
        y = pn.rms_norm(x, wb, casting="llama", out_dtype="float32", eps=EPS, backend=backend)
        want_q, want_s = oracle_quantize(y, "float8_e4m3fn")
        assert_q_equal(q, want_q, backend)
        assert_scales_equal(s, want_s)


def test_options_and_zero_tokens():
    x, w, _ = _data(n=4, d=30, seed=10)
    kw = dict(eps=0.1, partial=0.5, offset=1.0, eps_mode="outside")
    for backend in BACKENDS:
        q, s = pn.rms_norm_quant(x, w, dtype="int8", group_size=10, backend=backend, **kw)
        y = pn.rms_norm(x, w, out_dtype="float32", backend=backend, **kw)
        want_q, want_s = oracle_quantize(y, "int8", group_size=10)
        assert_q_equal(q, want_q, backend)
        assert_scales_equal(s, want_s)
    q, s = pn.rms_norm_quant(np.zeros((0, 8), np.float32), group_size=4)
    assert q.shape == (0, 8) and q.dtype == FP8 and s.shape == (0, 2)
    q, s, h = pn.rms_norm_quant(np.zeros((2, 0, 8), np.float32),
                                residual=np.zeros((2, 0, 8), np.float32), dtype="int8")
    assert q.shape == h.shape == (2, 0, 8) and s.shape == (2, 0)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kw, exc, match", [
    (dict(dtype="float8_e4m3fnuz"), TypeError, "dtype"),
    (dict(scale_mode="multiply"), ValueError, "scale_mode"),
    (dict(scale_mode=None, scale=0.5), ValueError, "scale_mode"),
    (dict(dtype=np.float16), TypeError, "dtype"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale=1e39), ValueError, "scale"),
    (dict(scale=1e-50), ValueError, "scale"),
    (dict(scale="1"), TypeError, "scale"),
    (dict(scale=np.ones(2, np.float32)), ValueError, "scale"),
    (dict(scale=np.ones(1, np.int32)), TypeError, "scale"),
    (dict(scale=np.array(-1.0)), ValueError, "scale"),
    (dict(scale=np.array(True)), TypeError, "scale"),
    (dict(group_size=3), ValueError, "group_size=3"),
    (dict(group_size=0), ValueError, "group_size"),
    (dict(group_size=2.0), TypeError, "group_size"),
    (dict(group_size=4, scale=0.1), ValueError, "group_size"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(residual=np.ones((4, 4), np.float32)), ValueError, "residual"),
    (dict(backend="nope"), ValueError, "nope"),
])
def test_errors(kw, exc, match):
    x, _, _ = _data(n=4, d=8)
    with pytest.raises(exc, match=match):
        pn.rms_norm_quant(x, **kw)


def test_numpy_scalar_scales():
    """A numpy 0-d array is a static scale like the float it holds (as numpy scalars,
    one-element arrays and 0-d torch/jax arrays are), on the fast and general paths."""
    x, w, _ = _data(n=4, d=8)
    y32 = pn.rms_norm(x, w, eps=EPS, out_dtype="float32")
    want_q, want_s = oracle_quantize(y32, "float8_e4m3fn", scale=0.25)
    for sc in (np.array(0.25), np.array(0.25, np.float32), np.array(0.25, ml_dtypes.bfloat16),
               np.float16(0.25), np.ones(1, np.float32) * 0.25):
        for extra in ({}, dict(axis=(-1,))):  # the fast path, then the general one
            q, s = pn.rms_norm_quant(x, w, scale=sc, eps=EPS, **extra)
            assert_q_equal(q, want_q, f"scale={sc!r} {extra}")
            assert s.shape == () and s.dtype == np.float32
            assert_scales_equal(s, want_s)


def test_array_api_strict_has_no_float8():
    xps = pytest.importorskip("array_api_strict")
    x = xps.asarray(_data(n=2, d=8)[0])
    with pytest.raises(TypeError, match="dtype"):
        pn.rms_norm_quant(x)
    q, s = pn.rms_norm_quant(x, dtype="int8")
    want, _ = pn.rms_norm_quant(_data(n=2, d=8)[0], dtype="int8", backend="array_api")
    np.testing.assert_array_equal(np.asarray(q), want)


# --------------------------------------------------------------------------- other libraries


def test_torch_eager_and_compile():
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    x, w, b = _data(n=6, d=64, seed=11)
    r = np.random.default_rng(12).standard_normal(x.shape).astype(np.float32)
    xt, wt, bt, rt = (torch.from_numpy(a) for a in (x, w, b, r))
    want_q, want_s, want_h = pn.rms_norm_quant(x, w, b, residual=r, scale=0.01, eps=EPS)
    q, s = pn.rms_norm_quant(xt, wt, bt, group_size=32, eps=EPS)  # the functional API
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 2)

    def f(a, w_, b_, r_, sc):
        return pt.rms_norm_quant(a, w_, b_, residual=r_, scale=sc, eps=EPS)

    fc = torch.compile(f, fullgraph=True)
    for fn in (f, fc):
        q, s, h = fn(xt, wt, bt, rt, torch.tensor([0.01]))
        assert q.dtype == torch.float8_e4m3fn and s.shape == ()
        np.testing.assert_array_equal(q.view(torch.uint8).numpy(), want_q.view(np.uint8))
        np.testing.assert_array_equal(h.numpy(), want_h)
    g = torch.compile(lambda a: pt.rms_norm_quant(a, dtype=torch.int8, group_size=16),
                      fullgraph=True)
    q, s = g(xt)
    want_q, want_s = pn.rms_norm_quant(x, dtype="int8", group_size=16)
    assert q.dtype == torch.int8 and tuple(s.shape) == (6, 4)
    np.testing.assert_array_equal(q.numpy(), want_q)
    np.testing.assert_array_equal(s.numpy(), want_s)



def test_torch_vmap_equals_a_loop(monkeypatch):
    """torch.vmap runs the op's vmap rule (one call over the tokens of all slices, or one
    per slice for a batched scale), with the bits of a loop over the slices."""
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    x, w, _ = _data(n=6, d=64, seed=11)
    xs = torch.from_numpy(x).reshape(2, 3, 64)
    rs = torch.from_numpy(np.random.default_rng(3).standard_normal(xs.shape).astype(np.float32))
    wt, scales = torch.from_numpy(w), torch.tensor([0.01, 0.02])
    calls_ = (
        (lambda a: pt.rms_norm_quant(a, wt, group_size=16, eps=EPS), (xs,), (0,)),
        (lambda a, r: pt.rms_norm_quant(a, residual=r, dtype=torch.int8, scale=0.01), (xs, rs),
         (0, 0)),
        (lambda a, s: pt.rms_norm_quant(a, wt, scale=s), (xs, scales), (0, 0)),
    )
    for f, args, in_dims in calls_:
        got = torch.vmap(f, in_dims)(*args)
        per = [f(*(a[i] for a in args)) for i in range(2)]
        for g, want in zip(got, zip(*per, strict=True), strict=True):
            want = torch.stack(want)
            assert g.dtype == want.dtype and g.shape == want.shape
            assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g,
                               want.view(torch.uint8) if want.element_size() == 1 else want)
    from polynorm.ops import quant as _quant

    calls = []  # a vmap over tokens is one kernel call (torch's fallback: one per slice)
    quant = _quant.rms_norm_quant
    monkeypatch.setattr(_quant, "rms_norm_quant",
                        lambda *a, **k: calls.append(1) or quant(*a, **k))
    for f, args, in_dims in calls_[:2]:
        torch.vmap(f, in_dims)(*args)
    assert len(calls) == 2

def test_jax_jit():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import polynorm.jax as pj

    x, w, _ = _data(n=5, d=64, seed=13)
    for mode in MODES:
        want_q, want_s = pn.rms_norm_quant(x, w, eps=EPS, **mode)
        qc, sc = pj.rms_norm_quant(jnp.asarray(x), jnp.asarray(w), eps=EPS, **mode)
        assert qc.dtype == jnp.float8_e4m3fn
        assert_q_equal(np.asarray(qc), want_q, "concrete: the kernel")
        qj, sj = jax.jit(lambda a, w_, m=mode: pj.rms_norm_quant(a, w_, eps=EPS, **m))(
            jnp.asarray(x), jnp.asarray(w))
        # traced: XLA's y may differ from the kernel's by an ulp, q by one code at most
        assert qj.dtype == jnp.float8_e4m3fn and qj.shape == x.shape
        diff = np.abs(qbits(np.asarray(qj)) - qbits(want_q))
        assert diff.max() <= 1 and diff.mean() < 0.01
        np.testing.assert_allclose(np.asarray(sj), want_s, rtol=1e-6)
    qs, _ = jax.jit(lambda a, s: pj.rms_norm_quant(a, dtype="int8", scale=s))(
        jnp.asarray(x), jnp.asarray(0.02, jnp.float32))
    assert qs.dtype == jnp.int8


def test_dask():
    da = pytest.importorskip("dask.array")
    x, w, b = _data(n=7, d=32, seed=14)
    r = np.random.default_rng(15).standard_normal(x.shape).astype(np.float32)
    xd, rd = da.from_array(x, chunks=(3, 32)), da.from_array(r, chunks=(2, 32))
    for mode in MODES:
        q, s, h = pn.rms_norm_quant(xd, w, b, residual=rd, eps=EPS, **mode)
        assert isinstance(q, da.Array) and q.dtype == FP8
        want_q, want_s, want_h = pn.rms_norm_quant(x, w, b, residual=r, eps=EPS, **mode)
        assert_q_equal(q.compute(), want_q, "dask")
        assert_scales_equal(np.asarray(s.compute()), want_s)
        np.testing.assert_array_equal(h.compute(), want_h)


# --------------------------------------------------------------------------- sweep (slow)

SWEEP_DTYPES = ["float16", "bfloat16", "float32", "float64"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("xdt", SWEEP_DTYPES)
@pytest.mark.parametrize("qdtype", ["float8_e4m3fn", "int8"])
def test_sweep(backend, xdt, qdtype):
    """Every input dtype x format x scale mode x option mix, with and without a
    residual of another dtype, against the quantized ``y`` of the same backend."""
    from _oracle import NP_DTYPES

    rng = np.random.default_rng(16)
    n, d = 11, 96
    x = (rng.standard_normal((n, d)) * rng.uniform(1e-3, 1e3, (n, 1))).astype(NP_DTYPES[xdt])
    r = rng.standard_normal((n, d)).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(d)).astype(np.float32)
    b = (0.1 * rng.standard_normal(d)).astype(np.float32)
    for opts in (dict(), dict(eps_mode="outside", offset=1.0), dict(partial=0.25, eps=0.5)):
        for mode in (dict(scale=0.003), dict(scale=7.0), dict(), dict(group_size=32),
                     dict(group_size=3)):
            for res in (None, r):
                kw = dict(backend=backend, **opts)
                got = pn.rms_norm_quant(x, w, b, residual=res, dtype=qdtype, **mode, **kw)
                if res is None:
                    y = pn.rms_norm(x, w, b, out_dtype="float32", **kw)
                else:
                    y, h = pn.add_rms_norm(x, res, w, b, out_dtype="float32", **kw)
                    np.testing.assert_array_equal(got[2], h)
                want_q, want_s = oracle_quantize(y, qdtype, **mode)
                assert_q_equal(got[0], want_q, f"{opts} {mode} residual={res is not None}")
                assert_scales_equal(got[1], want_s)


def test_numpy_fast_path_equals_generic_path():
    # plain numpy calls skip the array-API front end; a forced backend takes the generic one
    x, w, b = _data(n=6, d=32, seed=17)
    x3 = x.reshape(2, 3, 32)[:, ::-1]  # batch axes, negative strides
    r = np.random.default_rng(18).standard_normal(x3.shape).astype(np.float16)
    for mode in MODES:
        fast = pn.rms_norm_quant(x3, w, b, residual=r, eps=EPS, **mode)
        generic = pn.rms_norm_quant(x3, w, b, residual=r, eps=EPS, backend="numba", **mode)
        assert_q_equal(fast[0], generic[0])
        assert fast[1].shape == generic[1].shape
        assert_scales_equal(fast[1], generic[1])
        np.testing.assert_array_equal(fast[2], generic[2])
    swapped = x.astype(x.dtype.newbyteorder(">"))  # non-native order: converted, not misread
    assert_q_equal(pn.rms_norm_quant(swapped, w)[0], pn.rms_norm_quant(x, w)[0])
