"""polynorm.torch.patch on Hugging Face transformers models (tiny random configs, no download).

Two levels:

- one norm module: given the same ``rstd``, the patched module's output is
  HF's formula bit for bit (the rounding order is reproduced exactly); the
  ``rstd`` itself is polynorm's (float64 sum, one rounding) and within a
  couple of float32 ulps of HF's float32 ``rsqrt(mean(x**2) + eps)``.
- whole models: logits, every parameter's gradient and a few AdamW losses
  agree with the unpatched model within the tolerances of the README's table
  (their reason: the ``rstd`` ulp above in float32; in bfloat16 HF's autograd
  rounds every intermediate gradient to bfloat16, polynorm's backward rounds
  once).
"""

from __future__ import annotations

import copy
import importlib
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import polynorm as pn  # noqa: E402
from polynorm.torch import PatchedRMSNorm, patch, patched, unpatch  # noqa: E402
from polynorm.torch.hf import KNOWN_CLASSES  # noqa: E402

T = transformers
VOCAB = 128


def _common(**kw):
    d = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
    d.update(kw)
    return d


#: architecture -> tiny model; each has per-head or extra norms where the real one has them
BUILD = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**_common())),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**_common())),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**_common())),
    "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**_common(head_dim=16))),
    "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**_common(head_dim=16))),
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**_common(head_dim=16))),
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**_common(head_dim=16))),
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**_common())),
    "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**_common())),
    "deepseek_v3": lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(**_common(
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))),
    # with its gated norm (linear-attention layers): Qwen3NextRMSNormGated
    "qwen3_next": lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**_common(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"]))),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1,
        num_heads=4, dropout_rate=0.0)),
}

#: max |patched - HF| / max |HF| allowed, per dtype: (logits, gradients, AdamW losses)
TOL = {torch.float32: (1e-5, 1e-4, 1e-5), torch.bfloat16: (2**-6, 2**-4, 2**-6)}


