"""polynorm/backends/cuda.py itself, end to end on the CPU: a stand-in ``cupy``
module whose arrays are numpy arrays and whose ``RawModule`` runs the
generated kernels in the emulator (tests/emulator).

test_emul_kernels.py checks the kernels launched the way the backend launches
them; this file runs the backend's own code -- dtype decisions, exact
pre-casts, stride and pointer arguments, output allocation, the partial-sum
buffers and pn_colsum, the reference fallback -- so that a slip in that glue
shows up without a GPU.  bfloat16 is not covered here (cupy has no bfloat16
dtype; bfloat16 reaches the backend only as torch/jax arrays).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import ml_dtypes
import numpy as np
import pytest
from _oracle import TOL, Tol, assert_close
from emulator import compile_source

from polynorm.backends import cuda as cupy_backend
from polynorm.backends import reference
from polynorm.backends.cuda import launch as cl
from polynorm.backends.cuda import nvrtc as _nvrtc
from polynorm.core.options import Options, make_plan

# ------------------------------------------------------------------ the stand-in cupy

_POINTERS: dict[int, list[np.ndarray]] = {}


class ndarray(np.ndarray):  # noqa: N801 - mimics cupy.ndarray
    """A numpy array that answers ``.data.ptr`` and ``.device`` as cupy's does."""

    @property
    def data(self):  # type: ignore[override]
        ptr = self.ctypes.data
        _POINTERS.setdefault(ptr, []).append(self)
        return types.SimpleNamespace(ptr=ptr)

    @property
    def device(self):  # type: ignore[override]
        return contextlib.nullcontext()


ndarray.__module__ = "cupy"  # what polynorm.core.interop dispatches on


def _fake(a: np.ndarray) -> ndarray:
    return a.view(ndarray)


_CODE_DTYPE = {"f2": np.float16, "f4": np.float32, "f8": np.float64, "bf16": ml_dtypes.bfloat16}


@functools.cache
def _library(family: str):
    """The same per-family libraries as test_emul_kernels.py (shared build cache)."""
    first = {v: k for k, v in cl.CTYPE.items()}

    def fam(n: str) -> str:
        return first[n.split("<", 1)[1].split(",")[0].strip(" >")]

    names = [n for n in cl.specialisations() if not n.startswith("pn_colsum") and fam(n) == family]
    names += [n for n in cl.specialisations() if n.startswith("pn_colsum")]
    return compile_source(cl.SOURCE_PATH, names)


class _Kernel:
    launches: list[tuple[str, int, int, int]] = []

    def __init__(self, name: str):
        self.name = name
        self.max_dynamic_shared_size_bytes = 48 * 1024
        first = name.split("<", 1)[1].split(",")[0].strip(" >")
        family = {v: k for k, v in cl.CTYPE.items()}[first]
        self.lib = _library("float32" if name.startswith("pn_colsum") else family)

    def __call__(self, grid, block, args, shared_mem=0):
        assert shared_mem <= max(48 * 1024, self.max_dynamic_shared_size_bytes)
        params = self.lib.signature(self.name)
        real = []
        for p, a in zip(params, args, strict=True):
            if p.pointer:
                assert isinstance(a, np.uint64), f"{self.name}: pointers go as numpy uint64"
                if int(a) == 0:
                    real.append(None)
                    continue
                arr = _POINTERS[int(a)][-1]
                want = _CODE_DTYPE.get(p.code)
                real.append(np.asarray(arr).view(want) if want is not None else np.asarray(arr))
            else:
                real.append(a)
        _Kernel.launches.append((self.name, grid[0], block[0], shared_mem))
        self.lib.launch(self.name, grid, block, tuple(real), shared_mem)


