"""The front end: one module per op family, each validation + dispatch.

:mod:`~polynorm.ops.norm` (``rms_norm``, ``add_rms_norm``, ``rms_norm_backward``,
and the shared steps: namespace, canonical 2-D layout, ``Plan``, backend choice),
:mod:`~polynorm.ops.gated`, :mod:`~polynorm.ops.quant`, :mod:`~polynorm.ops.lean`
(the memory-lean training modes), and the fast paths :mod:`~polynorm.ops.fast`
(host arrays) and :mod:`~polynorm.ops.fast_cuda` (torch CUDA tensors).  The public
names are re-exported by :mod:`polynorm`.
"""
