"""CPU emulation of CUDA kernels for the tests: see :mod:`tests.emulator.harness`."""

from .harness import (
    CompileError,
    EmulatorUnavailable,
    KernelError,
    Module,
    Param,
    Ptr,
    compile_source,
    default_workers,
    toolchain,
)

__all__ = [
    "CompileError",
    "EmulatorUnavailable",
    "KernelError",
    "Module",
    "Param",
    "Ptr",
    "compile_source",
    "default_workers",
    "toolchain",
]
