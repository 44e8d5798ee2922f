"""Per-head weights in one Numba kernel call (``backends/numba/heads.py``) against
the per-head loop, bit for bit.

The loop (``polynorm.ops.norm._HEADS_ONE_CALL = False``) runs each head's
``(t, d)`` rows through the plain kernels with that head's weight row; the one
call takes ``x`` as ``(t * heads, d)`` rows, row ``i`` with weight row
``i % heads``.  Both must give the same bits: y, h and rstd of each row are
those of ``rms_norm`` of that row with its weight row.  tests/test_per_head.py
checks the values against the formula and central differences.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import polynorm as pn

pytest.importorskip("numba")
ml_dtypes = pytest.importorskip("ml_dtypes")
norm = importlib.import_module("polynorm.ops.norm")
nb = importlib.import_module("polynorm.backends.numba")


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8)


def _same(loop, one) -> None:
    loop = loop if isinstance(loop, tuple) else (loop,)
    one = one if isinstance(one, tuple) else (one,)
    assert len(loop) == len(one)
    for a, b in zip(loop, one, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.fixture
def one_calls(monkeypatch):
    """Counts the backend's per-head calls (the one-call path ran) and runs ``f`` both
    ways: ``compare(f)`` asserts the same bits."""
    calls = []
    for name in ("forward_heads", "forward_heads_small"):
        orig = getattr(nb, name)

        def spy(*a, _orig=orig, **k):
            r = _orig(*a, **k)
            calls.append(r is not None)
            return r

        monkeypatch.setattr(nb, name, spy)

    def compare(f):
        monkeypatch.setattr(norm, "_HEADS_ONE_CALL", False)
        loop = f()
        assert calls == []  # the loop ran, head by head
        monkeypatch.setattr(norm, "_HEADS_ONE_CALL", True)
        one = f()
        assert calls == [True]  # one kernel call
        calls.clear()
        _same(loop, one)

    return compare


# (t, heads, d): serial, and parallel (t * heads * d >= SERIAL_MAX_ELEMENTS rows)
SERIAL, PARALLEL = (5, 3, 40), (130, 4, 128)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_has_the_loops_bits(one_calls, rng, dtype):
    dt = np.dtype(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else dtype)
    t, h, d = SERIAL
    x = rng.standard_normal(SERIAL).astype(dt)
    r = rng.standard_normal(SERIAL).astype(dt)
    w = (1 + 0.5 * rng.standard_normal((h, d))).astype(dt)
    b = rng.standard_normal((h, d)).astype(dt)
    x[1, 2, :] = 0  # a zero row: rstd 1/sqrt(eps)
    one_calls(lambda: pn.rms_norm(x, w, return_rstd=True, eps=1e-5))
    one_calls(lambda: pn.rms_norm(x, w, b, return_rstd=True, offset=1.0))
    one_calls(lambda: pn.rms_norm(x, None, b, return_rstd=True))
    one_calls(lambda: pn.add_rms_norm(x, r, w, b, return_rstd=True))
    # two head axes, weight (2, 3, d) of x (2, 2, 3, d)
    x4 = rng.standard_normal((2, 2, h, d)).astype(dt)
    w3 = rng.standard_normal((2, h, d)).astype(dt)
    one_calls(lambda: pn.rms_norm(x4, w3, return_rstd=True))


def test_one_call_strided_out_and_torch(one_calls, rng):
    t, h, d = SERIAL
    w = (1 + 0.5 * rng.standard_normal((h, d))).astype(np.float32)
    # x with a row stride (the general path; the rows a strided view)
    xs = rng.standard_normal((t, h, d + 8)).astype(np.float32)[:, :, :d]
    one_calls(lambda: pn.rms_norm(xs, w, return_rstd=True))
    # out= (the general path writes through a (t * h, d) view of it)
    out = np.empty((t, h, d), np.float32)
    x = np.ascontiguousarray(xs)
    one_calls(lambda: pn.rms_norm(x, w, out=out).copy())
    # add_rms_norm_: y over x, h over the residual, through rows views of both
    def in_place():
        xi, ri = x.copy(), xs.copy()
        pn.add_rms_norm_(xi, ri, w)
        return xi, ri

    one_calls(in_place)
    torch = pytest.importorskip("torch")
    one_calls(lambda: tuple(a.numpy() for a in pn.add_rms_norm(
        torch.from_numpy(x), torch.from_numpy(xs.copy()), torch.from_numpy(w))))


def test_one_call_parallel(one_calls, rng):
    # parallel row counts: the drivers split the rows into ranges, which start mid-head
    # (16-bit rows: each range makes its heads' block weights)
    x = rng.standard_normal(PARALLEL).astype(ml_dtypes.bfloat16)
    r = rng.standard_normal(PARALLEL).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal(PARALLEL[1:]).astype(ml_dtypes.bfloat16)
    one_calls(lambda: pn.add_rms_norm(x, r, w, return_rstd=True))


def test_llama_casting_runs_head_by_head(rng):
    # the per-head drivers take no llama casting: the backend declines, the loop runs
    x = rng.standard_normal(SERIAL).astype(np.float32)
    w = rng.standard_normal(SERIAL[1:]).astype(np.float16)
    y = pn.rms_norm(x, w, casting="llama")
    want = np.stack([pn.rms_norm(x[:, j], w[j], casting="llama") for j in range(SERIAL[1])], 1)
    np.testing.assert_array_equal(y, want)
