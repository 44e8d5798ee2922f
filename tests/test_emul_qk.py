"""pn_qk_fwd (QK-norm + RoPE, in place) run on the CPU by the emulator.

Launched as the cupy backend launches it (``launch.qk_launch``, arguments in the ABI
order) on (T, H, D) views of a packed numpy qkv.  Bit for bit against pn_fwd's own y
of the same head rows (``emul_forward``: the same segment sums, so the same rstd)
rounded to the dtype, then the rotation written out in numpy in the compute type
(vLLM's ``a*c - b*s``, ``b*c + a*s``, NeoX halves or GPT-J pairs), rounded once; the
v slice untouched; a token alone gives its bits in the batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_emul_fusions import fake_cupy  # noqa: F401  (the stand-in cupy)
from test_emul_kernels import NP, _name, emul_forward, module

from polynorm.backends.cuda import launch as cl
from polynorm.core.options import Options, compute_dtype, make_plan

T, HQ, HK = 5, 3, 2


def emul_qk(x3, w, plan, cs, neox):
    """``pn_qk_fwd`` on the (T, H, D) view ``x3`` in place; ``cs``: (T, rot) or None."""
    xd = _name(x3)
    ct = NP[compute_dtype(xd)]
    t, h, d = x3.shape
    it = x3.itemsize
    assert x3.strides[2] == it
    wk = None if w is None else np.ascontiguousarray(w, ct)
    csk = None if cs is None else np.ascontiguousarray(cs, ct)
    rot = 0 if cs is None else cs.shape[1]
    launch = cl.qk_launch(t * h, d, xd, neox)
    args = (x3, np.int64(x3.strides[0] // it), np.int64(x3.strides[1] // it), np.int32(h), wk,
            csk, np.int64(rot), np.int32(rot), np.int64(t * h), np.int32(d),
            np.int32(plan.k), np.int32(launch.tpr), np.float64(plan.eps),
            np.int32(plan.eps_inside), np.float64(plan.offset))
    module(xd).launch(launch.name, launch.grid, launch.block, args, launch.shared)


def _expected(heads, w, plan, cs, neox):
    t, h, d = heads.shape
    y = emul_forward(np.ascontiguousarray(heads).reshape(t * h, d), None, w, None, plan)[0]
    y = y.reshape(t, h, d)
    if cs is None:
        return y
    ct = NP[plan.compute_dtype]
    v = y.astype(ct)
    rot = cs.shape[1]
    half = rot // 2
    c, s = cs[:, None, :half].astype(ct), cs[:, None, half:].astype(ct)
    sl = (slice(0, half), slice(half, rot)) if neox else (slice(0, rot, 2), slice(1, rot, 2))
    a, b = v[..., sl[0]].copy(), v[..., sl[1]].copy()
    v[..., sl[0]] = a * c - b * s
    v[..., sl[1]] = b * c + a * s
    return v.astype(y.dtype)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("d, rot, neox, opts", [
    (64, 64, True, {}),
    (64, 32, False, {"offset": 1.0, "eps_mode": "outside"}),
    (40, None, True, {"eps": 0.0}),
], ids=["neox", "gptj-partial-gemma", "norm-only-d40"])
def test_emul_qk_bits(dtype, d, rot, neox, opts):
    rng = np.random.default_rng(d + len(dtype))
    qkv = (rng.standard_normal((T, (HQ + 2 * HK) * d)) * 3).astype(NP[dtype])
    qkv[1, :d] = 0  # an all-zero head (NaN with eps=0, zero otherwise)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    plan = make_plan(d, dtype, Options(**opts))
    cs = None
    if rot:
        ang = rng.standard_normal((T, rot // 2))
        cs = np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(np.float32)
    a = qkv.copy()
    q3 = a[:, :HQ * d].reshape(T, HQ, d)
    k3 = a[:, HQ * d:(HQ + HK) * d].reshape(T, HK, d)
    want_q = _expected(qkv[:, :HQ * d].reshape(T, HQ, d), w, plan, cs, neox)
    want_k = _expected(qkv[:, HQ * d:(HQ + HK) * d].reshape(T, HK, d), None, plan, cs, neox)
    emul_qk(q3, w, plan, cs, neox)
    emul_qk(k3, None, plan, cs, neox)
    np.testing.assert_array_equal(_bits(q3), _bits(want_q))
    np.testing.assert_array_equal(_bits(k3), _bits(want_k))
    np.testing.assert_array_equal(_bits(a[:, (HQ + HK) * d:]), _bits(qkv[:, (HQ + HK) * d:]))
    one = qkv[3:4].copy()
    emul_qk(one[:, :HQ * d].reshape(1, HQ, d), w, plan, None if cs is None else cs[3:4], neox)
    np.testing.assert_array_equal(_bits(one[0, :HQ * d]), _bits(a[3, :HQ * d]))


def test_emul_qk_backend_glue(fake_cupy):  # noqa: F811  (the fixture imported above)
    """The cupy backend's qk_forward (pointers, token/head strides, casts of the weight
    and the cache rows) writes the launcher's bits in place into a packed qkv's views;
    llama casting runs the reference on the device arrays."""
    backend, fake, launches = fake_cupy
    rng = np.random.default_rng(7)
    d = 64
    qkv = (rng.standard_normal((T, (HQ + 2 * HK) * d)) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    ang = rng.standard_normal((T, d // 2))
    cs = np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(np.float32)
    plan = make_plan(d, "float32", Options(eps=1e-5))
    want = qkv.copy()
    emul_qk(want[:, :HQ * d].reshape(T, HQ, d), w, plan, cs, False)
    fq = fake(qkv.copy())
    q3 = fq[:, :HQ * d].reshape(T, HQ, d)
    got = backend.qk_forward(q3, fake(w), plan, (fake(cs), False), q3)
    assert got is q3
    np.testing.assert_array_equal(_bits(np.asarray(fq)), _bits(want))
    assert [nm for nm, *_ in launches] == ["pn_qk_fwd<float, 0>"]


def test_nvrtc_compiles_pn_qk_fwd():
    """Every pn_qk_fwd instantiation compiles with NVRTC (sm_90), without warnings, and
    is in the cubin under its lowered name."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) is not installed")
    from polynorm.backends.cuda import nvrtc as _nvrtc

    ok, why = _nvrtc.available()
    if not ok:
        pytest.skip(why)
    names = [cl.qk_name(t, nx) for t in ("float16", "bfloat16", "float32", "float64")
             for nx in (False, True)]
    assert set(names) <= set(cl.specialisations())
    res = _nvrtc.compile_names(names, "sm_90", ())
    assert res.ok, res.log
    assert "warning" not in res.log.lower(), res.log
    assert set(res.lowered) == set(names)
    for low in res.lowered.values():
        assert low.encode() in res.cubin
