"""hkernels.nn modules and hkernels.patch on a tiny Llama-style model (bench.model): state_dicts load both ways,
patching replaces what it says, the patched model's loss and gradients match the unpatched one, unpatch restores."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hkernels
from bench import model as bench_model
from hkernels import nn as hnn
from hkernels.patch import DEFAULT_OPS, OPS, Replacement, unpatch

BACKENDS = ["helion", "triton"]


def _grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [8, (4, 6)])
def test_rms_norm_and_layer_norm_modules_match_torch(backend, shape, device):
    g = torch.Generator().manual_seed(0)
    dims = (shape,) if isinstance(shape, int) else shape
    x = torch.randn(3, 5, *dims, generator=g).to(device)
    for ours, theirs in ((hnn.RMSNorm(shape, eps=1e-5), nn.RMSNorm(shape, eps=1e-5)),
                         (hnn.LayerNorm(shape), nn.LayerNorm(shape))):
        theirs.to(device)
        with torch.no_grad():
            for p in theirs.parameters():
                p.normal_(generator=None)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        ours.load_state_dict(theirs.state_dict())  # theirs -> ours
        ours.to(device)
        with hkernels.use_backend(backend):
            got = ours(x)
        torch.testing.assert_close(got, theirs(x), rtol=1e-4, atol=1e-4)
        theirs.load_state_dict(ours.state_dict())  # and back


def test_rms_norm_module_eps_none_is_the_dtype_eps(device):
    x = torch.randn(2, 16).to(device) * 1e-4
    ours, theirs = hnn.RMSNorm(16), nn.RMSNorm(16)
    torch.testing.assert_close(ours.to(device)(x), theirs.to(device)(x), rtol=1e-4, atol=1e-6)


def test_rotary_embedding_tables_and_rotation(device):
    """cos/sin as Llama's (base^(-2i/D), both halves), no state_dict entries, rotate() = the rope reference, and
    nn.Module.apply still works on it (a static method named apply once shadowed it)."""
    from hkernels import references

    rot = hnn.RotaryEmbedding(16, base=10000.0).to(device)
    assert rot.state_dict() == {}
    pos = torch.arange(5, device=device)[None]
    x = torch.randn(1, 5, 16, device=device)
    cos, sin = rot(x, pos)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, device=device).float() / 16)
    ang = pos[0, :, None].float() * inv
    torch.testing.assert_close(cos[0], torch.cat((ang, ang), -1).cos())
    torch.testing.assert_close(sin[0], torch.cat((ang, ang), -1).sin())
    q, k = torch.randn(1, 4, 5, 16, device=device), torch.randn(1, 2, 5, 16, device=device)
    got = rot.rotate(q, k, cos, sin)
    want = references.rope(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert rot.apply(lambda m: None) is rot


def test_module_input_of_the_wrong_size_names_the_module(device):
    with pytest.raises(ValueError, match=r"hkernels\.nn\.RMSNorm.*normalized shape"):
        hnn.RMSNorm(8).to(device)(torch.randn(2, 9).to(device))


def test_linear_cross_entropy_module_matches_unfused(device):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 5, 16, generator=g).to(device)
    w = torch.randn(40, 16, generator=g).to(device)
    t = torch.randint(0, 40, (2, 5), generator=g).to(device)
    t[0, 0] = -100
    got = hnn.LinearCrossEntropyLoss()(h, w, t)
    want = torch.nn.functional.cross_entropy((h @ w.T).flatten(0, 1), t.flatten())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    none = hnn.LinearCrossEntropyLoss(reduction="none")(h, w, t)
    assert none.shape == t.shape


def _tiny(device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    model = bench_model.build("tiny", device=device)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    return model, ids.to(device)


def test_patch_replaces_what_it_says_and_unpatch_restores(device):
    model, _ = _tiny(device)
    original_rope = bench_model.apply_rotary_pos_emb
    layers = model.config.num_layers
    done = hkernels.patch(model)
    try:
        by_op: dict[str, list[Replacement]] = {}
        for r in done:
            by_op.setdefault(r.op, []).append(r)
        assert len(by_op["rms_norm"]) == 2 * layers + 1  # two per layer and the final norm
        assert all(isinstance(model.get_submodule(r.where), hnn.RMSNorm) for r in by_op["rms_norm"])
        assert [r.where for r in by_op["swiglu"]] == [f"model.layers.{i}.mlp" for i in range(layers)]
        assert [r.where for r in by_op["rope"]] == ["bench.model.apply_rotary_pos_emb"]
        assert bench_model.apply_rotary_pos_emb is not original_rope
        assert [r.where for r in by_op["fused_linear_cross_entropy"]] == ["<model>"]
        assert set(by_op) == {"rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"}
        # Parameters are the same objects: an optimizer built before patching still owns them.
        assert model.model.norm.weight is done[[r.where for r in done].index("model.norm")].old.weight
        assert hkernels.patch(model) == []  # nothing left to replace
    finally:
        restored = unpatch(model)
    assert len(restored) == len(done)
    assert bench_model.apply_rotary_pos_emb is original_rope
    assert type(model.model.norm) is nn.RMSNorm and "forward" not in model.__dict__
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)


@pytest.mark.parametrize("backend", BACKENDS)
def test_patched_model_matches_unpatched_loss_and_gradients(backend, device):
    """The whole tiny model, float32: loss and every parameter's gradient, patched (each backend) vs plain."""
    model, ids = _tiny(device)
    plain = copy.deepcopy(model)
    want = plain(ids, labels=ids).loss
    want.backward()
    hkernels.patch(model)
    try:
        with hkernels.use_backend(backend):
            out = model(ids, labels=ids)
            assert out.logits is None  # the fused loss: no logits made
            out.loss.backward()
        torch.testing.assert_close(out.loss, want, rtol=1e-4, atol=1e-5)
        got, ref = _grads(model), _grads(plain)
        assert got.keys() == ref.keys() and len(got) == len(list(model.parameters()))
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        # Without labels the model's own forward runs: logits, no loss.
        with torch.no_grad(), hkernels.use_backend(backend):
            logits = model(ids).logits
        torch.testing.assert_close(logits, plain(ids).logits, rtol=1e-3, atol=1e-4)
    finally:
        unpatch(model)


