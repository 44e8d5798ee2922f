"""Edge values and hostile layouts (issue 14): eps=0 zero tokens, byte order,
read-only / broadcast / overlapping ``out``, layout-independent bits, fork
safety, and errors raised after ``out`` may have been written.

The numba backend is reached both through the numpy fast path of the front
end (``axis=-1``, ``backend="auto"``) and through the general entry
(``backend="numba"``).
"""

from __future__ import annotations

import multiprocessing
import sys

import numpy as np
import pytest

import polynorm as pn

pytest.importorskip("numba")

PATHS = ["auto", "numba"]  # the fast path, the general path
SERIAL, PARALLEL = (5, 64), (40, 4096)  # below / above the numba serial threshold


def _bits(a) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8)


def _same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return np.array_equal(_bits(a), _bits(b))


def _data(rng, shape, dtype="float32"):
    return rng.standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------- eps=0, zero token


@pytest.mark.parametrize("backend", PATHS)
@pytest.mark.parametrize("shape", [SERIAL, PARALLEL], ids=["serial", "parallel"])
@pytest.mark.parametrize("opts", [{}, {"eps_mode": "outside"}, {"partial": 0.5}],
                         ids=["inside", "outside", "partial"])
def test_zero_token_with_eps_zero(backend, shape, opts, rng):
    n, d = shape
    x = _data(rng, shape)
    x[2] = 0.0
    w, b = _data(rng, d), _data(rng, d)
    dy, r = _data(rng, shape), _data(rng, shape)
    kw = dict(eps=0.0, backend=backend, **opts)
    y, rstd = pn.rms_norm(x, w, b, return_rstd=True, **kw)
    assert rstd[2] == np.inf and np.isnan(y[2]).any()
    # every other token as usual: the bits of the same call without the zero token
    keep = np.delete(np.arange(n), 2)
    y1, rstd1 = pn.rms_norm(x[keep], w, b, return_rstd=True, **kw)
    assert _same_bits(y[keep], y1) and _same_bits(rstd[keep], rstd1)
    # out= is written whole, and the same
    out = np.full_like(x, 7.0)
    assert pn.rms_norm(x, w, b, out=out, **kw) is out
    np.testing.assert_array_equal(out, y)  # NaN where y is NaN
    # the fused add: h - residual is zero on that token
    h_y, h, h_rstd = pn.add_rms_norm(x - r, r, w, b, return_rstd=True, **kw)
    ref = pn.add_rms_norm(x - r, r, w, b, return_rstd=True, **{**kw, "backend": "array_api"})
    for got, want in zip((h_y, h, h_rstd), ref, strict=True):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    # backward: NaN dx for that token only (also with grad_residual); dweight is
    # a sum over tokens and NaN, as in torch; dbias is not touched
    dx, dw, db = pn.rms_norm_backward(dy, x, w, b, grad_residual=r, **kw)
    assert np.isnan(dx[2]).all()
    dx1, _, _ = pn.rms_norm_backward(dy[keep], x[keep], w, b, grad_residual=r[keep], **kw)
    assert _same_bits(dx[keep], dx1)
    assert np.isnan(dw).all() and np.isfinite(db).all()
    # the reference backend agrees (NaN pattern and values)
    rdx, rdw, rdb = pn.rms_norm_backward(dy, x, w, b, grad_residual=r,
                                         **{**kw, "backend": "array_api"})
    np.testing.assert_allclose(dx, rdx, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.isnan(dw), np.isnan(rdw))
    np.testing.assert_allclose(db, rdb, rtol=1e-4, atol=1e-4)  # float32 sums in the reference
    ry = pn.rms_norm(x, w, b, **{**kw, "backend": "array_api"})
    np.testing.assert_allclose(y, ry, rtol=1e-5, atol=1e-5)


def test_zero_token_with_eps_zero_torch_module():
    torch = pytest.importorskip("torch")
    from polynorm.torch import RMSNorm

    x = torch.randn(6, 32)
    x[1] = 0.0
    ours, theirs = RMSNorm(32, eps=0.0), torch.nn.RMSNorm(32, eps=0.0)
    for m in (ours, theirs):
        with torch.no_grad():
            m.weight.copy_(torch.linspace(0.5, 1.5, 32))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    g = torch.randn(6, 32)
    ya.backward(g)
    yb.backward(g)
    for a, b in ((ya, yb), (xa.grad, xb.grad), (ours.weight.grad, theirs.weight.grad)):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.isnan(ya[1]).all() and not torch.isnan(ya[[0, 2, 3, 4, 5]]).any()
    assert torch.isnan(xa.grad[1]).all() and not torch.isnan(xa.grad[[0, 2, 3, 4, 5]]).any()


