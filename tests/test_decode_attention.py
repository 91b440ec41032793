"""decode_attention beyond the shared suite: cache rows past each length are never read, the split plan fills the
GPU, the op traces under torch.compile, and a call never syncs the host."""

from __future__ import annotations

import math

import pytest
import torch

import hkernels
from hkernels import references
from tests.conftest import ON_GPU
from tests.specs import TOLERANCES, max_error
from triton_fallback import decode_attention as t_decode

BACKENDS = ["helion", "triton", "torch"]


def _inputs(device: torch.device, dtype: torch.dtype, b: int = 4, hq: int = 8, hk: int = 2, sq: int = 4,
            s_max: int = 70, d: int = 64, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g)
    k, v = (torch.randn(b, hk, s_max, d, generator=g) for _ in range(2))
    lengths = torch.tensor([s_max, 0, 2, 37][:b], dtype=torch.int32)  # full, empty, shorter than Sq, partial
    return *(t.to(device=device, dtype=dtype) for t in (q, k, v)), lengths.to(device)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_past_each_length_are_never_read(backend, dtype, device):
    """NaN and ±inf in every cache row at or past L_b change nothing: the output is bitwise the one of the clean
    cache, finite, within tolerance of the float64 reference, and exactly 0 for a query that sees no key (an
    empty cache; tokens 0 and 1 of a cache of 2 rows with 4 new tokens)."""
    q, k, v, lengths = _inputs(device, dtype)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for i, n in enumerate(lengths.tolist()):
        poisoned_k[i, :, n:] = math.nan
        poisoned_v[i, :, n:] = math.inf if i % 2 else -math.inf
        poisoned_v[i, :, n::3] = math.nan
    with hkernels.use_backend(backend):
        clean = hkernels.decode_attention(q, k, v, lengths, window=(20, None), softcap=30.0)
        out = hkernels.decode_attention(q, poisoned_k, poisoned_v, lengths, window=(20, None), softcap=30.0)
    assert torch.isfinite(out).all(), f"{backend}: a poisoned row was read"
    assert torch.equal(out, clean)
    assert not out[1].any() and not out[2, :, :2].any(), "a query that sees no key must give zeros"
    ref = references.decode_attention(q.double(), k.double(), v.double(), lengths, window=(20, None), softcap=30.0)
    base = references.decode_attention(q, k, v, lengths, window=(20, None), softcap=30.0)
    problem = max_error("out", out, ref, base, dtype)
    assert problem is None, problem


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_calls_read_each_calls_lengths_and_options(backend, device):
    """Calls of one signature after the first run in one step (the plan's bound kernel): each still reads its own
    lengths and data, and a call with other option values (scale, window, softcap) is its own signature."""
    q, k, v, lengths = _inputs(device, torch.float32)
    calls = [(lengths, {}), (lengths.flip(0), {}), (lengths.flip(0), {}),
             (lengths, {"scale": 0.5, "window": (5, None)}), (lengths, {"softcap": 10.0})]
    with hkernels.use_backend(backend):
        for i, (n, options) in enumerate(calls):
            got = hkernels.decode_attention(q * (i + 1), k, v, n, **options)
            want = references.decode_attention((q * (i + 1)).double(), k.double(), v.double(), n, **options)
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"call {i}: {m}")


def test_a_full_cache_of_new_tokens_is_causal_attention(device):
    """Sq = L = S_max: every new token at its own position, which is causal self-attention."""
    q, k, v, _ = _inputs(device, torch.float32, b=2, sq=33, s_max=33)
    lengths = torch.full((2,), 33, dtype=torch.int32, device=device)
    want = references.attention(q.double(), k.double(), v.double(), causal=True)
    for backend in BACKENDS:
        with hkernels.use_backend(backend):
            got = hkernels.decode_attention(q, k, v, lengths)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m, b=backend: f"{b}: {m}")


def test_the_split_plan_fills_the_gpu(monkeypatch):
    """One sequence of 128k tokens with 8 key/value heads: about two programs per multiprocessor of an H200, chunks
    a multiple of the step; a batch that fills the GPU by itself is not split; a short cache is not cut below the
    minimum chunk."""
    monkeypatch.setattr(t_decode, "num_sms", lambda device: 132)
    gpu = torch.device("cuda")
    ns, chunk = t_decode.split_plan(8, 131072, 64, 256, 2, gpu)
    assert 8 * ns >= 2 * 132 and chunk % 64 == 0 and (ns - 1) * chunk < 131072 <= ns * chunk
    assert t_decode.split_plan(64 * 8, 131072, 64, 256, 2, gpu) == (1, 131072)
    ns, chunk = t_decode.split_plan(8, 1000, 64, 256, 2, gpu)
    assert chunk >= 256 and ns * chunk >= 1000 and ns <= 4