def test_attention_is_opt_in_and_matches(device):
    """ops=None leaves attention alone; asking for it replaces bench.model's marked causal_attention, and the
    tiny model's loss and gradients still match the unpatched one (Triton's attention kernel, head dim 16)."""
    model, ids = _tiny(device)
    assert "attention" in OPS and "attention" not in DEFAULT_OPS
    original = bench_model.causal_attention
    done = hkernels.patch(model)
    try:
        assert all(r.op != "attention" for r in done)
    finally:
        unpatch(model)
    plain = copy.deepcopy(model)
    want = plain(ids, labels=ids).loss
    want.backward()
    done = hkernels.patch(model, ops="all")  # every op that applies, attention included
    try:
        assert {r.op for r in done} == {"rms_norm", "swiglu", "rope", "fused_linear_cross_entropy", "attention"}
        assert [r.where for r in done if r.op == "attention"] == ["bench.model.causal_attention"]
        assert bench_model.causal_attention is not original
        with hkernels.use_backend("triton"):
            loss = model(ids, labels=ids).loss
            loss.backward()
        torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        unpatch(model)
    assert bench_model.causal_attention is original


def test_state_dict_loads_both_ways_between_patched_and_plain(device):
    model, _ = _tiny(device)
    plain, _ = _tiny(device)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    hkernels.patch(model)
    try:
        assert model.state_dict().keys() == plain.state_dict().keys()
        model.load_state_dict(plain.state_dict())
        for (n, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
            assert torch.equal(a, b), n
        fresh, _ = _tiny(device)
        fresh.load_state_dict(model.state_dict())  # patched -> plain
        assert torch.equal(fresh.model.norm.weight, plain.model.norm.weight)
    finally:
        unpatch(model)


def test_patch_picks_ops_and_rejects_unknown_ones(device):
    model, _ = _tiny(device)
    done = hkernels.patch(model, ops="rms_norm")
    try:
        assert {r.op for r in done} == {"rms_norm"}
        assert "forward" not in model.model.layers[0].mlp.__dict__
    finally:
        unpatch(model)
    with pytest.raises(ValueError, match=r"hkernels\.patch: unknown op.*flash"):
        hkernels.patch(model, ops=["flash"])
    with pytest.raises(TypeError, match=r"hkernels\.patch: model must be a torch\.nn\.Module"):
        hkernels.patch(object())
    assert set(OPS) >= {"rms_norm", "layer_norm", "swiglu", "geglu", "rope", "cross_entropy"}


def test_patch_never_silently_does_nothing(device):
    """An op named that replaces nothing raises, naming it and what it looks for, and the call replaces nothing
    at all (the model is as it was); strict=False warns and patches the rest; a second patch of the same ops finds
    them on hkernels and says nothing; bad ops arguments raise."""
    model, _ = _tiny(device)
    norm = model.model.norm
    with pytest.raises(ValueError, match=r"hkernels\.patch: layer_norm, geglu replaced nothing in \w+ \(layer_norm: "
                                         r"no torch\.nn\.LayerNorm; geglu: no MLP .*tanh-approximated GELU"):
        hkernels.patch(model, ops=["rms_norm", "geglu", "layer_norm"])
    assert model.model.norm is norm and "forward" not in model.model.layers[0].mlp.__dict__
    assert unpatch(model) == []  # nothing recorded
    with pytest.warns(RuntimeWarning, match=r"layer_norm replaced nothing"):
        done = hkernels.patch(model, ops="rms_norm,layer_norm", strict=False)
    try:
        assert {r.op for r in done} == {"rms_norm"} and isinstance(model.model.norm, hnn.RMSNorm)
        assert hkernels.patch(model, ops="rms_norm") == []  # already on hkernels: nothing to say
    finally:
        unpatch(model)
    assert model.model.norm is norm
    for bad, match in ((["rms_norm", "all"], "'all' stands alone"), ([], "names no op"), (3, "ops must be")):
        with pytest.raises((ValueError, TypeError), match=match):
            hkernels.patch(model, ops=bad)


def test_patch_layer_norm_gelu_mlp_and_cross_entropy_modules(device):
    """A non-Llama model: LayerNorm, a tanh-GELU gated MLP, and an nn.CrossEntropyLoss module."""

    class GeluMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(16, 24), nn.Linear(16, 24)
            self.down_proj, self.act_fn = nn.Linear(24, 16), nn.GELU(approximate="tanh")

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.mlp, self.head = nn.LayerNorm(16), GeluMLP(), nn.Linear(16, 10)
            self.loss = nn.CrossEntropyLoss(label_smoothing=0.1)

        def forward(self, x, t):
            return self.loss(self.head(self.mlp(self.norm(x))), t)

    torch.manual_seed(0)
    net = Net().to(device)
    plain = copy.deepcopy(net)
    x = torch.randn(6, 16).to(device)
    t = torch.randint(0, 10, (6,)).to(device)
    done = hkernels.patch(net)
    try:
        assert sorted(r.op for r in done) == ["cross_entropy", "geglu", "layer_norm"]
        torch.testing.assert_close(net(x, t), plain(x, t), rtol=1e-4, atol=1e-4)
    finally:
        unpatch(net)
    assert type(net.norm) is nn.LayerNorm and type(net.loss) is nn.CrossEntropyLoss


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # not marked: may be interleaved
    return q, k


class _OwnRope(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)


def test_unmarked_rope_functions_are_left_alone():
    """Only known modules' (and marked) apply_rotary_pos_emb are replaced: a look-alike may rotate interleaved
    pairs or part of the head, where rotate_half would be silently wrong. Asked for by name, that is an error
    saying why; with strict=False a warning."""
    with pytest.raises(ValueError, match=r"hkernels\.patch: rope replaced nothing in _OwnRope \(rope: "
                                         r"tests\.test_patch\.apply_rotary_pos_emb is not known to be the full "
                                         r"rotate_half rotation"):
        hkernels.patch(_OwnRope(), ops="rope")
    with pytest.warns(RuntimeWarning, match=r"rope replaced nothing"):
        assert hkernels.patch(_OwnRope(), ops="rope", strict=False) == []
    assert apply_rotary_pos_emb(1, 2, 3, 4) == (1, 2)


def test_modules_with_hooks_are_left_alone_with_a_warning(device):
    model, _ = _tiny(device)
    seen = []
    model.model.norm.register_forward_hook(lambda mod, args, out: seen.append(1))
    with pytest.warns(RuntimeWarning, match=r"hkernels\.patch: left 1 module.*model\.norm"):
        done = hkernels.patch(model, ops="rms_norm")
    try:
        assert "model.norm" not in [r.where for r in done] and len(done) == 2 * model.config.num_layers
        assert type(model.model.norm) is nn.RMSNorm
    finally:
        unpatch(model)


def test_gemma_style_rms_norm_is_left_alone(device):
    class GemmaRMSNorm(nn.Module):  # scales by (1 + weight): a different function
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.zeros(8)), 1e-6

    net = nn.Sequential(GemmaRMSNorm())
    with pytest.raises(ValueError, match=r"hkernels\.patch: no op applies in Sequential \(rms_norm: GemmaRMSNorm "
                                         r"is not known to compute x / rms\(x\) \* weight"):
        hkernels.patch(net)
    assert type(net[0]) is GemmaRMSNorm


