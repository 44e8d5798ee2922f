"""dask: lazy per-chunk dispatch, checked on a real distributed cluster.

The cluster (two worker processes) starts once for the module.  Every result
is compared with the in-memory backend that the chunks run on (Numba when
usable, else the reference) on the same numpy data, bit for bit: y, h, rstd,
dx, and dweight/dbias too on Numba, whose row tree fixes the order of the
sums over tokens whatever the chunks (polynorm/backends/rowtree.py).
Without Numba, dweight/dbias agree to accumulation accuracy.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")

import polynorm as pn  # noqa: E402
from polynorm.backends import dask as dask_backend  # noqa: E402

BEST = "numba" if pn.backends()["numba"][0] else "array_api"
DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float64": np.float64,
}


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
        worker_dashboard_address=None,
    ) as cluster, distributed.Client(cluster) as c:
        yield c


def _no_compute(*args, **kwargs):
    raise AssertionError("polynorm computed something while building the graph")


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint8)


def _same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _sum_close(got, want):
    """dweight/dbias: the same bits on Numba (the row tree); without it the
    reference's sums are grouped by chunk, so they agree to float32
    accumulation accuracy (or the weight dtype's rounding, if coarser)."""
    assert got.dtype == want.dtype
    if BEST == "numba":
        _same_bits(got, want)
        return
    rtol = max(float(np.finfo(got.dtype).eps) * 2, 1e-5)
    got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def test_graph_building_computes_nothing():
    rng = np.random.default_rng(0)
    x = da.from_array(rng.standard_normal((40, 16)).astype(np.float32), chunks=(10, 8))
    w = da.from_array(np.ones(16, np.float32))
    with dask.config.set(scheduler=_no_compute):
        y, h, rstd = pn.add_rms_norm(x, x, w, return_rstd=True)
        dx, dw, _ = pn.rms_norm_backward(y, h, w, rstd=rstd)
    for a in (y, h, rstd, dx, dw):
        assert isinstance(a, da.Array)
    # one kernel task per row chunk, whatever the column chunking was
    assert y.chunks == ((10, 10, 10, 10), (16,))
    assert rstd.chunks == ((10, 10, 10, 10),)
    assert dask_backend.accepts(x) and not dask_backend.accepts(np.zeros(3))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cluster_forward_and_backward_match_in_memory(client, dtype):
    rng = np.random.default_rng(1)
    n, d = 203, 96
    dt = DTYPES[dtype]
    x = rng.standard_normal((n, d)).astype(dt)
    r = rng.standard_normal((n, d)).astype(dt)
    dy = rng.standard_normal((n, d)).astype(dt)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    b = rng.standard_normal(d).astype(np.float32)
    opts = dict(partial=0.5, offset=0.25, eps=1e-5)
    # tokens chunked unevenly, d split across chunks (the backend rechunks it whole)
    xd = da.from_array(x, chunks=(50, 48))
    rd = da.from_array(r, chunks=(70, 96))
    dyd = da.from_array(dy, chunks=(64, 96))
    wd, bd = da.from_array(w, chunks=32), da.from_array(b)
    y, h, rstd = pn.add_rms_norm(xd, rd, wd, bd, return_rstd=True, **opts)
    dx, dw, db = pn.rms_norm_backward(dyd, h, wd, bd, rstd=rstd, grad_residual=dyd, **opts)
    # in memory first: the workers then load this process's compiled kernels from the
    # kernel cache instead of each compiling them again
    ym, hm, rstdm = pn.add_rms_norm(x, r, w, b, return_rstd=True, backend=BEST, **opts)
    dxm, dwm, dbm = pn.rms_norm_backward(dy, hm, w, b, rstd=rstdm, grad_residual=dy,
                                          backend=BEST, **opts)
    got = client.compute([y, h, rstd, dx, dw, db], sync=True)
    for g, want in zip(got[:4], (ym, hm, rstdm, dxm), strict=True):
        _same_bits(g, want)
    _sum_close(got[4], dwm)
    _sum_close(got[5], dbm)


def test_cluster_nd_input_axis_tuple_and_llama(client):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 5, 4, 8)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16)
    xd = da.from_array(x, chunks=(2, 5, 4, 4))
    opts = dict(axis=(2, 3), casting="llama", eps_mode="outside")
    y = pn.rms_norm(xd, da.from_array(w), **opts)
    assert y.shape == x.shape and y.dtype == x.dtype
    want = pn.rms_norm(x, w, backend=BEST, **opts)  # first: the workers load its kernels
    _same_bits(client.compute(y, sync=True), want)


