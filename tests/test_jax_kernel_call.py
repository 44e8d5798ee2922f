"""jax, backend="auto" on a one-CPU-device process: the Numba kernels through the
compiled XLA FFI handler (polynorm.backends.numba.xla), under jit and for small eager
arrays, with the eager kernels' bits.  The test process has two CPU devices (conftest),
where the reference runs; the tests say "one device" by patching that check."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import polynorm as pn  # noqa: E402
from polynorm.jax import add_rms_norm, rms_norm  # noqa: E402
from polynorm.jax import norm as jn  # noqa: E402
from polynorm.ops import norm as _api  # noqa: E402

pytestmark = pytest.mark.skipif(not pn.backends()["numba"][0], reason="needs numba")


@pytest.fixture
def one_device(monkeypatch):
    monkeypatch.setattr(jn, "_one_cpu_device", lambda: True)
    monkeypatch.setattr(jn, "_eager_fns", {})
    monkeypatch.setattr(jn, "_eager_plain", {})


def _rand(shape, dtype, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _bits(a):
    return np.asarray(a).view(np.uint8)


def _formula(x, w, b, eps, offset=0.0, k=None):
    """float64 RMSNorm over the last axis, eps inside the root, statistic of the first k."""
    x = np.asarray(x, np.float64)
    k = x.shape[-1] if k is None else k
    ms = np.mean(x[..., :k] ** 2, axis=-1, keepdims=True)
    y = x / np.sqrt(ms + eps) * (np.asarray(w, np.float64) + offset)
    return y if b is None else y + np.asarray(b, np.float64)


CASES = {  # dtype, options, bias, the custom call: rstd alone (y from XLA) or the whole forward
    "float32": ("float32", {}, False, "polynorm_rstd_"),
    "bfloat16-all": ("bfloat16", dict(partial=0.5, offset=0.5, out_dtype="float32"), True,
                     "polynorm_forward_"),
}


@pytest.mark.parametrize("name", list(CASES))  # each compiles a handler of its own (~1.5 s)
def test_jit_default_is_the_kernel_call_with_the_eager_bits(name, one_device):
    dtype, opts, has_bias, target = CASES[name]
    x = _rand((2, 3, 64), dtype)
    w = _rand((64,), "float32", seed=1)
    b = _rand((64,), dtype, seed=2) if has_bias else None
    f = jax.jit(lambda x, w, b: rms_norm(x, w, b, **opts))
    text = f.lower(x, w, b).as_text()
    assert target in text and "stablehlo.reduce" not in text
    y = f(x, w, b)
    np_args = [None if a is None else np.asarray(a) for a in (x, w, b)]
    want = pn.rms_norm(*np_args, **opts)  # the eager kernels
    assert y.dtype == want.dtype and y.shape == x.shape
    np.testing.assert_array_equal(_bits(y), _bits(want))
    k = 32 if "partial" in opts else None
    np.testing.assert_allclose(np.asarray(y, np.float64),
                               _formula(x, w, b, 1e-6, opts.get("offset", 0.0), k),
                               rtol=1e-2 if dtype == "bfloat16" else 2e-6, atol=1e-5)
    # a token's bits do not depend on the batch (one token alone, jitted)
    one = jax.jit(lambda x, w, b: rms_norm(x, w, b, **opts))(x[1, 2:3], w, b)
    np.testing.assert_array_equal(_bits(one), _bits(y[1, 2:3]))


@pytest.mark.parametrize("name", list(CASES))
def test_jit_kernel_call_on_xla_threads_has_the_eager_bits(name, one_device):
    """Calls of at least POOL_MIN_ELEMENTS (the rstd alone: STAT_POOL_MIN_ELEMENTS) run in
    row chunks on XLA's thread pool (67 rows: chunks of unequal reach); every chunk written, the eager bits.  Each call
    has inputs of its own: XLA may hand a result buffer that still holds an earlier
    result."""
    from polynorm.backends.numba import xla

    dtype, opts, has_bias, target = CASES[name]
    d = 4096
    assert 67 * d >= max(xla.POOL_MIN_ELEMENTS, xla.STAT_POOL_MIN_ELEMENTS)
    f = jax.jit(lambda x, w, b: rms_norm(x, w, b, **opts))
    # a y of XLA_ASYNC_MIN_BYTES and more: the counted-flops operand (a small reduce) of
    # the whole forward's call
    assert 67 * d * 4 >= jn.XLA_ASYNC_MIN_BYTES
    x0 = _rand((67, d), dtype)
    text = f.lower(x0, _rand((d,), "float32"), x0[0] if has_bias else None).as_text()
    assert target in text and ("stablehlo.reduce" in text) == (target == "polynorm_forward_")
    for seed in (3, 4):
        x = _rand((67, d), dtype, seed=seed)
        w = _rand((d,), "float32", seed=seed + 10)
        b = _rand((d,), dtype, seed=seed + 20) if has_bias else None
        want = pn.rms_norm(*[None if a is None else np.asarray(a) for a in (x, w, b)], **opts)
        np.testing.assert_array_equal(_bits(f(x, w, b)), _bits(want))


def test_jit_kernel_call_under_vmap_and_grad(one_device):
    x = _rand((4, 5, 32), "float32")
    w = 1 + 0.3 * _rand((4, 32), "float32", seed=1)
    f = jax.jit(jax.vmap(lambda x, w: rms_norm(x, w, backend="numba"), in_axes=(0, 0)))
    assert "polynorm_rstd_" in f.lower(x, w).as_text()  # float32, no bias: rstd from the kernels
    y = f(x, w)
    for i in range(4):  # a batched weight: batch element i with weight row i
        np.testing.assert_array_equal(_bits(y[i]), _bits(pn.rms_norm(np.asarray(x[i]),
                                                                     np.asarray(w[i]))))
    yv = jax.jit(jax.vmap(lambda x: rms_norm(x, w[0], backend="numba"), in_axes=1))(x)  # unbatched weight
    np.testing.assert_array_equal(_bits(yv), _bits(pn.rms_norm(np.asarray(x), np.asarray(w[0]))
                                                   .transpose(1, 0, 2)))
    # the hand-written backward (the host call under jit), from the kernel's rstd
    g = jax.jit(jax.grad(lambda x, w: (rms_norm(x, w, backend="numba") ** 2 * jnp.arange(32)).sum(),
                         argnums=(0, 1)))(x[0], w[0])
    x64, w64 = np.asarray(x[0], np.float64), np.asarray(w[0], np.float64)
    r = 1 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + 1e-6)
    dy = 2 * (x64 * r * w64) * np.arange(32)  # of sum(y**2 * c)
    dxhat = dy * w64
    dx = r * (dxhat - x64 * r * np.mean(dxhat * x64 * r, axis=-1, keepdims=True))
    dw = (dy * x64 * r).sum(0)
    np.testing.assert_allclose(np.asarray(g[0]), dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g[1]), dw, rtol=1e-4, atol=1e-5)


def test_jit_default_keeps_the_reference_where_the_call_does_not_fit(one_device):
    x = _rand((3, 4, 16), "float32")
    w = _rand((4, 16), "float32", seed=1)
    # every float dtype: the kernels (jn.JIT_KERNEL_DTYPES), without bias their rstd only
    # (with a bias the whole kernel call: CASES["bfloat16-all"])
    for dt in ("float32", "bfloat16"):
        assert "polynorm_rstd_" in jax.jit(rms_norm).lower(x.astype(dt)).as_text()
    for f in (lambda x: rms_norm(x, backend="array_api"), lambda x: rms_norm(x, axis=1),
              lambda x: rms_norm(x, w, axis=(1, 2)), lambda x: rms_norm(x, casting="llama")):
        text = jax.jit(f).lower(x).as_text()
        assert "polynorm_forward_" not in text and "polynorm_rstd_" not in text


def test_jit_default_keeps_the_reference_on_several_cpu_devices():
    assert len(jax.devices("cpu")) > 1  # conftest's two host devices
    x = _rand((2, 16), "float32")
    text = jax.jit(rms_norm).lower(x).as_text()
    assert "polynorm_forward_" not in text and "polynorm_rstd_" not in text


def test_small_eager_arrays_take_the_jitted_kernel_call(one_device, monkeypatch):
    """Below EAGER_JIT_MAX_BYTES an eager call (polynorm.jax.rms_norm, and pn.rms_norm on
    jax arrays) runs the jitted kernel call, above it the front end's fast path: the
    kernels' bits either way, the numpy path's bits."""
    monkeypatch.setattr(jn, "EAGER_JIT_MAX_BYTES", 1024)
    calls = []
    fast = _api._fast.forward
    monkeypatch.setattr(_api._fast, "forward", lambda *a: calls.append(1) or fast(*a))
    w = _rand((32,), "float32", seed=1)
    for rows, front_end in ((2, False), (20, True)):  # 256 and 2560 bytes
        x = _rand((rows, 32), "float32")
        want = _bits(pn.rms_norm(np.asarray(x), np.asarray(w)))
        for f in (rms_norm, pn.rms_norm):
            f(x, w)  # a first call traces the reference too (the branch for other platforms)
            calls.clear()
            y = f(x, w)
            assert bool(calls) == front_end, (f, rows)
            assert isinstance(y, jax.Array) and y.dtype == x.dtype
            np.testing.assert_array_equal(_bits(y), want)
    assert [f for f in jn._eager_plain.values() if f is not None]  # without bias: by avals


def test_kernel_call_errors_are_the_front_ends(one_device):
    x = _rand((2, 16), "float32")
    with pytest.raises(ValueError, match="weight"):
        jax.jit(rms_norm)(x, _rand((15,), "float32"))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, _rand((15,), "float32"))


def _extreme_rows(rng, n, d):
    """Rows of scales from e**-20 to e**20, an Inf, a NaN, a zero row and one whose squares
    overflow float32."""
    x = (rng.standard_normal((n, d)) * np.exp(rng.uniform(-20, 20, (n, 1)))).astype(np.float32)
    x[3, 2], x[5, 1], x[7], x[9] = np.inf, np.nan, 0, 1e30
    return x


def test_jit_float32_takes_the_kernels_rstd_and_keeps_their_bits(one_device):
    """float32 without bias under jit: rstd from the kernels, y = x * rstd * (w + offset)
    from XLA (fused with the program's other ops): the eager kernels' bits, so a token's
    bits do not depend on the batch, also at a hidden size where XLA's own row sums do
    (test_jit_reference_rows_depend_on_the_batch)."""
    rng = np.random.default_rng(5)
    d = 1000
    x = _extreme_rows(rng, 33, d)
    w = rng.standard_normal(d).astype(np.float32)
    for opts, wt in (({}, w), (dict(offset=1.0, partial=0.5), w),
                     (dict(eps_mode="outside", eps=1e-3), None)):
        f = jax.jit(lambda x, w, opts=opts: rms_norm(x, w, **opts))
        wj = None if wt is None else jnp.asarray(wt)
        assert "polynorm_rstd_" in f.lower(jnp.asarray(x), wj).as_text()
        full = np.asarray(f(jnp.asarray(x), wj))
        np.testing.assert_array_equal(_bits(full), _bits(pn.rms_norm(x, wt, **opts)))
        for lo, hi in ((9, 10), (0, 7), (5, 33)):
            np.testing.assert_array_equal(_bits(f(jnp.asarray(x[lo:hi]), wj)), _bits(full[lo:hi]))
    # pn.rms_norm under jit (no derivative) takes the same route
    g = jax.jit(lambda x, w: pn.rms_norm(x, w))
    assert "polynorm_rstd_" in g.lower(jnp.asarray(x), jnp.asarray(w)).as_text()
    np.testing.assert_array_equal(_bits(g(jnp.asarray(x), jnp.asarray(w))),
                                  _bits(pn.rms_norm(x, w)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jit_add_takes_the_kernels_rstd_and_keeps_their_bits(dtype, one_device):
    """add_rms_norm under jit: h = x + residual and y from XLA, rstd of h from the kernels:
    the eager fused kernel's y and h, a token's bits whatever the batch."""
    rng = np.random.default_rng(7)
    x, r = _extreme_rows(rng, 33, 1000), rng.standard_normal((33, 1000)).astype(np.float32)
    w = rng.standard_normal(1000).astype(np.float32)
    xj, rj, wj = (jnp.asarray(a, dtype) for a in (x, r, w))
    f = jax.jit(lambda x, r, w: add_rms_norm(x, r, w, offset=1.0))
    assert "polynorm_rstd_" in f.lower(xj, rj, wj).as_text()
    y, h = f(xj, rj, wj)
    want_y, want_h = pn.add_rms_norm(*(np.asarray(a) for a in (xj, rj, wj)), offset=1.0)
    np.testing.assert_array_equal(_bits(y), _bits(want_y))
    np.testing.assert_array_equal(_bits(h), _bits(want_h))
    for lo, hi in ((9, 10), (2, 9)):
        y1, h1 = f(xj[lo:hi], rj[lo:hi], wj)
        np.testing.assert_array_equal(_bits(y1), _bits(np.asarray(y)[lo:hi]))


def test_jit_outputs_of_fresh_pages_size_take_the_huge_page_buffer_with_the_same_bits(
        one_device, monkeypatch):
    """From FRESH_PAGES_MIN_BYTES on, the statistic path's y (and the fused add's h) is a
    select over the huge-page handler's buffer, which XLA then writes: the same bits as
    the eager kernels, under grad too; smaller outputs have no such call."""
    rng = np.random.default_rng(11)
    x, r = _extreme_rows(rng, 33, 1000), rng.standard_normal((33, 1000)).astype(np.float32)
    w = rng.standard_normal(1000).astype(np.float32)
    xj, rj, wj = (jnp.asarray(a) for a in (x, r, w))
    monkeypatch.setattr(jn, "FRESH_PAGES_MIN_BYTES", x.nbytes)
    f = jax.jit(lambda x, w: rms_norm(x, w))
    assert f.lower(xj, wj).as_text().count("polynorm_huge_pages") == 1
    assert "polynorm_huge_pages" not in f.lower(xj[:32], wj).as_text()
    for rows in (33, 32):
        np.testing.assert_array_equal(_bits(f(xj[:rows], wj)), _bits(pn.rms_norm(x[:rows], w)))
    add = jax.jit(lambda x, r, w: add_rms_norm(x, r, w))
    assert add.lower(xj, rj, wj).as_text().count("polynorm_huge_pages") == 2
    for got, want in zip(add(xj, rj, wj), pn.add_rms_norm(x, r, w), strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))

    def grads():
        def loss(x, w):
            return jnp.sum(rms_norm(x, w) * jnp.cos(x))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(xj, wj)

    with_buffer = grads()
    monkeypatch.setattr(jn, "FRESH_PAGES_MIN_BYTES", 1 << 62)
    for got, want in zip(with_buffer, grads(), strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_jit_bfloat16_size_rule_chooses_the_whole_kernel_call():
    """From BF16_KERNEL_PASS_MIN_BYTES of bfloat16 x the kernels' whole call, not the
    statistic; float32 and float16 keep the statistic at every size."""
    from polynorm.core.options import make_plan, pack_options

    opts = pack_options("rms_norm", {})
    limit = jn.BF16_KERNEL_PASS_MIN_BYTES
    for dtype, size, statistic in (("bfloat16", limit // 2 - 1, True),
                                   ("bfloat16", limit // 2, False),
                                   ("float16", 4 * limit, True), ("float32", 4 * limit, True)):
        plan = make_plan(4096, dtype, opts)
        assert jn._xla_elementwise(plan, None, size) is statistic, (dtype, size)


@pytest.mark.slow  # a bfloat16 handler of its own, compiled cold in ~5 s
def test_jit_bfloat16_from_its_size_rule_takes_the_whole_kernel_call(one_device, monkeypatch):
    """bfloat16 from BF16_KERNEL_PASS_MIN_BYTES of x on: the whole kernel call, not the
    statistic (a matter of speed); both give the eager kernels' bits."""
    rng = np.random.default_rng(12)
    x = jnp.asarray(_extreme_rows(rng, 33, 1000), "bfloat16")
    w = jnp.asarray(rng.standard_normal(1000), "bfloat16")
    monkeypatch.setattr(jn, "BF16_KERNEL_PASS_MIN_BYTES", 2 * x.size)
    f = jax.jit(lambda x, w: rms_norm(x, w))
    text = f.lower(x, w).as_text()
    assert "polynorm_forward_" in text and "polynorm_rstd_" not in text
    assert "polynorm_rstd_" in f.lower(x[:32], w).as_text()
    for rows in (33, 32):
        want = pn.rms_norm(np.asarray(x[:rows]), np.asarray(w))
        np.testing.assert_array_equal(_bits(f(x[:rows], w)), _bits(want))


