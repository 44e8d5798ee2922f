"""Differentiable RMSNorm for jax: ``jax.custom_vjp`` on polynorm's hand-written backward.

:func:`polynorm.rms_norm` on jax arrays computes on their data and records no
derivative (under ``jax.jit`` it takes :func:`rms_norm`'s route below); these
functions add the derivative, so ``jax.grad``/``jax.vjp`` use
:func:`polynorm.rms_norm_backward` instead of differentiating the forward.

What runs where (forward and backward alike):

- eager, concrete CPU arrays (also the primal and backward computations of
  an eager ``jax.grad``/``jax.vjp``): the Numba kernels on zero-copy views of
  the arrays; results come back to jax without a copy.
- ``backend="auto"`` (or ``"numba"``) in a process whose jax has one CPU
  device, :func:`rms_norm`'s plain forward (no residual, the last axis, a
  ``(d,)`` weight/bias, not ``casting="llama"``/``"none"``, no
  ``group_size``): the Numba kernels through compiled XLA FFI handlers
  (:mod:`polynorm.backends.numba.xla`: machine code that reads XLA's call
  frame and runs the kernels on XLA's own buffers, no Python per call), with
  the eager kernels' bits at every size (so a token's bits do not depend on
  the batch):

  - under ``jax.jit`` (also ``vmap``, whose batch axis the handlers walk,
    and ``grad``: see the backward below): without bias, with ``y`` in ``x``'s dtype and ``eps`` of at
    least ``1e-30`` (``polynorm.jax.norm._xla_elementwise``), the kernels
    compute only ``rstd`` (``polynorm_rstd_*``) and XLA the elementwise pass
    ``y = x * rstd * (weight + offset)``, which it fuses with the program's
    neighbouring operations (the kernels' own output pass is these products,
    each rounded once: the same bits); from 32 MiB its ``y`` is written on
    huge pages (``_on_huge_pages``: a select over a buffer that the
    ``polynorm_huge_pages`` handler asks them for, which XLA gives the pass
    for its output).  bfloat16 ``x`` from 32 MiB
    (``BF16_KERNEL_PASS_MIN_BYTES``: XLA's loop fusion converts bfloat16
    slower than the kernel) and other calls take the whole kernel
    call (``polynorm_forward_*``; from 64 Ki elements in row chunks on XLA's
    own thread pool; a ``y`` of 256 KiB and more gets an operand that XLA's
    cost analysis counts, so that XLA runs it asynchronously as it runs the
    jnp formula: ``XLA_ASYNC_MIN_BYTES``).  On other platforms (GPU) the
    same function lowers the reference (``lax.platform_dependent``);
  - :func:`add_rms_norm` under ``jax.jit`` with the default conventions (no
    bias, ``residual`` of ``x``'s dtype and shape, ``norm_input="h"``):
    ``h = x + residual`` and ``y`` from XLA, ``rstd`` of ``h`` from the
    kernels: the eager fused kernel's ``y`` and ``h`` bit for bit;
  - the backward of both under ``jax.jit``/``grad`` (with ``dy`` of ``x``'s
    dtype; the residual stream's gradient fused into ``dx``): the compiled
    backward handler (``polynorm_backward_*``), the eager backward's kernels
    and row tree on XLA's buffers, its bits (``dx`` and ``dweight`` do not
    depend on the batch); from 64 Ki elements its aligned row blocks run on
    XLA's thread pool; under ``vmap`` once per batch element;
  - eager CPU jax arrays below ``polynorm.jax.norm.EAGER_JIT_MAX_BYTES``
    (32 MiB of ``x``): a jitted call of the above, cached per options and
    the avals of ``x`` and ``weight`` (with a bias: per dtypes, ranks and
    hidden size), so an eager call costs jax's dispatch of a jitted function
    plus ~2 us; larger ones go to the front end below,
    whose output pool spares the fresh pages of XLA's output buffer.

  Measured on 2 cores, d = 4096 (``python bench/jax_jit.py``): see
  :doc:`quickstart`.  A first call compiles the handler for its dtypes (1-10
  s; cached on disk with the kernels, so a later process loads it in well
  under a second; ``polynorm warmup`` compiles them ahead).
- eager jax arrays all on one CPU device otherwise (and ``pn.rms_norm`` on
  them) go to the kernels as numpy views (zero-copy) and the results come
  back to jax: below 1 MiB copied by ``jnp.asarray``, larger ones without a
  copy.  ~50-110 us at (1, 4096) on 2 loaded cores, where a jitted jnp
  RMSNorm takes ~6-15 us.
- traced arrays (``jax.jit``, ``vmap``, ``scan``, ``grad`` of ``jit``...)
  not taken by the compiled calls (several CPU devices, a GPU, other
  options, the backward, gated, QK-norm, quantized), ``backend="auto"``:
  the pure array-API reference, which XLA compiles, partitions and fuses
  like any jnp code (other bits than the kernels: within the dtype's
  tolerance).  On a one-CPU-device process its row sums are compiled Numba
  calls in a fixed order: XLA's own follow the array's shape on the CPU, so
  a token's bits would depend on the number of tokens.  The forward's
  ``rstd`` is one call (``polynorm.backends.reference.ROW_RSTD``: the sums of
  squares of ``x`` as it is, 16-bit too, the scaled pass for the rows that
  need it, and eps, with the bits of those steps as XLA compiles them), the
  backward's row statistics another (``ROW_STATS``: the sums and the scaled
  pass's parts), its row dots another from 64 Ki
  elements (``ROW_DOTS``: the products summed where they are made), other
  row sums ``ROW_SUMS``; its ``y`` from 32 MiB on huge pages as above.  A backward the compiled handler does not take (other options,
  mixed cotangent dtypes) has XLA's elementwise ``dx``, which may round one
  token's rows once less than a batch's (XLA's contraction).
  Elsewhere its overflow-safe scaled pass sits behind a ``lax.cond`` that
  runs it only when some row needs it.  A process with several CPU devices (XLA's
  host device count flag) keeps it for every call: XLA cannot split the
  host call, and would gather a sharded input to run it.
- traced arrays not taken by the compiled call, ``backend="numba"``: the
  Numba kernels inside the compiled computation, with the same bits as an
  eager call: an XLA FFI custom call whose Python handler
  (:mod:`polynorm.jax.ffi`) hands the kernels XLA's own buffers (``y`` is
  written in place; ``rstd``, ``h`` and the gradients are copied into XLA's
  buffers), or ``jax.pure_callback`` where this jax cannot take the FFI
  handler.  ~15-60 us more per call than the compiled handler.
  Under ``vmap`` the kernels run once per batch element (``"sequential"``).
  XLA cannot split the host call: a sharded input is gathered and every
  device runs it on the whole array (the result comes back replicated).
- Large float32 outputs under ``jit`` (32 MiB and up: 2048 x 4096) cost
  XLA's fresh output buffer more than the kernel: glibc returns an
  allocation above its largest dynamic mmap threshold (32 MiB) to the
  system on every call, so each call page-faults the whole buffer in, for
  the jnp formula as for the kernel call (``MALLOC_MMAP_THRESHOLD_`` in the
  environment raises it).  The handlers ask for transparent huge pages
  under their outputs of 4 MiB and more (``madvise``, numpy's rule for its
  own arrays), which faults them in per 2 MiB, and XLA's own pass of ``y``
  from 32 MiB gets a buffer that asks for them (above).
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
