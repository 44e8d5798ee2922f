"""The CUDA kernels of the split hidden axis (pn_split_stats, pn_split_fwd), run on the CPU
by the emulator through the cupy backend's own code (the stand-in cupy of
test_emul_cupy_backend.py), and their launch rule.

The one-shard rule: ``split_forward(x, sumsq=split_stats(x), d_total=d)`` gives the
emulated CUDA forward's y and rstd bits (float32 compute), where the stats kernel sums
over the forward's tree for that d.  The normalize kernel, given the same float64 sums,
gives the Numba split kernels' bits (the same formula in the same order).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import test_emul_cupy_backend as E
from _oracle import Tol, assert_close

from polynorm.backends import SplitKernels
from polynorm.backends import cuda as cupy_backend
from polynorm.backends import numba as numba_backend
from polynorm.backends.cuda import launch as cl
from polynorm.backends.cuda import nvrtc as _nvrtc
from polynorm.core.options import Options, make_plan


@pytest.fixture
def fake_cupy(monkeypatch):
    """The stand-in cupy with (stubbed) NVRTC cubins, as test_emul_cupy_backend.py's."""
    monkeypatch.setitem(sys.modules, "cupy", E._make_fake_cupy(3, 227 * 1024))
    monkeypatch.setattr(_nvrtc, "available", lambda: (True, "stubbed"))
    monkeypatch.setattr(_nvrtc, "cached_cubin", E._stub_cached_cubin)
    monkeypatch.setattr(cupy_backend, "_kernels", {})
    monkeypatch.setattr(cupy_backend, "_device_info", {})
    E._POINTERS.clear()
    E._Kernel.launches.clear()
    yield
    E._POINTERS.clear()


def _plan(d, dtype, **kw):
    o = dict(eps=1e-5, partial=1.0, offset=0.0, eps_mode="inside", casting="fp32", out_dtype=None)
    o.update(kw)
    return make_plan(d, dtype, Options(**o))


def _rows(rng, n, d, dtype):
    x = rng.standard_normal((n, d)) * np.exp(rng.uniform(-3, 3, (n, 1)))
    return x.astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def _exact_sumsq(x):
    """float64 sum of squares with every square exact (a float32 square fits a float64):
    the shard sums' value up to their float runs' rounding."""
    v = np.asarray(x).astype(np.float64)
    return np.sum(v * v, axis=1)


# pn_fwd_small (d <= 256), pn_fwd (registers), pn_fwd_big (two slices, a tail) rows
ONE_SHARD = [("float32", 37), ("float32", 1001), ("float16", 300), ("bfloat16", 72), ("float32", 9003)]


@pytest.mark.parametrize("dtype,d", ONE_SHARD)
def test_emul_split_one_shard_bits_equal_the_cuda_forward(fake_cupy, dtype, d):
    rng = np.random.default_rng(d)
    n = 3 if d > 4096 else 6
    x = _rows(rng, n, d, dtype)
    if n > 3:
        x[1] = 0.0  # rstd = 1/sqrt(eps)
        x[2, 5] = np.inf  # rstd = 0, y NaN at the Inf
        x[3, 0] = np.nan
        x[4] = (x[4] * 1e3).astype(dtype) if dtype == "float16" else x[4] * np.float32(1e22)
    w = rng.standard_normal(d).astype(np.float32)
    b = rng.standard_normal(d).astype(np.float32)
    plan = _plan(d, dtype, offset=1.0, eps_mode="outside" if d == 1001 else "inside")
    fx, fw, fb = (E._fake(a.copy()) for a in (x, w, b))
    y, _, rstd = cupy_backend.forward(fx, None, fw, fb, plan)
    E._Kernel.launches.clear()
    ss = cupy_backend.split_stats(fx, plan)
    y1, r1 = cupy_backend.split_forward(fx, fw, fb, ss, d, plan)
    assert [nm.split("<")[0] for nm, *_ in E._Kernel.launches] == ["pn_split_stats", "pn_split_fwd"]
    assert ss.dtype == np.float64 and y1.dtype == y.dtype and r1.dtype == rstd.dtype
    np.testing.assert_array_equal(_bits(r1), _bits(rstd))
    np.testing.assert_array_equal(_bits(y1), _bits(y))
    ok = np.isfinite(x).all(axis=1)
    np.testing.assert_allclose(np.asarray(ss)[ok], _exact_sumsq(x)[ok], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(fx), x)  # input untouched