def test_jit_reference_row_sums_do_not_depend_on_the_batch(one_device):
    """The jitted reference sums rows in the kernels' fixed order (ROW_RSTD): XLA's own
    row sums, fused with the value's producer, gave 912-1849 of 1000 elements other bits
    for 1-4 of 64 tokens at d = 1000."""
    rng = np.random.default_rng(6)
    x, r = (jnp.asarray(rng.standard_normal((64, 1000)), jnp.float32) for _ in range(2))
    # the norm of a value the program computes (XLA fuses a sum with its producer)
    f = jax.jit(lambda x, r: rms_norm(x + r, backend="array_api"))
    assert "polynorm_reference_rstd_" in f.lower(x, r).as_text()
    full = np.asarray(f(x, r))
    for n in (1, 3, 7, 16):
        np.testing.assert_array_equal(_bits(f(x[:n], r[:n])), _bits(full[:n]))


# the long sweeps: a handler each, compiled cold in 3-5 s (the default run is at its CPU
# budget; test_jit_reference_row_sums_do_not_depend_on_the_batch takes ROW_STATS there)
@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "rows"), [("float32", 12), ("float32", 300),
                                             ("bfloat16", 12), ("bfloat16", 300),
                                             ("float16", 12)])  # serial; XLA's pool
def test_jit_reference_row_statistics_in_one_call_keep_their_bits(dtype, rows, one_device,
                                                                   monkeypatch):
    """The jitted reference's rstd in one call (ROW_RSTD) and its row statistics in one
    call (ROW_STATS: the plain sums and, for the rows that need it, the scaled pass's
    parts; a 16-bit x read as it is, not its float32 cast) instead of the row sums of the
    cast and a lax.cond: the bits of y and of the gradient are the cond's, overflowing,
    subnormal, zero and non-finite rows included, and a token's do not depend on the
    batch."""
    from polynorm.backends import reference as ref

    rng = np.random.default_rng(16)
    x = _extreme_rows(rng, rows, 700)
    x = jnp.asarray(np.clip(x, -6e4, 6e4) if dtype == "float16" else x, dtype)
    w = jnp.asarray(rng.standard_normal(700), dtype)

    def results():
        f = jax.jit(lambda x, w: rms_norm(x, w, backend="array_api", partial=0.5))
        g = jax.jit(jax.grad(lambda x, w: jnp.sum(rms_norm(x, w, backend="array_api").astype(
            jnp.float32) * jnp.cos(x.astype(jnp.float32))), (0, 1)))
        return f.lower(x, w).as_text(), f(x, w), f(x[3:4], w), *g(x, w)

    text, y, y3, *grads = results()
    assert f"polynorm_reference_rstd_{dtype}" in text and "polynorm_row_sumsq_" not in text
    np.testing.assert_array_equal(_bits(y3), _bits(np.asarray(y)[3:4]))
    monkeypatch.setattr(ref, "ROW_RSTD", {})  # the statistics' parts, rstd by XLA
    text, parts_y, _, *parts_grads = results()
    assert f"polynorm_row_stats_{dtype}" in text and "polynorm_reference_rstd_" not in text
    monkeypatch.setattr(ref, "ROW_STATS", {})
    text, want_y, _, *want_grads = results()
    assert "polynorm_row_stats_" not in text
    for a, b in zip((parts_y, *parts_grads), (want_y, *want_grads), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    for a, b in zip((y, *grads), (want_y, *want_grads), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.slow  # a handler a dtype, compiled cold in 3-5 s
@pytest.mark.parametrize(("dtype", "opts"), [
    ("float32", {"eps_mode": "outside", "eps": 1e-3, "partial": 0.3}),
    ("float32", {"eps": 1e-4}),
    ("float32", {"eps": 0.0}),
    ("float64", {"eps": 1e-9, "partial": 0.7}),
])
def test_jit_reference_rstd_in_one_call_has_the_xla_steps_bits(dtype, opts, one_device):
    """The jitted reference's rstd in one call (ROW_RSTD) against its steps as XLA compiles
    them (the row statistics' parts, then the selection and eps in XLA): the same bits for
    eps outside and inside (XLA contracts 1 + q * q), a k that is no power of two (XLA
    multiplies by 1 / k) and float64, over rows of every scale, zero, Inf and NaN."""
    from polynorm.backends import reference as ref
    from polynorm.core.options import make_plan, pack_options

    rng = np.random.default_rng(21)
    x = rng.standard_normal((440, 333)) * np.exp(rng.uniform(-40, 40, (440, 1)))
    x[3, 2], x[5, 1], x[7], x[9] = np.inf, np.nan, 0, 1e200 if dtype == "float64" else 1e30
    # rows whose rms is near sqrt(eps), where eps inside is the hypot's 1 + q * q
    x[40:] = rng.standard_normal((400, 333)) * (np.sqrt(opts.get("eps", 1e-6))
                                                * rng.uniform(0.2, 5, (400, 1)))
    with jax.enable_x64(dtype == "float64"):
        xj = jnp.asarray(x.astype(dtype))
        plan = make_plan(333, dtype, pack_options("rms_norm", opts))
        f = jax.jit(lambda v: ref.rstd(v, plan))
        assert f"polynorm_reference_rstd_{dtype}" in f.lower(xj).as_text()
        got = np.asarray(f(xj))
        hooks = dict(ref.ROW_RSTD)
        ref.ROW_RSTD.clear()
        try:
            g = jax.jit(lambda v: ref.rstd(v, plan))
            assert "polynorm_reference_rstd_" not in g.lower(xj).as_text()
            want = np.asarray(g(xj))
        finally:
            ref.ROW_RSTD.update(hooks)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.slow  # the row-dot handler compiles cold in ~3 s
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [5, 300])  # serial; chunks on XLA's pool
def test_jit_reference_backward_row_dots_skip_the_products_array(dtype, rows, one_device,
                                                                 monkeypatch):
    """The jitted reference backward's row dots (ROW_DOTS: the products summed where they
    are made) have the bits of the row sums of the products' array, whatever the batch."""
    from polynorm.backends import reference as ref

    monkeypatch.setattr(jn, "ROW_DOT_MIN_ELEMENTS", 5 * 700)
    rng = np.random.default_rng(15)
    x = jnp.asarray(rng.standard_normal((rows, 700)) * 3, dtype)
    w = jnp.asarray(rng.standard_normal(700), dtype)

    def results():
        g = jax.jit(jax.grad(lambda x, w: jnp.sum(rms_norm(
            x, w, backend="array_api", offset=1.0).astype(jnp.float32) * jnp.cos(
                x.astype(jnp.float32))), (0, 1)))
        return g.lower(x, w).as_text(), *g(x, w)

    text, *got = results()
    assert "polynorm_row_dot_" in text
    monkeypatch.setattr(ref, "ROW_DOTS", {})
    text, *want = results()
    assert "polynorm_row_dot_" not in text
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_jit_reference_output_of_fresh_pages_size_takes_the_huge_page_buffer(
        one_device, monkeypatch):
    """The jitted reference's y from FRESH_PAGES_MIN_BYTES: the huge-page buffer's select,
    the same bits."""
    rng = np.random.default_rng(14)
    x = jnp.asarray(rng.standard_normal((9, 300)), jnp.float32)
    f = jax.jit(lambda x: rms_norm(x, backend="array_api"))
    want = f(x)
    monkeypatch.setattr(jn, "FRESH_PAGES_MIN_BYTES", x.size * 4)
    g = jax.jit(lambda x: rms_norm(x, backend="array_api"))
    assert "polynorm_huge_pages" in g.lower(x).as_text()
    np.testing.assert_array_equal(_bits(g(x)), _bits(want))


@pytest.mark.slow  # two handlers of their own (~5 s of compiling): in the long sweeps
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", [(3, 96), (40, 2048)])  # serial; rows on XLA's pool
def test_jit_reference_bfloat16_pass_is_xla_s_bitwise(one_device, monkeypatch, weighted,
                                                       shape):
    """The jitted reference's bfloat16 y from REFERENCE_SCALE_MIN_BYTES: the compiled
    pass (scale_handler) given the reference's rstd, with XLA's own pass's bits, for
    finite, Inf, subnormal and NaN inputs, with an offset and without a weight."""
    rng = np.random.default_rng(15)
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, :4] = [np.inf, 1e-40, 3e38, -0.0]
    x[1, 5] = np.nan  # a NaN row: NaN wherever XLA has one
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(shape[1]), jnp.bfloat16) if weighted else None

    def run(offset):
        return jax.jit(lambda x, w: rms_norm(x, w, backend="array_api", offset=offset))

    monkeypatch.setattr(jn, "REFERENCE_SCALE_MIN_BYTES", 1 << 62)
    want = [run(off)(x, w) for off in (0.0, 1.0)]
    monkeypatch.setattr(jn, "REFERENCE_SCALE_MIN_BYTES", x.size * 2)
    for off, expect in zip((0.0, 1.0), want, strict=True):
        f = run(off)
        assert "polynorm_scale_" in f.lower(x, w).as_text()
        got = np.asarray(f(x, w), np.float32)
        expect = np.asarray(expect, np.float32)
        nan = np.isnan(expect)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(_bits(got[~nan]), _bits(expect[~nan]))
    # below the size, a bias, or another dtype: XLA's pass
    monkeypatch.setattr(jn, "REFERENCE_SCALE_MIN_BYTES", x.size * 2 + 1)
    assert "polynorm_scale_" not in run(0.0).lower(x, w).as_text()


