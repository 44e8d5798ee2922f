"""QK-norm (+ RoPE) for jax: the custom_vjp's backward by float64 central differences
(``jax.test_util.check_grads``, reverse mode), with and without RoPE, eager and under jit;
the functional result matches ``pn.qk_norm``'s and the written-out composition."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import polynorm as pn  # noqa: E402
import polynorm.jax as pj  # noqa: E402

T, HQ, HK, D = 3, 2, 1, 8


def _inputs(dtype=np.float64):
    rng = np.random.default_rng(0)
    qkv = jnp.asarray(rng.standard_normal((T, (HQ + 2 * HK) * D)).astype(dtype))
    qw = jnp.asarray((1 + 0.1 * rng.standard_normal(D)).astype(dtype))
    kw = jnp.asarray((1 + 0.1 * rng.standard_normal(D)).astype(dtype))
    ang = rng.standard_normal((6, D // 2))
    cache = jnp.asarray(np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(dtype))
    return qkv, qw, kw, cache, jnp.asarray([5, 0, 3])


@pytest.mark.parametrize("rope", [None, True, False], ids=["norm", "neox", "gptj"])
def test_qk_norm_vjp_fd(rope):
    qkv, qw, kw, cache, pos = _inputs()
    r = None if rope is None else (cache, pos, rope, D)

    def f(a, b, c):
        return pj.qk_norm(a, b, c, num_heads_q=HQ, num_heads_k=HK, head_dim=D, rope=r,
                          eps=0.05, offset=0.5)

    check_grads(f, (qkv, qw, kw), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)
    check_grads(jax.jit(f), (qkv, qw, kw), order=1, modes=["rev"], eps=1e-6, atol=1e-6,
                rtol=1e-6)


def test_qk_norm_jax_matches_composition():
    qkv, qw, kw, cache, pos = _inputs(np.float32)
    y = pj.qk_norm(qkv, qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D,
                   rope=(cache, pos, True, None))
    assert bool((qkv != y).any())  # a new array; qkv unchanged
    same = pn.qk_norm(qkv, qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D,
                      rope=(cache, pos, True, None))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(same))
    x = np.asarray(qkv, np.float64)
    cs = np.asarray(cache, np.float64)[np.asarray(pos)]
    c, s = cs[:, None, :D // 2], cs[:, None, D // 2:]
    for lo, h, w in ((0, HQ, qw), (HQ * D, HK, kw)):
        v = x[:, lo:lo + h * D].reshape(T, h, D)
        n = v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6) * np.asarray(w, np.float64)
        a, b = n[..., :D // 2], n[..., D // 2:]
        want = np.concatenate([a * c - b * s, b * c + a * s], -1).reshape(T, h * D)
        np.testing.assert_allclose(np.asarray(y)[:, lo:lo + h * D], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(y)[:, (HQ + HK) * D:],
                                  np.asarray(qkv)[:, (HQ + HK) * D:])