# --------------------------------------------------------------------------- Inf token


def test_inf_token_torch_module_matches_torch():
    """An Inf among a token's elements: rstd = 0 and y = x * 0 * w (NaN at the Inf only),
    as torch.nn.RMSNorm gives, through polynorm.torch's custom ops and autograd; x.grad
    is NaN on that token (SPEC's dx with rstd 0: 0 * Inf in the sum), weight.grad NaN in
    the Inf's column only, as in torch's autograd."""
    torch = pytest.importorskip("torch")
    from polynorm.torch import RMSNorm

    x = torch.randn(4, 16)
    x[1, 3] = float("inf")
    x[2, 0], x[2, 9] = -float("inf"), float("inf")
    ours, theirs = RMSNorm(16, eps=1e-6), torch.nn.RMSNorm(16, eps=1e-6)
    for m in (ours, theirs):
        with torch.no_grad():
            m.weight.copy_(torch.linspace(0.5, 1.5, 16))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    g = torch.randn(4, 16)
    ya.backward(g)
    yb.backward(g)
    for a, b in ((ya, yb), (xa.grad, xb.grad), (ours.weight.grad, theirs.weight.grad)):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-5, atol=1e-5)
    assert torch.isnan(ya[1, 3]) and (ya[1, [0, 1, 2, 4]] == 0).all()
    assert torch.isnan(xa.grad[[1, 2]]).all() and not torch.isnan(xa.grad[[0, 3]]).any()
    assert set(torch.nonzero(torch.isnan(ours.weight.grad)).flatten().tolist()) == {0, 3, 9}


