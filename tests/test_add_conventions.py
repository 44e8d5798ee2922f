"""The fused add's peer conventions (#48): ``norm_input`` and ``residual_dtype``.

Each is compared with the peer's own reference formula, written out here in
numpy (not polynorm's path):

* FlashInfer's ``fused_add_rmsnorm`` reference (tests/test_norm.py)::

      x = x.float() + residual.float(); residual = x.to(dtype)
      y = (x * rsqrt(mean(x**2) + eps) * w.float()).to(dtype)     # y from the float32 sum

  which vLLM and QuACK share: ``norm_input="sum"``.
* QuACK's ``residual_dtype`` (quack/rmsnorm.py): ``residual_out`` is the float32 sum
  cast to ``residual_dtype``; ``out`` keeps ``x``'s dtype and normalizes the sum.

Every CPU front end runs: numpy on Numba and on the array-API reference, dask,
torch (``polynorm.torch``) and jax (``polynorm.jax``).  The CUDA backend takes
these options through the same front-end path (the add apart, then its plain
kernel), which the CPU cannot run.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn

BF16 = ml_dtypes.bfloat16
EPS = 1e-6
D = 256


def _data(dtype=BF16, n=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, D)).astype(dtype)
    r = rng.standard_normal((n, D)).astype(dtype)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(dtype)
    return x, r, w


def flashinfer_ref(x, r, w, eps=EPS):
    """FlashInfer's fused_add_rmsnorm reference, in numpy float32."""
    s = x.astype(np.float32) + r.astype(np.float32)
    residual = s.astype(x.dtype)
    ms = np.mean(s * s, axis=-1, keepdims=True, dtype=np.float32)
    y = (s * (np.float32(1) / np.sqrt(ms + np.float32(eps))) * w.astype(np.float32))
    return y.astype(x.dtype), residual


def quack_ref(x, r, w, residual_dtype, eps=EPS):
    """QuACK's rmsnorm_fwd with a residual: residual_out = float32 sum to residual_dtype,
    out (x's dtype) from the float32 sum."""
    s = x.astype(np.float32) + r.astype(np.float32)
    ms = np.mean(s * s, axis=-1, keepdims=True, dtype=np.float32)
    y = s * (np.float32(1) / np.sqrt(ms + np.float32(eps))) * w.astype(np.float32)
    return y.astype(x.dtype), s.astype(residual_dtype)


def _np(a):
    if hasattr(a, "compute"):
        a = a.compute()
    if type(a).__module__.startswith("torch"):
        import torch

        if a.dtype == torch.bfloat16:
            return a.detach().view(torch.int16).numpy().view(BF16)
        return a.detach().numpy()
    return np.asarray(a)


def _run(front, x, r, w, **kw):
    """``add_rms_norm`` through one CPU front end, results as numpy."""
    if front in ("numba", "array_api"):
        out = pn.add_rms_norm(x, r, w, eps=EPS, backend=front, **kw)
    elif front == "dask":
        import dask.array as da

        out = pn.add_rms_norm(da.from_array(x, chunks=(3, D)), da.from_array(r, chunks=(3, D)),
                              w, eps=EPS, **kw)
    elif front == "torch":
        import torch

        import polynorm.torch as pt

        def t(a):
            if a.dtype == BF16:
                return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(a)

        out = pt.add_rms_norm(t(x), t(r), t(w), eps=EPS, **kw)
    else:
        import jax.numpy as jnp

        import polynorm.jax as pj

        out = pj.add_rms_norm(jnp.asarray(x), jnp.asarray(r), jnp.asarray(w), eps=EPS, **kw)
    return tuple(_np(a) for a in out)


FRONTS = ["numba", "array_api", "dask", "torch", "jax"]


