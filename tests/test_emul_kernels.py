"""The generated CUDA kernels (polynorm/backends/cuda/polynorm.cu), run on the CPU by the emulator.

The exact source CuPy compiles is built with g++ and tests/emulator's prelude
(one library per x dtype family, cached by content hash) and launched the way
the cupy backend launches it: kernel, grid, block and dynamic shared memory
from :mod:`polynorm.backends.cuda.launch`, the dtype decisions
(``forward_types`` / ``backward_types`` / ``colsum_out``) from there too, and
the arguments packed as ``polynorm/backends/cuda.py`` packs them (the same
numpy scalar types, in the ABI order of codegen/ABI.md; the harness checks
each one against the compiled parameter type).  Results are compared with
polynorm's reference backend at the per-dtype tolerances of tests/_oracle.py,
and the backward in float64 with central differences of the emulated forward.

Needs g++; without it these tests fail (EmulatorUnavailable), they do not skip.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import ml_dtypes
import numpy as np
import pytest
from _oracle import TOL, Tol, assert_close, looser
from emulator import compile_source

from polynorm.backends import reference
from polynorm.backends.cuda import launch as cl
from polynorm.core.options import Options, compute_dtype, make_plan

NP = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
DTYPES = ("float16", "bfloat16", "float32", "float64")


def _name(a) -> str | None:
    if a is None:
        return None
    return next(k for k, v in NP.items() if a.dtype == v)


def _family(name: str) -> str:
    """x dtype of a kernel name expression (the first template argument)."""
    first = name.split("<", 1)[1].split(",")[0].strip(" >")
    return {v: k for k, v in cl.CTYPE.items()}[first]


def _names(family: str) -> list[str]:
    """fwd/bwd specialisations of one x dtype, plus every pn_colsum (the same lists as
    test_emul_cupy_backend.py builds, so the two share the cached libraries)."""
    names = [n for n in cl.specialisations() if not n.startswith("pn_colsum") and _family(n) == family]
    return names + [n for n in cl.specialisations() if n.startswith("pn_colsum")]


@functools.cache
def module(family: str):
    """The emulated library holding the kernels of x dtype ``family``, built on first use
    (a run that takes no float16 kernel builds no float16 library; cached by content
    hash after)."""
    return compile_source(cl.SOURCE_PATH, _names(family))


#: how the emulator runs blocks (changed only by the schedule test)
_RUN: dict = {"schedule": 0, "workers": None}


def _launch(launch: cl.Launch, args: tuple, family: str) -> None:
    module(family).launch(launch.name, launch.grid, launch.block, args, launch.shared, **_RUN)


def _garbage(shape, dtype: str) -> np.ndarray:
    """An output buffer full of NaN bytes: anything the kernel fails to write shows."""
    a = np.empty(shape, NP[dtype])
    a.view(np.uint8)[...] = 0xFF
    return a


def _cast_keep(a, dtype: str):
    return None if a is None else (a if _name(a) == dtype else a.astype(NP[dtype]))


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _rs(a) -> np.int64:
    return np.int64(0 if a is None else a.strides[0] // a.itemsize)


# ----------------------------------------------------------------------------- the cupy backend, on numpy


def emul_forward(x, residual, weight, bias, plan, *, force_big=False, max_smem=cl.DEFAULT_SMEM, out=None,
                 small=True, split=True, num_sms=cl.DEFAULT_SMS, rows=True, rows_config=None):
    """``polynorm.backends.cuda.forward`` with numpy buffers for device memory.

    Returns ``(y, h, rstd, launch)``, or ``None`` where the backend has no
    kernel (llama casting with a weight dtype without one: it runs the
    reference instead)."""
    types = cl.forward_types(_name(x), _name(residual), _name(weight), plan.out_dtype, plan.llama)
    if types is None:
        return None
    ct = compute_dtype(types.h)
    xk = _cast_keep(x, types.x)
    rk = _cast_keep(residual, types.res)
    wk = _cast_keep(weight, types.weight)
    bk = _cast_keep(bias, ct)
    n, d = xk.shape
    direct = out is not None and types.out == plan.out_dtype  # the backend writes into out=
    yc = out if direct else _garbage((n, d), types.out)
    hc = _garbage((n, d), types.h) if rk is not None else None
    rstd = _garbage((n,), ct)
    launch = cl.forward_launch(n, d, types.x, types.res, types.weight, types.out,
                               max_smem=max_smem, force_big=force_big, small=small, split=split,
                               num_sms=num_sms, rows=rows, rows_config=rows_config)  # fmt: skip
    head = (xk, _rs(xk), rk, _rs(rk), hc, _rs(hc), wk, bk, yc, _rs(yc), rstd)
    tail = (np.float64(plan.eps), np.int32(plan.eps_inside), np.float64(plan.offset), np.int32(plan.llama))
    if launch.slices:  # pn_fwd_split: phase 1 and 2 around the per-slice sums
        part = _garbage((n * launch.slices,), "float64")
        args = (*head, part, np.int64(n), np.int32(d), np.int32(plan.k), np.int32(launch.slices), *tail)
        _launch(launch, args, types.x)
        _launch(dataclasses.replace(launch, name=launch.name2), args, types.x)
    else:
        args = (*head, np.int64(n), np.int32(d), np.int32(plan.k),
                np.int32(launch.stash if launch.big else launch.tpr), *tail)  # fmt: skip
        _launch(launch, args, types.x)
    y = yc if types.out == plan.out_dtype else yc.astype(NP[plan.out_dtype])
    return y, hc, rstd, launch


def _colsum(part, d: int, ct: str, want: str):
    kout = cl.colsum_out(ct, want)
    out = _garbage((d,), kout)
    launch = cl.colsum_launch(d, ct, kout)
    args = (part, np.int64(part.shape[0]), np.int64(part.shape[1]), np.int32(d), out)
    _launch(launch, args, "float32")
    return out if kout == want else out.astype(NP[want])


def emul_backward(dy, x, weight, bias, rstd, grad_residual, plan, *, force_big=False,
                  max_smem=cl.DEFAULT_SMEM, num_sms=cl.DEFAULT_SMS, flags=None, split=True, small=True,
                  rows=True, rows_config=None):  # fmt: skip
    """``polynorm.backends.cuda.backward`` with numpy buffers; returns (dx, dw, db, launch).

    ``flags``: (HAS_W, HAS_G) of the pn_bwd instantiation, when not the arrays' own."""
    xd, wd, bd = _name(x), _name(weight), _name(bias)
    types = cl.backward_types(xd, _name(dy), _name(grad_residual), wd)
    ct = types.compute
    dyk = _cast_keep(dy, types.dy)
    gk = _cast_keep(grad_residual, types.dy)
    wk = _cast_keep(weight, types.weight)
    rk = _cast_keep(rstd, ct)
    n, d = x.shape
    dx = _garbage((n, d), xd)
    want = weight is not None or bias is not None
    launch = cl.backward_launch(n, d, xd, types.dy, types.weight, partials=want, num_sms=num_sms,
                                max_smem=max_smem, force_big=force_big, split=split, small=small,
                                rows=rows, rows_config=rows_config,
                                has_w=weight is not None if flags is None else flags[0],
                                has_g=grad_residual is not None if flags is None else flags[1])
    shape = (launch.partial_rows, launch.ldp)

    def part():
        return np.zeros(shape, NP[ct]) if launch.big else _garbage(shape, ct)

    dwp = part() if weight is not None else None
    dbp = part() if bias is not None else None
    head = (dyk, _rs(dyk), x, _rs(x), wk, rk, gk, _rs(gk), dx, _rs(dx), dwp, dbp, np.int64(launch.ldp))
    tail = (np.float64(plan.eps), np.int32(plan.eps_inside), np.float64(plan.offset))
    if launch.slices:  # pn_bwd_split: phase 1 and 2 around the per-slice sums
        part = _garbage((2 * n * launch.slices,), "float64")
        args = (*head, part, np.int64(n), np.int32(d), np.int32(plan.k), np.int32(launch.slices), *tail)
        _launch(launch, args, xd)
        _launch(dataclasses.replace(launch, name=launch.name2), args, xd)
    else:
        args = (*head, np.int64(n), np.int32(d), np.int32(plan.k),
                np.int32(launch.stash if launch.big else launch.tpr), *tail)  # fmt: skip
        _launch(launch, args, xd)
    dw = _colsum(dwp, d, ct, wd) if weight is not None else None
    db = _colsum(dbp, d, ct, bd) if bias is not None else None
    return dx, dw, db, launch


