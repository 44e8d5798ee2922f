"""Put polynorm under a Hugging Face ``transformers`` model: :func:`patch`, :func:`unpatch`.

Each RMSNorm class of ``transformers`` rounds in its own order.  The classes
fall into four kinds, read from the module's class (never from the model's
name or config), and each kind maps onto polynorm options that reproduce its
rounding order:

``"llama"``  ``self.weight * xhat.to(input_dtype)`` with ``xhat`` computed in float32:
             ``casting="llama"``, ``out_dtype=promote(x, weight)``.
``"gemma"``  ``(xhat * (1.0 + self.weight.float())).type_as(x)``, all float32:
             ``casting="fp32"``, ``offset=1.0``.
``"olmo2"``  ``(self.weight * xhat).to(input_dtype)``, product in float32:
             ``casting="fp32"``.
``"gated"``  Qwen3-Next's ``Qwen3NextRMSNormGated``, ``forward(x, gate)``:
             ``self.weight * xhat.to(input_dtype)`` times ``silu(gate.float())``,
             rounded to ``input_dtype``: :func:`polynorm.rms_norm_gated` with
             ``norm_before_gate=True``, ``casting="llama"``.
``"t5"``     ``xhat`` in float32, rounded to the weight's dtype when that is
             16-bit, then ``self.weight * xhat``: ``casting="llama"`` when ``x``
             and the weight share a 16-bit dtype, else ``casting="fp32"`` with
             ``out_dtype=promote(x, weight)``.

What polynorm computes differently: the statistic.  HF sums the squares in
float32 in torch's reduction order and takes ``rsqrt`` in float32 (three
roundings); polynorm sums in float64 and rounds ``rstd`` once.  polynorm's
``rstd`` is the correctly rounded one more often, and about a third of the
rows get an ``rstd`` one float32 ulp away from HF's, so float32 outputs are
close, not the same bits; in bfloat16 the rounding of ``xhat`` (or of the
output) hides most of that difference.  The backward is polynorm's
hand-written one (the derivative of the unrounded function), not autograd
through HF's chain of roundings.  The README's table gives the measured
agreement per architecture.

Inputs a kind does not reproduce (float64 activations, which every class
above computes in float32; a T5 norm with a 16-bit weight and input of
another dtype; a float64 weight where the product is formed in float32) run
the original class's own ``forward``, unchanged.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["patch", "unpatch", "patched", "PatchedRMSNorm", "KNOWN_CLASSES"]

#: ``transformers`` norm classes and their kind, by module and class name.
#: Only these exact classes are replaced (a subclass may change ``forward``).
KNOWN_CLASSES: dict[str, str] = {
    "transformers.models.llama.modeling_llama.LlamaRMSNorm": "llama",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm": "llama",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm": "llama",
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm": "llama",
    "transformers.models.phi3.modeling_phi3.Phi3RMSNorm": "llama",
    "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm": "llama",
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm": "gemma",
    "transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm": "gemma",
    "transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm": "gemma",
    "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm": "gemma",
    "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNormGated": "gated",
    "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm": "olmo2",
    "transformers.models.t5.modeling_t5.T5LayerNorm": "t5",
}

_HALF = (torch.float16, torch.bfloat16)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _kind_of(module: torch.nn.Module) -> str | None:
    return KNOWN_CLASSES.get(_class_name(type(module)))


def _eps_of(module: torch.nn.Module) -> float:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    raise TypeError(
        f"{type(module).__name__} has neither a numeric variance_epsilon nor eps attribute"
    )


def _promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.promote_types(a, b)


class PatchedRMSNorm(torch.nn.Module):
    """polynorm in place of a ``transformers`` RMSNorm module (made by :func:`patch`).

    Holds the original module's ``weight`` (the same ``nn.Parameter``
    object, so ``state_dict`` keys, optimizers and PEFT see no change) and
    its ``eps``; the original module is kept outside the module tree for
    :func:`unpatch` and for inputs the kind does not reproduce.

    Parameters
    ----------
    original : torch.nn.Module
        An instance of a class in :data:`KNOWN_CLASSES`.

    Examples
    --------
    >>> import torch
    >>> from polynorm.torch import patch
    >>> from transformers.models.llama.modeling_llama import LlamaRMSNorm
    >>> model = torch.nn.Sequential(LlamaRMSNorm(8, eps=1e-5))
    >>> patch(model)
    1
    >>> model[0]
    PatchedRMSNorm(LlamaRMSNorm, kind='llama', (8,), eps=1e-05)
    """

    def __init__(self, original: torch.nn.Module) -> None:
        super().__init__()
        kind = _kind_of(original)
        if kind is None:
            raise TypeError(
                f"original must be one of the known norm classes, got {_class_name(type(original))}"
            )
        self.kind = kind
        self.eps = _eps_of(original)
        self.weight = original.weight  # the same Parameter object
        # outside the module tree: not in state_dict, parameters() or modules()
        self.__dict__["original"] = original

    @property
    def variance_epsilon(self) -> float:
        """HF's name for ``eps`` in most of the classes replaced."""
        return self.eps

    def _options(self, x: torch.Tensor) -> dict[str, Any] | None:
        """polynorm options reproducing the kind's rounding order for ``x``, or None."""
        w = self.weight.dtype
        xd = x.dtype
        if xd == torch.float64:  # HF computes float64 input in float32
            return None
        kind = self.kind
        if kind == "llama":
            out = _promote(xd, w)
            return dict(casting="llama", out_dtype=None if out == xd else out)
        if kind == "gemma":
            return dict(offset=1.0)
        if kind == "gated":
            # the gate product is formed in promote(float32, weight): float32 unless float64
            return None if w == torch.float64 else dict(casting="llama")
        if kind == "olmo2":
            # the product is formed in promote(float32, weight): float32 unless a float64 weight
            return None if w == torch.float64 else {}
        # t5
        if w in _HALF:
            return dict(casting="llama") if xd == w else None
        if w == torch.float64:
            return None
        out = _promote(xd, w)
        return dict(out_dtype=None if out == xd else out)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        from polynorm.torch.gated import rms_norm_gated
        from polynorm.torch.norm import rms_norm

        opts = self._options(x)
        gated = self.kind == "gated"
        if gated and gate is None:
            raise TypeError(f"{type(self.__dict__['original']).__name__} needs its gate: forward(x, gate)")
        if opts is None:
            original = self.__dict__["original"]
            if original.weight is not self.weight:  # reassigned, e.g. load_state_dict(assign=True)
                original.weight = self.weight
            return original(x, gate) if gated else original(x)
        if gated:
            return rms_norm_gated(x, gate, self.weight, eps=self.eps, norm_before_gate=True,
                                  **opts)
        return rms_norm(x, self.weight, eps=self.eps, **opts)

    def extra_repr(self) -> str:
        name = type(self.__dict__["original"]).__name__
        return f"{name}, kind={self.kind!r}, {tuple(self.weight.shape)}, eps={self.eps}"