class _RawModule:
    """``RawModule(code=..., name_expressions=...)`` (CuPy compiles) or
    ``RawModule(path=...)`` (a cubin from polynorm.backends.cuda.nvrtc, stubbed below)."""

    def __init__(self, code=None, options=(), name_expressions=(), path=None):
        if path is not None:
            self.names = None
            self.path = path
        else:
            assert code == cl.source() and "-std=c++17" in options
            self.names = list(name_expressions)

    def get_function(self, name):
        if self.names is None:  # by mangled name, as the stubbed cached_cubin returned it
            expr = _STUB_CUBINS[self.path]
            assert name == f"mangled<{expr}>"
            return _Kernel(expr)
        assert name in self.names
        return _Kernel(name)


_STUB_CUBINS: dict[str, str] = {}


def _stub_cached_cubin(name: str, arch: str):
    assert arch == "sm_90"
    path = f"/nonexistent/{len(_STUB_CUBINS)}.cubin"
    _STUB_CUBINS[path] = name
    return path, f"mangled<{name}>"


def _garbage(shape, dtype) -> ndarray:
    """cupy.empty: all-ones bytes (NaN in every float format), so unwritten output shows."""
    a = np.empty(shape, dtype=dtype)
    a.view(np.uint8)[...] = 0xFF
    return _fake(a)


def _make_fake_cupy(sms: int, smem: int) -> types.ModuleType:
    m = types.ModuleType("cupy")
    m.ndarray = ndarray
    m.RawModule = _RawModule
    m.empty = _garbage
    m.zeros = lambda shape, dtype: _fake(np.zeros(shape, dtype=dtype))
    m.ascontiguousarray = lambda a: _fake(np.ascontiguousarray(a))
    m.from_dlpack = lambda t: _fake(np.from_dlpack(t))
    device = types.SimpleNamespace(
        id=0, compute_capability="90",
        attributes={"MultiProcessorCount": sms, "MaxSharedMemoryPerBlockOptin": smem})
    m.cuda = types.SimpleNamespace(
        Device=lambda *a: device,
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
        get_current_stream=contextlib.nullcontext,
        compiler=types.SimpleNamespace(CompileException=RuntimeError),
    )
    return m


@pytest.fixture(params=[(3, 227 * 1024, True), (2, 3000, False)], ids=["smem227k-nvrtc", "smem3k-cupycc"])
def fake_cupy(request, monkeypatch):
    """The stand-in cupy; kernels come from (stubbed) _nvrtc cubins or CuPy's compile."""
    sms, smem, use_nvrtc = request.param
    monkeypatch.setitem(sys.modules, "cupy", _make_fake_cupy(sms, smem))
    monkeypatch.setattr(_nvrtc, "available", lambda: (use_nvrtc, "stubbed"))
    monkeypatch.setattr(_nvrtc, "cached_cubin", _stub_cached_cubin)
    monkeypatch.setattr(cupy_backend, "_kernels", {})
    monkeypatch.setattr(cupy_backend, "_device_info", {})
    _POINTERS.clear()
    _Kernel.launches.clear()
    yield
    _POINTERS.clear()


# ------------------------------------------------------------------ tests


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _plan(d, x_dtype, **kw):
    o = dict(eps=1e-5, partial=1.0, offset=0.0, eps_mode="inside", casting="fp32", out_dtype=None)
    o.update(kw)
    return make_plan(d, x_dtype, Options(**o))


def _tol(dtype: str, factor: float = 4.0) -> Tol:
    t = TOL[dtype]
    return Tol(t.rtol * factor, t.atol * factor, t.floor)


def test_emul_cupy_available_and_accepts(fake_cupy):
    assert cupy_backend.available() == (True, "ok")
    assert cupy_backend.accepts(_fake(np.zeros(3)))
    assert not cupy_backend.accepts(np.zeros(3))


def test_emul_cupy_unavailable_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    ok, why = cupy_backend.available()
    assert not ok and "cupy is not installed" in why


