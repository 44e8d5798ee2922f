"""QK-norm (+ RoPE) for torch: the in-place and functional custom ops, and the backward.

The backward is checked by float64 central differences of ``L = sum(y * G)``
(``torch.autograd.gradcheck``: numerical Jacobian against the registered
backward) for ``qkv``, ``q_weight`` and ``k_weight``, with and without RoPE
(NeoX, GPT-J, partial rotary), and against the written-out rule that the
gradient of a RoPE'd output is the inverse rotation of the incoming one.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import polynorm as pn  # noqa: E402
import polynorm.torch as pt  # noqa: E402

T, HQ, HK, D = 3, 2, 1, 8


def _cache(rot, n=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    ang = torch.randn(n, rot // 2, generator=g, dtype=torch.float64)
    return torch.cat([ang.cos(), ang.sin()], 1).to(dtype)


def _weights(dtype=torch.float64):
    g = torch.Generator().manual_seed(2)
    qw = (1 + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype)
    kw = (1 + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype)
    return qw, kw


@pytest.mark.parametrize("rope", [None, (True, D), (False, D), (True, D // 2)],
                         ids=["norm", "neox", "gptj", "neox-partial"])
@pytest.mark.parametrize("opts", [{}, {"offset": 1.0, "eps_mode": "outside"}],
                         ids=["plain", "gemma-outside"])
def test_qk_norm_backward_fd(rope, opts):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (HQ + 2 * HK) * D, generator=g, dtype=torch.float64,
                      requires_grad=True)
    qw, kw = (w.requires_grad_() for w in _weights())
    r = None
    if rope is not None:
        r = (_cache(rope[1]), torch.tensor([5, 0, 3]), rope[0], rope[1])

    def f(a, b, c):
        return pt.qk_norm(a, b, c, num_heads_q=HQ, num_heads_k=HK, head_dim=D, rope=r,
                          eps=0.05, **opts)

    assert torch.autograd.gradcheck(f, (qkv, qw, kw), eps=1e-6, atol=1e-6, rtol=1e-6)


def test_qk_norm_backward_is_inverse_rotation():
    """With the weight's gradient aside, d/dqkv of rope(norm(x)) is norm's backward of
    the inverse rotation of the incoming gradient (written out here)."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (HQ + 2 * HK) * D, generator=g, dtype=torch.float64,
                      requires_grad=True)
    qw, kw = _weights()
    cache, pos = _cache(D), torch.tensor([1, 2, 4])
    y = pt.qk_norm(qkv, qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D, eps=0.05,
                   rope=(cache, pos, True, D))
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (dqkv,) = torch.autograd.grad(y, qkv, dy)
    cs = cache[pos]
    c, s = cs[:, None, :D // 2], cs[:, None, D // 2:]
    for lo, h, w in ((0, HQ, qw), (HQ * D, HK, kw)):
        g3 = dy[:, lo:lo + h * D].reshape(T, h, D)
        a, b = g3[..., :D // 2], g3[..., D // 2:]
        inv = torch.cat([a * c + b * s, b * c - a * s], -1)  # R(theta)^T
        x3 = qkv.detach()[:, lo:lo + h * D].reshape(T, h, D).requires_grad_()
        n = torch.nn.functional.rms_norm(x3, (D,), w, eps=0.05)
        (want,) = torch.autograd.grad(n, x3, inv)
        torch.testing.assert_close(dqkv[:, lo:lo + h * D].reshape(T, h, D), want,
                                   atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(dqkv[:, (HQ + HK) * D:], dy[:, (HQ + HK) * D:], atol=0, rtol=0)


def test_inplace_and_functional_ops_match_the_array_api_call():
    qw, kw = _weights(torch.float32)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(T, (HQ + 2 * HK) * D, generator=g).to(torch.bfloat16)
    cache, pos = _cache(D, dtype=torch.float32), torch.tensor([0, 5, 2])
    kw_ = dict(num_heads_q=HQ, num_heads_k=HK, head_dim=D, rope=(cache, pos, False, D),
               eps=1e-6)
    want = pn.qk_norm(qkv.clone(), qw, kw, **kw_)
    got = pt.qk_norm(qkv, qw, kw, **kw_)
    assert not torch.equal(got, qkv)  # the input is untouched, the result is new
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    a = qkv.clone()
    assert pt.qk_norm_(a, qw, kw, **kw_) is a
    assert torch.equal(a.view(torch.int16), want.view(torch.int16))
    # the torch reference composition (per-head F.rms_norm, rope written out) within bf16
    ref = qkv.float()
    for lo, h, w in ((0, HQ, qw), (HQ * D, HK, kw)):
        x3 = ref[:, lo:lo + h * D].reshape(T, h, D)
        n = torch.nn.functional.rms_norm(x3, (D,), w, eps=1e-6).to(torch.bfloat16).float()
        cs = cache[pos]
        c, s = cs[:, None, :D // 2], cs[:, None, D // 2:]
        x1, x2 = n[..., 0::2], n[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)
        ref[:, lo:lo + h * D] = rot.reshape(T, h * D)
    np.testing.assert_array_equal(got.float().numpy(), ref.to(torch.bfloat16).float().numpy())


def test_ops_pass_opcheck():
    qw, kw = _weights(torch.float32)
    qkv = torch.randn(T, (HQ + 2 * HK) * D)
    cache, pos = _cache(D, dtype=torch.float32), torch.tensor([0, 1, 2])
    args = (qw, kw, HQ, HK, D, cache, pos, True, 1e-6, 0.0, "inside", "fp32", "auto")
    torch.library.opcheck(torch.ops.polynorm.qk_norm_.default, (qkv.clone(), *args),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.polynorm.qk_norm.default, (qkv, *args),
                          test_utils=("test_schema", "test_faketensor"))


def test_pair_op_backward_fd_and_compile():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(T, HQ, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, HK, D, generator=g, dtype=torch.float64, requires_grad=True)
    qw, kw = (w.requires_grad_() for w in _weights())
    rope = (_cache(D), torch.tensor([2, 0, 1]), False, D)

    def f(a, b, c, e):
        return pt.qk_norm_pair(a, b, c, e, rope=rope, eps=0.05)

    assert torch.autograd.gradcheck(f, (q, k, qw, kw), eps=1e-6, atol=1e-6, rtol=1e-6)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(q, k, qw, kw), f(q, k, qw, kw), strict=True):
        assert torch.equal(a, b)
    torch._dynamo.reset()
