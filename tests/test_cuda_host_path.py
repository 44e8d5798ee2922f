"""The torch-CUDA host path (polynorm.backends.cuda.hostpath, kept by polynorm.ops.fast_cuda):
its launch records launch what the cupy backend's own calls launch, a repeated call
does no planning, and nothing on it synchronizes with the device.

Without a GPU: CPU tensors stand in for CUDA ones (the device test is patched), the
backend's kernels are stand-ins that record their launches instead of running, and
the records' driver launch is a stand-in that records its step.  The kernels' bits
are the emulator's business (test_emul_cupy_backend.py); tests/test_cupy_gpu.py and
bench/gpu_check.sh run the real thing, CUDA graph capture included.
"""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

import polynorm as pn
from polynorm.backends import cuda as cupy_backend
from polynorm.backends.cuda import hostpath
from polynorm.backends.cuda import launch as cl
from polynorm.ops import fast_cuda as _fast_cuda

torch = pytest.importorskip("torch")

NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
         torch.float64: "float64"}


class _Kernel:
    """A stand-in kernel: records the backend's own launches (name, grid, block, shared, args)."""

    def __init__(self, name, log):
        self.name, self.log, self.ptr = name, log, 1000 + len(name)
        self.max_dynamic_shared_size_bytes = 48 * 1024

    def __call__(self, grid, block, args, shared_mem=0):
        self.log.append((self.name, grid[0], block[0], shared_mem, tuple(args)))


@pytest.fixture
def stand_in(monkeypatch):
    """CPU tensors as CUDA ones; both paths' launches recorded, nothing run."""
    old, new = [], []
    rec_of = {}
    monkeypatch.setattr(_fast_cuda, "_STATE", [torch, NAMES, (torch.Tensor, torch.nn.Parameter),
                                               cupy_backend])
    monkeypatch.setattr(_fast_cuda, "_on_device", lambda x: True)
    monkeypatch.setattr(_fast_cuda, "_current_device", lambda t: -1)  # CPU tensors' get_device()
    monkeypatch.setattr(_fast_cuda, "_stream", lambda t, dev: 7)
    monkeypatch.setattr(_fast_cuda, "_RECORDS", {})
    monkeypatch.setattr(_fast_cuda, "_HOSTPATH", [hostpath])
    monkeypatch.setattr(cupy_backend, "_on_callers_stream", lambda x: contextlib.nullcontext())
    monkeypatch.setattr(cupy_backend, "_device", lambda: (132, 227 * 1024))
    monkeypatch.setattr(cupy_backend, "_device_name", lambda: "stand-in")
    monkeypatch.setattr(cupy_backend, "_kernel", lambda launch: _Kernel(launch.name, old))

    def go(fn, grid, block, shared, stream, params):
        assert stream == 7
        new.append((fn, grid, block, shared, params))

    monkeypatch.setattr(hostpath, "_LAUNCHER", [go, None, lambda ptr: ("handle", ptr)])
    return types.SimpleNamespace(old=old, new=new, rec_of=rec_of)


def _roles(log, known):
    """Launches with each pointer argument named: a known tensor's role, else scratch#k."""
    names = {t.data_ptr(): r for r, t in known.items() if t is not None}
    scratch: dict[int, str] = {}
    out = []
    for name, grid, block, shared, args in log:
        named = []
        for a in args:
            if isinstance(a, np.uint64):
                p = int(a)
                named.append("null" if p == 0 else names.get(p) or scratch.setdefault(p, f"scratch{len(scratch)}"))
            else:
                named.append((type(a).__name__, a.item()))
        out.append((name, grid, block, shared, tuple(named)))
    return out


def _new_log(s):
    """The record's launches of the last call (name, grid, block, shared, args)."""
    recs = [r for r in _fast_cuda._RECORDS.values() if r]
    assert len(recs) == 1
    rec = recs[0]
    assert len(s.new) == len(rec.steps)
    return [(rec.names[i], g, b, sh, rec.args(i)) for i, (_, g, b, sh, _) in enumerate(s.new)]


