"""Numba-backend specific tests: codecs, sizes, layouts, determinism, threads, caching.

The backend-parametrised suite already runs on numba through the ``numba``
case of ``conftest.py``; this file checks what only a compiled CPU backend
can get wrong.  Ground truth is the extended-precision oracle ``_oracle``.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from _oracle import NP_DTYPES, TOL, assert_close
from _oracle import backward as oracle_backward
from _oracle import forward as oracle_forward

import polynorm as pn

numba = pytest.importorskip("numba")
if not pn.backends()["numba"][0]:  # pragma: no cover
    pytest.skip("numba backend unusable", allow_module_level=True)

from polynorm.backends import numba as nb  # noqa: E402
from polynorm.backends.numba import codec  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# --------------------------------------------------------------------------- codecs


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_decode_every_bit_pattern(name):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = codec.decode_array(bits, name == "bfloat16")
    want = bits.view(HALF[name]).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def _encode_sample(rng, src):
    """Random bit patterns plus every half-precision midpoint and its neighbours."""
    if src == np.float32:
        v = rng.integers(0, 1 << 32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    else:
        v = rng.integers(0, 1 << 64, 400_000, dtype=np.uint64).view(np.float64)
        v = np.concatenate([v, rng.standard_normal(100_000) * 10.0 ** rng.integers(-12, 6, 100_000)])
    # midpoints between adjacent half values (exact in float32), nudged by one float64/32 ulp
    h = np.arange(1 << 16, dtype=np.uint32)
    mids_bf = ((h << 16) | 0x8000).view(np.float32)
    f16 = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    mids_f16 = (f16[:-1] / 2 + f16[1:] / 2).astype(np.float32)
    with np.errstate(all="ignore"):
        mids = np.concatenate([mids_bf, mids_f16, -mids_f16]).astype(src)
    mids = mids[np.isfinite(mids)]
    return np.concatenate([v, mids, np.nextafter(mids, src(np.inf)), np.nextafter(mids, src(0))])


@pytest.mark.parametrize("src", [np.float32, np.float64], ids=["from32", "from64"])
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_encode_matches_ml_dtypes(name, src, rng):
    v = _encode_sample(rng, src)
    got = codec.encode_array(v, name == "bfloat16")
    with np.errstate(all="ignore"):
        want = v.astype(HALF[name]).view(np.uint16)
    nan = np.isnan(v)
    assert np.isnan(got[nan].view(HALF[name]).astype(np.float32)).all()
    bad = (got != want) & ~nan
    if src == np.float64 and name == "bfloat16":
        # ml_dtypes rounds float64 -> bfloat16 through float32 for some values (a
        # double rounding); accept ours where it is the correctly rounded one
        bad[bad] = ~_correctly_rounded(v[bad], got[bad], HALF[name])
    assert not bad.any(), (v[bad][:5], got[bad][:5], want[bad][:5])


def _correctly_rounded(v, bits, dt):
    """Is ``bits`` the nearest ``dt`` value to ``v`` (ties to even)?  Judged in long double."""
    mine = bits.view(dt).astype(np.longdouble)
    up = np.where(v >= 0, bits + 1, bits - 1).astype(np.uint16).view(dt).astype(np.longdouble)
    dn = np.where(v >= 0, bits - 1, bits + 1).astype(np.uint16).view(dt).astype(np.longdouble)
    e = np.abs(v.astype(np.longdouble) - mine)
    e_up = np.abs(v.astype(np.longdouble) - up)
    e_dn = np.abs(v.astype(np.longdouble) - dn)
    even = (bits & 1) == 0
    return ((e < e_up) | ((e == e_up) & even)) & ((e < e_dn) | ((e == e_dn) & even))


# --------------------------------------------------------------------------- sizes and dtypes


def _data(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(NP_DTYPES[dtype])


@pytest.mark.parametrize("d", [1, 3, 127, 4096, 262144])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward_sizes(d, dtype, rng):
    n = 3 if d == 262144 else 5
    x = _data(rng, (n, d), dtype)
    w = _data(rng, d, dtype)
    b = _data(rng, d, dtype)
    y, rstd = pn.rms_norm(x, w, b, return_rstd=True, backend="numba")
    want, want_rstd = oracle_forward(x, w, b)
    assert y.dtype == x.dtype and rstd.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert_close(y, want, dtype, "y")
    assert_close(rstd, want_rstd, "float32" if dtype != "float64" else "float64", "rstd")
    dy = _data(rng, (n, d), dtype)
    dx, dw, db = pn.rms_norm_backward(dy, x, w, b, rstd=rstd, backend="numba")
    wdx, wdw, wdb = oracle_backward(dy, x, w, b)
    tol = TOL[dtype]._replace(rtol=max(TOL[dtype].rtol, 4e-5)) if d > 4096 else TOL[dtype]
    # dx's two terms can cancel (d = 1 cancels almost exactly): judge against their size
    terms = np.abs(dy.astype(np.float64) * w.astype(np.float64) * want_rstd[:, None]).max()
    assert_close(dx, wdx, tol, "dx", scale=max(terms, np.abs(wdx).max()))
    assert_close(dw, wdw, tol, "dweight")
    assert_close(db, wdb, tol, "dbias")


@pytest.mark.parametrize("xdt,wdt,rdt", [
    ("bfloat16", "float32", "float32"), ("float16", "bfloat16", "float16"),
    ("float32", "float64", "bfloat16"), ("float64", "float16", "float32"),
])
@pytest.mark.parametrize("casting", ["fp32", "llama"])
def test_mixed_dtypes_fused_add(xdt, wdt, rdt, casting, rng):
    x = _data(rng, (6, 40), xdt)
    res = _data(rng, (6, 40), rdt)
    w = _data(rng, 40, wdt)
    y, h = pn.add_rms_norm(x, res, w, offset=0.5, partial=0.7, casting=casting, backend="numba")
    yr, hr = pn.add_rms_norm(x, res, w, offset=0.5, partial=0.7, casting=casting,
                             backend="array_api")
    assert h.dtype == hr.dtype and y.dtype == yr.dtype
    np.testing.assert_array_equal(h, hr)  # one rounding of an exact sum: bit-exact
    want, _ = oracle_forward(h, w, offset=0.5, partial=0.7, casting=casting)
    assert_close(y, want, y.dtype.name if y.dtype != NP_DTYPES["bfloat16"] else "bfloat16", "y")


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_out_dtype_rounds_once(out_dtype, rng):
    x = _data(rng, (4, 33), "float64")
    y = pn.rms_norm(x, out_dtype=out_dtype, eps_mode="outside", backend="numba")
    want, _ = oracle_forward(x, eps_mode="outside")
    assert y.dtype == NP_DTYPES[out_dtype]
    if out_dtype == "float64":
        assert_close(y, want, "float64", "y")
    else:  # float64 math rounded once: the correctly rounded value (ties are improbable)
        np.testing.assert_array_equal(y, want.astype(NP_DTYPES[out_dtype]))


# --------------------------------------------------------------------------- layouts and out=


@pytest.mark.parametrize("view", ["rows2", "rows_neg", "cols_neg", "cols2", "transposed"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_strided_inputs(view, dtype, rng):
    base = _data(rng, (12, 66), dtype)
    x = {"rows2": base[::2, :33], "rows_neg": base[::-1, 1:34], "cols_neg": base[:, ::-2],
         "cols2": base[1::3, ::2], "transposed": base[:, :12].T}[view]
    before = base.copy()
    w = _data(rng, x.shape[1], "float32")
    y = pn.rms_norm(x, w, backend="numba")
    want, _ = oracle_forward(np.ascontiguousarray(x), w)
    assert_close(y, want, dtype, view)
    dy = _data(rng, x.shape, dtype)[::-1]
    dx, dw, _ = pn.rms_norm_backward(dy, x, w, backend="numba")
    wdx, wdw, _ = oracle_backward(np.ascontiguousarray(dy), np.ascontiguousarray(x), w)
    assert_close(dx, wdx, dtype, "dx")
    assert_close(dw, wdw, dtype, "dweight")
    np.testing.assert_array_equal(base, before)  # the input is never written


def test_out_in_place_allocates_no_token_arrays(rng):
    n, d = 64, 4096
    x = _data(rng, (n, d), "float32")
    w = _data(rng, d, "float32")
    want = pn.rms_norm(x, w, backend="numba")
    out = np.empty_like(x)
    pn.rms_norm(x, w, out=out, backend="numba")  # warm up
    tracemalloc.start()
    try:
        r = pn.rms_norm(x, w, out=out, backend="numba")
        r2 = pn.rms_norm(x, w, out=x, backend="numba")  # x itself as out
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r is out and r2 is x
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(x, want)
    assert peak < n * d * 4 // 8, peak


def test_strided_out(rng):
    x = _data(rng, (8, 20), "float16")
    big = np.zeros((16, 20), np.float16)
    out = big[::-2]
    r = pn.rms_norm(x, out=out, backend="numba")
    assert r is out
    np.testing.assert_array_equal(big[::-2], pn.rms_norm(x, backend="numba"))
    assert not big[-2::-2].any()



@pytest.mark.parametrize("xdt,wdt,out_dtype", [("float32", "float32", None),
                                               ("float64", "float32", None),
                                               ("float32", "bfloat16", None),
                                               ("float32", None, "bfloat16"),
                                               ("float32", "float64", None),
                                               ("bfloat16", "bfloat16", None),
                                               ("float16", None, "float32")])
# serial and parallel; 16-bit rows of 2051 take the pipeline (chunks of 512) and its tail
@pytest.mark.parametrize("n,d", [(3, 1), (5, 13), (7, 300), (40, 2051)])
def test_streamed_out_equals_ordinary(monkeypatch, xdt, wdt, out_dtype, n, d, rng):
    """out= rows written with streaming stores (numba.stream) have the bits of
    ordinary stores, whatever the out array's alignment; nothing beside it moves."""
    x = _data(rng, (n, d), xdt)
    x[0] *= 1e-40 if xdt == "float32" else 1.0  # a row whose rstd overflows float32 (eps=0)
    w = None if wdt is None else _data(rng, d, wdt)
    b = _data(rng, d, "float32")
    calls = []
    real = nb._stage
    monkeypatch.setattr(nb, "_stage", lambda yk, stream: calls.append(stream) or real(yk, stream))
    for kw in ({}, {"bias": b, "offset": 1.0}, {"partial": 0.5, "eps_mode": "outside"}):
        if d == 1 and "partial" in kw:
            continue
        opts = dict(eps=0.0, return_rstd=True, out_dtype=out_dtype, backend="numba", **kw)
        monkeypatch.setattr(nb, "STREAM_MIN_BYTES", 1 << 62)
        want, want_rstd = pn.rms_norm(x, w, **opts)
        monkeypatch.setattr(nb, "STREAM_MIN_BYTES", 0)
        monkeypatch.setattr(nb, "STREAM_MIN_ROW_BYTES_16", 0)
        monkeypatch.setattr(nb, "STREAM_16", True)  # whatever the CPU
        for shift in range(4):  # the rows' first line boundary moves
            big = np.full((n, d + 8), 7, want.dtype)
            out = big[:, shift:shift + d]
            got, rstd = pn.rms_norm(x, w, out=out, **opts)
            assert got is out and calls[-1] is True
            np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
            np.testing.assert_array_equal(rstd, want_rstd)
            assert (big[:, :shift] == 7).all() and (big[:, shift + d:] == 7).all()
    if out_dtype is None and wdt == xdt:  # in place: out is x itself
        xc = x.copy()
        pn.rms_norm(xc, w, out=xc, eps=0.0, backend="numba")
        np.testing.assert_array_equal(xc, pn.rms_norm(x, w, eps=0.0, backend="numba"))


