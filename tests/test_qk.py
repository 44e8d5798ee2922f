"""QK-norm (+ RoPE): ``pn.qk_norm`` / ``pn.qk_norm_pair`` on the numpy backends.

The oracle is written out here: each head's row is ``pn.rms_norm``'s row (the
contract: the same bits, on the same backend), and the rotation is vLLM's
``RotaryEmbedding.forward_native`` (``o1 = x1*cos - x2*sin``, ``o2 = x2*cos +
x1*sin``, NeoX halves or GPT-J pairs) done in float32 numpy on those rounded
values, rounded once to the storage dtype.  A second check compares with vLLM's
test reference literally (RoPE in the storage dtype) at vLLM's tolerance.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn

BF16 = ml_dtypes.bfloat16
T, HQ, HK, D = 5, 4, 2, 16
BACKENDS = ("numba", "array_api")


def _cache(rng, rot, n_pos=12, dtype=np.float32):
    """vLLM's cos_sin_cache layout: rows [cos | sin] of rot // 2 each."""
    inv = 1.0 / (10000.0 ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    ang = np.arange(n_pos)[:, None] * inv[None, :] + rng.standard_normal((n_pos, rot // 2))
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(dtype)


def _rope_f32(y, cs, neox):
    """The rotation of (T, H, D) values ``y`` (float32) by (T, rot) rows ``cs``."""
    y = y.astype(np.float32).copy()
    rot = cs.shape[1]
    half = rot // 2
    c, s = cs[:, None, :half].astype(np.float32), cs[:, None, half:].astype(np.float32)
    if neox:
        x1, x2 = y[..., :half].copy(), y[..., half:rot].copy()
        y[..., :half], y[..., half:rot] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = y[..., 0:rot:2].copy(), y[..., 1:rot:2].copy()
        y[..., 0:rot:2], y[..., 1:rot:2] = x1 * c - x2 * s, x2 * c + x1 * s
    return y


def _expected(qkv, qw, kw, backend, rope=None, **kw_):
    """The packed result from rms_norm per head (+ the float32 rotation)."""
    out = qkv.copy()
    for lo, h, w in ((0, HQ, qw), (HQ * D, HK, kw)):
        heads = qkv[:, lo:lo + h * D].reshape(T, h, D)
        y = pn.rms_norm(heads, w, backend=backend, **kw_)
        if rope is not None:
            cache, pos, neox, _ = rope
            y = _rope_f32(y, cache[pos], neox).astype(qkv.dtype)
        out[:, lo:lo + h * D] = y.reshape(T, h * D)
    return out


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _inputs(rng, dtype):
    qkv = (rng.standard_normal((T, (HQ + 2 * HK) * D)) * 3).astype(dtype)
    qw = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    kw = (1 + 0.1 * rng.standard_normal(D)).astype(dtype)
    return qkv, qw, kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("opts", [{}, {"offset": 1.0, "eps_mode": "outside"},
                                  {"casting": "llama"}], ids=["plain", "gemma-outside", "llama"])
def test_qk_norm_is_rms_norm_per_head(rng, backend, dtype, opts):
    qkv, qw, kw = _inputs(rng, dtype)
    want = _expected(qkv, qw, kw, backend, eps=1e-5, **opts)
    a = qkv.copy()
    got = pn.qk_norm(a, qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D, eps=1e-5,
                     backend=backend, **opts)
    assert got is a
    np.testing.assert_array_equal(_bits(a), _bits(want))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rot", [D, D // 2], ids=["full", "partial"])
def test_qk_norm_rope_bits(rng, backend, dtype, neox, rot):
    qkv, qw, kw = _inputs(rng, dtype)
    cache = _cache(rng, rot, dtype=BF16 if dtype is BF16 else np.float32)
    pos = rng.integers(0, cache.shape[0], T)
    rope = (cache, pos, neox, rot)
    want = _expected(qkv, qw, kw, backend, rope=rope, eps=1e-6)
    a = qkv.copy()
    pn.qk_norm(a, qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D, rope=rope,
               backend=backend)
    np.testing.assert_array_equal(_bits(a), _bits(want))
    # v is not touched; the columns past rot are the norm alone
    np.testing.assert_array_equal(_bits(a[:, (HQ + HK) * D:]), _bits(qkv[:, (HQ + HK) * D:]))


def _vllm_reference(qkv, qw, kw, eps, cache, pos, neox, rot):
    """vLLM's test reference (RMSNorm.forward_native then RotaryEmbedding.forward_native):
    the norm rounded to the dtype, times the weight in the dtype, then the rotation with
    cos/sin cast to the dtype and each operation rounded to it (torch bf16 semantics)."""
    dt = qkv.dtype
    out = qkv.copy()

    def r(v):
        return v.astype(dt)

    for lo, h, w in ((0, HQ, qw), (HQ * D, HK, kw)):
        x = qkv[:, lo:lo + h * D].reshape(T, h, D).astype(np.float32)
        var = (x * x).mean(-1, keepdims=True)
        y = r(r(x / np.sqrt(var + eps)).astype(np.float32) * w.astype(dt).astype(np.float32))
        cs = r(cache[pos])
        half = rot // 2
        c, s = cs[:, None, :half].astype(np.float32), cs[:, None, half:].astype(np.float32)
        y = y.astype(np.float32)
        sl1, sl2 = ((slice(0, half), slice(half, rot)) if neox
                    else (slice(0, rot, 2), slice(1, rot, 2)))
        x1, x2 = y[..., sl1].copy(), y[..., sl2].copy()
        y[..., sl1] = r(r(r(x1 * c).astype(np.float32) - r(x2 * s).astype(np.float32)))
        y[..., sl2] = r(r(r(x2 * c).astype(np.float32) + r(x1 * s).astype(np.float32)))
        out[:, lo:lo + h * D] = r(y).reshape(T, h * D)
    return out


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_qk_norm_rope_matches_vllm_reference(rng, neox):
    """vLLM's own acceptance: its test's reference within atol = rtol = 1e-2 (bfloat16)."""
    qkv, qw, kw = _inputs(rng, BF16)
    qw = qw.astype(BF16)
    cache = _cache(rng, D // 2)
    pos = rng.integers(0, cache.shape[0], T)
    want = _vllm_reference(qkv, qw, kw, 1e-6, cache, pos, neox, D // 2)
    a = qkv.copy()
    pn.qk_norm(a, qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D,
               rope=(cache, pos, neox, D // 2))
    np.testing.assert_allclose(a.astype(np.float32), want.astype(np.float32),
                               atol=1e-2, rtol=1e-2)
    assert not np.array_equal(a.astype(np.float32), qkv.astype(np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_qk_norm_pair_on_views_and_batch_invariance(rng, backend):
    """Strided (T, H, D) views are written in place, with the packed call's bits, and a
    token's bits do not depend on the other tokens."""
    qkv, qw, kw = _inputs(rng, BF16)
    cache = _cache(rng, D)
    pos = rng.integers(0, cache.shape[0], T)
    rope = (cache, pos, False, D)
    packed = qkv.copy()
    pn.qk_norm(packed, qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D, rope=rope,
               backend=backend)
    a = qkv.copy()
    q, k = a[:, :HQ * D].reshape(T, HQ, D), a[:, HQ * D:(HQ + HK) * D].reshape(T, HK, D)
    assert np.shares_memory(q, a)
    rq, rk = pn.qk_norm_pair(q, k, qw, kw, rope=rope, backend=backend)
    assert rq is q and rk is k
    np.testing.assert_array_equal(_bits(a), _bits(packed))
    for i in (0, T - 1):
        one = qkv[i:i + 1].copy()
        pn.qk_norm(one, qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D,
                   rope=(cache, pos[i:i + 1], False, D), backend=backend)
        np.testing.assert_array_equal(_bits(one[0]), _bits(packed[i]))
    # a reversed token order (negative strides) gives the same rows
    rev = qkv[::-1].copy()[::-1]
    rq, rk = rev[:, :HQ * D].reshape(T, HQ, D), rev[:, HQ * D:(HQ + HK) * D].reshape(T, HK, D)
    pn.qk_norm_pair(rq, rk, qw, kw, rope=rope, backend=backend)
    np.testing.assert_array_equal(_bits(rev), _bits(packed))


def test_qk_norm_errors(rng):
    qkv, qw, kw = _inputs(rng, np.float32)
    kw_ = dict(num_heads_q=HQ, num_heads_k=HK, head_dim=D)
    cache = _cache(rng, D)
    pos = np.zeros(T, np.int64)
    before = qkv.copy()
    with pytest.raises(ValueError, match="qkv must have shape"):
        pn.qk_norm(qkv, qw, kw, num_heads_q=HQ + 1, num_heads_k=HK, head_dim=D)
    with pytest.raises(ValueError, match="q_weight"):
        pn.qk_norm(qkv, qw[:-1], kw, **kw_)
    with pytest.raises(TypeError, match="num_heads_k"):
        pn.qk_norm(qkv, qw, kw, num_heads_q=HQ, num_heads_k=2.0, head_dim=D)
    with pytest.raises(ValueError, match="rotary_dim"):
        pn.qk_norm(qkv, qw, kw, rope=(cache, pos, True, D // 2), **kw_)
    with pytest.raises(ValueError, match="positions must be in"):
        pn.qk_norm(qkv, qw, kw, rope=(cache, pos + 100, True, None), **kw_)
    with pytest.raises(TypeError, match="positions must be integers"):
        pn.qk_norm(qkv, qw, kw, rope=(cache, pos.astype(np.float32), True, None), **kw_)
    with pytest.raises(TypeError, match="is_neox"):
        pn.qk_norm(qkv, qw, kw, rope=(cache, pos, 1, None), **kw_)
    with pytest.raises(TypeError, match="unexpected keyword argument 'partial'"):
        pn.qk_norm(qkv, qw, kw, partial=0.5, **kw_)
    with pytest.raises(ValueError, match="eps"):
        pn.qk_norm(qkv, qw, kw, eps=-1.0, **kw_)
    ro = qkv.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        pn.qk_norm(ro, qw, kw, **kw_)
    np.testing.assert_array_equal(qkv, before)


def test_qk_norm_dask_blockwise_over_tokens(rng):
    """dask: a new array, blockwise over token chunks, with the in-memory call's bits."""
    da = pytest.importorskip("dask.array")
    qkv, qw, kw = _inputs(rng, np.float32)
    cache = _cache(rng, D // 2)
    pos = rng.integers(0, cache.shape[0], T)
    want = qkv.copy()
    pn.qk_norm(want, qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D,
               rope=(cache, pos, True, None))
    x = da.from_array(qkv, chunks=(2, 24))
    got = pn.qk_norm(x, da.from_array(qw), kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D,
                     rope=(cache, da.from_array(pos, chunks=3), True, None))
    assert isinstance(got, da.Array)
    np.testing.assert_array_equal(_bits(got.compute()), _bits(want))


def test_qk_norm_rope_arrays_of_another_library(rng):
    torch = pytest.importorskip("torch")
    qkv, qw, kw = _inputs(rng, np.float32)
    cache = torch.ones(4, D)
    with pytest.raises(TypeError, match="cos_sin_cache"):
        pn.qk_norm(qkv.copy(), qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D,
                   rope=(cache, np.zeros(T, np.int64), True, None))


def test_options_qk_norm_does_not_carry_are_refused():
    # group_size is not an option of qk_norm; casting='none' has no QK kernels: both errors
    qkv = np.ones((2, 4 * 8), np.float32)
    kw = dict(num_heads_q=2, num_heads_k=1, head_dim=8)
    with pytest.raises(TypeError, match="group_size"):
        pn.qk_norm(qkv, None, None, group_size=4, **kw)
    with pytest.raises(ValueError, match="casting='none'"):
        pn.qk_norm(qkv, None, None, casting="none", **kw)