def _t(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


FWD = [
    # shape, x dtype, residual dtype, weight dtype, bias dtype, options
    ((4, 3, 256), torch.bfloat16, None, torch.bfloat16, None, {}),
    ((5, 1024), torch.bfloat16, torch.bfloat16, torch.float32, None, {"eps": 1e-5}),
    ((8, 96), torch.float16, None, None, torch.float32, {"partial": 0.5, "offset": 1.0}),
    ((3, 4096), torch.float32, torch.float32, torch.float32, torch.float32, {"eps_mode": "outside"}),
    ((2, 262144), torch.bfloat16, None, torch.bfloat16, None, {}),  # pn_fwd_split: two launches
    ((6, 40), torch.float64, None, torch.float64, None, {"casting": "llama"}),
    ((5, 300), torch.float32, torch.float32, None, None, {"strided": True}),  # rows 512 apart
]


@pytest.mark.parametrize("case", FWD, ids=lambda c: f"{c[0]}-{NAMES[c[1]]}-{c[2] is not None}")
def test_record_launches_what_the_backend_launches(stand_in, case):
    """(a) the record's kernels, grids, blocks, shared memory and arguments (pointers by
    role) are those of the backend's own call, first call and repeated call alike."""
    shape, xd, rd, wd, bd, kw = case
    kw = dict(kw)
    d = shape[-1]
    x, w = _t(shape, xd, 1), (None if wd is None else _t(d, wd, 2))
    b = None if bd is None else _t(d, bd, 3)
    r = None if rd is None else _t(shape, rd, 4)
    if kw.pop("strided", False):
        x, r = (_t((shape[0], 512), xd, 5)[:, 7:7 + d], _t((shape[0], 640), rd, 6)[:, :d])
    call = (lambda: pn.rms_norm(x, w, b, backend="cupy", return_rstd=True, **kw)) if r is None else (
        lambda: pn.add_rms_norm(x, r, w, b, backend="cupy", return_rstd=True, **kw))

    monkey_hp = _fast_cuda._HOSTPATH[:]
    _fast_cuda._HOSTPATH[:] = [None]  # the backend's own call
    got_old = call()
    _fast_cuda._HOSTPATH[:] = monkey_hp
    _fast_cuda._RECORDS.clear()  # it kept "no record" for such calls
    outs = ("y", "h", "rstd") if r is not None else ("y", "rstd")
    want = _roles(stand_in.old, {"x": x, "res": r, "w": w, "b": b, **dict(zip(outs, got_old, strict=True))})
    assert want and not stand_in.new
    for _ in range(2):
        stand_in.new.clear()
        stand_in.old.clear()
        got = call()
        assert not stand_in.old, "the record launched through the backend"
        for g, o in zip(got, got_old, strict=True):
            assert g.shape == o.shape and g.dtype == o.dtype and g.data_ptr() != o.data_ptr()
        have = _roles(_new_log(stand_in), {"x": x, "res": r, "w": w, "b": b, **dict(zip(outs, got, strict=True))})
        assert have == want


BWD = [
    # shape, x dtype, dy dtype, weight, bias, with rstd, grad_residual
    ((4, 3, 256), torch.bfloat16, torch.bfloat16, torch.bfloat16, None, True, False),
    ((5, 1024), torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, False, True),
    ((200, 8192), torch.bfloat16, torch.bfloat16, torch.bfloat16, None, True, False),  # pn_bwd_big
    ((2, 262144), torch.float32, torch.float32, torch.float32, None, True, False),  # pn_bwd_split
    ((7, 64), torch.float32, torch.float32, None, None, False, False),
]


@pytest.mark.parametrize("case", BWD, ids=lambda c: f"{c[0]}-{NAMES[c[1]]}")
def test_backward_record_launches_what_the_backend_launches(stand_in, case):
    shape, xd, dyd, wd, bd, with_rstd, with_g = case
    d = shape[-1]
    x, dy = _t(shape, xd, 1), _t(shape, dyd, 2)
    w = None if wd is None else _t(d, wd, 3)
    b = None if bd is None else _t(d, bd, 4)
    rstd = torch.rand(shape[:-1], dtype=torch.float32) + 0.5 if with_rstd else None
    g = _t(shape, dyd, 5) if with_g else None

    def call():
        return pn.rms_norm_backward(dy, x, w, b, rstd=rstd, grad_residual=g, backend="cupy")

    _fast_cuda._HOSTPATH[:] = [None]
    got_old = call()
    _fast_cuda._HOSTPATH[:] = [hostpath]
    _fast_cuda._RECORDS.clear()
    known = {"dy": dy, "x": x, "w": w, "rstd": rstd, "g": g}
    want = _roles(stand_in.old, {**known, "dx": got_old[0], "dw": got_old[1], "db": got_old[2]})
    assert want
    for _ in range(2):
        stand_in.new.clear()
        stand_in.old.clear()
        got = call()
        assert not stand_in.old
        for a, o in zip(got, got_old, strict=True):
            assert (a is None) == (o is None)
            if a is not None:
                assert a.shape == o.shape and a.dtype == o.dtype
        have = _roles(_new_log(stand_in), {**known, "dx": got[0], "dw": got[1], "db": got[2]})
        assert have == want


def test_repeated_call_does_no_planning(stand_in, monkeypatch):
    """(b) the second call of a kind makes no plan, no launch rule, no record."""
    counts: dict[str, int] = {}

    def counting(mod, name):
        f = getattr(mod, name)

        def wrapped(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return f(*a, **k)

        monkeypatch.setattr(mod, name, wrapped)

    from polynorm.ops import fast as _fast

    for mod, name in ((_fast_cuda, "_plan"), (_fast, "make_plan"), (cl, "forward_launch"), (cl, "backward_launch"),
                      (cl, "forward_types"), (cl, "backward_types"), (hostpath, "forward_record"),
                      (hostpath, "backward_record"), (cupy_backend, "_forward_launch_args")):
        counting(mod, name)
    x, r, dy = _t((6, 512), torch.bfloat16, 1), _t((6, 512), torch.bfloat16, 2), _t((6, 512), torch.bfloat16, 3)
    w = torch.nn.Parameter(_t(512, torch.float32, 4))
    calls = [lambda: pn.rms_norm(x, w, backend="cupy", eps=1e-5),
             lambda: pn.add_rms_norm(x, r, w, backend="cupy", eps=1e-5),
             lambda: pn.rms_norm_backward(dy, x, w, backend="cupy", eps=1e-5)]
    for c in calls:
        c()
    first = dict(counts)
    assert first["_plan"] == first["make_plan"] == 3
    assert first["forward_launch"] == 2 and first["backward_launch"] == 1
    stand_in.new.clear()
    for c in calls:
        c()
    assert counts == first
    assert len(stand_in.new) == 1 + 1 + 2  # fwd, add, bwd + pn_colsum


def test_nothing_on_the_record_path_synchronizes(stand_in, monkeypatch):
    """(c) a repeated call touches no sync-like call, no cupy and no backend code (which
    could allocate outside torch's allocator under a CUDA graph capture)."""
    x, dy = _t((4, 2048), torch.bfloat16, 1), _t((4, 2048), torch.bfloat16, 2)
    w = _t(2048, torch.bfloat16, 3)
    y, rstd = pn.rms_norm(x, w, backend="cupy", return_rstd=True)
    pn.rms_norm_backward(dy, x, w, rstd=rstd, backend="cupy")

    def refuse(*a, **k):
        raise AssertionError("a sync-like or backend call on the host path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "synchronize"):
        monkeypatch.setattr(torch.Tensor, name, refuse, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda, "current_stream", refuse)
    for name in ("_kernel", "_device", "_device_name", "_on_callers_stream", "_launch", "forward",
                 "backward"):
        monkeypatch.setattr(cupy_backend, name, refuse)
    stand_in.new.clear()
    y2, rstd2 = pn.rms_norm(x, w, backend="cupy", return_rstd=True)
    pn.rms_norm_backward(dy, x, w, rstd=rstd2, backend="cupy")
    assert len(stand_in.new) == 3 and y2.shape == y.shape


def test_other_calls_get_their_own_record_or_none(stand_in):
    """A call differing in anything checked (options, a stride, a dtype, a bool for an
    int) does not take another call's record; calls needing casts get none."""
    x = _t((4, 64), torch.float32, 1)
    w = _t(64, torch.float32, 2)
    pn.rms_norm(x, w, backend="cupy", eps=1e-5)
    pn.rms_norm(x, w, backend="cupy", eps=1e-6)
    pn.rms_norm(x[:, :32], w[:32], backend="cupy")  # row stride 64
    assert sum(1 for r in _fast_cuda._RECORDS.values() if r) == 3
    with pytest.raises(TypeError):
        pn.rms_norm(x, w, backend="cupy", partial=True)  # make_plan's error, not a record
    stand_in.old.clear()
    # a float16 weight of float32 x is cast first: the backend's own call each time
    wh = w.to(torch.float16)
    for _ in range(2):
        pn.rms_norm(x, wh, backend="cupy")
    assert len(stand_in.old) == 2
    assert sum(1 for r in _fast_cuda._RECORDS.values() if r is False) == 1


def test_another_current_device_takes_the_backends_call(stand_in, monkeypatch):
    x, w = _t((4, 64), torch.float32, 1), _t(64, torch.float32, 2)
    pn.rms_norm(x, w, backend="cupy")
    monkeypatch.setattr(_fast_cuda, "_current_device", lambda t: 3)
    stand_in.old.clear()
    stand_in.new.clear()
    pn.rms_norm(x, w, backend="cupy")
    assert len(stand_in.old) == 1 and not stand_in.new


def test_forward_into_takes_the_fused_add_tuning(stand_in, monkeypatch):
    """forward_into (add_rms_norm_) picks its launch as forward's fused add does: the
    tuning table's fused-add entries of this device."""
    seen = []
    real = cl.forward_launch

    def spy(*a, **k):
        seen.append((k.get("has_res"), k.get("device")))
        return real(*a, **k)

    monkeypatch.setattr(cl, "forward_launch", spy)
    x, r = _t((4, 512), torch.float32, 1), _t((4, 512), torch.float32, 2)
    plan = pn.core.options.make_plan(512, "float32", pn.core.options.Options())
    cupy_backend.forward_into(x, r, None, None, plan, None, r)
    cupy_backend.forward(x, r, None, None, plan)
    assert seen == [(True, "stand-in"), (True, "stand-in")]


def test_save_output_does_not_read_a_cuda_weight(monkeypatch):
    """save="output" keeps y without reading a CUDA weight (the read waits for the device);
    a CPU weight is still read."""
    from polynorm.ops import lean as _lean
    from polynorm.torch import norm as tnorm

    read = []
    monkeypatch.setattr(_lean, "recoverable", lambda *a: read.append(1) or True)
    opts = pn.core.options.Options()
    saved = {}
    ctx = types.SimpleNamespace(save_for_backward=lambda *a: saved.setdefault("t", a))
    x, y, rstd = torch.ones(2, 4), torch.zeros(2, 4), torch.ones(2)
    cuda_w = types.SimpleNamespace(is_cuda=True)
    tnorm._keep(ctx, x, y, cuda_w, None, rstd, opts, "output", True)
    assert ctx.lean and saved["t"][0] is y and not read
    tnorm._keep(ctx, x, y, torch.ones(4), None, rstd, opts, "output", True)
    assert ctx.lean and read == [1]


def test_recording_sees_the_launches(stand_in, monkeypatch):
    """While ``cuda.recording()`` runs (the GPU bench's kernel-only replays) calls take the
    backend's launches, which it records, not the record's."""
    import sys

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: None)))
    x, w = _t((4, 64), torch.float32, 1), _t(64, torch.float32, 2)
    pn.rms_norm(x, w, backend="cupy")
    stand_in.new.clear()
    with cupy_backend.recording() as replay:
        pn.rms_norm(x, w, backend="cupy")
    assert [la.name for la, _, _ in replay.launches if la is not None] == [stand_in.old[-1][0]]
    assert not stand_in.new


def test_a_refused_launch_takes_the_backends_call(stand_in, monkeypatch):
    """A driver refusal: the backend's own call runs it; a thread without a current context
    keeps the records, any other refusal turns them off with a warning."""
    x, w = _t((4, 64), torch.float32, 1), _t(64, torch.float32, 2)
    pn.rms_norm(x, w, backend="cupy")

    def refuse(code):
        def go(*a):
            raise hostpath.LaunchError(code, "stand-in")
        return go

    hostpath._LAUNCHER[0] = refuse(hostpath.INVALID_CONTEXT)
    stand_in.old.clear()
    pn.rms_norm(x, w, backend="cupy")
    assert len(stand_in.old) == 1 and any(_fast_cuda._RECORDS.values())
    hostpath._LAUNCHER[0] = refuse(700)
    with pytest.warns(RuntimeWarning, match="cuLaunchKernel failed"):
        pn.rms_norm(x, w, backend="cupy")
    assert len(stand_in.old) == 2 and _fast_cuda._HOSTPATH == [None]
    pn.rms_norm(x, w, backend="cupy")
    assert len(stand_in.old) == 3
