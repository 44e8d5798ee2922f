"""``add_rms_norm_`` (residual <- x + residual, x <- y) and ``residual_out=``.

The contract: the bits of ``add_rms_norm`` (vLLM's ``fused_add_rms_norm`` /
FlashInfer's ``fused_add_rmsnorm`` write the same two results over their
inputs), ``h`` the rounded sum written out here as a formula, no token-sized
allocation on the Numba backend, and every bad argument named before a kernel.
"""

from __future__ import annotations

import importlib

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn

BF16 = ml_dtypes.bfloat16
numba_backend = importlib.import_module("polynorm.backends.numba")


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def _inputs(rng, shape, xdt, rdt, wdt=np.float32):
    x = (2 * rng.standard_normal(shape)).astype(xdt)
    r = rng.standard_normal(shape).astype(rdt)
    w = (1 + 0.3 * rng.standard_normal(shape[-1])).astype(wdt)
    return x, r, w


@pytest.fixture
def allocations(monkeypatch):
    """The shapes the Numba backend allocates results of (its ``_empty_for``)."""
    shapes: list[tuple] = []
    real = numba_backend._empty_for

    def spy(caller):
        empty = real(caller)

        def record(shape, dtype):
            shapes.append(tuple(np.atleast_1d(shape)))
            return empty(shape, dtype)

        return record

    monkeypatch.setattr(numba_backend, "_empty_for", spy)
    return shapes


@pytest.mark.parametrize(("xdt", "rdt", "extra", "shape"), [
    (np.float32, np.float32, {}, (3, 40)),
    (np.float32, np.float32, {}, (130, 520)),  # the parallel driver
    (BF16, BF16, {}, (3, 40)),  # numba/inplace.py's driver
    pytest.param(BF16, BF16, {}, (130, 520), marks=pytest.mark.slow),  # its parallel twin
    (np.float16, np.float16, {"casting": "llama"}, (3, 40)),
    (BF16, np.float32, {"out_dtype": "bfloat16"}, (3, 40)),  # float32 residual stream
], ids=["f32", "f32-parallel", "bf16", "bf16-parallel", "f16-llama", "bf16-x-f32-residual"])
def test_inplace_has_the_bits_of_add_rms_norm(rng, allocations, xdt, rdt, extra, shape):
    x, r, w = _inputs(rng, shape, xdt, rdt)
    y, h = pn.add_rms_norm(x, r, w, eps=1e-5, **extra)
    # h is the sum rounded once to its dtype (exact in float64 for these dtypes)
    want_h = (x.astype(np.float64) + r.astype(np.float64)).astype(h.dtype)
    np.testing.assert_array_equal(_bits(h), _bits(want_h))
    xi, ri = x.copy(), r.copy()
    allocations.clear()
    got = pn.add_rms_norm_(xi, ri, w, eps=1e-5, **extra)
    assert got[0] is xi and got[1] is ri
    np.testing.assert_array_equal(_bits(xi), _bits(y))
    np.testing.assert_array_equal(_bits(ri), _bits(h))
    # no token-sized array: only the (n,) rstd
    assert all(len(s) == 1 for s in allocations), allocations


def test_residual_out_and_out_alias_the_inputs(rng):
    x, r, w = _inputs(rng, (4, 24), np.float32, np.float32)
    y, h = pn.add_rms_norm(x, r, w)
    # y over residual, h into a buffer of its own
    r2, hbuf = r.copy(), np.empty_like(r)
    y2, h2 = pn.add_rms_norm(x, r2, w, out=r2, residual_out=hbuf)
    assert y2 is r2 and h2 is hbuf
    np.testing.assert_array_equal(r2, y)
    np.testing.assert_array_equal(hbuf, h)
    # h over residual, y new
    r3 = r.copy()
    y3, h3 = pn.add_rms_norm(x, r3, w, residual_out=r3)
    assert h3 is r3
    np.testing.assert_array_equal(r3, h)
    np.testing.assert_array_equal(y3, y)


def test_inplace_strided_and_convention_copies_keep_the_bits(rng):
    x, r, w = _inputs(rng, (5, 64), np.float32, np.float32)
    # non-contiguous x and residual: computed apart, copied back
    bx, br = np.zeros((5, 128), np.float32), np.zeros((5, 128), np.float32)
    bx[:, ::2], br[:, ::2] = x, r
    y, h = pn.add_rms_norm(x, r, w)
    pn.add_rms_norm_(bx[:, ::2], br[:, ::2], w)
    np.testing.assert_array_equal(bx[:, ::2], y)
    np.testing.assert_array_equal(br[:, ::2], h)
    assert not bx[:, 1::2].any() and not br[:, 1::2].any()
    # vLLM's norm_input="sum" (the add apart) in place
    ys, hs = pn.add_rms_norm(x, r, w, norm_input="sum")
    xi, ri = x.copy(), r.copy()
    pn.add_rms_norm_(xi, ri, w, norm_input="sum")
    np.testing.assert_array_equal(xi, ys)
    np.testing.assert_array_equal(ri, hs)