FWD = [
    # x, residual, weight, bias, out_dtype, options
    ("float32", None, "float32", None, None, {}),
    ("float16", None, "float32", "float16", None, {"partial": 0.4}),
    ("float16", None, "float16", None, "float64", {"eps_mode": "outside", "offset": 1.0}),
    ("float64", "float64", "float64", "float64", None, {"casting": "llama"}),
    ("float16", "float32", "float32", None, None, {}),  # mixed pair with a kernel
    ("float32", "float16", "float16", None, None, {}),  # pair without one: cast to h first
    ("float16", "float16", "float64", None, "float32", {}),  # weight without a kernel: cast
    ("float16", None, "float64", None, None, {"casting": "llama"}),  # no kernel: reference
]


@pytest.mark.parametrize("d", [5, 300, 9000])
@pytest.mark.parametrize("case", FWD, ids=lambda c: "-".join(str(v) for v in c[:5]))
def test_emul_cupy_forward(fake_cupy, case, d):
    xd, rd, wd, bd, od, opts = case
    rng = np.random.default_rng(d)
    n = 6
    x = _rand(rng, (n, d), xd)
    r = None if rd is None else _rand(rng, (n, d), rd)
    w = None if wd is None else _rand(rng, d, wd)
    b = None if bd is None else _rand(rng, d, bd)
    h_dtype = xd if rd is None else np.promote_types(xd, rd).name
    plan = _plan(d, h_dtype, out_dtype=od, **opts)
    fx, fr, fw, fb = (None if a is None else _fake(a.copy()) for a in (x, r, w, b))
    y, h, rstd = cupy_backend.forward(fx, fr, fw, fb, plan)
    yr, hr, rr = reference.forward(x, r, w, b, plan)
    assert type(y) is ndarray and y.dtype == yr.dtype and rstd.dtype == rr.dtype
    # y is computed in the compute dtype: a wider out dtype cannot be more exact
    ydt = max((plan.out_dtype, plan.compute_dtype), key=lambda t: TOL[t].rtol)
    assert_close(np.asarray(y), yr, _tol(ydt))
    assert_close(np.asarray(rstd), rr, _tol(plan.compute_dtype))
    if r is not None:
        assert h.dtype == hr.dtype
        np.testing.assert_array_equal(np.asarray(h), hr)
    # inputs untouched
    np.testing.assert_array_equal(np.asarray(fx), x)
    expect_kernel = cl.forward_types(xd, rd, wd, plan.out_dtype, plan.llama) is not None
    assert bool(_Kernel.launches) == expect_kernel


@pytest.mark.parametrize("x16", ["bfloat16", "float16"])  # float16: the slow run (tests/conftest.py)
def test_emul_cupy_forward_strided_out_and_inplace(fake_cupy, x16):
    rng = np.random.default_rng(7)
    base = _rand(rng, (10, 70), x16)
    view = base[::-2, 3:67]  # negative row stride, unaligned start
    plan = _plan(64, x16)
    y, _, _ = cupy_backend.forward(_fake(base)[::-2, 3:67], None, None, None, plan)
    assert_close(np.asarray(y), reference.forward(np.ascontiguousarray(view), None, None, None, plan)[0],
                 _tol(x16))
    cols = _fake(base)[:, ::2]  # non-contiguous columns: copied
    y2, _, _ = cupy_backend.forward(cols, None, None, None, _plan(35, x16))
    assert_close(np.asarray(y2), reference.forward(base[:, ::2], None, None, None, _plan(35, x16))[0],
                 _tol(x16))
    x = _fake(base.copy())
    want = reference.forward(base, None, None, None, _plan(70, x16))[0]
    y3, _, _ = cupy_backend.forward(x, None, None, None, _plan(70, x16), out=x)
    assert y3 is x
    assert_close(np.asarray(x), want, _tol(x16))


BWD = [
    # x, dy, grad_residual, weight, bias, options, with rstd
    ("float32", "float32", None, "float32", "float32", {}, True),
    ("float16", "float16", "float16", "float32", None, {"partial": 0.5}, False),
    ("float16", "float32", None, "float16", "float16", {"eps_mode": "outside"}, True),
    ("float16", "float16", "float32", "float64", "float64", {"offset": 1.0}, False),
    ("float64", "float64", "float64", "float64", "float32", {"eps_mode": "outside", "partial": 0.3}, False),
    ("float32", "float16", None, None, None, {}, False),
]