def test_inf_token_jax_front():
    """The same rule through polynorm.jax: eager (the kernels), under jit (the reference
    lowered by jax), and its custom_vjp (the hand-written backward)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from polynorm.jax import rms_norm

    x = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    x[1, 2] = np.inf
    w = np.linspace(0.5, 1.5, 8).astype(np.float32)
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    want_y, want_r = pn.rms_norm(x, w, return_rstd=True, backend="array_api")
    assert want_r[1] == 0
    for y in (rms_norm(xj, wj), jax.jit(rms_norm)(xj, wj)):
        y = np.asarray(y)
        assert np.isnan(y[1, 2]) and (np.delete(y[1], 2) == 0).all()
        np.testing.assert_allclose(y, want_y, rtol=2e-6, atol=2e-6)
    dy = np.ones_like(x)
    _, vjp = jax.vjp(rms_norm, xj, wj)
    dx, dw = (np.asarray(a) for a in vjp(jnp.asarray(dy)))
    dxn, dwn, _ = pn.rms_norm_backward(dy, x, w)
    np.testing.assert_array_equal(np.isnan(dx), np.isnan(dxn))
    assert np.isnan(dx[1]).all() and np.isfinite(dx[[0, 2]]).all()
    np.testing.assert_array_equal(np.flatnonzero(np.isnan(dw)), [2])
    np.testing.assert_allclose(dw, dwn, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- byte order


@pytest.mark.parametrize("backend", PATHS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_non_native_byte_order_is_converted(backend, dtype, rng):
    swapped = np.dtype(dtype).newbyteorder("S")
    x, r, dy = (_data(rng, (6, 10), dtype) for _ in range(3))
    w = _data(rng, 10, dtype)
    sw = [a.astype(swapped) for a in (x, r, dy, w)]
    kw = dict(eps=1e-5, backend=backend)
    y, rstd = pn.rms_norm(x, w, return_rstd=True, **kw)
    ys, rstds = pn.rms_norm(sw[0], sw[3], return_rstd=True, **kw)
    assert ys.dtype.isnative and _same_bits(y, ys) and _same_bits(rstd, rstds)
    assert all(_same_bits(a, b) for a, b in zip(pn.add_rms_norm(x, r, w, **kw),
                                                pn.add_rms_norm(sw[0], sw[1], sw[3], **kw),
                                                strict=True))
    want = pn.rms_norm_backward(dy, x, w, rstd=rstd, **kw)
    got = pn.rms_norm_backward(sw[2], sw[0], sw[3], rstd=rstd.astype(rstd.dtype.newbyteorder("S")),
                               **kw)
    assert all(_same_bits(a, b) for a, b in zip(want, got, strict=True))
    # inputs untouched
    assert _same_bits(sw[0].astype(x.dtype), x)


@pytest.mark.parametrize("backend", PATHS)
def test_out_bad_memory(backend):
    x = np.ones((4, 8), np.float32)
    with pytest.raises(TypeError, match="out must have the machine's byte order"):
        pn.rms_norm(x, out=np.empty((4, 8), np.dtype(np.float32).newbyteorder("S")),
                    backend=backend)
    ro = np.zeros((4, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        pn.rms_norm(x, out=ro, backend=backend)
    with pytest.raises(ValueError, match="out is read-only"):
        pn.rms_norm(x, out=np.broadcast_to(np.zeros(8, np.float32), (4, 8)), backend=backend)
    zero_stride = np.lib.stride_tricks.as_strided(np.zeros(8, np.float32), (4, 8), (0, 4))
    with pytest.raises(ValueError, match="out's elements overlap"):
        pn.rms_norm(x, out=zero_stride, backend=backend)
    assert not zero_stride.any()


# --------------------------------------------------------------------------- overlapping out


@pytest.mark.parametrize("backend", PATHS)
@pytest.mark.parametrize("n", [8, 600], ids=["serial", "parallel"])
def test_out_overlapping_an_input_is_an_error(backend, n, rng):
    buf = _data(rng, (n + 1, 512))
    keep = buf.copy()
    with pytest.raises(ValueError, match="out overlaps x"):
        pn.rms_norm(buf[:n], out=buf[1:], backend=backend)
    with pytest.raises(ValueError, match="out overlaps x"):
        pn.rms_norm(buf[1:], out=buf[:n], backend=backend)
    res = _data(rng, (n, 512))
    with pytest.raises(ValueError, match="out overlaps residual"):
        pn.add_rms_norm(res, buf[:n], out=buf[1:], backend=backend)
    w = buf[0]
    with pytest.raises(ValueError, match="out overlaps weight"):
        pn.rms_norm(res, w, out=buf[:n], backend=backend)
    assert _same_bits(buf, keep)
    # exactly x (or residual): in place, allowed; disjoint interleaved rows too
    want = pn.rms_norm(buf[:n].copy(), backend=backend)
    assert pn.rms_norm(buf[:n], out=buf[:n], backend=backend) is not None
    assert _same_bits(buf[:n], want)
    even = buf[: n // 2 * 2]
    pn.rms_norm(even[0::2], out=even[1::2], backend=backend)
    assert _same_bits(even[1::2], pn.rms_norm(even[0::2].copy(), backend=backend))


def test_out_overlapping_torch_tensors():
    torch = pytest.importorskip("torch")
    t = torch.randn(9, 16)
    keep = t.clone()
    with pytest.raises(ValueError, match="out overlaps x"):
        pn.rms_norm(t[:8], out=t[1:])
    with pytest.raises(ValueError, match="out's elements overlap"):
        pn.rms_norm(t[:8], out=torch.zeros(16).expand(8, 16))
    assert torch.equal(t, keep)


# --------------------------------------------------------------------------- layout bits


def _layouts(base, d):
    return {
        "padded": base[:, :d],
        "negative rows": base[::-1, :d][::-1],
        "negative columns": base[:, d - 1::-1][:, ::-1],
        "fortran": np.asfortranarray(base[:, :d]),
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("n", [7, 130], ids=["serial", "parallel"])
def test_bits_do_not_depend_on_layout(dtype, n, rng):
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    d = 600
    xb, dyb = (rng.standard_normal((n, d + 9)).astype(dt) for _ in range(2))
    w = _data(rng, d)
    x0, dy0 = np.ascontiguousarray(xb[:, :d]), np.ascontiguousarray(dyb[:, :d])
    for opts in ({}, {"partial": 0.5, "eps_mode": "outside"}):
        y0, r0 = pn.rms_norm(x0, w, return_rstd=True, **opts)
        dx0, dw0, _ = pn.rms_norm_backward(dy0, x0, w, **opts)
        dys = _layouts(dyb, d)
        for name, xv in _layouts(xb, d).items():
            y, r = pn.rms_norm(xv, w, return_rstd=True, **opts)
            dx, dw, _ = pn.rms_norm_backward(dys[name], xv, w, **opts)
            for what, a, b in (("y", y0, y), ("rstd", r0, r), ("dx", dx0, dx), ("dw", dw0, dw)):
                assert _same_bits(a, b), f"{what} of {name} rows ({opts})"
    # broadcast (zero-stride) rows: every token is token 0 alone
    bx, bdy = np.broadcast_to(x0[:1], (n, d)), np.broadcast_to(dy0[:1], (n, d))
    y1, dx1 = pn.rms_norm(x0[:1], w), pn.rms_norm_backward(dy0[:1], x0[:1], w)[0]
    assert _same_bits(pn.rms_norm(bx, w), np.repeat(y1, n, axis=0))
    assert _same_bits(pn.rms_norm_backward(bdy, bx, w)[0], np.repeat(dx1, n, axis=0))


# --------------------------------------------------------------------------- failures after out


def test_kernel_failure_with_out_says_out_may_be_partly_written(monkeypatch):
    mod = sys.modules["polynorm.backends.numba"]

    def failing(x, residual, weight, bias, plan, out=None):
        if out is not None:
            mod._interop.to_numpy(out)[0] = 1.0
        raise FloatingPointError("boom")

    def failing_decode(e, x, residual, weight, bias, out):
        return failing(x, residual, weight, bias, None, out)

    monkeypatch.setattr(mod, "forward", failing)
    monkeypatch.setattr(mod, "forward_decode", failing_decode)  # the decode path's entry
    x = np.ones((4, 8), np.float32)
    for backend in PATHS:
        with pytest.raises(RuntimeError, match="out may be partly written") as info:
            pn.rms_norm(x, out=np.zeros_like(x), backend=backend)
        assert isinstance(info.value.__cause__, FloatingPointError)
    # without out, the error is the kernel's own
    with pytest.raises(FloatingPointError):
        pn.rms_norm(x, backend="numba")


# --------------------------------------------------------------------------- fork safety


def _child_call(q):
    x = np.linspace(-1, 1, PARALLEL[0] * PARALLEL[1], dtype=np.float32).reshape(PARALLEL)
    y = pn.rms_norm(x)
    dx = pn.rms_norm_backward(np.ones_like(x), x, np.ones(PARALLEL[1], np.float32))[0]
    q.put((y.tobytes(), dx.tobytes()))


@pytest.mark.skipif(not hasattr(multiprocessing, "get_all_start_methods")
                    or "fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method here")
def test_forked_child_can_call_after_a_parallel_call(forked):
    x = np.linspace(-1, 1, PARALLEL[0] * PARALLEL[1], dtype=np.float32).reshape(PARALLEL)
    y = pn.rms_norm(x)  # a parallel launch in the parent (the omp layer, if that is numba's)
    dx = pn.rms_norm_backward(np.ones_like(x), x, np.ones(PARALLEL[1], np.float32))[0]
    code, got = forked(_child_call)
    assert code == 0
    assert got == (y.tobytes(), dx.tobytes())  # the child's kernels give the same bits


class _Tokens:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        x = np.full(PARALLEL, float(i + 1), np.float32)
        return pn.rms_norm(x)[0, :4]


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method here")
def test_torch_dataloader_workers_can_call_after_a_parallel_call():
    torch = pytest.importorskip("torch")
    pn.rms_norm(np.ones(PARALLEL, np.float32))
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork")
    batches = list(loader)
    assert len(batches) == 2
    assert all(torch.allclose(b, torch.ones_like(b)) for b in batches)


def test_reference_mixed_batch_scales_only_the_rows_that_need_it():
    # the reference keeps the plain sum of squares per row and scales the rows where it
    # overflows, underflows or is non-finite: in one batch each row gets its own answer,
    # the float64 one, and the bits it gets alone
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    x[1] *= np.float32(1e25)  # squares overflow float32
    x[2] *= np.float32(1e-30)  # squares underflow
    x[3, 7] = np.inf
    x[4] = 0
    y, r = pn.rms_norm(x, eps=1e-6, backend="array_api", return_rstd=True)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        r64 = 1 / np.sqrt(np.mean(x64 * x64, axis=1) + 1e-6)
    np.testing.assert_allclose(r, r64, rtol=1e-6)
    for i in range(5):
        yi, ri = pn.rms_norm(x[i : i + 1], eps=1e-6, backend="array_api", return_rstd=True)
        assert np.array_equal(yi[0], y[i], equal_nan=True)
        assert ri[0].tobytes() == r[i].tobytes()
