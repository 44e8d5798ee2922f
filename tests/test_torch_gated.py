"""polynorm.torch's gated RMSNorm: autograd through the custom op against
polynorm.rms_norm_gated_backward, the module, and torch.compile(fullgraph=True)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import polynorm as pn  # noqa: E402
import polynorm.torch as pt  # noqa: E402
from polynorm.ops import gated as _gated  # noqa: E402


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


def _loop(f, args, in_dims):
    n = next(a.shape[d] for a, d in zip(args, in_dims, strict=True) if d is not None)
    return torch.stack([f(*(a if d is None else a[i] for a, d in zip(args, in_dims, strict=True)))
                        for i in range(n)])


def test_vmap_grad_and_jit_trace(monkeypatch):
    x, z, w = (t.detach().double() for t in _inputs())

    def f(x, z, w):
        return pt.rms_norm_gated(x, z, w, group_size=4, eps=0.05)

    xs, zs, ws = torch.stack([x, -x]), torch.stack([z, 2 * z]), torch.stack([w, w + 1])
    for in_dims, args in (((0, 0, None), (xs, zs, w)), ((None, 0, None), (x, zs, w)),
                          ((0, 0, 0), (xs, zs, ws))):
        assert torch.equal(torch.vmap(f, in_dims)(*args), _loop(f, args, in_dims))
    calls = []  # a vmap over tokens is one kernel call, not one per slice
    forward = _gated.gated_forward
    monkeypatch.setattr(_gated, "gated_forward",
                        lambda *a, **k: calls.append(1) or forward(*a, **k))
    torch.vmap(f, (0, 0, None))(xs, zs, w)
    assert len(calls) == 1
    monkeypatch.undo()
    got = torch.func.grad(lambda *a: f(*a).square().sum(), (0, 1, 2))(x, z, w)
    leaves = [t.clone().requires_grad_() for t in (x, z, w)]
    want = torch.autograd.grad(f(*leaves).square().sum(), leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    per = torch.vmap(torch.func.grad(lambda w, x, z: f(x, z, w).sum()), (None, 0, 0))(w, xs, zs)
    assert torch.equal(per[1], torch.func.grad(lambda w: f(xs[1], zs[1], w).sum())(w))
    m = pt.RMSNormGated(8, group_size=4).double()
    with torch.no_grad():
        traced = torch.jit.trace(m, (x, z))
    assert torch.equal(traced(xs[1], zs[1]), m(xs[1], zs[1]))


def test_second_derivative_and_forward_mode_raise():
    x, z, w = (t.detach().double().requires_grad_() for t in _inputs())
    g = torch.autograd.grad(pt.rms_norm_gated(x, z, w).square().sum(), (x, z, w),
                            create_graph=True)
    with pytest.raises(NotImplementedError, match="second derivatives are not supported"):
        torch.autograd.grad(g[0].sum(), (x, z, w), allow_unused=True)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jacfwd(pt.rms_norm_gated)(x.detach(), z.detach(), w.detach())
