"""hkernels.patch on Hugging Face's own Llama, Mistral and Qwen2 classes (tiny random-init configs, no downloads):
what it replaces, loss and gradients against the unpatched model, unpatch, state_dicts both ways."""

from __future__ import annotations

import copy
import importlib
import inspect

import pytest
import torch

import hkernels
from hkernels import nn as hnn
from hkernels.patch import unpatch

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "mistral", "qwen2"]


def _tiny(family: str, device: torch.device):
    cfg_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM}[family]
    cfg = cfg_cls(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_cls(cfg).to(device)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_patch_replaces_norms_mlps_rope_and_loss(family, device):
    model, _ = _tiny(family, device)
    module = importlib.import_module(type(model).__module__)
    original_rope = module.apply_rotary_pos_emb
    done = hkernels.patch(model)
    try:
        ops = sorted({r.op for r in done})
        assert ops == ["fused_linear_cross_entropy", "rms_norm", "rope", "swiglu"], ops
        assert sum(r.op == "rms_norm" for r in done) == 2 * 2 + 1
        assert isinstance(model.model.norm, hnn.RMSNorm)
        assert module.apply_rotary_pos_emb is not original_rope
    finally:
        unpatch(model)
    assert module.apply_rotary_pos_emb is original_rope
    assert type(model.model.norm).__name__.endswith("RMSNorm") and not isinstance(model.model.norm, hnn.RMSNorm)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_patched_loss_and_gradients_match(family, device):
    model, ids = _tiny(family, device)
    plain = copy.deepcopy(model)
    labels = ids.clone()
    labels[0, 3] = -100
    want = plain(input_ids=ids, labels=labels).loss
    want.backward()
    hkernels.patch(model)
    try:
        with hkernels.use_backend("triton"):
            out = model(input_ids=ids, labels=labels)
            assert out.logits is None
            out.loss.backward()
        torch.testing.assert_close(out.loss, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        # num_items_in_batch (gradient accumulation): sum over tokens / the count, as Hugging Face's loss
        n = torch.tensor(7)
        with torch.no_grad(), hkernels.use_backend("triton"):
            got = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
            ref = plain(input_ids=ids, labels=labels, num_items_in_batch=n).loss
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        with torch.no_grad():  # without labels: logits as before
            torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-3,
                                       atol=1e-4)
    finally:
        unpatch(model)


def test_hf_state_dict_loads_both_ways(device):
    model, _ = _tiny("llama", device)
    plain, _ = _tiny("llama", device)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(2.0)
    hkernels.patch(model)
    try:
        assert model.state_dict().keys() == plain.state_dict().keys()
        model.load_state_dict(plain.state_dict())
        fresh, _ = _tiny("llama", device)
        fresh.load_state_dict(model.state_dict())
        assert torch.equal(fresh.model.norm.weight, plain.model.norm.weight)
    finally:
        unpatch(model)


def test_hf_return_dict_false_and_signature_kept(device):
    """return_dict=False gives a tuple with the loss first (no crash on the base model's tuple); the patched
    forward keeps the model's signature (HF's Trainer keeps only the input columns it names)."""
    model, ids = _tiny("llama", device)
    plain = copy.deepcopy(model)
    params = list(inspect.signature(model.forward).parameters)
    hkernels.patch(model)
    try:
        assert list(inspect.signature(model.forward).parameters) == params
        assert "attention_mask" in params
        with torch.no_grad():
            got = model(input_ids=ids, labels=ids, return_dict=False)
            want = plain(input_ids=ids, labels=ids, return_dict=False)
        assert isinstance(got, tuple)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    finally:
        unpatch(model)


def test_hf_look_alike_norms_that_scale_by_one_plus_weight_are_left_alone(device):
    """Classes shaped like Llama's RMSNorm but computing x / rms * (1 + weight): replacing them would be silently
    wrong, so only the known classes are patched."""
    found = []
    for mod_name, cls_name in (("qwen3_next", "Qwen3NextRMSNorm"), ("gemma", "GemmaRMSNorm"),
                               ("gemma2", "Gemma2RMSNorm")):
        try:
            mod = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
        except ImportError:
            continue
        cls = getattr(mod, cls_name, None)
        if cls is not None:
            found.append(cls(16))
    if not found:
        pytest.skip("none of the look-alike classes in this transformers")
    net = torch.nn.Sequential(*found)
    assert hkernels.patch(net, ops="rms_norm") == []


def test_hf_attention_patch_runs_plain_causal_calls_and_restores(monkeypatch, device):
    """ops="attention" swaps HF's sdpa attention function for one on hkernels.attention (plain causal calls; the
    rest stay on SDPA), loss and gradients match, and unpatch puts the registry entry back."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


    module = importlib.import_module("hkernels.functional.attention")
    calls = []
    real = module.attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "attention", spy)
    model, ids = _tiny("llama", device)
    plain = copy.deepcopy(model)
    want = plain(input_ids=ids, labels=ids).loss
    want.backward()
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    done = hkernels.patch(model, ops="attention")
    try:
        assert [r.op for r in done] == ["attention"] and ALL_ATTENTION_FUNCTIONS["sdpa"] is not original
        with hkernels.use_backend("triton"):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        assert len(calls) == 2  # one per layer
        torch.testing.assert_close(out.loss, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        # with a padding mask the call is not plain causal: SDPA runs it
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        assert len(calls) == 2
    finally:
        unpatch(model)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original


MOE_FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe"]


def _tiny_moe(family: str, device: torch.device):
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48, num_experts=6,
                                          num_experts_per_tok=2, norm_topk_prob=True)
        model_cls = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48, num_experts=6,
                                          num_experts_per_tok=3, shared_expert_intermediate_size=32)
        model_cls = transformers.Qwen2MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(**common, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)
        model_cls = transformers.MixtralForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_cls(cfg).to(device)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_hf_moe_experts_run_on_hkernels_and_match(family, device, monkeypatch):
    """The experts of Hugging Face's MoE models through transformers' experts interface: the model's config
    selects the "hkernels" implementation (no module replaced), every experts call reaches hkernels.moe, and the
    loss and every gradient match the unpatched model; unpatch restores the previous implementation."""
    model, ids = _tiny_moe(family, device)
    plain = copy.deepcopy(model)
    labels = ids.clone()
    want = plain(input_ids=ids, labels=labels).loss
    want.backward()
    before = model.config._experts_implementation
    calls = []
    from hkernels.functional import moe as moe_module

    real = moe_module.moe
    monkeypatch.setattr(moe_module, "moe", lambda *a: calls.append(1) or real(*a))
    done = hkernels.patch(model, ops=["moe"])
    try:
        assert [r.op for r in done] == ["moe"] and model.config._experts_implementation == "hkernels"
        assert not any(isinstance(m, hnn.MoEExperts) for m in model.modules())
        with hkernels.use_backend("triton"):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
        assert len(calls) == len(_experts(model)) == 2
        torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        unpatch(model)
    assert model.config._experts_implementation == before


def test_hf_moe_experts_module_is_a_drop_in(device):
    """hkernels.nn.MoEExperts: the same parameters and state_dict keys as Hugging Face's Qwen3-MoE experts, the
    same call and result; ``sharing`` holds the module's own Parameters."""
    model, _ = _tiny_moe("qwen3_moe", device)
    hf = _experts(model)[0]
    ours = hnn.MoEExperts(hf.num_experts, hf.hidden_dim, hf.intermediate_dim, device=device)
    ours.load_state_dict(hf.state_dict())
    assert list(ours.state_dict()) == list(hf.state_dict())
    shared = hnn.MoEExperts.sharing(hf)
    assert shared.gate_up_proj is hf.gate_up_proj and shared.down_proj is hf.down_proj
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, hf.hidden_dim, generator=g).to(device)
    idx = torch.randint(0, hf.num_experts, (7, 2), generator=g).to(device)
    w = torch.rand(7, 2, generator=g).to(device)
    model.config._experts_implementation_internal = "eager"
    with torch.no_grad(), hkernels.use_backend("triton"):
        torch.testing.assert_close(ours(x, idx, w), hf(x, idx, w), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(shared(x, idx, w), hf(x, idx, w), rtol=1e-4, atol=1e-5)


def test_hf_moe_patch_leaves_experts_it_cannot_compute(device):
    """A config whose experts hkernels.moe does not compute exactly (here: biases) keeps its implementation; a
    patched experts module remembers the implementation its config had, which unpatch forgets."""
    from hkernels.patch import _BEFORE

    model, _ = _tiny_moe("qwen3_moe", device)
    before = model.config._experts_implementation
    for m in _experts(model):
        m.has_bias = True
    assert hkernels.patch(model, ops=["moe"]) == [] and model.config._experts_implementation == before
    for m in _experts(model):
        m.has_bias = False
    done = hkernels.patch(model, ops=["moe"])
    assert len(done) == 1 and all(m.__dict__[_BEFORE] == before for m in _experts(model))
    unpatch(model)
    assert model.config._experts_implementation == before and not any(_BEFORE in m.__dict__ for m in _experts(model))