def test_bench_moe_model_experts_become_moe_experts_and_match(device):
    """bench.model's marked experts module -> hkernels.nn.MoEExperts sharing its Parameters; loss and gradients of
    the tiny MoE model match the unpatched one; unpatch puts the module back."""
    model = bench_model.build("tiny_moe", device)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3)).to(device)
    want = plain(ids, labels=ids).loss
    want.backward()
    old = model.model.layers[0].mlp.experts
    done = hkernels.patch(model, ops=["moe"])
    try:
        assert [r.where for r in done] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        new = model.model.layers[0].mlp.experts
        assert isinstance(new, hnn.MoEExperts) and new.gate_up_proj is old.gate_up_proj
        with hkernels.use_backend("triton"):
            loss = model(ids, labels=ids).loss
            loss.backward()
        torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        unpatch(model)
    assert model.model.layers[0].mlp.experts is old


@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_patch_weighted_cross_entropy_module(backend, device):
    """An nn.CrossEntropyLoss with class weights becomes hkernels.nn.CrossEntropyLoss holding the same weight buffer
    (the same state_dict), with the same loss and logits gradient."""
    g = torch.Generator().manual_seed(4)
    weight = (torch.rand(10, generator=g) + 0.25).to(device)
    net = nn.Sequential(nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1))
    plain = copy.deepcopy(net)
    x = torch.randn(7, 10, generator=g).to(device)
    t = torch.tensor([1, 3, -100, 9, 0, 3, 5], device=device)
    done = hkernels.patch(net, ops="cross_entropy")
    try:
        assert [r.op for r in done] == ["cross_entropy"] and isinstance(net[0], hnn.CrossEntropyLoss)
        assert net.state_dict().keys() == plain.state_dict().keys() and net[0].weight is weight
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with hkernels.use_backend(backend):
            got = net[0](x1, t)
        want = plain[0](x2, t)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        got.backward()
        want.backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    finally:
        unpatch(net)
    assert type(net[0]) is nn.CrossEntropyLoss


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_mlp_with_multipliers_is_falcon_h1s(bias, device):
    """hkernels.nn.SwiGLUMLP with Falcon-H1's multipliers computes down_proj(silu(gate · a) · up) · b (with a bias
    on down_proj too, where b cannot be fused), forward and every gradient, as the same math in PyTorch."""
    torch.manual_seed(0)
    mlp = hnn.SwiGLUMLP(16, 24, bias=bias, gate_multiplier=0.7, down_multiplier=1.3).to(device)
    x = torch.randn(3, 16, device=device, requires_grad=True)
    with hkernels.use_backend("triton"):
        got = mlp(x)
        got.sum().backward()
    grads = [x.grad, *(p.grad for p in mlp.parameters())]
    x.grad = None
    mlp.zero_grad()
    want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x) * 0.7) * mlp.up_proj(x)) * 1.3
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, [x.grad, *(p.grad for p in mlp.parameters())], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