def _tree_sumsq(x, tpr: int, span: int, tail_first: bool) -> np.ndarray:
    """The forward's row sum written out (codegen/templates/common.cu.j2, forward.cu.j2):
    chunk c's squares summed as one float run (exact for the data below), thread tr
    adding chunks tr, tr + tpr, ... of a slice in order, the tail element first
    (pn_fwd_big) or last (pn_fwd), the xor butterfly over the tpr threads (warps'
    results added from warp 0 for tpr > 32), slice sums added from slice 0 up."""
    n, d = x.shape
    vec = 16 // x.dtype.itemsize
    body, tail = d // vec, d % vec
    out = np.empty(n)
    for i in range(n):
        v = x[i].astype(np.float64)
        runs = [float(np.sum(v[c * vec:(c + 1) * vec] ** 2)) for c in range(body)]
        tails = [float(v[body * vec + t] ** 2) for t in range(tail)]
        nsl = -(-body // span) if body > span else 1
        total = 0.0
        for sl in range(nsl):
            acc = [0.0] * tpr
            for tr in range(tpr):
                if sl == 0 and tail_first and tr < tail:
                    acc[tr] += tails[tr]
                for c in range(sl * span + tr, min(body, (sl + 1) * span), tpr):
                    acc[tr] += runs[c]
                if sl == 0 and not tail_first and tr < tail:
                    acc[tr] += tails[tr]
            lim = min(tpr, 32)
            for w0 in range(0, tpr, lim):
                o = lim // 2
                while o:
                    acc[w0:w0 + lim] = [acc[w0 + t] + acc[w0 + (t ^ o)] for t in range(lim)]
                    o //= 2
            s = acc[0]
            for w0 in range(lim, tpr, lim):
                s = s + acc[w0]
            total = s if sl == 0 else total + s
        out[i] = total
    return out


@pytest.mark.parametrize("dtype,d", ONE_SHARD)
def test_emul_split_stats_is_the_forward_tree(fake_cupy, dtype, d):
    """Chunks of small integers times powers of two far apart: every float run is
    exact, so the sum's bits are set by the double adds' order alone, which the tree
    written out in the test fixes."""
    rng = np.random.default_rng(d + 1)
    n, vec = 4, 16 // np.dtype(dtype).itemsize
    lo, hi = (-10, 5) if dtype == "float16" else (-9, 9)
    ints = rng.integers(1, 1024, (n, d)) * rng.choice([-1, 1], (n, d))
    scale = np.repeat(2.0 ** rng.integers(lo, hi, (n, -(-d // vec))), vec, axis=1)[:, :d]
    x = (ints * scale).astype(dtype)
    fl = cl.forward_launch(n, d, dtype, small=False, split=False, rows=False)  # the tree (pn_fwd_rows keeps it)
    assert fl.big == (d > 8192)
    if fl.big:  # thread 0's three leaves: tail 1, chunk 0's run 2, chunk tpr's 2**54
        x[0] = 0
        x[0, d // vec * vec] = x[0, 0] = x[0, 1] = 1
        x[0, fl.tpr * vec] = 2.0**27  # tail first: 2**54 + 4; last: 2**54
    span = cl.slice_span(d, dtype) if fl.big else d // vec
    want = _tree_sumsq(x, fl.tpr, span, fl.big)
    got = np.asarray(cupy_backend.split_stats(E._fake(x), _plan(d, dtype)))
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_emul_split_matches_numba_split_kernels(fake_cupy, dtype):
    """Given the same float64 sums, pn_split_fwd writes the Numba split kernels' bits;
    the two shard sums agree to rounding (their trees differ); two shards' sums give
    the unsplit forward within rounding."""
    rng = np.random.default_rng(5)
    n, d = 5, 200
    x = _rows(rng, n, d, dtype)
    w = rng.standard_normal(d).astype(dtype)
    b = rng.standard_normal(d).astype(np.float32)
    plan = _plan(d, dtype, offset=0.5, out_dtype="float32")
    total = _exact_sumsq(x)
    shard = slice(64, 136)
    xs = np.ascontiguousarray(x[:, shard])
    ws, bs = w[shard].copy(), b[shard].copy()
    splan = _plan(xs.shape[1], dtype, offset=0.5, out_dtype="float32")
    fx, fw, fb = (E._fake(a.copy()) for a in (xs, ws, bs))
    y1, r1 = cupy_backend.split_forward(fx, fw, fb, E._fake(total.copy()), d, splan)
    y2, r2 = numba_backend.split_forward(xs, ws, bs, total, d, splan)
    np.testing.assert_array_equal(_bits(r1), _bits(r2))
    np.testing.assert_array_equal(_bits(y1), _bits(y2))
    # the stats kernel on a column shard (an unaligned one: element by element)
    s1 = np.asarray(cupy_backend.split_stats(E._fake(x)[:, 3:103], splan))
    s2 = numba_backend.split_stats(np.ascontiguousarray(x[:, 3:103]), splan)
    np.testing.assert_allclose(s1, s2, rtol=1e-6)
    # two shards' sums added: within rounding of the unsplit CUDA forward
    fxall = E._fake(x.copy())
    y, _, rstd = cupy_backend.forward(fxall, None, E._fake(w.copy()), E._fake(b.copy()), plan)
    halves = [E._fake(np.ascontiguousarray(x[:, :120])), E._fake(np.ascontiguousarray(x[:, 120:]))]
    ss = np.asarray(cupy_backend.split_stats(halves[0], plan)) + np.asarray(
        cupy_backend.split_stats(halves[1], plan))
    ya, ra = cupy_backend.split_forward(halves[1], E._fake(w[120:].copy()), E._fake(b[120:].copy()),
                                        E._fake(ss), d, plan)
    assert_close(np.asarray(ra), np.asarray(rstd), Tol(1e-6, 1e-6))
    assert_close(np.asarray(ya), np.asarray(y)[:, 120:], Tol(1e-5, 1e-5))


def test_split_launch_rule_follows_the_forward():
    """pn_split_stats takes the tree of the forward kernel of the same d (pn_fwd's for
    the rows pn_fwd_small takes, pn_fwd_big's slices otherwise); both launches are whole
    warps, cover every row, and name compiled specialisations."""
    names = set(cl.specialisations())
    for x in ("float16", "bfloat16", "float32", "float64"):
        vec = cl.VEC[x]
        for d in (1, 3, 37, 256, 1001, 4096, 8192, 9003, 65536, 262144):
            for n in (1, 5, 1000):
                sl = cl.split_stats_launch(n, d, x)
                fl = cl.forward_launch(n, d, x, small=False, split=False, rows=False)
                assert sl.name in names and sl.tpr == fl.tpr and sl.tail_first == fl.big
                if fl.big and x != "float64":
                    assert sl.span == cl.slice_span(d, x) and sl.block == sl.tpr
                else:
                    assert sl.span * 1 >= d // vec  # one slice
                for la in (sl, cl.split_forward_launch(n, d, x)):
                    assert la.block % 32 == 0 and 32 <= la.block <= cl.FUSE_THREADS
                    assert la.block % la.tpr == 0 and la.grid * (la.block // la.tpr) >= n
                    assert la.name in names
        for t in cl.FWD_TYPES:
            if t[0] == t[1]:
                assert cl.split_forward_launch(4, 64, t[0], t[2], t[3]).name in names
    assert isinstance(cupy_backend, SplitKernels)


def test_nvrtc_split_kernels_compile_without_spills():
    """The split kernels alone for sm_90 (the whole unit: tests/test_nvrtc.py, slow suite):
    no warning, no spill."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) is not installed")
    ok, why = _nvrtc.available()
    if not ok:
        pytest.skip(why)
    from polynorm.bench import sass

    names = cl.split_specialisations()
    res = _nvrtc.compile_names(names, "sm_90", ("--ptxas-options=-v",))
    assert res.ok, res.log
    assert "warning" not in res.log.lower(), res.log
    assert set(res.lowered) == set(names)
    spills = sass.ptxas_spills(res.log)
    assert len(spills) == len(names)
    assert all(s == (0, 0) for s in spills.values()), spills


@pytest.mark.parametrize("dtype,dy_dtype,mode", [("float32", "float32", "inside"),
                                                 ("float16", "float32", "outside"),
                                                 ("float16", "float16", "inside")])
def test_emul_split_backward_matches_the_reference(fake_cupy, dtype, dy_dtype, mode):
    """pn_split_dot: the reference's split_dot to rounding (another summation order);
    pn_split_bwd: the reference's split_backward dx bits, dweight/dbias to rounding
    (summed in double by pn_colsum)."""
    from polynorm.backends import reference

    rng = np.random.default_rng(9)
    n, d, d_total = 5, 70, 100
    x = _rows(rng, n, d, dtype)
    dy = rng.standard_normal((n, d)).astype(dy_dtype)
    w = rng.standard_normal(d).astype(np.float32)
    b = rng.standard_normal(d).astype(dtype)
    total = _exact_sumsq(x) + rng.uniform(1, 50, n)  # the other shards' part
    plan = _plan(d, dtype, offset=0.5, eps_mode=mode)
    fdy, fx, fw, fb = (E._fake(a.copy()) for a in (dy, x, w, b))
    dot = np.asarray(cupy_backend.split_dot(fdy, fx, fw, E._fake(total.copy()), d_total, plan))
    want_dot = reference.split_dot(dy, x, w, total, d_total, plan)
    assert dot.dtype == np.float64
    np.testing.assert_allclose(dot, want_dot, rtol=1e-6, atol=1e-9)
    dot = dot + rng.uniform(-5, 5, n)  # the other shards' part
    dx, dw, db = cupy_backend.split_backward(fdy, fx, fw, fb, E._fake(total.copy()),
                                             E._fake(dot.copy()), d_total, plan)
    rdx, rdw, rdb = reference.split_backward(dy, x, w, b, total, dot, d_total, plan)
    assert dx.dtype == rdx.dtype and dw.dtype == rdw.dtype and db.dtype == rdb.dtype
    np.testing.assert_array_equal(_bits(dx), _bits(rdx))
    assert_close(np.asarray(dw), rdw, Tol(1e-5, 1e-5))
    assert_close(np.asarray(db), rdb, Tol(2e-3, 2e-3) if dtype == "float16" else Tol(1e-5, 1e-5))
    no_w = cupy_backend.split_backward(fdy, fx, None, None, E._fake(total.copy()),
                                       E._fake(dot.copy()), d_total, plan)
    assert no_w[1] is None and no_w[2] is None
    np.testing.assert_array_equal(
        _bits(no_w[0]), _bits(reference.split_backward(dy, x, None, None, total, dot, d_total,
                                                       plan)[0]))


@pytest.mark.parametrize("mode", ["inside", "outside"])
def test_emul_split_backward_matches_finite_differences(fake_cupy, mode):
    """float64, two shards: the CUDA split backward (dot of each shard summed, then dx,
    dweight, dbias per shard) against central differences of sum(G * y), y the CUDA
    split forward of the shards."""
    rng = np.random.default_rng(21)
    n, d, h = 3, 8, 1e-6
    cuts = (slice(0, 3), slice(3, 8))
    x, g = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    w, b = rng.standard_normal(d), rng.standard_normal(d)
    plan = {c.start: _plan(c.stop - c.start, "float64", eps=0.1, offset=0.5, eps_mode=mode)
            for c in cuts}

    def f(a):
        return E._fake(np.ascontiguousarray(a))

    def loss(x, w, b):
        total = sum(np.asarray(cupy_backend.split_stats(f(x[:, c]), plan[c.start])) for c in cuts)
        ys = [cupy_backend.split_forward(f(x[:, c]), f(w[c]), f(b[c]), f(total), d,
                                         plan[c.start])[0]
              for c in cuts]
        return float(np.sum(g * np.concatenate([np.asarray(y) for y in ys], axis=1)))

    def fd(arr, i):
        up, dn = arr.copy(), arr.copy()
        up[i] += h
        dn[i] -= h
        args = {"x": x, "w": w, "b": b}
        name = next(k for k, v in args.items() if v is arr)
        return (loss(**{**args, name: up}) - loss(**{**args, name: dn})) / (2 * h)

    total = np.sum(x * x, axis=1)
    dot = sum(np.asarray(cupy_backend.split_dot(f(g[:, c]), f(x[:, c]), f(w[c]), f(total), d,
                                                plan[c.start])) for c in cuts)
    parts = [cupy_backend.split_backward(f(g[:, c]), f(x[:, c]), f(w[c]), f(b[c]), f(total),
                                         f(dot), d, plan[c.start]) for c in cuts]
    dx = np.concatenate([np.asarray(p[0]) for p in parts], axis=1)
    dw = np.concatenate([np.asarray(p[1]) for p in parts])
    db = np.concatenate([np.asarray(p[2]) for p in parts])
    for got, arr in ((dx, x), (dw, w), (db, b)):
        want = np.array([fd(arr, i) for i in np.ndindex(arr.shape)]).reshape(arr.shape)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