def test_many_chunks_tree_reduction_and_empty_chunks(client):
    rng = np.random.default_rng(3)
    n, d = 330, 32
    x = rng.standard_normal((n, d)).astype(np.float32)
    dy = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float64)
    chunks = ((0,) + (10,) * 33, (d,))  # 33 chunks: three levels of fan-in 8; one empty
    xd, dyd = da.from_array(x, chunks=chunks), da.from_array(dy, chunks=chunks)
    dx, dw, _ = pn.rms_norm_backward(dyd, xd, da.from_array(w))
    assert dask_backend.SPLIT_EVERY < 33
    dxm, dwm, _ = pn.rms_norm_backward(dy, x, w, backend=BEST)  # first: the workers load its kernels
    dxg, dwg = client.compute([dx, dw], sync=True)
    _same_bits(dxg, dxm)
    _sum_close(dwg, dwm)


@pytest.mark.skipif(BEST != "numba", reason="bit-exact dweight needs the Numba row tree")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_dweight_bits_do_not_depend_on_the_chunks(client, dtype):
    rng = np.random.default_rng(6)
    n, d = 1000, 40
    x = rng.standard_normal((n, d)).astype(DTYPES[dtype])
    dy = rng.standard_normal((n, d)).astype(DTYPES[dtype])
    w = rng.standard_normal(d).astype(DTYPES[dtype])
    b = rng.standard_normal(d).astype(np.float32)
    want = pn.rms_norm_backward(dy, x, w, b)
    wd, bd = da.from_array(w), da.from_array(b)
    chunkings = [(1000,), (1,) * 7 + (993,), (333, 334, 333), (17,) * 58 + (14,),
                 tuple(np.diff([0, *sorted(rng.choice(np.arange(1, n), 11, replace=False)), n]))]
    graphs = [pn.rms_norm_backward(da.from_array(dy, chunks=(c, d)),
                                   da.from_array(x, chunks=(c, d)), wd, bd)
              for c in chunkings]
    for got in client.compute(graphs, sync=True):
        for g, m in zip(got, want, strict=True):
            _same_bits(g, m)


def test_results_are_deterministic(client):
    rng = np.random.default_rng(4)
    x = da.from_array(rng.standard_normal((120, 40)).astype(np.float32), chunks=(7, 40))
    w = da.from_array(np.linspace(0.5, 1.5, 40).astype(np.float32))
    dy = x[::-1]
    _, dw1, _ = pn.rms_norm_backward(dy, x, w)
    _, dw2, _ = pn.rms_norm_backward(dy, x, w)
    a, b = client.compute([dw1, dw2], sync=True)
    _same_bits(a, b)


