"""polynorm.torch's gated RMSNorm: autograd through the custom op against
polynorm.rms_norm_gated_backward, the module, and torch.compile(fullgraph=True)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import polynorm as pn  # noqa: E402
import polynorm.torch as pt  # noqa: E402


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g, dtype=dtype, requires_grad=True)
    z = torch.randn(3, 8, generator=g, dtype=dtype, requires_grad=True)
    w = (1 + 0.3 * torch.randn(8, generator=g, dtype=dtype)).requires_grad_()
    return x, z, w


@pytest.mark.parametrize("nbg", [False, True])
def test_autograd_matches_functional(nbg):
    x, z, w = _inputs()
    kw = dict(group_size=4, norm_before_gate=nbg, eps=0.05)
    y = pt.rms_norm_gated(x, z, w, **kw)
    dy = torch.randn_like(y)
    y.backward(dy)
    with torch.no_grad():
        want = pn.rms_norm_gated(x, z, w, **kw)
        dx, dz, dw, _ = pn.rms_norm_gated_backward(dy, x, z, w, **kw)
    assert torch.equal(y.detach(), want)
    assert torch.equal(x.grad, dx) and torch.equal(z.grad, dz) and torch.equal(w.grad, dw)


def test_gradcheck_float64():
    x, z, w = (t.detach().double().requires_grad_() for t in _inputs())
    assert torch.autograd.gradcheck(
        lambda a, b, c: pt.rms_norm_gated(a, b, c, group_size=2, norm_before_gate=True),
        (x, z, w))


def test_module_and_compile_fullgraph():
    m = pt.RMSNormGated(8, eps=1e-5, group_size=4)
    x, z, _ = _inputs()
    y = m(x, z)
    y.sum().backward()
    gw = m.weight.grad.clone()
    m.weight.grad = None
    xc, zc = x.detach().clone().requires_grad_(), z.detach().clone().requires_grad_()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    yc = compiled(xc, zc)
    yc.sum().backward()
    assert torch.equal(yc.detach(), y.detach())
    np.testing.assert_array_equal(m.weight.grad.numpy(), gw.numpy())
    assert torch.equal(xc.grad, x.grad)