@pytest.mark.parametrize("n,d", [(3, 7), (40, 96), (5, 9000)])
@pytest.mark.parametrize("case", BWD, ids=lambda c: "-".join(str(v) for v in c[:5]))
def test_emul_cupy_backward(fake_cupy, case, n, d):
    xd, dyd, gd, wd, bd, opts, with_rstd = case
    rng = np.random.default_rng(n * d)
    x, dy = _rand(rng, (n, d), xd), _rand(rng, (n, d), dyd)
    g = None if gd is None else _rand(rng, (n, d), gd)
    w = None if wd is None else _rand(rng, d, wd)
    b = None if bd is None else _rand(rng, d, bd)
    plan = _plan(d, xd, **opts)
    rstd = reference.forward(x, None, w, None, plan)[2] if with_rstd else None
    got = cupy_backend.backward(*(None if a is None else _fake(a.copy()) for a in (dy, x, w, b, rstd, g)),
                                plan)
    want = reference.backward(dy, x, w, b, rstd, g, plan)
    for a, e in zip(got, want, strict=True):
        if e is None:
            assert a is None
            continue
        assert a.dtype == e.dtype
        # the looser of the result dtype and the compute dtype; dweight/dbias
        # add n rows in another order than numpy's pairwise sum
        tdt = max((e.dtype.name, plan.compute_dtype), key=lambda t: TOL[t].rtol)
        tol = _tol(tdt, 4.0 * (n if a.ndim == 1 else 1))
        assert_close(np.asarray(a).astype(np.float64), np.asarray(e).astype(np.float64), tol)
    names = [name for name, *_ in _Kernel.launches]
    assert any(nm.startswith("pn_bwd") for nm in names)
    assert sum(nm.startswith("pn_colsum") for nm in names) == (w is not None) + (b is not None)


# ------------------------------------------------------------------ bfloat16 through torch


@pytest.mark.parametrize("d", [64, 20000])
def test_emul_cupy_torch_bfloat16(fake_cupy, monkeypatch, d):
    """torch bfloat16 tensors go to the kernels as they are (their data pointers and
    strides; torch allocates the results): no DLPack, no cupy arrays.

    CPU tensors stand in for CUDA ones: their pointers are registered with the
    stand-in (as numpy views of the same memory); the stream context, which
    needs CUDA, is replaced.
    """
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(cupy_backend, "_on_callers_stream", lambda x: contextlib.nullcontext())

    def torch_ptr(t):
        bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        return _fake(bits.detach().numpy()).data.ptr

    monkeypatch.setattr(cupy_backend, "_torch_ptr", torch_ptr)
    rng = np.random.default_rng(d)
    x = _rand(rng, (4, d), np.float32).astype(ml_dtypes.bfloat16)
    w = _rand(rng, d, np.float32)
    dy = _rand(rng, (4, d), np.float32).astype(ml_dtypes.bfloat16)

    def t(a):
        tt = torch.from_numpy(np.asarray(a, dtype=np.float32))
        return tt.to(torch.bfloat16) if a.dtype == ml_dtypes.bfloat16 else tt

    plan = _plan(d, "bfloat16", partial=0.5)
    y, _, rstd = cupy_backend.forward(t(x), None, t(w), None, plan)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    yr, _, rr = reference.forward(x, None, w, None, plan)
    assert_close(y.float().numpy(), yr.astype(np.float32), _tol("bfloat16"))
    assert_close(rstd.numpy(), rr, _tol("float32"))
    dx, dw, _ = cupy_backend.backward(t(dy), t(x), t(w), None, rstd, None, plan)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    dxr, dwr, _ = reference.backward(dy, x, w, None, rr, None, plan)
    assert_close(dx.float().numpy(), dxr.astype(np.float32), _tol("bfloat16"))
    assert_close(dw.numpy(), dwr, _tol("float32", 16))


