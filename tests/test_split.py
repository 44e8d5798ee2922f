"""The hidden axis split across shards: ``rms_norm_stats`` / ``rms_norm_from_stats`` and
the backward's ``rms_norm_backward_stats`` / ``rms_norm_backward_from_stats``.

The shards are column slices of one array; the "all-reduce" is a plain sum of the
shards' results.  The expected values are the RMSNorm formula in float64, written out
here; the backward is checked by central differences of ``sum(y * G)`` through the
composed split forward (float64, as tests/test_backward_fd.py does).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn

EPS = 0.05


def _formula(x, w=None, b=None, eps=EPS, inside=True, offset=0.0):
    v = x.astype(np.float64)
    ms = np.mean(v * v, axis=-1, keepdims=True)
    r = 1 / np.sqrt(ms + eps) if inside else 1 / (np.sqrt(ms) + eps)
    y = v * r
    if w is not None:
        y = y * (w.astype(np.float64) + offset)
    if b is not None:
        y = y + b.astype(np.float64)
    return y, r[..., 0]


def _cuts(d, shards):
    edges = np.linspace(0, d, shards + 1).astype(int)
    return [slice(a, c) for a, c in zip(edges[:-1], edges[1:], strict=True)]


def _split_forward(x, w, b, shards, **kw):
    cuts = _cuts(x.shape[-1], shards)
    total = sum(pn.rms_norm_stats(x[..., c], **kw) for c in cuts)
    ys = [pn.rms_norm_from_stats(x[..., c], None if w is None else w[c],
                                 None if b is None else b[c], sumsq=total,
                                 d_total=x.shape[-1], **kw) for c in cuts]
    return np.concatenate(ys, axis=-1), total


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
def test_one_shard_gives_the_unsplit_bits_on_numba(dtype):
    rng = np.random.default_rng(1)
    # d = 300: whole 16-bit lanes blocks and a partial one; rows of very different scales
    # and heavy-tailed elements, where another summation order (a float64 loop instead of
    # the 16-bit forward's float32 lanes) changes rstd's float32 bits on ~10% of the rows
    scale = np.exp(2 * rng.standard_normal((64, 300))) * np.geomspace(1e-3, 1e4, 64)[:, None]
    x = (rng.standard_normal((64, 300)) * scale).astype(dtype)
    w = rng.standard_normal(300).astype(np.float32)
    for kw in ({}, {"eps_mode": "outside", "offset": 1.0}):
        y, r = pn.rms_norm(x, w, return_rstd=True, **kw)
        ss = pn.rms_norm_stats(x, **kw)
        assert ss.dtype == np.float64 and ss.shape == (64,)
        y1, r1 = pn.rms_norm_from_stats(x, w, sumsq=ss, d_total=300, return_rstd=True, **kw)
        assert y1.dtype == y.dtype and r1.dtype == r.dtype
        np.testing.assert_array_equal(y1.view(np.uint8), y.view(np.uint8))
        np.testing.assert_array_equal(r1, r)
        # axis as a tuple: the general path (the fast path takes axis=-1 only)
        y2 = pn.rms_norm_from_stats(x, w, sumsq=pn.rms_norm_stats(x, axis=(1,), **kw),
                                    d_total=300, axis=(1,), **kw)
        np.testing.assert_array_equal(y2.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("backend", ["numba", "array_api"])
@pytest.mark.parametrize("inside", [True, False])
def test_shards_match_the_formula(backend, inside):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    w, b = rng.standard_normal(40).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    mode = "inside" if inside else "outside"
    want, _ = _formula(x, w, b, inside=inside, offset=0.5)
    for shards in (1, 3):
        y, total = _split_forward(x, w, b, shards, eps=EPS, eps_mode=mode, offset=0.5,
                                  backend=backend)
        assert y.dtype == np.float32 and total.shape == (2, 3)
        np.testing.assert_allclose(y, want, rtol=2e-6, atol=2e-6)
        # the reference sums in float64; the kernels' float32 rows in float32 partials
        # over blocks of 512 elements (the unsplit forward's order), added in float64
        rtol = 1e-12 if backend == "array_api" else 1e-6
        np.testing.assert_allclose(total, np.sum(x.astype(np.float64) ** 2, axis=-1), rtol=rtol)


def test_float32_rows_beyond_the_float32_square_range():
    # 1e25**2 overflows float32, 1e-25**2 underflows it: the float64 sums hold both (the
    # kernels sum such rows again in float64)
    x = np.array([[1e25, -2e25, 3e25, 0.0], [1e-25, 2e-25, -1e-25, 1e-25]], np.float32)
    for backend in ("numba", "array_api"):
        y, _ = _split_forward(x, None, None, 2, eps=0.0, backend=backend)
        np.testing.assert_allclose(y, _formula(x, eps=0.0)[0], rtol=2e-6)


def test_llama_casting_and_out_dtype_go_through():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 16)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal(16).astype(np.float32)
    ss = pn.rms_norm_stats(x)
    y = pn.rms_norm_from_stats(x, w, sumsq=ss, d_total=16, casting="llama", out_dtype="float32")
    assert y.dtype == np.float32
    # llama: xhat rounded to bfloat16, times w in float32
    _, r = _formula(x, eps=1e-6)
    xhat = (x.astype(np.float64) * r[:, None]).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(y, xhat * w, rtol=1e-6, atol=1e-6)


def _loss(x, w, b, g, shards, kw):
    y, _ = _split_forward(x, w, b, shards, **kw)
    return float(np.sum(y * g))


@pytest.mark.parametrize("mode", ["inside", "outside"])
def test_composed_split_backward_matches_finite_differences(mode):
    rng = np.random.default_rng(4)
    n, d, shards = 3, 7, 2
    x = rng.standard_normal((n, d))
    w, b = rng.standard_normal(d), rng.standard_normal(d)
    g = rng.standard_normal((n, d))
    kw = dict(eps=EPS, eps_mode=mode, offset=0.25, backend="array_api")
    cuts = _cuts(d, shards)
    total = sum(pn.rms_norm_stats(x[:, c], **kw) for c in cuts)
    dot = sum(pn.rms_norm_backward_stats(g[:, c], x[:, c], w[c], sumsq=total, d_total=d, **kw)
              for c in cuts)
    parts = [pn.rms_norm_backward_from_stats(g[:, c], x[:, c], w[c], b[c], sumsq=total, dot=dot,
                                             d_total=d, **kw) for c in cuts]
    dx = np.concatenate([p[0] for p in parts], axis=1)
    dw = np.concatenate([p[1] for p in parts])
    db = np.concatenate([p[2] for p in parts])
    h = 1e-6
    fd = np.zeros_like(x)
    for i in range(n):
        for j in range(d):
            e = np.zeros_like(x)
            e[i, j] = h
            fd[i, j] = (_loss(x + e, w, b, g, shards, kw) - _loss(x - e, w, b, g, shards, kw)) / (2 * h)
    np.testing.assert_allclose(dx, fd, rtol=1e-6, atol=1e-6 * np.abs(fd).max())
    fdw = np.array([(_loss(x, w + h * e, b, g, shards, kw) - _loss(x, w - h * e, b, g, shards, kw))
                    / (2 * h) for e in np.eye(d)])
    np.testing.assert_allclose(dw, fdw, rtol=1e-6, atol=1e-6 * np.abs(fdw).max())
    np.testing.assert_allclose(db, g.sum(axis=0), rtol=1e-12)
    # and the unsplit backward's gradient
    dx1, dw1, _ = pn.rms_norm_backward(g, x, w, b, eps=EPS, eps_mode=mode, offset=0.25)
    np.testing.assert_allclose(dx, dx1, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dw, dw1, rtol=1e-10, atol=1e-12)


def test_backward_on_float32_numba_arrays_matches_the_unsplit_backward():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    g = rng.standard_normal((5, 64)).astype(np.float32)
    total = pn.rms_norm_stats(x[:, :20]) + pn.rms_norm_stats(x[:, 20:])
    dot = (pn.rms_norm_backward_stats(g[:, :20], x[:, :20], w[:20], sumsq=total, d_total=64)
           + pn.rms_norm_backward_stats(g[:, 20:], x[:, 20:], w[20:], sumsq=total, d_total=64))
    assert dot.dtype == np.float64
    dx_a, dw_a, _ = pn.rms_norm_backward_from_stats(g[:, :20], x[:, :20], w[:20], sumsq=total,
                                                    dot=dot, d_total=64)
    dx, dw, _ = pn.rms_norm_backward(g, x, w)
    assert dx_a.dtype == np.float32 and dw_a.dtype == np.float32
    np.testing.assert_allclose(dx_a, dx[:, :20], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw_a, dw[:20], rtol=1e-5, atol=1e-6)


def test_zero_tokens_and_batch_axes():
    x = np.zeros((0, 8), np.float32)
    ss = pn.rms_norm_stats(x)
    assert ss.shape == (0,)
    assert pn.rms_norm_from_stats(x, sumsq=ss, d_total=16).shape == (0, 8)


def test_torch_tensors_in_torch_tensors_out():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 8)
    ss = pn.rms_norm_stats(x)
    assert isinstance(ss, torch.Tensor) and ss.dtype == torch.float64
    y = pn.rms_norm_from_stats(x, sumsq=ss, d_total=8)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (8,), eps=1e-6))


@pytest.mark.parametrize(("kw", "err", "match"), [
    ({"partial": 0.5}, ValueError, "partial=0.5"),
    ({"partial_size": 2}, ValueError, "partial_size=2"),
    ({"d_total": 4}, ValueError, "d_total must be at least"),
    ({"d_total": 8.0}, TypeError, "d_total must be an int"),
    ({"d_total": True}, TypeError, "d_total must be an int"),
    ({"sumsq": np.ones(4)}, ValueError, "sumsq"),
    ({"sumsq": np.ones(3, np.int64)}, TypeError, "sumsq must have a floating dtype"),
    ({"sumsq": None}, TypeError, "sumsq must be an array"),
    ({"norm_input": "sum"}, TypeError, "unexpected keyword argument 'norm_input'"),
])
def test_bad_arguments(kw, err, match):
    x = np.ones((3, 6), np.float32)
    args = {"sumsq": np.ones(3), "d_total": 12, **kw}
    with pytest.raises(err, match=match):
        pn.rms_norm_from_stats(x, **args)


def test_bad_arguments_of_the_stats_and_backward():
    x = np.ones((3, 6), np.float32)
    with pytest.raises(ValueError, match="partial"):
        pn.rms_norm_stats(x, partial=0.5)
    with pytest.raises(TypeError, match="out_dtype"):
        pn.rms_norm_stats(x, out_dtype="float32")
    with pytest.raises(ValueError, match="dot"):
        pn.rms_norm_backward_from_stats(x, x, sumsq=np.ones(3), dot=np.ones(2), d_total=6)
    with pytest.raises(ValueError, match="dy"):
        pn.rms_norm_backward_stats(x[:, :2], x, sumsq=np.ones(3), d_total=6)


def test_dask_hidden_chunks_are_not_rechunked():
    da = pytest.importorskip("dask.array")
    import dask

    rng = np.random.default_rng(6)
    x = rng.standard_normal((40, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    xd, wd = da.from_array(x, chunks=(10, 32)), da.from_array(w, chunks=32)
    ss = pn.rms_norm_stats(xd)
    y, r = pn.rms_norm_from_stats(xd, wd, sumsq=ss, d_total=96, return_rstd=True)
    assert y.chunks == xd.chunks and r.chunks == (xd.chunks[0],)
    for a in (ss, y, r):
        names = {k[0] if isinstance(k, tuple) else k for k in dict(a.__dask_graph__())}
        assert not any("rechunk" in str(n) for n in names), names
    yc, rc, sc = dask.compute(y, r, ss)
    want_y, want_r = _formula(x, w, eps=1e-6)
    # the chunks' float32 partials (the kernels' order), added in float64
    np.testing.assert_allclose(sc, np.sum(x.astype(np.float64) ** 2, axis=1), rtol=1e-6)
    np.testing.assert_allclose(yc, want_y, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(rc, want_r, rtol=2e-7)


def test_dask_split_backward_keeps_the_hidden_chunks():
    da = pytest.importorskip("dask.array")
    import dask

    rng = np.random.default_rng(7)
    x, g = (rng.standard_normal((20, 48)) for _ in range(2))
    w = rng.standard_normal(48)
    xd, gd, wd = (da.from_array(a, chunks=(10, 16) if a.ndim == 2 else 16) for a in (x, g, w))
    ss = pn.rms_norm_stats(xd)
    dot = pn.rms_norm_backward_stats(gd, xd, wd, sumsq=ss, d_total=48)
    dx, dw, _ = pn.rms_norm_backward_from_stats(gd, xd, wd, sumsq=ss, dot=dot, d_total=48)
    assert dx.chunks == xd.chunks and dw.chunks == wd.chunks
    assert not any("rechunk" in str(k) for k in dict(dx.__dask_graph__()))
    # the backward formula written out (eps inside, k = d)
    r = 1 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6)
    xhat = x * r
    c = np.sum(g * w * xhat, axis=1, keepdims=True)
    got_dx, got_dw = dask.compute(dx, dw)
    np.testing.assert_allclose(got_dx, r * (g * w - xhat * c / 48), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_dw, np.sum(g * xhat, axis=0), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- keyword form
# pn.rms_norm(x, w, sumsq=, d_total=) and pn.rms_norm_backward(..., sumsq=, dot=, d_total=)


def test_rms_norm_keywords_are_the_from_stats_call():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 12)).astype(np.float32)
    w = rng.standard_normal(12).astype(np.float32)
    b = rng.standard_normal(12).astype(np.float32)
    cuts = _cuts(12, 3)
    total = sum(pn.rms_norm_stats(x[..., c]) for c in cuts)
    want, want_r = _formula(x, w, b)
    for c in cuts:
        y, r = pn.rms_norm(x[..., c], w[c], b[c], sumsq=total, d_total=12, eps=EPS,
                           return_rstd=True)
        np.testing.assert_allclose(y, want[..., c], rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(r, want_r, rtol=2e-6)
        y2 = pn.rms_norm_from_stats(x[..., c], w[c], b[c], sumsq=total, d_total=12, eps=EPS)
        np.testing.assert_array_equal(y, y2)
    # the general path (another axis), same bits as the explicit name
    xt = np.ascontiguousarray(np.moveaxis(x, -1, 0))
    y3 = pn.rms_norm(xt[4:8], w[4:8], b[4:8], sumsq=total, d_total=12, eps=EPS, axis=0)
    np.testing.assert_allclose(np.moveaxis(y3, 0, -1), want[..., 4:8], rtol=2e-6, atol=2e-6)


def test_rms_norm_backward_keywords_are_the_from_stats_call():
    rng = np.random.default_rng(12)
    x, dy = rng.standard_normal((2, 4, 10)), rng.standard_normal((2, 4, 10))
    w = rng.standard_normal(10)
    total = np.sum(x * x, axis=-1)
    c = slice(3, 10)
    dot = sum(pn.rms_norm_backward_stats(dy[..., s], x[..., s], w[s], sumsq=total, d_total=10,
                                         eps=EPS) for s in (slice(0, 3), c))
    got = pn.rms_norm_backward(dy[..., c], x[..., c], w[c], sumsq=total, dot=dot, d_total=10,
                               eps=EPS)
    full = pn.rms_norm_backward(dy, x, w, eps=EPS)  # the unsplit backward's columns
    np.testing.assert_allclose(got[0], full[0][..., c], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], full[1][c], rtol=1e-12, atol=1e-12)
    assert got[2] is None
    ref = pn.rms_norm_backward_from_stats(dy[..., c], x[..., c], w[c], sumsq=total, dot=dot,
                                          d_total=10, eps=EPS)
    np.testing.assert_array_equal(got[0], ref[0])


@pytest.mark.parametrize("kw,err,match", [
    ({"sumsq": np.ones(3)}, TypeError, "sumsq given without d_total"),
    ({"d_total": 8}, TypeError, "d_total given without sumsq"),
    ({"sumsq": np.ones(3), "d_total": 8, "out": np.empty((3, 4), np.float32)}, ValueError,
     "out= is not supported"),
    ({"sumsq": np.ones(3), "d_total": 8, "partial": 0.5}, ValueError, "partial=0.5"),
    ({"sumsq": np.ones(3), "d_total": 8, "residual_dtype": "float32"}, ValueError,
     "residual_dtype"),
    ({"sumsq": np.ones(3), "d_total": 2}, ValueError, "d_total must be at least"),
    ({"sumsq": np.ones(4), "d_total": 8}, ValueError, "sumsq"),
])
def test_rms_norm_keyword_errors(kw, err, match):
    with pytest.raises(err, match=match):
        pn.rms_norm(np.ones((3, 4), np.float32), **kw)


def test_rms_norm_backward_keyword_errors():
    x = np.ones((3, 4))
    with pytest.raises(TypeError, match="sumsq, d_total given without dot"):
        pn.rms_norm_backward(x, x, sumsq=np.ones(3), d_total=8)
    with pytest.raises(ValueError, match="rstd= is not supported"):
        pn.rms_norm_backward(x, x, sumsq=np.ones(3), dot=np.ones(3), d_total=8, rstd=np.ones(3))


@pytest.mark.parametrize("kw", [{"group_size": 4}, {"casting": "none"}])
def test_options_without_a_split_form_are_refused(kw):
    # a grouped norm's and casting='none''s statistic cannot be summed across shards:
    # refused by every split entry, not silently dropped
    x = np.ones((2, 8), np.float32)
    s = pn.rms_norm_stats(x)
    dot = pn.rms_norm_backward_stats(x, x, sumsq=s, d_total=8)
    calls = [lambda: pn.rms_norm_stats(x, **kw),
             lambda: pn.rms_norm(x, sumsq=s, d_total=8, **kw),
             lambda: pn.rms_norm_backward_stats(x, x, sumsq=s, d_total=8, **kw),
             lambda: pn.rms_norm_backward(x, x, sumsq=s, dot=dot, d_total=8, **kw)]
    for call in calls:
        with pytest.raises(ValueError, match=next(iter(kw))):
            call()
