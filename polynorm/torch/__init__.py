"""Differentiable RMSNorm for torch: autograd functions, custom ops and an ``nn.Module``.

:func:`polynorm.rms_norm` on a tensor computes on its data and records no
autograd history.  For training use this module: :func:`rms_norm` and
:func:`add_rms_norm` are differentiable, with polynorm's hand-written backward
(:func:`polynorm.rms_norm_backward`, fed the ``rstd`` saved by the forward),
and :class:`RMSNorm` is a drop-in for ``torch.nn.RMSNorm``.

What runs where:

- eager, with autograd recording: ``torch.autograd.Function``\\ s (the
  cheapest dispatch, ~12 us for a (1, 4096) call); without (``no_grad``,
  nothing requires grad): straight to :func:`polynorm.rms_norm` (~7 us).
- ``torch.compile`` (and ``torch.export``): the custom ops
  ``torch.ops.polynorm.rms_norm``, ``.add_rms_norm`` and
  ``.rms_norm_backward``, with fake (shape/dtype) implementations and the same
  backward registered through ``torch.library.register_autograd``.  The
  compiler keeps them in its graph: ``fullgraph=True`` works, no graph break.
  They run the same kernels, so compiled and eager results are the same bits.
  Called directly in eager mode they cost ~8 us more per call (~36 us with
  autograd), which is why eager calls do not use them.

:func:`patch` / :func:`unpatch` / :func:`patched` swap the RMSNorm modules of
a Hugging Face ``transformers`` model for polynorm ones (see ``polynorm.torch.hf``).

CPU tensors run on the Numba kernels through zero-copy views; CUDA tensors on
the CuPy kernels through DLPack (that path is not tested on a machine without
a GPU).

``torch.func`` (``vmap``, ``grad``, ``vjp``, ``jacrev``) and ``torch.jit.trace``
run the custom ops too: they carry vmap rules (a ``vmap`` over tokens is one
kernel call; a ``vmap`` over weights, and every batched backward, one call
per slice, since ``dweight`` sums over the tokens of one slice), and
``autograd.Function``\\ s with ``setup_context`` for ``torch.func``'s
gradients.  Forward-mode AD (``jvp``, ``jacfwd``, ``hessian``,
``torch.autograd.forward_ad``) raises ``NotImplementedError``.

The backward is not itself differentiable: a second derivative through it
(``create_graph=True`` and a second ``backward``/``autograd.grad``,
``gradgradcheck``, nested ``torch.func.grad``/``jacrev``)
raises ``NotImplementedError`` when it reaches the norm, instead of
treating the norm's gradient as a constant.
"""


from polynorm.torch.gated import RMSNormGated, rms_norm_gated
from polynorm.torch.hf import PatchedRMSNorm, patch, patched, unpatch
from polynorm.torch.inplace import add_rms_norm_
from polynorm.torch.norm import RMSNorm, add_rms_norm, rms_norm
from polynorm.torch.qk import qk_norm, qk_norm_, qk_norm_pair
from polynorm.torch.quant import rms_norm_quant

__all__ = [
    "rms_norm", "add_rms_norm", "RMSNorm", "patch", "unpatch", "patched", "PatchedRMSNorm",
    "rms_norm_gated", "RMSNormGated", "rms_norm_quant", "add_rms_norm_",
]
__all__ += ["qk_norm", "qk_norm_", "qk_norm_pair"]
