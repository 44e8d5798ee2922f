"""polynorm: RMSNorm and partial RMSNorm for every array library.

Public names: :func:`rms_norm`, :func:`add_rms_norm`, :func:`rms_norm_backward`,
:func:`rms_norm_gated`, :func:`rms_norm_gated_backward`, :func:`rms_norm_quant`, :func:`backends`,
and :data:`output_pool` (the CPU backend's bounded pool of freed output buffers).
The semantics are in :mod:`polynorm.core.options`.
"""

from polynorm.core.pool import output_pool
from polynorm.ops.gated import rms_norm_gated, rms_norm_gated_backward
from polynorm.ops.norm import add_rms_norm, add_rms_norm_, backends, rms_norm, rms_norm_backward
from polynorm.ops.qk import qk_norm, qk_norm_pair
from polynorm.ops.quant import rms_norm_quant
from polynorm.ops.split import (
    rms_norm_backward_from_stats,
    rms_norm_backward_stats,
    rms_norm_from_stats,
    rms_norm_stats,
)

__version__ = "0.1.0"

__all__ = [
    "rms_norm", "add_rms_norm", "rms_norm_backward", "rms_norm_gated", "rms_norm_gated_backward",
    "rms_norm_quant", "backends", "output_pool", "__version__",
    "rms_norm_stats", "rms_norm_from_stats", "rms_norm_backward_stats",
    "rms_norm_backward_from_stats",
    "add_rms_norm_",
]
__all__ += ["qk_norm", "qk_norm_pair"]