def _model(arch: str, dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    m = BUILD[arch]().eval()  # eval: no dropout; autograd still records
    with torch.no_grad():  # norm weights away from their init, so that (1 + w) vs w shows
        for name, p in m.named_parameters():
            if "norm" in name:
                p.normal_(0.5, 0.3)
    return m.to(dtype)


def _batch(arch: str, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    kw = dict(input_ids=ids, labels=ids)
    if arch == "t5":
        kw["decoder_input_ids"] = ids
    return kw


def _norm_count(model) -> int:
    return len({id(m) for m in model.modules()
                if f"{type(m).__module__}.{type(m).__qualname__}" in KNOWN_CLASSES})


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- one module, exact rounding


def _class(full: str):
    mod, _, name = full.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def _hf_formula(kind, x, w, r):
    """The HF class's own lines, with ``r`` (float32, shape (..., 1)) as its rsqrt(...)."""
    if kind == "llama":
        return w * (x.to(torch.float32) * r).to(x.dtype)
    if kind == "gemma":
        return (x.float() * r * (1.0 + w.float())).type_as(x)
    if kind == "olmo2":
        return (w * (x.to(torch.float32) * r)).to(x.dtype)
    h = x * r  # t5
    if w.dtype in (torch.float16, torch.bfloat16):
        h = h.to(w.dtype)
    return w * h


_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
           (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
           (torch.float32, torch.bfloat16)]


_PLAIN = sorted(k for k, v in KNOWN_CLASSES.items() if v != "gated")


@pytest.mark.parametrize("full", _PLAIN, ids=lambda s: s.rpartition(".")[2])
def test_module_rounding_order_is_hf_bit_for_bit(full):
    kind = KNOWN_CLASSES[full]
    d = 48
    hf = _class(full)(d, eps=1e-5)
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(d, generator=g) * 0.3 + 0.5
    x0 = torch.randn(3, 70, d, generator=g) * 2
    for xd, wd in _DTYPES:
        x = x0.to(xd)
        with torch.no_grad():
            hf.weight.data = w0.to(wd)
        ref = hf(x)
        # r_hf: HF's statistic, spelled out; the formula with it is HF's output bit for bit
        r_hf = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + 1e-5)
        assert torch.equal(_hf_formula(kind, x, hf.weight, r_hf), ref)
        m = torch.nn.Sequential(hf)
        assert patch(m) == 1
        got = m[0](x)
        _, r_pn = pn.rms_norm(x, eps=1e-5, return_rstd=True)
        want = _hf_formula(kind, x, hf.weight, r_pn[..., None])
        assert got.dtype == ref.dtype == want.dtype and got.shape == ref.shape
        if kind == "t5" and wd != xd and wd in (torch.float16, torch.bfloat16):
            assert torch.equal(got, ref)  # not reproducible: the original forward runs
        else:
            assert torch.equal(got, want), (xd, wd)
        # polynorm's rstd: within 2 float32 ulps of HF's (it sums in float64, rounds once)
        ulp = torch.finfo(torch.float32).eps * r_hf.abs()
        assert ((r_pn[..., None] - r_hf).abs() <= 2 * ulp).all()
        assert unpatch(m) == 1 and m[0] is hf


@pytest.mark.parametrize("full", _PLAIN[:1] + ["t5"])
def test_float64_input_runs_the_original_forward(full):
    full = full if full in KNOWN_CLASSES else "transformers.models.t5.modeling_t5.T5LayerNorm"
    hf = _class(full)(16, eps=1e-6)
    x = torch.randn(5, 16, dtype=torch.float64)
    ref = hf(x)
    m = torch.nn.Sequential(hf)
    patch(m)
    assert torch.equal(m[0](x), ref)


# ---------------------------------------------------------------- whole models


def _fwd_bwd(model, batch, params_of=None):
    out = model(**batch)
    out.loss.backward()
    grads = {k: p.grad for k, p in (params_of or model).named_parameters()}
    return out.logits.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", sorted(BUILD))
def test_model_logits_and_gradients_match_hf(arch, dtype, monkeypatch):
    import polynorm.ops.qk as qk

    fused_calls = []
    plain_pair = qk.qk_norm_pair
    monkeypatch.setattr(qk, "qk_norm_pair",
                        lambda *a, **k: fused_calls.append(1) or plain_pair(*a, **k))
    ref = _model(arch, dtype)
    model = copy.deepcopy(ref)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    n = _norm_count(model)
    assert n >= 5
    assert patch(model) == n
    assert _norm_count(model) == 0
    assert sum(isinstance(m, PatchedRMSNorm) for m in model.modules()) == n
    # the same Parameter objects under the same names, the same state_dict keys
    assert all(p is params[k] for k, p in model.named_parameters())
    assert list(model.state_dict()) == keys

    batch = _batch(arch)
    ref_logits, ref_grads = _fwd_bwd(ref, batch)
    logits, grads = _fwd_bwd(model, batch)
    tol_y, tol_g, _ = TOL[dtype]
    assert logits.dtype == ref_logits.dtype
    assert _rel(logits, ref_logits) <= tol_y
    assert grads.keys() == ref_grads.keys()
    for k, g in grads.items():
        assert (g is None) == (ref_grads[k] is None), k
        if g is not None:
            assert g.dtype == ref_grads[k].dtype
            assert _rel(g, ref_grads[k]) <= tol_g, k
    # Qwen3's and Gemma-3's q_norm, k_norm and RoPE run as one fused QK-norm call per layer
    fused = arch in ("qwen3", "gemma3")
    assert len(fused_calls) == (model.config.num_hidden_layers if fused else 0)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "t5"])
def test_adamw_steps_give_the_same_losses(arch):
    losses = []
    for do_patch in (False, True):
        model = _model(arch, torch.float32).train()
        if do_patch:
            assert patch(model) > 0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = _batch(arch)
        run = []
        for _ in range(4):
            opt.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(torch.tensor(run))
    assert _rel(losses[1], losses[0]) <= TOL[torch.float32][2]
    assert losses[1][-1] < losses[1][0]  # it learns the batch


