"""CuPy backend: the generated CUDA kernels of ``polynorm/backends/cuda`` on CUDA arrays.

Takes cupy arrays and torch/jax arrays in CUDA memory, with no host round
trip.  The row kernels (forward, fused add, backward) take torch tensors as
they are -- data pointer and strides, results from torch's allocator -- since
on small shapes a call's time is its host glue; jax arrays and the fusions go
through DLPack (bfloat16 as an int16 view where cupy has no bfloat16).
Kernels run on the caller's current stream: torch's current stream for torch
tensors, cupy's current stream otherwise.

Which kernel, grid, block and shared memory: :mod:`polynorm.backends.cuda.launch`.
Each kernel instantiation is compiled on first use by NVRTC
(:mod:`polynorm.backends.cuda.nvrtc`: IEEE float32 arithmetic, cubins cached on
disk) and loaded with ``cupy.RawModule(path=...)``; without ``cuda-bindings``
CuPy compiles it instead (``RawModule(code=..., name_expressions=...)``), which
flushes float32 subnormals to zero.

Dtype combinations without a kernel are first cast exactly (see
``cuda.launch``); ``casting="llama"`` with a weight dtype that has no kernel
runs the array-API reference on the same device instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import numpy as np

from polynorm.backends.cuda import launch as cl
from polynorm.core import interop as _interop
from polynorm.core.dtypes import dtype_name, namespace_dtype
from polynorm.core.options import Plan, compute_dtype, promote

name = "cupy"

_NP_STORAGE = {"float16": np.float16, "bfloat16": np.int16, "float32": np.float32, "float64": np.float64,
               "uint8": np.uint8}


def available() -> tuple[bool, str]:
    """Usable when cupy imports and sees at least one CUDA device."""
    try:
        import cupy
    except ImportError as exc:
        return False, f"cupy is not installed ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver
        return False, f"no usable CUDA driver/GPU ({type(exc).__name__}: {exc})"
    if count < 1:
        return False, "no CUDA GPU found"
    return True, "ok"


def accepts(x: Any) -> bool:
    """CUDA arrays only: cupy, and torch/jax arrays in CUDA memory."""
    return _interop.is_cuda_array(x)


# ------------------------------------------------------------------ kernels

_kernels: dict[tuple[int, str], Any] = {}
_device_info: dict[int, tuple[int, int]] = {}


def _kernel(launch: cl.Launch):
    import cupy

    dev = cupy.cuda.Device()
    key = (dev.id, launch.name)
    kern = _kernels.get(key)
    if kern is None:
        kern = _load(launch.name, f"sm_{dev.compute_capability}")
        _kernels[key] = kern
    if launch.shared > 48 * 1024 and kern.max_dynamic_shared_size_bytes < launch.shared:
        kern.max_dynamic_shared_size_bytes = launch.shared
    return kern


#: (arch, name expression) -> how its kernel was built: "nvrtc-cubin", or
#: "cupy-fallback ...: <why the cubin was not used>" (recorded by the GPU bench)
compile_paths: dict[tuple[str, str], str] = {}


def _load(name: str, arch: str):
    """The kernel for one name expression: our NVRTC cubin (IEEE float32), else
    CuPy's own compile (which flushes float32 subnormals to zero)."""
    import cupy

    from polynorm.backends.cuda import nvrtc as _nvrtc

    ok, why = _nvrtc.available()
    if ok:
        try:
            path, lowered = _nvrtc.cached_cubin(name, arch)
            fn = cupy.RawModule(path=str(path)).get_function(lowered)
            compile_paths[(arch, name)] = "nvrtc-cubin"
            return fn
        except Exception as exc:  # a device newer than this NVRTC, a driver older than its cubins:
            why = f"{type(exc).__name__}: {exc}"  # let CuPy compile instead, and say so
    compile_paths[(arch, name)] = f"cupy-fallback (-ftz=true): {why}"
    if ok:  # NVRTC is installed but its cubin failed here: not silently
        warnings.warn(f"polynorm: {name} for {arch} compiled by CuPy, whose -ftz=true flushes float32 "
                      f"subnormals to zero, because the NVRTC cubin could not be used: {why}",
                      RuntimeWarning, stacklevel=3)
    options = (*cl.NVRTC_OPTIONS, *(f"-I{d}" for d in cl.include_dirs()))
    try:
        return cupy.RawModule(code=cl.source(), options=options, name_expressions=[name]).get_function(name)
    except cupy.cuda.compiler.CompileException as exc:
        hint = "" if cl.include_dirs() else (
            " (cuda_fp16.h/cuda_bf16.h not found: pip install nvidia-cuda-runtime-cu12)")
        raise RuntimeError(f"polynorm: compiling {name} failed{hint}: {exc}") from exc


def _device() -> tuple[int, int]:
    """(multiprocessor count, opt-in shared memory per block) of the current device."""
    import cupy

    dev = cupy.cuda.Device()
    info = _device_info.get(dev.id)
    if info is None:
        attrs = dev.attributes
        info = (int(attrs["MultiProcessorCount"]), int(attrs["MaxSharedMemoryPerBlockOptin"]))
        _device_info[dev.id] = info
    return info