@pytest.mark.parametrize("front", FRONTS)
def test_norm_input_sum_gives_flashinfers_bits(front):
    x, r, w = _data()
    ref_y, ref_h = flashinfer_ref(x, r, w)
    y, h = _run(front, x, r, w, norm_input="sum")
    assert h.dtype == BF16 and np.array_equal(h.view(np.int16), ref_h.view(np.int16))
    # FlashInfer's tolerance; the one float32 rounding of its mean (polynorm's
    # statistic is exact to float32) may move a rare value one bf16 step
    np.testing.assert_allclose(y.astype(np.float32), ref_y.astype(np.float32),
                               rtol=1e-3, atol=1e-3)
    assert np.mean(y.view(np.int16) != ref_y.view(np.int16)) < 0.01


def test_norm_input_h_default_is_the_norm_of_the_rounded_h():
    # the default (HF, Liger) differs from FlashInfer's reference here; "sum" is the fix
    x, r, w = _data()
    ref_y, _ = flashinfer_ref(x, r, w)
    y, h = pn.add_rms_norm(x, r, w, eps=EPS)
    assert not np.allclose(y.astype(np.float32), ref_y.astype(np.float32), rtol=1e-3, atol=1e-3)
    assert np.array_equal(y.view(np.int16), pn.rms_norm(h, w, eps=EPS).view(np.int16))


@pytest.mark.parametrize("front", FRONTS)
def test_residual_dtype_gives_quacks_residual_stream(front):
    x, r, w = _data()
    ref_y, ref_h = quack_ref(x, r, w, np.float32)
    y, h = _run(front, x, r, w, norm_input="sum", residual_dtype="float32")
    assert h.dtype == np.float32 and np.array_equal(h, ref_h)
    assert y.dtype == BF16  # y keeps the promoted input dtype
    np.testing.assert_allclose(y.astype(np.float32), ref_y.astype(np.float32),
                               rtol=1e-3, atol=1e-3)
    # a float32 h holds the bf16 sum exactly: the norm of h is the norm of the sum
    y_h, h2 = _run(front, x, r, w, residual_dtype="float32")
    assert np.array_equal(h2, h) and np.array_equal(y_h.view(np.int16), y.view(np.int16))


@pytest.mark.parametrize("backend", ["numba", "array_api"])
def test_residual_dtype_narrower_rounds_h_once(backend):
    x, r, w = _data(np.float32)
    y, h, rstd = pn.add_rms_norm(x, r, w, eps=EPS, residual_dtype="bfloat16",
                                 return_rstd=True, backend=backend)
    s = x + r  # float32: the compute type's sum
    assert h.dtype == BF16 and np.array_equal(h.view(np.int16), s.astype(BF16).view(np.int16))
    assert y.dtype == np.float32 and rstd.dtype == np.float32
    assert np.array_equal(y, pn.rms_norm(h, w, eps=EPS, out_dtype="float32", backend=backend))
    ys, _ = pn.add_rms_norm(x, r, w, eps=EPS, residual_dtype="bfloat16", norm_input="sum",
                            backend=backend)
    assert np.array_equal(ys, pn.rms_norm(s, w, eps=EPS, backend=backend))


@pytest.mark.parametrize("backend", ["numba", "array_api"])
def test_quant_with_residual_takes_both(backend):
    x, r, w = _data()
    q, s, h = pn.rms_norm_quant(x, w, residual=r, dtype="int8", eps=EPS, norm_input="sum",
                                residual_dtype="float32", backend=backend)
    total = x.astype(np.float32) + r.astype(np.float32)
    assert h.dtype == np.float32 and np.array_equal(h, total)
    q0, s0 = pn.rms_norm_quant(total, w, dtype="int8", eps=EPS, backend=backend)
    assert np.array_equal(q, q0) and np.array_equal(s, s0)
    # the default: the norm of the rounded h (bf16 here)
    q1, s1, h1 = pn.rms_norm_quant(x, w, residual=r, dtype="int8", eps=EPS, backend=backend)
    q2, s2 = pn.rms_norm_quant(h1, w, dtype="int8", eps=EPS, backend=backend)
    assert np.array_equal(q1, q2) and np.array_equal(s1, s2)


def test_empty_batch_has_the_option_dtypes():
    x, r, w = _data(n=0)
    y, h, rstd = pn.add_rms_norm(x, r, w, residual_dtype="float64", return_rstd=True,
                                 backend="array_api")
    assert (y.dtype, h.dtype, rstd.dtype) == (BF16, np.float64, np.float64)