@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_a_symbolic_cache_length_keeps_the_split_count(backend, monkeypatch, device):
    """At a symbolic S_max (a compiled graph whose cache grows a row a step) the count of splits comes from the
    programs alone and each chunk is the length's share: splits that start past the cache find no key, and the
    result is the reference's (here on concrete sizes, the plan as it is at a symbolic one)."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    monkeypatch.setattr(t_decode, "num_sms", lambda device: 132)
    env = ShapeEnv()
    s = env.create_symintnode(sympy.Symbol("s0", positive=True, integer=True), hint=70)
    ns, chunk = t_decode.split_plan(8, s, 64, 256, 2, torch.device("cuda"))
    assert ns == 33 and isinstance(chunk, torch.SymInt), (ns, chunk)  # cdiv(2·132, 8) splits, whatever S_max
    plan = t_decode.split_plan

    def at_symbolic(programs, s_max, block_n, min_chunk, per_sm, device):
        want = max(1, min(t_decode.MAX_SPLITS, 6 * plan(programs, s_max, block_n, min_chunk, per_sm, device)[0]))
        return want, t_decode.cdiv(t_decode.cdiv(s_max, want), block_n) * block_n  # (more splits than chunks)

    if backend == "helion":
        from hkernels.ops import decode_attention as module
    else:
        module = t_decode
    monkeypatch.setattr(module, "split_plan", at_symbolic)
    q, k, v, lengths = _inputs(device, torch.float32)
    got = module.decode_attention_fwd(q, k, v, lengths, 0.125, -1, 0.0)
    want = references.decode_attention(q.double(), k.double(), v.double(), lengths, scale=0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_a_gradient_wanted_raises(device):
    """Forward only: inputs that require grad (grad mode on) raise naming the op, instead of a result without a
    graph; under no_grad the same call runs and its result needs no gradient."""
    q, k, v, lengths = _inputs(device, torch.float32, b=1)
    q.requires_grad_()
    with pytest.raises(ValueError, match=r"^hkernels\.decode_attention: it is forward only"):
        hkernels.decode_attention(q, k, v, lengths)
    with torch.no_grad():
        assert not hkernels.decode_attention(q, k, v, lengths).requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_fullgraph_matches_eager(backend, device):
    """torch.compile(fullgraph=True) traces through the custom op (its fake gives the shape): no graph break."""
    torch._dynamo.reset()
    q, k, v, lengths = _inputs(device, torch.float32)

    def f(q, k, v, lengths):
        return hkernels.decode_attention(q * 2, k, v, lengths, window=(9, None), softcap=5.0).sum(-1)

    with hkernels.use_backend(backend):
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, lengths)
        want = f(q, k, v, lengths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_with_inductor(device):
    torch._dynamo.reset()
    q, k, v, lengths = _inputs(device, torch.float32)

    def f(q, k, v, lengths):
        return hkernels.decode_attention(q * 2, k, v, lengths, softcap=5.0).sum(-1)

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v, lengths), f(q, k, v, lengths), rtol=1e-5,
                               atol=1e-5)


def test_custom_op_registration(device):
    """torch.library's checks of hkernels::decode_attention_fwd: schema, fake kernel against the real one."""
    q, k, v, lengths = _inputs(device, torch.float32, b=2)
    torch.library.opcheck(torch.ops.hkernels.decode_attention_fwd.default, (q, k, v, lengths, 0.125, -1, 0.0, ""))


@pytest.mark.skipif(not ON_GPU, reason="a host sync is a CUDA notion")
@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_a_call_never_syncs_the_host(backend, device):
    """The lengths are read on the device: with CUDA's sync debug mode set to error, a call (after the first,
    which compiles) raises nothing."""
    q, k, v, lengths = _inputs(device, torch.bfloat16, b=4, hq=32, hk=8, sq=1, s_max=4096, d=128)
    with hkernels.use_backend(backend):
        hkernels.decode_attention(q, k, v, lengths)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            hkernels.decode_attention(q, k, v, lengths)
        finally:
            torch.cuda.set_sync_debug_mode("default")