def test_jit_backward_rows_do_not_depend_on_the_batch(one_device):
    """SPEC's batch invariance of dx under jit: the compiled backward handler runs the
    eager kernels (the jitted reference's elementwise dx took another rounding, XLA's
    contraction, for one token than for a batch)."""
    rng = np.random.default_rng(8)
    x, c = (jnp.asarray(rng.standard_normal((64, 128)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(128), jnp.float32)
    g = jax.jit(jax.grad(lambda x, c: (rms_norm(x, w) * c).sum()))
    full = np.asarray(g(x, c))
    for n in (1, 3, 7):
        np.testing.assert_array_equal(_bits(g(x[:n], c[:n])), _bits(full[:n]))


def _eager_backward(dy, x, w, b, rstd, grad_residual=None):
    a = [None if v is None else np.asarray(v) for v in (dy, x, w, b, rstd, grad_residual)]
    return pn.rms_norm_backward(a[0], a[1], a[2], a[3], rstd=a[4], grad_residual=a[5])


@pytest.mark.parametrize("case", [
    "float32-weight", "float32-add",
    # other dtypes and arrays: each compiles a handler of its own (~8 s)
    pytest.param("bfloat16-weight", marks=pytest.mark.slow),
    pytest.param("float32-none", marks=pytest.mark.slow),
    pytest.param("float32-weight-bias", marks=pytest.mark.slow),
    pytest.param("bfloat16-add", marks=pytest.mark.slow),
    # a 16-bit weight of float32 rows: the handler widens it (no convert before the call)
    pytest.param("float32-weight16", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("shape", [(3, 96), (40, 2048)])  # serial; blocks on XLA's pool
def test_jit_backward_is_the_eager_backward_bitwise(one_device, case, shape):
    """The jitted vjp's gradients are the eager kernels' (pn.rms_norm_backward), bit for
    bit, for the forward's rstd (the kernels' own: a plain forward, a bias-less add)."""
    dtype, *arrays = case.split("-")
    rng = np.random.default_rng(3)
    x, r, dy, dh = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(4))
    wdt = "float16" if "weight16" in arrays else dtype
    w = (jnp.asarray(rng.standard_normal(shape[1]), wdt)
         if any(a.startswith("weight") for a in arrays) else None)
    b = jnp.asarray(rng.standard_normal(shape[1]), dtype) if "bias" in arrays else None
    np_args = [None if a is None else np.asarray(a) for a in (x, r, w, b)]
    if "add" in arrays:
        f = jax.jit(lambda x, r, w, dy, dh: jax.vjp(add_rms_norm, x, r, w)[1]((dy, dh)))
        assert "polynorm_backward_" in f.lower(x, r, w, dy, dh).as_text()
        gx, gr, gw = f(x, r, w, dy, dh)
        _, h, rstd = pn.add_rms_norm(*np_args, return_rstd=True)
        ex, ew, _ = _eager_backward(dy, h, w, None, rstd, dh)
        np.testing.assert_array_equal(_bits(gr), _bits(ex))
    else:
        f = jax.jit(lambda x, w, b, dy: jax.vjp(rms_norm, x, w, b)[1](dy))
        assert "polynorm_backward_" in f.lower(x, w, b, dy).as_text()
        gx, gw, gb = f(x, w, b, dy)
        _, rstd = pn.rms_norm(np_args[0], *np_args[2:], return_rstd=True)
        ex, ew, eb = _eager_backward(dy, x, w, b, rstd)
        assert (gb is None) == (b is None)
        if b is not None:
            np.testing.assert_array_equal(_bits(gb), _bits(eb))
    np.testing.assert_array_equal(_bits(gx), _bits(ex))
    assert (gw is None) == (w is None)
    if w is not None:
        np.testing.assert_array_equal(_bits(gw), _bits(ew))


def test_jit_backward_under_vmap_is_a_loop_of_calls(one_device):
    """The backward handler under vmap runs once per batch element: the same bits as
    each element's own jitted gradient (x batched, the weight shared)."""
    x, c = _rand((3, 5, 64), jnp.float32, 1), _rand((3, 5, 64), jnp.float32, 2)
    w = _rand((64,), jnp.float32, 3)
    g = jax.jit(jax.grad(lambda x, w, c: (rms_norm(x, w) * c).sum(), argnums=(0, 1)))
    gx, gw = jax.jit(jax.vmap(g, in_axes=(0, None, 0)))(x, w, c)
    for i in range(3):
        ex, ew = g(x[i], w, c[i])
        np.testing.assert_array_equal(_bits(gx[i]), _bits(ex))
        np.testing.assert_array_equal(_bits(gw[i]), _bits(ew))


def _concurrent_calls_keep_the_eager_bits(threads=3, calls=12):
    """Jitted forwards (float32: the kernels' rstd) and vjps (the backward handler) from
    ``threads`` Python threads at once: XLA's executions overlap, and the pooled handlers
    wait for chunks that tasks preempted by the other executions still run (the forward
    handler's pool is the same code).  Every result has the eager bits."""
    import threading

    d = 4096
    rng = np.random.default_rng(5)
    fwd = jax.jit(rms_norm)
    grad = jax.jit(lambda x, w: jax.vjp(rms_norm, x, w)[1](x))
    cases = []
    for n in (67, 131):  # pooled: from STAT_POOL_MIN_ELEMENTS (rstd) and POOL_MIN_ELEMENTS
        x, w = (rng.standard_normal(s).astype(np.float32) for s in ((n, d), d))
        y, rstd = pn.rms_norm(x, w, return_rstd=True)
        ex, ew, _ = pn.rms_norm_backward(x, x, w, rstd=rstd)
        cases.append(((jnp.asarray(x), jnp.asarray(w)), (y, ex, ew)))
    failures = []

    def run(k):
        for i in range(calls):
            (x, w), want = cases[(k + i) % len(cases)]
            got = (fwd(x, w), *grad(x, w))
            failures.extend((k, i, j) for j, (g, e) in enumerate(zip(got, want, strict=True))
                            if not np.array_equal(_bits(g), _bits(e)))

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return failures


def test_overlapping_pooled_calls_keep_the_eager_bits(one_device):
    from polynorm.backends.numba import xla

    assert 67 * 4096 >= max(xla.POOL_MIN_ELEMENTS, xla.STAT_POOL_MIN_ELEMENTS)
    assert _concurrent_calls_keep_the_eager_bits() == []


def _pooled_calls_in_a_process(knob: str) -> None:
    """:func:`_concurrent_calls_keep_the_eager_bits` in a process of its own whose handlers
    compile with ``xla.<knob>`` (an assignment) instead of the module's value."""
    import os
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, 'tests')\n"
            "from polynorm.backends.numba import xla\n"
            f"xla.{knob}  # read when the handlers compile\n"
            "import test_jax_kernel_call as t\n"
            "assert t.jn._one_cpu_device()\n"
            "assert t._concurrent_calls_keep_the_eager_bits(threads=4, calls=20) == []\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow  # a process of its own: the handlers compile again (~15 s)
def test_pooled_calls_whose_handler_sleeps_keep_the_eager_bits():
    """The handlers' wait for chunks still running on pool tasks with the futex sleep
    from the first check (no yields first): every wake-up handshake taken."""
    from polynorm.backends.numba import xla

    if xla._SYS_FUTEX == 0:
        pytest.skip("no futex on this platform: the handlers only yield")
    _pooled_calls_in_a_process("_YIELDS_BEFORE_SLEEP = 0")


@pytest.mark.slow  # a process of its own: the handlers compile again (~15 s)
def test_pooled_calls_with_more_threads_than_shares_keep_the_eager_bits():
    """One share for every thread (``_MAX_SHARES = 1``): the tasks whose share is past the
    last take it modulo, and every chunk is claimed from one counter."""
    _pooled_calls_in_a_process("_MAX_SHARES = 1")
