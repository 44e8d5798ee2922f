"""``torch.distributed.tensor.DTensor`` inputs of :func:`polynorm.torch.rms_norm` and
:func:`polynorm.torch.add_rms_norm`.

Per mesh dimension, by ``x``'s placement there:

- ``Shard(d)`` with ``d`` a token axis, or ``Replicate()``: every rank normalizes its
  local tokens (``to_local``, the op, ``from_local`` with ``x``'s placements), with
  no communication;
- ``Shard(d)`` with ``d`` the normalized axis: the tensor-parallel path of
  :mod:`polynorm.torch.distributed` over that mesh dimension's process group (one
  all-reduce of one float per token forward, one backward);
- ``Partial()``: refused (``ValueError``; reduce it first).

``weight``/``bias`` may be DTensors on ``x``'s mesh (replicated, or sharded like
``x``'s normalized axis) or plain tensors holding the whole parameter; either way
every rank uses the part that its slice of ``x`` needs, and their gradients come
back with the placements autograd expects (a replicated parameter's gradient summed
over the token shards, as DTensor's own ops do).  Liger-Kernel instead gathers a
DTensor whole (``full_tensor()``) and normalizes the full tensor on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from polynorm.core.options import Options


def is_dtensor(a: Any) -> bool:
    return type(a).__name__ == "DTensor" and type(a).__module__.startswith("torch.distributed")


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in axes:
        if not isinstance(a, int) or isinstance(a, bool) or not -ndim <= a < ndim:
            raise ValueError(f"axis {axis!r} is out of range for a DTensor x of {ndim} dims")
        out.append(a % ndim)
    return tuple(sorted(out))


def _param(p, mesh, want, grad, name: str):
    """A parameter as this rank's local tensor with the placements ``want`` on ``mesh``:
    a DTensor is redistributed (replicated -> sharded is a local slice), a plain
    tensor is taken as replicated first.  ``grad``: the placements of its gradient."""
    from torch.distributed.tensor import DTensor, Replicate

    if p is None:
        return None
    if is_dtensor(p):
        if p.device_mesh != mesh:
            raise ValueError(f"{name} is a DTensor on another device mesh than x's")
    else:
        p = DTensor.from_local(p, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if tuple(p.placements) != tuple(want):
        p = p.redistribute(mesh, want)
    return p.to_local(grad_placements=grad)


def rms_norm(x, weight, bias, opts: Options, apply_local, residual: Any = None) -> Any:
    """:func:`polynorm.torch.rms_norm` of a DTensor ``x`` (``opts`` with eps resolved);
    ``apply_local(x, weight, bias)`` runs the op on plain tensors.  With ``residual``
    (a DTensor like ``x``), :func:`polynorm.torch.add_rms_norm`: ``apply_local(x,
    residual, weight, bias)`` returns ``(y, h)``, and so does this."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from polynorm.torch import distributed as _dist

    mesh = x.device_mesh
    axes = _axes(opts.axis, x.ndim)
    hidden = []  # mesh dims that shard the normalized axis
    w_place, w_grad = [], []
    for i, p in enumerate(x.placements):
        if isinstance(p, Partial):
            raise ValueError(f"x has a Partial placement on mesh dim {i}: RMSNorm needs its "
                             "values; redistribute x to Replicate or Shard first")
        if isinstance(p, Shard) and p.dim % x.ndim in axes:
            if len(axes) != 1:
                raise ValueError("a DTensor x sharded over its normalized axes needs one "
                                 f"normalized axis, got axis={opts.axis!r}")
            hidden.append(i)
            w_place.append(Shard(0))
            w_grad.append(Shard(0))
        elif isinstance(p, Shard):
            w_place.append(Replicate())
            w_grad.append(Partial())  # each rank's tokens give a part of the gradient
        else:
            w_place.append(Replicate())
            w_grad.append(Replicate())
    if len(hidden) > 1:
        raise ValueError(f"x shards its normalized axis over {len(hidden)} mesh dims; "
                         "one is supported")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and len(axes) > 1 and hidden:
            raise ValueError(f"{name}: several normalized axes with a sharded hidden axis")
    w = _param(weight, mesh, w_place, w_grad, "weight")
    b = _param(bias, mesh, w_place, w_grad, "bias")
    local = x.to_local()
    r_local = None
    if residual is not None:
        if not is_dtensor(residual) or residual.device_mesh != mesh:
            raise TypeError("residual must be a DTensor on x's device mesh when x is a DTensor")
        if tuple(residual.placements) != tuple(x.placements):
            residual = residual.redistribute(mesh, x.placements)
        r_local = residual.to_local()
    h = None
    if hidden:
        group = mesh.get_group(hidden[0])
        kw = _dist._kw(opts, y=True)
        if r_local is not None:
            if opts.norm_input != "h" or opts.residual_dtype is not None:
                raise ValueError("a DTensor x sharded over its normalized axis takes the "
                                 "fused add with norm_input='h' and residual_dtype=None only")
            # h = x + residual rounded once to the promoted dtype, as the kernels do
            hdt = torch.promote_types(local.dtype, r_local.dtype)
            h = local.to(hdt) + r_local.to(hdt)
            local = h
        y = _dist.rms_norm(local, w, b, group=group, d_total=x.shape[axes[0]], **kw)
    elif r_local is not None:
        y, h = apply_local(local, r_local, w, b)
    else:
        y = apply_local(local, w, b)
    stride = torch.empty(x.shape, device="meta").stride()

    def wrap(a):
        return DTensor.from_local(a, mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=stride)

    return wrap(y) if residual is None else (wrap(y), wrap(h))
