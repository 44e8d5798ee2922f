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


def _spy(monkeypatch) -> list:
    """A list that records each call of the backend's per-head entries (True: it ran)."""
    calls: list = []
    for name in ("forward_heads", "forward_heads_small"):
        orig = getattr(nb, name)

        def spy(*a, _orig=orig, **k):
            r = _orig(*a, **k)
            calls.append(r is not None)
            return r

        monkeypatch.setattr(nb, name, spy)
    return calls


@pytest.fixture
def one_calls(monkeypatch):
    """Counts the backend's per-head calls (the one-call path ran) and runs ``f`` both
    ways: ``compare(f)`` asserts the same bits."""
    calls = _spy(monkeypatch)

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
SERIAL, PARALLEL = (5, 3, 40), (180, 3, 128)  # ranges of 8 rows: mid-head starts
# Each per-head driver variant (dtype, layout, bias or not) is a Numba compile of its
# own: these tests use the variants tests/test_per_head.py compiles anyway (float32
# without bias, float64 with), plus the strided float32 and the two bfloat16 paths.


def test_one_call_has_the_loops_bits(one_calls, rng):
    t, h, d = SERIAL
    x = rng.standard_normal(SERIAL).astype(np.float32)
    r = rng.standard_normal(SERIAL).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal((h, d))).astype(np.float32)
    x[1, 2, :] = 0  # a zero row: rstd 1/sqrt(eps)
    one_calls(lambda: pn.rms_norm(x, w, return_rstd=True, eps=1e-5))
    one_calls(lambda: pn.add_rms_norm(x, r, w, return_rstd=True))
    # two head axes, weight (2, 3, d) of x (2, 2, 3, d)
    x4 = rng.standard_normal((2, 2, h, d)).astype(np.float32)
    w3 = rng.standard_normal((2, h, d)).astype(np.float32)
    one_calls(lambda: pn.rms_norm(x4, w3, return_rstd=True))
    # bias (float64): with a weight and an offset, alone, and in the fused add
    x64, r64 = x.astype(np.float64), r.astype(np.float64)
    w64, b64 = w.astype(np.float64), rng.standard_normal((h, d))
    one_calls(lambda: pn.rms_norm(x64, w64, b64, return_rstd=True, offset=1.0))
    one_calls(lambda: pn.rms_norm(x64, None, b64, return_rstd=True))
    one_calls(lambda: pn.add_rms_norm(x64, r64, w64, b64, return_rstd=True))


def test_one_call_strided_out_in_place_and_torch(one_calls, rng):
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
    one_calls(lambda: pn.rms_norm(torch.from_numpy(x), torch.from_numpy(w)).numpy())


def _per_head_calls(f, x, r, w) -> tuple:
    """``f`` on each head's rows as a contiguous ``(t, d)`` array with its weight row
    (plain kernels), stacked back."""
    parts = [f(np.ascontiguousarray(x[:, j]), np.ascontiguousarray(r[:, j]), w[j])
             for j in range(x.shape[1])]
    return tuple(np.stack([p[i] for p in parts], axis=1) for i in range(len(parts[0])))


@pytest.mark.parametrize("shape, add", [
    pytest.param(SERIAL, False, id="serial"),
    # parallel: the drivers split the rows into ranges that start mid-head (two more
    # compiled variants, so with the long sweeps)
    pytest.param(PARALLEL, True, id="parallel-add", marks=pytest.mark.slow),
])
def test_bfloat16(rng, monkeypatch, shape, add):
    # 16-bit rows (pipelined; block weights per head): each head's rows against a plain
    # call on them
    bf16 = ml_dtypes.bfloat16
    calls = _spy(monkeypatch)
    x = rng.standard_normal(shape).astype(bf16)
    r = rng.standard_normal(shape).astype(bf16)
    w = (1 + 0.5 * rng.standard_normal(shape[1:])).astype(bf16)
    x[1, 2, :] = 0
    if add:
        got = pn.add_rms_norm(x, r, w, return_rstd=True)
        want = _per_head_calls(lambda a, b, c: pn.add_rms_norm(a, b, c, return_rstd=True),
                               x, r, w)
    else:
        got = pn.rms_norm(x, w, return_rstd=True)
        want = _per_head_calls(lambda a, b, c: pn.rms_norm(a, c, return_rstd=True), x, r, w)
    assert calls == [True]
    _same(want, got)


def test_llama_casting_runs_head_by_head(rng):
    # the per-head drivers take no llama casting: the backend declines, the loop runs
    x = rng.standard_normal(SERIAL).astype(np.float32)
    w = rng.standard_normal(SERIAL[1:]).astype(np.float16)
    y = pn.rms_norm(x, w, casting="llama")
    want = np.stack([pn.rms_norm(x[:, j], w[j], casting="llama") for j in range(SERIAL[1])], 1)
    np.testing.assert_array_equal(y, want)
