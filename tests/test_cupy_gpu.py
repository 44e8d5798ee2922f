"""The cupy backend on a real GPU, checked against the numpy reference backend.

Skipped cleanly without cupy, without a CUDA driver or without a GPU.  The
kernels' numerics are also checked without a GPU by the emulator tests
(``pytest -k emul``); these tests add what only a device shows: the real
compiler, real alignment, streams, DLPack with torch.
"""

from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn

pytestmark = pytest.mark.gpu

if importlib.util.find_spec("cupy") is None:
    pytest.skip("cupy is not installed", allow_module_level=True)
_usable, _why = pn.backends()["cupy"]
if not _usable:
    pytest.skip(f"cupy backend unusable: {_why}", allow_module_level=True)

import cupy  # noqa: E402

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-13}


def _close(got, want, dtype, scale=1.0):
    """Elementwise within rtol, plus an atol relative to the largest expected magnitude."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    tol = TOL[dtype] * scale
    fin = np.isfinite(want)
    big = float(np.max(np.abs(want[fin]))) if fin.any() else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * (big or 1.0))


def _ref(fn, *arrays, **kw):
    return fn(*arrays, backend="array_api", **kw)


def _data(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(NP[dtype])


FWD_CASES = [
    # (n, d, dtype)
    (1, 1, "float32"), (3, 7, "float16"), (5, 8, "float32"), (9, 100, "float64"),
    (64, 1024, "float16"), (33, 4097, "float32"), (8, 8192, "float16"), (4, 20000, "float32"),
    (3, 65536, "float16"), (2, 262144, "float32"), (2, 9000, "float64"),
]
OPTIONS = [
    {},
    {"partial": 0.3},
    {"eps_mode": "outside", "eps": 1e-3},
    {"offset": 1.0},
    {"casting": "llama"},
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize(("n", "d", "dtype"), FWD_CASES)
def test_gpu_forward_matches_reference(n, d, dtype, opts):
    if int(d * opts.get("partial", 1.0)) < 1:
        pytest.skip("partial leaves no element of this row (a ValueError, tests/test_errors.py)")
    rng = np.random.default_rng(n * 1000 + d)
    x, w, b = _data(rng, (n, d), dtype), _data(rng, d, dtype), _data(rng, d, dtype)
    y, rstd = pn.rms_norm(cupy.asarray(x), cupy.asarray(w), cupy.asarray(b), return_rstd=True,
                          backend="cupy", **opts)
    yr, rr = _ref(pn.rms_norm, x, w, b, return_rstd=True, **opts)
    assert y.dtype == yr.dtype and rstd.dtype == rr.dtype
    _close(y.get(), yr, dtype, scale=4)
    _close(rstd.get(), rr, "float64" if dtype == "float64" else "float32", scale=4)


@pytest.mark.parametrize(("xd", "rd"), [("float16", "float16"), ("float32", "float32"),
                                        ("float16", "float32"), ("float32", "float16")])
@pytest.mark.parametrize("d", [5, 1024, 30000])
def test_gpu_add_forward(xd, rd, d):
    rng = np.random.default_rng(d)
    x, r, w = _data(rng, (6, d), xd), _data(rng, (6, d), rd), _data(rng, d, "float32")
    y, h = pn.add_rms_norm(cupy.asarray(x), cupy.asarray(r), cupy.asarray(w), backend="cupy")
    yr, hr = _ref(pn.add_rms_norm, x, r, w)
    assert h.dtype == hr.dtype and y.dtype == yr.dtype
    np.testing.assert_array_equal(h.get(), hr)
    _close(y.get(), yr, str(yr.dtype), scale=4)


@pytest.mark.parametrize("with_rstd", [False, True])
@pytest.mark.parametrize("opts", [{}, {"partial": 0.5, "eps_mode": "outside", "offset": 1.0}])
@pytest.mark.parametrize(("n", "d", "dtype"), [(7, 33, "float32"), (300, 512, "float16"),
                                                (5, 9000, "float32"), (3, 40000, "float16"),
                                                (4, 3000, "float64"), (3, 70000, "float64")])
def test_gpu_backward(n, d, dtype, opts, with_rstd):
    rng = np.random.default_rng(d)
    x, dy, w, b = (_data(rng, (n, d), dtype), _data(rng, (n, d), dtype),
                   _data(rng, d, "float32"), _data(rng, d, dtype))
    g = _data(rng, (n, d), dtype)
    rstd = _ref(pn.rms_norm, x, w, return_rstd=True, **opts)[1] if with_rstd else None
    got = pn.rms_norm_backward(
        cupy.asarray(dy), cupy.asarray(x), cupy.asarray(w), cupy.asarray(b),
        rstd=None if rstd is None else cupy.asarray(rstd), grad_residual=cupy.asarray(g),
        backend="cupy", **opts)
    want = _ref(pn.rms_norm_backward, dy, x, w, b, rstd=rstd, grad_residual=g, **opts)
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype
    _close(got[0].get(), want[0], dtype, scale=8)
    # dweight/dbias sum n rows: allow for the different summation order
    _close(got[1].get(), want[1], "float32", scale=8 * n)
    _close(got[2].get(), want[2], dtype, scale=8 * n)


def test_gpu_deterministic_and_nan_isolated():
    rng = np.random.default_rng(1)
    x = _data(rng, (4096, 1024), "float32")
    x[17, 5] = np.nan
    x[18, 0] = np.inf
    xc, w = cupy.asarray(x), cupy.asarray(_data(rng, 1024, "float32"))
    y1 = pn.rms_norm(xc, w, backend="cupy").get()
    y2 = pn.rms_norm(xc, w, backend="cupy").get()
    np.testing.assert_array_equal(y1.view(np.uint32), y2.view(np.uint32))
    assert np.isnan(y1[17]).all() and not np.isfinite(y1[18]).all()
    assert np.isfinite(np.delete(y1, [17, 18], axis=0)).all()
    dy = cupy.asarray(_data(rng, (4096, 1024), "float32"))
    xf = cupy.asarray(np.nan_to_num(x))
    d1 = pn.rms_norm_backward(dy, xf, w, backend="cupy")[1].get()
    d2 = pn.rms_norm_backward(dy, xf, w, backend="cupy")[1].get()
    np.testing.assert_array_equal(d1.view(np.uint32), d2.view(np.uint32))


@pytest.mark.parametrize("scale", [1e25, 1e-30, 1e-40])  # 1e-40: float32 subnormals (no flush to zero)
def test_gpu_no_overflow_or_underflow_float32(scale):
    rng = np.random.default_rng(2)
    x = _data(rng, (3, 300), "float32", scale=scale)
    y = pn.rms_norm(cupy.asarray(x), backend="cupy").get()
    _close(y, _ref(pn.rms_norm, x.astype(np.float64)), "float32", scale=4)


def test_gpu_strided_and_inplace():
    rng = np.random.default_rng(3)
    base = _data(rng, (12, 520), "float16")
    xs = base[::-2, 3:515]  # negative row stride, unaligned start
    y = pn.rms_norm(cupy.asarray(base)[::-2, 3:515], backend="cupy").get()
    _close(y, _ref(pn.rms_norm, np.ascontiguousarray(xs)), "float16", scale=4)
    xc = cupy.asarray(base)
    want = _ref(pn.rms_norm, base)
    out = pn.rms_norm(xc, out=xc, backend="cupy")
    assert out is xc
    _close(xc.get(), want, "float16", scale=4)


torch = None
if importlib.util.find_spec("torch") is not None:
    import torch

needs_torch_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                                      reason="torch with CUDA is not available")


@needs_torch_cuda
@pytest.mark.parametrize("d", [4096, 65536])
def test_gpu_torch_bfloat16_on_side_stream(d):
    rng = np.random.default_rng(4)
    x = _data(rng, (64, d), "bfloat16")
    w = _data(rng, d, "float32")
    xt = torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
    wt = torch.from_numpy(w).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = pn.rms_norm(xt, wt, backend="auto")
        dx, dw, _ = pn.rms_norm_backward(torch.ones_like(xt), xt, wt)
    s.synchronize()
    assert y.is_cuda and y.dtype == torch.bfloat16 and dw.dtype == torch.float32
    yr = _ref(pn.rms_norm, x, w)
    _close(y.float().cpu().numpy(), yr.astype(np.float32), "bfloat16", scale=2)
    dxr, dwr, _ = _ref(pn.rms_norm_backward, np.ones_like(x), x, w)
    _close(dx.float().cpu().numpy(), dxr.astype(np.float32), "bfloat16", scale=4)
    _close(dw.cpu().numpy(), dwr, "float32", scale=64 * 64)


# ------------------------------------------------------------------ batch invariance, fusions


@pytest.mark.parametrize(("d", "dtype"), [(4096, "bfloat16"), (1000, "float16"), (65536, "float32"),
                                          (300000, "float16")])
def test_gpu_batch_invariance(d, dtype):
    """A token's bits never depend on the other tokens, how many, or the row stride."""
    rng = np.random.default_rng(d)
    n = 257 if d < 100000 else 5
    if dtype == "bfloat16":  # cupy has no bfloat16: move its bits as uint16
        pytest.importorskip("torch")
    x = _data(rng, (n, d), dtype)
    w = _data(rng, d, dtype)
    dy = _data(rng, (n, d), dtype)

    def run(rows):
        if dtype == "bfloat16":
            xt, wt, dyt = (_torch_bf16(a) for a in (x[rows], w, dy[rows]))
            y = pn.rms_norm(xt, wt, backend="cupy")
            dx = pn.rms_norm_backward(dyt, xt, wt, backend="cupy")[0]
            return (y.view(torch.int16).cpu().numpy(), dx.view(torch.int16).cpu().numpy())
        xc, wc, dyc = cupy.asarray(x[rows]), cupy.asarray(w), cupy.asarray(dy[rows])
        y = pn.rms_norm(xc, wc, backend="cupy").get()
        dx = pn.rms_norm_backward(dyc, xc, wc, backend="cupy")[0].get()
        return y.view(f"u{y.itemsize}"), dx.view(f"u{dx.itemsize}")

    y_all, dx_all = run(slice(None))
    for i in (0, 1, n // 2, n - 1):
        y1, dx1 = run(slice(i, i + 1))
        np.testing.assert_array_equal(y1[0], y_all[i])
        np.testing.assert_array_equal(dx1[0], dx_all[i])
    y_odd, dx_odd = run(slice(1, None, 2))  # another row stride and count
    np.testing.assert_array_equal(y_odd, y_all[1::2])
    np.testing.assert_array_equal(dx_odd, dx_all[1::2])


def _torch_bf16(a):
    """A bfloat16 numpy array as a CUDA torch tensor of the same bits."""
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).cuda().view(torch.bfloat16)


