"""Test machinery shared by every backend.

Tests take the ``case`` fixture, a :class:`Case` for each :class:`Backend`:
an array library plus the ``backend=`` keyword to force.  A backend joins the
whole suite by adding one entry to :data:`CASES`; cases whose library or
backend is missing here are skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn

# jax with two CPU devices (set before jax starts its backend; nothing above imports
# jax), so that the placement tests have a device besides the default one: results on
# cpu:1 stay there, sharded arrays span a mesh.  cpu:0 stays the default device.
if "jax" not in sys.modules and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        (os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2")).strip()

NP_DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


class Backend(Enum):
    """Array library x polynorm backend combinations the suite runs on."""

    NUMPY_REFERENCE = "numpy-reference"
    STRICT = "array_api_strict"
    TORCH = "torch"
    DASK = "dask"
    JAX = "jax"
    NUMBA = "numba"
    CUPY = "cupy"


@dataclass(frozen=True)
class Case:
    """How to make arrays for one :class:`Backend` and read them back."""

    backend_enum: Backend
    module: str  # the array library that must be importable
    backend: str  # passed as backend=
    make: Callable[[np.ndarray], Any]
    read: Callable[[Any], np.ndarray]
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
    needs: str | None = None  # a polynorm backend that must be usable
    mutable: bool = True  # supports out= / in-place
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.backend_enum.value

    def asarray(self, a: np.ndarray, dtype: str | None = None) -> Any:
        """A copy of numpy ``a`` in this library, cast to ``dtype`` (a name)."""
        a = np.asarray(a)
        if dtype is not None:
            a = a.astype(NP_DTYPES[dtype])
        return self.make(a)

    def to_numpy(self, a: Any) -> np.ndarray:
        return None if a is None else self.read(a)

    def skip_unless_dtype(self, dtype: str) -> None:
        if dtype not in self.dtypes:
            pytest.skip(f"{self.name} has no {dtype}")


# ---------------------------------------------------------------- per-library adapters


def _np_make(a):
    return np.array(a, copy=True)


def _np_read(a):
    return np.asarray(a)


def _strict_make(a):
    import array_api_strict as xs

    return xs.asarray(np.array(a, copy=True))


def _strict_read(a):
    return np.asarray(a)


def _torch_make(a):
    import torch

    if a.dtype == NP_DTYPES["bfloat16"]:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))


def _torch_read(a):
    import torch

    a = a.detach().cpu()
    if a.dtype == torch.bfloat16:
        return a.float().numpy().astype(NP_DTYPES["bfloat16"])
    return a.numpy()


def _dask_make(a):
    import dask.array as da

    # tokens chunked, the last axis whole (the layout polynorm's dask backend wants)
    chunks = tuple(max(1, s // 2) for s in a.shape[:-1]) + a.shape[-1:]
    return da.from_array(np.array(a, copy=True), chunks=chunks)


def _dask_read(a):
    return np.asarray(a.compute())


def _jax_make(a):
    import jax.numpy as jnp

    return jnp.asarray(a)


def _jax_read(a):
    return np.asarray(a)


def _cupy_make(a):
    import cupy

    try:
        return cupy.asarray(a)
    except (TypeError, ValueError) as exc:  # bfloat16 before cupy 14
        pytest.skip(f"cupy {cupy.__version__} cannot hold {a.dtype}: {exc}")


def _cupy_read(a):
    return a.get()


CASES: dict[Backend, Case] = {
    Backend.NUMPY_REFERENCE: Case(Backend.NUMPY_REFERENCE, "numpy", "array_api", _np_make, _np_read),
    Backend.STRICT: Case(
        Backend.STRICT, "array_api_strict", "auto", _strict_make, _strict_read,
        dtypes=("float32", "float64"),
    ),
    Backend.TORCH: Case(Backend.TORCH, "torch", "auto", _torch_make, _torch_read),
    Backend.DASK: Case(Backend.DASK, "dask", "auto", _dask_make, _dask_read, mutable=False),
    Backend.JAX: Case(Backend.JAX, "jax", "auto", _jax_make, _jax_read, mutable=False),
    Backend.NUMBA: Case(Backend.NUMBA, "numba", "numba", _np_make, _np_read, needs="numba"),
    Backend.CUPY: Case(Backend.CUPY, "cupy", "cupy", _cupy_make, _cupy_read, needs="cupy"),
}


#: ``POLYNORM_TEST_CASES=numpy-reference,torch`` runs only those cases (tox uses it:
#: one env per backend); unset runs every case whose library is installed.
_SELECTED = {s.strip() for s in os.environ.get("POLYNORM_TEST_CASES", "").split(",") if s.strip()}
_unknown = _SELECTED - {b.value for b in Backend}
if _unknown:
    raise ValueError(
        f"POLYNORM_TEST_CASES names unknown cases {sorted(_unknown)}; "
        f"known: {[b.value for b in Backend]}"
    )


def _skip_reason(case: Case) -> str | None:
    if _SELECTED and case.name not in _SELECTED:
        return f"not selected by POLYNORM_TEST_CASES={os.environ['POLYNORM_TEST_CASES']}"
    if importlib.util.find_spec(case.module) is None:
        return f"{case.module} is not installed"
    if case.needs is not None:
        usable, reason = pn.backends()[case.needs]
        if not usable:
            return f"backend {case.needs} unusable: {reason}"
    return None


@pytest.fixture(params=list(CASES), ids=lambda b: b.value)
def case(request) -> Case:
    """Every backend case; skipped where its library or backend is missing."""
    c = CASES[request.param]
    reason = _skip_reason(c)
    if reason:
        pytest.skip(reason)
    if c.module == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
    return c


@pytest.fixture
def forked() -> Callable[[Callable], tuple[int | None, Any]]:
    """``run(target)``: ``target(queue)`` in a forked child; ``(exit code, what it put)``."""
    import multiprocessing

    def run(target):
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=target, args=(q,))
        p.start()
        got = q.get(timeout=120)
        p.join(60)
        return p.exitcode, got

    return run


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)


# ---------------------------------------------------------------- the long sweeps
#
# The default run (``python -m pytest``) tests every feature on every backend; the
# sweeps below repeat features over more dtype mixes, layouts and hypothesis
# examples.  Each new (dtype, layout) combination compiles a Numba kernel variant
# (10-30 s of CPU), so they carry the ``slow`` marker: ``pytest -m slow`` runs them,
# and .ci/run does.  One pattern list, matched against node ids, keeps the choice in
# one place (``*`` is the only wildcard); a parameter left out of a pattern stays
# in the default run.
SLOW_SWEEPS = (
    # group_size: the fused-add/eps-outside fd config and the group-size sweep (the plain
    # grouped fd config and the per-backend formula tests stay in the default run)
    "tests/test_backward_fd.py::test_backward_matches_central_differences[*-grouped-add-*",
    "tests/test_group_conventions.py::test_grouped_float64_matches_the_formula_closely",
    # quantized output: every dtype x format x scale mode x options (test_quant's targeted
    # cases stay in the default run)
    "tests/test_quant.py::test_sweep[*",
    # hypothesis over shapes, layouts, dtypes and options (the emulated CUDA one stays)
    "tests/test_batch_invariance.py::test_a_tokens_bits_do_not_depend_on_the_batch[*",
    # pn_fwd_small vs pn_fwd over the options: the plain sweep stays in the default run
    "tests/test_emul_kernels.py::test_emul_small_rows_same_bits_as_pn_fwd[residual_f32-*",
    "tests/test_emul_kernels.py::test_emul_small_rows_same_bits_as_pn_fwd[llama_offset-*",
    # pn_bwd_small vs pn_bwd over the options: the plain sweep stays in the default run
    *(f"tests/test_emul_kernels.py::test_emul_small_bwd_same_bits_as_pn_bwd[{o}-*"
      for o in ("no_weight", "bias_no_weight", "partial", "eps_outside", "rstd_given", "grad_residual",
                "weight_f32", "dy_f32", "everything")),
    # layouts x dtypes: serial float32 stays in the default run
    "tests/test_edge_cases.py::test_bits_do_not_depend_on_layout[parallel-*",
    "tests/test_edge_cases.py::test_bits_do_not_depend_on_layout[serial-bfloat16]",
    "tests/test_edge_cases.py::test_bits_do_not_depend_on_layout[serial-float64]",
    # dtype mixes: the first mix of each stays in the default run
    "tests/test_accuracy.py::test_out_dtype[*-float32-float16]",
    "tests/test_accuracy.py::test_out_dtype[*-float64-bfloat16]",
    "tests/test_accuracy.py::test_out_dtype[*-float16-float64]",
    "tests/test_accuracy.py::test_out_dtype[*-float32-float64]",
    "tests/test_accuracy.py::test_weight_dtype_differs_from_x[*-float16-float32]",
    "tests/test_accuracy.py::test_weight_dtype_differs_from_x[*-float32-float64]",
    "tests/test_accuracy.py::test_weight_dtype_differs_from_x[*-float32-bfloat16]",
    "tests/test_accuracy.py::test_weight_dtype_differs_from_x[*-float64-float32]",
    "tests/test_accuracy.py::test_add_matches_oracle[*-float16-bfloat16]",
    "tests/test_accuracy.py::test_add_matches_oracle[*-bfloat16-float32]",
    "tests/test_numba.py::test_mixed_dtypes_fused_add[*",
    "tests/test_numba.py::test_out_dtype_rounds_once[float16]",
    "tests/test_numba.py::test_out_dtype_rounds_once[float64]",
    "tests/test_numba.py::test_out_dtype_rounds_once[bfloat16]",
    # strided and streamed variants: float32 stays
    "tests/test_numba.py::test_strided_inputs[bfloat16-*",
    "tests/test_numba.py::test_streamed_out_equals_ordinary[*bfloat16*",
    "tests/test_numba.py::test_streamed_out_equals_ordinary[*float16*",
    "tests/test_numba.py::test_streamed_out_equals_ordinary[*-float64-float32-None]",
    "tests/test_layout.py::test_read_only_and_zero_stride_input[torch-*",
    "tests/test_layout.py::test_read_only_and_zero_stride_input[jax-*",
    "tests/test_layout.py::test_read_only_and_zero_stride_input[dask-*",
    "tests/test_layout.py::test_strided_and_negatively_strided_inputs[torch-*",
    "tests/test_layout.py::test_strided_and_negatively_strided_inputs[jax-*",
    "tests/test_layout.py::test_strided_and_negatively_strided_inputs[dask-*",
    # the emulated CUDA batch invariance in bfloat16 (float32 stays), jit with every
    # option in bfloat16 (plain bfloat16 and float32 with every option stay), inductor
    # (torch.compile fullgraph stays)
    "tests/test_batch_invariance.py::test_emulated_cuda_kernels_are_batch_invariant[bfloat16]",
    "tests/test_jax.py::test_jit_runs_the_kernels_with_the_eager_bits[bfloat16-all]",
    "tests/test_torch.py::test_torch_compile_inductor",
    # torch.compile fullgraph through the functional options (~9 s of inductor; the
    # patched model's fullgraph compile stays), the HF models in float32 (bfloat16 stays)
    "tests/test_torch.py::test_torch_compile_fullgraph_functional_options",
    "tests/test_hf_patch.py::test_model_logits_and_gradients_match_hf[*-torch.float32]",
    # the gated kernel's parallel rows in float32 (bfloat16 stays)
    "tests/test_gated.py::test_numba_parallel_rows_invariant[float32]",
    # NVRTC compiles of every specialisation and their machine-code targets (~50 s per
    # architecture): the default run compiles one kernel (test_nvrtc_cached_cubin)
    "tests/test_nvrtc.py::test_nvrtc_every_specialisation_compiles[*",
    "tests/test_nvrtc.py::test_nvrtc_no_warnings[*",
    "tests/test_nvrtc.py::test_sass_targets[*",
    # dask on a local cluster in 16-bit (its workers compile their own kernels; float32
    # and float64 stay), the public-API fuzz through torch (numpy, reference, dask stay),
    # the emulated GPU bench records (the launch-record and JSON tests stay)
    "tests/test_dask.py::test_cluster_forward_and_backward_match_in_memory[float16]",
    "tests/test_dask.py::test_cluster_forward_and_backward_match_in_memory[bfloat16]",
    "tests/test_fuzz.py::test_fuzz_public_api[torch]",
    "tests/test_bench_gpu.py::test_bench_gpu_records",
    # the emulated fusion kernels in float16 and float64 (each dtype is one g++ build;
    # float32 and bfloat16 stay), the backward's recomputed rstd and the row-split tree
    # at 2100 rows in float16 and float64 (float32 and bfloat16 stay)
    "tests/test_emul_fusions.py::test_emul_quant_bits_of_pn_fwd_then_reference_quantize[*-float16]",
    "tests/test_emul_fusions.py::test_emul_quant_bits_of_pn_fwd_then_reference_quantize[*-float64]",
    "tests/test_emul_fusions.py::test_emul_gated_forward[float16]",
    "tests/test_emul_fusions.py::test_emul_gated_forward[float64]",
    "tests/test_emul_fusions.py::test_emul_gated_backward[float16]",
    "tests/test_emul_fusions.py::test_emul_gated_backward[float64]",
    "tests/test_numba_bwd_pipeline.py::test_recomputed_rstd_is_the_forwards[*-float16]",
    "tests/test_numba_bwd_pipeline.py::test_recomputed_rstd_is_the_forwards[*-float64]",
    "tests/test_rowtree.py::test_any_split_of_the_rows_gives_the_same_bits[2100-130-float16]",
    "tests/test_rowtree.py::test_any_split_of_the_rows_gives_the_same_bits[2100-130-float64]",
    # variants that are the only default users of a kernel specialisation (~4-6 s of
    # compile each: bench/compile_census.py prints a test's seconds): the row tree's parallel
    # blocks in bfloat16 and float64 (float32 stays), the emulated gated forward in
    # bfloat16 (float32 stays), opcheck without a weight (plain, all, axis-middle
    # stay), the fast path's mixed-dtype backward (its forward and add stay), the
    # bfloat16 output-saving bound (float32's saving tests stay), the README's
    # float64 claim at (64, 16, 4096) ((64, 1024) stays), jax's bfloat16 llama
    # path under jit (float32 stays), the numba quantizer with a residual (the
    # fast-path test's residual stays)
    "tests/test_rowtree.py::test_any_split_of_the_rows_gives_the_same_bits[2100-130-bfloat16]",
    "tests/test_rowtree.py::test_kernel_sums_dbias_over_the_defined_tree[bfloat16-4099]",
    "tests/test_rowtree.py::test_kernel_sums_dbias_over_the_defined_tree[float64-4099]",
    "tests/test_emul_fusions.py::test_emul_gated_forward[bfloat16]",
    "tests/test_torch.py::test_opcheck_forward_ops[no-weight]",
    "tests/test_numba.py::test_fast_path_equals_generic_path[rms_norm_backward]",
    "tests/test_lean.py::test_bfloat16_output_saving_within_bfloat16_precision",
    "tests/test_docs.py::test_readme_claim_default_casting_has_torch_rms_norm_bits_where_rstd_agrees"
    "[(64, 16, 4096)-float64]",
    "tests/test_jax.py::test_jit_runs_the_kernels_with_the_eager_bits[bfloat16-llama-axis]",
    "tests/test_quant.py::test_residual[numba]",
    # QK-norm: float16 and the llama kernels of float32/float16 compile kernels of their own;
    # float32/bfloat16 and llama bfloat16 (Qwen3's) stay in the default run
    "tests/test_qk.py::test_qk_norm_is_rms_norm_per_head[*-float16-*",
    "tests/test_qk.py::test_qk_norm_is_rms_norm_per_head[llama-float32-*",
    "tests/test_qk.py::test_qk_norm_rope_bits[*-*-float32-array_api]",
    "tests/test_qk_torch.py::test_qk_norm_backward_fd[gemma-outside-neox-partial]",
    "tests/test_qk_torch.py::test_qk_norm_backward_fd[gemma-outside-gptj]",
    "tests/test_emul_qk.py::test_emul_qk_bits[norm-only-d40-bfloat16]",
    # the new features' heaviest duplicates in the default run (each keeps a cheaper sibling
    # there): the torch bfloat16 grouped forward (torch float32 and every other case stay),
    # torch's grouped fd (numpy/numba grouped fd stay), per-head fd with the add (plain
    # stays), Gemma-3's bfloat16 logits and AdamW steps (Qwen3's fused bfloat16 row and the
    # patched Gemma-3 state-dict round trip stay)
    "tests/test_group_conventions.py::test_grouped_forward_is_mambas_rms_norm_ref[torch-bfloat16]",
    "tests/test_backward_fd.py::test_backward_matches_central_differences[torch-grouped]",
    "tests/test_per_head.py::test_per_head_backward_matches_central_differences[add]",
    "tests/test_hf_patch.py::test_model_logits_and_gradients_match_hf[gemma3-torch.bfloat16]",
    "tests/test_hf_patch.py::test_adamw_steps_give_the_same_losses[gemma3]",
    # kernels only these variants compile (the default run has grown with the rows-body CUDA
    # kernels' emulator builds and the jax kernel call): the one-pass fused add with a
    # float16 or mixed-dtype residual ([None-bfloat16] stays), the numba grouped forward in
    # bfloat16 (float32 stays), jax's eager zero-copy results in float16/float64 (float32,
    # bfloat16 stay), the float16 gated decode call (float32, bfloat16 stay), DeepSeek-V3's
    # bfloat16 logits (Qwen3's stay)
    "tests/test_add_conventions.py::test_numba_one_pass_equals_the_two_pass_form[None-float16-numba]",
    "tests/test_add_conventions.py::test_numba_one_pass_equals_the_two_pass_form[float16-bfloat16-numba]",
    "tests/test_add_conventions.py::test_numba_one_pass_equals_the_two_pass_form[float32-bfloat16-numba]",
    "tests/test_add_conventions.py::test_numba_one_pass_equals_the_two_pass_form[float32-float16-numba]",
    "tests/test_group_conventions.py::test_grouped_forward_is_mambas_rms_norm_ref[numba-bfloat16]",
    "tests/test_jax.py::test_eager_results_are_the_kernels_own_memory[float16]",
    "tests/test_jax.py::test_eager_results_are_the_kernels_own_memory[float64]",
    "tests/test_decode.py::test_gated_decode_bits_equal_generic[float16-gkw2]",
    "tests/test_hf_patch.py::test_model_logits_and_gradients_match_hf[deepseek_v3-torch.bfloat16]",
    # the torch oracle cases at 2-4 s each in the full run (the torch dispatch is the same for
    # every dtype; float32 plain and bfloat16 weight-bias stay, every backend's dtypes stay)
    "tests/test_accuracy.py::test_forward_matches_oracle[torch-float16-plain]",
    "tests/test_accuracy.py::test_forward_matches_oracle[torch-float16-weight-bias]",
    "tests/test_accuracy.py::test_forward_matches_oracle[torch-bfloat16-plain]",
    "tests/test_accuracy.py::test_forward_matches_oracle[torch-float32-weight-bias]",
    "tests/test_accuracy.py::test_forward_matches_oracle[torch-float64-plain]",
    "tests/test_accuracy.py::test_forward_matches_oracle[torch-float64-weight-bias]",
    "tests/test_accuracy.py::test_backward_matches_oracle[torch-float16-plain]",
    "tests/test_accuracy.py::test_backward_matches_oracle[torch-float16-weight-bias]",
    "tests/test_accuracy.py::test_backward_matches_oracle[torch-bfloat16-plain]",
    "tests/test_accuracy.py::test_backward_matches_oracle[torch-float32-weight-bias]",
    "tests/test_accuracy.py::test_backward_matches_oracle[torch-float64-plain]",
    "tests/test_accuracy.py::test_backward_matches_oracle[torch-float64-weight-bias]",
    "tests/test_accuracy.py::test_no_spurious_overflow_or_underflow[torch-float16-60000.0-1e-06]",
    "tests/test_accuracy.py::test_no_spurious_overflow_or_underflow[torch-float64-1e+200-1e-06]",
    # parallel-driver specialisations only these variants compile (Numba's compile events per
    # test): the one-pass fused add with a float16 x or a residual_dtype, through either
    # entry point (the bfloat16 x with h in x's dtype stays, through both), the numba
    # quantizer in float64 (the reference's float64 case stays; float32 and bfloat16
    # quantize with Numba in the default run), jax's eager zero-copy results in bfloat16
    # (float32 stays), the row tree's dweight in float16 (bfloat16 and float32 stay)
    *(f"tests/test_add_conventions.py::test_numba_one_pass_equals_the_two_pass_form[{h}-{x}-auto]"
      for h, x in (("None", "float16"), ("float16", "float16"), ("float16", "bfloat16"),
                   ("float32", "bfloat16"), ("float32", "float16"))),
    "tests/test_add_conventions.py::test_numba_one_pass_equals_the_two_pass_form[float16-float16-numba]",
    "tests/test_quant.py::test_dequantized_matches_float64_oracle[*-numba]",
    "tests/test_jax.py::test_eager_results_are_the_kernels_own_memory[bfloat16]",
    "tests/test_rowtree.py::test_kernel_sums_dweight_over_the_defined_tree[*-float16]",
    # integration cases of 5-8 s that a cheaper default case covers: Qwen3-Next's bfloat16
    # model (its gated module's rounding test stays), the two-process gloo run, torch's
    # partial-size selection and its partial backward in float64/float16 (numpy's selection,
    # torch's plain and weight-bias backward, every dtype's partial case on numpy and numba
    # stay)
    "tests/test_hf_patch.py::test_model_logits_and_gradients_match_hf[qwen3_next-torch.bfloat16]",
    "tests/test_torch_distributed.py::test_split_hidden_axis_and_dtensor_on_two_gloo_processes",
    "tests/test_accuracy.py::test_partial_size_and_partial_k_over_d_select_k[torch]",
    "tests/test_accuracy.py::test_backward_matches_oracle[torch-float64-partial-outside-offset]",
    "tests/test_accuracy.py::test_backward_matches_oracle[torch-float16-partial-outside-offset]",
    # the emulated CUDA kernels with a float16 x: their library (every specialisation of that
    # x dtype) is the costliest g++ build of the default run after bfloat16's (~20 s) and
    # its ~220 cases ~15 s more (warm); bfloat16 (the other 16-bit x, the same templates with another
    # storage type), float32 and float64 stay in the default run with every option and size,
    # and the prelude's half conversions (test_emul_prelude.py) stay
    "tests/test_emul_kernels.py::*-float16]",
    "tests/test_emul_kernels.py::*[float16]",
    "tests/test_emul_bwd_rows.py::*-float16]",
    "tests/test_emul_bwd_rows.py::*[float16]",
    "tests/test_emul_bwd_rows.py::*[float16-*",
    "tests/test_emul_fwd_rows.py::*-float16]",
    "tests/test_emul_fwd_rows.py::*[float16]",
    "tests/test_emul_fwd_rows.py::*[float16-*",
    "tests/test_emul_fusion_rows.py::*[float16]",
    "tests/test_emul_fusion_rows.py::*[float16-*",
    "tests/test_emul_fusions.py::test_emul_fusion_backend_glue[float16]",
    "tests/test_emul_none.py::*[float16]",
    "tests/test_emul_split.py::*[float16]",
    "tests/test_emul_split.py::*[float16-*",
    "tests/test_emul_cupy_backend.py::*[smem*-float16-*",
    "tests/test_emul_cupy_backend.py::*[smem*-float16]",
    "tests/test_emul_cupy_backend.py::*-float16]",
    "tests/test_emul_cupy_backend.py::*-float16-*",
    # Numba specialisations that only these cases call (bench/kernel_users.py on a warm cache,
    # their compile seconds from bench/compile_census.py): the grouped batch invariance in
    # bfloat16 (~7 s: its grouped rows' layout; float32's reuses a kernel the default run has),
    # the streamed-dx stage in float64 (~3 s: the only float64 parallel-blocks backward; the
    # float32 cases, every alignment and option, stay)
    "tests/test_group_conventions.py::test_grouped_batch_invariant[bfloat16]",
    "tests/test_numba_bwd_pipeline.py::test_streamed_dx_equals_ordinary[*-float64]",
    # jax's check_grads of qk_norm with GPT-J's rotation (~3 s of tracing and fd; the plain
    # norm and NeoX's rotation stay, and every rotation's per-head fd stays on torch)
    "tests/test_qk_jax.py::test_qk_norm_vjp_fd[gptj]",
    # NVRTC with ptxas -v for three pn_none_fwd instantiations (~4 s): like the other NVRTC
    # compiles above, the default run keeps test_nvrtc_cached_cubin's one kernel
    "tests/test_emul_none.py::test_nvrtc_none_compiles_without_spills",
    # dtype crossings whose every Numba specialisation only these cases call (bench/kernel_users.py
    # on the default run), each axis of the crossing staying in the default run (~10 s cold,
    # bench/results/compile-census-2026-12-07-crossings.txt): llama casting of a float16 x with a
    # float32 weight against the oracle's emulation and the HF transcription, every backend
    # (test_llama_casting_matches_torch_hf keeps that crossing on every backend; a bfloat16 x with
    # a float32 weight and a float16 x with a float16 weight stay in all three tests); float16
    # and float64 rows at d = 262144 (the parallel drivers and the long rows stay in float32 and
    # bfloat16, both dtypes' rows stay at d <= 4096); out_dtype float64 spelled as a scalar type
    # or dtype (the spellings are parsed alike for every dtype: float16, bfloat16, float32 stay);
    # eps=None in float32 (the float32 opmath epsilon of the bfloat16 case, which stays, as does
    # float64's)
    "tests/test_accuracy.py::test_llama_casting_matches_hf_transcription[*-float16-float32]",
    "tests/test_accuracy.py::test_llama_casting_matches_oracle_emulation[*-float16-float32]",
    "tests/test_numba.py::test_forward_backward_sizes[float16-262144]",
    "tests/test_numba.py::test_forward_backward_sizes[float64-262144]",
    "tests/test_api_inputs.py::test_out_dtype_as_a_scalar_type_or_dtype_object[float64-*",
    "tests/test_torch.py::test_functional_eps_none_is_the_modules_and_torchs_default[float32]",
)


_SLOW_RE = re.compile("|".join(re.escape(p).replace(r"\*", ".*") for p in SLOW_SWEEPS))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _SLOW_RE.fullmatch(item.nodeid):
            item.add_marker(pytest.mark.slow)