def test_streaming_only_for_large_out(monkeypatch, rng):
    """Ordinary stores below STREAM_MIN_BYTES; streaming above, for out= and the
    forward's own output (memory from the output pool)."""
    x = _data(rng, (64, 256), "float32")
    calls = []
    real = nb._stage
    monkeypatch.setattr(nb, "_stage", lambda yk, stream: calls.append(stream) or real(yk, stream))
    monkeypatch.setattr(nb, "STREAM_MIN_BYTES", x.nbytes + 1)
    pn.rms_norm(x, out=np.empty_like(x), backend="numba")
    pn.rms_norm(x, backend="numba")
    monkeypatch.setattr(nb, "STREAM_MIN_BYTES", x.nbytes)
    pn.rms_norm(x, out=np.empty_like(x), backend="numba")
    pn.rms_norm(x, out=np.empty((64, 512), np.float32)[:, ::2], backend="numba")  # strided
    pn.rms_norm(x, backend="numba")
    assert calls == [False, False, True, False, True]
    # 16-bit rows: from STREAM_MIN_ROW_BYTES_16 on, where STREAM_16
    xb = _data(rng, (64, 256), "bfloat16")
    monkeypatch.setattr(nb, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(nb, "STREAM_16", True)
    monkeypatch.setattr(nb, "STREAM_MIN_ROW_BYTES_16", 2 * 256 + 2)
    pn.rms_norm(xb, out=np.empty_like(xb), backend="numba")
    monkeypatch.setattr(nb, "STREAM_MIN_ROW_BYTES_16", 2 * 256)
    pn.rms_norm(xb, out=np.empty_like(xb), backend="numba")
    pn.add_rms_norm(xb, xb, out=np.empty_like(xb), backend="numba")  # never with a residual
    monkeypatch.setattr(nb, "STREAM_16", False)
    pn.rms_norm(xb, out=np.empty_like(xb), backend="numba")
    pn.rms_norm(x, out=np.empty_like(x), backend="numba")  # float32 rows stream anyway
    assert calls[5:] == [False, True, False, False, True]


@pytest.mark.parametrize("avx512", [False, True])
def test_16_bit_rows_stream_where_the_cpu_has_avx512(monkeypatch, avx512):
    """STREAM_16 unset: decided once, from the CPU's avx512f feature."""
    from polynorm.backends.numba import codec as _numba_codec

    asked = []
    monkeypatch.setattr(nb, "STREAM_16", None)
    monkeypatch.setattr(_numba_codec, "host_has", lambda f: asked.append(f) or avx512)
    assert nb._streams_16() is avx512 and nb._streams_16() is avx512
    assert asked == ["avx512f"] and nb.STREAM_16 is avx512


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype,value", [("float32", 1e25), ("bfloat16", 1e30),
                                         ("float32", 1e-30), ("float64", 1e200),
                                         ("float64", 1e-200), ("float16", 6e-8)])