GATED_CASES = [  # (n, d, dtype, group_size, norm_before_gate)
    (5, 7, "float32", None, False), (64, 1024, "float16", None, False), (9, 4096, "float32", 512, True),
    (3, 20000, "float16", 2500, False), (4, 3000, "float64", None, True), (2, 70000, "float32", None, False),
]


@pytest.mark.parametrize(("n", "d", "dtype", "group_size", "nbg"), GATED_CASES)
def test_gpu_gated_forward_and_backward(n, d, dtype, group_size, nbg):
    rng = np.random.default_rng(d + n)
    x, z, dy = (_data(rng, (n, d), dtype) for _ in range(3))
    w, b = _data(rng, d, dtype), _data(rng, d, dtype)
    kw = {"group_size": group_size, "norm_before_gate": nbg}
    c = [cupy.asarray(a) for a in (x, z, w, b, dy)]
    y, rstd = pn.rms_norm_gated(*c[:4], return_rstd=True, backend="cupy", **kw)
    yr, rr = _ref(pn.rms_norm_gated, x, z, w, b, return_rstd=True, **kw)
    assert y.dtype == yr.dtype and rstd.shape == rr.shape
    _close(y.get(), yr, dtype, scale=8)
    _close(rstd.get(), rr, "float64" if dtype == "float64" else "float32", scale=4)
    got = pn.rms_norm_gated_backward(c[4], *c[:4], backend="cupy", **kw)
    want = _ref(pn.rms_norm_gated_backward, dy, x, z, w, b, **kw)
    for a, e, s in zip(got, want, (8, 8, 8 * n, 8 * n), strict=True):
        assert a.dtype == e.dtype
        _close(a.get(), e, dtype, scale=s)


