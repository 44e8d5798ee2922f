"""Memory-lean training: ``save="output"`` keeps y instead of x (polynorm.ops.lean)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import polynorm as pn  # noqa: E402
import polynorm.torch as pnt  # noqa: E402
from polynorm.ops.lean import recover_input  # noqa: E402

# (shape, axis, with bias, options)
CASES = {
    "plain": ((6, 16), -1, False, {}),
    "bias-offset-partial": ((3, 4, 12), -1, True, dict(offset=1.0, partial=0.5)),
    "eps-outside": ((5, 24), -1, False, dict(eps_mode="outside", eps=1e-3)),
    "axis-middle": ((3, 5, 4), (0, 2), True, {}),
}


def _inputs(shape, axis, with_bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    axes = (axis,) if isinstance(axis, int) else axis
    wshape = tuple(shape[a] for a in axes)
    w = (torch.rand(*wshape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    b = (0.1 * torch.randn(*wshape, generator=g, dtype=torch.float64)).to(dtype) if with_bias else None
    return x, w, b


def _grads(fn, x, w, b, dy):
    leaves = [a.detach().clone().requires_grad_() for a in (x, w, b) if a is not None]
    xs, ws, *bs = leaves
    y = fn(xs, ws, bs[0] if bs else None)
    y.backward(dy)
    return [y.detach()] + [a.grad for a in leaves]


@pytest.mark.parametrize("name", list(CASES))
def test_output_saving_matches_input_saving_float64(name):
    shape, axis, with_bias, opts = CASES[name]
    x, w, b = _inputs(shape, axis, with_bias, torch.float64)
    dy = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    runs = {save: _grads(lambda a, c, e, s=save: pnt.rms_norm(a, c, e, axis=axis, save=s, **opts),
                         x, w, b, dy) for save in ("input", "output")}
    for u, v in zip(runs["input"], runs["output"], strict=True):
        torch.testing.assert_close(v, u, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["plain", "bias-offset-partial"])
def test_output_saving_gradcheck(name):
    """Finite differences of the lean path itself (float64)."""
    shape, axis, with_bias, opts = CASES[name]
    x, w, b = _inputs(shape, axis, with_bias, torch.float64, seed=1)
    args = [a.requires_grad_() for a in (x, w, b) if a is not None]

    def f(*a):
        return pnt.rms_norm(a[0], a[1], a[2] if len(a) > 2 else None, axis=axis, save="output",
                            **opts)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7)


def test_add_rms_norm_output_saving_matches():
    x, w, b = _inputs((4, 32), -1, True, torch.float64, seed=2)
    r = torch.randn(4, 32, dtype=torch.float64)
    gy, gh = torch.randn(4, 32, dtype=torch.float64), torch.randn(4, 32, dtype=torch.float64)
    res = {}
    for save in ("input", "output"):
        xs, rs, ws = (a.detach().clone().requires_grad_() for a in (x, r, w))
        y, h = pnt.add_rms_norm(xs, rs, ws, b, save=save)
        torch.autograd.backward((y, h), (gy, gh))
        res[save] = (xs.grad, rs.grad, ws.grad)
    for u, v in zip(res["input"], res["output"], strict=True):
        torch.testing.assert_close(v, u, rtol=1e-10, atol=1e-12)


def test_bfloat16_output_saving_within_bfloat16_precision():
    x, w, _ = _inputs((64, 256), -1, False, torch.bfloat16, seed=4)
    dy = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ref = _grads(lambda a, c, e: pnt.rms_norm(a, c, save="input"), x, w, None, dy)
    lean = _grads(lambda a, c, e: pnt.rms_norm(a, c, save="output"), x, w, None, dy)
    assert torch.equal(ref[0], lean[0])  # the forward is the same call
    for u, v in zip(ref[1:], lean[1:], strict=True):
        scale = u.float().abs().max()
        assert (v.float() - u.float()).abs().max() <= 2 ** -6 * scale


def _saved_ptrs(fn):
    """data pointers of every tensor autograd keeps for the backward of ``fn()``."""
    ptrs = []

    def pack(t):
        ptrs.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return ptrs, out


def test_output_saving_keeps_y_not_x():
    x, w, _ = _inputs((8, 64), -1, False, torch.float32)
    x.requires_grad_()
    for save, kept, dropped in (("input", "x", "y"), ("output", "y", "x")):
        ptrs, y = _saved_ptrs(lambda s=save: pnt.rms_norm(x, w.requires_grad_(), save=s))
        where = {"x": x.untyped_storage().data_ptr(), "y": y.untyped_storage().data_ptr()}
        assert where[kept] in ptrs and where[dropped] not in ptrs, save


def test_weight_with_a_zero_keeps_the_input_and_its_exact_gradients():
    x, w, _ = _inputs((5, 16), -1, False, torch.float32)
    w[3] = 0.0
    dy = torch.randn(5, 16)
    ref = _grads(lambda a, c, e: pnt.rms_norm(a, c, save="input"), x, w, None, dy)
    lean = _grads(lambda a, c, e: pnt.rms_norm(a, c, save="output"), x, w, None, dy)
    for u, v in zip(ref, lean, strict=True):
        assert torch.equal(u, v)
    ptrs, _ = _saved_ptrs(lambda: pnt.rms_norm(x.requires_grad_(), w, save="output"))
    assert x.untyped_storage().data_ptr() in ptrs


def test_module_save_option_and_repr():
    m = pnt.RMSNorm(16, save="output")
    assert "save='output'" in repr(m)
    x = torch.randn(3, 16, requires_grad=True)
    m(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("bad", ["outputs", None, 1])
def test_bad_save_is_a_value_error_naming_it(bad):
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="save"):
        pnt.rms_norm(x, save=bad)
    with pytest.raises(ValueError, match="save"):
        pnt.RMSNorm(4, save=bad)


def test_compiled_output_saving_matches_eager():
    x, w, b = _inputs((4, 32), -1, True, torch.float32, seed=6)
    dy = torch.randn(4, 32)

    def f(a, c, e):
        return pnt.rms_norm(a, c, e, save="output")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    eager, comp = _grads(f, x, w, b, dy), _grads(compiled, x, w, b, dy)
    for u, v in zip(eager, comp, strict=True):
        torch.testing.assert_close(v, u, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ in_place backward


def _in_place_step(fn, x, w, b, g, in_place):
    """A pre-norm step ``(lin(norm(x)) * g).sum()``; returns the grads and whether the
    gradient reaching the norm's output holds the norm's dx afterwards."""
    leaves = [a.detach().clone().requires_grad_() for a in (x, w, b) if a is not None]
    xs, ws, *bs = leaves
    lin = torch.nn.Linear(x.shape[-1], x.shape[-1], bias=False, dtype=x.dtype)
    torch.nn.init.eye_(lin.weight)
    seen = []
    out = fn(xs, ws, bs[0] if bs else None, in_place)
    y = out[0] if isinstance(out, tuple) else out
    y.register_hook(seen.append)
    loss = (lin(y) * g).sum() + (out[1].sum() if isinstance(out, tuple) else 0)
    loss.backward()
    # autograd clones a gradient held elsewhere (by ``seen``) into .grad: compare values
    wrote = torch.equal(seen[0], xs.grad)
    return [a.grad for a in leaves], wrote


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_in_place_backward_writes_dx_over_dy_with_the_same_bits(dtype, fused):
    x, w, b = _inputs((6, 48), -1, True, dtype, seed=4)
    g = torch.randn(6, 48, generator=torch.Generator().manual_seed(5)).to(dtype)
    r = torch.randn(6, 48, generator=torch.Generator().manual_seed(6)).to(dtype)

    def fn(a, c, e, in_place):
        if fused:
            return pnt.add_rms_norm(a, r, c, e, partial=0.5, in_place=in_place)
        return pnt.rms_norm(a, c, e, partial=0.5, in_place=in_place)

    ref, wrote_ref = _in_place_step(fn, x, w, b, g, False)
    got, wrote = _in_place_step(fn, x, w, b, g, True)
    assert wrote and not wrote_ref
    for u, v in zip(ref, got, strict=True):
        assert torch.equal(u, v)


def test_in_place_backward_of_the_module_and_a_float32_gradient_of_16_bit_x():
    """The module passes in_place on; a dy of another dtype than x gets a new dx."""
    m = pnt.RMSNorm(32, in_place=True)
    assert "in_place=True" in repr(m)
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 32)
    m.to(torch.bfloat16)
    y = m(x)
    y.backward(dy.to(torch.bfloat16))
    want = x.grad.clone()
    x.grad = None
    torch.autograd.backward(pnt.rms_norm(x, m.weight, eps=None, in_place=False),  # the module's eps
                            dy.to(torch.bfloat16))
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_bad_in_place_is_a_type_error_naming_it(bad):
    with pytest.raises(TypeError, match="in_place"):
        pnt.rms_norm(torch.randn(2, 4), in_place=bad)
    with pytest.raises(TypeError, match="in_place"):
        pnt.RMSNorm(4, in_place=bad)


def test_recover_input_numpy_round_trip():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 9))
    w = rng.uniform(0.5, 2.0, 9)
    b = rng.standard_normal(9) * 0.1
    y, rstd = pn.rms_norm(x, w, b, offset=0.25, return_rstd=True)
    np.testing.assert_allclose(recover_input(y, w, b, rstd, (1,), 0.25), x, rtol=1e-12,
                               atol=1e-12)


# ----------------------------------------------------------------------------- jax


@pytest.mark.parametrize("name", ["plain", "bias-offset-partial", "axis-middle"])
@pytest.mark.parametrize("jit", [False, True])
def test_jax_output_saving_matches_input_saving(name, jit):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    import polynorm.jax as pj

    shape, axis, with_bias, opts = CASES[name]
    x, w, b = (None if a is None else jnp.asarray(a.numpy())
               for a in _inputs(shape, axis, with_bias, torch.float64, seed=7))
    dy = jnp.asarray(np.random.default_rng(8).standard_normal(shape))

    def grads(save):
        def f(x, w):
            return jnp.vdot(pj.rms_norm(x, w, b, axis=axis, save=save, **opts), dy)

        g = jax.grad(f, argnums=(0, 1))
        return (jax.jit(g) if jit else g)(x, w)

    for u, v in zip(grads("input"), grads("output"), strict=True):
        np.testing.assert_allclose(np.asarray(v), np.asarray(u), rtol=1e-9, atol=1e-11)


def test_jax_add_rms_norm_output_saving_and_bad_save():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import polynorm.jax as pj

    rng = np.random.default_rng(9)
    x, r = (jnp.asarray(rng.standard_normal((4, 16)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.uniform(0.5, 1.5, 16), jnp.float32)

    def grads(save):
        def f(x, r, w):
            y, h = pj.add_rms_norm(x, r, w, save=save)
            return y.sum() + (h * h).sum()

        return jax.grad(f, argnums=(0, 1, 2))(x, r, w)

    for u, v in zip(grads("input"), grads("output"), strict=True):
        np.testing.assert_allclose(np.asarray(v), np.asarray(u), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="save"):
        pj.rms_norm(x, w, save="everything")