def test_no_spurious_overflow(dtype, value, rng):
    x = (rng.uniform(0.5, 1.5, (3, 64)) * value).astype(NP_DTYPES[dtype])
    x[1, ::2] *= -1
    y, rstd = pn.rms_norm(x, eps=0.0, return_rstd=True, backend="numba")
    want, _ = oracle_forward(x.astype(np.float64), eps=0.0)
    assert_close(y, want, dtype, "y")
    dy = rng.standard_normal(x.shape).astype(x.dtype)
    dx, _, _ = pn.rms_norm_backward(dy, x, eps=0.0, backend="numba")
    wdx, _, _ = oracle_backward(dy, x.astype(np.float64), eps=0.0)
    with np.errstate(over="ignore"):  # float16 dx of 6e-8 rows is ~1e7: Inf is right
        wdx = wdx.astype(x.dtype).astype(np.float64)
    assert_close(dx, wdx, dtype, "dx")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf_isolated_per_token(bad, rng):
    x = _data(rng, (20, 4100), "float32")  # big enough for the parallel kernel
    x[2, 7] = bad
    y = pn.rms_norm(x, backend="numba")
    if np.isnan(bad):
        assert np.isnan(y[2]).all()
    else:  # rstd = 1/sqrt(Inf) = 0: NaN at the Inf, 0 elsewhere (SPEC's formula, torch)
        assert np.isnan(y[2, 7]) and (np.delete(y[2], 7) == 0).all()
    assert np.isfinite(np.delete(y, 2, axis=0)).all()
    dx, dw, _ = pn.rms_norm_backward(np.ones_like(x), x, np.ones(4100, np.float32),
                                     backend="numba")
    assert np.isfinite(np.delete(dx, 2, axis=0)).all()