@pytest.mark.parametrize("group_size", [None, 128])
@pytest.mark.parametrize(("n", "d", "dtype"), [(7, 1000, "float16"), (33, 4096, "float32"), (3, 40000, "float16")])
def test_gpu_quant_int8(n, d, dtype, group_size):
    rng = np.random.default_rng(d)
    x, r, w = _data(rng, (n, d), dtype), _data(rng, (n, d), dtype), _data(rng, d, dtype)
    if group_size is not None and d % group_size:
        group_size = None
    q, s, h = pn.rms_norm_quant(cupy.asarray(x), cupy.asarray(w), residual=cupy.asarray(r), dtype="int8",
                                group_size=group_size, backend="cupy")
    qr, sr, hr = _ref(pn.rms_norm_quant, x, w, residual=r, dtype="int8", group_size=group_size)
    np.testing.assert_array_equal(h.get(), hr)
    _close(s.get(), sr, "float32", scale=4)
    # rstd may differ in its last bit (another summation order): q by at most one step
    assert np.abs(q.get().astype(np.int32) - qr.astype(np.int32)).max() <= 1


@needs_torch_cuda
@pytest.mark.parametrize("scale", [None, 0.05])
@pytest.mark.parametrize(("n", "d"), [(16, 4096), (2, 65536)])
def test_gpu_quant_e4m3_torch(n, d, scale):
    rng = np.random.default_rng(d)
    x, r, w = _data(rng, (n, d), "float32"), _data(rng, (n, d), "float32"), _data(rng, d, "float32")
    xt, rt, wt = (torch.from_numpy(a).to("cuda", torch.bfloat16) for a in (x, r, w))
    q, s, h = pn.rms_norm_quant(xt, wt, residual=rt, scale=scale)
    assert q.dtype == torch.float8_e4m3fn and h.dtype == torch.bfloat16
    xb, rb, wb = (t.float().cpu().numpy().astype(ml_dtypes.bfloat16) for t in (xt, rt, wt))
    qr, sr, hr = _ref(pn.rms_norm_quant, xb, wb, residual=rb, scale=scale)
    np.testing.assert_array_equal(h.float().cpu().numpy(), hr.astype(np.float32))
    _close(s.cpu().numpy(), sr, "float32", scale=4)
    got, want = q.float().cpu().numpy(), qr.astype(np.float32)
    # one e4m3 step (3 mantissa bits) where rstd's last bit differs
    np.testing.assert_allclose(got, want, rtol=2.0**-3, atol=2.0**-9)
    assert (got == want).mean() > 0.99


