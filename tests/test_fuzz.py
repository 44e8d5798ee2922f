"""Fuzzing the public API (hypothesis): arbitrary shapes, strides, byte orders, dtypes and
option values on every backend here.  Each call either matches the float64 oracle
(tests/_oracle.py) within the output dtype's tolerance, or raises a TypeError/ValueError
whose message names an argument; never another exception, and the inputs are unchanged.
A second family wraps polynorm.torch in torch.func (vmap, grad, vjp, jacrev, vmap of grad)
and torch.jit.trace: the bits of the same work done eagerly, or NotImplementedError where
the transform needs a second derivative or forward-mode AD.

Bounded for the default run (``FUZZ_EXAMPLES`` per backend, 40); set
``POLYNORM_FUZZ_EXAMPLES`` for a longer run.

A second family (``test_fuzz_non_finite_rows``) puts Inf, -Inf and NaN at random places
of ``x`` (or of the residual) and compares with SPEC's formula evaluated in float64
IEEE arithmetic, written out below (:func:`_ieee_forward`, :func:`_ieee_backward`): the
NaN and Inf positions must be the same, the finite values within tolerance.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from _oracle import TOL, assert_close, looser
from _oracle import backward as o_backward
from _oracle import forward as o_forward
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polynorm as pn

FUZZ_EXAMPLES = int(os.environ.get("POLYNORM_FUZZ_EXAMPLES", "40"))
FLOATS = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
          "float64": np.float64}
#: words an error message must contain one of: it names the argument
ARGNAMES = ("x", "residual", "weight", "bias", "dy", "rstd", "grad_residual", "out", "eps",
            "partial", "axis", "offset", "eps_mode", "casting", "out_dtype", "backend")


def _dtype_name(a) -> str:
    if type(a).__module__.startswith("torch"):
        return str(a.dtype).rsplit(".", 1)[-1]
    return np.asarray(a).dtype.name


def _np(a):
    if a is None:
        return None
    if type(a).__module__.startswith("torch"):
        import torch

        a = a.detach()
        if a.dtype == torch.bfloat16:
            return a.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return a.numpy()
    if type(a).__module__.startswith("dask"):
        return np.asarray(a.compute(scheduler="sync"))
    return np.asarray(a)


def _arrays(draw, shape, dtype, byteorder, layout, rng):
    """An array of ``shape`` in the drawn layout; values N(0, 3)."""
    dt = np.dtype(FLOATS[dtype]) if dtype in FLOATS else np.dtype(dtype)
    if byteorder and dt.itemsize > 1 and dtype != "bfloat16":
        dt = dt.newbyteorder(">")
    vals = (rng.standard_normal(shape) * 3).astype(dt)
    if layout == "padded" and len(shape) >= 1:
        buf = np.zeros(shape[:-1] + (shape[-1] + 2,), dt)
        buf[..., 1:shape[-1] + 1] = vals
        return buf[..., 1:shape[-1] + 1]
    if layout == "negative" and len(shape) >= 1:
        return np.ascontiguousarray(vals[..., ::-1])[..., ::-1]
    if layout == "zero" and len(shape) >= 1 and shape[0] > 0:  # a broadcast (zero-stride) axis
        return np.broadcast_to(vals[:1], shape)
    return vals


@st.composite
def _calls(draw, kind):
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    op = draw(st.sampled_from(["fwd", "add", "bwd"]))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    dtypes = list(FLOATS) + ["int32"]
    dtype = draw(st.sampled_from(dtypes + ["float32"] * 4))
    byteorder = kind != "torch" and draw(st.booleans())
    layouts = ["c", "padded", "negative"] + (["zero"] if kind != "torch" else [])
    layout = lambda: draw(st.sampled_from(layouts))  # noqa: E731
    x = _arrays(draw, shape, dtype, byteorder, layout(), rng)
    opts = {}
    for name, values in (
        ("eps", [1e-6, 0.0, 0.5, -1.0, float("nan")]),
        ("partial", [1.0, 0.5, 0.01, 0.0]),
        ("axis", [-1, -1, 0, (0, -1), 3]),
        ("offset", [0.0, 1.0]),
        ("eps_mode", ["inside", "outside", "Inside"]),
        ("casting", ["fp32", "llama", "bad"]),
    ):
        if draw(st.booleans()):
            opts[name] = draw(st.sampled_from(values))
    axis = opts.get("axis", -1)
    try:
        axes = tuple(sorted({a % ndim for a in (axis if isinstance(axis, tuple) else (axis,))}))
        ok_axes = all(-ndim <= a < ndim for a in (axis if isinstance(axis, tuple) else (axis,)))
    except ZeroDivisionError:
        axes, ok_axes = (), False
    norm_shape = tuple(shape[a] for a in axes) if ok_axes else shape[-1:]
    wdtype = draw(st.sampled_from([dtype, "float32"]))
    weight = (_arrays(draw, norm_shape, wdtype, False, "c", rng) if draw(st.booleans())
              else None)
    bias = _arrays(draw, norm_shape, wdtype, False, "c", rng) if draw(st.booleans()) else None
    args = {"x": x, "weight": weight, "bias": bias}
    if op == "add":
        args["residual"] = _arrays(draw, shape, draw(st.sampled_from([dtype, "float32"])),
                                   byteorder, layout(), rng)
    if op == "bwd":
        args["dy"] = _arrays(draw, shape, dtype, byteorder, layout(), rng)
        if draw(st.booleans()):
            args["grad_residual"] = _arrays(draw, shape, dtype, False, layout(), rng)
    else:
        if draw(st.booleans()):
            opts["out_dtype"] = draw(st.sampled_from(["float32", np.float16, "int8"]))
        opts["return_rstd"] = draw(st.booleans())
        out = draw(st.sampled_from([None, None, "fresh", "x", "overlap", "wrong_dtype"]))
        if out is not None and kind != "dask":
            opts["out"] = out
    return op, args, opts


def _make(kind, a):
    if a is None:
        return None
    if kind == "torch":
        import torch

        if not a.dtype.isnative or any(s <= 0 for s in a.strides) and a.size:
            a = np.ascontiguousarray(a)
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    if kind == "dask":
        import dask.array as da

        return da.from_array(a, chunks=tuple(max(1, (s + 1) // 2) for s in a.shape))
    return a


def _out(kind, spec, x, plan_dtype):
    """The out= argument: a fresh array, x itself, an overlapping view, a wrong dtype."""
    if spec == "x":
        return x
    dt = FLOATS.get(plan_dtype, np.float32)
    if spec == "fresh":
        return _make(kind, np.zeros(np.shape(x), dt))
    if spec == "wrong_dtype":
        return _make(kind, np.zeros(np.shape(x), np.float64 if dt != np.float64 else np.float32))
    if spec == "overlap" and kind in ("numpy", "reference") and np.ndim(x) >= 1 \
            and np.shape(x)[0] > 1:
        return x[::-1]  # x's own memory, rows in another order: a ValueError
    return None


def _snapshot(args):
    return {k: None if v is None else np.array(v, copy=True) for k, v in args.items()}


def _check(kind, op, args, opts):
    backend = {"numpy": "auto", "reference": "array_api", "dask": "auto", "torch": "auto"}[kind]
    before = _snapshot(args)
    call = {k: _make(kind, v) for k, v in args.items()}
    out_spec = opts.pop("out", None)
    h_dtype = args["x"].dtype.name
    if op == "add" and h_dtype in FLOATS and args["residual"].dtype.name in FLOATS:
        from polynorm.core.options import promote

        h_dtype = promote(h_dtype, args["residual"].dtype.name)
    want_out = opts.get("out_dtype")
    want_out = np.dtype(want_out).name if want_out not in (None, "int8") else want_out
    out = None
    if out_spec is not None:
        out = _out(kind, out_spec, call["x"], want_out or h_dtype)
        if out is not None:
            opts["out"] = out
    passed_as_out = out_spec == "x" and out is not None
    try:
        if op == "fwd":
            res = pn.rms_norm(call["x"], call["weight"], call["bias"], backend=backend, **opts)
        elif op == "add":
            res = pn.add_rms_norm(call["x"], call["residual"], call["weight"], call["bias"],
                                  backend=backend, **opts)
        else:
            res = pn.rms_norm_backward(call["dy"], call["x"], call["weight"], call["bias"],
                                       grad_residual=call.get("grad_residual"), backend=backend,
                                       **opts)
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        assert any(name in msg for name in ARGNAMES), f"{type(exc).__name__} names no argument: {msg}"
        res = None
    for k, v in before.items():  # inputs unchanged (x may be out)
        if v is not None and not (k == "x" and passed_as_out):
            now = np.ascontiguousarray(_np(call[k]))
            assert np.array_equal(now.view(np.uint8), np.ascontiguousarray(v).view(np.uint8)), (
                f"{k} changed")
    if res is None:
        return
    _compare(op, before, opts, res, h_dtype)  # the values before the call: x may be out


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def _compare(op, args, opts, res, h_dtype):
    o = {k: v for k, v in opts.items() if k in ("eps", "axis", "partial", "offset", "eps_mode")}
    # the oracle takes native byte order
    args = {k: None if v is None else v.astype(v.dtype.newbyteorder("=")) for k, v in args.items()}
    x = args["x"]
    if x.size == 0:
        return
    if op == "bwd":
        dx, dw, db = (_np(a) for a in res)
        want = o_backward(args["dy"].astype(np.float64), x, args["weight"], args["bias"],
                          grad_residual=_f64(args.get("grad_residual")), **o)
        xd = x.dtype.name
        # dx is a difference of two terms of size |dy| * rstd * |w|: its error is relative to them
        rs = o_forward(x, **o)[1]
        g = 1.0 if args["weight"] is None else float(
            np.max(np.abs(args["weight"].astype(np.float64) + o.get("offset", 0.0)), initial=1.0))
        scale = float(np.nanmax(np.abs(args["dy"].astype(np.float64)), initial=0.0)
                      * np.nanmax(rs, initial=0.0) * g) or None
        assert_close(dx, want[0], TOL[xd], "dx", scale=scale)
        if args["weight"] is not None:
            assert_close(dw, want[1], looser(xd, args["weight"].dtype.name), "dweight")
        if args["bias"] is not None:
            assert_close(db, want[2], looser(xd, args["bias"].dtype.name), "dbias")
        return
    res = res if isinstance(res, tuple) else (res,)
    y = _np(res[0])
    xin = x
    if op == "add":
        h = _np(res[1])
        assert h.dtype.name == h_dtype
        assert_close(h, x.astype(np.float64) + args["residual"].astype(np.float64), h_dtype, "h")
        xin = h
    out_dtype = opts.get("out_dtype")
    out_name = h_dtype if out_dtype is None else np.dtype(out_dtype).name
    assert y.dtype.name == out_name
    wy, wr = o_forward(xin, args["weight"], args["bias"], casting=opts.get("casting", "fp32"),
                       out_dtype=out_name, **o)
    assert_close(y, wy, looser(xin.dtype.name, out_name), "y")
    if opts.get("return_rstd"):
        assert_close(_np(res[-1]), wr, "float64" if h_dtype == "float64" else "float32", "rstd")


# ------------------------------------------------------------------ torch transforms

#: torch.func and torch.jit.trace around polynorm.torch; the last three must refuse
TRANSFORMS = ("vmap", "vmap-weight", "grad", "vjp", "jacrev", "vmap-grad", "trace",
              "create-graph", "jacfwd", "hessian")
_REFUSALS = {"create-graph": "second derivatives are not supported",
             "jacfwd": "forward-mode AD", "hessian": "forward-mode AD"}


@st.composite
def _transform_calls(draw, transform):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)))
    opts = {}
    for name, values in (
        ("eps", [1e-6, 0.5, -1.0]),
        ("partial", [1.0, 0.5, 0.0]),
        ("axis", [-1, 0, (0, -1), 3]),
        ("offset", [0.0, 1.0]),
        ("eps_mode", ["inside", "outside"]),
        ("casting", ["fp32", "llama"]),
        ("save", ["input", "output"]),
    ):
        if draw(st.booleans()):
            opts[name] = draw(st.sampled_from(values))
    return dict(transform=transform, add=draw(st.booleans()),
                shape=shape, dtype=draw(st.sampled_from(["float32", "float64"])), opts=opts,
                weight=draw(st.booleans()), bias=draw(st.booleans()),
                in_dim=draw(st.integers(0, ndim)), seed=draw(st.integers(0, 2**16)))


def _check_transform(transform, add, shape, dtype, opts, weight, bias, in_dim, seed):
    """The transform of polynorm.torch equals the same work done eagerly (a loop over the
    vmapped slices, torch.autograd, the untraced call), bit for bit; or both raise the same
    TypeError/ValueError naming an argument; second derivatives and forward-mode AD raise
    NotImplementedError, never a silent None, zero or constant."""
    import torch

    import polynorm.torch as pnt

    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def randn(*s):
        return (torch.randn(*s, generator=gen, dtype=torch.float64) * 3).to(dt)

    axis = opts.get("axis", -1)
    axes = axis if isinstance(axis, tuple) else (axis,)
    ok = all(-len(shape) <= a < len(shape) for a in axes)
    norm_shape = tuple(shape[a] for a in axes) if ok else shape[-1:]
    x, r, x2 = randn(2, *shape), randn(*shape), randn(*shape)
    w = 1 + 0.1 * randn(2, *norm_shape)  # never zero: save="output" recovers x through w
    b = randn(*norm_shape) if bias else None
    names = ["x", "w"] if weight else ["x"]

    def f(x, w=None):
        if add:
            y, h = pnt.add_rms_norm(x, r, w, b, **opts)
            return y + 2 * h
        return pnt.rms_norm(x, w, b, **opts)

    def autograd(inputs, cot):
        leaves = [a.clone().requires_grad_() for a in inputs]
        return list(torch.autograd.grad(f(*leaves), leaves, cot))

    def same(got, want):
        assert len(got) == len(want)
        for g, v in zip(got, want, strict=True):
            assert g.dtype == v.dtype and g.shape == v.shape, (g.shape, v.shape)
            assert torch.equal(g, v) or (g.isnan() == v.isnan()).all() and torch.equal(
                g.nan_to_num(), v.nan_to_num()), f"{transform}: {g} != {v}"

    args = [x[0], w[0]][:len(names)]
    try:
        f(*args)
    except (TypeError, ValueError) as exc:  # the transform must raise it too, by name
        assert any(name in str(exc) for name in ARGNAMES + ("save",)), str(exc)
        want_exc = type(exc)
    else:
        want_exc = None
    cot = randn(*shape)

    def run():
        if transform == "vmap" or transform == "vmap-weight" and not weight:
            xs = x.movedim(0, in_dim)
            got = torch.func.vmap(f, (in_dim, None))(xs, w[0]) if weight else \
                torch.func.vmap(f, in_dim)(xs)
            same([got], [torch.stack([f(*([x[i], w[0]][:len(names)])) for i in range(2)])])
        elif transform == "vmap-weight":
            same([torch.func.vmap(f, (None, 0))(x[0], w)],
                 [torch.stack([f(x[0], w[i]) for i in range(2)])])
        elif transform == "grad":
            got = torch.func.grad(lambda *a: (f(*a) * cot).sum(), tuple(range(len(args))))(*args)
            same(list(got), autograd(args, cot))
        elif transform == "vjp":
            same(list(torch.func.vjp(f, *args)[1](cot)), autograd(args, cot))
        elif transform == "jacrev":
            jac = torch.func.jacrev(f)(*args)
            for idx in np.ndindex(*shape):
                onehot = torch.zeros(shape, dtype=dt)
                onehot[idx] = 1
                same([jac[idx]], autograd(args, onehot)[:1])
        elif transform == "vmap-grad":
            per = torch.func.vmap(torch.func.grad(lambda *a: (f(*a) * cot).sum(),
                                                  tuple(range(len(args)))),
                                  (0, None)[:len(args)])(x, *args[1:])
            want = [autograd([x[i], *args[1:]], cot) for i in range(2)]
            same(list(per), [torch.stack(g) for g in zip(*want, strict=True)])
        elif transform == "trace":
            with torch.no_grad():
                traced = torch.jit.trace(f, tuple(args), check_trace=False)
            same([traced(x2, *args[1:])], [f(x2, *args[1:])])
        elif transform == "create-graph":
            leaves = [a.clone().requires_grad_() for a in args]
            g = torch.autograd.grad((f(*leaves) * cot).sum(), leaves, create_graph=True)
            same([a.detach() for a in g], autograd(args, cot))
            torch.autograd.grad(g[0].sum(), leaves, allow_unused=True)
        elif transform == "jacfwd":
            torch.func.jacfwd(f)(*args)
        else:
            torch.func.hessian(lambda *a: f(*a).sum())(*args)

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.trace's deprecation and tracer warnings
        if want_exc is not None:
            with pytest.raises(want_exc):
                run()
        elif transform in _REFUSALS:
            with pytest.raises(NotImplementedError, match=_REFUSALS[transform]):
                run()
        else:
            run()


def _torch_numba() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return pn.backends()["numba"][0]


@pytest.mark.skipif(not _torch_numba(), reason="needs torch and the numba backend")
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_fuzz_torch_transforms(transform):
    @settings(max_examples=max(5, FUZZ_EXAMPLES // 4), deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    @given(_transform_calls(transform))
    def run(call):
        _check_transform(**call)

    run()


def _kinds():
    kinds = ["reference"]
    if pn.backends()["numba"][0]:
        kinds.append("numpy")
    if pn.backends()["dask"][0]:
        kinds.append("dask")
    try:
        import torch  # noqa: F401

        if pn.backends()["numba"][0]:
            kinds.append("torch")
    except ImportError:
        pass
    return kinds


@pytest.mark.parametrize("kind", _kinds())
def test_fuzz_public_api(kind):
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_calls(kind))
    def run(call):
        op, args, opts = call
        _check(kind, op, args, dict(opts))

    run()


# ------------------------------------------------------------------ jax device placement
# tests/conftest.py gives jax two CPU devices; a result must come back on its input's
# device, committed to it as the input is, with the bits of the same call on the default
# device: whichever device, any number of tokens, through every front end.


@st.composite
def _placements(draw, ndev):
    op = draw(st.sampled_from(["fwd", "add", "bwd", "grad", "gated", "quant"]))
    kernel_dtypes = ["float32", "bfloat16"]  # the gated and quantized kernels' default-run ones
    dtype = draw(st.sampled_from(kernel_dtypes if op in ("gated", "quant")
                                 else kernel_dtypes + ["float16", "float64"]))
    return dict(op=op, shape=(draw(st.integers(0, 4)), draw(st.integers(1, 6))), dtype=dtype,
                device=draw(st.integers(0, ndev - 1)), x_committed=draw(st.booleans()),
                weight=draw(st.sampled_from(["none", "with-x", "uncommitted"])),
                wdtype=draw(st.sampled_from([dtype, "float32"])), seed=draw(st.integers(0, 99)))


def _placed_call(p, x, r, w):
    import jax
    import jax.numpy as jnp

    import polynorm.jax as pj

    op = p["op"]
    if op == "fwd":
        return pn.rms_norm(x, w, return_rstd=True)
    if op == "add":
        return pn.add_rms_norm(x, r, w, return_rstd=True)
    if op == "bwd":
        return pn.rms_norm_backward(r, x, w)
    if op == "gated":
        return pj.rms_norm_gated(x, r, w)
    if op == "quant":
        return pj.rms_norm_quant(x, w, dtype="int8")
    argnums = (0,) if w is None else (0, 1)
    return jax.grad(lambda x, w: (pj.rms_norm(x, w).astype(jnp.float32) ** 2).sum(),
                    argnums=argnums)(x, w)


def test_fuzz_jax_device_placement():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    from polynorm.core.interop import jax_committed
    devices = jax.devices()

    @settings(max_examples=max(10, FUZZ_EXAMPLES // 2), deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    @given(_placements(len(devices)))
    def run(p):
        rng = np.random.default_rng(p["seed"])
        dt = np.dtype(FLOATS[p["dtype"]])
        x, r = ((rng.standard_normal(p["shape"]) * 3).astype(dt) for _ in range(2))
        w = None if p["weight"] == "none" else (
            1 + rng.standard_normal(p["shape"][-1:])).astype(FLOATS[p["wdtype"]])
        dev = devices[p["device"]]
        want = _placed_call(p, *(None if a is None else jax.numpy.asarray(a) for a in (x, r, w)))
        xj, rj = (jax.device_put(a, dev) if p["x_committed"] else jax.numpy.asarray(a)
                  for a in (x, r))
        wj = None if w is None else (jax.device_put(w, dev) if p["weight"] == "with-x"
                                     else jax.numpy.asarray(w))
        got = _placed_call(p, xj, rj, wj)
        leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
        assert len(leaves) == len(want_leaves)
        for g, e in zip(leaves, want_leaves, strict=True):
            assert g.devices() == xj.devices(), (p, g.devices(), xj.devices())
            # uncommitted as jnp leaves it (a committed one would refuse other devices' arrays)
            assert jax_committed(g) == jax_committed(xj), p
            assert g.dtype == e.dtype and g.shape == e.shape
            assert np.array_equal(np.asarray(g).view(np.uint8), np.asarray(e).view(np.uint8)), p


# --------------------------------------------------------------------------- non-finite rows


def _ieee_forward(v, w, b, k, eps, inside, offset):
    """``(y, rstd)`` of SPEC's formula on float64 rows ``v``, every step IEEE: an Inf in
    the first k elements makes ms = Inf and rstd = 0 (y = v * 0: NaN at the Inf), a NaN
    makes the row NaN, an Inf beyond k only its own element."""
    ms = np.sum(v[:, :k] * v[:, :k], axis=1) / k
    rstd = 1 / np.sqrt(ms + eps) if inside else 1 / (np.sqrt(ms) + eps)
    y = v * rstd[:, None]
    if w is not None:
        y = y * (w + offset)
    if b is not None:
        y = y + b
    return y, rstd


def _ieee_backward(dy, v, w, gr, k, eps, inside, offset):
    """``(dx, dweight, dbias-less)`` of SPEC's backward in the documented ``xhat`` form:
    ``dx = rstd * (g*dy - [j<k] * xhat * coef)`` with ``[j<k]`` applied to ``coef`` (the term
    beyond k is ``xhat * 0``: NaN where xhat is not finite), ``coef = c/k`` (times
    ``(rms + eps)/rms`` outside), ``c = sum_j g*dy*xhat``."""
    ms = np.sum(v[:, :k] * v[:, :k], axis=1) / k
    rms = np.sqrt(ms)
    rstd = 1 / np.sqrt(ms + eps) if inside else 1 / (rms + eps)
    xhat = v * rstd[:, None]
    gdy = dy if w is None else dy * (w + offset)
    coef = np.sum(gdy * xhat, axis=1) / k
    if not inside:
        coef = np.where(rms == 0, 0.0, coef * ((rms + eps) / np.where(rms == 0, 1.0, rms)))
    mask = np.arange(v.shape[1]) < k
    dx = rstd[:, None] * (gdy - xhat * np.where(mask[None, :], coef[:, None], 0.0))
    if gr is not None:
        dx = dx + gr
    dweight = None if w is None else np.sum(dy * xhat, axis=0)
    return dx, dweight


_POISON = (np.inf, -np.inf, np.nan)


@st.composite
def _non_finite_calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    op = draw(st.sampled_from(["fwd", "add", "bwd"]))
    dtype = draw(st.sampled_from(list(FLOATS)))
    n, d = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    dt = FLOATS[dtype]
    x = (rng.standard_normal((n, d)) * 3).astype(dt)
    res = (rng.standard_normal((n, d)) * 3).astype(dt) if op == "add" else None
    target = res if op == "add" and draw(st.booleans()) else x
    for _ in range(draw(st.integers(1, 3))):
        i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, d - 1))
        target[i, j] = draw(st.sampled_from(_POISON))
    opts = dict(eps=draw(st.sampled_from([1e-6, 0.0, 0.5])),
                partial=draw(st.sampled_from([1.0, 0.5])) if d >= 2 else 1.0,
                eps_mode=draw(st.sampled_from(["inside", "outside"])),
                offset=draw(st.sampled_from([0.0, 1.0])))
    w = (rng.standard_normal(d) * 3).astype(dt) if draw(st.booleans()) else None
    b = (rng.standard_normal(d) * 3).astype(dt) if draw(st.booleans()) else None
    dy = (rng.standard_normal((n, d)) * 3).astype(dt) if op == "bwd" else None
    gr = (rng.standard_normal((n, d)) * 3).astype(dt) if op == "bwd" and draw(st.booleans()) \
        else None
    return op, dict(x=x, residual=res, weight=w, bias=b, dy=dy, grad_residual=gr), opts


def _check_non_finite(kind, op, a, opts):
    backend = {"numpy": "auto", "reference": "array_api", "dask": "auto", "torch": "auto"}[kind]
    c = {name: _make(kind, v) for name, v in a.items()}
    x, dtype = a["x"], a["x"].dtype.name
    d = x.shape[1]
    k = int(d * opts["partial"])
    f64 = {name: _f64(v) for name, v in a.items()}
    spec = dict(k=k, eps=opts["eps"], inside=opts["eps_mode"] == "inside", offset=opts["offset"])
    with np.errstate(all="ignore"):
        if op == "bwd":
            dx, dw, _ = (_np(r) for r in pn.rms_norm_backward(
                c["dy"], c["x"], c["weight"], c["bias"], grad_residual=c["grad_residual"],
                backend=backend, **opts))
            want_dx, want_dw = _ieee_backward(f64["dy"], f64["x"], f64["weight"],
                                              f64["grad_residual"], **spec)
            # dx is a difference of two terms of size |g*dy| * rstd: its error is relative to them
            g = 1.0 if a["weight"] is None else np.abs(f64["weight"] + opts["offset"])
            terms = np.abs(f64["dy"]) * g * _ieee_forward(f64["x"], None, None, **spec)[1][:, None]
            terms = terms[np.isfinite(terms)]
            scale = float(terms.max()) if terms.size and terms.max() > 0 else None
            assert_close(dx, want_dx, TOL[dtype], "dx", scale=scale)
            if want_dw is not None:
                assert_close(dw, want_dw, TOL[dtype], "dweight")
            return
        if op == "add":
            y, h, rstd = (_np(r) for r in pn.add_rms_norm(
                c["x"], c["residual"], c["weight"], c["bias"], return_rstd=True,
                backend=backend, **opts))
            assert_close(h, f64["x"] + f64["residual"], dtype, "h")
            v = h.astype(np.float64)  # y is the norm of the h returned
        else:
            y, rstd = (_np(r) for r in pn.rms_norm(c["x"], c["weight"], c["bias"],
                                                   return_rstd=True, backend=backend, **opts))
            v = f64["x"]
        want_y, want_rstd = _ieee_forward(v, f64["weight"], f64["bias"], **spec)
    assert_close(y, want_y, dtype, "y")
    assert_close(rstd, want_rstd, "float64" if dtype == "float64" else "float32", "rstd")


@pytest.mark.parametrize("kind", _kinds())
def test_fuzz_non_finite_rows(kind):
    """Rows with Inf/-Inf/NaN at random places (x, or the residual of the fused add),
    every option that changes the statistic: SPEC's formula in float64 IEEE arithmetic."""
    @settings(max_examples=max(FUZZ_EXAMPLES // 2, 1), deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    @given(_non_finite_calls())
    def run(call):
        op, args, opts = call
        _check_non_finite(kind, op, args, opts)

    run()
