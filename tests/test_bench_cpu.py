"""The CPU benchmark's roof and ONNX Runtime peer compute what they claim (no timing asserted)."""

from __future__ import annotations

import numpy as np
import pytest

import polynorm as pn
from polynorm.bench import cpu, roof
from polynorm.core.dtypes import numpy_dtype


@pytest.mark.parametrize("kind", roof.KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_roof_candidate_is_an_exact_copy(kind, dtype, rng):
    x = rng.standard_normal((37, 129), dtype=np.float32).astype(numpy_dtype(dtype))
    out = np.empty_like(x)
    fns = roof.copies(x, kind, out=out)
    assert "numpy" in fns
    if pn.backends()["numba"][0]:
        assert set(fns) == {"row", "stream", "numpy"}
    for name, fn in fns.items():
        out[...] = 0
        got = fn()
        if kind == "plain":
            got = out
        else:
            assert not np.shares_memory(got, out), name
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), x.view(np.uint8), name)


def test_paired_roof_times_the_op_and_its_peers_in_the_same_rounds():
    x = np.ones((64, 256), np.float32)
    calls = {"op": 0, "peer": 0}

    def op():
        calls["op"] += 1

    def peer():
        calls["peer"] += 1

    p = roof.paired_roof(op, x, min_time=0.001, min_repeat=7, peers={"peer": peer})
    assert p.rounds >= 7 and calls["op"] == calls["peer"] == p.rounds + 1  # + the warm-up
    assert p.fastest in roof.copies(x) and p.speed > 0 and set(p.peers) == {"peer"}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["fwd", "fwd-out", "add"])
def test_onnxruntime_peers_compute_the_same_op(op, dtype, rng):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    npd = numpy_dtype(dtype)
    x, r = (rng.standard_normal((5, 96), dtype=np.float32).astype(npd) for _ in range(2))
    w = (1 + 0.1 * rng.standard_normal(96, dtype=np.float32)).astype(npd)
    out = np.empty_like(x)
    fns = cpu._ort_fns(op, x, w, r, out)
    if dtype == "bfloat16":  # not run by ONNX Runtime's CPU provider
        assert fns == {} and cpu._ort_missing(dtype)
        return
    assert set(fns) == ({"skip"} if op == "add" else {"rms", "sln"})
    if op == "add":
        want_y, want_h = pn.add_rms_norm(x, r, w, eps=cpu.EPS)
    else:
        want_y, want_h = pn.rms_norm(x, w, eps=cpu.EPS), None
    tol = 2e-3 if dtype == "float16" else 2e-6
    for name, fn in fns.items():
        res = fn()
        y = out if op == "fwd-out" else res[0]
        np.testing.assert_allclose(np.asarray(y, np.float32), want_y.astype(np.float32),
                                   rtol=tol, atol=tol, err_msg=name)
        if want_h is not None:
            np.testing.assert_allclose(np.asarray(res[1], np.float32),
                                       want_h.astype(np.float32), rtol=tol, atol=tol)