# ----------------------------------------------------------------------------- cases


def _plan(d, h_dtype, *, eps=1e-6, partial=1.0, offset=0.0, eps_mode="inside", casting="fp32", out_dtype=None):
    return make_plan(d, h_dtype, Options(eps=eps, partial=partial, offset=offset,
                                         eps_mode=eps_mode, casting=casting, out_dtype=out_dtype))


def _data(rng, n, d, dtype, scale=1.0):
    return (rng.standard_normal((n, d)) * scale).astype(NP[dtype])


def _check_forward(x, residual, weight, bias, plan, **kw):
    got = emul_forward(x, residual, weight, bias, plan, **kw)
    assert got is not None, "no kernel for this combination"
    y, h, rstd, launch = got
    ry, rh, rr = reference.forward(x, residual, weight, bias, plan)
    tag = f"{launch.name} grid={launch.grid} block={launch.block} shared={launch.shared}"
    assert y.dtype == NP[plan.out_dtype]
    assert_close(y, ry, looser(plan.norm_dtype, plan.out_dtype), f"y of {tag}")
    assert_close(rstd, rr, Tol(2e-6, 0.0) if plan.compute_dtype == "float32" else Tol(1e-13, 0.0), f"rstd of {tag}")
    if residual is not None:
        np.testing.assert_array_equal(h.astype(np.float64), np.asarray(rh).astype(np.float64), err_msg=f"h of {tag}")
    return launch


#: hidden sizes: not multiples of any vector width, one that is, and one past the register kernels
D_SMALL = (1, 3, 31, 127, 1000, 4101)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", D_SMALL)
def test_emul_forward_every_dtype_and_size(dtype, d):
    rng = np.random.default_rng(d)
    n = 37 if d < 1000 else 5  # several tokens per block for small d, ragged last block
    x = _data(rng, n, d, dtype)
    w = _data(rng, 1, d, dtype)[0]
    launch = _check_forward(x, None, w, None, _plan(d, dtype))
    if d <= 31:
        assert launch.block // launch.tpr > 1, "expected several tokens per block"


OPTIONS = {
    "no_weight": dict(weight=False),
    "bias": dict(bias=True),
    "partial": dict(partial=0.3),
    "offset": dict(offset=1.0),
    "eps_outside": dict(eps=0.5, eps_mode="outside"),
    "eps_inside_large": dict(eps=0.5),
    "llama": dict(casting="llama"),
    "llama_offset_bias": dict(casting="llama", offset=1.0, bias=True),
    "residual": dict(residual=True),
    "residual_f32": dict(residual="float32"),
    "weight_f32": dict(weight="float32"),
    "residual_f16": dict(residual="float16"),
    "out_f32": dict(out_dtype="float32"),
    "out_f16": dict(out_dtype="float16"),
    "everything": dict(residual=True, bias=True, partial=0.5, offset=1.0, eps=0.5, eps_mode="outside"),
}


