"""torch: zero-copy dispatch of CPU tensors, autograd functions, the nn.Module."""

from __future__ import annotations

import contextlib
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import polynorm as pn  # noqa: E402
from polynorm.core import interop as _interop  # noqa: E402
from polynorm.core.options import Options  # noqa: E402
from polynorm.ops import norm as _api  # noqa: E402
from polynorm.torch import (  # noqa: E402
    RMSNorm,
    _custom_ops,  # noqa: E402
    add_rms_norm,
    rms_norm,
)
from polynorm.torch import norm as torch_norm  # noqa: E402

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
BEST = "numba" if pn.backends()["numba"][0] else "array_api"


def _randn(*shape, dtype=torch.float32, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(
        kw.get("requires_grad", False)
    )


# ------------------------------------------------------------------ zero-copy interop


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_to_numpy_is_a_view_of_the_tensor(dtype):
    t = _randn(5, 7, dtype=TORCH_DTYPES[dtype], requires_grad=True)[:, 1:6]
    v = _interop.to_numpy(t)
    assert _interop.is_host_array(t)
    assert v.dtype.name == dtype
    assert v.ctypes.data == t.data_ptr()
    assert v.strides == tuple(s * t.element_size() for s in t.stride())
    np.testing.assert_array_equal(v.astype(np.float64), t.detach().double().numpy())


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_from_numpy_shares_memory(dtype):
    a = _interop.to_numpy(_randn(3, 4, dtype=TORCH_DTYPES[dtype])).copy()
    t = _interop.from_numpy(a, torch.empty(0))
    assert t.dtype == TORCH_DTYPES[dtype]
    assert t.data_ptr() == a.ctypes.data
    np.testing.assert_array_equal(t.double().numpy(), a.astype(np.float64))


def test_non_host_tensors_are_not_host_arrays():
    assert not _interop.is_host_array(torch.zeros(2, device="meta"))
    assert not _interop.is_host_array(torch.zeros(2, 2).to_sparse())
    with pytest.raises(TypeError, match="numpy"):
        _interop.to_numpy(torch.zeros(2, device="meta"))


def _ptr(a):
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("shape", [(6, 32), (2, 3, 32)], ids=["2d", "3d"])
def test_auto_dispatch_reaches_the_kernel_without_copies(dtype, shape, monkeypatch):
    """The backend gets the tensor's own memory and its result becomes the tensor returned."""
    tdt = TORCH_DTYPES[dtype]
    x = _randn(*shape, dtype=tdt, requires_grad=True)
    w = _randn(32, dtype=torch.float32, seed=1)
    mod = _api._choose_backend("auto", x)
    assert mod.name == BEST
    seen = {}
    forward, forward_small, backward = mod.forward, mod.forward_small, mod.backward
    forward_decode, backward_decode = mod.forward_decode, mod.backward_decode

    def spy_forward(*args):
        res = forward(*args)
        seen["x"], seen["y"] = _ptr(args[0]), _ptr(res[0])
        return res

    def spy_forward_small(*args):  # the numpy fast path's serial entry
        res = forward_small(*args)
        seen["x"], seen["y"] = _ptr(args[0]), _ptr(res[0])
        return res

    def spy_forward_decode(entry, *args):  # a serial-size call's cached signature
        res = forward_decode(entry, *args)
        seen["x"], seen["y"] = _ptr(args[0]), _ptr(res[0])
        return res

    def spy_backward(*args):
        res = backward(*args)
        seen["dy"], seen["dx"] = _ptr(args[0]), _ptr(res[0])
        return res

    monkeypatch.setattr(mod, "forward", spy_forward)
    monkeypatch.setattr(mod, "forward_small", spy_forward_small)
    monkeypatch.setattr(mod, "forward_decode", spy_forward_decode)
    # no cached signature: the call goes through forward_decode, not an earlier test's
    # entry's lean call, which the spies cannot see
    from polynorm.ops import fast

    monkeypatch.setattr(fast, "_DECODE", {})

    def spy_backward_decode(entry, *args):
        res = backward_decode(entry, *args)
        seen["dy"], seen["dx"] = _ptr(args[0]), _ptr(res[0])
        return res

    monkeypatch.setattr(mod, "backward_decode", spy_backward_decode)
    monkeypatch.setattr(mod, "backward", spy_backward)
    y, rstd = pn.rms_norm(x, w, return_rstd=True)
    assert seen["x"] == x.data_ptr() and seen["y"] == y.data_ptr()
    assert isinstance(y, torch.Tensor) and y.dtype == tdt and y.device == x.device
    assert not y.requires_grad  # the functional API records no history
    assert rstd.dtype == (torch.float64 if dtype == "float64" else torch.float32)
    dy = torch.ones_like(y)
    dx, dw, _ = pn.rms_norm_backward(dy, x, w, rstd=rstd)
    assert seen["dy"] == dy.data_ptr() and seen["dx"] == dx.data_ptr()
    assert dx.dtype == tdt and dw.dtype == torch.float32


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_tensor_result_equals_numpy_result_bitwise(dtype):
    x = _randn(9, 48, dtype=TORCH_DTYPES[dtype], requires_grad=True)
    r = _randn(9, 48, dtype=TORCH_DTYPES[dtype], seed=2)
    w = _randn(48, dtype=torch.float32, seed=1)
    xn, rn, wn = (_interop.to_numpy(a) for a in (x, r, w))
    y, h = pn.add_rms_norm(x, r, w, partial=0.5)
    yn, hn = pn.add_rms_norm(xn, rn, wn, partial=0.5)
    assert y.dtype == x.dtype and h.dtype == x.dtype
    np.testing.assert_array_equal(_interop.to_numpy(y).view(np.uint8), yn.view(np.uint8))
    np.testing.assert_array_equal(_interop.to_numpy(h).view(np.uint8), hn.view(np.uint8))
    dy = _randn(9, 48, dtype=TORCH_DTYPES[dtype], seed=3)
    dx, dw, _ = pn.rms_norm_backward(dy, h, w)
    dxn, dwn, _ = pn.rms_norm_backward(_interop.to_numpy(dy), hn, wn)
    np.testing.assert_array_equal(_interop.to_numpy(dx).view(np.uint8), dxn.view(np.uint8))
    np.testing.assert_array_equal(dw.numpy(), dwn)


def test_out_writes_into_the_tensor():
    x = _randn(4, 64)
    out = torch.empty_like(x)
    ptr = out.data_ptr()
    y = pn.rms_norm(x, out=out)
    assert y is out and out.data_ptr() == ptr
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (64,), eps=1e-6))


