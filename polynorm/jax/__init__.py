"""Differentiable RMSNorm for jax: ``jax.custom_vjp`` on polynorm's hand-written backward.

:func:`polynorm.rms_norm` on jax arrays computes on their data and records no
derivative (under ``jax.jit`` it runs the pure array-API reference); these
functions add the derivative, so ``jax.grad``/``jax.vjp`` use
:func:`polynorm.rms_norm_backward` instead of differentiating the forward.

What runs where (forward and backward alike):

- eager, concrete CPU arrays (also the primal and backward computations of
  an eager ``jax.grad``/``jax.vjp``): the Numba kernels on zero-copy views of
  the arrays; results come back to jax without a copy.
- eager jax arrays all on one CPU device go to the kernels as numpy views
  (zero-copy) and the results come back to jax: below 1 MiB copied by
  ``jnp.asarray``, larger ones without a copy.  ~50-70 us at (1, 4096) on 2
  loaded cores, where a jitted jnp RMSNorm takes ~12-25 us and the general
  path (jax reshapes, a ``device_put`` per result) took ~250-470 us
  (``bench/jax_jit.py``).
- traced arrays (``jax.jit``, ``vmap``, ``scan``, ``grad`` of ``jit``...),
  ``backend="auto"``: the pure array-API reference, which XLA compiles and
  fuses like any jnp code (other bits than the kernels: within the dtype's
  tolerance), at every size: the kernels through the FFI call below win
  only for 16-bit ``x`` of about 2**22 to 2**23 elements (bfloat16
  2048 x 4096: 2.5-3.9x a jitted jnp RMSNorm on 2 shared cores; float32 and
  other sizes lose, ``bench/results/jax-jit-2026-12-06.json``), and a rule
  that took them there would make a token's bits depend on the number of
  tokens; ``backend="numba"`` asks for them.
- traced arrays, ``backend="numba"``: the Numba kernels inside the
  compiled computation, with the same bits as an eager call: an XLA FFI
  custom call whose handler (:mod:`polynorm.jax.ffi`) hands the kernels
  XLA's own buffers (``y`` is written in place; ``rstd``, ``h`` and the
  gradients are copied into XLA's buffers), or ``jax.pure_callback`` where
  this jax cannot take the FFI handler.  Measured on 2 cores, float32: as
  fast as a jitted jnp RMSNorm at 16384 x 4096 (~60 ms, most of it the first
  touch of XLA's fresh output buffer; the kernel alone: ~10 ms), but
  ~20 us more per call at (1, 4096): use it for bit-identical results.
  Under ``vmap`` the kernels run once per batch element (``"sequential"``).
  XLA cannot split the host call: a sharded input is gathered and every
  device runs it on the whole array (the result comes back replicated).
- concrete CUDA arrays: the CuPy kernels through DLPack when cupy is
  installed (not tested on a machine without a GPU).
- concrete arrays on several devices (sharded, e.g. ``NamedSharding`` over
  a mesh), with ``weight``/``bias`` replicated on the same devices: the
  pure array-API reference through jnp, which XLA partitions: rows per
  shard, results sharded as ``x``, the reference's bits.  Eager jnp compiles
  each operation for every new shape and sharding (a first call costs
  seconds, later ones milliseconds); under ``jit`` it is one compilation.

Results come back on ``x``'s device: committed to it when ``x`` is
(``jax.device_put(x, jax.devices()[1])``), else uncommitted on the default
device, as jnp places the result of uncommitted inputs; the gradients of an
eager ``jax.grad`` likewise.  Arrays committed to different devices (or
device sets) are a ``ValueError``, as in jnp; an uncommitted array goes with
any CPU placement (jnp moves it).  With an uncommitted ``x`` and a weight
committed elsewhere the result stays uncommitted on ``x``'s device (jnp
would commit it to the weight's), and jax moves it where it meets the weight.

Only reverse mode is defined (a ``custom_vjp`` has no forward-mode rule).
Needs ``pip install 'polynorm[jax]'``.
"""

from polynorm.jax.gated import rms_norm_gated
from polynorm.jax.norm import add_rms_norm, rms_norm
from polynorm.jax.qk import qk_norm
from polynorm.jax.quant import rms_norm_quant

__all__ = ["rms_norm", "add_rms_norm", "rms_norm_gated", "rms_norm_quant"]
__all__ += ["qk_norm"]