@pytest.mark.parametrize("eps_mode", ["inside", "outside"])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_float32_out_of_range_rows_match_the_scaled_path(eps, eps_mode):
    """float32 kernels skip the scaled rms scan (their float64 sum is out of range only
    as 0, Inf or NaN): rstd of such rows is the float64 kernels' (which scan), rounded."""
    x = np.ones((6, 8), np.float32)
    x[0] = 0.0
    x[1] = -0.0
    x[2, 3] = np.inf
    x[3, 1] = -np.inf
    x[4, 2] = np.nan
    x[5, 0], x[5, 1] = np.inf, np.nan
    opts = dict(eps=eps, eps_mode=eps_mode, backend="numba", return_rstd=True)
    r32 = pn.rms_norm(x, **opts)[1]
    r64 = pn.rms_norm(x.astype(np.float64), **opts)[1]
    assert r32.dtype == np.float32
    assert np.array_equal(r32.view(np.uint32), r64.astype(np.float32).view(np.uint32))
    dx32 = pn.rms_norm_backward(np.ones_like(x), x, backend="numba", eps=eps, eps_mode=eps_mode)[0]
    dx64 = pn.rms_norm_backward(np.ones_like(x, np.float64), x.astype(np.float64),
                                backend="numba", eps=eps, eps_mode=eps_mode)[0]
    assert np.array_equal(np.isnan(dx32), np.isnan(dx64))


def test_zero_rows_stay_zero():
    x = np.zeros((3, 9), np.float64)
    y = pn.rms_norm(x, np.full(9, 2.0), np.full(9, 0.5), backend="numba")
    np.testing.assert_array_equal(y, np.full((3, 9), 0.5))


# --------------------------------------------------------------------------- determinism, threads


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bits_do_not_depend_on_thread_count(dtype, rng):
    n, d = 1000, 512  # n*d well above the serial threshold
    x = _data(rng, (n, d), dtype)
    w = _data(rng, d, "float32")
    b = _data(rng, d, "float32")
    dy = _data(rng, (n, d), dtype)
    saved = numba.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 1):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            y, rstd = pn.rms_norm(x, w, b, return_rstd=True, backend="numba")
            grads = pn.rms_norm_backward(dy, x, w, b, backend="numba")
            results.append((y, rstd, *grads))
    finally:
        numba.set_num_threads(saved)
    for other in results[1:]:
        for a, b_ in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), b_.view(np.uint8))


def test_concurrent_calls_while_compiling(rng):
    # dtype combinations no other test compiles, so the threads race the compiler
    combos = [("float16", "float64"), ("bfloat16", "float16"), ("float64", "bfloat16"),
              ("float32", "float16")] * 2
    xs = [_data(rng, (40 + 30 * i, 300), xd) for i, (xd, _) in enumerate(combos)]
    ws = [_data(rng, 300, wd) for _, wd in combos]
    results: list = [None] * len(combos)
    errors: list = []
    barrier = threading.Barrier(len(combos))

    def work(i):
        try:
            barrier.wait()
            for _ in range(3):
                y, _h = pn.add_rms_norm(xs[i], xs[i], ws[i], eps_mode="outside", backend="numba")
            results[i] = y
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(combos))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (xd, _) in enumerate(combos):
        h = pn.add_rms_norm(xs[i], xs[i], backend="array_api")[1]
        want, _ = oracle_forward(h, ws[i], eps_mode="outside")
        assert_close(results[i], want, xd, f"thread {i}")


