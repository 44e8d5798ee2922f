"""The Numba backward: a row's dx bits do not depend on its neighbours.

A backward that pipelines rows (the next row's dot accumulated during this
row's dx pass, as the forward does for 16-bit rows) must give the first row
of a range -- summed on its own -- the same bits as a pipelined one, or dx
would depend on how the rows are split (threads, blocks, dask chunks).
Here every row computed alone is compared with the same row computed in one
call on all rows, for widths with whole and partial 256-column chunks,
partial 128-element blocks and rows shorter than a block; strided rows
with contiguous ones; and a backward that recomputes rstd with one given
the forward's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn

pytest.importorskip("numba")

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
          "float64": np.float64}


def _rows_alone(fn, dy, x):
    return np.concatenate([fn(dy[i:i + 1], x[i:i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d,opts", [
    (1000, {}),  # chunks + a partial block
    (600, {"partial": 0.3, "eps_mode": "outside", "offset": 1.0}),  # k inside a chunk
    (50, {"bias": True}),  # shorter than a lanes block: no pipelined columns
    (512, {"weight": False, "grad_residual": True}),
    # rows over 4 KB: the dx pass in 256-column chunks under the next row's prefetches
    (2600, {"partial": 0.37}),  # k inside a chunk
    (4099, {"bias": True}),  # a partial last chunk
])
def test_pipelined_rows_equal_rows_alone(dtype, d, opts, rng):
    dt = DTYPES[dtype]
    n = 9
    x = rng.standard_normal((n, d)).astype(dt)
    dy = rng.standard_normal((n, d)).astype(dt)
    w = None if opts.get("weight") is False else rng.standard_normal(d).astype(dt)
    b = rng.standard_normal(d).astype(dt) if opts.get("bias") else None
    gr = rng.standard_normal((n, d)).astype(dt) if opts.get("grad_residual") else None
    kw = {k: v for k, v in opts.items() if k in ("partial", "eps_mode", "offset")}

    def call(dyp, xp, grp=None):
        return pn.rms_norm_backward(dyp, xp, w, b, grad_residual=grp, backend="numba", **kw)[0]

    whole = np.asarray(call(dy, x, gr))
    if gr is None:
        alone = _rows_alone(call, dy, x)
    else:
        alone = np.concatenate([call(dy[i:i + 1], x[i:i + 1], gr[i:i + 1]) for i in range(n)])
    assert whole.dtype == x.dtype
    np.testing.assert_array_equal(whole.view(np.uint8), alone.view(np.uint8))
    # and the values are right (the order of the sum is not the reference's)
    ref = pn.rms_norm_backward(dy.astype(np.float64), x.astype(np.float64),
                               None if w is None else w.astype(np.float64),
                               None if b is None else b.astype(np.float64),
                               grad_residual=None if gr is None else gr.astype(np.float64),
                               backend="array_api", **kw)[0]
    tol = {"float64": 1e-12, "float32": 1e-5}.get(dtype, 2e-2)
    np.testing.assert_allclose(whole.astype(np.float64), ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_strided_rows_equal_contiguous(rng):
    """Rows with strided elements give the bits of contiguous ones (the backward copies
    them: its dot is summed in the order LLVM vectorizes contiguous rows in)."""
    x = rng.standard_normal((6, 2 * 700)).astype(np.float32)
    dy = rng.standard_normal((6, 2 * 700)).astype(np.float32)
    w = rng.standard_normal(700).astype(np.float32)
    a = pn.rms_norm_backward(dy[:, ::2], x[:, ::2], w, backend="numba")[0]
    b = pn.rms_norm_backward(np.ascontiguousarray(dy[:, ::2]), np.ascontiguousarray(x[:, ::2]), w,
                             backend="numba")[0]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("eps_mode", ["inside", "outside"])
def test_recomputed_rstd_is_the_forwards(dtype, eps_mode, rng):
    """rstd=None: the backward recomputes rstd from the forward's own sum of squares
    (lanes for 16-bit rows), so dx has the bits of a call given the forward's rstd."""
    dt = DTYPES[dtype]
    for d in (7, 300, 4099):
        # row scales over many octaves; the last rows take the scaled path
        scale = np.exp(rng.standard_normal((64, 1)) * 3)
        x = (rng.standard_normal((64, d)) * scale).astype(dt)
        if dtype in ("float32", "float64"):
            x[-2:] *= dt(1e-30) if dtype == "float32" else dt(1e-300)
        dy = rng.standard_normal((64, d)).astype(dt)
        w = rng.standard_normal(d).astype(dt)
        _, rstd = pn.rms_norm(x, w, eps_mode=eps_mode, eps=1e-30, return_rstd=True,
                              backend="numba")
        got = pn.rms_norm_backward(dy, x, w, eps_mode=eps_mode, eps=1e-30, backend="numba")[0]
        want = pn.rms_norm_backward(dy, x, w, rstd=rstd, eps_mode=eps_mode, eps=1e-30,
                                    backend="numba")[0]
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("d,opts", [
    (2600, {"partial": 0.37}),  # k inside a chunk
    (4099, {"bias": True}),  # a partial last chunk; rows start off a line
    (2560, {}),  # rows of whole lines
])
def test_streamed_dx_equals_ordinary(monkeypatch, dtype, d, opts, rng):
    """dx written through the stage with streaming stores (STREAM_DX) has the
    bits of ordinary stores, on every row alignment (offsets into the array),
    into a fresh array, into out= and into dy itself; nothing beside out moves."""
    from polynorm.backends import numba as nb

    dt = DTYPES[dtype]
    n = 40  # whole 16-row groups, the folded rows after them, two threads' blocks
    x = rng.standard_normal((n, d)).astype(dt)
    dy = rng.standard_normal((n, d)).astype(dt)
    w = rng.standard_normal(d).astype(dt)
    b = rng.standard_normal(d).astype(dt) if opts.get("bias") else None
    gr = rng.standard_normal((n, d)).astype(dt) if opts.get("grad_residual") else None
    kw = {k: v for k, v in opts.items() if k == "partial"}

    def call(dyp, out=None):
        return pn.rms_norm_backward(dyp, x, w, b, grad_residual=gr, out=out, backend="numba",
                                    **kw)

    monkeypatch.setattr(nb, "STREAM_MIN_BYTES", 1 << 62)
    want = [np.asarray(a) for a in call(dy) if a is not None]
    streamed = []
    real = nb._streams_dx
    monkeypatch.setattr(nb, "_streams_dx", lambda a: streamed.append(real(a)) or streamed[-1])
    monkeypatch.setattr(nb, "STREAM_MIN_BYTES", 0)
    pn.output_pool.clear()
    junk = pn.output_pool.empty((n, d), dt)  # the buffer the next dx takes: not its bits
    junk[...] = 7
    del junk
    got = [np.asarray(a) for a in call(dy) if a is not None]
    for a, e in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8))
    for shift in range(3):  # the rows' first line boundary moves (C-ordered out:
        # the kernels the suite compiles anyway)
        flat = np.full(n * d + 8, 7, dt)
        out = flat[shift:shift + n * d].reshape(n, d)
        call(dy, out=out)
        np.testing.assert_array_equal(out.view(np.uint8), want[0].view(np.uint8))
        assert (flat[:shift] == 7).all() and (flat[shift + n * d:] == 7).all()
    dyc = dy.copy()
    call(dyc, out=dyc)  # in place over dy
    np.testing.assert_array_equal(dyc.view(np.uint8), want[0].view(np.uint8))
    assert streamed and all(streamed[:1])