@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("d", [1000, 40000])
def test_gpu_torch_tensors_give_the_cupy_bits(dtype, d):
    """torch tensors go to the kernels by pointer, cupy arrays as cupy: the same bits,
    strided rows, ``out=`` and the fused add included."""
    rng = np.random.default_rng(5)
    base, r, dy = _data(rng, (14, d + 3), dtype), _data(rng, (7, d), dtype), _data(rng, (7, d), dtype)
    w, b = _data(rng, d, dtype), _data(rng, d, dtype)
    x = base[::2, 3:]  # every other row, unaligned start

    def bits(a):
        a = a.get() if isinstance(a, cupy.ndarray) else a.cpu().numpy()
        return a.view(f"u{a.itemsize}")

    tt = {k: torch.from_numpy(np.ascontiguousarray(v)).cuda() for k, v in
          {"base": base, "r": r, "dy": dy, "w": w, "b": b}.items()}
    cc = {k: cupy.asarray(v) for k, v in {"base": base, "r": r, "dy": dy, "w": w, "b": b}.items()}
    got, want = [], []
    for lib, out in ((tt, got), (cc, want)):
        xs = lib["base"][::2, 3:]
        out += [pn.rms_norm(xs, lib["w"], lib["b"], backend="cupy")]
        out += list(pn.add_rms_norm(xs, lib["r"], lib["w"], backend="cupy"))
        out += [a for a in pn.rms_norm_backward(lib["dy"], xs, lib["w"], lib["b"], backend="cupy")]
    for g, e in zip(got, want, strict=True):
        np.testing.assert_array_equal(bits(g), bits(e))
    y = torch.empty((7, d), device="cuda", dtype=getattr(torch, dtype))
    assert pn.rms_norm(tt["base"][::2, 3:], tt["w"], tt["b"], out=y) is y
    np.testing.assert_array_equal(bits(y), bits(want[0]))
    _close(want[0].get(), _ref(pn.rms_norm, x, w, b), dtype, scale=4)


