"""jax: zero-copy host views, dispatch, and custom_vjp checked with check_grads."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import polynorm as pn  # noqa: E402
from polynorm.core import interop as _interop  # noqa: E402
from polynorm.jax import add_rms_norm, rms_norm  # noqa: E402
from polynorm.ops import norm as _api  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32", "float64")
BEST = "numba" if pn.backends()["numba"][0] else "array_api"


def _rand(shape, dtype="float64", seed=0):
    a = np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(a).astype(getattr(jnp, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_views_are_zero_copy(dtype):
    x = _rand((5, 8), dtype)
    assert _interop.is_host_array(x)
    v = _interop.to_numpy(x)
    assert v.dtype.name == dtype
    assert v.ctypes.data == x.unsafe_buffer_pointer()
    # results allocated aligned come back to jax without a copy (bfloat16 takes a bit-cast)
    a = _interop.empty((4, 8), v.dtype)
    a[...] = 1
    j = _interop.from_numpy(a, x)
    assert j.dtype == x.dtype
    assert j.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(j, dtype=np.float64), 1.0)


def test_eager_call_hands_the_kernel_the_arrays_own_memory(monkeypatch):
    """Eager jax arrays reach the fast path as numpy views of their own memory."""
    x = _rand((6, 32), "bfloat16")
    seen = {}
    forward = _api._fast.forward

    def spy(mod, x, *args):
        seen["x"] = _interop.to_numpy(x).ctypes.data
        assert type(x) is np.ndarray
        return forward(mod, x, *args)

    monkeypatch.setattr(_api._fast, "forward", spy)
    y = pn.rms_norm(x)
    assert seen["x"] == x.unsafe_buffer_pointer()
    assert isinstance(y, jax.Array) and y.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_results_allocated_with_host_empty_return_to_jax_without_a_copy(dtype):
    x = _rand((3, 8), dtype)
    y = _interop.host_empty((3, 8), np.dtype(dtype), like=x)
    y[...] = 2
    j = _interop.from_numpy(y, x)
    assert j.unsafe_buffer_pointer() == y.ctypes.data
    assert type(_interop.host_empty((2,), np.float32, like=np.zeros(1))) is np.ndarray


@pytest.mark.skipif(BEST != "numba", reason="needs numba")
@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_results_are_the_kernels_own_memory(dtype, monkeypatch):
    """What the kernels wrote becomes the jax array returned: no copy on the way back."""
    made = []
    wrap = _interop.from_numpy
    monkeypatch.setattr(_interop, "from_numpy",
                        lambda a, like: made.append(None if a is None else a.ctypes.data)
                        or wrap(a, like))
    forward = _api._fast.forward

    def spy(*args):  # the forward's results: numpy arrays of the fast path
        r = forward(*args)
        made.extend(a.ctypes.data for a in (r if isinstance(r, tuple) else (r,)))
        return r

    monkeypatch.setattr(_api._fast, "forward", spy)
    # 1 MiB and more: results smaller than that come from numpy's own (16-byte aligned)
    # allocations, which jax copies (polynorm.core.pool.MIN_BYTES)
    x = _rand((512, 1024), dtype)
    w = _rand((1024,), "float32", seed=1)
    y, h = add_rms_norm(x, x, w)
    (dx, dw), = [jax.grad(lambda x, w: (rms_norm(x, w).astype(jnp.float32) ** 2).sum(),
                          argnums=(0, 1))(x, w)]
    for a in (y, h, dw):
        assert a.unsafe_buffer_pointer() in made
    assert dx.dtype == x.dtype and dx.unsafe_buffer_pointer() in made


def test_tracers_are_not_host_arrays():
    seen = []
    jax.jit(lambda x: seen.append(_interop.is_host_array(x)) or x)(jnp.ones(3))
    assert seen == [False]


@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_dispatch_bitwise_equals_numpy(dtype):
    x = _rand((7, 40), dtype)
    r = _rand((7, 40), dtype, seed=1)
    w = _rand((40,), "float32", seed=2)
    assert _api._choose_backend("auto", x).name == BEST
    y, h, rstd = pn.add_rms_norm(x, r, w, partial=0.5, return_rstd=True)
    assert isinstance(y, jax.Array) and y.dtype == x.dtype and h.dtype == x.dtype
    yn, hn, rstdn = pn.add_rms_norm(*(np.asarray(a) for a in (x, r, w)), partial=0.5,
                                    return_rstd=True)
    for got, want in ((y, yn), (h, hn), (rstd, rstdn)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


def test_functional_api_under_jit_takes_the_reference_path_and_agrees():
    x = _rand((6, 32), "float32")
    w = _rand((32,), "float32", seed=1)
    f = jax.jit(lambda x, w: pn.rms_norm(x, w, eps_mode="outside", partial=0.25))
    np.testing.assert_allclose(
        np.asarray(f(x, w)),
        np.asarray(pn.rms_norm(x, w, eps_mode="outside", partial=0.25)), rtol=2e-6, atol=2e-6,
    )


def _bits(a):
    return np.asarray(a).view(np.uint8)


def _assert_same_bits(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(_bits(g), _bits(w))


JIT_OPTIONS = {  # backend="numba": the kernels under jit (a host callback)
    "plain": dict(backend="numba"),
    "all": dict(partial=0.5, offset=0.5, eps_mode="outside", eps=1e-2, out_dtype="float32",
                backend="numba"),
    "llama-axis": dict(casting="llama", axis=(1, 2), backend="numba"),
}


@pytest.mark.skipif(BEST != "numba", reason="needs numba")
@pytest.mark.parametrize("name", list(JIT_OPTIONS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jit_runs_the_kernels_with_the_eager_bits(dtype, name, monkeypatch):
    """backend="numba" under jit: the custom_vjp reaches the kernels (an XLA FFI host call)."""
    opts = dict(JIT_OPTIONS[name])
    x = _rand((3, 5, 16), dtype)
    r = _rand((3, 5, 16), dtype, seed=1)
    ns = (16,) if "axis" not in opts else (5, 16)
    w = _rand(ns, "float32", seed=2)
    b = _rand(ns, dtype, seed=3)

    def loss(x, r, w, b):
        y1 = rms_norm(x, w, b, **opts)
        y2, h = add_rms_norm(x, r, w, **opts)
        return sum((a.astype(jnp.float32) ** 2).sum() for a in (y1, y2, h))

    def fwd(x, r, w, b):
        return rms_norm(x, w, b, **opts), add_rms_norm(x, r, None, b, **opts)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    want_y, want_g = fwd(x, r, w, b), grad(x, r, w, b)
    kernel = _api._backends.get("numba")
    calls = []
    for fn in ("forward", "backward"):
        orig = getattr(kernel, fn)
        monkeypatch.setattr(kernel, fn, lambda *a, _f=orig, _n=fn: calls.append(_n) or _f(*a))
    got_y, got_g = jax.block_until_ready((jax.jit(fwd)(x, r, w, b), jax.jit(grad)(x, r, w, b)))
    assert calls.count("forward") == 4 and calls.count("backward") == 2
    _assert_same_bits(got_y, want_y)
    _assert_same_bits(got_g, want_g)
    _assert_same_bits(jax.grad(jax.jit(loss), argnums=(0, 1, 2, 3))(x, r, w, b), want_g)


@pytest.mark.skipif(BEST != "numba", reason="needs numba")
def test_jit_lowers_the_reference_by_default_and_the_host_kernel_for_numba():
    x = _rand((4, 8), "float32")
    auto = jax.jit(lambda x: rms_norm(x)).lower(x).as_text()
    assert "custom_call" not in auto and "stablehlo.reduce" in auto
    numba = jax.jit(lambda x: rms_norm(x, backend="numba")).lower(x).as_text()
    assert "@polynorm_host_kernel" in numba and "stablehlo.reduce" not in numba
    grad = jax.jit(jax.grad(lambda x: rms_norm(x, backend="numba").sum())).lower(x).as_text()
    assert grad.count("@polynorm_host_kernel") == 2 and "stablehlo.reduce" not in grad


@pytest.mark.skipif(BEST != "numba", reason="needs numba")
def test_jit_host_kernel_works_on_xlas_own_buffers(monkeypatch):
    """Operands are read and y is written in place: no copy on either side of the kernel."""
    kernel = _api._backends.get("numba")
    seen = {}
    forward = kernel.forward

    def spy(x, residual, weight, bias, plan, out=None):
        seen["x"], seen["out"] = x.ctypes.data, out.ctypes.data
        return forward(x, residual, weight, bias, plan, out)

    monkeypatch.setattr(kernel, "forward", spy)
    x = _rand((64, 128), "bfloat16")
    y = jax.block_until_ready(jax.jit(lambda x: rms_norm(x, backend="numba"))(x))
    assert seen["x"] == x.unsafe_buffer_pointer() and seen["out"] == y.unsafe_buffer_pointer()


@pytest.mark.skipif(BEST != "numba", reason="needs numba")
def test_jit_host_kernel_errors_reach_the_caller(monkeypatch):
    def boom(*args):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(_api._backends.get("numba"), "forward", boom)
    with pytest.raises(Exception, match="kernel exploded"):
        jax.block_until_ready(jax.jit(lambda x: rms_norm(x, backend="numba"))(jnp.ones((2, 8))))


@pytest.mark.slow  # the fallback of a jax without the FFI: its own compiles (~10 s cold)
@pytest.mark.skipif(BEST != "numba", reason="needs numba")
def test_jit_without_the_ffi_falls_back_to_pure_callback(monkeypatch):
    from polynorm.jax import ffi as _jax_ffi

    monkeypatch.setattr(_jax_ffi, "available", lambda: False)
    x, w, b, opts = _args(OPTION_SETS["all"])

    def f(x, w, b):
        return rms_norm(x, w, b, backend="numba", **opts)

    assert "callback" in jax.jit(f).lower(x, w, b).as_text()
    _assert_same_bits(jax.jit(f)(x, w, b), f(x, w, b))
    check_grads(jax.jit(f), (x, w, b), order=1, modes=["rev"])


@pytest.mark.parametrize("backend", ["auto", "numba"])
def test_check_grads_under_jit_and_vmap(backend):
    if backend == "numba" and BEST != "numba":
        pytest.skip("needs numba")
    x, w, b, opts = _args(OPTION_SETS["all"])
    f = jax.jit(lambda x, w, b: rms_norm(x, w, b, backend=backend, **opts))
    check_grads(f, (x, w, b), order=1, modes=["rev"])
    fv = jax.jit(jax.vmap(lambda x, w, b: rms_norm(x, w, b, backend=backend, **opts),
                          in_axes=(1, None, None)))
    check_grads(fv, (x, w, b), order=1, modes=["rev"])


def test_jit_with_numba_forced_but_missing_says_so(monkeypatch):
    monkeypatch.setitem(_api._backends._status, "numba", (False, "hidden by the test"))
    x = _rand((4, 8), "float32")
    with pytest.raises(ValueError, match="numba"):
        jax.jit(lambda x: rms_norm(x, backend="numba"))(x)
    np.testing.assert_allclose(jax.jit(rms_norm)(x), pn.rms_norm(np.asarray(x)), rtol=1e-6)


@pytest.mark.skipif(BEST != "numba", reason="needs numba")
@pytest.mark.parametrize("where", ["x", "x-axis1", "x-and-weight"])
def test_vmap_equals_a_loop_bitwise(where):
    x = _rand((3, 5, 16), "float32")
    w = _rand((3, 16), "float32", seed=1)
    if where == "x":
        args, axes, loop = (x, w[0]), (0, None), [(x[i], w[0]) for i in range(3)]
    elif where == "x-axis1":
        args, axes, loop = (x, w[0]), (1, None), [(x[:, i], w[0]) for i in range(5)]
    else:
        args, axes, loop = (x, w), (0, 0), [(x[i], w[i]) for i in range(3)]

    def f(x, w):
        y = rms_norm(x, w, partial=0.5, backend="numba")
        loss = lambda x, w: (rms_norm(x, w, backend="numba") ** 2).sum()  # noqa: E731
        return y, jax.grad(loss, argnums=(0, 1))(x, w)

    got = jax.jit(jax.vmap(f, in_axes=axes))(*args)
    want = jax.tree.map(lambda *a: jnp.stack(a), *[f(*a) for a in loop])
    _assert_same_bits(got, want)


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


def _args(opts, shape=(3, 4, 6)):
    opts = dict(opts)
    axis = opts.pop("axis", -1)
    axes = (axis,) if isinstance(axis, int) else axis
    ns = tuple(shape[a] for a in axes)
    x = _rand(shape)
    w = 1 + 0.3 * _rand(ns, seed=1) if opts.pop("weight", True) else None
    b = _rand(ns, seed=2) if opts.pop("bias", False) else None
    return x, w, b, dict(opts, axis=axis)


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_check_grads_rms_norm(name):
    x, w, b, opts = _args(OPTION_SETS[name])
    check_grads(lambda x, w, b: rms_norm(x, w, b, **opts), (x, w, b), order=1, modes=["rev"])


@pytest.mark.parametrize("name", ["plain", "bias", "partial", "outside"])
def test_check_grads_add_rms_norm(name):
    x, w, b, opts = _args(OPTION_SETS[name])
    r = _rand(x.shape, seed=5)
    check_grads(lambda x, r, w, b: add_rms_norm(x, r, w, b, **opts), (x, r, w, b), order=1,
                modes=["rev"])


def test_grad_dtypes_follow_the_inputs():
    x = _rand((4, 16), "bfloat16")
    r = _rand((4, 16), "float32", seed=1)
    w = _rand((16,), "float32", seed=2)

    def loss(x, r, w):
        y, h = add_rms_norm(x, r, w)
        return y.astype(jnp.float32).sum() + h.sum()

    gx, gr, gw = jax.grad(loss, argnums=(0, 1, 2))(x, r, w)
    assert (gx.dtype, gr.dtype, gw.dtype) == (jnp.bfloat16, jnp.float32, jnp.float32)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(gr.astype(jnp.bfloat16)))


def test_vjp_is_the_hand_written_backward():
    x = _rand((5, 12), "float32")
    w = _rand((12,), "float32", seed=1)
    dy = _rand((5, 12), "float32", seed=2)
    _, vjp = jax.vjp(lambda x, w: rms_norm(x, w), x, w)
    dx, dw = vjp(dy)
    dxn, dwn, _ = pn.rms_norm_backward(*(np.asarray(a) for a in (dy, x, w)))
    np.testing.assert_array_equal(np.asarray(dx), dxn)
    np.testing.assert_array_equal(np.asarray(dw), dwn)


def test_jit_of_grad_with_a_closed_over_bias():
    """A traced x (no device) meets a concrete closed-over bias (cpu:0) in the front end."""
    w, b = jnp.ones(8), jnp.full(8, 0.5)
    g = jax.jit(jax.grad(lambda x, w: rms_norm(x, w, b).sum(), argnums=(0, 1)))
    gx, gw = g(jnp.arange(16.0).reshape(2, 8), w)
    assert gx.shape == (2, 8) and gw.shape == (8,)
    assert bool(jnp.isfinite(gx).all())


# ------------------------------------------------------------------ device placement
# tests/conftest.py gives jax two CPU devices (XLA_FLAGS, before jax starts)


def _devices(n=2):
    devs = jax.devices("cpu")
    if len(devs) < n:
        pytest.skip(f"needs {n} jax CPU devices, has {len(devs)} (jax started before "
                    "tests/conftest.py could set XLA_FLAGS)")
    return devs


def _every_op(x, r, w):
    """Each front end on (x, r, w): the functional API, polynorm.jax and its gradients,
    the gated and the quantized op."""
    import polynorm.jax as pj

    def loss(x, w):
        return (rms_norm(x, w).astype(jnp.float32) ** 2).sum()

    def gated_loss(x, z):
        return pj.rms_norm_gated(x, z, w).astype(jnp.float32).sum()

    return {
        "rms_norm": pn.rms_norm(x, w, return_rstd=True),
        "add_rms_norm": pn.add_rms_norm(x, r, w, return_rstd=True),
        "rms_norm_backward": pn.rms_norm_backward(r, x, w),
        "jax.rms_norm": rms_norm(x, w),
        "jax.add_rms_norm": add_rms_norm(x, r, w),
        "grad": jax.grad(loss, argnums=(0, 1))(x, w),
        "rms_norm_gated": pj.rms_norm_gated(x, r, w),
        "gated grad": jax.grad(gated_loss, argnums=(0, 1))(x, r),
        "rms_norm_quant": pj.rms_norm_quant(x, w, dtype="int8"),
    }


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_results_and_gradients_stay_on_a_non_default_device(dtype):
    """Arrays on cpu:1: every result there too (not on cpu:0), and the eager bits."""
    dev = _devices()[1]
    x, r = _rand((6, 32), dtype), _rand((6, 32), dtype, seed=1)
    w = _rand((32,), "float32", seed=2)
    want = _every_op(x, r, w)
    got = _every_op(*(jax.device_put(a, dev) for a in (x, r, w)))
    for name, res in got.items():
        for a in jax.tree.leaves(res):
            assert a.devices() == {dev}, name
        _assert_same_bits(res, want[name])


def test_check_grads_on_a_non_default_device():
    """check_grads passes uncommitted cotangents (numpy): jax may move them, as jnp does."""
    dev = _devices()[1]
    x, w, b, opts = _args(OPTION_SETS["all"])
    x, w, b = (jax.device_put(a, dev) for a in (x, w, b))
    check_grads(lambda x, w, b: rms_norm(x, w, b, **opts), (x, w, b), order=1, modes=["rev"])
    r = jax.device_put(_rand(x.shape, seed=5), dev)
    check_grads(lambda x, r, w, b: add_rms_norm(x, r, w, b, **opts), (x, r, w, b), order=1,
                modes=["rev"])


def test_uncommitted_inputs_give_uncommitted_results():
    """As a jnp operation: a result jax may move next to arrays committed elsewhere."""
    dev = _devices()[1]
    x, w = _rand((3, 8), "float32"), _rand((8,), "float32", seed=1)
    y = pn.rms_norm(x, w)
    assert not _interop.jax_committed(y)
    assert not any(_interop.jax_committed(a) for a in pn.rms_norm(x[:0], w, return_rstd=True))
    assert (y + jax.device_put(x, dev)).devices() == {dev}
    y1 = pn.rms_norm(jax.device_put(x, dev), w)  # the weight moves to x's device
    assert y1.devices() == {dev} and _interop.jax_committed(y1)
    _assert_same_bits(y1, y)


@pytest.mark.parametrize("backend", ["array_api", "auto"])
def test_empty_rows_under_jit(backend):
    """No rows: the results are made, not computed, and a tracer has no device of its own."""
    x = _rand((0, 8), "float32")
    y, h = jax.jit(lambda x: add_rms_norm(x, x, backend=backend))(x)
    assert y.shape == h.shape == (0, 8) and y.dtype == h.dtype == jnp.float32
    y, h = jax.jit(lambda x: pn.add_rms_norm(x, x, backend=backend))(x)
    assert y.shape == h.shape == (0, 8)
    assert jax.jit(lambda x: rms_norm(x, backend=backend))(x).shape == (0, 8)
    g = jax.grad(lambda x: add_rms_norm(x, x, backend=backend)[0].sum())(x)
    assert g.shape == (0, 8)


def test_arrays_committed_to_different_devices_are_a_value_error():
    d0, d1 = _devices()[:2]
    x, w = _rand((3, 8), "float32"), _rand((8,), "float32", seed=1)
    with pytest.raises(ValueError, match="x is on device cpu:1 but weight is on device cpu:0"):
        pn.rms_norm(jax.device_put(x, d1), jax.device_put(w, d0))
    with pytest.raises(ValueError, match="x is on device cpu:1 but dy is on device cpu:0"):
        pn.rms_norm_backward(jax.device_put(x, d0), jax.device_put(x, d1), w)


def test_sharded_x_with_a_replicated_weight_runs_per_shard_rows():
    """x split over a mesh by tokens, weight replicated on it: the jnp reference, which
    XLA partitions; results on the same mesh, x-shaped ones split as x is.  (Eager jnp
    compiles each operation for the sharding: a few front ends only.)"""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(_devices()[:2]), ("d",))
    x, r = _rand((4, 16), "float32"), _rand((4, 16), "float32", seed=1)
    w = 1 + 0.3 * _rand((16,), "float32", seed=2)
    rows, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def ops(x, r, w):
        return {"rms_norm": pn.rms_norm(x, w, return_rstd=True),
                "add_rms_norm": pn.add_rms_norm(x, r, w),
                "grad": jax.grad(lambda x, w: (rms_norm(x, w) ** 2).sum(), argnums=(0, 1))(x, w)}

    got = ops(jax.device_put(x, rows), jax.device_put(r, rows), jax.device_put(w, whole))
    want = ops(x, r, w)
    for name, res in got.items():
        for g, e in zip(jax.tree.leaves(res), jax.tree.leaves(want[name]), strict=True):
            assert g.sharding.device_set == set(mesh.devices.flat), name
            if g.shape == x.shape:
                assert g.sharding.is_equivalent_to(rows, g.ndim), name
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5,
                                       err_msg=name)
    # a weight committed to one device of the mesh: jnp refuses it too
    with pytest.raises(ValueError, match="weight is on device cpu:0"):
        pn.rms_norm(jax.device_put(x, rows), jax.device_put(w, mesh.devices.flat[0]))


def test_jit_scaled_pass_behind_cond():
    """Under jit the reference's scaled pass (rows whose squares overflow or underflow)
    sits behind a lax.cond, and a row's bits do not depend on the branch: a plain row
    alone (scaled pass skipped) equals the same row beside an overflowing one (taken),
    and both equal the formula in float64 to rounding."""
    f = jax.jit(lambda x, w: rms_norm(x, w, backend="array_api"))
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    x[1] *= np.float32(1e25)  # its float32 squares overflow
    w = np.linspace(0.5, 1.5, 64, dtype=np.float32)
    jaxpr = str(jax.make_jaxpr(f)(jnp.asarray(x), jnp.asarray(w)))
    assert "cond[" in jaxpr
    both = np.asarray(f(jnp.asarray(x), jnp.asarray(w)))
    alone = np.asarray(f(jnp.asarray(x[:1]), jnp.asarray(w)))
    np.testing.assert_array_equal(both[:1].view(np.uint32), alone.view(np.uint32))
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(both, want, rtol=2e-6)