_device_names: dict[int, str] = {}


def _device_name() -> str:
    """The current device's name (the key of its tuning table, ``cuda/tuning/<name>.json``)."""
    import cupy

    dev = cupy.cuda.Device()
    name = _device_names.get(dev.id)
    if name is None:
        try:
            name = str(cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode())
        except Exception:  # a stand-in cupy without properties: no table, the rules
            name = ""
        _device_names[dev.id] = name
    return name


def _launch(launch: cl.Launch, args: tuple) -> None:
    if _recorded is not None:
        import cupy

        _recorded.append((launch, args, cupy.cuda.get_current_stream()))
    _kernel(launch)((launch.grid,), (launch.block,), args, shared_mem=launch.shared)


#: while :func:`recording` runs: every launch (with its stream) and every buffer the
#: backend allocated, which the launches' pointers refer to
_recorded: list | None = None


@contextlib.contextmanager
def recording():
    """Record the kernels that the calls inside launch; yields a function that
    launches exactly them again, with the same arguments and buffers.

    For timing the kernels alone, without the host's work (planning, casts,
    allocation, DLPack): ``pn.rms_norm`` of a small row costs more on the host
    than on the GPU.  The caller keeps the inputs alive; the recorded buffers
    (outputs and scratch) are kept by the replay function.  Not thread-safe.
    """
    global _recorded
    launches: list = []
    _recorded = launches
    try:
        def replay() -> None:
            for launch, args, stream in launches:
                if launch is None:
                    continue
                with stream:
                    _kernel(launch)((launch.grid,), (launch.block,), args,
                                    shared_mem=launch.shared)

        replay.launches = launches  # type: ignore[attr-defined]
        yield replay
    finally:
        _recorded = None


#: (device, raw stream pointer) -> cupy's wrapper of that torch stream (made once: a
#: wrapper costs ~1.5 us and, in cupy >= 14, a DeprecationWarning each time)
_streams: dict[tuple[int, int], Any] = {}


def _torch_stream(torch: Any, dev: int) -> Any:
    import cupy

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~0.3 us against ~5 us
    ptr = raw(dev) if raw is not None else torch.cuda.current_stream(dev).cuda_stream
    stream = _streams.get((dev, ptr))
    if stream is None:
        if len(_streams) > 64:  # streams come and go: keep the table small
            _streams.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = _streams[(dev, ptr)] = cupy.cuda.ExternalStream(ptr, dev)
    return stream


@contextlib.contextmanager
def _on_callers_stream(x: Any):
    """The device of ``x`` and its library's current stream, for the whole call."""
    import cupy

    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        import torch

        dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
        with cupy.cuda.Device(dev), _torch_stream(torch, dev):
            yield
        return
    if mod == "cupy":
        with x.device:
            yield
        return
    dev = next(iter(x.devices())).id  # jax
    with cupy.cuda.Device(dev):
        yield


# ------------------------------------------------------------------ array helpers


def _name(a: Any) -> str | None:
    return None if a is None else dtype_name(a.dtype)


def _cast(a: Any, dtype: str) -> Any:
    """``a`` cast to ``dtype`` in its own library (on its device)."""
    if a is None or _name(a) == dtype:
        return a
    from array_api_compat import array_namespace

    xp = array_namespace(a)
    return xp.astype(a, namespace_dtype(xp, dtype, a))


def _view(a: Any) -> Any:
    """cupy view with contiguous last axis (copying only when it is not)."""
    c = _interop.to_cupy(a)
    if c is None:
        return None
    if c.ndim == 2 and c.shape[1] > 1 and c.strides[1] != c.itemsize:
        import cupy

        c = cupy.ascontiguousarray(c)
    elif c.ndim == 1 and c.shape[0] > 1 and c.strides[0] != c.itemsize:
        import cupy

        c = cupy.ascontiguousarray(c)
    return c


def _is_torch(a: Any) -> bool:
    return type(a).__module__.split(".", 1)[0] == "torch"


def _dev(a: Any) -> Any:
    """A buffer the kernels can take: a torch CUDA tensor as it is (its pointer and
    strides are read directly, no DLPack: a call's host time is mostly such glue),
    anything else as a cupy view (:func:`_view`); the last axis made contiguous."""
    if a is None or not _is_torch(a):
        return _view(a)
    return a.contiguous() if a.shape[-1] > 1 and a.stride(-1) != 1 else a


def _torch_ptr(t: Any) -> int:
    return t.data_ptr()


def _ptr(c: Any) -> np.uint64:
    if c is None:
        return np.uint64(0)
    return np.uint64(_torch_ptr(c) if _is_torch(c) else c.data.ptr)