# ------------------------------------------------------------------ autograd

OPTION_SETS = {
    "plain": dict(),
    "no-weight": dict(weight=False),
    "bias": dict(bias=True),
    "partial": dict(partial=0.5),
    "offset": dict(offset=1.0),
    "outside": dict(eps_mode="outside", eps=1e-3),
    "llama": dict(casting="llama"),
    "axis-tuple": dict(axis=(1, 2)),
    "axis-middle": dict(axis=1),
    "all": dict(bias=True, partial=0.75, offset=0.5, eps_mode="outside", eps=1e-2),
}


def _args(opts, shape=(3, 4, 6), seed=0):
    opts = dict(opts)
    axis = opts.pop("axis", -1)
    axes = (axis,) if isinstance(axis, int) else axis
    norm_shape = tuple(shape[a] for a in axes)
    x = _randn(*shape, dtype=torch.float64, seed=seed, requires_grad=True)
    w = None
    if opts.pop("weight", True):
        w = (1 + 0.3 * _randn(*norm_shape, dtype=torch.float64, seed=seed + 1)).requires_grad_()
    b = _randn(*norm_shape, dtype=torch.float64, seed=seed + 2, requires_grad=True) if opts.pop(
        "bias", False) else None
    return x, w, b, dict(opts, axis=axis)