def test_16_bit_dx_is_not_streamed(rng):
    """16-bit dx passes are bound in the core: the stage gains them nothing
    dependable (numba._streams_dx)."""
    from polynorm.backends import numba as nb

    big = 1 << 25
    assert nb._streams_dx(np.empty((big // 8, 2), np.float32))
    assert nb._streams_dx(np.empty((big // 16, 2), np.float64))
    assert not nb._streams_dx(np.empty((big // 4, 2), np.float16))
    assert not nb._streams_dx(np.empty((big // 4, 2), ml_dtypes.bfloat16))
    assert not nb._streams_dx(np.empty((4, 2), np.float32))  # small: stays in cache
    assert not nb._streams_dx(np.empty((big // 4, 4), np.float32)[:, ::2])  # strided rows
    raw = np.empty(big + 64, np.uint8)
    assert not nb._streams_dx(raw[2:2 + big].view(np.float32).reshape(-1, 2))  # misaligned


@pytest.mark.parametrize("offset", [2, 62])
def test_misaligned_out_is_not_streamed(monkeypatch, offset, rng):
    """An out= array off its element grid (bytes at any offset) is written with
    ordinary stores: the streaming stores need aligned lines, and faulted there."""
    from polynorm.backends import numba as nb

    monkeypatch.setattr(nb, "STREAM_MIN_BYTES", 0)
    n, d = 40, 2560
    x, dy = (rng.standard_normal((n, d), dtype=np.float32) for _ in range(2))
    w = rng.standard_normal(d, dtype=np.float32)
    want = pn.rms_norm_backward(dy, x, w, backend="numba")[0]
    raw = np.zeros(n * d * 4 + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = raw[start:start + n * d * 4].view(np.float32).reshape(n, d)
    assert not out.flags.aligned
    pn.rms_norm_backward(dy, x, w, out=out, backend="numba")
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