def _rs(c: Any) -> np.int64:
    """Row stride in elements (0 for absent arrays)."""
    if c is None:
        return np.int64(0)
    return np.int64(c.stride(0) if _is_torch(c) else c.strides[0] // c.itemsize)


def _col_stride(c: Any) -> int:
    return c.stride(1) if _is_torch(c) else c.strides[1] // c.itemsize


_TORCH_DTYPES: dict[str, Any] = {}


def _empty(shape: tuple[int, ...], dtype: str, zero: bool = False, like: Any = None):
    """A new device array; a torch tensor on ``like``'s device when ``like`` is one
    (torch's allocator, on its current stream), else a cupy array."""
    if like is not None and _is_torch(like):
        import torch

        if not _TORCH_DTYPES:
            _TORCH_DTYPES.update({k: getattr(torch, k) for k in _NP_STORAGE})
        a = (torch.zeros if zero else torch.empty)(shape, dtype=_TORCH_DTYPES[dtype], device=like.device)
    else:
        import cupy

        a = (cupy.zeros if zero else cupy.empty)(shape, dtype=_NP_STORAGE[dtype])
    if _recorded is not None:
        _recorded.append((None, a, None))  # kept alive for the replay; not a launch
    return a


# ------------------------------------------------------------------ the contract


def forward(x, residual, weight, bias, plan: Plan, out=None):
    """Forward on 2-D rows (see :mod:`polynorm.backends.reference`)."""
    if plan.cast_none:
        return none_forward(x, residual, weight, bias, plan, out)
    types = cl.forward_types(_name(x), _name(residual), _name(weight), plan.out_dtype, plan.llama)
    if types is None:  # llama casting with a weight dtype that has no kernel
        from polynorm.backends import reference

        return reference.forward(x, residual, weight, bias, plan, out)
    ct = compute_dtype(types.h)
    with _on_callers_stream(x):
        xk = _cast(x, types.x)
        rk = _cast(residual, types.res)
        wk = _cast(weight, types.weight)
        bk = _cast(bias, ct)
        xc, resc, wc, bc = _dev(xk), _dev(rk), _dev(wk), _dev(bk)
        n, d = xc.shape
        yc = None
        direct = out is not None and types.out == plan.out_dtype
        if direct:
            yc = out if _is_torch(out) else _interop.to_cupy(out)
            if yc.shape[1] > 1 and _col_stride(yc) != 1:
                yc, direct = None, False
        if yc is None:
            yc = _empty((n, d), types.out, like=x)
        hc = _empty((n, d), types.h, like=x) if resc is not None else None
        rstd = _empty((n,), ct, like=x)
        ptr = {"x": _ptr(xc), "res": _ptr(resc), "h": _ptr(hc), "w": _ptr(wc), "b": _ptr(bc),
               "y": _ptr(yc), "rstd": _ptr(rstd)}
        rs = {"x": _rs(xc), "res": _rs(resc), "h": _rs(hc), "y": _rs(yc)}
        launch, head, tail = _forward_launch_args(types, plan, n, d, resc is not None, ptr, rs)
        _launch_rows(launch, head, tail, n, d, plan.k, sums=1, like=x)
        if direct:
            y = out
        else:
            y = _interop.from_cupy(yc, x, types.out)
            y = _cast(y, plan.out_dtype)
        h = _interop.from_cupy(hc, x, types.h)
        return y, h, _interop.from_cupy(rstd, x)


def forward_into(x, residual, weight, bias, plan: Plan, out, h_out):
    """The fused add of :func:`forward` with ``h`` written into ``h_out`` (possibly
    ``residual`` itself) and ``y`` into ``out`` (possibly ``x``, or None): the
    in-place ``add_rms_norm_``; None where the kernel cannot write ``h_out``
    directly (another dtype than the kernel's ``h``, non-adjacent columns), and
    the front end copies.  Alias-safe: see forward.cu.j2 (no ``__restrict__``
    on ``x``/``res``; each element read before the same thread writes it)."""
    types = cl.forward_types(_name(x), _name(residual), _name(weight), plan.out_dtype, plan.llama)
    if types is None or types.h != _name(h_out):
        return None
    with _on_callers_stream(x):
        hc = h_out if _is_torch(h_out) else _interop.to_cupy(h_out)
        if hc.shape[1] > 1 and _col_stride(hc) != 1:
            return None
        xk, rk = _cast(x, types.x), _cast(residual, types.res)
        wk, bk = _cast(weight, types.weight), _cast(bias, compute_dtype(types.h))
        xc, resc, wc, bc = _dev(xk), _dev(rk), _dev(wk), _dev(bk)
        n, d = xc.shape
        yc = None
        direct = out is not None and types.out == plan.out_dtype
        if direct:
            yc = out if _is_torch(out) else _interop.to_cupy(out)
            if yc.shape[1] > 1 and _col_stride(yc) != 1:
                yc, direct = None, False
        if yc is None:
            yc = _empty((n, d), types.out, like=x)
        rstd = _empty((n,), compute_dtype(types.h), like=x)
        ptr = {"x": _ptr(xc), "res": _ptr(resc), "h": _ptr(hc), "w": _ptr(wc), "b": _ptr(bc),
               "y": _ptr(yc), "rstd": _ptr(rstd)}
        rs = {"x": _rs(xc), "res": _rs(resc), "h": _rs(hc), "y": _rs(yc)}
        launch, head, tail = _forward_launch_args(types, plan, n, d, True, ptr, rs)
        _launch_rows(launch, head, tail, n, d, plan.k, sums=1, like=x)
        y = out if direct else _cast(_interop.from_cupy(yc, x, types.out), plan.out_dtype)
        return y, h_out, _interop.from_cupy(rstd, x)


def _forward_launch_args(types: cl.FwdTypes, plan: Plan, n: int, d: int, has_res: bool,
                         ptr: dict, rs: dict) -> tuple[cl.Launch, tuple, tuple]:
    """(launch, head, tail) of the forward / fused add row kernel (:func:`_row_steps`),
    shared by :func:`forward`, :func:`forward_into` and the host path's launch records
    (:mod:`.hostpath`), so that all three launch the same kernel the same way.

    ``ptr``: role (x, res, h, w, b, y, rstd) -> pointer argument (a null pointer for an
    absent array), ``rs``: role (x, res, h, y) -> row stride argument.  ``has_res``
    picks the tuning table's fused-add entries.
    """
    num_sms, max_smem = _device()
    launch = cl.forward_launch(n, d, types.x, types.res, types.weight, types.out, max_smem=max_smem,
                               num_sms=num_sms, has_res=has_res, device=_device_name())
    head = (ptr["x"], rs["x"], ptr["res"], rs["res"], ptr["h"], rs["h"], ptr["w"], ptr["b"],
            ptr["y"], rs["y"], ptr["rstd"])
    tail = (np.float64(plan.eps), np.int32(plan.eps_inside), np.float64(plan.offset),
            np.int32(plan.llama))
    return launch, head, tail


def _row_steps(launch, head: tuple, tail: tuple, n: int, d: int, k: int, part: Any = None) -> list:
    """[(launch, args)] of a row kernel: one launch (``head``, the row scalars, ``tail``),
    or pn_*_split's two around the float64 buffer whose pointer argument is ``part``."""
    if launch.slices:
        args = (*head, part, np.int64(n), np.int32(d), np.int32(k), np.int32(launch.slices), *tail)
        return [(launch, args), (dataclasses.replace(launch, name=launch.name2), args)]
    return [(launch, (*head, np.int64(n), np.int32(d), np.int32(k),
                      np.int32(launch.stash if launch.big else launch.tpr), *tail))]


def _launch_rows(launch, head: tuple, tail: tuple, n: int, d: int, k: int, sums: int,
                 like: Any = None) -> None:
    """A row kernel's launch, or pn_*_split's two launches around a float64 buffer of
    ``sums`` sums per (row, slice)."""
    part = _empty((sums * n * launch.slices,), "float64", like=like) if launch.slices else None
    for step, args in _row_steps(launch, head, tail, n, d, k, _ptr(part) if launch.slices else None):
        _launch(step, args)


def _backward_launch(types: cl.BwdTypes, n: int, d: int, has_w: bool, has_b: bool,
                     has_g: bool) -> cl.Launch:
    """The backward row kernel's launch (its partial-sum buffers are
    ``launch.partial_rows x launch.ldp`` of the compute dtype, zeroed for ``launch.big``)."""
    num_sms, max_smem = _device()
    return cl.backward_launch(n, d, types.x, types.dy, types.weight, partials=has_w or has_b,
                              num_sms=num_sms, max_smem=max_smem, has_w=has_w, has_g=has_g,
                              device=_device_name())


def _backward_args(launch: cl.Launch, plan: Plan, ptr: dict, rs: dict) -> tuple[tuple, tuple]:
    """(head, tail) of the backward row kernel (:func:`_row_steps`), as in
    :func:`_forward_launch_args`: ``ptr`` roles dy, x, w, rstd, g, dx, dwp, dbp (the
    partial-sum buffers), ``rs`` roles dy, x, g, dx."""
    head = (ptr["dy"], rs["dy"], ptr["x"], rs["x"], ptr["w"], ptr["rstd"], ptr["g"], rs["g"],
            ptr["dx"], rs["dx"], ptr["dwp"], ptr["dbp"], np.int64(launch.ldp))
    tail = (np.float64(plan.eps), np.int32(plan.eps_inside), np.float64(plan.offset))
    return head, tail


def _colsum_launch_args(rows: int, ldp: int, d: int, ct: str, kout: str, part: Any, out: Any):
    """(launch, args) of pn_colsum over ``rows x ldp`` partial sums into ``d`` columns."""
    launch = cl.colsum_launch(d, ct, kout)
    return launch, (part, np.int64(rows), np.int64(ldp), np.int32(d), out)


def backward(dy, x, weight, bias, rstd, grad_residual, plan: Plan, out=None):
    """Backward on 2-D rows (see :mod:`polynorm.backends.reference`).

    ``dx`` is always a new array (``out``, even ``dy`` itself, gets a copy from the
    front end): the kernels are not written for ``dx`` aliasing ``dy``.
    """
    xd, wd, bd = _name(x), _name(weight), _name(bias)
    types = cl.backward_types(xd, _name(dy), _name(grad_residual), wd)
    ct = types.compute
    with _on_callers_stream(x):
        xc = _dev(x)
        dyc = _dev(_cast(dy, types.dy))
        gc = _dev(_cast(grad_residual, types.dy))
        wc = _dev(_cast(weight, types.weight))
        rstdc = _dev(_cast(rstd, ct))
        n, d = xc.shape
        dxc = _empty((n, d), xd, like=x)
        launch = _backward_launch(types, n, d, weight is not None, bias is not None,
                                  grad_residual is not None)
        shape = (launch.partial_rows, launch.ldp)
        dwp = _empty(shape, ct, zero=launch.big, like=x) if weight is not None else None
        dbp = _empty(shape, ct, zero=launch.big, like=x) if bias is not None else None
        ptr = {"dy": _ptr(dyc), "x": _ptr(xc), "w": _ptr(wc), "rstd": _ptr(rstdc), "g": _ptr(gc),
               "dx": _ptr(dxc), "dwp": _ptr(dwp), "dbp": _ptr(dbp)}
        rs = {"dy": _rs(dyc), "x": _rs(xc), "g": _rs(gc), "dx": _rs(dxc)}
        head, tail = _backward_args(launch, plan, ptr, rs)
        _launch_rows(launch, head, tail, n, d, plan.k, sums=2, like=x)
        dx = _interop.from_cupy(dxc, x, xd)
        dweight = _colsum(dwp, d, ct, wd, x) if weight is not None else None
        dbias = _colsum(dbp, d, ct, bd, x) if bias is not None else None
        return dx, dweight, dbias


def _colsum(part, d: int, ct: str, want: str, like: Any):
    kout = cl.colsum_out(ct, want)
    out = _empty((d,), kout, like=like)
    _launch(*_colsum_launch_args(part.shape[0], part.shape[1], d, ct, kout, _ptr(part), _ptr(out)))
    return _cast(_interop.from_cupy(out, like, kout), want)


# ------------------------------------------------------------------ fusions (gated, quantized output)


def _rows_for(a: Any, dtype: str) -> Any:
    """``a`` cast exactly to the kernel's ``dtype`` (see ``cuda.launch.kernel_dtype``), as a view."""
    return _view(_cast(a, dtype))


def _tree_sum(leaves: Any, cdt: str) -> Any:
    """Sum of ``leaves`` (rows, d) over rows in the row tree's order
    (:mod:`.rowtree`): adjacent pairs level by level, a lone last row carried
    up, in the compute dtype below ``TREE_G`` and in float64 from it up -- the
    adds of ``numba.gated.tree_sum``, one elementwise kernel per level."""
    from polynorm.backends.rowtree import TREE_G

    cur = leaves
    level = 1
    while cur.shape[0] > 1:
        m = cur.shape[0]
        if level == TREE_G and cdt != "float64":
            cur = cur.astype(np.float64)
        pairs = cur[0:m - 1:2] + cur[1:m:2]
        if m % 2:
            nxt = _empty((m // 2 + 1, cur.shape[1]), "float64" if cur.dtype == np.float64 else cdt)
            nxt[: m // 2] = pairs
            nxt[m // 2] = cur[m - 1]
            cur = nxt
        else:
            cur = pairs
        level += 1
    return cur[0].astype(np.float64)


def gated_forward(x, z, weight, bias, gplan, out=None):
    """Gated forward on 2-D rows (see :func:`.reference.gated_forward`): pn_gated_fwd.

    ``casting="llama"`` runs the reference on the device (its roundings are not
    in the kernel).  z and the output move in x's dtype or the compute dtype
    (exact casts otherwise); weight and bias in the compute dtype.
    """
    plan = gplan.plan
    if plan.llama:
        from polynorm.backends import reference

        return reference.gated_forward(x, z, weight, bias, gplan, out)
    xd = _name(x)
    ct = plan.compute_dtype
    kz = cl.kernel_dtype(xd, _name(z))
    ko = cl.kernel_dtype(xd, plan.out_dtype)
    with _on_callers_stream(x):
        xc, zc = _view(x), _rows_for(z, kz)
        wc, bc = _rows_for(weight, ct), _rows_for(bias, ct)
        n, d = xc.shape
        yc = _empty((n, d), ko)
        rstd = _empty((n, gplan.groups), ct)
        num_sms, _ = _device()
        launch = cl.gated_forward_launch(n, d, gplan.group_size, xd, kz, ko, num_sms=num_sms,
                                         device=_device_name())
        args = (
            _ptr(xc), _rs(xc), _ptr(zc), _rs(zc), _ptr(wc), _ptr(bc), _ptr(yc), _rs(yc), _ptr(rstd),
            np.int64(n), np.int32(d), np.int32(gplan.group_size), np.int32(gplan.k),
            np.int32(launch.tpr), np.float64(plan.eps), np.int32(plan.eps_inside),
            np.float64(plan.offset), np.int32(gplan.norm_before_gate),
        )
        _launch(launch, args)
        y = _cast(_interop.from_cupy(yc, x, ko), plan.out_dtype)
        return y, _interop.from_cupy(rstd, x)


def gated_backward(dy, x, z, weight, bias, rstd, gplan):
    """Gated backward on 2-D rows: pn_gated_bwd writes dx, dz and per-row dweight /
    dbias leaves, summed over rows in the row tree's order (:func:`_tree_sum`)."""
    plan = gplan.plan
    xd, zd = _name(x), _name(z)
    ct = plan.compute_dtype
    kz = cl.kernel_dtype(xd, zd)
    kdy = cl.kernel_dtype(xd, _name(dy))
    with _on_callers_stream(x):
        import cupy

        # the kernel takes C-contiguous rows (one offset for all its arrays: fewer registers)
        xc, zc, dyc, rstdc = (None if a is None else cupy.ascontiguousarray(_view(a))
                              for a in (x, _cast(z, kz), _cast(dy, kdy),
                                        None if rstd is None else _cast(rstd, ct)))
        wc, bc = _rows_for(weight, ct), _rows_for(bias, ct)
        n, d = xc.shape
        dxc = _empty((n, d), xd)
        dzc = _empty((n, d), kz)
        lw = _empty((n, d), ct) if weight is not None else None
        lb = _empty((n, d), ct) if bias is not None else None
        launch = cl.gated_backward_launch(n, d, gplan.group_size, xd, kz, kdy)
        args = (
            _ptr(dyc), _ptr(xc), _ptr(zc), _ptr(wc), _ptr(bc), _ptr(rstdc),
            _ptr(dxc), _ptr(dzc), _ptr(lw), _ptr(lb),
            np.int64(n), np.int32(d), np.int32(gplan.group_size), np.int32(gplan.k),
            np.int32(launch.tpr), np.float64(plan.eps), np.int32(plan.eps_inside),
            np.float64(plan.offset), np.int32(gplan.norm_before_gate),
        )
        _launch(launch, args)
        dx = _interop.from_cupy(dxc, x, xd)
        dz = _cast(_interop.from_cupy(dzc, x, kz), zd)
        dw = db = None
        if weight is not None:
            dw = _cast(_interop.from_cupy(_tree_sum(lw, ct), x), _name(weight))
        if bias is not None:
            db = _cast(_interop.from_cupy(_tree_sum(lb, ct), x), _name(bias))
        return dx, dz, dw, db


def _wrap_q(q: Any, like: Any, qdtype: str) -> Any:
    """``q`` (uint8 bits, cupy) as the caller's array of the quantized format."""
    mod = type(like).__module__.split(".")[0]
    if qdtype == "int8":
        q = q.view(np.int8)
        return q if mod == "cupy" else _interop.from_cupy(q, like)
    if mod == "torch":
        import torch

        return torch.from_dlpack(q).view(getattr(torch, qdtype))
    if mod in ("jax", "jaxlib"):
        import jax
        import jax.numpy as jnp

        return jax.lax.bitcast_convert_type(jnp.from_dlpack(q), getattr(jnp, qdtype))
    raise TypeError(f"dtype={qdtype!r}: {mod} arrays have no {qdtype} dtype")


def quant_forward(x, residual, weight, bias, qplan, scale=None):
    """Quantized forward on 2-D rows (see :func:`.reference.quant_forward`): pn_quant_fwd.

    x and residual move in their promoted dtype when they differ (exact);
    weight and bias in the compute dtype.  ``casting="llama"`` runs
    :func:`forward` into float32 rows and quantizes them with the reference's
    array code on the device.
    """
    plan = qplan.plan
    if plan.llama:
        from polynorm.backends import reference

        y, h, _ = forward(x, residual, weight, bias, plan)
        from array_api_compat import array_namespace

        q, scales = reference.quantize(array_namespace(y), y, qplan, scale)
        return q, scales, h
    xd = _name(x)
    hd = xd if residual is None else promote(xd, _name(residual))
    ct = plan.compute_dtype
    with _on_callers_stream(x):
        xc, resc = _rows_for(x, hd), _rows_for(residual, hd)
        wc, bc = _rows_for(weight, ct), _rows_for(bias, ct)
        n, d = xc.shape
        hc = _empty((n, d), hd) if resc is not None else None
        q = _empty((n, d), "uint8")
        if qplan.static:
            sdev = _empty((1,), "float32")
            if scale is None:
                sdev[0] = np.float32(qplan.scale)
            else:
                sdev[...] = _view(_cast(_interop_reshape(scale), "float32"))
            sc = None
        else:
            sdev = None
            sc = _empty((n, qplan.groups), "float32")
        num_sms, _ = _device()
        launch = cl.quant_launch(n, d, hd, qplan.qdtype, group_size=qplan.group_size, num_sms=num_sms,
                                 device=_device_name())
        args = (
            _ptr(xc), _rs(xc), _ptr(resc), _rs(resc), _ptr(hc), _rs(hc), _ptr(wc), _ptr(bc),
            _ptr(q), _rs(q), _ptr(sc), _ptr(sdev),
            np.int64(n), np.int32(d), np.int32(plan.k), np.int32(qplan.group_size),
            np.int32(launch.tpr), np.float64(plan.eps), np.int32(plan.eps_inside),
            np.float64(plan.offset), np.int32(qplan.reciprocal),
        )
        _launch(launch, args)
        scales = _interop.from_cupy(sdev.reshape(()) if qplan.static else sc, x)
        return (_wrap_q(q, x, qplan.qdtype), scales,
                _interop.from_cupy(hc, x, hd) if hc is not None else None)


def _interop_reshape(scale: Any) -> Any:
    """A one-element scale array of any CUDA library as a (1,) array of its library."""
    from array_api_compat import array_namespace

    return array_namespace(scale).reshape(scale, (1,))


# ------------------------------------------------------------------ hidden axis split across shards


def split_stats(x, plan: Plan):
    """One shard's per-row float64 sum of squares: pn_split_stats, summed over the tree of
    the forward kernel that rows of this ``d`` get (``cuda.launch.split_stats_launch``),
    so that one shard's sum is the forward's."""
    xd = _name(x)
    with _on_callers_stream(x):
        xc = _dev(x)
        n, d = xc.shape
        ss = _empty((n,), "float64", like=x)
        if n:
            launch = cl.split_stats_launch(n, d, xd)
            _launch(launch, (_ptr(xc), _rs(xc), _ptr(ss), np.int64(n), np.int32(d),
                             np.int32(launch.tpr), np.int32(launch.span),
                             np.int32(launch.tail_first)))
        return _interop.from_cupy(ss, x)


def split_forward(x, weight, bias, sumsq, k_total: int, plan: Plan):
    """``(y, rstd)`` of one shard's rows from the whole rows' ``sumsq``: pn_split_fwd
    (fp32 casting; the front end sends llama casting to the reference).  ``sumsq`` is
    taken in float64 (an exact cast from any float dtype)."""
    types = cl.forward_types(_name(x), None, _name(weight), plan.out_dtype, False)
    assert types is not None  # fp32 casting always has a kernel
    ct = compute_dtype(types.h)
    with _on_callers_stream(x):
        xc = _dev(_cast(x, types.x))
        wc, bc = _dev(_cast(weight, types.weight)), _dev(_cast(bias, ct))
        ssc = _dev(_cast(sumsq, "float64"))
        n, d = xc.shape
        yc = _empty((n, d), types.out, like=x)
        rstd = _empty((n,), ct, like=x)
        if n:
            launch = cl.split_forward_launch(n, d, types.x, types.weight, types.out)
            _launch(launch, (_ptr(xc), _rs(xc), _ptr(wc), _ptr(bc), _ptr(yc), _rs(yc), _ptr(rstd),
                             _ptr(ssc), np.int64(n), np.int32(d), np.int32(launch.tpr),
                             np.int64(k_total), np.float64(plan.eps), np.int32(plan.eps_inside),
                             np.float64(plan.offset)))
        y = _cast(_interop.from_cupy(yc, x, types.out), plan.out_dtype)
        return y, _interop.from_cupy(rstd, x)


def split_dot(dy, x, weight, sumsq, k_total: int, plan: Plan):
    """One shard's float64 ``sum(g * dy * xhat)`` per row: pn_split_dot (the reference's
    ``split_dot`` products, summed in double over a tree instead of its order)."""
    xd = _name(x)
    types = cl.backward_types(xd, _name(dy), None, None)
    ct = types.compute
    with _on_callers_stream(x):
        xc, dyc = _dev(x), _dev(_cast(dy, types.dy))
        wc, ssc = _dev(_cast(weight, ct)), _dev(_cast(sumsq, "float64"))
        n, d = xc.shape
        dot = _empty((n,), "float64", like=x)
        if n:
            launch = cl.split_backward_launch(n, d, xd, types.dy, 1)
            _launch(launch, (_ptr(dyc), _rs(dyc), _ptr(xc), _rs(xc), _ptr(wc), _ptr(ssc), _ptr(dot),
                             np.int64(n), np.int32(d), np.int32(launch.tpr), np.int64(k_total),
                             np.float64(plan.eps), np.int32(plan.eps_inside),
                             np.float64(plan.offset)))
        return _interop.from_cupy(dot, x)


def split_backward(dy, x, weight, bias, sumsq, dot, k_total: int, plan: Plan):
    """``(dx, dweight, dbias)`` of one shard: pn_split_bwd (dx with the reference's
    ``split_backward`` bits) and pn_colsum of its per-row leaves (dweight / dbias summed
    in double: within rounding of the reference's compute-dtype sums)."""
    xd, wd, bd = _name(x), _name(weight), _name(bias)
    types = cl.backward_types(xd, _name(dy), None, None)
    ct = types.compute
    with _on_callers_stream(x):
        xc, dyc = _dev(x), _dev(_cast(dy, types.dy))
        wc = _dev(_cast(weight, ct))
        ssc, dotc = _dev(_cast(sumsq, "float64")), _dev(_cast(dot, "float64"))
        n, d = xc.shape
        dxc = _empty((n, d), xd, like=x)
        lw = _empty((n, d), ct, like=x) if weight is not None else None
        lb = _empty((n, d), ct, like=x) if bias is not None else None
        if n:
            launch = cl.split_backward_launch(n, d, xd, types.dy, 2)
            _launch(launch, (_ptr(dyc), _rs(dyc), _ptr(xc), _rs(xc), _ptr(wc), _ptr(ssc), _ptr(dotc),
                             _ptr(dxc), _rs(dxc), _ptr(lw), _ptr(lb), np.int64(n), np.int32(d),
                             np.int32(launch.tpr), np.int64(k_total), np.float64(plan.eps),
                             np.int32(plan.eps_inside), np.float64(plan.offset)))
        dx = _interop.from_cupy(dxc, x, xd)
        dweight = _colsum(lw, d, ct, wd, x) if weight is not None else None
        dbias = _colsum(lb, d, ct, bd, x) if bias is not None else None
        return dx, dweight, dbias


def qk_forward(x, weight, plan: Plan, rope, out=None):
    """QK-norm (+ RoPE) of ``(T, H, D)`` heads (:class:`polynorm.backends.QKKernels`):
    pn_qk_fwd in place on ``out`` when it is ``x`` with a contiguous last axis and the
    casting is fp32; otherwise (llama casting, a new result, a strided last axis, a
    head longer than :func:`~polynorm.backends.cuda.launch.qk_takes` allows) the
    reference's arrays on the device."""
    from polynorm.backends import reference

    c = _interop.to_cupy(x) if out is x else None
    if (plan.llama or c is None or c.ndim != 3 or (c.shape[2] > 1 and c.strides[2] != c.itemsize)
            or not cl.qk_takes(c.shape[2], _name(x))):
        return reference.qk_forward(x, weight, plan, rope, out)
    xd = _name(x)
    ct = plan.compute_dtype
    t, h, d = c.shape
    neox = True if rope is None else bool(rope[1])
    with _on_callers_stream(x):
        wc = _rows_for(weight, ct)
        csc = None if rope is None else _view(_cast(rope[0], ct))
        rot = 0 if csc is None else int(csc.shape[1])
        launch = cl.qk_launch(t * h, d, xd, neox)
        it = c.itemsize
        args = (
            np.uint64(c.data.ptr), np.int64(c.strides[0] // it), np.int64(c.strides[1] // it),
            np.int32(h), _ptr(wc), _ptr(csc), _rs(csc), np.int32(rot),
            np.int64(t * h), np.int32(d), np.int32(plan.k), np.int32(launch.tpr),
            np.float64(plan.eps), np.int32(plan.eps_inside), np.float64(plan.offset),
        )
        _launch(launch, args)
    return out


# ------------------------------------------------------------------ casting="none"

#: this backend runs ``casting="none"`` (pn_none_fwd); the front end sends such calls
#: of a backend without it to the reference
CASTING_NONE = True


def none_forward(x, residual, weight, bias, plan: Plan, out=None):
    """``casting="none"`` forward on 2-D rows (:data:`polynorm.core.options.NONE_CASTING`):
    pn_none_fwd, the steps of the Numba backend's ``none_forward``.

    The fused add runs on the reference (``h``, then the mode's steps), as Numba's
    does.  The weight is prepared in the caller's library as Numba prepares it on the
    host (``P(weight + T(offset))``, then the kernel's wide type); ``out`` of
    ``plan.out_dtype`` with adjacent columns is written in place.
    """
    from polynorm.backends import reference
    from polynorm.core.dtypes import numpy_dtype

    if residual is not None:
        return reference.forward(x, residual, weight, bias, plan, out)
    tname = plan.norm_dtype
    pname = bname = tname
    if weight is not None:
        pname = bname = promote(tname, dtype_name(weight.dtype))
    if bias is not None:
        bname = promote(pname, dtype_name(bias.dtype))
    # the row's product and bias sum in one type: float64 where either needs it
    wide = compute_dtype(promote(compute_dtype(tname), compute_dtype(bname)))
    eps = float(np.asarray(plan.eps, numpy_dtype(tname)))
    with _on_callers_stream(x):
        g = None
        if weight is not None:
            off = float(np.asarray(plan.offset, numpy_dtype(tname)))
            g = _cast(_cast(_cast(weight, compute_dtype(pname)) + off, pname), wide)
        xc, gc, bc = _dev(_cast(x, tname)), _dev(g), _dev(_cast(bias, wide))
        n, d = xc.shape
        yc = None
        direct = out is not None
        if direct:
            yc = out if _is_torch(out) else _interop.to_cupy(out)
            if yc.shape[1] > 1 and _col_stride(yc) != 1:
                yc, direct = None, False
        if yc is None:
            yc = _empty((n, d), plan.out_dtype, like=x)
        rstd = _empty((n,), compute_dtype(tname), like=x)
        launch = cl.none_launch(n, d, tname, wide, plan.out_dtype)
        _launch(launch, (
            _ptr(xc), _rs(xc), _ptr(gc), _ptr(bc), _ptr(yc), _rs(yc), _ptr(rstd),
            np.int64(n), np.int32(d), np.int32(plan.k), np.int32(launch.tpr),
            np.float64(eps), np.int32(plan.eps_inside),
            np.int32(cl.FORMAT_CODE[pname]), np.int32(cl.FORMAT_CODE[bname]),
        ))
        y = out if direct else _interop.from_cupy(yc, x, plan.out_dtype)
        return y, None, _interop.from_cupy(rstd, x)