def test_bad_values_name_the_argument():
    x, r, w = _data(np.float32, n=2)
    with pytest.raises(ValueError, match="norm_input"):
        pn.add_rms_norm(x, r, norm_input="rounded")
    with pytest.raises(TypeError, match="norm_input"):
        pn.add_rms_norm(x, r, norm_input=1)
    with pytest.raises(TypeError, match="residual_dtype"):
        pn.add_rms_norm(x, r, residual_dtype="int8")
    with pytest.raises(ValueError, match="norm_input='sum' with casting='llama'"):
        pn.add_rms_norm(x, r, norm_input="sum", casting="llama")
    # meaningless without a residual: residual_dtype is an error, norm_input the same bits
    with pytest.raises(ValueError, match="residual_dtype"):
        pn.rms_norm(x, residual_dtype="float32")
    with pytest.raises(ValueError, match="residual_dtype"):
        pn.rms_norm_quant(x, dtype="int8", residual_dtype="float32")
    with pytest.raises(ValueError, match="residual_dtype"):
        pn.rms_norm_gated(x, x, residual_dtype="float32")
    assert np.array_equal(pn.rms_norm(x, norm_input="sum"), pn.rms_norm(x))


def test_torch_fake_and_compile_give_h_the_residual_dtype():
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    x = torch.randn(3, 64, dtype=torch.bfloat16)
    r = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    f = torch.compile(lambda x, r, w: pt.add_rms_norm(x, r, w, norm_input="sum",
                                                      residual_dtype=torch.float32),
                      backend="eager", fullgraph=True)
    y, h = f(x, r, w)
    y0, h0 = pt.add_rms_norm(x, r, w, norm_input="sum", residual_dtype="float32")
    assert (y.dtype, h.dtype) == (torch.bfloat16, torch.float32)
    assert torch.equal(y, y0) and torch.equal(h, h0)


def test_torch_backward_fd_with_norm_input_sum():
    # the backward evaluates the norm's derivative at the h returned with the rstd the
    # forward saved (the sum's); in float64 h is the sum, so the finite differences of
    # the whole function must match
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 16, dtype=torch.float64, generator=g, requires_grad=True)
            for _ in range(2))
    w = torch.randn(16, dtype=torch.float64, generator=g, requires_grad=True)
    torch.autograd.gradcheck(
        lambda x, r, w: pt.add_rms_norm(x, r, w, eps=0.05, norm_input="sum",
                                        residual_dtype="float64"),
        (x, r, w), eps=1e-6, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["numba", "array_api"])
def test_float64_residual_dtype_sums_in_float64(backend):
    # 2**20 + 2**-10 needs 31 bits: a float32 sum would round it away
    x = np.full((2, 8), 2.0**20, BF16)
    r = np.full((2, 8), 2.0**-10, BF16)
    y, h = pn.add_rms_norm(x, r, residual_dtype="float64", backend=backend)
    assert h.dtype == np.float64 and np.all(h == 2.0**20 + 2.0**-10)
    assert y.dtype == BF16


def test_torch_and_jax_quant_take_both():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import polynorm.jax as pj
    import polynorm.torch as pt

    x, r, w = _data(n=3)
    total = x.astype(np.float32) + r.astype(np.float32)
    q0, s0 = pn.rms_norm_quant(total, dtype="int8")
    kw = {"norm_input": "sum", "residual_dtype": "float32"}
    xt, rt = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for a in (x, r))
    f = torch.compile(lambda x, r: pt.rms_norm_quant(x, residual=r, dtype=torch.int8, **kw),
                      backend="eager", fullgraph=True)
    for q, s, h in (pt.rms_norm_quant(xt, residual=rt, dtype=torch.int8, **kw), f(xt, rt)):
        assert h.dtype == torch.float32 and np.array_equal(h.numpy(), total)
        assert np.array_equal(q.numpy(), q0) and np.array_equal(s.numpy(), s0)
    g = jax.jit(lambda x, r: pj.rms_norm_quant(x, residual=r, dtype=jnp.int8, **kw))
    for q, s, h in (pj.rms_norm_quant(jnp.asarray(x), residual=jnp.asarray(r), dtype=jnp.int8,
                                      **kw), g(jnp.asarray(x), jnp.asarray(r))):
        assert h.dtype == jnp.float32 and np.array_equal(np.asarray(h), total)
        assert np.array_equal(np.asarray(q), q0) and np.array_equal(np.asarray(s), s0)
    with pytest.raises(ValueError, match="residual_dtype"):
        pt.RMSNorm(D, residual_dtype="float32")