@pytest.fixture(params=["eager", "op"])
def path(request, monkeypatch):
    """eager: the autograd.Functions; op: the custom ops torch.compile uses, forced in eager."""
    if request.param == "op":
        monkeypatch.setattr(torch_norm, "_eager", lambda x: False)
    return request.param


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_gradcheck_rms_norm(name, path):
    x, w, b, opts = _args(OPTION_SETS[name])
    inputs = tuple(a for a in (x, w, b) if a is not None)

    def f(*args):
        it = iter(args)
        xx = next(it)
        ww = next(it) if w is not None else None
        bb = next(it) if b is not None else None
        return rms_norm(xx, ww, bb, **opts)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["plain", "bias", "partial", "outside", "axis-tuple"])
def test_gradcheck_add_rms_norm(name, path):
    x, w, b, opts = _args(OPTION_SETS[name])
    r = _randn(*x.shape, dtype=torch.float64, seed=7, requires_grad=True)
    inputs = tuple(a for a in (x, r, w, b) if a is not None)

    def f(*args):
        it = iter(args)
        xx, rr = next(it), next(it)
        ww = next(it) if w is not None else None
        bb = next(it) if b is not None else None
        y, h = add_rms_norm(xx, rr, ww, bb, **opts)
        return y, h  # both outputs carry gradients: the residual stream is fused into dx

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


def test_gradcheck_on_the_reference_backend():
    x, w, b, opts = _args(OPTION_SETS["all"])
    assert torch.autograd.gradcheck(
        lambda xx, ww, bb: rms_norm(xx, ww, bb, backend="array_api", **opts), (x, w, b)
    )