@needs_torch_cuda
@pytest.mark.parametrize("qdtype", ["float8_e4m3fn", "float8_e5m2", "int8"])
def test_gpu_quant_scale_mode_midpoints_torch(qdtype):
    """#48: pn_quant_fwd compiled by NVRTC, on torch CUDA tensors, at the midpoints where
    ``y / s`` and ``y * float32(1 / s)`` land one step apart (a row of ones with
    eps=0: y is the weight): each ``scale_mode`` gives its formula's bits
    (tests/test_quant_conventions.py writes them out), static and per token."""
    from test_quant_conventions import _midpoint_row, peer_divide, peer_reciprocal

    s1 = np.float32(0.875)
    w = _midpoint_row(qdtype, s1)
    x = np.ones((3, w.size), np.float32)
    tq = getattr(torch, qdtype)
    for mode, f in (("divide", peer_divide), ("reciprocal", peer_reciprocal)):
        want = np.asarray(f(x * w, s1, qdtype)).view(np.uint8)
        for scale in (float(s1), None):
            q, s = pn.rms_norm_quant(torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda(),
                                     eps=0.0, dtype=qdtype, scale=scale, scale_mode=mode)
            assert q.dtype == tq and q.is_cuda
            np.testing.assert_array_equal(q.view(torch.uint8).cpu().numpy(), want,
                                          f"{mode} scale={scale}")
            assert np.all(s.cpu().numpy() == s1)


def _bits_t(t):
    return None if t is None else t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _host_path_case(fast_cuda, g, n, d, dt):
    """Records off, then on (built, then taken): the same bits of fwd, add and bwd."""
    x, r, dy = (torch.randn(n, d, device="cuda", dtype=dt, generator=g) for _ in range(3))
    w = torch.randn(d, device="cuda", dtype=dt, generator=g)
    rstd = pn.rms_norm(x, w, return_rstd=True)[1]
    calls = (lambda: pn.rms_norm(x, w, return_rstd=True, partial=0.5),
             lambda: pn.add_rms_norm(x, r, w, return_rstd=True),
             lambda: pn.rms_norm_backward(dy, x, w, rstd=rstd))
    hp = fast_cuda._HOSTPATH[:]
    fast_cuda._HOSTPATH[:] = [None]
    fast_cuda._RECORDS.clear()
    want = [c() for c in calls]
    fast_cuda._HOSTPATH[:] = hp
    fast_cuda._RECORDS.clear()
    for _ in range(2):
        got = [c() for c in calls]
        for gs, ws in zip(got, want, strict=True):
            for a, b in zip(gs, ws, strict=True):
                assert torch.equal(_bits_t(a), _bits_t(b)), (n, d, dt)
    assert sum(1 for v in fast_cuda._RECORDS.values() if v) == 3


@needs_torch_cuda
def test_gpu_torch_host_path_records_and_graph_capture():
    """The torch-CUDA host path's launch records (polynorm.backends.cuda.hostpath) on the
    device: the backend's own call's bits, first and repeated call, for fwd / add / bwd
    (register, split and big kernels); then the calls captured in torch.cuda.graph and
    replayed on refilled inputs give the eager bits."""
    from polynorm.ops import fast_cuda

    if fast_cuda._hostpath() is None:
        pytest.skip("cuda-bindings' driver module is missing: no launch records")
    g = torch.Generator(device="cuda").manual_seed(3)
    for n, d, dt in ((4096, 1024, torch.bfloat16), (3, 5000, torch.float32), (2, 262144, torch.bfloat16),
                     (300, 8192, torch.float16)):
        _host_path_case(fast_cuda, g, n, d, dt)
    n, d = 4096, 1024
    x, r, dy = (torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16, generator=g)
    rstd = pn.rms_norm(x, w, return_rstd=True)[1]
    calls = (lambda: pn.rms_norm(x, w), lambda: pn.add_rms_norm(x, r, w),
             lambda: pn.rms_norm_backward(dy, x, w, rstd=rstd))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = [c() for c in calls]
    for a in (x, r, dy):
        a.copy_(torch.randn_like(a))
    graph.replay()
    eager = [c() for c in calls]
    for gs, es in zip(static, eager, strict=True):
        gs, es = (gs if isinstance(gs, tuple) else (gs,)), (es if isinstance(es, tuple) else (es,))
        for a, b in zip(gs, es, strict=True):
            assert torch.equal(_bits_t(a), _bits_t(b))
