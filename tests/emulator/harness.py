"""Compile CUDA C++ with g++ against the ``cuda_emul.h`` prelude and run it on numpy buffers.

The point is to execute the *exact* text that CuPy hands to NVRTC: the source
file is ``#include``-d unchanged into a small translation unit that also
holds one ``extern "C"`` launcher per kernel name expression (the same
strings CuPy's ``RawModule(name_expressions=...)`` receives).  The prelude is
force-included (``-include``), and a directory of stub headers answers the
source's ``#include <cuda_fp16.h>`` / ``<cuda_bf16.h>`` / ... lines.

Build (about 2-10 s per source, cached by content hash)::

    g++ -std=c++20 -Og -pthread -fPIC ... -c tu.cpp          # the kernels
    readelf -sW tu.o                                         # extern __shared__ names
    g++ ... -shared tu.o arena.cpp -o lib.so                 # arena aliased to them
    readelf -sW lib.so                                       # static __shared__ to poison

Launching follows the CUDA driver / CuPy conventions: every argument is packed
the way ``cupy.RawKernel.__call__`` packs it (``None`` -> null pointer, an
ndarray -> its data pointer, a Python ``int``/``bool`` -> int64, a Python
``float`` -> float64, a numpy scalar -> its own bytes) and the kernel reads its
declared parameter type from those bytes.  Unlike CuPy, a scalar whose packed
type differs from the parameter's (a Python float for a ``float`` parameter
reads garbage on the GPU) is a ``TypeError`` here, and so is an array whose
dtype differs from the pointer's element type.

Arrays are not handed to the kernel in place: each one (overlapping arrays
together, so aliasing is kept) is copied into a buffer that keeps its
address modulo 256 (so vector-alignment decisions are the same), sits between
``PROT_NONE`` guard pages, and has canary bytes (all ones: NaN in every float
format, so a stray read shows in the results) on both sides.  After the
launch the canaries are checked (an out-of-bounds write is an error), arrays
passed only through ``const`` pointers are checked unchanged, and the others
are copied back.

Other checks a GPU would make, or a CPU would hide: the kernels are built
with ``-fsanitize=alignment`` (a misaligned vector load fails the launch, as
``cudaErrorMisalignedAddress`` would), literal ``__launch_bounds__(N)`` is
enforced, and a launch can take the threads of a block in another order
(``schedule=``) to expose races.  See ``cuda_emul.h`` for the execution model.

Environment: ``POLYNORM_EMUL_CACHE`` (library cache directory),
``POLYNORM_EMUL_WORKERS`` (OS threads per launch), ``POLYNORM_EMUL_CXXFLAGS``
(extra g++ flags, e.g. ``-mfma -ffp-contract=fast`` to contract like nvcc),
``CXX`` / ``READELF`` (tools).

Example
-------
>>> import numpy as np
>>> src = '''
... template <int B> __global__ void scale(const float* x, float* y, float a, int n) {
...   int i = blockIdx.x * B + threadIdx.x;
...   if (i < n) y[i] = a * x[i];
... }'''
>>> mod = compile_source(src, ["scale<64>"])
>>> x = np.arange(100, dtype=np.float32); y = np.zeros_like(x)
>>> mod.launch("scale<64>", grid=2, block=64, args=(x, y, np.float32(2), np.int32(100)))
>>> float(y[99])
198.0
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
PRELUDE = HERE / "cuda_emul.h"
STUBS = HERE / "include"
_VERSION = "4"  # bump to invalidate every cached library

#: ``g++ -std=c++20 -pthread -shared -fPIC`` at ``-Og`` (the kernel libraries
#: compile in about half the CPU time of ``-O1``, and the tests that run them
#: lose less than that: a cold emulated run takes about 30% less CPU; neither
#: level contracts or reassociates floating point, so the bits are the same;
#: ``-O0`` builds about 20% faster than ``-Og`` but runs the kernels so much
#: slower that the emulator test files cost about 13% more CPU cold) plus:
#: ``-fno-extern-tls-init`` (``extern __shared__`` becomes ``extern
#: thread_local``; without it g++ calls a TLS init function nobody defines) and
#: ``-fno-strict-aliasing`` (CUDA code type-puns through vector pointers),
#: ``-fvisibility=hidden -fno-gnu-unique`` (every library keeps its own copy of
#: the prelude's inline variables -- ``threadIdx``, the scheduler state --
#: even with several libraries loaded in one process; GNU_UNIQUE symbols would
#: be merged process-wide despite ``RTLD_LOCAL``).
CXXFLAGS = (
    "-std=c++20",
    "-Og",
    "-pthread",
    "-fPIC",
    "-fno-extern-tls-init",
    "-fno-strict-aliasing",
    "-fvisibility=hidden",
    "-fno-gnu-unique",
)

#: For the kernels' translation unit only: every typed load/store is checked for
#: its type's alignment; the prelude's handler (not libubsan, which is not
#: linked) fails the launch, as the GPU would with a misaligned address.
KERNEL_ONLY_FLAGS = ("-fsanitize=alignment",)

#: Dynamic shared memory the emulator provides per block (the H100/H200 limit).
DSMEM_CAPACITY = 232448

#: TLS symbols of the prelude itself (never poisoned).
_PRELUDE_TLS = {"threadIdx", "blockIdx", "blockDim", "gridDim"}


class EmulatorUnavailable(RuntimeError):
    """g++ or readelf is missing: the emulation tests cannot run (and must not pass)."""


class CompileError(RuntimeError):
    """g++ rejected the source; the message carries its diagnostics."""


class KernelError(RuntimeError):
    """The emulated kernel misbehaved (deadlock, divergence, out-of-bounds write ...)."""


def _which(tool: str, env: str) -> str:
    path = shutil.which(os.environ.get(env) or tool)
    if not path:
        raise EmulatorUnavailable(
            f"{tool} not found (set ${env} or install it: apt-get install g++ binutils); "
            "the CUDA emulation tests need it and fail without it"
        )
    return path


def toolchain() -> tuple[str, str, str]:
    """``(g++ path, readelf path, g++ version line)``; raises :class:`EmulatorUnavailable`.

    >>> cxx, readelf, version = toolchain()
    >>> "readelf" in readelf
    True
    """
    cxx = _which("g++", "CXX")
    readelf = _which("readelf", "READELF")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise EmulatorUnavailable(f"{cxx} --version failed: {exc}") from exc
    return cxx, readelf, out.splitlines()[0] if out else cxx


def cache_dir() -> Path:
    """Where compiled libraries live: ``$POLYNORM_EMUL_CACHE`` or ``~/.cache/polynorm-emul``."""
    env = os.environ.get("POLYNORM_EMUL_CACHE")
    if env:
        d = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = Path(base) / "polynorm-emul"
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".probe"
        probe.write_text("")
        probe.unlink()
    except OSError:
        d = Path(tempfile.gettempdir()) / f"polynorm-emul-{os.getuid()}"
        d.mkdir(parents=True, exist_ok=True)
    return d


# ----------------------------------------------------------------------------- building


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"{what} failed ({' '.join(cmd)}):\n{proc.stderr[-20000:]}")
    return proc.stdout


_SYM = re.compile(
    r"^\s*\d+:\s+([0-9a-fA-F]+)\s+(\d+)\s+(\w+)\s+(\w+)\s+\w+\s+(\w+)\s+(\S+)\s*$"
)


def _tls_symbols(readelf: str, path: Path) -> list[tuple[str, int, int, bool]]:
    """``(name, value, size, undefined)`` of every TLS symbol in an ELF file."""
    out = _run([readelf, "-sW", str(path)], "readelf")
    seen: dict[str, tuple[str, int, int, bool]] = {}
    for line in out.splitlines():
        m = _SYM.match(line)
        if not m or m.group(3) != "TLS":
            continue
        value, size, ndx, name = int(m.group(1), 16), int(m.group(2)), m.group(5), m.group(6)
        name = name.split("@")[0]
        seen.setdefault(name, (name, value, size, ndx == "UND"))
    return list(seen.values())


def _launcher_tu(source_path: Path, kernels: Sequence[str]) -> str:
    lines = [
        "// generated by tests/emulator/harness.py: the kernel source, unchanged, plus launchers",
        f'#include "{source_path}"',
        "",
    ]
    for i, expr in enumerate(kernels):
        lines += [
            f"// {i}: {expr}",
            f'extern "C" CUDA_EMUL_EXPORT int cuda_emul_launch_{i}(const cuda_emul::LaunchCfg* c, '
            f"void** a) {{ return cuda_emul::launch(&{expr}, c, a); }}",
            f'extern "C" CUDA_EMUL_EXPORT const char* cuda_emul_sig_{i}() '
            f"{{ return cuda_emul::signature(&{expr}); }}",
        ]
    return "\n".join(lines) + "\n"


def _arena_tu(extern_shared: Sequence[str]) -> str:
    lines = [
        "// generated by tests/emulator/harness.py: one dynamic shared memory arena per thread,",
        "// every extern __shared__ array of the source an alias of it (as on the GPU).",
        "#include <cstddef>",
        'extern "C" {',
        f"alignas(256) thread_local unsigned char cuda_emul_dsmem_arena[{DSMEM_CAPACITY} + 512];",
        "unsigned char* cuda_emul_dsmem_arena_ptr() { return cuda_emul_dsmem_arena; }",
        f"size_t cuda_emul_dsmem_capacity() {{ return {DSMEM_CAPACITY}; }}",
        "}",
    ]
    for i, name in enumerate(extern_shared):
        lines.append(
            f'extern thread_local unsigned char cuda_emul_alias_{i}[] __asm__("{name}") '
            '__attribute__((alias("cuda_emul_dsmem_arena")));'
        )
    return "\n".join(lines) + "\n"


def _build(source_path: Path, kernels: Sequence[str], flags: Sequence[str], out_dir: Path) -> dict:
    cxx, readelf, _ = toolchain()
    tu1 = out_dir / "kernels.cpp"
    tu1.write_text(_launcher_tu(source_path, kernels))
    base = [cxx, *CXXFLAGS, *flags]
    obj = out_dir / "kernels.o"
    _run(
        [*base, *KERNEL_ONLY_FLAGS, "-include", str(PRELUDE), "-I", str(STUBS), "-c", str(tu1), "-o", str(obj)],
        "g++ (kernels)",
    )
    extern_shared = [n for n, _v, _s, und in _tls_symbols(readelf, obj) if und]
    tu2 = out_dir / "arena.cpp"
    tu2.write_text(_arena_tu(extern_shared))
    lib = out_dir / "lib.so"
    _run(
        [*base, "-shared", "-Wl,--no-undefined", str(obj), str(tu2), "-o", str(lib)],
        "g++ (link)",
    )
    obj.unlink()  # only the library is needed from here on
    syms = _tls_symbols(readelf, lib)
    anchor = [v for n, v, _s, und in syms if n == "threadIdx" and not und]
    if not anchor:
        raise CompileError("threadIdx is missing from the linked library's TLS symbols")
    aliases = set(extern_shared) | {"cuda_emul_dsmem_arena"}
    poison = [
        (n, v, s)
        for n, v, s, und in syms
        if not und and s > 0 and n not in _PRELUDE_TLS and "cuda_emul" not in n and n not in aliases
    ]
    return {
        "kernels": list(kernels),
        "anchor": anchor[0],
        "static_shared": poison,
        "extern_shared": extern_shared,
    }


def compile_source(
    source: str | os.PathLike,
    kernels: Sequence[str],
    *,
    defines: dict[str, Any] | None = None,
    flags: Sequence[str] = (),
) -> Module:
    """Compile CUDA source (text, or a path to a ``.cu`` file) for the given kernels.

    Parameters
    ----------
    source : str or path-like
        A :class:`~pathlib.Path`/``os.PathLike`` is compiled in place (so
        diagnostics name the real file); a ``str`` is source text.
    kernels : sequence of str
        Name expressions, exactly as for ``cupy.RawModule(name_expressions=)``,
        e.g. ``"rms_fwd<float, 4, 256>"``.
    defines : dict, optional
        Extra ``-D`` macros.
    flags : sequence of str
        Extra g++ flags (e.g. ``-DCUDA_EMUL_UCONTEXT`` to use ucontext fibers).

    Returns
    -------
    Module
    """
    cxx, _readelf, version = toolchain()
    if isinstance(source, os.PathLike):
        text = Path(source).read_text()
    else:
        text = source
    flags = list(flags) + [f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
    flags += os.environ.get("POLYNORM_EMUL_CXXFLAGS", "").split()  # e.g. "-mfma -ffp-contract=fast"
    h = hashlib.sha256()
    for part in (
        _VERSION,
        version,
        PRELUDE.read_text(),
        *(p.read_text() for p in sorted(STUBS.rglob("*")) if p.is_file()),
        text,
        "\0".join(kernels),
        "\0".join(flags),
        " ".join(CXXFLAGS + KERNEL_ONLY_FLAGS),
    ):
        h.update(part.encode())
        h.update(b"\0\1")
    key = h.hexdigest()[:24]
    root = cache_dir()
    final = root / key
    if not (final / "meta.json").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=root))
        try:
            if isinstance(source, os.PathLike):
                src_path = Path(source).resolve()
            else:
                src_path = tmp / "source.cu"
                src_path.write_text(text)
            meta = _build(src_path, kernels, flags, tmp)
            if not isinstance(source, os.PathLike):
                meta["source_copy"] = True
            (tmp / "meta.json").write_text(json.dumps(meta))
            try:
                os.replace(tmp, final)
            except OSError:  # another process won the race: use its copy
                shutil.rmtree(tmp, ignore_errors=True)
            _prune(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    meta = json.loads((final / "meta.json").read_text())
    meta["launch_bounds"] = launch_bounds(text)
    return Module(final / "lib.so", meta)


_BOUNDS = re.compile(r"__launch_bounds__\s*\(\s*(\d+)\s*(?:,[^)]*)?\)\s*(\w+)\s*\(")


def launch_bounds(text: str) -> dict[str, int]:
    """``{kernel name: max threads per block}`` from literal ``__launch_bounds__(N)``.

    The prelude defines the qualifier away, so the harness enforces it: the GPU
    refuses a launch with more threads than the kernel was compiled for.

    >>> launch_bounds("__global__ void __launch_bounds__(256, 2) k(int* p) {}")
    {'k': 256}
    """
    return {m.group(2): int(m.group(1)) for m in _BOUNDS.finditer(text)}


def _prune(root: Path, keep: int = 48) -> None:
    """Drop the least recently built libraries beyond ``keep`` (each is a few MB)."""
    entries = sorted((p for p in root.iterdir() if (p / "meta.json").exists()), key=lambda p: p.stat().st_mtime)
    for p in entries[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- launching


class _LaunchCfg(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("smem", ctypes.c_ulonglong),
        ("workers", ctypes.c_int),
        ("stack_kib", ctypes.c_uint),
        ("schedule", ctypes.c_uint),
    ]


@dataclass(frozen=True)
class Param:
    """One kernel parameter, from the compiled signature."""

    pointer: bool
    const: bool  # pointer to const
    code: str  # numpy-like element/scalar code: f2 bf16 f4 f8 i4 u8 b1 ..., "?" unknown, "v" void
    size: int  # bytes of a scalar parameter (8 for pointers)


def _parse_signature(sig: str) -> list[Param]:
    params = []
    for item in filter(None, sig.split(",")):
        if "*" in item:
            const = item.startswith("c*")
            params.append(Param(True, const, item.split("*", 1)[1], 8))
        else:
            code, size = item.split(":")
            params.append(Param(False, False, code, int(size)))
    return params


@dataclass(frozen=True)
class Ptr:
    """A pointer ``offset`` bytes into ``array`` (which may lie on both sides of it:
    a kernel with a negative row stride reads before the pointer).  The whole
    array is guarded and copied; the kernel receives the interior address."""

    array: np.ndarray
    offset: int


_NUMPY_SCALARS = tuple(np.dtype(c).type for c in "?bhilqBHILQefdFD")


def _code(dtype: np.dtype) -> str:
    if dtype.name == "bfloat16":
        return "bf16"
    if dtype.kind == "b":
        return "b1"
    return f"{dtype.kind}{dtype.itemsize}"


def _pack_scalar(x: Any) -> np.generic:
    """The bytes CuPy's ``_pointer()`` passes for a non-array argument."""
    if type(x) in _NUMPY_SCALARS:
        return x
    if isinstance(x, int):  # bool too: CuPy tests int first
        return np.int64(x)
    if isinstance(x, float):
        return np.float64(x)
    raise TypeError(f"unsupported kernel argument type {type(x).__name__} (CuPy rejects it too)")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PAGE = mmap.PAGESIZE
