"""Launch records: the host path of the row kernels for torch CUDA tensors.

A (4096, 1024) bfloat16 forward runs ~13 us on an H200; the general glue around
it (dtype decisions, launch rules, argument tuples of numpy scalars, CuPy's
per-argument conversion, stream contexts) cost several times that per call.  A
:class:`Record` is that glue done once for one kind of call -- the shapes,
dtypes, row strides, options (the :class:`~polynorm.core.options.Plan`) and
device -- and kept by :mod:`polynorm.ops.fast_cuda`: the kernel handles, grids,
blocks, shared memory and each launch's packed argument buffer, every
argument but the data pointers already in place.  A call then only reads the
tensors' ``data_ptr()``, torch's current stream, allocates its results with
``torch.empty`` and launches through the driver (``cuLaunchKernel`` of
cuda-bindings with the packed buffer: one call, no per-argument conversion;
CuPy's ``Function`` call would convert each of the ~20 arguments to a new
object on every launch).

Records are built by the same helpers as the cupy backend's own calls
(``_forward_launch_args``, ``_backward_launch``, ``_row_steps``,
``_colsum_launch_args`` in :mod:`polynorm.backends.cuda`), so both launch the
same kernels with the same arguments.  A call that needs anything besides
launches -- a cast, a copy, a result cast afterwards, the reference's
fallback -- gets no record (``None``) and takes the backend's general code.

Nothing on a record's call synchronizes with the device or allocates outside
torch's allocator, so it can be captured in a CUDA graph
(``torch.cuda.graph``) once the record exists (a warm-up call before the
capture builds it and loads the kernels).
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from typing import Any

import numpy as np

from polynorm.backends import cuda as _be
from polynorm.backends.cuda import launch as cl
from polynorm.core.options import Plan, compute_dtype

__all__ = ["LaunchError", "Record", "available", "backward_record", "forward_record"]

#: the backend module whose launches the records are
backend = _be


class _Slot:
    """A pointer argument filled at each call: the pointer of the call's buffer ``role``
    (an input, or a buffer the record allocates)."""

    __slots__ = ("role",)

    def __init__(self, role: str):
        self.role = role


_NULL = np.uint64(0)
_ZERO = np.int64(0)


class Record:
    """One kind of call's launches, ready to go.

    ``inputs``: the roles of a call's input tensors, in the order the call passes
    them; ``allocs``: ``(role, shape, torch dtype, zero, like)`` of each buffer the call
    allocates (``like``: an input role whose tensor it is ``torch.empty_like`` of, the
    cheapest allocation torch has, or None); ``outputs``: the roles returned (``None`` for an absent result);
    each of ``steps``: kernel handle, grid, block, dynamic shared bytes, the packed
    argument cells, the address of its ``void*`` parameter array and the (cell,
    buffer index) pairs filled per call.
    """

    __slots__ = ("allocs", "device", "lock", "names", "outputs", "steps", "_kinds", "_keep")

    def __init__(self, steps: list, functions: list, inputs: tuple, allocs: list, outputs: tuple,
                 device: Any):
        index = {r: i for i, r in enumerate((*inputs, *(a[0] for a in allocs)))}
        self.allocs = tuple(_allocator(shape, dtype, zero, device, -1 if like is None else index[like])
                            for _, shape, dtype, zero, like in allocs)
        self.outputs = tuple(None if r is None else index[r] for r in outputs)
        self.device = device
        self.lock = threading.Lock()
        self.names = tuple(launch.name for launch, _ in steps)
        built, kinds, keep = [], [], []
        for (launch, args), fn in zip(steps, functions, strict=True):
            cells = (ctypes.c_uint64 * max(1, len(args)))()
            slots = []
            for i, a in enumerate(args):
                if isinstance(a, _Slot):
                    slots.append((i, index[a.role]))
                else:
                    cells[i] = struct.unpack("<Q", a.tobytes().ljust(8, b"\0"))[0]
            base = ctypes.addressof(cells)
            params = (ctypes.c_void_p * max(1, len(args)))(*(base + 8 * i for i in range(len(args))))
            built.append((fn, launch.grid, launch.block, launch.shared, cells,
                          ctypes.addressof(params), tuple(slots)))
            kinds.append(tuple(np.uint64 if isinstance(a, _Slot) else type(a) for a in args))
            keep.append(params)
        self.steps = tuple(built)
        self._kinds = tuple(kinds)
        self._keep = keep  # the parameter arrays the steps' addresses point into

    def __call__(self, inputs: list, stream: int) -> list:
        """Allocate, launch every step on ``stream``; the results (see ``outputs``)."""
        empty_like = _torch().empty_like
        bufs = list(inputs)
        for like, make in self.allocs:
            bufs.append(empty_like(bufs[like]) if like >= 0 else make())
        ptrs = [0 if b is None else b.data_ptr() for b in bufs]
        go = _launcher()
        with self.lock:  # the cells are shared: fill and launch as one
            for fn, grid, block, shared, cells, params, slots in self.steps:
                for cell, src in slots:
                    cells[cell] = ptrs[src]
                go(fn, grid, block, shared, stream, params)
        return [None if i is None else bufs[i] for i in self.outputs]

    def args(self, step: int) -> tuple:
        """The arguments step ``step`` was last launched with, as numpy scalars (for tests:
        the same values the backend's own launch passes)."""
        cells = self.steps[step][4]
        out = []
        for i, kind in enumerate(self._kinds[step]):
            raw = struct.pack("<Q", cells[i])
            out.append(np.frombuffer(raw[:np.dtype(kind).itemsize], dtype=kind)[0])
        return tuple(out)


def _allocator(shape: tuple, dtype: Any, zero: bool, device: Any, like: int) -> tuple:
    """(like, make): ``like`` >= 0 for ``torch.empty_like`` of that buffer, else ``make()``
    allocates (the sizes as separate ints: torch parses a tuple slower)."""
    torch = _torch()
    fn = torch.zeros if zero else torch.empty
    if like >= 0 and not zero:
        return like, None
    return -1, functools.partial(fn, *shape, dtype=dtype, device=device) if shape else \
        functools.partial(fn, (), dtype=dtype, device=device)


# ------------------------------------------------------------------ the launch itself

_TORCH: list = []


def _torch():
    if not _TORCH:
        import torch

        _TORCH.append(torch)
    return _TORCH[0]


_LAUNCHER: list = []


class LaunchError(RuntimeError):
    """``cuLaunchKernel`` refused a record's launch (``code``: the CUresult)."""

    def __init__(self, code: int, what: str):
        super().__init__(f"polynorm: cuLaunchKernel failed: {what}")
        self.code = code


#: CUDA_ERROR_INVALID_CONTEXT: the calling thread has no current context yet
INVALID_CONTEXT = 201


def _driver_launch(fn: Any, grid: int, block: int, shared: int, stream: int, params: int) -> None:
    err = _LAUNCHER[1](fn, grid, 1, 1, block, 1, 1, shared, stream, params, 0)[0]
    if err:
        raise LaunchError(int(err), repr(err))


def _launcher():
    """The function that launches one step (replaced by tests)."""
    if not _LAUNCHER:
        from cuda.bindings import driver

        _LAUNCHER.extend((_driver_launch, driver.cuLaunchKernel, driver.CUfunction))
    return _LAUNCHER[0]


def available() -> bool:
    """Whether records can launch: cuda-bindings' driver module imports (without it the
    cupy backend's own calls run)."""
    try:
        _launcher()
    except ImportError:
        return False
    return True


def _function(launch: cl.Launch) -> Any:
    """The driver handle of ``launch``'s kernel (loaded, shared memory opted in, by the
    backend's own :func:`polynorm.backends.cuda._kernel`)."""
    _launcher()
    return _LAUNCHER[2](_be._kernel(launch).ptr)


# ------------------------------------------------------------------ building records


def _name(a: Any) -> str | None:
    return None if a is None else _be._name(a)


def _adjacent(a: Any) -> bool:
    """Adjacent last-axis elements (else the backend copies first)."""
    return a is None or a.shape[-1] <= 1 or a.stride(-1) == 1


def _dtype(name: str) -> Any:
    return getattr(_torch(), name)


def _slots(roles: tuple[str, ...]) -> dict:
    return {r: _Slot(r) for r in roles}


def forward_record(x: Any, residual: Any, weight: Any, bias: Any, plan: Plan,
                   shape: tuple[int, ...]) -> Record | None:
    """The record of a forward / fused add of ``x`` rows ``(n, d)`` (torch CUDA
    tensors, as the call's), or None where the call needs more than launches.

    ``shape``: the caller's ``x`` shape, in which ``y``/``h`` (and ``rstd``
    without its last axis) are allocated.  Inputs of a call: ``[x, residual,
    weight, bias]``; results ``[y, h, rstd]``.
    """
    xd, rd, wd, bd = _name(x), _name(residual), _name(weight), _name(bias)
    if plan.cast_none or not all(_adjacent(a) for a in (x, residual, weight, bias)):
        return None
    types = cl.forward_types(xd, rd, wd, plan.out_dtype, plan.llama)
    if types is None:
        return None
    ct = compute_dtype(types.h)
    if (types.x != xd or (rd is not None and types.res != rd) or (wd is not None and types.weight != wd)
            or (bd is not None and bd != ct) or types.out != plan.out_dtype):
        return None
    n, d = x.shape
    s = _slots(("x", "res", "w", "b", "y", "h", "rstd", "part"))
    has_res = residual is not None
    ptr = {"x": s["x"], "res": s["res"] if has_res else _NULL, "h": s["h"] if has_res else _NULL,
           "w": s["w"] if weight is not None else _NULL, "b": s["b"] if bias is not None else _NULL,
           "y": s["y"], "rstd": s["rstd"]}
    rs = {"x": np.int64(x.stride(0)), "res": np.int64(residual.stride(0)) if has_res else _ZERO,
          "h": np.int64(d) if has_res else _ZERO, "y": np.int64(d)}
    with _be._on_callers_stream(x):
        launch, head, tail = _be._forward_launch_args(types, plan, n, d, has_res, ptr, rs)
        steps = _be._row_steps(launch, head, tail, n, d, plan.k, s["part"])
        functions = [_function(la) for la, _ in steps]
    shape = tuple(shape)
    dense = x.is_contiguous()
    allocs = [("y", shape, _dtype(types.out), False, "x" if dense and types.out == xd else None)]
    if has_res:
        like = "x" if dense and types.h == xd else (
            "res" if residual.is_contiguous() and types.h == rd else None)
        allocs.append(("h", shape, _dtype(types.h), False, like))
    allocs.append(("rstd", shape[:-1], _dtype(ct), False, None))
    if launch.slices:
        allocs.append(("part", (n * launch.slices,), _dtype("float64"), False, None))
    return Record(steps, functions, ("x", "res", "w", "b"), allocs,
                  ("y", "h" if has_res else None, "rstd"), x.device)


def backward_record(dy: Any, x: Any, weight: Any, bias: Any, rstd: Any, grad_residual: Any,
                    plan: Plan, shape: tuple[int, ...]) -> Record | None:
    """The record of a backward of ``x`` rows ``(n, d)`` (``rstd`` as the caller's:
    ``n`` values), or None where the call needs more than launches.

    Inputs of a call: ``[dy, x, weight, rstd, grad_residual]``; results
    ``[dx, dweight, dbias]`` (``dx`` in ``shape``).
    """
    xd, wd, bd = _name(x), _name(weight), _name(bias)
    gd, dyd = _name(grad_residual), _name(dy)
    if not all(_adjacent(a) for a in (dy, x, weight, grad_residual)):
        return None
    if rstd is not None and not rstd.is_contiguous():
        return None
    types = cl.backward_types(xd, dyd, gd, wd)
    ct = types.compute
    if (types.dy != dyd or (gd is not None and types.dy != gd) or (wd is not None and types.weight != wd)
            or (rstd is not None and _name(rstd) != ct)
            or (wd is not None and cl.colsum_out(ct, wd) != wd)
            or (bd is not None and cl.colsum_out(ct, bd) != bd)):
        return None
    n, d = x.shape
    has_w, has_b, has_g = weight is not None, bias is not None, grad_residual is not None
    s = _slots(("dy", "x", "w", "rstd", "g", "dx", "dwp", "dbp", "part", "dw", "db"))
    with _be._on_callers_stream(x):
        launch = _be._backward_launch(types, n, d, has_w, has_b, has_g)
        ptr = {"dy": s["dy"], "x": s["x"], "w": s["w"] if has_w else _NULL,
               "rstd": s["rstd"] if rstd is not None else _NULL, "g": s["g"] if has_g else _NULL,
               "dx": s["dx"], "dwp": s["dwp"] if has_w else _NULL, "dbp": s["dbp"] if has_b else _NULL}
        rs = {"dy": np.int64(dy.stride(0)), "x": np.int64(x.stride(0)),
              "g": np.int64(grad_residual.stride(0)) if has_g else _ZERO, "dx": np.int64(d)}
        head, tail = _be._backward_args(launch, plan, ptr, rs)
        steps = _be._row_steps(launch, head, tail, n, d, plan.k, s["part"])
        part_shape = (launch.partial_rows, launch.ldp)
        if has_w:
            steps.append(_be._colsum_launch_args(*part_shape, d, ct, wd, s["dwp"], s["dw"]))
        if has_b:
            steps.append(_be._colsum_launch_args(*part_shape, d, ct, bd, s["dbp"], s["db"]))
        functions = [_function(la) for la, _ in steps]
    ctd = _dtype(ct)
    allocs = [("dx", tuple(shape), _dtype(xd), False, "x" if x.is_contiguous() else None)]
    if has_w:
        allocs.append(("dwp", part_shape, ctd, launch.big, None))
    if has_b:
        allocs.append(("dbp", part_shape, ctd, launch.big, None))
    if launch.slices:
        allocs.append(("part", (2 * n * launch.slices,), _dtype("float64"), False, None))
    if has_w:
        allocs.append(("dw", (d,), _dtype(wd), False, "w" if weight.is_contiguous() else None))
    if has_b:
        allocs.append(("db", (d,), _dtype(bd), False, None))
    return Record(steps, functions, ("dy", "x", "w", "rstd", "g"), allocs,
                  ("dx", "dw" if has_w else None, "db" if has_b else None), x.device)
