"""Every kernel specialisation the dispatcher can request compiles with NVRTC.

No GPU or driver needed: NVRTC (``nvidia-cuda-nvrtc`` wheel, through
``cuda-bindings``) compiles the generated source to a cubin for sm_80 and sm_90,
with cuda_fp16.h / cuda_bf16.h from the ``nvidia-cuda-runtime`` wheel.  The
translation unit is compiled once per architecture with all name expressions
(and the two architectures in parallel), which keeps this to well under a
minute on two cores.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from polynorm.backends import _cuda_launch as cl

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) is not installed")

ARCHS = ("sm_80", "sm_90")


def _check(result, prog=None):
    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC error {err}" + (f":\n{_log(prog)}" if prog is not None else ""))
    return rest[0] if len(rest) == 1 else rest


def _log(prog) -> str:
    size = _check(nvrtc.nvrtcGetProgramLogSize(prog))
    buf = b" " * size
    _check(nvrtc.nvrtcGetProgramLog(prog, buf))
    return buf.decode(errors="replace").rstrip("\x00 \n")


def compile_all(arch: str, names: list[str]) -> dict:
    """Compile the generated source for ``arch`` with every name expression."""
    t0 = time.perf_counter()
    src = cl.source().encode()
    prog = _check(nvrtc.nvrtcCreateProgram(src, b"polynorm.cu", 0, [], []))
    try:
        for nm in names:
            _check(nvrtc.nvrtcAddNameExpression(prog, nm.encode()))
        opts = [*cl.NVRTC_OPTIONS, f"--gpu-architecture={arch}", *(f"-I{d}" for d in cl.include_dirs())]
        opts = [o.encode() for o in opts]
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _log(prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return {"ok": False, "log": log, "seconds": time.perf_counter() - t0}
        lowered = {nm: _check(nvrtc.nvrtcGetLoweredName(prog, nm.encode())) for nm in names}
        size = _check(nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin))
        return {"ok": True, "log": log, "lowered": lowered, "cubin": cubin,
                "seconds": time.perf_counter() - t0}
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@pytest.fixture(scope="module")
def compiled() -> dict:
    if not cl.include_dirs():
        pytest.skip("cuda_fp16.h not found: pip install nvidia-cuda-runtime-cu12")
    names = cl.specialisations()
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        results = dict(zip(ARCHS, pool.map(lambda a: compile_all(a, names), ARCHS), strict=True))
    return {"names": names, **results}


@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_every_specialisation_compiles(compiled, arch):
    res = compiled[arch]
    assert res["ok"], f"{arch} compile failed:\n{res['log']}"
    # every requested instantiation exists under a mangled name in the cubin
    for nm, low in res["lowered"].items():
        low = low.decode() if isinstance(low, bytes) else low
        assert low.startswith("_Z"), (nm, low)
        assert low.encode() in res["cubin"], f"{nm} ({low}) missing from the {arch} cubin"
    print(f"{arch}: {len(compiled['names'])} kernels in {res['seconds']:.1f}s, cubin {len(res['cubin'])} bytes")


def test_nvrtc_no_warnings(compiled):
    for arch in ARCHS:
        log = compiled[arch]["log"]
        assert "warning" not in log.lower(), f"{arch}:\n{log}"


def test_dispatch_only_requests_compiled_kernels():
    """Every launch the planner produces names a compiled specialisation."""
    names = set(cl.specialisations())
    for d in (1, 3, 7, 8, 63, 64, 1000, 1024, 4097, 8192, 16384, 40000, 262144):
        for n in (1, 5, 4096):
            for t in cl.FWD_TYPES:
                for big in (False, True):
                    assert cl.forward_launch(n, d, *t, force_big=big).name in names
            for t in cl.BWD_TYPES:
                for big in (False, True):
                    assert cl.backward_launch(n, d, *t, force_big=big).name in names
    for t in cl.COLSUM_TYPES:
        assert cl.colsum_launch(3, 10, *t).name in names


@pytest.mark.parametrize("d", [1, 2, 3, 7, 8, 9, 31, 64, 100, 1023, 4096, 8191, 16384, 20000, 65536, 262144])
@pytest.mark.parametrize("x", ["float16", "bfloat16", "float32", "float64"])
def test_launch_shapes_cover_the_row(d, x):
    """Launch invariants the kernels rely on (see codegen/ABI.md)."""
    vec = cl.VEC[x]
    for n in (1, 3, 1000):
        for launch in (cl.forward_launch(n, d, x), cl.backward_launch(n, d, x)):
            assert launch.block % 32 == 0 and 32 <= launch.block <= 1024
            if launch.big:
                assert launch.tpr == launch.block and 0 <= launch.stash <= d // vec
                assert launch.shared <= cl.DEFAULT_SMEM
            else:
                assert launch.block <= cl.REG_THREADS
                assert launch.tpr & (launch.tpr - 1) == 0 and vec <= launch.tpr <= launch.block
                items = int(launch.name.rsplit(",", 1)[1].strip(" >"))
                assert d // vec <= launch.tpr * items
                rows = launch.block // launch.tpr
                if "pn_fwd" in launch.name:
                    assert launch.grid * rows >= n
            if "pn_bwd" in launch.name:
                assert launch.ldp >= d and launch.partial_rows == launch.grid