_CANARY = 0xFF  # all-ones bytes: NaN in every float format, so stray reads show too
_TAIL = 64  # at least this many canary bytes after the data, then a guard page


def _byte_bounds(a: np.ndarray) -> tuple[int, int]:
    try:
        from numpy.lib.array_utils import byte_bounds
    except ImportError:  # numpy < 2
        byte_bounds = np.byte_bounds  # noqa: NPY201
    lo, hi = byte_bounds(a)
    return int(lo), int(hi)


class _Guarded:
    """A copy of host memory [lo, hi) between guard pages, same address mod 256."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        span = hi - lo
        mod = lo % 256
        body = -(-(256 + 256 + span + _TAIL + 256) // _PAGE) * _PAGE
        self.total = body + 2 * _PAGE
        base = _libc.mmap(None, self.total, 3, 0x22, -1, 0)  # RW, PRIVATE|ANONYMOUS
        if base in (None, ctypes.c_void_p(-1).value):
            raise MemoryError("mmap failed")
        self.base = base
        _libc.mprotect(base, _PAGE, 0)
        _libc.mprotect(base + _PAGE + body, _PAGE, 0)
        guard_hi = base + _PAGE + body
        self.start = ((guard_hi - _TAIL - span - mod) // 256) * 256 + mod
        self.body_lo = base + _PAGE
        self.body_hi = guard_hi
        assert self.start - self.body_lo >= 256
        ctypes.memset(self.body_lo, _CANARY, body)
        ctypes.memmove(self.start, lo, span)

    def ptr(self, addr: int) -> int:
        return self.start + (addr - self.lo)

    def view(self, lo: int, hi: int) -> np.ndarray:
        return np.frombuffer((ctypes.c_char * (hi - lo)).from_address(lo), dtype=np.uint8)

    def check(self, what: str) -> None:
        span = self.hi - self.lo
        for lo, hi, where in (
            (self.body_lo, self.start, "before the start"),
            (self.start + span, self.body_hi, "past the end"),
        ):
            bad = np.flatnonzero(self.view(lo, hi) != _CANARY)
            if bad.size:
                off = (hi - lo - bad[0]) if where == "before the start" else bad[-1] + 1
                raise KernelError(f"out-of-bounds write {where} of {what} (up to {off} bytes away)")

    def changed(self) -> bool:
        span = self.hi - self.lo
        return not np.array_equal(self.view(self.start, self.start + span), self.view(self.lo, self.hi))

    def copy_back(self) -> None:
        ctypes.memmove(self.lo, self.start, self.hi - self.lo)

    def free(self) -> None:
        if self.base:
            _libc.munmap(self.base, self.total)
            self.base = 0


def _dim3(v: int | Sequence[int]) -> tuple[int, int, int]:
    t = (int(v),) if np.isscalar(v) else tuple(int(i) for i in v)  # type: ignore[arg-type]
    if not 1 <= len(t) <= 3:
        raise ValueError(f"a grid/block shape has 1 to 3 entries, got {v!r}")
    return t + (1,) * (3 - len(t))  # type: ignore[return-value]


class Module:
    """A compiled source: launch its kernels on numpy arrays."""

    def __init__(self, path: Path, meta: dict):
        self.path = path
        self.meta = meta
        self._lib = ctypes.CDLL(str(path))
        self._lib.cuda_emul_last_error.restype = ctypes.c_char_p
        self.kernels: dict[str, tuple[Any, list[Param]]] = {}
        for i, expr in enumerate(meta["kernels"]):
            sig = getattr(self._lib, f"cuda_emul_sig_{i}")
            sig.restype = ctypes.c_char_p
            fn = getattr(self._lib, f"cuda_emul_launch_{i}")
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(_LaunchCfg), ctypes.POINTER(ctypes.c_void_p)]
            self.kernels[_norm(expr)] = (fn, _parse_signature(sig().decode()))
        shared = meta["static_shared"]
        n = len(shared)
        offs = (ctypes.c_ulonglong * max(n, 1))(*[v for _n, v, _s in shared])
        sizes = (ctypes.c_ulonglong * max(n, 1))(*[s for _n, _v, s in shared])
        self._lib.cuda_emul_set_poison(offs, sizes, n, ctypes.c_ulonglong(meta["anchor"]))

    def signature(self, kernel: str) -> list[Param]:
        """The kernel's parameters as compiled."""
        return self._entry(kernel)[1]

    def _entry(self, kernel: str):
        try:
            return self.kernels[_norm(kernel)]
        except KeyError:
            raise KeyError(f"kernel {kernel!r} was not compiled; have {list(self.kernels)}") from None

    def launch(
        self,
        kernel: str,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any],
        shared_mem: int = 0,
        *,
        workers: int | None = None,
        stack_kib: int = 64,
        schedule: int = 0,
    ) -> None:
        """Run ``kernel<<<grid, block, shared_mem>>>(*args)``; arrays are updated in place.

        ``schedule`` is the order in which the threads of a block take turns
        between synchronisation points: 0 thread order, 1 reversed, ``s >= 2``
        a pseudo-random permutation seeded by ``s`` and the block index.  A
        correct (race-free) kernel gives bit-identical results for every
        schedule; ``workers`` (OS threads running blocks concurrently) must not
        matter either.

        Raises
        ------
        TypeError
            An argument does not match the kernel's parameter (count, pointer vs
            scalar, dtype, scalar width).
        KernelError
            The kernel deadlocked, diverged at a barrier or warp intrinsic,
            wrote out of bounds, wrote through a ``const`` pointer's array, or
            the launch configuration is invalid.
        """
        fn, params = self._entry(kernel)
        threads = int(np.prod(_dim3(block)))
        bound = self.meta.get("launch_bounds", {}).get(kernel.split("<")[0].split("::")[-1].strip())
        if bound is not None and threads > bound:
            raise KernelError(
                f"{kernel}: block of {threads} threads exceeds its __launch_bounds__({bound}); "
                "the GPU refuses this launch (too many resources requested)"
            )
        if len(args) != len(params):
            raise TypeError(f"{kernel}: takes {len(params)} arguments, got {len(args)}")
        keep: list[Any] = []
        slots = (ctypes.c_void_p * max(len(args), 1))()
        arrays: list[tuple[int, np.ndarray, Param, int]] = []
        for i, (a, p) in enumerate(zip(args, params, strict=True)):
            off = 0
            if isinstance(a, Ptr):
                a, off = a.array, int(a.offset)
                if not 0 <= off < max(a.nbytes, 1):
                    raise ValueError(f"{kernel}: argument {i}: offset {off} outside the array's {a.nbytes} bytes")
            if isinstance(a, np.ndarray):
                if not p.pointer:
                    raise TypeError(f"{kernel}: argument {i} is an array but parameter {i} is a {p.code} scalar")
                if p.code not in ("?", "v", "u1", "i1") and _code(a.dtype) != p.code:
                    raise TypeError(
                        f"{kernel}: argument {i} has dtype {a.dtype} but parameter {i} points to {p.code}"
                    )
                arrays.append((i, a, p, off))
                continue
            if a is None:
                if not p.pointer:
                    raise TypeError(f"{kernel}: argument {i} is None but parameter {i} is a {p.code} scalar")
                v = ctypes.c_void_p(0)
                keep.append(v)
                slots[i] = ctypes.addressof(v)
                continue
            s = _pack_scalar(a)
            if p.pointer:
                raise TypeError(f"{kernel}: argument {i} is a scalar {a!r} but parameter {i} is a pointer")
            code = _code(s.dtype)
            if code != p.code or s.dtype.itemsize != p.size:
                raise TypeError(
                    f"{kernel}: argument {i} packs as {s.dtype} ({code}, {s.dtype.itemsize} bytes; "
                    f"from {type(a).__name__} {a!r}) but parameter {i} is {p.code} ({p.size} bytes)"
                )
            buf = np.array(s)  # keeps the bytes alive at a fixed address
            keep.append(buf)
            slots[i] = buf.ctypes.data
        # one guarded copy per group of overlapping arrays
        ranges = sorted({_byte_bounds(a) for _i, a, _p, _o in arrays if a.size})
        groups: list[list[int]] = []
        for lo, hi in ranges:
            if groups and lo < groups[-1][1]:
                groups[-1][1] = max(groups[-1][1], hi)
            else:
                groups.append([lo, hi])
        guarded = [_Guarded(lo, hi) for lo, hi in groups]
        try:
            written = [False] * len(guarded)
            for i, a, p, off in arrays:
                if a.size == 0:
                    v = ctypes.c_void_p(a.ctypes.data)  # never dereferenced by a correct kernel
                else:
                    lo, _hi = _byte_bounds(a)
                    g = next(k for k, gg in enumerate(guarded) if gg.lo <= lo < gg.hi)
                    written[g] |= not p.const
                    v = ctypes.c_void_p(guarded[g].ptr(a.ctypes.data + off))
                keep.append(v)
                slots[i] = ctypes.addressof(v)
            cfg = _LaunchCfg()
            cfg.grid[:] = _dim3(grid)
            cfg.block[:] = _dim3(block)
            cfg.smem = int(shared_mem)
            cfg.workers = int(workers if workers is not None else default_workers())
            cfg.stack_kib = int(stack_kib)
            cfg.schedule = int(schedule)
            rc = fn(ctypes.byref(cfg), slots)
            if rc != 0:
                raise KernelError(f"{kernel}: {self._lib.cuda_emul_last_error().decode()}")
            for k, g in enumerate(guarded):
                g.check(f"the array at [{g.lo:#x}, {g.hi:#x})")
                if not written[k] and g.changed():
                    raise KernelError(f"{kernel}: an array passed only through const pointers was modified")
            for k, g in enumerate(guarded):
                if written[k]:
                    g.copy_back()
        finally:
            for g in guarded:
                g.free()


def _norm(expr: str) -> str:
    return re.sub(r"\s+", "", expr)


def default_workers() -> int:
    """OS threads per launch: ``$POLYNORM_EMUL_WORKERS`` or the CPU count (at most 4)."""
    env = os.environ.get("POLYNORM_EMUL_WORKERS")
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))