def test_emul_cupy_recording_replays_the_same_kernels(fake_cupy):
    """``recording()``: the launches of a call, replayed with their buffers (the GPU
    bench's kernel-only time); a replay rewrites the same outputs."""
    rng = np.random.default_rng(11)
    x, r = (_fake(_rand(rng, (5, 40), np.float32)) for _ in range(2))
    w = _fake(_rand(rng, (40,), np.float32))
    plan = _plan(40, "float32")
    with cupy_backend.recording() as replay:
        y, h, rstd = cupy_backend.forward(x, r, w, None, plan)
    assert [la.name for la, _, _ in replay.launches if la is not None] == [
        cl.forward_launch(5, 40, "float32", "float32", "float32", "float32").name]
    want = (np.array(y), np.array(h), np.array(rstd))
    for a in (y, h, rstd):
        np.asarray(a)[...] = np.nan
    replay()
    for a, b in zip((y, h, rstd), want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert cupy_backend._recorded is None  # recording ended


@pytest.mark.parametrize("xd", ["float16", "float32"])
def test_emul_cupy_split_rows(fake_cupy, xd):
    """Fewer rows than SMs at large d: the backend launches both phases of pn_fwd_split
    and pn_bwd_split (their slice-sum buffers allocated by it, uninitialised: the fake
    cupy.empty fills NaN bytes), then pn_colsum over one partial row per row."""
    d = 2 * cl.SLICE_MIN_PASSES * cl.BIG_THREADS * cl.VEC[xd] + 3 * cl.VEC[xd] + 1
    rng = np.random.default_rng(d)
    x, r, dy = (_rand(rng, (1, d), xd) for _ in range(3))
    w, b = _rand(rng, d, xd), _rand(rng, d, xd)
    plan = _plan(d, xd, partial=0.7)
    y, h, rstd = cupy_backend.forward(*(_fake(a.copy()) for a in (x, r, w, b)), plan)
    yr, hr, rr = reference.forward(x, r, w, b, plan)
    assert_close(np.asarray(y), yr, _tol(xd))
    assert_close(np.asarray(rstd), rr, _tol(plan.compute_dtype))
    np.testing.assert_array_equal(np.asarray(h), hr)
    fwd = [nm for nm, *_ in _Kernel.launches]
    assert [nm.rsplit(",", 1)[1] for nm in fwd] == [" 1>", " 2>"] and all("pn_fwd_split" in nm for nm in fwd)
    assert {g for _, g, *_ in _Kernel.launches} == {cl.slice_count(d, xd)}
    _Kernel.launches.clear()
    got = cupy_backend.backward(*(_fake(a.copy()) for a in (dy, x, w, b)), None, None, plan)
    want = reference.backward(dy, x, w, b, None, None, plan)
    for a, e, what in zip(got, want, ("dx", "dweight", "dbias"), strict=True):
        assert_close(np.asarray(a).astype(np.float64), np.asarray(e).astype(np.float64), _tol(xd), what)
    names = [nm for nm, *_ in _Kernel.launches]
    assert names[:2] == [cl.bwd_split_name(xd, xd, xd, 1), cl.bwd_split_name(xd, xd, xd, 2)]
    assert sum(nm.startswith("pn_colsum") for nm in names) == 2


def test_emul_cupy_bfloat16_needs_a_cupy_that_has_it(fake_cupy, monkeypatch):
    """cupy < 14 has no bfloat16 dtype: asking for bfloat16 results of cupy arrays
    (``out_dtype="bfloat16"``) is a TypeError before any kernel, not int16 bits."""
    from polynorm.core.dtypes import namespace_dtype

    xp = types.SimpleNamespace(__name__="array_api_compat.cupy")
    like = _fake(np.zeros(3, np.float32))
    assert namespace_dtype(xp, "bfloat16", like) == ml_dtypes.bfloat16  # the stand-in has it
    cupy = sys.modules["cupy"]

    def empty(shape, dtype):
        if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):
            raise TypeError("Unsupported dtype bfloat16")
        return _garbage(shape, dtype)

    monkeypatch.setattr(cupy, "empty", empty)
    monkeypatch.setattr(cupy, "__version__", "13.6.0", raising=False)
    with pytest.raises(TypeError, match="cupy 13.6.0 has no bfloat16"):
        namespace_dtype(xp, "bfloat16", like)


