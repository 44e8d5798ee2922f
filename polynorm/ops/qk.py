"""QK-norm (+ RoPE) front end: :func:`qk_norm` on a packed ``qkv``, :func:`qk_norm_pair` on ``q``/``k`` heads.

Per ``(token, head)`` row of ``q`` and ``k`` (length ``head_dim``, shared ``(D,)``
weight per tensor) the operation is :func:`polynorm.rms_norm`'s row, bit for bit
(same :class:`~polynorm.core.options.Plan`: eps placement, offset, casting), rounded
to the storage dtype; then, with ``rope``, RoPE on the first ``rotary_dim`` columns,
computed in the compute dtype (float32; float64 for float64 data) from those rounded
values and rounded once more.  That is the order of vLLM's reference for its
``fused_qk_norm_rope`` (``RMSNorm.forward_native``, which returns the storage dtype,
then ``RotaryEmbedding.forward_native``), with the rotation's arithmetic in float32
as vLLM's kernel does it (its reference multiplies in the storage dtype).

A backend takes part with ``qk_forward`` (:class:`polynorm.backends.QKKernels`);
without it ``backend="auto"`` runs the array-API reference.  The backward
(:func:`qk_backward`, used by :mod:`polynorm.torch` and :mod:`polynorm.jax`) is the
inverse rotation then :func:`polynorm.rms_norm_backward` of the heads' rows.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import array_api_compat as aac

from polynorm.backends.reference import _eager
from polynorm.core.dtypes import float_dtype_name, namespace_dtype
from polynorm.core.options import NormOptions, Options, Plan, make_plan, pack_options, takes_options
from polynorm.ops import norm as _api
from polynorm.ops.norm import Array

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["qk_norm", "qk_norm_pair"]

#: options that have no meaning for per-head norms (one normalized axis, the
#: storage dtype out, no fused add), set by the functions themselves
EXCLUDED = ("axis", "partial", "partial_size", "out_dtype", "norm_input", "residual_dtype",
            "group_size")
_FIXED = {"axis": -1, "partial": 1.0, "partial_size": None, "out_dtype": None,
          "norm_input": "h", "residual_dtype": None, "group_size": None}

_ROPE_DOC = """rope : tuple (cos_sin_cache, positions, is_neox, rotary_dim), optional
        RoPE after the norm, as vLLM's ``fused_qk_norm_rope``: ``cos_sin_cache`` of shape
        ``(max_position, rotary_dim)``, each row ``[cos | sin]`` (vLLM's
        ``RotaryEmbedding.cos_sin_cache``; any float dtype, converted exactly to the
        compute dtype), ``positions`` an integer array of shape ``(T,)``, ``is_neox``
        ``True`` for NeoX (rotate halves) or ``False`` for GPT-J (interleaved pairs),
        ``rotary_dim`` the rotated leading columns of each head (even, ``<= head_dim``;
        ``None``: the cache's width, which it must equal).  Columns from ``rotary_dim``
        on are only normalized (partial rotary)."""


def _pos_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive int, got {value!r}") from None
    if v < 1:
        raise ValueError(f"{name} must be a positive int, got {v}")
    return v


def _opts(func: str, options: dict) -> Options:
    return pack_options(func, options, **_FIXED)


def _check_weight(name: str, w: Any, d: int) -> None:
    if w is None:
        return
    float_dtype_name(name, w)
    if tuple(w.shape) != (d,):
        raise ValueError(f"{name} must have shape (head_dim,) = ({d},), got {tuple(w.shape)}")


def _rope_rows(xp, rope: Any, t: int, d: int, plan: Plan, like: Any):
    """``(cs, neox)`` from the ``rope`` argument: ``cs`` the ``(T, rot)`` cache rows of
    the tokens' positions in the compute dtype; None without rope."""
    if rope is None:
        return None
    if not isinstance(rope, (tuple, list)) or len(rope) != 4:
        raise TypeError("rope must be a tuple (cos_sin_cache, positions, is_neox, rotary_dim), "
                        f"got {type(rope).__name__}")
    cache, positions, neox, rot = rope
    if not isinstance(neox, bool):
        raise TypeError(f"rope's is_neox must be True or False, got {neox!r}")
    if not aac.is_array_api_obj(cache) or getattr(cache, "ndim", None) != 2:
        raise ValueError("rope's cos_sin_cache must be a 2-D array (max_position, rotary_dim), "
                         f"got {getattr(cache, 'shape', type(cache).__name__)}")
    float_dtype_name("rope's cos_sin_cache", cache)
    width = int(cache.shape[1])
    rot = width if rot is None else _pos_int("rope's rotary_dim", rot)
    if rot != width:
        raise ValueError(f"rope's rotary_dim={rot} must equal cos_sin_cache's width {width} "
                         "(its rows are [cos | sin] of rotary_dim // 2 each)")
    if rot % 2 or rot > d:
        raise ValueError(f"rope's rotary_dim must be even and <= head_dim={d}, got {rot}")
    if not aac.is_array_api_obj(positions):
        raise TypeError(f"rope's positions must be an integer array, got {type(positions).__name__}")
    if tuple(positions.shape) != (t,):
        raise ValueError(f"rope's positions must have shape (T,) = ({t},), got "
                         f"{tuple(positions.shape)}")
    if not xp.isdtype(positions.dtype, "integral"):
        raise TypeError(f"rope's positions must be integers, got dtype {positions.dtype}")
    n_pos = int(cache.shape[0])
    if t and _eager(positions):
        lo, hi = int(xp.min(positions)), int(xp.max(positions))
        if lo < 0 or hi >= n_pos:
            raise ValueError(f"rope's positions must be in [0, {n_pos}) (the cache's rows), "
                             f"got values in [{lo}, {hi}]")
    cdt = namespace_dtype(xp, plan.compute_dtype, like)
    if aac.is_dask_array(like):
        return _dask_rows(cache, positions, cdt, like.chunks[0]), neox
    if aac.is_jax_array(positions):
        import jax.numpy as jnp

        rows = jnp.take(cache, positions, axis=0)  # out of range: NaN rows (mode "fill")
    else:
        rows = xp.take(cache, positions, axis=0)
    cs = xp.astype(rows, cdt)
    return cs, neox


def _dask_rows(cache, positions, cdt, like_chunks):
    """The cache rows of dask ``positions``, chunked as they are (lazy)."""
    import dask.array as da
    import numpy as np

    if not aac.is_dask_array(positions):
        positions = da.from_array(np.asarray(positions), chunks=(like_chunks,))
    cache = cache if aac.is_dask_array(cache) else da.from_array(np.asarray(cache))
    cache = cache.rechunk(-1)
    return da.blockwise(lambda p, c: np.asarray(c)[p].astype(cdt), "tr", positions, "t",
                        cache, "qr", concatenate=True, dtype=cdt)


def _writable(a: Any) -> bool:
    if aac.is_jax_array(a) or aac.is_dask_array(a):
        return False
    flags = getattr(a, "flags", None)
    return flags is None or getattr(flags, "writeable", True)


def _heads(q3, k3, q_weight, k_weight, rope, opts: Options, *, inplace: bool):
    """Norm (+ RoPE) of the ``(T, H, D)`` heads ``q3`` and ``k3``: the new heads, written
    into ``q3``/``k3`` themselves where ``inplace``."""
    q_weight, k_weight = _api._chunk_library_params(q3, q_weight, k_weight)
    arrays = {"q": q3, "k": k3, "q_weight": q_weight, "k_weight": k_weight}
    if (isinstance(rope, (tuple, list)) and len(rope) == 4
            and type(q3).__module__.split(".")[0] in ("numpy", "torch", "cupy")):
        # one library and device for the cache and positions too: a clean error, not the gather's
        arrays.update({"rope's cos_sin_cache": rope[0], "rope's positions": rope[1]})
    xp = _api._namespace(arrays)
    name = float_dtype_name("q", q3)
    if float_dtype_name("k", k3) != name:
        raise TypeError(f"q and k must have one dtype, got {name} and {float_dtype_name('k', k3)}")
    t, _, d = q3.shape
    if k3.shape[0] != t or k3.shape[2] != d:
        raise ValueError(f"k must have shape (T, Hk, head_dim) with q's T={t} and head_dim={d}, "
                         f"got {tuple(k3.shape)}")
    _check_weight("q_weight", q_weight, d)
    _check_weight("k_weight", k_weight, d)
    plan = make_plan(d, name, opts)
    if plan.cast_none:
        # the QK kernels round as rms_norm's fp32/llama castings do; Liger's mode has no
        # QK-norm to match
        raise ValueError("casting='none' is not supported by qk_norm; use 'fp32' or 'llama'")
    cs = _rope_rows(xp, rope, t, d, plan, q3)
    if aac.is_dask_array(q3):
        from polynorm.backends import dask as dmod

        return (dmod.qk_forward(q3, q_weight, plan, cs), dmod.qk_forward(k3, k_weight, plan, cs))
    mod = _api._capable_backend(opts.backend, q3, _api._backends.QKKernels, "QK-norm")
    if t == 0:
        return q3, k3
    out = []
    with _api._no_autograd(q3, "q", k=k3, q_weight=q_weight, k_weight=k_weight):
        for x3, w in ((q3, q_weight), (k3, k_weight)):
            if x3.shape[1] == 0:
                out.append(x3)
                continue
            y = mod.qk_forward(x3, w, plan, cs, x3 if inplace else None)
            if inplace and y is not x3:
                x3[...] = y
                y = x3
            out.append(y)
    return tuple(out)


@takes_options(exclude=EXCLUDED, docs={})
def qk_norm(
    qkv: Array,
    q_weight: Array | None,
    k_weight: Array | None,
    *,
    num_heads_q: int,
    num_heads_k: int,
    head_dim: int,
    rope: tuple | None = None,
    **options: Unpack[NormOptions],
) -> Array:
    """QK-norm (+ RoPE) in place on the q and k slices of a packed ``qkv`` (vLLM's ``fused_qk_norm_rope``).

    ``qkv`` is ``(T, (Hq + 2*Hk) * head_dim)``: per token ``[q heads | k heads | v heads]``.
    Each q and k head ``v`` (a row of ``head_dim``) becomes, with ``w`` the tensor's
    ``(head_dim,)`` weight::

        y = rms_norm(v, w, eps=eps, offset=offset, eps_mode=eps_mode, casting=casting)
        # bit for bit that row of polynorm.rms_norm, rounded to qkv's dtype
        with rope: for each rotated pair (a, b) of y, in the compute dtype (float32,
        float64 for float64 qkv), with c, s = cos, sin of the token's position:
        (a, b) <- (a*c - b*s, b*c + a*s), then rounded to qkv's dtype

    NeoX pairs column ``i`` with ``i + rotary_dim/2``, GPT-J ``2i`` with ``2i+1``.
    The order (norm rounded to the dtype, then the rotation from those values) is
    vLLM's reference for the kernel (``RMSNorm.forward_native`` then
    ``RotaryEmbedding.forward_native``); the rotation's products and sums are
    float32 operations as in vLLM's kernel, which differs from its reference by
    rounding (vLLM's test: ``atol = rtol = 1e-2`` in bfloat16).  The v slice is not
    read or written.  Gemma's ``(1 + w)``: ``offset=1.0``.

    numpy, torch, cupy and array-api-strict arrays are modified in place and
    returned; a read-only numpy array is a ``ValueError``.  jax and dask arrays
    are immutable: a new ``qkv`` is returned (the v slice carried over).  Not
    differentiable here (torch: no autograd record); for training use
    :func:`polynorm.torch.qk_norm` / :func:`polynorm.jax.qk_norm`.

    Parameters
    ----------
    qkv : array
        Float array ``(T, (num_heads_q + 2 * num_heads_k) * head_dim)``, any strides.
    q_weight, k_weight : array or None
        ``(head_dim,)`` float weights (any float dtype) of q's and k's norm.
    num_heads_q, num_heads_k, head_dim : int
        ``Hq``, ``Hk`` (the v slice has ``Hk`` heads too) and ``D``.
    {rope_doc}
    {options}

    Returns
    -------
    array
        ``qkv`` itself (modified), or a new array for jax and dask.

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> T, Hq, Hk, D = 2, 2, 1, 4
    >>> qkv = np.arange(T * (Hq + 2 * Hk) * D, dtype=np.float32).reshape(T, -1)
    >>> ref = pn.rms_norm(qkv[:, : (Hq + Hk) * D].reshape(T, Hq + Hk, D), eps=1e-6)
    >>> out = pn.qk_norm(qkv, None, None, num_heads_q=Hq, num_heads_k=Hk, head_dim=D)
    >>> out is qkv, bool((qkv[:, :12] == ref.reshape(T, 12)).all())
    (True, True)
    >>> cache = np.array([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], np.float32)  # 0 and 90 deg
    >>> x = np.ones((1, 3 * D), np.float32)
    >>> _ = pn.qk_norm(x, None, None, num_heads_q=1, num_heads_k=1, head_dim=D, eps=0.0,
    ...                rope=(cache, np.array([1]), True, 4))
    >>> x[0, :4]   # NeoX, 90 degrees: (a, b) -> (-b, a)
    array([-1., -1.,  1.,  1.], dtype=float32)
    """
    return packed(qkv, q_weight, k_weight, num_heads_q, num_heads_k, head_dim, rope,
                  _opts("qk_norm", options))


def _torch_cpu_views(arrays: tuple) -> list | None:
    """numpy views of torch CPU tensors (None passes), or None unless every array is one.

    A torch call on the CPU runs as the numpy call on views of its tensors (zero copy,
    in place through them): each tensor converted once instead of at every step."""
    import torch

    from polynorm.core.interop import is_functorch_wrapped, to_numpy

    out = []
    for a in arrays:
        if a is None:
            out.append(None)
        elif (type(a).__module__.split(".")[0] == "torch" and a.device.type == "cpu"
              and not is_functorch_wrapped(torch, a)):  # torch.func's: no storage
            out.append(to_numpy(a))
        else:
            return None
    return out


def packed(qkv, q_weight, k_weight, num_heads_q, num_heads_k, head_dim, rope, opts: Options):
    """:func:`qk_norm` with its options packed (:mod:`polynorm.torch`, :mod:`polynorm.jax`)."""
    if type(qkv).__module__.split(".")[0] == "torch" and (
            rope is None or (isinstance(rope, (tuple, list)) and len(rope) == 4)):
        views = _torch_cpu_views((qkv, q_weight, k_weight) + (
            () if rope is None else (rope[0], rope[1])))
        if views is not None and views[0].flags.writeable:
            r = None if rope is None else (views[3], views[4], rope[2], rope[3])
            packed(views[0], views[1], views[2], num_heads_q, num_heads_k, head_dim, r, opts)
            return qkv
    hq = _pos_int("num_heads_q", num_heads_q)
    hk = _pos_int("num_heads_k", num_heads_k)
    d = _pos_int("head_dim", head_dim)
    qkv = _api._native(qkv)
    if not aac.is_array_api_obj(qkv):
        raise TypeError(f"qkv must be an array, got {type(qkv).__name__}")
    float_dtype_name("qkv", qkv)
    width = (hq + 2 * hk) * d
    if qkv.ndim != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"qkv must have shape (T, (num_heads_q + 2 * num_heads_k) * head_dim) = (T, {width}), "
            f"got {tuple(qkv.shape)}")
    inplace = _writable(qkv)
    if not inplace and not (aac.is_jax_array(qkv) or aac.is_dask_array(qkv)):
        raise ValueError("qkv is read-only: qk_norm works in place")
    xp = aac.array_namespace(qkv)
    t = qkv.shape[0]
    if aac.is_dask_array(qkv):
        qkv = qkv.rechunk({1: -1})
    q3 = xp.reshape(qkv[:, : hq * d], (t, hq, d))
    k3 = xp.reshape(qkv[:, hq * d:(hq + hk) * d], (t, hk, d))
    if inplace and not _shares(q3, qkv):
        raise ValueError("qkv: its q slice has no (T, H, head_dim) view (strides); pass a "
                         "contiguous qkv or use qk_norm_pair on views")
    yq, yk = _heads(q3, k3, q_weight, k_weight, rope, opts, inplace=inplace)
    if inplace:
        return qkv
    return xp.concat([xp.reshape(yq, (t, hq * d)), xp.reshape(yk, (t, hk * d)),
                      qkv[:, (hq + hk) * d:]], axis=1)