def _torch_rms(x, w, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_low_precision_grads_match_torch_autograd(dtype):
    tdt = TORCH_DTYPES[dtype]
    x = _randn(16, 64, dtype=tdt, requires_grad=True)
    w = (1 + 0.1 * _randn(64, dtype=torch.float32, seed=1)).requires_grad_()
    dy = _randn(16, 64, dtype=tdt, seed=2)
    rms_norm(x, w, eps=1e-5).backward(dy)
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    _torch_rms(x, w, 1e-5).backward(dy)
    assert gx.dtype == tdt and gw.dtype == torch.float32
    tol = 2e-2 if dtype != "float32" else 1e-5
    torch.testing.assert_close(gx.float(), x.grad.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(gw, w.grad, atol=tol * 4, rtol=tol)


def test_add_rms_norm_mixed_dtypes_grads():
    """bf16 activations into an f32 residual stream: each input gets its own dtype's grad."""
    x = _randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    r = _randn(4, 32, dtype=torch.float32, seed=1, requires_grad=True)
    y, h = add_rms_norm(x, r)
    assert h.dtype == torch.float32
    (y.float().sum() + h.sum()).backward()
    assert x.grad.dtype == torch.bfloat16 and r.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.float(), r.grad.to(torch.bfloat16).float())


def test_only_requested_grads_are_computed():
    x = _randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.ones(8, dtype=torch.float64)  # frozen weight
    rms_norm(x, w).sum().backward()
    assert x.grad is not None and w.grad is None


# ------------------------------------------------------------------ nn.Module


@pytest.mark.parametrize("shape", [8, (4, 8)])
def test_module_is_a_drop_in_for_torch_rmsnorm(shape):
    ours, theirs = RMSNorm(shape), torch.nn.RMSNorm(shape)
    assert set(ours.state_dict()) == set(theirs.state_dict()) == {"weight"}
    with torch.no_grad():
        theirs.weight.copy_(1 + 0.1 * _randn(*theirs.weight.shape, seed=3))
    ours.load_state_dict(theirs.state_dict())
    x1 = _randn(5, 4, 8, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = ours(x1), theirs(x2)
    torch.testing.assert_close(y1, y2)
    dy = _randn(5, 4, 8, seed=4)
    y1.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_module_default_eps_is_torchs(dtype):
    # torch's eps=None is the machine epsilon of its compute dtype (float32 for half types);
    # rows of rms ~0.05 make a wrong eps (bfloat16's 2**-7) visible far above rounding.
    x = 0.05 * _randn(3, 16, dtype=dtype)
    ours, theirs = RMSNorm(16, dtype=dtype), torch.nn.RMSNorm(16, dtype=dtype)
    torch.testing.assert_close(ours(x), theirs(x))
    assert ours.weight.dtype == dtype


def test_functional_api_records_no_history_on_any_backend():
    x = _randn(3, 8, requires_grad=True)
    for backend in ("auto", "array_api"):
        assert not pn.rms_norm(x, backend=backend).requires_grad
        assert not pn.rms_norm_backward(x, x, backend=backend)[0].requires_grad


def test_functional_api_under_torch_func_transforms():
    """torch.func's wrappers have no storage for the kernels' views: pn.rms_norm under
    vmap computes with torch's own operations; under grad, where the functional API's
    no-history rule would be a silent zero gradient, it is a TypeError."""
    x = _randn(3, 8, dtype=torch.float64)
    w = 1 + 0.1 * _randn(8, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(lambda r: pn.rms_norm(r, w, eps=1e-6))(x),
                               pn.rms_norm(x, w, eps=1e-6))
    with pytest.raises(TypeError, match="^x is differentiated by torch.func"):
        torch.func.grad(lambda x: pn.rms_norm(x, w).sum())(x)
    with pytest.raises(TypeError, match="^weight is differentiated by torch.func"):
        torch.func.grad(lambda w: pn.rms_norm(x, w).sum())(w)
    with pytest.raises(TypeError, match="^residual is differentiated by torch.func"):
        torch.func.grad(lambda r: pn.add_rms_norm(x, r, w)[0].sum())(x)
    with pytest.raises(TypeError, match="^dy is differentiated by torch.func"):
        torch.func.grad(lambda dy: pn.rms_norm_backward(dy, x, w)[0].sum())(x)
    with pytest.raises(TypeError, match="^z is differentiated by torch.func"):
        torch.func.grad(lambda z: pn.rms_norm_gated(x, z, w).sum())(x)
    with pytest.raises(TypeError, match="^k is differentiated by torch.func"):
        torch.func.grad(lambda q, k: pn.qk_norm_pair(q, k, None, None)[1].sum(), argnums=1)(
            x.reshape(3, 2, 4).clone(), x.reshape(3, 2, 4).clone())
    # an argument grad does not differentiate is wrapped too, and is not an error
    g = torch.func.grad(lambda a, b: (pn.rms_norm(a, w) * b).sum(), argnums=1)(x, x)
    torch.testing.assert_close(g, pn.rms_norm(x, w))
    g = torch.func.grad(lambda x: torch_norm.rms_norm(x, w).sum())(x)  # the way to go
    assert g.shape == x.shape


def test_module_extra_options():
    m = RMSNorm(8, eps=1e-5, bias=True, partial=0.5, offset=1.0, eps_mode="outside",
                casting="llama", dtype=torch.float64)
    assert m.weight.abs().max() == 0 and m.bias.abs().max() == 0  # a scale of one, no shift
    assert "partial=0.5" in repr(m) and "bias=True" in repr(m)
    x = _randn(3, 8, dtype=torch.float64, requires_grad=True)
    y = m(x)
    expected = pn.rms_norm(x.detach(), m.weight.detach(), m.bias.detach(), eps=1e-5, partial=0.5,
                           offset=1.0, eps_mode="outside", casting="llama")
    torch.testing.assert_close(y.detach(), expected)
    assert torch.autograd.gradcheck(m, (x,))
    m2 = RMSNorm(8, elementwise_affine=False)
    assert m2.weight is None and list(m2.parameters()) == []


def test_module_rejects_bad_options_and_shapes():
    with pytest.raises(ValueError, match="partial"):
        RMSNorm(8, partial=0.0)
    with pytest.raises(ValueError, match="eps_mode"):
        RMSNorm(8, eps_mode="between")
    with pytest.raises(ValueError, match="normalized_shape"):
        RMSNorm(8)(torch.zeros(2, 7))


def test_fast_path_leaves_mixed_and_odd_inputs_to_the_generic_front_end():
    x = _randn(2, 8)
    with pytest.raises(TypeError, match="different libraries"):
        pn.rms_norm(x, np.ones(8, np.float32))
    with pytest.raises(TypeError, match="weight"):
        pn.rms_norm(x, torch.ones(8, dtype=torch.int32))
    # a Parameter weight and a non-contiguous x take the fast path and agree with torch
    w = torch.nn.Parameter(1 + 0.1 * _randn(8, seed=1))
    xt = _randn(8, 2).t()
    torch.testing.assert_close(
        pn.rms_norm(xt, w), torch.nn.functional.rms_norm(xt, (8,), w.detach(), 1e-6)
    )


def _compile(f, backend="aot_eager"):
    torch._dynamo.reset()
    return torch.compile(f, backend=backend, fullgraph=True)  # fullgraph: a graph break fails


def _grads(f, *inputs):
    """f's outputs and the gradients of their sum of squares (every output gets a cotangent)."""
    outs = f(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(o.float().square().sum() for o in outs).backward()
    grads = [a.grad for a in inputs]
    for a in inputs:
        a.grad = None
    return [o.detach() for o in outs], grads


def _same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert torch.equal(u, v)


def test_torch_compile_fullgraph_module_fwd_bwd_equals_eager():
    m = RMSNorm(16, bias=True, partial=0.5, eps=1e-5)
    x = _randn(3, 5, 16, requires_grad=True)

    def f(x):
        return m(2 * x) + 1

    runs = []
    for g in (_compile(f), f):
        (y,), (gx,) = _grads(g, x)
        runs.append([y, gx, m.weight.grad, m.bias.grad])
        m.zero_grad(set_to_none=True)
    _same(*runs)


def test_torch_compile_fullgraph_functional_options():
    """Optional args, kwargs and out_dtype survive the custom op; the graph has no break."""
    x = _randn(4, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    r = _randn(4, 3, 8, seed=1, requires_grad=True)
    w = (1 + 0.1 * _randn(3, 8, seed=2)).requires_grad_()

    def f(x, r, w):
        y1 = rms_norm(x, eps=1e-3, eps_mode="outside", partial=0.75)            # no weight
        y2 = rms_norm(x * 2, w, axis=(1, 2), offset=1.0, out_dtype="float32")
        y3, h = add_rms_norm(x, r, w[0], None, casting="llama", out_dtype=torch.float16)
        return y1, y2, y3, h

    got, want = _grads(_compile(f), x, r, w), _grads(f, x, r, w)
    assert [o.dtype for o in got[0]] == [torch.bfloat16, torch.float32, torch.float16,
                                         torch.float32]
    _same(got[0], want[0])
    _same(got[1], want[1])


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_torch_compile_inductor():
    m = RMSNorm(32, dtype=torch.float32)
    x = _randn(4, 32, requires_grad=True)

    def f(x):
        y, h = add_rms_norm(x.sin(), x, m.weight)
        return m(y) * 3 + h

    runs = []
    for g in (_compile(f, "inductor"), f):
        (y,), (gx,) = _grads(g, x)
        runs.append([y, gx, m.weight.grad])
        m.zero_grad(set_to_none=True)
    # inductor's own sin and fused elementwise code may differ from eager's in the last bit
    for u, v in zip(*runs, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["plain", "no-weight", "all", "axis-middle"])
def test_opcheck_forward_ops(name):
    x, w, b, opts = _args(OPTION_SETS[name])
    x = x.detach().float().requires_grad_()
    w = None if w is None else w.detach().float().requires_grad_()
    b = None if b is None else b.detach().float().requires_grad_()
    o = _custom_ops._op_args(Options(**opts))
    for save in ("input", "output"):
        torch.library.opcheck(torch.ops.polynorm.rms_norm.default, (x, w, b, *o, save))
    r = _randn(*x.shape, seed=9, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.polynorm.add_rms_norm.default,
                          (x, r, w, b, *o._replace(out_dtype="float16"), "input"))


def test_opcheck_backward_op():
    x, w, b, opts = _args(OPTION_SETS["all"])
    x, w, b = (a.detach() for a in (x, w, b))
    dy = _randn(*x.shape, seed=5, dtype=torch.float64)
    o = _custom_ops._op_args(Options(**opts))
    for rstd, gr in ((None, None), (pn.rms_norm(x, w, b, return_rstd=True, **opts)[1], dy)):
        torch.library.opcheck(torch.ops.polynorm.rms_norm_backward.default,
                              (dy, x, w, b, rstd, gr, *o))


def test_eager_without_grad_records_nothing_and_matches():
    x = _randn(3, 8)
    w = torch.nn.Parameter(torch.ones(8))
    y = rms_norm(x, w)
    assert y.requires_grad  # a parameter needs grad: recorded
    with torch.no_grad():
        y2 = rms_norm(x, w)
        y3, _ = add_rms_norm(x, x, w)
    assert not y2.requires_grad and not y3.requires_grad
    assert torch.equal(y.detach(), y2)


# ------------------------------------------------------------------ torch.jit.trace, torch.func

@pytest.mark.parametrize("grad", [False, True])
def test_jit_trace_follows_its_input(grad):
    """The trace records the custom op, not the first input's result as a constant."""
    m = RMSNorm(6, bias=True, partial=0.5).double()
    m.requires_grad_(grad)
    x = _randn(4, 6, dtype=torch.float64)
    with contextlib.nullcontext() if grad else torch.no_grad():
        traced = torch.jit.trace(m, x)
        traced_add = torch.jit.trace(add_rms_norm, (x, 2 * x, m.weight))
    assert "polynorm::rms_norm" in str(traced.graph)
    assert "polynorm::add_rms_norm" in str(traced_add.graph)
    x2 = _randn(2, 6, dtype=torch.float64, seed=5, requires_grad=grad)  # another shape, too
    y = traced(x2)
    assert torch.equal(y, m(x2))
    _same(traced_add(x2, x2.detach(), m.weight), add_rms_norm(x2, x2.detach(), m.weight))
    if grad:  # the traced graph runs the op's autograd
        gx, gw = torch.autograd.grad(y.square().sum(), (x2, m.weight))
        want = torch.autograd.grad(m(x2).square().sum(), (x2, m.weight))
        _same((gx, gw), want)


def _loop(f, args, in_dims):
    """``torch.vmap(f, in_dims)(*args)`` by hand: f per slice, stacked."""
    n = next(a.shape[d] for a, d in zip(args, in_dims, strict=True) if d is not None)
    outs = [f(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)))
            for i in range(n)]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(o) for o in zip(*outs, strict=True))
    return torch.stack(outs)


#: options and the shape of one vmapped slice (positive axes: the rule shifts them)
VMAP_CASES = {
    "plain": (dict(), (4, 6)),
    "all": (dict(bias=True, partial=0.75, offset=0.5, eps_mode="outside", eps=1e-2), (4, 6)),
    "axis-first": (dict(axis=0), (4, 6)),
    "axis-tuple": (dict(axis=(0, 2)), (2, 3, 4)),
}


@pytest.mark.parametrize("name", list(VMAP_CASES))
def test_vmap_equals_a_loop_over_slices(name, monkeypatch):
    opts, shape = VMAP_CASES[name]
    opts = dict(opts)
    axis = opts.get("axis", -1)
    norm_shape = tuple(shape[a] for a in ((axis,) if isinstance(axis, int) else axis))
    b = _randn(*norm_shape, dtype=torch.float64, seed=2) if opts.pop("bias", False) else None
    w = 1 + 0.3 * _randn(*norm_shape, dtype=torch.float64, seed=1)
    ws = torch.stack([w, 2 * w, -w])
    xs = _randn(3, *shape, dtype=torch.float64)
    rs = _randn(3, *shape, dtype=torch.float64, seed=8)

    def f(x, w):
        return rms_norm(x, w, b, **opts)

    def g(x, r):
        return add_rms_norm(x, r, w, b, **opts)

    x_last = xs.movedim(0, -1)  # the vmapped dim last
    for fn, in_dims, args in ((f, (0, None), (xs, w)), (f, (-1, None), (x_last, w)),
                              (f, (None, 0), (xs[0], ws)), (f, (0, 0), (xs, ws)),
                              (g, (0, 0), (xs, rs)), (g, (None, 0), (xs[0], rs)),
                              (g, (0, None), (xs, rs[0]))):
        got = torch.func.vmap(fn, in_dims)(*args)
        in_dims = tuple(None if d is None else d % args[i].ndim for i, d in enumerate(in_dims))
        _same(got if isinstance(got, tuple) else [got],
              _loop(fn, args, in_dims) if fn is g else [_loop(fn, args, in_dims)])
    assert torch.func.vmap(f, (0, 0))(xs[:0], ws[:0]).shape == (0, *shape)  # no slices
    # a vmap over tokens is one kernel call (torch's fallback would make one per slice)
    calls = []
    forward = _api.forward
    monkeypatch.setattr(_api, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    torch.func.vmap(f, (0, None))(xs, w)
    torch.func.vmap(g, (0, None))(xs, rs[0])
    assert len(calls) == 2


def _autograd(f, inputs, cot):
    inputs = [a.detach().requires_grad_() for a in inputs]
    return torch.autograd.grad(f(*inputs), inputs, cot)


@pytest.mark.parametrize("name", ["plain", "all", "no-weight"])
def test_func_grad_vjp_jacrev_equal_autograd(name):
    x, w, b, opts = _args(OPTION_SETS[name], shape=(3, 6))
    inputs = [a.detach() for a in (x, w, b) if a is not None]

    def f(*args):
        it = iter(args)
        return rms_norm(next(it), next(it) if w is not None else None,
                        next(it) if b is not None else None, **opts)

    cot = _randn(3, 6, dtype=torch.float64, seed=4)
    argnums = tuple(range(len(inputs)))
    got = torch.func.grad(lambda *a: (f(*a) * cot).sum(), argnums)(*inputs)
    _same(got, _autograd(f, inputs, cot))
    _, vjp = torch.func.vjp(f, *inputs)
    _same(vjp(cot), _autograd(f, inputs, cot))
    jac = torch.func.jacrev(f, argnums)(*inputs)  # vmap over the backward
    for i, j in np.ndindex(3, 6):
        onehot = torch.zeros(3, 6, dtype=torch.float64)
        onehot[i, j] = 1
        _same([jk[i, j] for jk in jac], _autograd(f, inputs, onehot))
    # per-sample gradients: vmap over grad, the weight shared
    if w is not None:
        per = torch.func.vmap(torch.func.grad(lambda ww, xx: f(xx, ww, *inputs[2:]).sum()),
                              (None, 0))(inputs[1], inputs[0])
        want = torch.stack([_autograd(lambda ww, xi=xi: f(xi, ww, *inputs[2:]), [inputs[1]],
                                      torch.ones(6, dtype=torch.float64))[0]
                            for xi in inputs[0]])
        _same([per], [want])


def test_func_grad_add_rms_norm_and_module():
    x, w, _, _ = _args(OPTION_SETS["plain"], shape=(3, 6))
    x, w = x.detach(), w.detach()
    r = _randn(3, 6, dtype=torch.float64, seed=6)

    def f(x, r, w):
        y, h = add_rms_norm(x, r, w)
        return (y * h).sum()

    got = torch.func.grad(f, (0, 1, 2))(x, r, w)
    _same(got, _autograd(lambda *a: f(*a), [x, r, w], torch.tensor(1.0, dtype=torch.float64)))
    m = RMSNorm(6).double()
    p = {"weight": w}
    got = torch.func.grad(lambda p, x: torch.func.functional_call(m, p, (x,)).sum())(p, x)
    with torch.no_grad():
        m.weight.copy_(w)
    m(x).sum().backward()
    assert torch.equal(got["weight"], m.weight.grad)


_SECOND = "second derivatives are not supported"


@pytest.mark.parametrize("add", [False, True])
def test_second_derivative_raises_not_implemented(add, path):
    """No silent None or constant: the first derivative with create_graph=True is right,
    and differentiating it again raises, also where allow_unused=True."""
    x, w, b, opts = _args(OPTION_SETS["bias"], shape=(3, 6))
    r = _randn(3, 6, dtype=torch.float64, seed=7)

    def f(x, w, b):
        return add_rms_norm(x, r, w, b)[0] if add else rms_norm(x, w, b)

    first = torch.autograd.grad(f(x, w, b).square().sum(), (x, w, b))
    g = torch.autograd.grad(f(x, w, b).square().sum(), (x, w, b), create_graph=True)
    _same([a.detach() for a in g], first)
    for inputs in ((x,), (w,), (x, w, b)):
        with pytest.raises(NotImplementedError, match=_SECOND):
            torch.autograd.grad(g[0].sum(), inputs, allow_unused=True)
    with pytest.raises(NotImplementedError, match=_SECOND):
        torch.autograd.gradgradcheck(f, (x, w, b))


def test_second_derivative_and_forward_mode_under_torch_func():
    x = _randn(6, dtype=torch.float64)

    def f(x):
        return rms_norm(x)

    with pytest.raises(NotImplementedError, match=_SECOND):
        torch.func.jacrev(torch.func.jacrev(f))(x)
    with pytest.raises(NotImplementedError, match=_SECOND):
        torch.func.grad(lambda x: torch.func.grad(lambda x: f(x).square().sum())(x).sum())(x)
    for transform in (lambda: torch.func.jvp(f, (x,), (x,)), lambda: torch.func.jacfwd(f)(x),
                      lambda: torch.func.hessian(lambda x: f(x).sum())(x)):
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            transform()
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():  # eager, nothing requires grad: still no silent zero tangent
        dual = fwad.make_dual(x, torch.ones_like(x))
        for call in (lambda: rms_norm(dual), lambda: add_rms_norm(dual, x)):
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                call()
        assert torch.equal(rms_norm(x), f(x.clone()))  # plain tensors there still run


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_functional_eps_none_is_the_modules_and_torchs_default(dtype):
    """eps=None means what it means for pnt.RMSNorm and F.rms_norm: finfo of the opmath dtype."""
    dt = TORCH_DTYPES[dtype]
    x, w = _randn(5, 16, dtype=dt, seed=3), _randn(16, dtype=dt, seed=4)
    want_eps = torch.finfo(torch.float64 if dt == torch.float64 else torch.float32).eps
    y = rms_norm(x, w, eps=None)
    assert torch.equal(y, rms_norm(x, w, eps=want_eps))
    m = RMSNorm(16, dtype=dt)
    with torch.no_grad():
        m.weight.copy_(w)
    assert torch.equal(m(x), y)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (16,), w))
    xg = x.clone().requires_grad_()
    rms_norm(xg, w, eps=None).sum().backward()  # the autograd path takes it too
    assert torch.isfinite(xg.grad).all()
    r = _randn(5, 16, dtype=torch.float64, seed=5)
    yh, _ = add_rms_norm(x, r, eps=None)  # h is float64: float64's epsilon
    assert torch.equal(yh, add_rms_norm(x, r, eps=torch.finfo(torch.float64).eps)[0])


def test_functional_rejects_non_tensors_by_name():
    a = np.ones((2, 4), np.float32)
    t = torch.ones(2, 4)
    for call, name in ((lambda: rms_norm(a), "x"), (lambda: rms_norm(t, a[0]), "weight"),
                       (lambda: rms_norm(t, None, a[0]), "bias"),
                       (lambda: add_rms_norm(t, a), "residual"),
                       (lambda: add_rms_norm(a, t), "x")):
        with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor.*numpy.ndarray") as info:
            call()
        assert "[[" not in str(info.value)  # not the dispatcher's printout of the array