def test_parallel_kernels_run_on_pips_tbb():
    # pip puts libtbb in the environment's lib/, where the loader does not look: without
    # start_threads' preload Numba silently takes OpenMP, whose caller waits for workers
    # that a busy machine has not scheduled (bench/parallel_load.py)
    lib = {"linux": "libtbb.so.12", "darwin": "libtbb.12.dylib"}.get(sys.platform)
    if lib is None or not os.path.exists(os.path.join(sys.prefix, "lib", lib)):
        pytest.skip("pip's tbb is not installed")
    if nb._available_cpus() < 2:
        pytest.skip("one CPU: polynorm leaves TBB out (test_one_cpu_process_...)")
    code = textwrap.dedent("""
        import numba, numpy as np, polynorm as pn
        from polynorm.backends import numba as nb
        x = np.ones((64, nb.SERIAL_MAX_ELEMENTS // 32), np.float32)
        assert nb._parallel(*x.shape)
        y = pn.rms_norm(x, backend="numba")
        print(numba.threading_layer(), bool(np.isfinite(y).all()))
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["tbb", "True"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_one_cpu_process_whose_first_parallel_call_is_off_the_main_thread_exits():
    # TBB starts no worker on one CPU, and a layer started from a thread other than the
    # main one leaves a task that the main thread's wait at exit never gets: the process
    # hung at exit (numba#10556).  polynorm takes another layer there.
    code = textwrap.dedent("""
        import os, threading
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        import numba, numpy as np, polynorm as pn
        from polynorm.backends import numba as nb
        x = np.ones((64, nb.SERIAL_MAX_ELEMENTS // 32), np.float32)
        assert nb._parallel(*x.shape)
        t = threading.Thread(target=lambda: pn.rms_norm(x, backend="numba"))
        t.start()
        t.join()
        print(numba.threading_layer())
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] in ("omp", "workqueue")


def test_read_only_cache_dir_still_works(tmp_path):
    # a cache path below a regular file can never be created, even by root
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = textwrap.dedent("""
        import numpy as np, polynorm as pn
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        y = pn.rms_norm(x, backend="numba")
        ref = pn.rms_norm(x, backend="array_api")
        assert np.allclose(y, ref, rtol=1e-6), (y, ref)
        print("ok")
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(blocker / "cache"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok"


def test_auto_picks_numba_for_numpy(monkeypatch, rng):
    calls = []

    def spy(real):
        def call(*a, **k):
            calls.append(real.__name__)
            return real(*a, **k)
        return call

    monkeypatch.setattr(nb, "forward", spy(nb.forward))
    monkeypatch.setattr(nb, "forward_small", spy(nb.forward_small))
    monkeypatch.setattr(nb, "forward_decode", spy(nb.forward_decode))
    x = _data(rng, (2, 8), "float32")
    pn.rms_norm(x, backend="auto")  # the numpy fast path: serial size, the decode path
    pn.rms_norm(x, axis=0)  # the generic path
    pn.add_rms_norm(x, x)  # fused add: the decode path too
    pn.rms_norm(x, eps=np.float64(1e-6))  # an inexact option type: the serial entry
    big = np.ones((8, 9000), np.float32)
    pn.add_rms_norm(big, big)  # above the serial size: the general entry
    assert calls == ["forward_decode", "forward", "forward_decode", "forward_small", "forward"]


# every dtype plain, and each option set with one dtype (compiling all 20 pairs
# cost ~40 s of CI)
@pytest.mark.parametrize("dtype,opts", [(dt, {}) for dt in DTYPES] + [
    ("bfloat16", {"weight": "bfloat16"}),
    ("float16", {"weight": "float32", "bias": "float64", "offset": 1.0}),
    ("float32", {"partial": 0.5, "eps_mode": "outside", "out_dtype": "float16"}),
    ("float64", {"weight": "float64", "out_dtype": "bfloat16", "return_rstd": True}),
], ids=["plain-f16", "plain-bf16", "plain-f32", "plain-f64", "bf16-w", "f16-w-b-offset",
        "f32-partial-outside-f16out", "f64-f64w-bf16out-rstd"])
def test_small_fast_path_equals_general_entry(dtype, opts, rng):
    """The numpy fast path's serial entry (nb.forward_small) gives the bits of nb.forward."""
    d = 257
    x = _data(rng, (3, d), dtype)
    kw = dict(opts)
    for name in ("weight", "bias"):
        if name in kw:
            kw[name] = _data(rng, d, kw[name])
    x_before = x.copy()
    fast = pn.rms_norm(x, **kw)  # backend="auto": the fast path
    general = pn.rms_norm(x, backend="numba", **kw)
    fast = fast if isinstance(fast, tuple) else (fast,)
    general = general if isinstance(general, tuple) else (general,)
    for a, b in zip(fast, general, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    np.testing.assert_array_equal(x.view(np.uint8), x_before.view(np.uint8))


def test_serial_and_parallel_drivers_agree(monkeypatch, rng):
    x = _data(rng, (300, 257), "float16")
    w = _data(rng, 257, "bfloat16")
    par = pn.rms_norm(x, w, partial=0.5, backend="numba")
    monkeypatch.setattr(nb, "SERIAL_MAX_ELEMENTS", 1 << 62)
    ser = pn.rms_norm(x, w, partial=0.5, backend="numba")
    np.testing.assert_array_equal(par.view(np.uint16), ser.view(np.uint16))


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_software_codecs_match(name, rng):
    """The pure-integer codecs (used where the CPU has no F16C) agree with ml_dtypes too."""
    dec = codec._bf16_to_f32_sw if name == "bfloat16" else codec._f16_to_f32_sw
    enc = codec._f32_to_bf16_sw if name == "bfloat16" else codec._f32_to_f16_sw

    @numba.njit
    def roundtrip(bits, values):
        a = np.empty(bits.shape[0], np.float32)
        b = np.empty(values.shape[0], np.uint16)
        for i in range(bits.shape[0]):
            a[i] = dec(bits[i])
        for i in range(values.shape[0]):
            b[i] = enc(values[i])
        return a, b

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = _encode_sample(rng, np.float32)
    got_dec, got_enc = roundtrip(bits, values)
    want_dec = bits.view(HALF[name]).astype(np.float32)
    nan = np.isnan(want_dec)
    np.testing.assert_array_equal(np.isnan(got_dec), nan)
    np.testing.assert_array_equal(got_dec[~nan].view(np.uint32), want_dec[~nan].view(np.uint32))
    with np.errstate(all="ignore"):
        want_enc = values.astype(HALF[name]).view(np.uint16)
    vnan = np.isnan(values)
    np.testing.assert_array_equal(got_enc[~vnan], want_enc[~vnan])
    assert np.isnan(got_enc[vnan].view(HALF[name]).astype(np.float32)).all()


@pytest.mark.parametrize("fn", ["rms_norm", "add_rms_norm", "rms_norm_backward"])
def test_fast_path_equals_generic_path(fn, rng):
    """axis=-1 on numpy takes the front end's fast path; axis=(2,) the generic one."""
    x = _data(rng, (3, 4, 50), "bfloat16")
    other = _data(rng, (3, 4, 50), "float32")
    w = _data(rng, 50, "float16")
    rstd = None
    if fn == "rms_norm_backward":
        rstd = pn.rms_norm(x, w, return_rstd=True)[1]
    kw = dict(offset=1.0, partial=0.5, casting="llama")
    results = []
    for axis in (-1, (2,)):
        if fn == "rms_norm":
            r = pn.rms_norm(x, w, axis=axis, return_rstd=True, **kw)
        elif fn == "add_rms_norm":
            r = pn.add_rms_norm(x, other, w, axis=axis, return_rstd=True, **kw)
        else:
            r = pn.rms_norm_backward(other, x, w, rstd=rstd, grad_residual=other, axis=axis, **kw)
        results.append(r)
    for a, b in zip(*results, strict=True):
        if a is None:  # dbias without bias
            assert b is None
            continue
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_float32_rstd_beyond_float32_range(rng):
    """rms of a float32 row ~1e-40 (subnormal) with eps=0: rstd ~1e40 overflows
    float32, yet y and dweight are O(1) and must match the float64 answer."""
    x = (rng.uniform(0.5, 2.0, (3, 16)) * np.array([[1e-40], [1.0], [3e-41]])).astype(np.float32)
    w = _data(rng, 16, "float32")
    y, rstd = pn.rms_norm(x, w, eps=0.0, return_rstd=True, backend="numba")
    want, _ = oracle_forward(x.astype(np.float64), w, eps=0.0)
    assert_close(y, want, "float32", "y")
    dy = _data(rng, (3, 16), "float32")
    for r in (None, rstd):
        _, dw, _ = pn.rms_norm_backward(dy, x, w, eps=0.0, rstd=r, backend="numba")
        _, wdw, _ = oracle_backward(dy, x.astype(np.float64), w, eps=0.0)
        assert_close(dw, wdw, "float32", "dweight")


@pytest.mark.parametrize("bf", [True, False])
@pytest.mark.parametrize("d", [1, 127, 129, 256, 300, 4099])
def test_pipelined_row_sum_is_the_rows_own(bf, d, rng):
    """16-bit rows: the float64 sum of row i+1 accumulated during row i's output
    pass has the bits of row i+1's sum taken on its own (d off the lane sizes)."""
    from polynorm.backends.numba import kernels as K

    x = rng.standard_normal((3, d)) * np.array([[1.0], [1e3], [1e-3]])
    # the kernels' convention: bfloat16 bits as uint16, float16 bits as int16
    bits = x.astype(HALF["bfloat16" if bf else "float16"]).view(np.uint16 if bf else np.int16)
    w = _data(rng, d, "float32")
    y = np.empty_like(bits)
    rstd = np.empty(3, np.float32)
    flags = K.HAS_W | K.EPS_INSIDE
    for k in sorted({d, max(1, d // 2), 1}):
        for i in range(2):
            ss = K._sumsq_lanes(bits, i, k)
            nxt = K._fwd_norm_row(i, 3, bits, w, w, y, rstd, flags, k, 1e-6, 0.0, ss,
                                  K._NO_BLOCKS)
            alone = K._sumsq_lanes(bits, i + 1, k)
            assert np.float64(nxt).view(np.uint64) == np.float64(alone).view(np.uint64)
            want = np.sum(bits[i + 1, :k].view(HALF["bfloat16" if bf else "float16"])
                          .astype(np.float64) ** 2)
            assert abs(alone - want) <= 1e-6 * want


@pytest.mark.skipif(not codec.HW_HALF, reason="no hardware float16 conversions on this CPU")
def test_f16c_codec_equals_software_codec(rng):
    """The F16C conversions (chosen at import) and the software float16 codec (CPUs
    without F16C) give the same bits: every 16-bit pattern decoded, NaN included,
    and the encode sample plus random NaN payloads, subnormal results included."""

    @numba.njit
    def both(bits, values):
        n, m = bits.shape[0], values.shape[0]
        hw_d, sw_d = np.empty(n, np.float32), np.empty(n, np.float32)
        hw_e, sw_e = np.empty(m, np.uint16), np.empty(m, np.uint16)
        for i in range(n):
            hw_d[i] = codec._f16_to_f32_hw(bits[i])
            sw_d[i] = codec._f16_to_f32_sw(bits[i])
        for i in range(m):
            hw_e[i] = codec._f32_to_f16_hw(values[i])
            sw_e[i] = codec._f32_to_f16_sw(values[i])
        return hw_d, sw_d, hw_e, sw_e

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    nans = (rng.integers(1, 1 << 23, 50_000, dtype=np.uint32) | np.uint32(0x7F800000))
    nans[::2] |= np.uint32(0x80000000)
    sub = rng.integers(0, 1 << 23, 50_000, dtype=np.uint32) + np.uint32(100 << 23)  # f16 subnormals
    values = np.concatenate([_encode_sample(rng, np.float32), nans.view(np.float32),
                             sub.view(np.float32)])
    hw_d, sw_d, hw_e, sw_e = both(bits, values)
    np.testing.assert_array_equal(hw_d.view(np.uint32), sw_d.view(np.uint32))
    np.testing.assert_array_equal(hw_e, sw_e)
    assert codec.f16_to_f32 is codec._f16_to_f32_hw and codec.f32_to_f16 is codec._f32_to_f16_hw


def _bf16_edge_patterns():
    """float32 patterns of every class the bfloat16 rounding treats apart: each of
    the 65536 top halves (signs, zeros, subnormals, normals, the largest finite,
    Inf, every NaN class) with low halves below, at and above the tie."""
    hi = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lo = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF], np.uint32)
    return (hi[:, None] | lo[None, :]).ravel()


def test_bf16_encoder_equals_software_encoder(rng):
    """The vectorized bfloat16 rounding (``f32_to_bf16``) gives the bits of the plain
    add-and-shift formula (``_f32_to_bf16_sw``), NaN payloads included, on 2**24
    random float32 patterns and every edge class."""

    @numba.njit
    def both(values):
        a = np.empty(values.shape[0], np.uint16)
        b = np.empty(values.shape[0], np.uint16)
        for i in range(values.shape[0]):
            a[i] = codec.f32_to_bf16(values[i])
        for i in range(values.shape[0]):
            b[i] = codec._f32_to_bf16_sw(values[i])
        return a, b

    u = np.concatenate([rng.integers(0, 1 << 32, 1 << 24, dtype=np.uint64).astype(np.uint32),
                        _bf16_edge_patterns()])
    got, want = both(u.view(np.float32))
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_bf16_encoder_every_float32():
    """As above, exhaustively: all 2**32 float32 patterns."""

    @numba.njit(parallel=True)
    def mismatches():
        bad = 0
        for hi in numba.prange(1 << 16):
            for lo in range(1 << 16):
                f = codec._u32_as_f32(np.uint32(hi) << np.uint32(16) | np.uint32(lo))
                bad += codec.f32_to_bf16(f) != codec._f32_to_bf16_sw(f)
        return bad

    assert mismatches() == 0


def test_bf16_out_blocks_equal_the_scalar_span(rng):
    """The bfloat16 output blocks (``_bf16_out_block``, with and without the NaN
    guard) give the scalar output loop's bits: every edge class of the rounding as
    ``w + offset`` (x = 1, rstd = 1), random patterns, x's decode included."""
    from polynorm.backends.numba import kernels as K

    def pairs(w, oc):
        """w + oc for the whole blocks, per block its even columns, then its odd ones."""
        n = w.size - w.size % K.OUT_BLOCK
        with np.errstate(invalid="ignore"):
            g = w[:n] + oc
        return np.ascontiguousarray(g.reshape(-1, K.OUT_BLOCK // 2, 2).transpose(0, 2, 1)).ravel()

    @numba.njit
    def spans(x, w, y_ref, y_guard, y_free, rc, oc, wg):
        for i in range(x.shape[0]):
            K._out_span(x, i, np.uint64(0), x.shape[1], w, None, y_ref, rc, oc)
            K._out_span_blocks(x, i, 0, x.shape[1], w, None, y_guard, rc, oc, wg,
                               K.SPAN_BLOCKS)
            K._out_span_blocks(x, i, 0, x.shape[1], w, None, y_free, rc, oc, wg,
                               K.SPAN_BLOCKS_NO_NAN)

    u = np.concatenate([_bf16_edge_patterns(),
                        rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)])
    d = 4 * K.OUT_BLOCK + 5  # whole blocks and a tail
    u = u[: u.size // d * d]
    w = u.view(np.float32)
    ones = np.full((1, d), 0x3F80, np.uint16)  # bfloat16 1.0
    rows = w.reshape(-1, d)
    outs = [np.zeros((rows.shape[0], d), np.uint16) for _ in range(3)]
    for r in range(rows.shape[0]):
        views = [o[r:r + 1] for o in outs]
        wr = np.ascontiguousarray(rows[r])
        spans(ones, wr, *views, np.float32(1.0), np.float32(0.0), pairs(wr, np.float32(0.0)))
    ref, guard, free = outs
    np.testing.assert_array_equal(guard, ref)
    ok = ~np.isnan(rows)
    np.testing.assert_array_equal(free[ok], ref[ok])
    # and on x's decode: random bfloat16 x, float32 weights, an offset
    x = rng.integers(0, 1 << 16, (8, d), dtype=np.uint64).astype(np.uint16)
    outs = [np.zeros((8, d), np.uint16) for _ in range(3)]
    w = rng.standard_normal(d, dtype=np.float32)
    spans(x, w, *outs, np.float32(0.37), np.float32(1.0), pairs(w, np.float32(1.0)))
    np.testing.assert_array_equal(outs[1], outs[0])
    xf = codec.decode_array(x.ravel(), True).reshape(x.shape)
    ok = ~np.isnan(xf) & ~np.isinf(xf)  # the rows' lanes whose product cannot be NaN
    np.testing.assert_array_equal(outs[2][ok], outs[0][ok])


@pytest.mark.parametrize("d", [7, 16, 100, 4096])
def test_bf16_forward_rows_of_every_mode(d, rng):
    """bfloat16 rows that take each output mode (blocks without the NaN guard, with
    it, element by element) give ``bf16((x * rstd) * (w + offset))`` from the rstd
    returned, bit for bit: finite rows, NaN/Inf rows, NaN past k (partial), an eps=0
    zero row (rstd inf), outputs that overflow to Inf, a non-finite weight."""
    bf = ml_dtypes.bfloat16
    n = 24
    x = rng.standard_normal((n, d), dtype=np.float32)
    x[1, d // 2] = np.nan
    x[2, 0] = np.inf
    x[3, -1] = -np.inf
    x[4] = 0.0
    x[5, -1] = np.nan  # past k for partial=0.5 (d > 1)
    x[6] *= 1e4  # large, within float16
    # float16 x into bfloat16 y (element by element): a NaN whose payload reaches
    # the low half of its float32 bits
    xh = x.astype(np.float16)
    xh.view(np.uint16)[7, d // 2] = 0x7E07
    big = rng.standard_normal(d, dtype=np.float32) * np.float32(1e37)
    big[::5] = 3e38  # finite weights whose products overflow to Inf
    for w in (big,
              np.where(np.arange(d) == d // 3, np.float32(np.inf), np.float32(2.0))):
        for (partial, eps), offset, x in itertools.product(
                ((1.0, 0.0), (0.5, 1e-6)), (0.0, 1.0), (xh.astype(bf), xh)):
            y, rstd = pn.rms_norm(x, w, eps=eps, partial=partial, offset=offset,
                                  out_dtype="bfloat16", return_rstd=True, backend="numba")
            with np.errstate(all="ignore"):
                t = (x.astype(np.float32) * rstd[:, None]) * (w + np.float32(offset))
            want = codec.encode_array(t.ravel(), True).reshape(t.shape)
            np.testing.assert_array_equal(y.view(np.uint16), want)


@pytest.mark.parametrize("d", [7, 100, 4096])
def test_bf16_fused_add_sum_bits(d, rng):
    """The fused add's bfloat16 ``h`` is ``bf16(x + r)`` in float32 bit for bit: NaN
    payloads, Inf + -Inf, overflow to Inf, column-strided inputs; y takes the
    output blocks (``_bf16_out_block``) from that h."""
    bf = ml_dtypes.bfloat16
    x = rng.standard_normal((9, 2 * d), dtype=np.float32)
    r = rng.standard_normal((9, 2 * d), dtype=np.float32)
    x[1, d // 2], r[2, 0], r[3, -1] = np.nan, np.inf, -np.inf
    x[3, -1] = np.inf
    x[4], r[4] = 3e38, 3e38
    xb, rb = x.astype(bf), r.astype(bf)
    xb.view(np.uint16)[5, d - 1] = 0x7F81  # a signalling NaN
    for xs, rs in ((xb[:, :d], rb[:, :d]), (xb[:, ::2], rb[:, ::2])):
        _, h = pn.add_rms_norm(xs, rs, np.ones(d, np.float32), backend="numba")
        with np.errstate(all="ignore"):
            t = xs.astype(np.float32) + rs.astype(np.float32)
        want = codec.encode_array(t.ravel(), True).reshape(t.shape)
        np.testing.assert_array_equal(h.view(np.uint16), want)