@pytest.mark.parametrize("backend", ["numba", "array_api"])
def test_run_apart_is_batch_invariant(backend):
    x, r, w = _data(n=40, seed=3)
    kw = {"norm_input": "sum", "residual_dtype": "float16", "return_rstd": True, "backend": backend}
    y, h, rstd = pn.add_rms_norm(x, r, w, **kw)
    for i in (0, 17, 39):
        yi, hi, ri = pn.add_rms_norm(x[i:i + 1], r[i:i + 1], w, **kw)
        assert np.array_equal(yi.view(np.int16), y[i:i + 1].view(np.int16))
        assert np.array_equal(hi.view(np.int16), h[i:i + 1].view(np.int16))
        assert np.array_equal(ri, rstd[i:i + 1])
    # strided rows (every other token, a column slice of a wider array) give the same bits
    wide = np.concatenate([x, x], axis=1)[::2, :D]
    ys, _, _ = pn.add_rms_norm(wide, r[::2], w, **kw)
    assert np.array_equal(ys.view(np.int16), y[::2].view(np.int16))


@pytest.mark.parametrize("backend", ["numba", "auto"])  # general path, numpy fast path
@pytest.mark.parametrize("dtype", [BF16, np.float16])
@pytest.mark.parametrize("h_dtype", [None, "float32", "float16"])
def test_numba_one_pass_equals_the_two_pass_form(dtype, h_dtype, backend):
    # Numba's forward_apart (scratch-row sum; the fused kernel for residual_dtype alone)
    # against the add in numpy and Numba's plain norm, every option that reaches the kernel
    # (the array-API reference's statistic may differ from Numba's in rstd's last bit)
    rng = np.random.default_rng(7)
    n, d = 600, 300  # enough rows for the parallel driver
    x = (3 * rng.standard_normal((n, d))).astype(dtype)
    r = rng.standard_normal((n, d)).astype(dtype)
    w = rng.standard_normal(d).astype(np.float32)
    b = rng.standard_normal(d).astype(dtype)
    s = x.astype(np.float32) + r.astype(np.float32)
    for kw in ({}, {"partial": 0.5, "eps_mode": "outside", "offset": 1.0}):
        for norm_input in ("h", "sum"):
            y, h, rstd = pn.add_rms_norm(x, r, w, b, norm_input=norm_input, residual_dtype=h_dtype,
                                         return_rstd=True, backend=backend, **kw)
            h_ref = s.astype(h.dtype)
            y_ref, rstd_ref = pn.rms_norm(s if norm_input == "sum" else h_ref, w, b,
                                          out_dtype=y.dtype, return_rstd=True,
                                          backend="numba", **kw)
            assert np.array_equal(h.view(np.uint8), h_ref.view(np.uint8))
            assert np.array_equal(y.view(np.uint8), y_ref.view(np.uint8))
            assert np.array_equal(rstd, rstd_ref)


def test_jax_backward_fd_with_norm_input_sum():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax.test_util import check_grads

    import polynorm.jax as pj

    jax.config.update("jax_enable_x64", True)  # float64 differences (as tests/test_jax.py)
    rng = np.random.default_rng(0)
    x, r = (jnp.asarray(rng.standard_normal((3, 16))) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(16))
    check_grads(lambda x, r, w: pj.add_rms_norm(x, r, w, eps=0.05, norm_input="sum",
                                                residual_dtype="float64")[0],
                (x, r, w), order=1, modes=["rev"], eps=1e-6)
