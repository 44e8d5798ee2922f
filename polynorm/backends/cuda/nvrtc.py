"""Compile the generated CUDA source with NVRTC (``cuda-bindings``), cubins cached on disk.

The cupy backend loads these cubins with ``cupy.RawModule(path=...)`` instead
of letting CuPy compile the source, because CuPy always appends
``-ftz=true`` (flush float32 subnormals to zero), which breaks the spec's
"no spurious underflow" promise for float32/bfloat16 subnormal input.  The
same function compiles every specialisation in tests/test_nvrtc.py, so the
options tested without a GPU are the options that run on one.

Needs ``cuda-bindings`` and the ``nvidia-cuda-nvrtc`` / ``nvidia-cuda-runtime``
wheels (or a CUDA toolkit's headers); no GPU or driver.

>>> ok, why = available()
>>> isinstance(ok, bool) and isinstance(why, str)
True
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from polynorm.backends.cuda import launch as cl
from polynorm.core.cache import cache_dir

#: options for every compile: IEEE float32 (no flush to zero), C++17
OPTIONS = (*cl.NVRTC_OPTIONS, "-ftz=false")


def available() -> tuple[bool, str]:
    """Whether NVRTC and the CUDA fp16/bf16 headers are here."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        return False, f"cuda-bindings is not installed ({exc}); pip install 'cuda-bindings>=12.6,<13'"
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # libnvrtc missing
        return False, f"NVRTC cannot be loaded ({exc}); pip install nvidia-cuda-nvrtc-cu12"
    if not cl.include_dirs():
        return False, "cuda_fp16.h not found; pip install nvidia-cuda-runtime-cu12"
    return True, f"NVRTC {major}.{minor}"


@dataclass
class Compiled:
    ok: bool
    log: str
    seconds: float
    cubin: bytes = b""
    lowered: dict[str, str] = field(default_factory=dict)


def _check(result):
    from cuda.bindings import nvrtc

    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC error {err}")
    return rest[0] if len(rest) == 1 else rest


def compile_names(names: list[str], arch: str, extra: tuple[str, ...] = ()) -> Compiled:
    """Compile the generated source once for ``arch`` (e.g. ``"sm_90"``) with
    every name expression in ``names``; a failed compile returns ``ok=False``
    with NVRTC's log."""
    from cuda.bindings import nvrtc

    t0 = time.perf_counter()
    prog = _check(nvrtc.nvrtcCreateProgram(cl.source().encode(), b"polynorm.cu", 0, [], []))
    try:
        for nm in names:
            _check(nvrtc.nvrtcAddNameExpression(prog, nm.encode()))
        opts = [*OPTIONS, f"--gpu-architecture={arch}", *(f"-I{d}" for d in cl.include_dirs()), *extra]
        opts_b = [o.encode() for o in opts]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts_b), opts_b)
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog))
        buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf))
        log = buf.decode(errors="replace").rstrip("\x00 \n")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return Compiled(False, log, time.perf_counter() - t0)
        lowered = {}
        for nm in names:
            low = _check(nvrtc.nvrtcGetLoweredName(prog, nm.encode()))
            lowered[nm] = low.decode() if isinstance(low, bytes) else low
        size = _check(nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin))
        return Compiled(True, log, time.perf_counter() - t0, cubin, lowered)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cached_cubin(name: str, arch: str) -> tuple[Path, str]:
    """(cubin path, mangled kernel name) for one name expression, compiling on a miss.

    The key covers the source, the options, the architecture and NVRTC's version;
    a ``.json`` file beside the cubin records the name expression and its mangled name.
    """
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    h = hashlib.sha256()
    for part in (cl.source(), "\0".join(OPTIONS), arch, name, f"{major}.{minor}"):
        h.update(part.encode())
        h.update(b"\0\1")
    key = h.hexdigest()[:32]
    root = cache_dir() / "cubin"
    cubin, meta = root / f"{key}.cubin", root / f"{key}.json"
    if cubin.exists() and meta.exists():
        return cubin, json.loads(meta.read_text())["lowered"]
    res = compile_names([name], arch)
    if not res.ok:
        raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{res.log}")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{key}.{os.getpid()}.tmp"
    tmp.write_bytes(res.cubin)
    os.replace(tmp, cubin)  # atomic: concurrent processes write the same bytes
    meta_tmp = root / f"{key}.{os.getpid()}.json.tmp"
    meta_tmp.write_text(json.dumps({"name": name, "lowered": res.lowered[name], "arch": arch}))
    os.replace(meta_tmp, meta)
    return cubin, res.lowered[name]


def _cached_one(args: tuple[str, str]) -> str:
    return cached_cubin(*args)[1]


def warm_cache(arch: str, names: list[str] | None = None, jobs: int | None = None) -> int:
    """Compile every specialisation for ``arch`` into the cubin cache, ``jobs`` at a time.

    A first GPU call compiles its kernel on demand (about a second each); this fills
    the cache ahead of time, one NVRTC process per core (the compiles are independent).

    Parameters
    ----------
    arch : str
        The target, e.g. ``"sm_90"``.
    names : list of str, optional
        Name expressions (default :func:`~.cuda.launch.specialisations`: all).
    jobs : int, optional
        Worker processes (default: the CPU count).

    Returns
    -------
    int
        How many cubins are now cached for ``arch``.

    Examples
    --------
    >>> from polynorm.backends.cuda import nvrtc
    >>> if nvrtc.available()[0]:                                   # doctest: +SKIP
    ...     nvrtc.warm_cache("sm_90", ["pn_colsum<float, float>"], jobs=1)
    1
    """
    from concurrent.futures import ProcessPoolExecutor

    todo = [(nm, arch) for nm in (cl.specialisations() if names is None else names)]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    if jobs == 1:
        return len([_cached_one(t) for t in todo])
    with ProcessPoolExecutor(jobs) as pool:
        return len(list(pool.map(_cached_one, todo)))