def _shares(view: Any, base: Any) -> bool:
    """Whether ``view`` (a reshape of a slice of ``base``) is a view, not a copy."""
    import numpy as np

    try:
        from polynorm.core.interop import host_view

        v, b = host_view(view), host_view(base)
    except Exception:  # pragma: no cover - a library without host views
        v = b = None
    if v is not None and b is not None:
        return np.shares_memory(v, b) or view.size == 0
    if aac.is_torch_array(view):
        return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    return True


@takes_options(exclude=EXCLUDED)
def qk_norm_pair(
    q: Array,
    k: Array,
    q_weight: Array | None,
    k_weight: Array | None,
    *,
    rope: tuple | None = None,
    **options: Unpack[NormOptions],
) -> tuple[Array, Array]:
    """:func:`qk_norm` on separate ``q`` ``(T, Hq, D)`` and ``k`` ``(T, Hk, D)`` heads, in place.

    The same operation and bits as :func:`qk_norm`, for callers that hold q and k
    apart (or as views of a packed tensor in another layout): any strides, no copy
    where the library has views (numpy, torch: ``qkv[:, :Hq*D].view(T, Hq, D)``).
    jax and dask arrays get new ones.  ``q`` and ``k`` must not overlap in memory
    (not checked: each is written as it is read).

    Parameters
    ----------
    q, k : array
        ``(T, Hq, D)`` and ``(T, Hk, D)``, one float dtype.
    q_weight, k_weight : array or None
        ``(D,)`` weights.
    {rope_doc}
    {options}

    Returns
    -------
    (q, k)
        The arrays passed (modified), or new ones for jax and dask.

    Examples
    --------
    >>> import numpy as np
    >>> import polynorm as pn
    >>> q = np.full((1, 2, 4), 3.0, np.float32)
    >>> k = np.full((1, 1, 4), -2.0, np.float32)
    >>> _ = pn.qk_norm_pair(q, k, None, None, eps=0.0)
    >>> q[0, 0], k[0, 0]
    (array([1., 1., 1., 1.], dtype=float32), array([-1., -1., -1., -1.], dtype=float32))
    """
    opts = _opts("qk_norm_pair", options)
    return pair(q, k, q_weight, k_weight, rope, opts)