def test_torch_compile_fullgraph_patched_model():
    model = _model("qwen3", torch.float32)  # per-head q/k norms as well as the block norms
    patch(model)
    batch = _batch("qwen3")
    eager_logits, eager_grads = _fwd_bwd(model, batch)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break fails
    logits, grads = _fwd_bwd(compiled, batch, model)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-6, atol=1e-6)
    for k, g in grads.items():
        torch.testing.assert_close(g, eager_grads[k], rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_state_dict_round_trip_and_unpatch():
    ref = _model("gemma3", torch.float32)
    model = copy.deepcopy(ref)
    n = patch(model)
    batch = _batch("gemma3")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # the patched model's own values, not the init
        want = model(**batch).logits
    sd = model.state_dict()
    # into an unpatched model and into a patched one: the same keys, the same values
    for other, do_patch in ((_model("gemma3", torch.float32), False),
                            (_model("gemma3", torch.float32), True)):
        if do_patch:
            patch(other)
        assert other.load_state_dict(sd, strict=True)
        with torch.no_grad():
            got = other(**batch).logits
        if do_patch:
            assert torch.equal(got, want)
        else:
            assert _rel(got, want) <= TOL[torch.float32][0]
    weights = [m.weight for m in model.modules() if isinstance(m, PatchedRMSNorm)]
    assert unpatch(model) == n
    assert not any(isinstance(m, PatchedRMSNorm) for m in model.modules())
    assert _norm_count(model) == n
    originals = [m.weight for m in model.modules()
                 if type(m).__name__ == "Gemma3RMSNorm"]
    assert all(a is b for a, b in zip(originals, weights, strict=True))
    with torch.no_grad():
        assert _rel(model(**batch).logits, want) <= TOL[torch.float32][0]


def test_assign_load_state_dict_reaches_the_original_on_unpatch():
    model = _model("llama", torch.float32)
    patch(model)
    sd = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    w = model.model.norm.weight
    unpatch(model)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm" and model.model.norm.weight is w


def test_include_exclude_context_manager_and_shared_modules(capsys):
    model = _model("qwen3", torch.float32)
    n = _norm_count(model)
    q_k = sum(1 for name, _ in model.named_modules() if name.endswith(("q_norm", "k_norm")))
    assert patch(model, exclude=["*.q_norm", "*.k_norm"]) == n - q_k
    assert unpatch(model) == n - q_k
    assert patch(model, include="*.self_attn.*") == q_k
    unpatch(model)
    assert patch(model, include="Qwen3RMSNorm", exclude="model.norm") == n - 1
    unpatch(model)
    with patched(model) as count:
        assert count == n and isinstance(model.model.norm, PatchedRMSNorm)
    assert _norm_count(model) == n
    # a module reachable twice is replaced by one patched module
    shared = T.models.llama.modeling_llama.LlamaRMSNorm(8)
    seq = torch.nn.Sequential(shared, torch.nn.Sequential(shared))
    assert patch(seq) == 1 and seq[0] is seq[1][0]
    assert unpatch(seq) == 1 and seq[0] is shared and seq[1][0] is shared


def test_verbose_report_lists_the_unknown_norm(capsys):
    from transformers.models.qwen3_next import modeling_qwen3_next as q3n

    model = torch.nn.ModuleDict(dict(norm=q3n.Qwen3NextRMSNorm(16),
                                     gated=q3n.Qwen3NextRMSNormGated(16),
                                     ln=torch.nn.LayerNorm(16)))
    assert patch(model, verbose=True) == 2
    out = capsys.readouterr().out
    assert "1 x Qwen3NextRMSNorm: kind 'gemma'" in out
    assert "1 x Qwen3NextRMSNormGated: kind 'gated'" in out
    assert "LayerNorm (unknown class), e.g. ln" in out
    assert isinstance(model["gated"], PatchedRMSNorm)


@pytest.mark.parametrize("xd, wd", _DTYPES[:4], ids=str)
def test_gated_module_rounding_order(xd, wd):
    """Qwen3NextRMSNormGated: with polynorm's rstd and silu (z / (1 + exp(-z)) in float32)
    in HF's lines, the patched module is HF's formula bit for bit; against HF itself
    (torch's rsqrt statistic and silu kernel) it is within the tolerance below."""
    from transformers.models.qwen3_next import modeling_qwen3_next as q3n

    d = 48
    hf = q3n.Qwen3NextRMSNormGated(d, eps=1e-6)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        hf.weight.data = (torch.randn(d, generator=g) * 0.3 + 0.5).to(wd)
    x = (torch.randn(3, 70, d, generator=g) * 2).to(xd)
    gate = (torch.randn(3, 70, d, generator=g) * 2).to(xd)
    ref = hf(x, gate)
    m = torch.nn.Sequential(hf)
    assert patch(m) == 1
    got = m[0](x, gate)
    with torch.no_grad():
        _, r = pn.rms_norm_gated(x, gate, hf.weight, eps=1e-6, norm_before_gate=True,
                                 casting="llama", return_rstd=True)
    gf = gate.float()
    silu = gf / (1 + torch.exp(-gf))
    want = ((hf.weight * (x.float() * r[..., None]).to(xd)) * silu).to(xd)
    assert got.dtype == ref.dtype == xd and got.shape == ref.shape
    assert torch.equal(got, want), (xd, wd)
    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[xd]
    assert _rel(got, ref) <= tol
    with pytest.raises(TypeError, match="gate"):
        m[0](x)
    assert unpatch(m) == 1 and m[0] is hf


def test_bad_arguments():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        patch("llama")
    with pytest.raises(TypeError, match="include"):
        patch(torch.nn.Sequential(), include=[1])
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        unpatch(None)
    with pytest.raises(TypeError, match="original must be one of the known norm classes"):
        PatchedRMSNorm(torch.nn.LayerNorm(4))