def _patterns(name: str, value: str | Iterable[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    try:
        pats = tuple(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a string or an iterable of strings, got {type(value).__name__}"
        ) from None
    if not all(isinstance(p, str) for p in pats):
        raise TypeError(f"{name} must hold strings (fnmatch patterns), got {pats!r}")
    return pats


def _selected(qualname: str, cls: type, include, exclude) -> bool:
    keys = (qualname, cls.__name__)

    def hit(pats):
        return any(fnmatch.fnmatchcase(k, p) for p in pats for k in keys)

    if include is not None and not hit(include):
        return False
    return not (exclude is not None and hit(exclude))


def _children(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, Any]]:
    """``(qualified name, parent, attribute, child)`` for every edge of the module tree."""
    for pname, parent in model.named_modules(remove_duplicate=False):
        for attr, child in list(parent._modules.items()):
            if child is not None:
                yield (f"{pname}.{attr}" if pname else attr), parent, attr, child


def _looks_like_norm(module: torch.nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not isinstance(module, PatchedRMSNorm)


def patch(
    model: torch.nn.Module,
    *,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    verbose: bool = False,
) -> int:
    """Replace, in place, every known RMSNorm module of ``model`` by polynorm.

    Every submodule whose class is one of :data:`KNOWN_CLASSES` becomes a
    :class:`PatchedRMSNorm` holding the same ``weight`` Parameter, so the
    ``state_dict``, an optimizer built before or after, ``torch.compile``
    (``fullgraph=True``) and device moves keep working.  A module that
    appears at several places of the tree is replaced by one patched module.
    :func:`unpatch` puts the originals back.

    Parameters
    ----------
    model : torch.nn.Module
        Typically a ``transformers`` ``PreTrainedModel``; ``model`` itself is
        never replaced, only its submodules.
    include, exclude : str or iterable of str, optional
        ``fnmatch`` patterns matched against a submodule's qualified name
        (as in ``model.named_modules()``, e.g. ``"model.layers.*.self_attn.*"``)
        and against its class name (e.g. ``"Qwen3RMSNorm"``).  With
        ``include`` only matching modules are replaced; ``exclude`` wins.
    verbose : bool
        Print what was replaced, with the polynorm options, and every module
        whose class name contains "Norm" that was left alone.

    Returns
    -------
    int
        The number of modules replaced (each object counted once).

    Examples
    --------
    >>> import torch
    >>> from polynorm.torch import patch, unpatch
    >>> from transformers.models.llama.modeling_llama import LlamaRMSNorm
    >>> model = torch.nn.Sequential(LlamaRMSNorm(8), torch.nn.Linear(8, 8), LlamaRMSNorm(8))
    >>> patch(model, exclude="2")
    1
    >>> type(model[0]).__name__, type(model[2]).__name__
    ('PatchedRMSNorm', 'LlamaRMSNorm')
    >>> unpatch(model)
    1
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inc = _patterns("include", include)
    exc = _patterns("exclude", exclude)
    replaced: dict[int, PatchedRMSNorm] = {}
    left: dict[str, list[str]] = {}
    for qualname, parent, attr, child in list(_children(model)):
        cls = type(child)
        if id(child) in replaced:
            parent._modules[attr] = replaced[id(child)]
            continue
        if _kind_of(child) is not None and _selected(qualname, cls, inc, exc):
            new = PatchedRMSNorm(child)
            new.train(child.training)
            replaced[id(child)] = new
            parent._modules[attr] = new
        elif _looks_like_norm(child):
            why = "unknown class" if _kind_of(child) is None else "excluded"
            left.setdefault(f"{_class_name(cls)} ({why})", []).append(qualname)
    fused = _fuse_attention(model)
    if verbose:
        _report(replaced.values(), left)
        if fused:
            print(f"  {fused:4d} x attention with q_norm, k_norm and RoPE fused (qk_norm_pair)")
    return len(replaced)


def _report(replaced: Iterable[PatchedRMSNorm], left: dict[str, list[str]]) -> None:
    kinds: dict[tuple[str, str], int] = {}
    for m in replaced:
        key = (type(m.__dict__["original"]).__name__, m.kind)
        kinds[key] = kinds.get(key, 0) + 1
    lines = [f"polynorm.torch.patch: replaced {sum(kinds.values())} module(s)"]
    for (name, kind), n in sorted(kinds.items()):
        lines.append(f"  {n:4d} x {name}: kind {kind!r} ({_OPTION_TEXT[kind]})")
    if left:
        lines.append("left alone:")
        for name, where in sorted(left.items()):
            lines.append(f"  {len(where):4d} x {name}, e.g. {where[0]}")
    print("\n".join(lines))


_OPTION_TEXT = {
    "llama": 'casting="llama", out_dtype=promote(x, weight)',
    "gemma": 'offset=1.0, casting="fp32"',
    "gated": 'rms_norm_gated, norm_before_gate=True, casting="llama"',
    "olmo2": 'casting="fp32"',
    "t5": 'casting="llama" (16-bit weight) or "fp32" with out_dtype=promote(x, weight)',
}


def unpatch(model: torch.nn.Module) -> int:
    """Put back the original modules that :func:`patch` replaced.

    The original gets the patched module's current ``weight`` Parameter (the
    same object unless it was reassigned, e.g. by
    ``load_state_dict(..., assign=True)``).

    Parameters
    ----------
    model : torch.nn.Module

    Returns
    -------
    int
        The number of modules restored (each object counted once).

    Examples
    --------
    >>> import torch
    >>> from polynorm.torch import patch, unpatch
    >>> from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    >>> model = torch.nn.Sequential(GemmaRMSNorm(8))
    >>> w = model[0].weight
    >>> patch(model), unpatch(model)
    (1, 1)
    >>> type(model[0]).__name__, model[0].weight is w
    ('GemmaRMSNorm', True)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _unfuse_attention(model)
    restored: dict[int, torch.nn.Module] = {}
    for _, parent, attr, child in list(_children(model)):
        if isinstance(child, PatchedRMSNorm):
            original = child.__dict__["original"]
            original.weight = child.weight
            original.train(child.training)
            restored[id(child)] = original
            parent._modules[attr] = original
    return len(restored)


@contextmanager
def patched(
    model: torch.nn.Module,
    *,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    verbose: bool = False,
) -> Iterator[int]:
    """Context manager: :func:`patch` on entry (yields the count), :func:`unpatch` on exit.

    Parameters
    ----------
    model : torch.nn.Module
    include, exclude, verbose
        As in :func:`patch`.

    Returns
    -------
    contextlib.AbstractContextManager
        Yields the number of modules replaced; the originals are back on exit,
        also when the block raises.

    Examples
    --------
    >>> import torch
    >>> from polynorm.torch import patched
    >>> from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    >>> model = torch.nn.Sequential(Qwen3RMSNorm(8))
    >>> with patched(model) as n:
    ...     print(n, type(model[0]).__name__)
    1 PatchedRMSNorm
    >>> type(model[0]).__name__
    'Qwen3RMSNorm'
    """
    n = patch(model, include=include, exclude=exclude, verbose=verbose)
    try:
        yield n
    finally:
        unpatch(model)


# ---------------------------------------------------------------- fused QK-norm + RoPE

#: attention classes whose q_norm/k_norm and RoPE :func:`patch` fuses into one
#: :func:`polynorm.torch.qk_norm_pair` call (per-head norm, then NeoX RoPE from
#: ``position_embeddings``), when both norms were patched and reproduce the class's
#: order in ``x``'s dtype.  Their forward is otherwise the class's own.
FUSED_ATTENTION: dict[str, str] = {
    "transformers.models.qwen3.modeling_qwen3.Qwen3Attention": "qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention": "qwen3",
    # the same forward, q/k normalized after the transpose (per head all the same)
    "transformers.models.gemma3.modeling_gemma3.Gemma3Attention": "qwen3",
}
KNOWN_CLASSES.setdefault("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm",
                         "llama")


def _fused_qk(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q/k ``(B, S, H, D)`` normalized and rotated by one fused call, or None where the
    fused call would not reproduce the modules (then the caller runs them)."""
    qn, kn = attn.q_norm, attn.k_norm
    if not (isinstance(qn, PatchedRMSNorm) and isinstance(kn, PatchedRMSNorm)):
        return None
    opts = qn._options(q)
    if opts is None or opts != kn._options(k) or opts.get("out_dtype") is not None:
        return None
    if qn.eps != kn.eps or k.dtype != q.dtype:
        return None
    opts = {key: v for key, v in opts.items() if key != "out_dtype"}
    *lead, hq, d = q.shape
    hk = k.shape[-2]
    if cos.shape[-1] != d or d % 2:
        return None
    t = q.numel() // (hq * d)
    half = d // 2
    # HF's cos/sin are cat(freqs, freqs) per token: the halves are vLLM's [cos | sin] rows
    cs = torch.cat([cos[..., :half], sin[..., :half]], dim=-1).expand(*lead, d).reshape(t, d)
    positions = torch.arange(t, device=q.device)
    from polynorm.torch.qk import qk_norm_pair

    q2, k2 = qk_norm_pair(q.reshape(t, hq, d), k.reshape(t, hk, d), qn.weight, kn.weight,
                          rope=(cs, positions, True, d), eps=qn.eps, **opts)
    return q2.view(*lead, hq, d), k2.view(*lead, hk, d)


def _qwen3_attention_forward(self, hidden_states, position_embeddings, attention_mask=None,
                             cache=None, **kwargs):
    """Qwen3Attention.forward (transformers 5; Qwen3-MoE's and Gemma-3's are the same
    steps) with q_norm, k_norm and the RoPE fused."""
    import sys

    mod = sys.modules[type(self).__module__]
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape)
    k = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    fused = _fused_qk(self, q, k, cos, sin)
    if fused is None:
        query_states, key_states = mod.apply_rotary_pos_emb(
            self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), cos, sin)
    else:
        query_states, key_states = fused[0].transpose(1, 2), fused[1].transpose(1, 2)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx,
                                                kwargs=kwargs)
    attention_interface = mod.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, mod.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


_FUSED_FORWARD = {"qwen3": _qwen3_attention_forward}


def _fuse_attention(model: torch.nn.Module) -> int:
    """Give every attention of :data:`FUSED_ATTENTION` whose q_norm and k_norm are
    patched the fused forward (an instance attribute, removed by :func:`_unfuse_attention`)."""
    import types

    n = 0
    for m in model.modules():
        kind = FUSED_ATTENTION.get(_class_name(type(m)))
        if kind is None or "forward" in m.__dict__:
            continue
        if isinstance(getattr(m, "q_norm", None), PatchedRMSNorm) and isinstance(
                getattr(m, "k_norm", None), PatchedRMSNorm):
            m.forward = types.MethodType(_FUSED_FORWARD[kind], m)
            n += 1
    return n


def _unfuse_attention(model: torch.nn.Module) -> None:
    for m in model.modules():
        fwd = m.__dict__.get("forward")
        if getattr(fwd, "__func__", None) in _FUSED_FORWARD.values():
            del m.forward