def pair(q, k, q_weight, k_weight, rope, opts: Options):
    """:func:`qk_norm_pair` with its options packed."""
    if type(q).__module__.split(".")[0] == "torch" and (
            rope is None or (isinstance(rope, (tuple, list)) and len(rope) == 4)):
        views = _torch_cpu_views((q, k, q_weight, k_weight) + (
            () if rope is None else (rope[0], rope[1])))
        if views is not None and views[0].flags.writeable and views[1].flags.writeable:
            r = None if rope is None else (views[4], views[5], rope[2], rope[3])
            pair(views[0], views[1], views[2], views[3], r, opts)
            return q, k
    q, k = _api._native(q), _api._native(k)
    for name, a in (("q", q), ("k", k)):
        if not aac.is_array_api_obj(a):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
        if a.ndim != 3:
            raise ValueError(f"{name} must have shape (T, heads, head_dim), got {tuple(a.shape)}")
    inplace = _writable(q) and _writable(k)
    if not inplace and not (aac.is_jax_array(q) or aac.is_dask_array(q)):
        raise ValueError("q or k is read-only: qk_norm_pair works in place")
    return _heads(q, k, q_weight, k_weight, rope, opts, inplace=inplace)


qk_norm.__doc__ = (qk_norm.__doc__ or "").replace("{rope_doc}", _ROPE_DOC)
qk_norm_pair.__doc__ = (qk_norm_pair.__doc__ or "").replace("{rope_doc}", _ROPE_DOC)


# --------------------------------------------------------------------------- backward


def qk_backward(dy3, x3, weight, plan: Plan, cs_neox, opts: Options):
    """``(dx3, dweight)`` of one tensor's heads: the inverse rotation of ``dy3`` in the
    compute dtype (the rounding to the storage dtype passes the gradient through, as
    ``rms_norm``'s casting does), then :func:`polynorm.rms_norm_backward` of the
    ``(T*H, D)`` rows, dweight summed over tokens and heads in the row tree's order."""
    xp = aac.array_namespace(dy3)
    t, h, d = x3.shape
    cdt = namespace_dtype(xp, plan.compute_dtype, x3)
    g = xp.astype(dy3, cdt)
    if cs_neox is not None:
        from polynorm.backends.reference import rope_rotate

        g = rope_rotate(xp, g, cs_neox[0], cs_neox[1], inverse=True)
    g2 = xp.reshape(g, (t * h, d))
    x2 = xp.reshape(x3, (t * h, d))
    dx, dw, _ = _api.backward(g2, x2, weight, None, None, None, opts)
    return xp.reshape(xp.astype(dx, x3.dtype, copy=False), (t, h, d)), dw