def test_inplace_bad_arguments_are_named(rng):
    x, r, w = _inputs(rng, (2, 8), np.float32, np.float32)
    ro = x.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="^x is read-only"):
        pn.add_rms_norm_(ro, r.copy(), w)
    with pytest.raises(ValueError, match="^residual is read-only"):
        pn.add_rms_norm_(x.copy(), ro, w)
    both = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="x overlaps residual"):
        pn.add_rms_norm_(both[:2], both[1:])
    with pytest.raises(ValueError, match="x overlaps weight"):
        pn.add_rms_norm_(both[:2], r.copy(), both[1])
    with pytest.raises(TypeError, match="residual receives h.*bfloat16.*residual_dtype"):
        pn.add_rms_norm_(x.copy(), r.astype(BF16), w)
    with pytest.raises(TypeError, match="x receives y.*out_dtype"):
        pn.add_rms_norm_(x.copy(), r.copy(), w, out_dtype="float16")
    with pytest.raises(ValueError, match="residual must have shape"):
        pn.add_rms_norm_(x.copy(), r[:1].copy(), w)
    with pytest.raises(TypeError, match="residual must be an array"):
        pn.add_rms_norm_(x.copy(), None, w)
    with pytest.raises(TypeError, match="residual_out must have dtype float32"):
        pn.add_rms_norm(x, r, w, residual_out=np.empty((2, 8), np.float64))
    with pytest.raises(ValueError, match="residual_out overlaps x"):
        pn.add_rms_norm(x, r, w, residual_out=x)
    xo = x.copy()
    with pytest.raises(ValueError, match="residual_out overlaps out"):
        pn.add_rms_norm(x, r, w, out=xo, residual_out=xo)
    # the checks come before any write
    x0, r0 = x.copy(), r.copy()
    with pytest.raises(TypeError):
        pn.add_rms_norm_(x0, r0, w, out_dtype="float16")
    np.testing.assert_array_equal(x0, x)
    np.testing.assert_array_equal(r0, r)


def test_inplace_refuses_immutable_libraries():
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(TypeError, match="x is a jax array.*add_rms_norm.*donate_argnums"):
        pn.add_rms_norm_(jnp.ones((2, 4)), jnp.ones((2, 4)))
    da = pytest.importorskip("dask.array")
    with pytest.raises(TypeError, match="x is a dask array"):
        pn.add_rms_norm_(da.ones((2, 4)), da.ones((2, 4)))


def test_quant_residual_out(rng):
    x, r, w = _inputs(rng, (3, 32), np.float32, np.float32)
    q, s, h = pn.rms_norm_quant(x, w, residual=r)
    r2 = r.copy()
    q2, s2, h2 = pn.rms_norm_quant(x, w, residual=r2, residual_out=r2)
    assert h2 is r2
    np.testing.assert_array_equal(r2, (x.astype(np.float64) + r).astype(np.float32))
    np.testing.assert_array_equal(_bits(q2), _bits(q))
    np.testing.assert_array_equal(s2, s)
    with pytest.raises(TypeError, match="residual_out= receives h.*residual="):
        pn.rms_norm_quant(x, w, residual_out=r2)
    with pytest.raises(ValueError, match="residual_out overlaps x"):
        pn.rms_norm_quant(x, w, residual=r, residual_out=x)


def _op_args_of(**options):
    from polynorm.core.options import pack_options
    from polynorm.torch._custom_ops import _op_args

    return _op_args(pack_options("add_rms_norm_", options))


def test_torch_inplace_op_declares_and_performs_the_mutation(rng):
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    schema = str(torch.ops.polynorm.add_rms_norm_.default._schema)
    assert "Tensor(a!) x, Tensor(b!) residual" in schema and schema.endswith("-> ()")
    x, r, w = (torch.from_numpy(a) for a in _inputs(rng, (4, 32), np.float32, np.float32))
    x, r, w = x.to(torch.bfloat16), r.to(torch.bfloat16), w.to(torch.bfloat16)
    y, h = pn.add_rms_norm(x, r, w, eps=1e-6)
    xi, ri = x.clone(), r.clone()
    versions = xi._version, ri._version
    assert pt.add_rms_norm_(xi, ri, w, eps=1e-6) == (xi, ri)
    assert torch.equal(xi, y) and torch.equal(ri, h)
    # autograd's saved-tensor checks see the write, as after the op's own dispatch
    assert xi._version > versions[0] and ri._version > versions[1]
    xo, ro = x.clone(), r.clone()
    torch.ops.polynorm.add_rms_norm_(xo, ro, w, None, *_op_args_of(eps=1e-6))
    assert torch.equal(xo, y) and torch.equal(ro, h)
    with pytest.raises(ValueError, match="x requires grad"):
        pt.add_rms_norm_(x.clone().requires_grad_(), r.clone(), w)


def test_torch_inplace_under_compile_fullgraph(rng):
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    x, r, w = (torch.from_numpy(a) for a in _inputs(rng, (4, 32), np.float32, np.float32))
    y, h = pn.add_rms_norm(x, r, w, eps=1e-6)

    def block(a, b, c):
        pt.add_rms_norm_(a, b, c, eps=1e-6)
        return a * 2

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    xc, rc = x.clone(), r.clone()
    twice = compiled(xc, rc, w)
    # functionalization must write the mutation back to the caller's tensors
    assert torch.equal(xc, y) and torch.equal(rc, h) and torch.equal(twice, y * 2)


@pytest.mark.parametrize("kw", [{"group_size": 4}, {"casting": "none"}])
def test_in_place_add_keeps_groups_and_casting_none(kw):
    # add_rms_norm_ with the options that the in-place kernel does not carry: the same
    # bits as add_rms_norm (written apart, then copied in)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    r = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    y, h = pn.add_rms_norm(x, r, w, **kw)
    xi, ri = x.copy(), r.copy()
    pn.add_rms_norm_(xi, ri, w, **kw)
    np.testing.assert_array_equal(xi, y)
    np.testing.assert_array_equal(ri, h)