@pytest.mark.parametrize("d", [300, 9000])  # the register kernel; the split / big kernels
@pytest.mark.parametrize("x16", ["bfloat16", "float16"])  # float16: the slow run (tests/conftest.py)
def test_emul_cupy_forward_into_writes_add_rms_norm_bits_over_the_inputs(fake_cupy, d, x16):
    """add_rms_norm_ on the GPU: h over the residual and y over x (both aliased in
    one launch) carry the bits of the allocating fused add, also where pass 2
    re-reads the row (pn_fwd_big / pn_fwd_split read h there, not the residual)."""
    rng = np.random.default_rng(d)
    n = 6
    for xd, rd in ((x16, x16), (x16, "float32")):
        x, r, w = _rand(rng, (n, d), xd), _rand(rng, (n, d), rd), _rand(rng, d, "float32")
        plan = _plan(d, np.promote_types(xd, rd).name)
        y, h, rstd = cupy_backend.forward(_fake(x.copy()), _fake(r.copy()), _fake(w), None, plan)
        xi, ri = _fake(x.copy()), _fake(r.copy())
        same = plan.out_dtype == xd  # y can go over x
        got = cupy_backend.forward_into(xi, ri, _fake(w), None, plan, xi if same else None, ri)
        assert got is not None and got[1] is ri and (not same or got[0] is xi)
        np.testing.assert_array_equal(np.asarray(ri), np.asarray(h))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(rstd))
        if same:
            np.testing.assert_array_equal(np.asarray(xi), np.asarray(y))
    # an h buffer of another dtype than the kernel's h: declined, the front end copies
    plan = _plan(8, "float32")
    f = _fake(np.ones((2, 8), np.float32))
    assert cupy_backend.forward_into(f, f, None, None, plan, None, _fake(np.ones((2, 8)))) is None


@pytest.mark.parametrize("x16", ["bfloat16", "float16"])  # float16: the slow run (tests/conftest.py)
def test_emul_cupy_per_head_rows_have_the_bits_of_contiguous_rows(fake_cupy, x16):
    """Per-head weights on the GPU: the front end (ops/norm.py forward_heads /
    backward_heads) hands each head's (T, D) rows to the backend as a strided view
    of x (T, H, D) with its weight row; the kernels take the row stride as it is
    and give the bits of the same rows copied out, dweight included."""
    rng = np.random.default_rng(11)
    t, heads, d = 5, 3, 64
    x = _rand(rng, (t, heads, d), x16)
    dy = _rand(rng, (t, heads, d), x16)
    w = _rand(rng, (heads, d), "float32")
    plan = _plan(d, x16)
    fx = _fake(x.copy())
    for j in range(heads):
        y, _, rstd = cupy_backend.forward(fx[:, j, :], None, _fake(w[j].copy()), None, plan)
        yc, _, rc = cupy_backend.forward(_fake(np.ascontiguousarray(x[:, j, :])), None,
                                         _fake(w[j].copy()), None, plan)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(yc))
        np.testing.assert_array_equal(np.asarray(rstd), np.asarray(rc))
        dx, dw, _ = cupy_backend.backward(_fake(dy.copy())[:, j, :], fx[:, j, :],
                                          _fake(w[j].copy()), None, None, None, plan)
        dxc, dwc, _ = cupy_backend.backward(_fake(np.ascontiguousarray(dy[:, j, :])),
                                            _fake(np.ascontiguousarray(x[:, j, :])),
                                            _fake(w[j].copy()), None, None, None, plan)
        np.testing.assert_array_equal(np.asarray(dx), np.asarray(dxc))
        np.testing.assert_array_equal(np.asarray(dw), np.asarray(dwc))
    np.testing.assert_array_equal(np.asarray(fx), x)  # x untouched
