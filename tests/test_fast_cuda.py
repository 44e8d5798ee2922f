"""polynorm.ops.fast_cuda: which calls the torch-CUDA fast path takes, and that it
hands the cupy backend what the general path would.

Without a GPU: CPU tensors stand in for CUDA ones (the device test is patched)
and the array-API reference stands in for the cupy backend, so a taken call
must give the general path's reference bits exactly; tests/test_cupy_gpu.py
runs the real thing.
"""

from __future__ import annotations

import numpy as np
import pytest

import polynorm as pn
from polynorm.backends import reference
from polynorm.ops import fast_cuda as _fast_cuda

torch = pytest.importorskip("torch")


class _Recorder:
    """The reference backend, counting the calls the fast path makes."""

    def __init__(self):
        self.calls = []

    def forward(self, *args):
        self.calls.append("forward")
        return reference.forward(*args)

    def backward(self, *args):
        self.calls.append("backward")
        return reference.backward(*args)


@pytest.fixture
def fake_cuda(monkeypatch):
    rec = _Recorder()
    names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
             torch.float64: "float64"}
    monkeypatch.setattr(_fast_cuda, "_STATE", [torch, names, (torch.Tensor, torch.nn.Parameter), rec])
    monkeypatch.setattr(_fast_cuda, "_on_device", lambda x: True)
    return rec


def _bits(t):
    a = t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32 if t.element_size() == 4
                        else torch.int64)
    return a.numpy()


def _same(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if g is None or w is None:
            assert g is None and w is None
            continue
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize(("shape", "dtype"), [((5, 64), torch.float32), ((2, 3, 40), torch.bfloat16),
                                              ((33,), torch.float16)])
def test_forward_taken_gives_the_general_bits(fake_cuda, shape, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = torch.nn.Parameter(torch.randn(shape[-1], generator=g))
    b = torch.randn(shape[-1], generator=g).to(dtype)
    kw = {"eps": 1e-5, "partial": 0.5, "offset": 1.0}
    _same(pn.rms_norm(x, w, b, backend="cupy", return_rstd=True, **kw),
          pn.rms_norm(x, w, b, backend="array_api", return_rstd=True, **kw))
    _same(pn.add_rms_norm(x, r, w, backend="cupy", **kw), pn.add_rms_norm(x, r, w, backend="array_api", **kw))
    assert fake_cuda.calls == ["forward", "forward"]


def test_backward_taken_gives_the_general_bits(fake_cuda):
    g = torch.Generator().manual_seed(2)
    x, dy, gr = (torch.randn(2, 3, 48, generator=g) for _ in range(3))
    w = torch.randn(48, generator=g)
    rstd = pn.rms_norm(x, w, return_rstd=True, backend="array_api")[1]
    for kw in ({}, {"rstd": rstd, "grad_residual": gr}):
        _same(pn.rms_norm_backward(dy, x, w, backend="cupy", **kw),
              pn.rms_norm_backward(dy, x, w, backend="array_api", **kw))
    assert fake_cuda.calls == ["backward", "backward"]


def test_unusual_calls_take_the_general_path(fake_cuda):
    x = torch.randn(4, 6, 8)
    w = torch.randn(8)
    cases = [
        lambda: pn.rms_norm(x, w, backend="cupy", out=torch.empty_like(x)),  # out=
        lambda: pn.rms_norm(x, torch.randn(6, 8), backend="cupy", axis=(-2, -1)),  # another axis
        lambda: pn.rms_norm(x.transpose(0, 1), w, backend="cupy"),  # rows not viewable
        lambda: pn.rms_norm(x, torch.randn(7), backend="cupy"),  # weight of the wrong shape
        lambda: pn.rms_norm(x.to(torch.int32), backend="cupy"),  # not a float
        lambda: pn.rms_norm(x, w, backend="cupy", partial=0.01),  # k = 0
        lambda: pn.rms_norm_backward(x, x, w, rstd=torch.ones(4, 6, dtype=torch.float64),
                                     backend="cupy"),  # rstd of the wrong dtype
        lambda: pn.rms_norm(x, w, backend="numba"),  # another backend
    ]
    for call in cases:
        try:
            call()
        except (TypeError, ValueError):
            pass  # the general path's own errors (cupy is not usable here)
    assert fake_cuda.calls == []


def test_errors_stay_the_general_paths(fake_cuda):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        pn.rms_norm(x, torch.randn(7), backend="cupy")
    with pytest.raises(ValueError, match="partial"):
        pn.rms_norm(x, backend="cupy", partial=0.01)
    assert fake_cuda.calls == []
