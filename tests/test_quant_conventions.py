"""Quantized output's peer conventions (#48): ``scale_mode`` and ``float8_e5m2``.

The expected bits come from the peers' formulas written out below in numpy
(not from polynorm's own quantizer):

* vLLM ``csrc/layernorm_quant_kernels.cu`` (``rms_norm_static_fp8_quant``,
  ``fused_add_rms_norm_static_fp8_quant``): ``scale_inv = 1.0f / *scale``, then
  ``scaled_fp8_conversion<true>``: ``x * scale_inv`` clamped to the format's
  max, converted with saturation, nearest even;
* vLLM ``fused_layernorm_dynamic_per_token_quant.cu``: int8 takes
  ``norm_and_quant<..., true>(..., 1.0f / token_scale)`` (``float_to_int8_rn``:
  ``nearbyint`` then the clamp); fp8 divides by ``token_scale`` ("for exact
  match with FBGemm"); ``token_scale = max(amax / qmax, min_scaling_factor)``;
* FlashInfer ``include/flashinfer/norm.cuh`` (``RMSNormQuantKernel``):
  ``scale_inv = 1.0f / scale[0]``, ``y * scale_inv`` clamped to +-448 (for
  float8_e5m2 too), cast to the output format.

``y`` is each backend's own ``rms_norm(..., out_dtype="float32")``; where the
test needs particular ``y`` values (the midpoints where the two modes part),
``x`` is a row of ones with ``eps=0``: its rstd is exactly 1, so ``y`` is the
weight, bit for bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn

F32 = np.float32
FMT = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
QMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
QDTYPES = ["float8_e4m3fn", "float8_e5m2", "int8"]
BACKENDS = ["array_api", "numba"]


def _encode(v, qdtype):
    """float32 ``v`` -> the format: the clamp to its largest magnitude, then the
    saturating round-to-nearest-even conversion (``__nv_cvt_float_to_fp8(...,
    __NV_SATFINITE, ...)``; ``nearbyint`` then the clamp for int8)."""
    if qdtype == "int8":
        return np.clip(np.rint(v), -128, 127).astype(np.int8)
    top = QMAX[qdtype]
    return np.clip(v, -top, top).astype(FMT[qdtype])


def peer_reciprocal(y, s, qdtype):
    """vLLM's static fp8 and per-token int8 kernels, FlashInfer's quantized norm:
    ``q = cvt(y * float32(1.0f / s))``; ``s`` broadcasts against ``y``."""
    s = np.asarray(s, F32)
    scale_inv = (F32(1.0) / s).astype(F32)  # float32 division, correctly rounded
    return _encode((np.asarray(y, F32) * scale_inv).astype(F32), qdtype)


def peer_divide(y, s, qdtype):
    """vLLM's dynamic per-token fp8 kernel (and polynorm's default): ``q = cvt(y / s)``."""
    return _encode((np.asarray(y, F32) / np.asarray(s, F32)).astype(F32), qdtype)


def peer_token_scales(y, qdtype, group_size=None):
    """vLLM's ``compute_dynamic_per_token_scales``: ``amax / qmax`` in float32 (its
    floor ``min_scaling_factor`` does not bind for these rows: amax > 1/512)."""
    n, d = y.shape
    gs = d if group_size is None else group_size
    amax = np.abs(y.reshape(n, d // gs, gs)).max(axis=2).astype(F32)
    return (amax / F32(QMAX[qdtype])).astype(F32)


def _codes(q):
    a = np.asarray(q)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _data(n=6, d=64, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.5, 4, (n, 1))).astype(dtype)
    r = rng.standard_normal((n, d)).astype(dtype)
    w = (1 + 0.3 * rng.standard_normal(d)).astype(np.float32)
    return x, r, w


# --------------------------------------------------------------------------- against the peers


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("add", [False, True], ids=["plain", "add"])
def test_static_reciprocal_is_vllm_and_flashinfer(backend, qdtype, add):
    """Static scale, ``scale_mode="reciprocal"``: vLLM's
    ``(fused_add_)rms_norm_static_fp8_quant`` and FlashInfer's
    ``rmsnorm_quant`` / ``fused_add_rmsnorm_quant`` quantization of ``y``.
    The scale keeps |y / s| below 448, where FlashInfer's clamp to +-448 does
    not bind for float8_e5m2."""
    x, r, w = _data(seed=1)
    kw = dict(eps=1e-6, backend=backend)
    s = 0.013
    res = dict(residual=r) if add else {}
    out = pn.rms_norm_quant(x, w, scale=s, dtype=qdtype, scale_mode="reciprocal", **res, **kw)
    y = (pn.add_rms_norm(x, r, w, out_dtype="float32", **kw)[0] if add
         else pn.rms_norm(x, w, out_dtype="float32", **kw))
    assert np.abs(y).max() / s < 448
    np.testing.assert_array_equal(_codes(out[0]), _codes(peer_reciprocal(y, s, qdtype)))
    assert out[0].dtype == FMT[qdtype] and float(out[1]) == float(F32(s))


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_modes_are_vllms_dynamic_kernels(backend):
    """``rms_norm_dynamic_per_token_quant``: int8 multiplies by ``1.0f / token_scale``
    (``scale_mode="reciprocal"``), fp8 divides (the default); the scales are its."""
    x, r, w = _data(seed=2)
    kw = dict(eps=1e-6, backend=backend)
    y = pn.rms_norm(x, w, out_dtype="float32", **kw)
    q8, s8 = pn.rms_norm_quant(x, w, dtype="int8", scale_mode="reciprocal", **kw)
    want_s = peer_token_scales(y, "int8")
    np.testing.assert_array_equal(s8, want_s[:, 0])
    np.testing.assert_array_equal(q8, peer_reciprocal(y, want_s, "int8"))
    qf, sf = pn.rms_norm_quant(x, w, dtype="float8_e4m3fn", **kw)
    want_s = peer_token_scales(y, "float8_e4m3fn")
    np.testing.assert_array_equal(sf, want_s[:, 0])
    np.testing.assert_array_equal(_codes(qf), _codes(peer_divide(y, want_s, "float8_e4m3fn")))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("scale_mode", ["divide", "reciprocal"])
def test_per_group_scales_and_modes(backend, qdtype, scale_mode):
    """Per group of 16 (with the fused add): scales ``amax / qmax`` per group and
    ``q`` by the mode's formula (SPEC's: no peer fuses grouped scales with a norm)."""
    x, r, w = _data(seed=3)
    kw = dict(eps=1e-6, backend=backend)
    q, s, h = pn.rms_norm_quant(x, w, residual=r, dtype=qdtype, group_size=16,
                                scale_mode=scale_mode, **kw)
    y, h2 = pn.add_rms_norm(x, r, w, out_dtype="float32", **kw)
    want_s = peer_token_scales(y, qdtype, 16)
    np.testing.assert_array_equal(s, want_s)
    srep = np.repeat(want_s, 16, axis=1)
    f = peer_reciprocal if scale_mode == "reciprocal" else peer_divide
    np.testing.assert_array_equal(_codes(q), _codes(f(y, srep, qdtype)))
    np.testing.assert_array_equal(h, h2)


# --------------------------------------------------------------------------- the midpoints


def midpoint_cases(qdtype, s):
    """float32 ``y`` where ``y / s`` and ``y * float32(1 / s)`` encode one step apart:
    ``y`` the float32 nearest ``t * s`` for every midpoint ``t`` between two
    codes of the format, and one float32 ulp either side, kept where the two
    formulas disagree."""
    if qdtype == "int8":
        t = np.arange(-127, 127) + 0.5
    else:
        c = np.arange(256, dtype=np.uint8).view(FMT[qdtype]).astype(np.float64)
        c = np.unique(c[np.isfinite(c)])
        t = (c[:-1] + c[1:]) / 2
    y0 = (t * float(s)).astype(F32)
    y = np.concatenate([y0, np.nextafter(y0, F32(np.inf)), np.nextafter(y0, F32(-np.inf))])
    y = y[np.abs(y) < F32(s) * F32(QMAX[qdtype])]
    apart = _codes(peer_divide(y, s, qdtype)) != _codes(peer_reciprocal(y, s, qdtype))
    return y[apart]


def _midpoint_row(qdtype, s):
    """One row (as the weight): the disagreeing ``y``, and ``s * qmax`` (exact for
    these scales), so that a dynamic scale is ``s`` itself."""
    y = midpoint_cases(qdtype, s)
    top = F32(s) * F32(QMAX[qdtype])
    assert float(top) == float(s) * QMAX[qdtype]
    return np.concatenate([y, [top]]).astype(F32)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_midpoints_divide_and_reciprocal_differ(qdtype):
    """Where the two formulas part, each mode gives its own formula's bits, on every
    CPU backend, for a static scale, a per-token one and per-group ones."""
    s1, s2 = F32(0.875), F32(0.6875)  # inexact reciprocals; s * qmax exact
    r1, r2 = _midpoint_row(qdtype, s1), _midpoint_row(qdtype, s2)
    assert r1.size > 10 and r2.size > 10
    m = min(r1.size, r2.size)
    # group 0: s1's cases, group 1: s2's (each ends with its amax)
    w = np.concatenate([r1[-m:], r2[-m:]])
    x = np.ones((1, w.size), F32)
    n1 = m - 1
    for backend in BACKENDS:
        kw = dict(eps=0.0, backend=backend, dtype=qdtype)
        assert np.array_equal(pn.rms_norm(x, w, eps=0.0, backend=backend, out_dtype="float32"),
                              x * w)
        for mode, f in (("divide", peer_divide), ("reciprocal", peer_reciprocal)):
            tag = f"{backend} {mode}"
            # static and per-token: one row of s1's cases
            xs, ws = np.ones((1, r1.size), F32), r1
            q, s = pn.rms_norm_quant(xs, ws, scale=float(s1), scale_mode=mode, **kw)
            np.testing.assert_array_equal(_codes(q), _codes(f(ws[None], s1, qdtype)), tag)
            q, s = pn.rms_norm_quant(xs, ws, scale_mode=mode, **kw)
            assert s[0] == s1, tag
            np.testing.assert_array_equal(_codes(q), _codes(f(ws[None], s1, qdtype)), tag)
            # per group: two groups, two scales
            q, s = pn.rms_norm_quant(x, w, group_size=m, scale_mode=mode, **kw)
            np.testing.assert_array_equal(s, [[s1, s2]], tag)
            srep = np.repeat(np.array([[s1, s2]], F32), m, axis=1)
            np.testing.assert_array_equal(_codes(q), _codes(f(w[None], srep, qdtype)), tag)
        qd = pn.rms_norm_quant(x, w, group_size=m, **kw)[0]
        qr = pn.rms_norm_quant(x, w, group_size=m, scale_mode="reciprocal", **kw)[0]
        differ = _codes(qd)[0] != _codes(qr)[0]
        # every case differs (by one step), the amax of each group does not
        assert differ[:n1].all() and differ[m:m + n1].all()
        assert not differ[n1] and not differ[-1]


def test_midpoints_torch_jax_dask():
    """The front ends pass ``scale_mode`` and take ``float8_e5m2``: the midpoint
    row through the torch op (eager and compiled), jax (eager and jit) and dask."""
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    qdtype = "float8_e5m2"
    s1 = F32(0.875)
    w = _midpoint_row(qdtype, s1)
    x = np.ones((2, w.size), F32)
    for mode, f in (("divide", peer_divide), ("reciprocal", peer_reciprocal)):
        want = _codes(f(x * w, s1, qdtype))
        q, s = pt.rms_norm_quant(torch.from_numpy(x), torch.from_numpy(w), eps=0.0,
                                 dtype=torch.float8_e5m2, scale_mode=mode)
        assert q.dtype == torch.float8_e5m2
        np.testing.assert_array_equal(q.view(torch.uint8).numpy(), want, f"torch {mode}")
        np.testing.assert_array_equal(s.numpy(), [s1, s1])
        q, s = pt.rms_norm_quant(torch.from_numpy(x), torch.from_numpy(w), eps=0.0,
                                 dtype="float8_e5m2", scale=float(s1), scale_mode=mode)
        np.testing.assert_array_equal(q.view(torch.uint8).numpy(), want, f"torch static {mode}")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import polynorm.jax as pj
    from polynorm.backends import reference
    from polynorm.core.options import Options, make_plan, make_quant_plan

    for mode, f in (("divide", peer_divide), ("reciprocal", peer_reciprocal)):
        q, s = pj.rms_norm_quant(jnp.asarray(x), jnp.asarray(w), eps=0.0, dtype=qdtype,
                                 scale_mode=mode)
        assert q.dtype == jnp.float8_e5m2
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8),
                                      _codes(f(x * w, s1, qdtype)), f"jax {mode}")
        # under jit XLA computes y (its rstd of ones is not exactly 1: y is off by an
        # ulp) and turns amax / qmax into amax * (1 / qmax), so the quantizing step
        # jit runs (the reference's, in jax.numpy) is checked on the midpoints with
        # the scale an argument: XLA keeps y / s and y * (1 / s) as they are
        qp = make_quant_plan(make_plan(w.size, "float32", Options(out_dtype="float32")),
                             qdtype=qdtype, scale=None, scale_is_array=True, group_size=None,
                             scale_mode=mode)
        q, _ = jax.jit(lambda y, sa, qp=qp: reference.quantize(jnp, y, qp, sa))(
            jnp.asarray(x * w), jnp.asarray([s1]))
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8),
                                      _codes(f(x * w, s1, qdtype)), f"jax jit {mode}")
    da = pytest.importorskip("dask.array")
    xd = da.from_array(x, chunks=(1, w.size))
    for mode, f in (("divide", peer_divide), ("reciprocal", peer_reciprocal)):
        q, s = pn.rms_norm_quant(xd, w, eps=0.0, dtype=qdtype, scale_mode=mode)
        np.testing.assert_array_equal(_codes(q.compute()), _codes(f(x * w, s1, qdtype)),
                                      f"dask {mode}")


def test_torch_compile_scale_mode():
    """``scale_mode`` is an argument of the custom op: a compiled graph keeps it."""
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    w = _midpoint_row("float8_e4m3fn", F32(0.875))
    x = torch.ones(1, w.size)
    f = torch.compile(lambda a, b: pt.rms_norm_quant(a, b, eps=0.0, scale_mode="reciprocal"),
                      fullgraph=True)
    q = f(x, torch.from_numpy(w))[0]
    want = _codes(peer_reciprocal(w[None], F32(0.875), "float8_e4m3fn"))
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), want)


# --------------------------------------------------------------------------- float8_e5m2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [dict(scale=0.5), dict(), dict(group_size=16)],
                         ids=["static", "token", "group"])
def test_e5m2_special_values(backend, mode):
    """Saturation to +-57344 (inf too), NaN kept as ml_dtypes' 0x7e with its sign."""
    x = np.array([[1.0, -1.0, 3e4, -3e4] * 4, [np.nan] + [1.0] * 15], np.float32)
    w = np.array([1.0, 1.0, 1e30, 1e30] * 4, np.float32)
    q, s = pn.rms_norm_quant(x, w, dtype="float8_e5m2", eps=1e-6, backend=backend, **mode)
    y = pn.rms_norm(x, w, out_dtype="float32", eps=1e-6, backend=backend)
    want_s = (F32(mode["scale"]) if "scale" in mode else
              peer_token_scales(y, "float8_e5m2", mode.get("group_size")))
    if "scale" not in mode:
        np.testing.assert_array_equal(s.reshape(want_s.shape), want_s)
    srep = want_s if "scale" in mode else np.repeat(want_s, 16 // want_s.shape[1], axis=1)
    want = _codes(peer_divide(y, srep, "float8_e5m2"))
    got = _codes(q)
    np.testing.assert_array_equal(got[0], want[0])
    if "scale" in mode:  # saturated: 0x7b is 57344
        assert set(got[0][2::4] & 0x7F) == {0x7B}
    assert np.all(got[1] & 0x7F == 0x7E)  # the NaN token: every value NaN (ml_dtypes' code)