def test_forced_dask_backend_rejects_numpy():
    with pytest.raises(TypeError, match="dask"):
        pn.rms_norm(np.ones((2, 3), np.float32), backend="dask")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_empty_chunks_forward_and_backward(dtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((12, 16)).astype(DTYPES[dtype])
    chunks = ((0, 5, 0, 7), (16,))
    xd, rd = da.from_array(x, chunks=chunks), da.from_array(x[::-1].copy(), chunks=chunks)
    w, b = np.ones(16, np.float32), np.zeros(16, np.float32)
    y, h, rstd = dask.compute(*pn.add_rms_norm(xd, rd, da.from_array(w), da.from_array(b),
                                               return_rstd=True), scheduler="sync")
    ym, hm, rstdm = pn.add_rms_norm(x, x[::-1].copy(), w, b, return_rstd=True, backend=BEST)
    _same_bits(y, ym)
    _same_bits(h, hm)
    _same_bits(rstd, rstdm)
    dx, dw, db = dask.compute(*pn.rms_norm_backward(xd, xd, da.from_array(w), da.from_array(b)),
                              scheduler="sync")
    dxm, dwm, dbm = pn.rms_norm_backward(x, x, w, b, backend=BEST)
    _same_bits(dx, dxm)
    _sum_close(dw, dwm)
    _sum_close(db, dbm)


def test_numpy_weight_and_bias_with_a_dask_x():
    """SPEC: a dask x takes weight/bias as arrays of its chunks' library, as dask's ops do."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 2, 4)).astype(np.float32)
    w, b = rng.standard_normal((2, 4)).astype(np.float32), np.ones((2, 4), np.float32)
    dx = da.from_array(x, chunks=(4, 2, 4))
    for axis, ww, bb in ((-1, w[0], b[0]), ((1, 2), w, b)):
        y = pn.rms_norm(dx, ww, bb, axis=axis)
        assert isinstance(y, da.Array)
        np.testing.assert_array_equal(y.compute(scheduler="sync"), pn.rms_norm(x, ww, bb, axis=axis))
        got = pn.rms_norm_backward(dx, dx, ww, bb, axis=axis)
        want = pn.rms_norm_backward(x, x, ww, bb, axis=axis)
        for g, v in zip(dask.compute(*got, scheduler="sync"), want, strict=True):
            np.testing.assert_array_equal(g, v)
    y, h = pn.add_rms_norm(dx, dx, w[0])
    np.testing.assert_array_equal(y.compute(scheduler="sync"), pn.add_rms_norm(x, x, w[0])[0])
    # token-shaped arrays stay dask-only, and other libraries stay refused by name
    with pytest.raises(TypeError, match="residual: numpy"):
        pn.add_rms_norm(dx, x)
    with pytest.raises(TypeError, match="weight: array_api_strict"):
        pn.rms_norm(dx, pytest.importorskip("array_api_strict").asarray(w[0]))


def test_numpy_rstd_with_a_dask_x():
    """The backward's rstd of the chunks' library is lifted as weight is."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 2, 4)).astype(np.float32)
    dy = rng.standard_normal((6, 2, 4)).astype(np.float32)
    w = rng.standard_normal(4).astype(np.float32)
    xd, dyd = da.from_array(x, chunks=(4, 1, 4)), da.from_array(dy, chunks=(3, 2, 4))
    _, rstd = pn.rms_norm(x, w, return_rstd=True, eps=1e-5)
    want = pn.rms_norm_backward(dy, x, w, rstd=rstd, eps=1e-5)
    got = pn.rms_norm_backward(dyd, xd, w, rstd=rstd, eps=1e-5)
    assert all(isinstance(g, da.Array) for g in got[:2])
    for g, v in zip(dask.compute(*got[:2], scheduler="sync"), want[:2], strict=True):
        _same_bits(g, v)
    # the recomputed-rstd call would give other bits: the given one is used
    got = pn.rms_norm_backward(dyd, xd, w, rstd=rstd * 2, eps=1e-5)
    want = pn.rms_norm_backward(dy, x, w, rstd=rstd * 2, eps=1e-5)
    _same_bits(got[0].compute(scheduler="sync"), want[0])
    with pytest.raises(ValueError, match="rstd"):
        pn.rms_norm_backward(dyd, xd, w, rstd=rstd[:5])
    with pytest.raises(TypeError, match="rstd"):
        pn.rms_norm_backward(dyd, xd, w, rstd=rstd.astype(np.float64))


def _masked(a, mask, chunks):
    """``a``'s rows where ``mask`` holds, as a dask array of unknown chunk sizes."""
    return da.from_array(a, chunks=chunks)[mask]


def test_unknown_chunk_sizes(client):
    """After boolean indexing dask knows neither the rows nor the chunk sizes: every
    row is normalized on its own, so each block is, with the in-memory bits (dweight's
    too: the chunks' row numbers are counted when they are computed)."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((30, 3, 16)).astype(np.float32)
    r, dy, z = (rng.standard_normal(x.shape).astype(np.float32) for _ in range(3))
    w, b = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    keep = x[:, 0, 0] > -0.3
    mask = da.from_array(keep, chunks=3)
    xu, ru, dyu, zu = (_masked(a, mask, (3, 2, 8)) for a in (x, r, dy, z))
    xm, rm, dym, zm = x[keep], r[keep], dy[keep], z[keep]
    # more chunks than the fan-in: dweight's states merge over two levels
    assert np.isnan(xu.shape[0]) and len(xu.chunks[0]) == 10 > dask_backend.SPLIT_EVERY
    graphs, wants = [], []
    for axis, ww, bb in ((-1, w, b), ((1, 2), np.tile(w, (3, 1)), None), (1, w[:3], None)):
        with dask.config.set(scheduler=_no_compute):
            y, h, rstd = pn.add_rms_norm(xu, ru, ww, bb, axis=axis, return_rstd=True)
            dx, dw, db = pn.rms_norm_backward(dyu, h, ww, bb, axis=axis, rstd=rstd,
                                              grad_residual=dyu)
            dx2, dw2, _ = pn.rms_norm_backward(dyu, xu, ww, axis=axis)  # rstd recomputed
        graphs += [y, h, rstd, dx, dw, dx2, dw2]
        ym, hm, rstdm = pn.add_rms_norm(xm, rm, ww, bb, axis=axis, return_rstd=True)
        dxm, dwm, _ = pn.rms_norm_backward(dym, hm, ww, bb, axis=axis, rstd=rstdm,
                                           grad_residual=dym)
        dx2m, dw2m, _ = pn.rms_norm_backward(dym, xm, ww, axis=axis)
        wants += [ym, hm, rstdm, dxm, dwm, dx2m, dw2m]
    graphs += [*pn.rms_norm_gated(xu, zu, w, group_size=8, return_rstd=True),
               *pn.rms_norm_quant(xu, w, residual=ru, dtype="int8")]
    wants += [*pn.rms_norm_gated(xm, zm, w, group_size=8, return_rstd=True),
              *pn.rms_norm_quant(xm, w, residual=rm, dtype="int8")]
    for got, want in zip(client.compute(graphs, sync=True), wants, strict=True):
        _same_bits(got, want)
    # a token chunk whose rows are all masked out, and every row masked out
    none = da.from_array(np.zeros(30, bool), chunks=7)
    dx, dw, db = pn.rms_norm_backward(_masked(dy, none, (7, 3, 16)), _masked(x, none, (7, 3, 16)),
                                      w, b)
    dx, dw, db = dask.compute(dx, dw, db, scheduler="sync")
    assert dx.shape == (0, 3, 16)
    _same_bits(dw, np.zeros(16, np.float32))
    _same_bits(db, np.zeros(16, np.float32))


def test_unknown_chunk_sizes_errors():
    x = np.random.default_rng(9).standard_normal((12, 4, 8)).astype(np.float32)
    xd = da.from_array(x, chunks=(5, 2, 8))
    keep = xd[:, 0, 0] > 0
    xu = xd[keep]
    _, rstd = pn.rms_norm(xu, return_rstd=True)
    with pytest.raises(ValueError, match="normalized axes"):
        pn.rms_norm(xu, axis=0)
    for chunks in ((5, 2, 8), (5, 4, 8)):  # unknown, not the first token axis
        xc = da.from_array(x, chunks=chunks)
        with pytest.raises(ValueError, match=r"axis 1 unknown"):
            pn.rms_norm(xc[:, xc[0, :, 0] > 0])
    with pytest.raises(ValueError, match="residual must be chunked as x"):
        pn.add_rms_norm(xu, da.from_array(x, chunks=(3, 4, 8))[keep.rechunk(3)])
    with pytest.raises(ValueError, match="residual must have shape"):
        pn.add_rms_norm(xu, xd)
    with pytest.raises(ValueError, match="rstd must be chunked as x"):
        pn.rms_norm_backward(xu, xu, rstd=rstd.compute())  # numpy: lifted in one chunk
    with pytest.raises(ValueError, match="out="):
        pn.rms_norm(xu, out=xu * 0)
    # blocks as many as x's but other sizes: caught by the chunk task, naming the array
    y, h = pn.add_rms_norm(xu, xd[xd[:, 0, 0] < 0])
    with pytest.raises(ValueError, match="residual has"):
        dask.compute(y, h, scheduler="sync")
    # ... unless it is moved first
    xc = da.moveaxis(da.from_array(x, chunks=(5, 2, 8))[:, xd[0, :, 0] > 0], 1, 0)
    want = pn.rms_norm(np.moveaxis(x[:, x[0, :, 0] > 0], 1, 0))
    _same_bits(pn.rms_norm(xc).compute(scheduler="sync"), want)


def test_graphs_never_respec_a_key_of_the_callers():
    """Every key the caller's arrays already have keeps its spec in polynorm's graphs
    (a second spec under one key makes distributed warn and can deadlock it)."""
    for dt, chunks, weighted, masked in ((np.float16, (16, 32), True, False),
                                         (np.float32, (16, 16), True, False),
                                         (np.float32, (16, 32), False, False),
                                         (np.float32, (16, 16), True, True)):
        x = da.random.default_rng(1).standard_normal((64, 32), chunks=chunks).astype(dt)
        if masked:  # unknown chunk sizes: the row tree counts the rows in the graph
            x = x[x[:, 0] > 0]
        w = da.ones(32, dtype=dt, chunks=32) if weighted else None
        y, rstd = pn.rms_norm(x, w, return_rstd=True)
        dy = (y * 2).astype(dt)
        caller = {**dict(x.__dask_graph__()), **dict(dy.__dask_graph__())}
        for out in (pn.rms_norm_backward(dy, x, w, rstd=rstd), pn.add_rms_norm(x, dy, w)):
            ours = {}
            for a in out:
                if a is not None:
                    ours.update(dict(a.__dask_graph__()))
            shared = [k for k in caller if k in ours]
            assert shared
            assert [k for k in shared if ours[k] != caller[k]] == []