def _option_case(rng, n, d, dtype, opt):
    x = _data(rng, n, d, dtype)
    res = None
    if opt.get("residual"):
        res = _data(rng, n, d, dtype if opt["residual"] is True else opt["residual"])
    h_dtype = dtype if res is None else cl.promote(dtype, _name(res))
    wdt = opt.get("weight", True)
    w = None if wdt is False else _data(rng, 1, d, dtype if wdt is True else wdt)[0]
    b = _data(rng, 1, d, dtype)[0] if opt.get("bias") else None
    kw = {k: v for k, v in opt.items() if k in ("eps", "partial", "offset", "eps_mode", "casting", "out_dtype")}
    return x, res, w, b, _plan(d, h_dtype, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opt", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("d,force_big", [(31, False), (1000, False), (1000, True)], ids=["d31", "d1000", "d1000big"])
def test_emul_forward_options(dtype, opt, d, force_big):
    rng = np.random.default_rng(_seed(dtype, opt, d))
    x, res, w, b, plan = _option_case(rng, 19, d, dtype, OPTIONS[opt])
    if cl.forward_types(_name(x), _name(res), _name(w), plan.out_dtype, plan.llama) is None:
        pytest.skip("no kernel: the cupy backend runs the reference for this combination")
    _check_forward(x, res, w, b, plan, force_big=force_big)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_emul_forward_big_kernel_sizes_and_stash(dtype):
    """The one-row-per-block kernel: past the register kernels' limit, and with the
    row stash in shared memory full, partial and empty (any stash is correct)."""
    rng = np.random.default_rng(4)
    vec = cl.VEC[dtype]
    d_big = 2 * cl.REG_THREADS * cl.FWD_ITEMS_BY_X[dtype][-1] * vec + 5  # past pn_fwd's reach
    x = _data(rng, 2, d_big, dtype)
    w = _data(rng, 1, d_big, dtype)[0]
    launch = _check_forward(x, None, w, None, _plan(d_big, dtype), split=False, rows=False)
    assert launch.big and launch.block == 1024
    x = _data(rng, 3, 4101, dtype)
    w = _data(rng, 1, 4101, dtype)[0]
    for max_smem in (cl.DEFAULT_SMEM, 100 * vec * NP[dtype].itemsize + 3, 0):
        launch = _check_forward(x, None, w, None, _plan(4101, dtype), force_big=True, max_smem=max_smem)
        assert launch.big


@pytest.mark.parametrize("dtype", DTYPES)
def test_emul_forward_layouts(dtype):
    """Misaligned rows (scalar head), row strides that are not a multiple of the
    vector width, negative strides, and an output written in place over x."""
    rng = np.random.default_rng(5)
    d = 203
    wide = _data(rng, 9, d + 3, dtype)
    w = _data(rng, 1, d, dtype)[0]
    plan = _plan(d, dtype)
    for x in (wide[:, 1 : d + 1], wide[:, :d], wide[::-1, 2 : d + 2], wide[::2, :d]):
        _check_forward(x, None, w, None, plan)
    x = wide[:, 1 : d + 1]
    before = x.copy()
    ry, _, _ = reference.forward(before, None, w, None, plan)
    y, _, _, _ = emul_forward(x, None, w, None, plan)  # inputs untouched (harness checks const arrays)
    np.testing.assert_array_equal(x, before)
    assert_close(y, ry, dtype, "y")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_emul_forward_nan_and_zero_rows_stay_local(dtype):
    rng = np.random.default_rng(6)
    for d, force_big in ((64, False), (2000, True)):
        x = _data(rng, 6, d, dtype)
        x[1, 3] = np.nan
        x[2, :] = 0
        x[4, 5] = np.inf
        w = _data(rng, 1, d, dtype)[0]
        y, _, rstd, _ = emul_forward(x, None, w, None, _plan(d, dtype), force_big=force_big)
        assert np.isnan(y[1].astype(np.float32)).all()
        # an Inf: rstd = 1/sqrt(Inf) = 0, y = x * 0 * w, NaN at the Inf only (SPEC, torch)
        y4 = y[4].astype(np.float32)
        assert rstd[4] == 0 and np.isnan(y4[5]) and (np.delete(y4, 5) == 0).all()
        assert (y[2].astype(np.float32) == 0).all()
        assert np.isfinite(y[[0, 3, 5]].astype(np.float32)).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_emul_inf_rows_follow_specs_formula(dtype):
    """An Inf among a row's first k elements makes ms = Inf, so rstd = 0 and
    y = x * 0 * w + b: NaN at the Inf, b elsewhere (SPEC's formula; torch gives it), in
    every forward form (pn_fwd_small, pn_fwd, pn_fwd_big, pn_fwd_split; float64 through
    the scaled sum, where Inf / Inf was NaN).  A NaN still makes its row NaN, an Inf
    beyond k leaves rstd finite.  y, rstd and the backward (dx NaN over the first k,
    beyond k the term xhat * 0: NaN at an Inf there too) match the reference."""
    rng = np.random.default_rng(_seed("inf rows", dtype))
    forms = [(40, {}), (40, {"small": False}), (1000, {"force_big": True})]
    if dtype != "float64":
        forms.append((_split_d(dtype), {}))
    for d, how in forms:
        x = _data(rng, 5, d, dtype)
        x[1, 3] = np.inf
        x[1, d - 2] = np.inf  # beyond k for partial=0.5
        x[2, 0], x[2, 5] = -np.inf, np.inf
        x[3, d - 1] = -np.inf  # beyond k for partial=0.5 only
        x[4, 2], x[4, 7] = np.nan, np.inf
        w, b = _data(rng, 1, d, dtype)[0], _data(rng, 1, d, dtype)[0]
        dy = _data(rng, 5, d, dtype)
        for opts in ({}, {"partial": 0.5, "eps_mode": "outside", "eps": 0.0}):
            plan = _plan(d, dtype, **opts)
            tag = f"d={d} {how} {opts}"
            launch = _check_forward(x, None, w, b, plan, **how)
            y, _, rstd, _ = emul_forward(x, None, w, b, plan, **how)
            assert rstd[1] == 0 and rstd[2] == 0 and np.isnan(rstd[4]), tag
            assert (rstd[3] == 0) == (opts == {}), tag
            np.testing.assert_array_equal(np.delete(y[1], [3, d - 2]), np.delete(b, [3, d - 2]), err_msg=tag)
            assert np.isnan(y[4].astype(np.float64)).all(), tag
            _check_backward(dy, x, w, b, None, None, plan, **how)
            _check_backward(dy, x, w, b, rstd, None, plan, **how)
        if how.get("small", True) and d == 40:
            assert launch.name.startswith("pn_fwd_small"), launch.name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_emul_signed_zero_weight_keeps_its_sign(dtype):
    """A -0.0 weight: y = x * rstd * -0.0 has the sign of -x (torch's bits) in every
    forward form and both castings -- the Plan's zero offset is -0.0, which adds nothing."""
    rng = np.random.default_rng(_seed("signed zero", dtype))
    for d, how in ((40, {}), (40, {"small": False}), (1000, {"force_big": True})):
        x = _data(rng, 3, d, dtype)
        w = _data(rng, 1, d, dtype)[0]
        w[::3] = -0.0
        w[1::3] = 0.0
        for casting in ("fp32", "llama"):
            y, _, _, launch = emul_forward(x, None, w, None, _plan(d, dtype, casting=casting), **how)
            z = y[:, : (d // 3) * 3].astype(np.float64)[:, ::3]
            assert (z == 0).all()
            np.testing.assert_array_equal(np.signbit(z), ~np.signbit(x[:, : (d // 3) * 3:3].astype(np.float64)),
                                          err_msg=f"{launch.name} {casting}")
            z1 = y.astype(np.float64)[:, 1::3]
            np.testing.assert_array_equal(np.signbit(z1), np.signbit(x[:, 1::3].astype(np.float64)))


def test_emul_forward_no_overflow():
    """float32 rows of 1e25 (x**2 overflows float32) and bfloat16 rows of 1e30."""
    rng = np.random.default_rng(7)
    for dtype, scale in (("float32", 1e25), ("bfloat16", 1e30), ("float32", 1e-30)):
        x = _data(rng, 4, 300, dtype, scale)
        _check_forward(x, None, None, None, _plan(300, dtype, eps=0.0))


def test_emul_forward_deterministic_across_workers():
    rng = np.random.default_rng(8)
    x = _data(rng, 64, 100, "bfloat16")
    plan = _plan(100, "bfloat16")
    types = cl.forward_types("bfloat16", None, None, "bfloat16", False)
    outs = []
    for workers in (1, 3):
        launch = cl.forward_launch(64, 100, types.x)
        y = _garbage((64, 100), "bfloat16")
        r = _garbage((64,), "float32")
        args = (x, _rs(x), None, np.int64(0), None, np.int64(0), None, None, y, _rs(y), r,
                np.int64(64), np.int32(100), np.int32(plan.k), np.int32(launch.tpr),
                np.float64(plan.eps), np.int32(1), np.float64(0.0), np.int32(0))  # fmt: skip
        module("bfloat16").launch(launch.name, launch.grid, launch.block, args, launch.shared, workers=workers)
        outs.append(y.view(np.uint16).copy())
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_emul_largest_hidden_size(dtype):
    """d = 262,144 (the issue's largest): one row per block, stash at the shared-memory limit."""
    rng = np.random.default_rng(10)
    d = 262144
    x = _data(rng, 1, d, dtype)
    w = _data(rng, 1, d, dtype)[0]
    launch = _check_forward(x, None, w, None, _plan(d, dtype), split=False)
    assert launch.big and 0 < launch.shared <= cl.DEFAULT_SMEM
    launch = _check_forward(x, None, w, None, _plan(d, dtype))
    assert launch.slices == cl.slice_count(d, dtype) > 1 and launch.grid == launch.slices
    dy, x, w, b, rstd, g, plan = _bwd_case(rng, 2, d, dtype, dict(bias=True))
    launch = _check_backward(dy, x, w, b, rstd, g, plan, split=False)
    assert launch.big and 0 < launch.shared <= cl.DEFAULT_SMEM
    launch = _check_backward(dy, x, w, b, rstd, g, plan)
    assert launch.slices == cl.slice_count(d, dtype) and launch.partial_rows == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_emul_single_misaligned_row(dtype):
    """n == 1 takes the vector path even when the row stride would not allow it."""
    rng = np.random.default_rng(11)
    wide = _data(rng, 1, 1003, dtype)
    x = wide[:, 1:1002]
    w = _data(rng, 1, 1001, dtype)[0]
    dy = _data(rng, 1, 1001, dtype)
    for big in (False, True):
        _check_forward(x, None, w, None, _plan(1001, dtype), force_big=big)
        _check_backward(dy, x, w, None, None, None, _plan(1001, dtype), force_big=big)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,force_big,max_smem", [(67, False, 0), (3001, True, cl.DEFAULT_SMEM), (3001, True, 0)])
def test_emul_forward_in_place(dtype, d, force_big, max_smem):
    """out= x (the front end allows it): y overwrites x, with and without the row stash."""
    rng = np.random.default_rng(12)
    x = _data(rng, 5, d, dtype)
    w = _data(rng, 1, d, dtype)[0]
    plan = _plan(d, dtype)
    ry, _, rr = reference.forward(x.copy(), None, w, None, plan)
    y, _, rstd, _ = emul_forward(x, None, w, None, plan, force_big=force_big, max_smem=max_smem, out=x)
    assert y is x
    assert_close(x, ry, dtype, "y written over x")


# ----------------------------------------------------------------------------- backward


def _check_backward(dy, x, w, b, rstd, gres, plan, *, tol=None, **kw):
    dx, dw, db, launch = emul_backward(dy, x, w, b, rstd, gres, plan, **kw)
    rdx, rdw, rdb = reference.backward(dy, x, w, b, rstd, gres, plan)
    tag = f"{launch.name} grid={launch.grid} block={launch.block} shared={launch.shared}"
    xd = _name(x)
    assert dx.dtype == x.dtype
    assert_close(dx, rdx, tol or TOL[xd], f"dx of {tag}")
    if w is not None:
        assert dw.dtype == w.dtype
        assert_close(dw, rdw, tol or looser(xd, _name(w)), f"dweight of {tag}")
    else:
        assert dw is None
    if b is not None:
        assert db.dtype == b.dtype
        assert_close(db, rdb, tol or looser(xd, _name(b)), f"dbias of {tag}")
    return launch


BWD_OPTIONS = {
    "plain": dict(),
    "no_weight": dict(weight=False),
    "bias": dict(bias=True),
    "bias_no_weight": dict(bias=True, weight=False),
    "partial": dict(partial=0.3),
    "offset": dict(offset=1.0),
    "eps_outside": dict(eps=0.5, eps_mode="outside"),
    "rstd_given": dict(rstd=True),
    "grad_residual": dict(grad_residual=True),
    "weight_f32": dict(weight="float32"),
    "dy_f32": dict(dy="float32"),
    "everything": dict(bias=True, partial=0.5, offset=1.0, eps=0.5, eps_mode="outside", rstd=True,
                       grad_residual=True),
}  # fmt: skip


def _bwd_case(rng, n, d, dtype, opt):
    x = _data(rng, n, d, dtype)
    dy = _data(rng, n, d, opt.get("dy", dtype))
    wdt = opt.get("weight", True)
    w = None if wdt is False else _data(rng, 1, d, dtype if wdt is True else wdt)[0]
    b = _data(rng, 1, d, dtype)[0] if opt.get("bias") else None
    g = _data(rng, n, d, dtype) if opt.get("grad_residual") else None
    kw = {k: v for k, v in opt.items() if k in ("eps", "partial", "offset", "eps_mode")}
    plan = _plan(d, dtype, **kw)
    rstd = reference.rstd(x, plan) if opt.get("rstd") else None
    return dy, x, w, b, rstd, g, plan


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", D_SMALL)
def test_emul_backward_every_dtype_and_size(dtype, d):
    rng = np.random.default_rng(100 + d)
    n = 37 if d < 1000 else 5
    dy, x, w, b, rstd, g, plan = _bwd_case(rng, n, d, dtype, dict(bias=True))
    _check_backward(dy, x, w, b, rstd, g, plan)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opt", list(BWD_OPTIONS), ids=list(BWD_OPTIONS))
@pytest.mark.parametrize("d,force_big", [(31, False), (1000, False), (1000, True)], ids=["d31", "d1000", "d1000big"])
def test_emul_backward_options(dtype, opt, d, force_big):
    rng = np.random.default_rng(_seed(dtype, opt, d, 1))
    dy, x, w, b, rstd, g, plan = _bwd_case(rng, 23, d, dtype, BWD_OPTIONS[opt])
    _check_backward(dy, x, w, b, rstd, g, plan, force_big=force_big)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [5, 64, 200, 1000])
def test_emul_backward_flag_specialisations_bits(dtype, d):
    """pn_bwd<.., HAS_W=false> (and pn_bwd_small's) gives the bits of HAS_W=true with a weight of ones
    (offset 0: g = (1 + 0) * dy = dy exactly), and HAS_G=false those of HAS_G=true with
    a grad_residual of -0.0 (o + -0.0 == o for every o), also with a persistent grid
    smaller than the row groups and float32 rows whose squares or g*dy*xhat overflow."""
    rng = np.random.default_rng(_seed(dtype, d, 11))
    dy, x, _, b, _, _, plan = _bwd_case(rng, 45, d, dtype, dict(bias=True))
    if dtype == "float32":
        x[3] *= np.float32(1e25)  # the squares' double fallback
        dy[4] *= np.float32(1e30)  # the g*dy*xhat double fallback
    ones = np.ones(d, NP[dtype])
    negz = np.full(x.shape, -0.0, NP[dtype])
    def flags_of(name):  # (HAS_W, HAS_G) of a pn_bwd / pn_bwd_small name (after ITEMS) or pn_bwd_rows' (last)
        parts = [v.strip(" >") for v in name.split(",")]
        return tuple(v == "true" for v in (parts[-2:] if name.startswith("pn_bwd_rows") else parts[4:6]))

    for num_sms, small in ((1, True), (cl.DEFAULT_SMS, True), (1, False)):
        want = emul_backward(dy, x, ones, b, None, negz, plan, num_sms=num_sms, small=small)
        if want[3].big:
            pytest.skip("a row too long for pn_bwd")
        assert flags_of(want[3].name) == (True, True)
        assert want[3].name.startswith("pn_bwd_small") == (small and cl.takes_small_bwd(d, dtype, dtype))
        for flags, w, g in (((False, True), None, negz), ((True, False), ones, None), ((False, False), None, None)):
            got = emul_backward(dy, x, w, b, None, g, plan, num_sms=num_sms, flags=flags, small=small)
            assert flags_of(got[3].name) == flags
            np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]), err_msg=f"dx of {got[3].name}")
            np.testing.assert_array_equal(_bits(got[2]), _bits(want[2]), err_msg=f"dbias of {got[3].name}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_emul_backward_persistent_grid_and_stash(dtype):
    """More row groups than blocks (each block strides over several; partial rows
    summed per block), and the big kernel with full / partial / no stash."""
    rng = np.random.default_rng(9)
    dy, x, w, b, rstd, g, plan = _bwd_case(rng, 300, 40, dtype, dict(bias=True))
    launch = _check_backward(dy, x, w, b, rstd, g, plan, num_sms=2)
    assert launch.grid * (launch.block // launch.tpr) < 300
    vec = cl.VEC[dtype]
    dy, x, w, b, rstd, g, plan = _bwd_case(rng, 7, 3001, dtype, dict(bias=True, grad_residual=True))
    for max_smem in (cl.DEFAULT_SMEM, 50 * vec * 8 + 16, 0):
        launch = _check_backward(dy, x, w, b, rstd, g, plan, force_big=True, max_smem=max_smem, num_sms=3)
        assert launch.big and launch.grid == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_emul_backward_row_ring_wraps(dtype):
    """pn_bwd's row ring over more rows per lane than it has stages (one block per SM
    of one SM: every lane handles 5 rows), for VA rows (d = 64) and element-by-element
    ones (d = 100: rows not 16-byte aligned), with and without grad_residual (pn_bwd, not
    pn_bwd_small, which the dispatcher gives rows this short)."""
    rng = np.random.default_rng(_seed(dtype, 12))
    for d in (64, 100):
        for opt in (dict(bias=True), dict(bias=True, grad_residual=True, dy="float32")):
            dy, x, w, b, rstd, g, plan = _bwd_case(rng, 300, d, dtype, opt)
            launch = _check_backward(dy, x, w, b, rstd, g, plan, num_sms=1, small=False)
            stages = cl.bwd_ring(dtype, cl.backward_types(dtype, _name(dy), _name(g), dtype).dy, g is not None)[0]
            assert -(-300 // (launch.grid * (launch.block // launch.tpr))) > stages, launch


def test_emul_cp_async_early_read_is_caught():
    """The prelude's cp.async is asynchronous (PN_EMUL_CP_ASYNC: a copy lands at the
    wait that covers it), so a read of pn_bwd's ring before its wait is caught: with
    the wait one group short (the generated source, mutated) dx reads the 0xFF fill of
    shared memory; unmutated, the same launch is right."""
    src = cl.source()
    early = src.replace("pn_cp_wait<S - 1>();", "pn_cp_wait<S>();")
    assert early.count("pn_cp_wait<S>();") == 1
    name = cl.bwd_name("float32", "float32", "float32", 1, True, False)
    rng = np.random.default_rng(13)
    dy, x, w, _, _, _, plan = _bwd_case(rng, 300, 64, "float32", {})
    launch = cl.backward_launch(300, 64, "float32", num_sms=1, has_w=True, has_g=False, small=False)
    assert launch.name == name and launch.grid * (launch.block // launch.tpr) < 300
    rdx = reference.backward(dy, x, w, None, None, None, plan)[0]
    for mod, right in ((compile_source(early, [name]), False), (module("float32"), True)):
        dx = _garbage(x.shape, "float32")
        dwp = _garbage((launch.partial_rows, launch.ldp), "float32")
        args = (dy, _rs(dy), x, _rs(x), w, None, None, np.int64(0), dx, _rs(dx), dwp, None, np.int64(launch.ldp),
                np.int64(300), np.int32(64), np.int32(plan.k), np.int32(launch.tpr), np.float64(plan.eps),
                np.int32(plan.eps_inside), np.float64(plan.offset))
        mod.launch(name, launch.grid, launch.block, args, launch.shared)
        if right:
            assert_close(dx, rdx, TOL["float32"], "dx")
        else:
            assert np.isnan(dx).any(), "a read before its cp.async wait went unnoticed"


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_emul_same_bits_for_every_schedule_and_worker_count(dtype):
    """No races, no order dependence: the threads of a block taking turns in
    another order (reversed, shuffled) and blocks spread over other numbers of
    OS threads give bit-identical y, h, rstd, dx, dweight, dbias."""
    rng = np.random.default_rng(13)

    def run_all():
        outs = []
        for d, big in ((31, False), (3001, True)):
            x, res, w, b, plan = _option_case(rng_fixed(d), 37 if d < 100 else 3, d, dtype,
                                              dict(residual=True, bias=True, partial=0.5))  # fmt: skip
            y, h, r, _ = emul_forward(x, res, w, b, plan, force_big=big, max_smem=d * 2)
            dy, x2, w2, b2, _, g, plan2 = _bwd_case(rng_fixed(d + 1), 37 if d < 100 else 3, d, dtype,
                                                    dict(bias=True, grad_residual=True))  # fmt: skip
            dx, dw, db, _ = emul_backward(dy, x2, w2, b2, None, g, plan2, force_big=big, max_smem=d * 4, num_sms=2)
            outs += [a.view(np.uint8).copy() for a in (y, h, r, dx, dw, db)]
        return outs

    def rng_fixed(seed):
        return np.random.default_rng(seed)

    base = run_all()
    try:
        for schedule, workers in ((1, 1), (int(rng.integers(2, 1000)), 3), (0, 2)):
            _RUN.update(schedule=schedule, workers=workers)
            for a, b in zip(run_all(), base, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"schedule={schedule} workers={workers}")
    finally:
        _RUN.update(schedule=0, workers=None)


# ----------------------------------------------------------------------------- backward: finite differences

H = 1e-6
#: Central differences in float64: truncation h**2/6*|L'''| ~ 1e-12 * O(10),
#: rounding ~ 2.2e-16 * |L| / h ~ 2e-9 for |L| = O(10); a formula error is
#: O(eps) = O(0.05) or more (eps is chosen that large so that the placement of
#: eps matters).  rtol = atol = 1e-6 (atol relative to the largest gradient)
#: leaves a factor ~500 over the fd error and is ~1e4 below any real error.
FD_TOL = Tol(1e-6, 1e-6)
FD_OPTIONS = {
    "plain": dict(),
    "partial_offset": dict(partial=0.4, offset=1.0),
    "eps_outside": dict(eps_mode="outside"),
    "eps_outside_partial": dict(eps_mode="outside", partial=0.6),
    "no_weight": dict(weight=False),
}


def _loss_grads_fd(x, w, b, g_y, plan, force_big):
    """Central differences of L = sum(y * g_y) through the EMULATED forward."""

    def fwd(xx, ww, bb):
        y, _, _, _ = emul_forward(xx, None, ww, bb, plan, force_big=force_big)
        return y

    n, d = x.shape
    # perturb column p of every token at once: tokens are independent
    xs = np.concatenate([x + s * H * (np.arange(d) == p) for p in range(d) for s in (1, -1)])
    ys = fwd(xs, w, b).reshape(d, 2, n, d)
    dx = ((ys[:, 0] - ys[:, 1]) * g_y).sum(axis=2).T / (2 * H)  # (n, d)
    dw = None
    if w is not None:
        dw = np.array([((fwd(x, w + H * e, b) - fwd(x, w - H * e, b)) * g_y).sum() / (2 * H) for e in np.eye(d)])
    db = g_y.sum(axis=0) if b is not None else None  # L is linear in b: exact
    return dx, dw, db


@pytest.mark.parametrize("opt", list(FD_OPTIONS), ids=list(FD_OPTIONS))
@pytest.mark.parametrize("force_big", [False, True], ids=["reg", "big"])
def test_emul_backward_finite_differences_float64(opt, force_big):
    rng = np.random.default_rng(_seed(opt, force_big))
    n, d = 3, 11
    o = FD_OPTIONS[opt]
    x = rng.standard_normal((n, d))
    w = None if o.get("weight") is False else rng.standard_normal(d)
    b = rng.standard_normal(d)
    g_y = rng.standard_normal((n, d))
    plan = _plan(d, "float64", eps=0.05, **{k: v for k, v in o.items() if k != "weight"})
    fdx, fdw, fdb = _loss_grads_fd(x, w, b, g_y, plan, force_big)
    for rstd in (None, emul_forward(x, None, w, b, plan)[2]):
        dx, dw, db, _ = emul_backward(g_y, x, w, b, rstd, None, plan, force_big=force_big)
        assert_close(dx, fdx, FD_TOL, "dx vs finite differences")
        if w is not None:
            assert_close(dw, fdw, FD_TOL, "dweight vs finite differences")
        assert_close(db, fdb, FD_TOL, "dbias vs sum of dy")


# ----------------------------------------------------------------------------- every specialisation


#: ABI.md parameter types (pointer -> "*", const pointer -> "c*", scalar code:size)
_FWD_SIG = ["c*X", "i8:8", "c*R", "i8:8", "*H", "i8:8", "c*W", "c*C", "*O", "i8:8", "*C",
            "i8:8", "i4:4", "i4:4", "i4:4", "f8:8", "i4:4", "f8:8", "i4:4"]  # fmt: skip
_BWD_SIG = ["c*G", "i8:8", "c*X", "i8:8", "c*W", "c*C", "c*G", "i8:8", "*X", "i8:8", "*C", "*C",
            "i8:8", "i8:8", "i4:4", "i4:4", "i4:4", "f8:8", "i4:4", "f8:8"]  # fmt: skip
_CODE = {"float16": "f2", "bfloat16": "bf16", "float32": "f4", "float64": "f8"}


@pytest.mark.parametrize("family", DTYPES)
def test_emul_every_specialisation_compiles_with_the_abi_signature(family):
    mod = module(family)
    rev = {v: k for k, v in cl.CTYPE.items()}
    for name in mod.kernels:
        expr = next(n for n in cl.specialisations() if n.replace(" ", "") == name)
        if expr.startswith(("pn_gated", "pn_quant", "pn_split_", "pn_qk_", "pn_none")):
            # the fusions', the split's, QK-norm's and casting="none"'s ABIs:
            # tests/test_emul_fusions.py, test_emul_split.py, test_emul_qk.py, test_emul_none.py
            # (the harness checks every launch)
            continue
        targs = [a.strip() for a in expr.split("<", 1)[1].rstrip(">").split(",")]
        sig = mod.signature(expr)
        got = [("c*" if p.const else "*") + p.code if p.pointer else f"{p.code}:{p.size}" for p in sig]
        if expr.startswith("pn_colsum"):
            ct, out = (_CODE[rev[t]] for t in targs)
            assert got == [f"c*{ct}", "i8:8", "i8:8", "i4:4", f"*{out}"], expr
            continue
        x = rev[targs[0]]
        if expr.startswith("pn_fwd"):
            r, w, o = (rev[t] for t in targs[1:4])
            h = cl.promote(x, r)
            sub = {"X": x, "R": r, "H": h, "W": w, "O": o, "C": compute_dtype(h), "P": "float64"}
            # pn_fwd_split: the float64 slice sums after rstd
            want = _FWD_SIG[:11] + ["*P"] + _FWD_SIG[11:] if expr.startswith("pn_fwd_split") else _FWD_SIG
        else:
            g, w = (rev[t] for t in targs[1:3])
            sub = {"X": x, "G": g, "W": w, "C": compute_dtype(x), "P": "float64"}
            # pn_bwd_split: the float64 slice sums after ldp
            want = _BWD_SIG[:13] + ["*P"] + _BWD_SIG[13:] if expr.startswith("pn_bwd_split") else _BWD_SIG
        want = [s[:-1] + _CODE[sub[s[-1]]] if "*" in s else s for s in want]
        assert got == want, expr


# ----------------------------------------------------------------------------- batch invariance, eps = 0

#: (dtype, d) pairs on both sides of the launch-rule boundaries: one chunk per
#: thread, the widest register kernel, and the first row of the one-row-per-block kernel
_BI_CASES = (("bfloat16", 64), ("bfloat16", 2 * cl.REG_THREADS * 8 + 8), ("float32", 1000),
             ("float64", 2 * cl.REG_THREADS * 2 + 2))


@pytest.mark.parametrize(("dtype", "d"), _BI_CASES)
def test_emul_batch_invariance_and_eps0_zero_token(dtype, d):
    """A token's y, h, rstd and dx bits equal those of the same token alone in a
    (1, d) call, whatever the row count (other rows per block, grid, persistent
    grid); with eps = 0 an all-zero token gives NaN for that token only."""
    rng = np.random.default_rng(_seed("bi", dtype, d))
    n = 37 if d <= 1000 else 3
    x, res, w, _, _ = _option_case(rng, n, d, dtype, dict(residual=True))
    x[1] = 0
    res[1] = 0
    plan = _plan(d, dtype, eps=0.0)
    y, h, r, la = emul_forward(x, res, w, None, plan)
    dy = _data(rng, n, d, dtype)
    dx, _, _, lb = emul_backward(dy, x, w, None, None, None, plan)
    assert np.isnan(y[1].astype(np.float64)).all() and np.isnan(dx[1].astype(np.float64)).all()
    others = [i for i in range(n) if i != 1]
    assert np.isfinite(y[others].astype(np.float64)).all() and np.isfinite(dx[others].astype(np.float64)).all()
    for i in (0, 1, n - 1):
        y1, h1, r1, la1 = emul_forward(x[i:i + 1], res[i:i + 1], w, None, plan)
        dx1, _, _, lb1 = emul_backward(dy[i:i + 1], x[i:i + 1], w, None, None, None, plan)
        assert (la1.name, lb1.name) == (la.name, lb.name)
        for got, one in ((y[i], y1[0]), (h[i], h1[0]), (r[i:i + 1], r1), (dx[i], dx1[0])):
            np.testing.assert_array_equal(got.view(np.uint8), one.view(np.uint8), err_msg=f"token {i}")


# ----------------------------------------------------------------------------- pn_fwd_small


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _small_vs_fwd(x, res, w, b, plan, tag):
    """pn_fwd_small's y, h and rstd bits equal pn_fwd's for the same rows (and are
    close to the reference)."""
    got = emul_forward(x, res, w, b, plan)
    if got is None:
        return None
    ref = emul_forward(x, res, w, b, plan, small=False)
    assert not ref[3].name.startswith("pn_fwd_small")
    for a, r, what in zip(got[:3], ref[:3], ("y", "h", "rstd"), strict=True):
        if a is not None:
            np.testing.assert_array_equal(_bits(a), _bits(r), err_msg=f"{what} of {got[3].name} vs {ref[3].name} {tag}")
    ry, _, rr = reference.forward(x, res, w, b, plan)
    assert_close(got[0], ry, looser(plan.norm_dtype, plan.out_dtype), f"y of {got[3].name} {tag}")
    return got[3]


#: every d of one small-row kernel shape, both sides of each shape change, and the edges
D_SMALLROWS = (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 128, 129, 130, 200, 255, 256)
SMALL_OPTS = ("plain", "residual_bias", "partial_outside", "llama_offset", "residual_f32")


def _small_case(rng, n, d, dtype, opt):
    spec = {
        "plain": dict(),
        "residual_bias": dict(residual=True, bias=True),
        "partial_outside": dict(partial=0.5, eps=0.25, eps_mode="outside", weight=False),
        "llama_offset": dict(casting="llama", offset=1.0, bias=True),
        "residual_f32": dict(residual="float32", weight="float32", partial=0.6),
    }[opt]
    return _option_case(rng, n, d, dtype, spec)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opt", SMALL_OPTS)
def test_emul_small_rows_same_bits_as_pn_fwd(dtype, opt):
    """d <= 256 goes to pn_fwd_small; its bits equal pn_fwd's for the same rows, over
    every shape change of the lanes-per-row rule, odd n (a ragged last block), the
    options, and misaligned rows (the element-by-element twin)."""
    rng = np.random.default_rng(_seed("small", dtype, opt))
    ds = D_SMALLROWS if opt == "plain" else D_SMALLROWS[1::3]  # from d=2: partial keeps k >= 1
    seen = set()
    for d in ds:
        n = 1 + int(rng.integers(1, 40)) * 2  # odd
        x, res, w, b, plan = _small_case(rng, n, d, dtype, opt)
        la = _small_vs_fwd(x, res, w, b, plan, f"d={d} n={n}")
        if la is None:
            pytest.skip("no kernel: the cupy backend runs the reference for this combination")
        seen.add(la.name)
        if cl.small_shape(d, dtype) is not None:
            assert la.name.startswith("pn_fwd_small"), la.name
    x, res, w, b, plan = _small_case(rng, 9, 129, dtype, opt)
    wide = np.concatenate([x, x[:, :3]], axis=1)[:, 1:130]  # rows not 16-byte aligned
    _small_vs_fwd(wide, res, w, b, plan, "misaligned")
    assert any(nm.startswith("pn_fwd_small") for nm in seen)


@pytest.mark.parametrize("x16", [False, True], ids=["wide", "float16"])  # float16 x: the slow run (tests/conftest.py)
def test_emul_small_rows_extreme_values(x16):
    """The float runs' exact fallback (squares that overflow float32 or are tiny),
    NaN/Inf and zero rows, eps 0: the same bits as pn_fwd."""
    rng = np.random.default_rng(11)
    for dtype, scale in (("float32", 1e25), ("float32", 1e-30), ("bfloat16", 1e30), ("float64", 1e200),
                         ("float64", 1e-200), ("float16", 1e4)):
        if (dtype == "float16") != x16:
            continue
        for d in (7, 64, 128, 200):
            x = _data(rng, 7, d, dtype, scale)
            x[2] = 0
            x[3, d // 2] = np.inf
            x[4, :: 3] *= 1e-3
            w = _data(rng, 1, d, dtype)[0]
            _small_vs_fwd(x, None, w, None, _plan(d, dtype, eps=0.0), f"{dtype} scale={scale} d={d}")


def _rstd_sequential_f64(x: np.ndarray, eps: float) -> np.ndarray:
    """pn_fwd's float64 rstd (eps inside) with the squares summed left to right instead
    of over its tree: the order the test below must tell apart."""
    out = np.empty(x.shape[0])
    for i, row in enumerate(x):
        m = np.abs(row).max()
        inv = 1.0 / m
        ss = 0.0
        for v in row:
            ss += (v * inv) * (v * inv)
        rms = m * np.sqrt(ss / row.size)
        se = np.sqrt(eps)
        a, b = max(rms, se), min(rms, se)
        out[i] = 1.0 / (a * np.sqrt(1.0 + (b / a) * (b / a)))
    return out


def test_emul_small_rows_follow_pn_fwds_tree():
    """float64 rows spread over 2^-30..2^30, where the order of the double sum shows in
    rstd's bits (a left-to-right sum differs for most rows): pn_fwd_small, in both forms
    (d=64: 16 lanes per row; d=128: WIDE, one warp), gives pn_fwd's bits."""
    rng = np.random.default_rng(12)
    for d in (64, 128):
        x = rng.standard_normal((65, d)) * np.exp2(rng.integers(-30, 31, (65, d)))
        plan = _plan(d, "float64", eps=1e-6)
        la = _small_vs_fwd(x, None, None, None, plan, f"spread d={d}")
        assert la.name.startswith("pn_fwd_small")
        _, _, rstd, _ = emul_forward(x, None, None, None, plan)
        differ = (rstd != _rstd_sequential_f64(x, 1e-6)).mean()
        assert differ > 0.2, f"d={d}: only {differ:.2f} of the rows tell the summation orders apart"


# ----------------------------------------------------------------------------- pn_bwd_small

#: BWD_OPTIONS keys of the pn_bwd_small sweep (plain in the default run, the rest slow)
SMALL_BWD_OPTS = ("plain", "no_weight", "bias_no_weight", "partial", "eps_outside", "rstd_given",
                  "grad_residual", "weight_f32", "dy_f32", "everything")


def _small_bwd_vs_bwd(dy, x, w, b, rstd, g, plan, tag, *, reference_too=True, **kw):
    """pn_bwd_small's dx bits equal pn_bwd's for the same rows; its dweight / dbias (over
    its own partial rows) and dx are close to the reference.  Returns the launch."""
    dx, _, _, la = emul_backward(dy, x, w, b, rstd, g, plan, **kw)
    ref = emul_backward(dy, x, w, b, rstd, g, plan, small=False, **kw)
    assert not ref[3].name.startswith("pn_bwd_small")
    np.testing.assert_array_equal(_bits(dx), _bits(ref[0]), err_msg=f"dx of {la.name} vs {ref[3].name}, {tag}")
    if reference_too:
        _check_backward(dy, x, w, b, rstd, g, plan, **kw)
    return la


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opt", SMALL_BWD_OPTS)
def test_emul_small_bwd_same_bits_as_pn_bwd(dtype, opt):
    """d <= 256 goes to pn_bwd_small; its dx bits equal pn_bwd's for the same rows, over
    every shape change of the lanes-per-row rule, odd n (a ragged last row group), a
    persistent grid smaller than the row groups (num_sms=1), the options, and misaligned
    rows (the element-by-element twin)."""
    rng = np.random.default_rng(_seed("small_bwd", dtype, opt))
    spec = BWD_OPTIONS[opt]
    ds = D_SMALLROWS if opt == "plain" else D_SMALLROWS[1::3]
    seen = set()
    for i, d in enumerate(ds):
        if int(d * spec.get("partial", 1.0)) < 1:
            continue
        num_sms = 1 if i % 4 == 0 else cl.DEFAULT_SMS
        shape = cl.small_bwd_shape(d, dtype)
        # num_sms=1: 4 blocks, each striding over two row groups or more
        n = 1 + int(rng.integers(1, 20)) * 2 + (8 * cl.SMALL_THREADS // shape[0] if num_sms == 1 and shape else 0)
        dy, x, w, b, rstd, g, plan = _bwd_case(rng, n, d, dtype, spec)
        la = _small_bwd_vs_bwd(dy, x, w, b, rstd, g, plan, f"d={d} n={n} num_sms={num_sms}", num_sms=num_sms)
        seen.add(la.name)
        if cl.takes_small_bwd(d, dtype, cl.backward_types(dtype, _name(dy), _name(g), _name(w)).dy):
            assert la.name.startswith("pn_bwd_small"), la.name
            if num_sms == 1:  # each block strides over several row groups
                assert la.grid * (la.block // la.tpr) < n
    dy, x, w, b, rstd, g, plan = _bwd_case(rng, 9, 129, dtype, spec)
    wide = np.concatenate([x, x[:, :3]], axis=1)[:, 1:130]  # rows not 16-byte aligned
    _small_bwd_vs_bwd(dy, wide, w, b, rstd, g, plan, "misaligned")
    assert any(nm.startswith("pn_bwd_small") for nm in seen) or opt == "dy_f32"


@pytest.mark.parametrize("x16", [False, True], ids=["wide", "float16"])  # float16 x: the slow run (tests/conftest.py)
def test_emul_small_bwd_extreme_values(x16):
    """The float runs' exact fallbacks (squares that overflow float32 or are tiny, g*dy*xhat
    that overflows), NaN/Inf and zero rows, eps 0, and float64 rows spread over 2^-30..2^30
    (where the order of the double sums shows in the bits): the same dx bits as pn_bwd."""
    rng = np.random.default_rng(21)
    for dtype, scale in (("float32", 1e25), ("float32", 1e-30), ("bfloat16", 1e30), ("float64", 1e200),
                         ("float64", 1e-200), ("float16", 1e4), ("float32", 1.0), ("float64", 1.0)):
        if (dtype == "float16") != x16:
            continue
        for d in (7, 64, 128, 200):
            dy, x, w, b, _, g, plan = _bwd_case(rng, 9, d, dtype, dict(bias=True, grad_residual=True))
            x = (x.astype(np.float64) * scale).astype(x.dtype)
            if scale == 1.0:  # spread magnitudes
                x = (x * np.exp2(rng.integers(-30, 31, x.shape))).astype(x.dtype)
            x[2] = 0
            x[3, d // 2] = np.inf
            x[4, ::3] *= 1e-3
            x[5, d - 1] = np.nan
            if dtype == "float32":
                dy[6] *= np.float32(1e30)
            for eps, mode in ((0.0, "inside"), (0.25, "outside")):
                plan = _plan(d, dtype, eps=eps, eps_mode=mode)
                for rstd in (None, reference.rstd(x, plan)):
                    _small_bwd_vs_bwd(dy, x, w, b, rstd, g, plan, f"{dtype} scale={scale} d={d} eps={eps} {mode}",
                                      reference_too=False)


# ----------------------------------------------------------------------------- pn_bwd at ITEMS=2

_ITEMS2_TYPES = (("bfloat16", "bfloat16", "bfloat16"), ("float32",) * 3, ("float64",) * 3)


@functools.cache
def _items2_module():
    names = [cl.bwd_name(*t, items, True, hg) for t in _ITEMS2_TYPES for items in (1, 2) for hg in (False, True)]
    return compile_source(cl.SOURCE_PATH, names)


@pytest.mark.parametrize("types", _ITEMS2_TYPES, ids=[t[0] for t in _ITEMS2_TYPES])
@pytest.mark.parametrize("d", [5, 100, 256, 1000, 1024])
def test_emul_backward_items2_sums_over_the_items1_tree(types, d):
    """pn_bwd's body at ITEMS=2 (instantiated here only: the dispatcher keeps ITEMS=1,
    as ITEMS=2 spills within 64 registers) gives the ITEMS=1 launch's dx and partial-row
    bits with half the threads per row and per block and the same rows per block and
    grid: its row sums follow the ITEMS=1 tree (in-lane level, warp sums, red[] order)."""
    x_t, dy_t, w_t = types
    ct = compute_dtype(x_t)
    rng = np.random.default_rng(_seed(types, d, 13))
    n = 45
    x = _data(rng, n, d, x_t)
    dy = _data(rng, n, d, dy_t)
    if x_t == "float32":
        x[3] *= np.float32(1e25)
        dy[4] *= np.float32(1e30)
    w = _data(rng, 1, d, w_t)[0]
    for hg in (False, True):
        g = _data(rng, n, d, dy_t) if hg else None
        one = cl.backward_launch(n, d, *types, num_sms=1, has_g=hg, small=False, rows=False)
        if one.big or one.block % 64:
            pytest.skip("no ITEMS=2 shape for this row")
        outs = []
        for items in (1, 2):
            dx = _garbage((n, d), x_t)
            dwp, dbp = _garbage((one.partial_rows, one.ldp), ct), _garbage((one.partial_rows, one.ldp), ct)
            args = (dy, _rs(dy), x, _rs(x), w, None, g, _rs(g), dx, _rs(dx), dwp, dbp, np.int64(one.ldp),
                    np.int64(n), np.int32(d), np.int32(d), np.int32(one.tpr // items),
                    np.float64(1e-6), np.int32(1), np.float64(0.5))  # fmt: skip
            _items2_module().launch(cl.bwd_name(*types, items, True, hg), one.grid, one.block // items, args,
                                    one.shared)
            outs.append((dx, dwp[:, :d], dbp[:, :d]))
        for what, a, b in zip(("dx", "dweight partials", "dbias partials"), *outs, strict=True):
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{what}, d={d}, grad_residual={hg}")


# ----------------------------------------------------------------------------- pn_fwd_split


def _split_d(dtype: str) -> int:
    """An odd d of three slices (the last one partial) with a tail: two full slices of
    pn_fwd_big's 1024-thread passes, 37 chunks more, then tail elements."""
    vec = cl.VEC[dtype]
    return 2 * cl.SLICE_MIN_PASSES * cl.BIG_THREADS * vec + 37 * vec + vec - 1


def test_split_launch_rule():
    """pn_fwd_split takes float-compute rows of two or more slices when there are fewer
    rows than SMs; its slices are a function of d alone and cover the row."""
    for dtype in DTYPES:
        vec = cl.VEC[dtype]
        for d in (4101, _split_d(dtype), 65536, 262144, 1 << 22):
            body, span, s = d // vec, cl.slice_span(d, dtype), cl.slice_count(d, dtype)
            assert span % cl.big_block(d, dtype) == 0 and s <= cl.SLICE_MAX
            assert (s - 1) * span < body <= s * span or (s == 1 and body <= span)
            for n in (1, 7, 131, 132, 4096):
                la = cl.forward_launch(n, d, dtype, num_sms=132)
                want = dtype != "float64" and n < 132 and s >= 2
                assert bool(la.slices) == want == cl.takes_split(n, d, dtype, dtype, 132), (dtype, d, n)
                if want:
                    assert la.slices == s and la.grid == n * s and la.block == cl.big_block(d, dtype)
                    assert la.name.endswith(", 1>") and la.name2.endswith(", 2>")
                    assert la.name in cl.specialisations() and la.name2 in cl.specialisations()
                else:
                    assert la.name2 == "" and (la.big or d <= 4101)
    # mixed pairs: a float32 h from 16-bit x takes it; a float64 residual does not
    assert cl.forward_launch(2, 65536, "bfloat16", "float32", "float32", "float32").slices == 4
    assert not cl.takes_split(2, 65536, "float32", "float64")


SPLIT_OPTS = ("plain", "residual_bias", "partial_outside", "llama_offset", "residual_f32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("opt", SPLIT_OPTS)
def test_emul_split_same_bits_as_big(dtype, opt):
    """A few rows at large d go to pn_fwd_split; y, h and rstd bits equal pn_fwd_big's for
    the same rows (so a token's bits do not depend on how many rows share the call),
    for aligned and misaligned rows, and y is close to the reference."""
    rng = np.random.default_rng(_seed("split", dtype, opt))
    d = _split_d(dtype)
    x, res, w, b, plan = _small_case(rng, 3, d, dtype, opt)
    if cl.forward_types(_name(x), _name(res), _name(w), plan.out_dtype, plan.llama) is None:
        pytest.skip("no kernel: the cupy backend runs the reference for this combination")
    wide = np.concatenate([x, x[:, :3]], axis=1)[:, 1 : d + 1]  # rows not 16-byte aligned
    for xs in (x, wide):
        got = emul_forward(xs, res, w, b, plan)
        big = emul_forward(xs, res, w, b, plan, split=False)
        assert got[3].slices == 3 and got[3].grid == 9 and big[3].big, (got[3], big[3])
        for a, r, what in zip(got[:3], big[:3], ("y", "h", "rstd"), strict=True):
            if a is not None:
                np.testing.assert_array_equal(_bits(a), _bits(r), err_msg=f"{what} of {got[3].name} {opt}")
        ry, _, rr = reference.forward(xs, res, w, b, plan)
        assert_close(got[0], ry, looser(plan.norm_dtype, plan.out_dtype), f"y of {got[3].name} {opt}")
        assert_close(got[2], rr, Tol(2e-6, 0.0), f"rstd of {got[3].name} {opt}")
    # the same token alone (split) and among more rows than SMs (pn_fwd_big): the same bits
    one = emul_forward(x[1:2], None if res is None else res[1:2], w, b, plan)
    many = emul_forward(x, res, w, b, plan, num_sms=2)
    assert one[3].slices and many[3].big
    np.testing.assert_array_equal(_bits(one[0][0]), _bits(many[0][1]))
    np.testing.assert_array_equal(_bits(one[2]), _bits(many[2][1:2]))


@pytest.mark.parametrize("x16", [False, True], ids=["wide", "float16"])  # float16 x: the slow run (tests/conftest.py)
def test_emul_split_extreme_values(x16):
    """NaN/Inf and zero rows stay in their row, float runs' exact fallback (squares that
    overflow float32 or are tiny), eps 0: pn_fwd_big's bits."""
    rng = np.random.default_rng(21)
    for dtype, scale in (("float32", 1e25), ("float32", 1e-30), ("bfloat16", 1e30), ("float16", 1e4)):
        if (dtype == "float16") != x16:
            continue
        d = _split_d(dtype)
        x = _data(rng, 4, d, dtype, scale)
        x[1] = 0
        x[2, d - 3] = np.inf
        x[3, ::3] *= 1e-3
        plan = _plan(d, dtype, eps=0.0)
        got = emul_forward(x, None, None, None, plan)
        big = emul_forward(x, None, None, None, plan, split=False)
        assert got[3].slices and big[3].big
        for a, r in zip(got[:3:2], big[:3:2], strict=True):
            np.testing.assert_array_equal(_bits(a), _bits(r), err_msg=f"{dtype} scale={scale}")
        y = got[0].astype(np.float64)
        assert np.isnan(y[1]).all() and np.isfinite(y[[0, 3]]).all()
        assert got[2][2] == 0 and np.isnan(y[2, d - 3]) and (np.delete(y[2], d - 3) == 0).all()


SPLIT_BWD_OPTS = ("plain", "no_weight", "bias", "partial", "eps_outside", "rstd_given", "grad_residual",
                  "weight_f32", "dy_f32", "everything")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("opt", SPLIT_BWD_OPTS)
def test_emul_bwd_split_same_bits_as_big(dtype, opt):
    """A few rows at large d go to pn_bwd_split: dx, dweight and dbias bits equal
    pn_bwd_big's (one block per row) for aligned and misaligned rows, its partial rows
    are written without a zero fill (the emulator hands it NaN bytes), and a token's dx
    alone equals its dx among more rows than SMs (pn_bwd_big's persistent grid)."""
    rng = np.random.default_rng(_seed("bsplit", dtype, opt))
    d = _split_d(dtype)
    dy, x, w, b, rstd, g, plan = _bwd_case(rng, 3, d, dtype, BWD_OPTIONS[opt])
    wide = np.concatenate([x, x[:, :5]], axis=1)[:, 3 : d + 3]  # rows not 16-byte aligned
    for xs in (x, wide):
        got = emul_backward(dy, xs, w, b, rstd, g, plan)
        big = emul_backward(dy, xs, w, b, rstd, g, plan, split=False)
        assert got[3].slices == 3 and got[3].grid == 9 and big[3].big and big[3].grid == 3, (got[3], big[3])
        for a, r, what in zip(got[:3], big[:3], ("dx", "dweight", "dbias"), strict=True):
            assert (a is None) == (r is None)
            if a is not None:
                np.testing.assert_array_equal(_bits(a), _bits(r), err_msg=f"{what} of {got[3].name} {opt}")
        _check_backward(dy, xs, w, b, rstd, g, plan)
    one = emul_backward(dy[1:2], x[1:2], w, b, None if rstd is None else rstd[1:2],
                        None if g is None else g[1:2], plan)  # fmt: skip
    many = emul_backward(dy, x, w, b, rstd, g, plan, num_sms=2)
    assert one[3].slices and many[3].big
    np.testing.assert_array_equal(_bits(one[0][0]), _bits(many[0][1]))
