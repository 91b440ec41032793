"""hkernels.patch on Hugging Face's own Llama, Mistral, Qwen2, Qwen2.5-VL's text model, Gemma 2/3 and MoE classes
(tiny random-init configs, no downloads): what it replaces, loss and gradients against the unpatched model,
unpatch, state_dicts both ways."""

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

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def _tiny(family: str, device: torch.device):
    cfg_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[family]
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
        qk = ["qk_norm_rope"] if family == "qwen3" else []  # Qwen3's attention: its q_norm, k_norm and rope fused
        assert ops == sorted(["fused_linear_cross_entropy", "rms_norm", "rope", "swiglu", *qk]), ops
        assert sum(r.op == "qk_norm_rope" for r in done) == (2 if qk else 0)  # one per layer
        per_layer = 4 if family == "qwen3" else 2  # Qwen3's q_norm and k_norm too
        assert sum(r.op == "rms_norm" for r in done) == per_layer * 2 + 1
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


@pytest.mark.parametrize("ops", ["qk_norm_rope", None], ids=["alone", "default"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_hf_attention_with_head_norms_runs_qk_norm_rope(family, ops, device, monkeypatch):
    """Qwen3's and Gemma 3's attention patched (Gemma 3: 1 + weight norms, a sliding and a full layer): q_norm,
    k_norm and rope as one qk_norm_rope call per layer and step (the norms as transformers' modules, or as
    hkernels' after the rms_norm patch), the cache updated as transformers does; loss and every gradient as the
    unpatched model's, and greedy generation (one-token steps over the cache) the same tokens."""
    from hkernels.functional import qk_norm_rope as module

    model, ids = _tiny(family, device) if family == "qwen3" else _tiny_windowed(family, device)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:  # weights that matter (Gemma's start at 0: a scale of 1)
                p.add_(torch.randn(p.shape, generator=g).to(p.device) * 0.3)
    plain = copy.deepcopy(model)
    calls = []
    real = module.qk_norm_rope
    monkeypatch.setattr(module, "qk_norm_rope", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    labels = ids.clone()
    labels[0, 3] = -100
    want = plain(input_ids=ids, labels=labels)
    want.loss.backward()
    done = hkernels.patch(model, ops=ops)
    try:
        assert sum(r.op == "qk_norm_rope" for r in done) == model.config.num_hidden_layers
        with hkernels.use_backend("triton"):
            got = model(input_ids=ids, labels=labels)
            got.loss.backward()
            assert len(calls) == model.config.num_hidden_layers  # one call per layer
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-5)
            for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
            model.eval()
            plain.eval()
            with torch.no_grad():
                tokens = model.generate(ids[:1, :6], max_new_tokens=3, do_sample=False)
                assert torch.equal(tokens, plain.generate(ids[:1, :6], max_new_tokens=3, do_sample=False))
            layers = model.config.num_hidden_layers  # the prompt, then two steps of one token
            assert [s[2] for s in calls[layers:]] == [6] * layers + [1] * (2 * layers)
    finally:
        unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


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


# Each Hugging Face RMSNorm class patch knows by name: its modeling module and its offset (1: x̂ · (1 + w)).
NORMS = {"LlamaRMSNorm": ("llama", 0.0), "MistralRMSNorm": ("mistral", 0.0), "MixtralRMSNorm": ("mixtral", 0.0),
         "Qwen2RMSNorm": ("qwen2", 0.0), "Qwen2VLRMSNorm": ("qwen2_vl", 0.0),
         "Qwen2_5_VLRMSNorm": ("qwen2_5_vl", 0.0), "Qwen3RMSNorm": ("qwen3", 0.0),
         "Qwen3MoeRMSNorm": ("qwen3_moe", 0.0), "Phi3RMSNorm": ("phi3", 0.0), "GraniteRMSNorm": ("granite", 0.0),
         "DeepseekV3RMSNorm": ("deepseek_v3", 0.0), "GemmaRMSNorm": ("gemma", 1.0),
         "Gemma2RMSNorm": ("gemma2", 1.0), "Gemma3RMSNorm": ("gemma3", 1.0), "Qwen3NextRMSNorm": ("qwen3_next", 1.0)}


def test_hf_norms_known_by_name_are_the_tested_ones():
    from hkernels.patch import HF_OFFSET_RMS_NORMS, HF_RMS_NORMS

    assert sorted(HF_RMS_NORMS) == sorted(k for k, (_, offset) in NORMS.items() if offset == 0.0)
    assert sorted(HF_OFFSET_RMS_NORMS) == sorted(k for k, (_, offset) in NORMS.items() if offset == 1.0)


def _named_norms_match(offset: float, weight_dtype: torch.dtype, device: torch.device, monkeypatch) -> None:
    """Each RMSNorm class of NORMS with this offset (absent from this transformers: skipped) becomes
    hkernels.nn.RMSNorm with ``offset``, sharing the weight, with the same output and gradients (bfloat16 input, a
    weight of ``weight_dtype`` near what trained ones are) — recognised by name even without the mark transformers'
    kernel mapping sets, which is missing where the `kernels` package is not installed."""
    found = []
    for cls_name, (model, its_offset) in NORMS.items():
        if its_offset != offset:
            continue
        try:
            mod = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        except ImportError:
            continue
        cls = getattr(mod, cls_name, None)
        if cls is not None:
            monkeypatch.delattr(cls, "kernel_layer_name", raising=False)
            found.append(cls(48, eps=1e-6).to(device=device, dtype=weight_dtype))
    if not found:
        pytest.skip("none of these classes in this transformers")
    g = torch.Generator().manual_seed(2)
    for m in found:
        with torch.no_grad():
            m.weight.copy_(torch.randn(48, generator=g) * 0.1 + (1.0 - offset))
    plain = copy.deepcopy(torch.nn.Sequential(*found))
    net = torch.nn.Sequential(*found)
    done = hkernels.patch(net, ops="rms_norm")
    assert len(done) == len(found)
    assert all(isinstance(m, hnn.RMSNorm) and m.offset == offset for m in net)
    assert all(a.weight is b.weight for a, b in zip(net, found, strict=True))
    x = (torch.randn(3, 5, 48, generator=g) * 2).to(device=device, dtype=torch.bfloat16)
    up = torch.randn(x.shape, generator=g).to(device=device, dtype=torch.bfloat16)
    for ours, theirs in zip(net, plain, strict=True):  # one by one: a chain would compound bfloat16 roundings
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with hkernels.use_backend("triton"):
            y = ours(x1)
        want = theirs(x2)
        assert y.dtype == want.dtype, type(theirs).__name__
        torch.testing.assert_close(y, want, rtol=1.6e-2, atol=1e-2)
        got = torch.autograd.grad(y, [x1, ours.weight], up)
        ref = torch.autograd.grad(want, [x2, theirs.weight], up)
        for a, b in zip(got, ref, strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_hf_named_norms_are_replaced_without_the_kernels_package(weight_dtype, device, monkeypatch):
    """Every RMSNorm class patch names as Llama's computation (Mixtral's, Qwen2-VL's, Qwen3-MoE's, ...) is replaced
    with offset 0 and computes the same, also where transformers' kernel mark is absent: in a bfloat16 model, and
    with float32 weights on bfloat16 input (mixed precision's q_norm after a bfloat16 projection), where these
    classes return float32 (casting="llama")."""
    _named_norms_match(0.0, weight_dtype, device, monkeypatch)


def test_hf_norms_that_scale_by_one_plus_weight_get_offset_one(device, monkeypatch):
    """Gemma's, Gemma 2's, Gemma 3's and Qwen3-Next's RMSNorm compute x / rms(x) · (1 + weight) in float32: they
    become hkernels.nn.RMSNorm with offset 1."""
    _named_norms_match(1.0, torch.float32, device, monkeypatch)


def test_hf_look_alike_norms_of_other_forms_are_left_alone(device):
    """A class shaped like an RMSNorm that hkernels does not know (here: one marked for no known computation) is not
    replaced: the patch says what it looks for."""
    cls = type("SomeRMSNorm", (torch.nn.Module,), {"__module__": "transformers.models.some.modeling_some"})

    def init(self, n):
        torch.nn.Module.__init__(self)
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = 1e-6

    cls.__init__ = init
    net = torch.nn.Sequential(cls(16))
    with pytest.raises(ValueError, match=r"rms_norm replaced nothing.*is not known to compute x / rms\(x\) \* weight"):
        hkernels.patch(net, ops="rms_norm")
    assert not any(isinstance(m, hnn.RMSNorm) for m in net.modules())


def test_hf_attention_patch_runs_plain_causal_calls_and_restores(monkeypatch, device):
    """ops="attention" swaps HF's sdpa attention function and the model module's eager one for functions on
    hkernels.attention (plain causal calls; the rest stay on SDPA), loss and gradients match, and unpatch puts the
    registry entry and the module function back."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = _spy_attention(monkeypatch)
    model, ids = _tiny("llama", device)
    plain = copy.deepcopy(model)
    want = plain(input_ids=ids, labels=ids).loss
    want.backward()
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    module = importlib.import_module(type(model).__module__)
    eager = module.eager_attention_forward
    done = hkernels.patch(model, ops="attention")
    try:
        assert [r.where for r in done] == ["transformers:ALL_ATTENTION_FUNCTIONS[sdpa]",
                                           f"{module.__name__}.eager_attention_forward"]
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not original and module.eager_attention_forward is not eager
        with hkernels.use_backend("triton"):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        assert [c[0] for c in calls] == ["attention"] * 2  # one per layer
        torch.testing.assert_close(out.loss, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        unpatch(model)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original and module.eager_attention_forward is eager


def _spy_attention(monkeypatch) -> list[tuple[str, dict]]:
    """Records each call of hkernels.attention / attention_varlen made through the patch: (op, keyword args)."""
    from hkernels.functional import attention as dense
    from hkernels.functional import attention_varlen as varlen

    calls: list[tuple[str, dict]] = []
    for module, name in ((dense, "attention"), (varlen, "attention_varlen")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def _tiny_windowed(family: str, device: torch.device, window: int = 4, head_dim: int = 16):
    """Two layers, hidden 64, head dim 16, on the attention implementation the family loads with: Mistral (every
    layer sliding, sdpa), Gemma 2 (sliding then global layer, softcap 1.0, eager), Gemma 3 (sliding then global,
    sdpa). Weights and Gemma's scaling are large enough for scores of a few units, so that the cap and the windows
    change the result."""
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, sliding_window=window,
                  initializer_range=0.2)
    if family == "mistral":
        cfg, cls = transformers.MistralConfig(**common, head_dim=head_dim), transformers.MistralForCausalLM
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(**common, head_dim=head_dim, attn_logit_softcapping=1.0,
                                        query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
        cfg._attn_implementation = "eager"  # what transformers 5 loads it with (SDPA has no softcap)
        cls = transformers.Gemma2ForCausalLM
    else:
        cfg = transformers.Gemma3TextConfig(**common, head_dim=head_dim, query_pre_attn_scalar=16,
                                            layer_types=["sliding_attention", "full_attention"])
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).to(device)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids


def _patched_matches(model, plain, kwargs: dict, loss_of) -> None:
    """The patched model's loss_of(output) and every gradient equal the unpatched model's."""
    want = loss_of(plain(**kwargs))
    want.backward()
    hkernels.patch(model, ops="attention")
    try:
        with hkernels.use_backend("torch"):
            got = loss_of(model(**kwargs))
            got.backward()
    finally:
        unpatch(model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    _same_grads(model, plain)


def _same_grads(model, plain) -> None:
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_hf_attention_sliding_windows_and_softcap_run_on_hkernels(family, monkeypatch, device):
    """A sliding window W smaller than the sequence reaches hkernels.attention as window=(W - 1, 0) (Hugging
    Face's query sees W keys, itself included), Gemma's global layers without a window, Gemma 2's logit softcap as
    softcap, through the implementation each model runs (Gemma 2: eager; the others: sdpa); loss and gradients
    match the unpatched model."""
    calls = _spy_attention(monkeypatch)
    model, ids = _tiny_windowed(family, device, window=4)
    assert model.config._attn_implementation == ("eager" if family == "gemma2" else "sdpa")
    _patched_matches(model, copy.deepcopy(model), dict(input_ids=ids, labels=ids), lambda out: out.loss)
    windows = [(4 - 1, 0), (4 - 1, 0)] if family == "mistral" else [(4 - 1, 0), None]
    assert [(op, c["window"]) for op, c in calls] == [("attention", w) for w in windows]
    assert [c["softcap"] for _, c in calls] == [1.0 if family == "gemma2" else None] * 2


def test_hf_gemma_head_dim_256_runs_on_hkernels(monkeypatch, device):
    """Gemma's head dim of 256 is taken (its sliding and global layers reach hkernels.attention); loss and
    gradients match the unpatched model."""
    calls = _spy_attention(monkeypatch)
    model, ids = _tiny_windowed("gemma2", device, window=4, head_dim=256)
    _patched_matches(model, copy.deepcopy(model), dict(input_ids=ids, labels=ids), lambda out: out.loss)
    assert [(op, c["window"], c["softcap"]) for op, c in calls] == [("attention", (3, 0), 1.0),
                                                                   ("attention", None, 1.0)]


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2"])
def test_hf_attention_packed_documents_run_on_attention_varlen(family, monkeypatch, device):
    """Three documents packed in one row (position_ids restarting at 0, no attention mask: what
    DataCollatorWithFlattening gives) reach hkernels.attention_varlen with their cu_seqlens (Mistral and Gemma 2's
    sliding layer: with the window inside each document; Gemma 2: eager, with its softcap); the logits and every
    gradient equal those of each document run on its own through the unpatched model."""
    calls = _spy_attention(monkeypatch)
    if family == "qwen2":
        model, _ = _tiny("qwen2", device)
    else:
        model, _ = _tiny_windowed(family, device, window=3)
    plain = copy.deepcopy(model)
    lengths = [4, 6, 3]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 96, (1, sum(lengths)), generator=g).to(device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    weights = torch.randn(1, sum(lengths), 96, generator=g).to(device)  # a loss that reads every logit
    want, start = 0.0, 0
    for n in lengths:
        logits = plain(input_ids=ids[:, start:start + n], use_cache=False).logits
        want = want + (logits * weights[:, start:start + n]).sum()
        start += n
    want.backward()
    hkernels.patch(model, ops="attention")
    try:
        with hkernels.use_backend("torch"):
            got = (model(input_ids=ids, position_ids=pos, use_cache=False).logits * weights).sum()
            got.backward()
    finally:
        unpatch(model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    _same_grads(model, plain)
    windows = {"qwen2": [None, None], "mistral": [(3 - 1, 0)] * 2, "gemma2": [(3 - 1, 0), None]}[family]
    assert [(op, c["window"]) for op, c in calls] == [("attention_varlen", w) for w in windows]
    assert [c["softcap"] for _, c in calls] == [1.0 if family == "gemma2" else None] * 2


def test_hf_attention_calls_it_does_not_cover_keep_their_implementation(monkeypatch, device):
    """A padding mask, a padded packed row, weights asked for (eager returns them), decoding with a KV cache and an
    eager call without a mask (not causal) run the original function: hkernels is never called and the results
    are the unpatched model's."""
    from transformers.models.gemma2 import modeling_gemma2

    calls = _spy_attention(monkeypatch)
    mistral, ids = _tiny_windowed("mistral", device)
    gemma, _ = _tiny_windowed("gemma2", device)
    plains = {id(m): copy.deepcopy(m) for m in (mistral, gemma)}
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    packed_padding = torch.ones_like(ids[:1])
    packed_padding[0, -2:] = 0
    pos = torch.cat([torch.arange(5), torch.arange(6)])[None].to(device)
    cases = [(mistral, dict(input_ids=ids, attention_mask=padding)),
             (gemma, dict(input_ids=ids, attention_mask=padding)),
             (mistral, dict(input_ids=ids[:1], position_ids=pos, attention_mask=packed_padding, use_cache=False)),
             (gemma, dict(input_ids=ids, output_attentions=True))]
    for model in (mistral, gemma):
        hkernels.patch(model, ops="attention")
    try:
        with torch.no_grad(), hkernels.use_backend("torch"):
            for model, kwargs in cases:
                got, want = model(**kwargs), plains[id(model)](**kwargs)
                torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
                if kwargs.get("output_attentions"):
                    assert all(a is not None for a in got.attentions)
                    torch.testing.assert_close(got.attentions, want.attentions, rtol=0, atol=0)
            assert calls == []
            # decoding: one new token against the cache of the ones before (S = 1 != Skv)
            out = mistral(input_ids=ids[:, :-1], use_cache=True)
            assert len(calls) == 2
            cache = "cache" if "cache" in inspect.signature(mistral.forward).parameters else "past_key_values"
            mistral(input_ids=ids[:, -1:], use_cache=True, **{cache: out.past_key_values})
            assert len(calls) == 2
            q = torch.randn(1, 4, 6, 16, device=device)
            k = torch.randn(1, 2, 6, 16, device=device)
            attn = gemma.model.layers[0].self_attn
            got, weights = modeling_gemma2.eager_attention_forward(attn, q, k, k, None, scaling=0.25)
            assert weights is not None and calls[2:] == []
    finally:
        for model in (mistral, gemma):
            unpatch(model)


MOE_FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe"]


def _tiny_moe(family: str, device: torch.device):
    pytest.importorskip("transformers.integrations.moe", reason="this transformers has no experts interface (5.x has)")
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
    with pytest.raises(ValueError, match=r"moe replaced nothing.*are not what hkernels\.moe computes \(biases"):
        hkernels.patch(model, ops=["moe"])
    assert model.config._experts_implementation == before
    for m in _experts(model):
        m.has_bias = False
    done = hkernels.patch(model, ops=["moe"])
    assert len(done) == 1 and all(m.__dict__[_BEFORE] == before for m in _experts(model))
    unpatch(model)
    assert model.config._experts_implementation == before and not any(_BEFORE in m.__dict__ for m in _experts(model))


def _marked() -> bool:
    """transformers marks its layers for the kernels package, and the installed kernels is the one it takes."""
    from transformers.models.llama import modeling_llama

    return getattr(modeling_llama.LlamaRMSNorm, "kernel_layer_name", None) == "RMSNorm"


def _hub():
    if not _marked():
        pytest.skip("this transformers marks no layer for the kernels package (transformers 5 with kernels does)")
    pytest.importorskip("kernels")
    from hkernels import hub

    return hub


def _replaced(m: torch.nn.Module) -> bool:
    """m's forward is set on the instance to something other than its class's own."""
    own = m.__dict__.get("forward")
    return own is not None and getattr(own, "__func__", None) is not type(m).forward


def _functions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The marked functions' modules the attention modules call: one per attention module (kernels 0.19), or the
    module-level one they share (0.16)."""
    found = {id(f): f for m in model.modules() for f in getattr(m, "_kernel_funcs", {}).values()}
    return list(found.values())


def _spy_hub(monkeypatch) -> list[str]:
    """Records each call hkernels' kernelized layers make: "rms_norm" or "rope"."""
    import sys

    from hkernels import hub

    calls: list[str] = []
    real_norm, patch_module = hub.rms_norm, sys.modules["hkernels.patch"]
    real_rotate = patch_module._rotate
    monkeypatch.setattr(hub, "rms_norm", lambda *a, **k: calls.append("rms_norm") or real_norm(*a, **k))
    monkeypatch.setattr(patch_module, "_rotate", lambda *a: calls.append("rope") or real_rotate(*a))
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_kernelize_runs_marked_layers_on_hkernels(family, device, monkeypatch):
    """hkernels.hub.kernelize on a transformers-5 model: kernels.kernelize with hkernels' mapping puts every marked
    RMSNorm and each attention module's copy of apply_rotary_pos_emb on hkernels (the modules keep their class and
    state_dict; the module's function is left as it is), hkernels.patch the MLP and the loss; the loss and every
    gradient match the unpatched model; unpatch gives every forward back."""
    hub = _hub()
    from kernels import Mode

    model, ids = _tiny(family, device)
    module = importlib.import_module(type(model).__module__)
    rope_fn, norm_cls = module.apply_rotary_pos_emb, type(model.model.norm)
    plain = copy.deepcopy(model)
    labels = ids.clone()
    labels[1, 2] = -100
    want = plain(input_ids=ids, labels=labels).loss
    want.backward()
    calls = _spy_hub(monkeypatch)
    done = hub.kernelize(model, Mode.TRAINING)
    try:
        kinds = {(r.op, r.kind) for r in done}
        assert kinds == {("rms_norm", "kernelized"), ("rope", "kernelized"), ("swiglu", "forward"),
                         ("fused_linear_cross_entropy", "forward")}, kinds
        layers = model.config.num_hidden_layers
        norms = (4 if family == "qwen3" else 2) * layers + 1
        assert sum(r.op == "rms_norm" for r in done) == norms
        assert sum(r.op == "rope" for r in done) == len(_functions(model)) in (1, layers)
        assert type(model.model.norm) is norm_cls and module.apply_rotary_pos_emb is rope_fn
        assert model.state_dict().keys() == plain.state_dict().keys()
        assert hub.kernelize(model, Mode.TRAINING) == []  # already on hkernels
        with hkernels.use_backend("triton"):
            out = model(input_ids=ids, labels=labels)
            out.loss.backward()
        assert calls.count("rms_norm") == norms and calls.count("rope") == layers
        assert out.logits is None
        torch.testing.assert_close(out.loss, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        unpatch(model)
    assert not any(_replaced(m) for m in model.modules()) and not any(_replaced(f) for f in _functions(model))


def test_hf_kernel_mapping_is_what_kernels_kernelize_takes(device, monkeypatch):
    """The mapping alone, as a kernels user would use it: kernels.kernelize inside use_kernel_mapping puts the
    marked norms and rope of a Llama on hkernels, in every mode, with no network; the result matches."""
    hub = _hub()
    import kernels

    model, ids = _tiny("llama", device)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    calls = _spy_hub(monkeypatch)
    try:
        for mode in (kernels.Mode.INFERENCE, kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE):
            with kernels.use_kernel_mapping(hub.mapping()):
                kernels.kernelize(model, mode=mode, device=device.type)
            with torch.no_grad(), hkernels.use_backend("torch"):
                torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        assert calls.count("rms_norm") == 2 * 5 and calls.count("rope") == 2 * 2
    finally:
        for m in (*model.modules(), *_functions(model)):
            m.__dict__.pop("forward", None)  # (0.16 shares the module-level function: leave it as it was)
    assert set(hub.mapping("rms_norm")) == {"RMSNorm"}
    with pytest.raises(ValueError, match=r"hkernels\.hub\.mapping: no marked layer for op\(s\) \['swiglu'\]"):
        hub.mapping(["swiglu"])


def test_hf_kernelize_raises_for_an_op_it_cannot_place(device):
    """kernelize, like patch, never silently does nothing: geglu asked for on a SiLU model raises and leaves the
    model as it was."""
    hub = _hub()
    model, _ = _tiny("llama", device)
    with pytest.raises(ValueError, match=r"hkernels\.hub\.kernelize: geglu replaced nothing"):
        hub.kernelize(model, ops=["rms_norm", "geglu"])
    assert not any(_replaced(m) for m in model.modules())


def test_hf_kernelized_model_trains_under_torch_compile(device):
    """A model kernelized for torch.compile (Mode.TRAINING | Mode.TORCH_COMPILE) compiles with hkernels' layers in
    the graph; the compiled loss and gradients match the unpatched eager model."""
    hub = _hub()
    from kernels import Mode

    model, ids = _tiny("llama", device)
    plain = copy.deepcopy(model)
    want = plain(input_ids=ids, labels=ids).loss
    want.backward()
    hkernels.kernelize(model, Mode.TRAINING | Mode.TORCH_COMPILE)
    try:
        with hkernels.use_backend("triton"):
            loss = torch.compile(model)(input_ids=ids, labels=ids).loss
            loss.backward()
        torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
        _same_grads(model, plain)
    finally:
        unpatch(model)
    assert hub.kernelize is hkernels.kernelize


def _train_under_autocast(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype | None,
                          steps: int = 3) -> list[float]:
    """``steps`` AdamW steps of float32 parameters, each forward (and the loss) under autocast to ``dtype`` (None:
    plain float32); the backward and the step outside it, as mixed-precision training does."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        with torch.autocast(ids.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=labels).loss
        assert loss.dtype == torch.float32
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_hf_patched_llama_trains_under_autocast(backend, dtype, device):
    """A patched tiny Llama (float32 parameters) trained three steps with its forward under autocast gives the
    unpatched model's losses under the same autocast, within twice what autocast itself moves the unpatched
    model's losses from float32 training (the suite's rule: a small multiple of PyTorch's own error in that
    dtype), and at least a bf16 ulp of the loss."""
    model, ids = _tiny("llama", device)
    plain, plain32 = copy.deepcopy(model), copy.deepcopy(model)
    labels = ids.clone()
    labels[1, :2] = -100
    want = _train_under_autocast(plain, ids, labels, dtype)
    exact = _train_under_autocast(plain32, ids, labels, None)
    hkernels.patch(model)
    try:
        with hkernels.use_backend(backend):
            got = _train_under_autocast(model, ids, labels, dtype)
    finally:
        unpatch(model)
    for step, (g, w, e) in enumerate(zip(got, want, exact, strict=True)):
        allowed = max(2 * abs(w - e), 2 * torch.finfo(torch.bfloat16).eps * abs(w))
        assert abs(g - w) <= allowed, f"step {step}: patched {g:.6f}, unpatched {w:.6f} (float32 {e:.6f})"


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_hf_gemma_loss_with_final_logit_softcap_runs_on_the_linear_loss(family, backend, device):
    """Gemma 2/3 cap their logits (final_logit_softcapping, here 3.0: scores of a few units are changed by it):
    the patched causal LM's loss, on the fused linear loss with that softcap and Gemma's norms with offset 1,
    and every gradient match the unpatched model's; no logits."""
    model, ids = _tiny_windowed(family, device)
    model.config.final_logit_softcapping = 3.0
    plain = copy.deepcopy(model)
    want = plain(input_ids=ids, labels=ids).loss
    want.backward()
    done = hkernels.patch(model)
    try:
        assert {"fused_linear_cross_entropy", "rms_norm"} <= {r.op for r in done}
        with hkernels.use_backend(backend):
            out = model(input_ids=ids, labels=ids)
            assert out.logits is None
            out.loss.backward()
    finally:
        unpatch(model)
    torch.testing.assert_close(out.loss, want, rtol=1e-4, atol=1e-5)
    _same_grads(model, plain)


def _tiny_qwen2_5_vl_text(device: torch.device):
    """Qwen2.5-VL's text model (mRoPE: three position streams), tiny and random; position ids whose streams differ
    (an image's height and width positions), so that a rotation reading the wrong stream shows."""
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    section = [2, 3, 3]  # head dim 16
    if "rope_parameters" in inspect.signature(transformers.Qwen2_5_VLTextConfig.__init__).parameters:
        cfg = transformers.Qwen2_5_VLTextConfig(**common, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    else:  # transformers 4.x
        cfg = transformers.Qwen2_5_VLTextConfig(**common, rope_scaling={"type": "mrope", "mrope_section": section})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLTextModel(cfg).to(device)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 96, (2, 10), generator=g).to(device)
    t = torch.arange(10).expand(2, 10)
    positions = torch.stack([t, t // 3, t % 3 + 2]).to(device)  # [3, B, S]
    return model, ids, positions


def test_hf_qwen2_5_vl_text_model_runs_mrope_on_hkernels(device):
    """Qwen2.5-VL's text model patched: its rope (mRoPE over three position streams: transformers 4's
    apply_multimodal_rotary_pos_emb, or 5's apply_rotary_pos_emb after the rotary embedding selects the streams)
    runs on hkernels.rope, with the norms and the MLP; hidden states and every gradient as the unpatched model's."""
    model, ids, positions = _tiny_qwen2_5_vl_text(device)
    plain = copy.deepcopy(model)
    up = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(3)).to(device)
    want = plain(input_ids=ids, position_ids=positions).last_hidden_state
    (want * up).sum().backward()
    done = hkernels.patch(model)
    try:
        assert {"rms_norm", "swiglu", "rope"} <= {r.op for r in done}, sorted({r.op for r in done})
        module = importlib.import_module(type(model).__module__)
        if hasattr(module, "apply_multimodal_rotary_pos_emb"):  # transformers 4: the mRoPE function itself
            ours = importlib.import_module("hkernels.patch").apply_multimodal_rotary_pos_emb
            assert module.apply_multimodal_rotary_pos_emb is ours
        with hkernels.use_backend("triton"):
            got = model(input_ids=ids, position_ids=positions).last_hidden_state
            (got * up).sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        unpatch(model)


def test_hf_falcon_h1_mlp_keeps_its_multipliers(device):
    """Falcon-H1's MLP (``down_proj(up · silu(gate · m_gate)) · m_down``) runs on swiglu with its multipliers fused:
    output and every gradient as the unpatched module's. Without them the patch would be silently wrong."""
    from transformers.models.falcon_h1 import modeling_falcon_h1

    cfg = transformers.FalconH1Config(hidden_size=64, intermediate_size=112, mlp_multipliers=[0.7, 1.3])
    torch.manual_seed(0)
    mlp = modeling_falcon_h1.FalconH1MLP(cfg).to(device)
    plain = copy.deepcopy(mlp)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4)).to(device)
    xp, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    up = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(5)).to(device)
    want = plain(xp)
    (want * up).sum().backward()
    done = hkernels.patch(mlp, ops=["swiglu"])
    try:
        assert [r.op for r in done] == ["swiglu"]
        with hkernels.use_backend("triton"):
            got = mlp(xo)
            (got * up).sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(mlp.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        unpatch(mlp)


def test_hf_kernelize_runs_qwen2_5_vl_text_model_on_hkernels(device, monkeypatch):
    """hkernels.hub.kernelize on Qwen2.5-VL's text model (transformers 5: the rotary embedding selects mRoPE's
    streams, then the marked apply_rotary_pos_emb rotates): its norms and rope on hkernels through kernels'
    mapping, the MLP by patch; hidden states and every gradient as the unpatched model's."""
    hub = _hub()
    from kernels import Mode

    model, ids, positions = _tiny_qwen2_5_vl_text(device)
    plain = copy.deepcopy(model)
    up = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(3)).to(device)
    want = plain(input_ids=ids, position_ids=positions).last_hidden_state
    (want * up).sum().backward()
    calls = _spy_hub(monkeypatch)
    done = hub.kernelize(model, Mode.TRAINING)
    try:
        assert {("rms_norm", "kernelized"), ("rope", "kernelized"), ("swiglu", "forward")} <= {
            (r.op, r.kind) for r in done}, sorted({(r.op, r.kind) for r in done})
        with hkernels.use_backend("triton"):
            got = model(input_ids=ids, position_ids=positions).last_hidden_state
            (got * up).sum().backward()
        assert calls.count("rope") == model.config.num_hidden_layers and "rms_norm" in calls
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        unpatch(model)
