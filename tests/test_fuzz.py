"""Differential fuzzing: random shapes, layouts, dtypes and values for every op, Helion and Triton against the
float64 reference, forward and every gradient.

Each example draws sizes that include 0, 1, primes and rows longer than a block, a layout for the main input
(contiguous, transposed, a column slice of a wider tensor, rows expanded from one), a dtype, and a value regime
(normal, tiny, large, or normal with NaN / ±inf planted in the main input). What must hold:
  - where PyTorch's own computation in the same dtype (``hkernels.references``, or the case's baseline) gives
    NaN / +inf / -inf, hkernels' output gives the same; where it gives a finite number, so does hkernels' and
    within the suite's tolerance of the float64 reference (tests/specs.py: a small multiple of PyTorch's own
    error);
  - gradients: non-finite exactly where PyTorch's are, finite and within tolerance elsewhere (a NaN row must not
    leak into other rows);
  - no input is written: every tensor argument holds what it held before the forward and backward.
Examples per op and backend: ``HKERNELS_FUZZ_EXAMPLES`` (default 6 on a CPU, where the kernels are interpreted;
60 on a GPU). Deterministic (derandomized, no example database): a failure reproduces by rerunning the test.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkernels
from hkernels import references
from tests.conftest import ON_GPU
from tests.specs import (
    TOLERANCES,
    _torch_attention,
    _torch_attention_varlen,
    _torch_chunked_linear_ce,
    _torch_grouped_matmul,
    _torch_matmul,
    _torch_moe,
    cast_case,
    ulps,
)
from tests.test_llm_ops import _leaves, _outputs

Tensor = torch.Tensor

EXAMPLES = int(os.environ.get("HKERNELS_FUZZ_EXAMPLES", "60" if ON_GPU else "6"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

ROWS = [0, 1, 2, 3, 5, 7, 13, 33] + ([257, 1031, 4096] if ON_GPU else [])
COLS = [1, 2, 3, 5, 16, 17, 64, 100, 257, 1031] + ([4096, 8192, 32771] if ON_GPU else [])
LONG = 40009 if not ON_GPU else 131101  # a prime, longer than any block of registers: the looped kernels
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded"]
REGIMES = ["normal", "tiny", "large", "special"]
DTYPES = list(TOLERANCES)


# ------------------------------------------------------------------------------------------------ drawing


class Draw:
    """Helpers over hypothesis' ``data``: sizes, layouts and values, all made in float64 on the CPU."""

    def __init__(self, data: Any, dtype: torch.dtype) -> None:
        self.data, self.dtype = data, dtype
        self.gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
        self.regime = data.draw(st.sampled_from(REGIMES), label="values")
        self.layout = data.draw(st.sampled_from(LAYOUTS), label="layout")

    def pick(self, options: list[Any], label: str) -> Any:
        return self.data.draw(st.sampled_from(options), label=label)

    def rows_cols(self) -> tuple[int, int]:
        m, n = self.pick(ROWS, "rows"), self.pick([*COLS, LONG], "cols")
        return (min(m, 3), n) if n == LONG else (m, n)  # interpreted long rows are slow: few of them

    def randn(self, *shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        return torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale + shift

    def main(self, *shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        """The op's main input: the drawn layout and value regime."""
        scale *= {"normal": 1.0, "special": 1.0, "tiny": 1e-4 if self.dtype == torch.float16 else 1e-6,
                  "large": 1e3 if self.dtype == torch.float16 else 1e5}[self.regime]
        if self.layout == "transposed" and len(shape) >= 2:
            t = self.randn(*shape[:-2], shape[-1], shape[-2], scale=scale, shift=shift).transpose(-1, -2)
        elif self.layout == "sliced":
            t = self.randn(*shape[:-1], shape[-1] + 3, scale=scale, shift=shift)[..., : shape[-1]]
        elif self.layout == "expanded" and len(shape) >= 2:
            t = self.randn(*shape[:-2], 1, shape[-1], scale=scale, shift=shift).expand(shape)
        else:
            t = self.randn(*shape, scale=scale, shift=shift)
        if self.regime == "special" and t.numel():
            base = t._base if t._base is not None else t
            flat = base.view(-1)
            for _ in range(self.data.draw(st.integers(1, 3), label="specials")):
                flat[int(torch.randint(flat.numel(), (1,), generator=self.gen))] = self.pick(
                    [math.nan, math.inf, -math.inf], "special")
        return t

    def targets(self, t: int, v: int, ignore_index: int = -100) -> Tensor:
        ignored = self.pick([0.0, 0.3, 1.0], "ignored")
        target = torch.randint(0, v, (t,), generator=self.gen)
        return torch.where(torch.rand(t, generator=self.gen) < ignored, ignore_index, target)


# One maker per op: (float64 inputs, other arguments, inputs that get a gradient, PyTorch's same-dtype baseline or
# None for hkernels.references').
Made = tuple[dict[str, Tensor], dict[str, Any], tuple[str, ...], Callable[..., Any] | None]


def _norm(op: str) -> Callable[[Draw], Made]:
    def make(d: Draw) -> Made:
        m, n = d.rows_cols()
        x = d.main(m, n, scale=2.0 if op == "layer_norm" else 1.0, shift=3.0 if op == "layer_norm" else 0.0)
        params = {p: d.randn(n, scale=0.5, shift=1.0 if p == "weight" else 0.0)
                  for p in (("weight", "bias") if op == "layer_norm" else ("weight",)) if d.pick([True, False], p)}
        return {"x": x, **params}, {"eps": 1e-5 if op == "layer_norm" else 1e-6}, ("x", *params), None
    return make


def _torch_softmax(x: Tensor, dim: int) -> Tensor:
    """PyTorch's native softmax in the input dtype: its backward, like hkernels', starts from the rounded output
    (hkernels.references' autograd keeps float32 probabilities, more than any kernel that saves y has; a column
    slice at 5 × 17 bf16 was 6% past twice its error)."""
    return torch.softmax(x, dim)


def _softmax(d: Draw) -> Made:
    m, n = d.rows_cols()
    return {"x": d.main(m, n, scale=3.0)}, {"dim": -1}, ("x",), _torch_softmax


def _add_rms_norm(d: Draw) -> Made:
    m, n = d.rows_cols()
    tensors = {"x": d.main(m, n), "residual": d.randn(m, n, scale=2.0)}
    if d.pick([True, False], "weight"):
        tensors["weight"] = d.randn(n, scale=0.5, shift=1.0)
    return tensors, {"eps": 1e-6}, tuple(tensors), None


def _gated(op: str) -> Callable[[Draw], Made]:
    def make(d: Draw) -> Made:
        m, n = d.rows_cols()
        kwargs = {"approximate": d.pick(["tanh", "none"], "approximate")} if op == "geglu" else {}
        return {"gate": d.main(m, n, scale=2.0), "up": d.randn(m, n)}, kwargs, ("gate", "up"), None
    return make


def _rope(d: Draw) -> Made:
    b, hk, group = d.pick([1, 2], "batch"), d.pick([1, 2], "kv heads"), d.pick([1, 2, 3], "group")
    s, dim = d.pick([0, 1, 2, 5, 17, 64], "seq"), d.pick([2, 8, 64, 128], "head dim")
    if d.pick([True, False], "bshd"):  # a view of a [B, S, H, D] projection
        q = d.main(b, s, hk * group, dim).transpose(1, 2)
    else:
        q = d.main(b, hk * group, s, dim)
    angles = d.randn(s, dim, scale=3.0)
    tensors = {"q": q, "k": d.randn(b, hk, s, dim), "cos": torch.cos(angles), "sin": torch.sin(angles)}
    return tensors, {}, ("q", "k"), None


def _qk_norm_rope(d: Draw) -> Made:
    b, hk, group = d.pick([1, 2], "batch"), d.pick([1, 2], "kv heads"), d.pick([1, 2, 3], "group")
    s, dim = d.pick([0, 1, 2, 5, 17, 64], "seq"), max(4, d.pick([4, 8, 64, 128], "head dim"))  # (D >= 4)
    if d.pick([True, False], "bshd"):  # a view of a [B, S, H, D] projection, normalised per head
        q = d.main(b, s, hk * group, dim).transpose(1, 2)
    else:
        q = d.main(b, hk * group, s, dim)
    angles = d.randn(s, dim, scale=3.0)
    tensors = {"q": q, "k": d.randn(b, hk, s, dim, scale=3.0), "q_weight": d.randn(dim, scale=0.3, shift=1.0),
               "k_weight": d.randn(dim, scale=0.3, shift=1.0), "cos": torch.cos(angles), "sin": torch.sin(angles)}
    return tensors, {"eps": d.pick([1e-6, 1e-2], "eps")}, ("q", "k", "q_weight", "k_weight"), None


def _cross_entropy(d: Draw) -> Made:
    t, v = d.rows_cols()
    kwargs = {"reduction": d.pick(["mean", "sum", "none"], "reduction"),
              "label_smoothing": d.pick([0.0, 0.1], "label_smoothing")}
    return {"logits": d.main(t, v, scale=3.0)}, {"target": d.targets(t, v), **kwargs}, ("logits",), None


def _fused_linear_cross_entropy(d: Draw) -> Made:
    t, h, v = d.pick(ROWS, "tokens"), d.pick([1, 8, 16, 48], "hidden"), d.pick([1, 2, 37, 300, 1031], "vocab")
    tensors = {"hidden": d.main(t, h), "weight": d.randn(v, h, scale=h**-0.5)}
    if d.pick([True, False], "bias"):
        tensors["bias"] = d.randn(v, scale=0.5)
    kwargs = {"reduction": d.pick(["mean", "sum", "none"], "reduction"),
              "label_smoothing": d.pick([0.0, 0.1], "label_smoothing")}
    return tensors, {"target": d.targets(t, v), **kwargs}, tuple(tensors), _torch_chunked_linear_ce


def _matmul(d: Draw) -> Made:
    m, k, n = d.pick(ROWS[1:], "m"), d.pick([1, 16, 17, 64, 100], "k"), d.pick([1, 16, 33, 48, 100], "n")
    tensors = {"a": d.main(m, k), "b": d.randn(k, n, scale=k**-0.5)}
    if d.pick([True, False], "bias"):
        tensors["bias"] = d.randn(n, scale=0.5)
    kwargs = {"activation": d.pick([None, "relu", "gelu", "gelu_tanh", "silu"], "activation")}
    return tensors, kwargs, tuple(tensors), _torch_matmul


def _attention(d: Draw) -> Made:
    b, hk, group = d.pick([1, 2], "batch"), d.pick([1, 2], "kv heads"), d.pick([1, 2], "group")
    s, skv, dim = d.pick([1, 2, 7, 33], "seq"), d.pick([1, 2, 7, 33, 65], "kv seq"), d.pick([16, 32, 64, 128], "dim")
    causal = d.pick([False, True], "causal")
    if causal:
        skv = s  # causal attention here is self-attention (a query sees keys up to its own position)
    tensors = {"q": d.main(b, hk * group, s, dim), "k": d.randn(b, hk, skv, dim), "v": d.randn(b, hk, skv, dim)}
    scale = d.pick([None, 0.3, 0.0, -0.5], "scale")
    kwargs = {"causal": causal, "scale": scale, "softcap": d.pick([None, 4.0], "softcap")}
    if s == skv:
        kwargs["window"] = d.pick([None, (3, None), (0, 5), (2, 0)], "window")
    return tensors, kwargs, ("q", "k", "v"), _torch_attention


def _attention_varlen(d: Draw) -> Made:
    # first options: 3 sequences, one of each length kind (the fixed cells)
    hk, group, dim = d.pick([2, 1], "kv heads"), d.pick([2, 1, 3], "group"), d.pick([64, 16, 128], "dim")
    lens_q = [d.pick([5, 0, 1, 33], f"q length {i}") for i in range(d.pick([3, 1, 5], "sequences"))]
    cross = d.pick([False, True], "cross")
    lens_k = [d.pick([7, 0, 1, 40], f"k length {i}") for i in range(len(lens_q))] if cross else lens_q
    tail = d.pick([0, 3], "rows past the sequences")
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    tq, tk = sum(lens_q) + tail, sum(lens_k) + tail
    tensors = {"q": d.main(tq, hk * group, dim), "k": d.randn(tk, hk, dim), "v": d.randn(tk, hk, dim)}
    kwargs: dict[str, Any] = {"cu_seqlens_q": cu(lens_q), "causal": d.pick([True, False], "causal"),
                              "scale": d.pick([None, 0.3, -0.5], "scale"), "softcap": d.pick([None, 4.0], "softcap"),
                              "window": d.pick([None, (3, None), (2, 0)], "window")}
    if cross:
        kwargs["cu_seqlens_k"] = cu(lens_k)
    if d.pick([True, False], "max given"):
        kwargs["max_seqlen_q"], kwargs["max_seqlen_k"] = max(lens_q), max(lens_k)
    return tensors, kwargs, ("q", "k", "v"), _torch_attention_varlen


def _grouped_matmul(d: Draw) -> Made:
    # 7 tokens first: the bad-input matrix's fixed cells take each first option and need a kernel to run
    t, k, n = d.pick([7, *ROWS], "tokens"), d.pick([1, 16, 17, 64], "k"), d.pick([1, 16, 33, 48], "n")
    experts = d.pick([1, 2, 5], "experts")
    tensors = {"x": d.main(t, k), "weight": d.randn(experts, n, k, scale=k**-0.5)}
    cuts = torch.sort(torch.randint(0, t + 1, (experts - 1,), generator=d.gen)).values.tolist()
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, t], strict=True)]
    if d.pick([False, True], "short sum") and t:
        sizes[-1] -= 1  # the last row belongs to no group: zeros
    return tensors, {"group_sizes": torch.tensor(sizes)}, ("x", "weight"), _torch_grouped_matmul


def _moe(d: Draw) -> Made:
    # 7 tokens first (see _grouped_matmul)
    t, h, i = d.pick([7, *ROWS], "tokens"), d.pick([16, 17, 64], "hidden"), d.pick([8, 16, 33], "intermediate")
    experts, k = d.pick([1, 3, 8], "experts"), d.pick([1, 2, 4], "k")
    tensors = {"x": d.main(t, h), "gate_up_proj": d.randn(experts, 2 * i, h, scale=h**-0.5),
               "down_proj": d.randn(experts, h, i, scale=i**-0.5),
               "topk_weights": torch.rand((t, k), generator=d.gen, dtype=torch.float64)}
    ids = torch.randint(0, experts, (t, k), generator=d.gen)
    if d.pick([False, True], "id out of range") and t:
        ids[0, 0] = experts  # selects nothing
    return tensors, {"topk_ids": ids}, ("x", "gate_up_proj", "down_proj", "topk_weights"), _torch_moe


def _decode_attention(d: Draw) -> Made:
    # first options: 3 sequences of 2 kv heads × 4 query heads, one new token, lengths drawn (the fixed cells)
    b, hk, group = d.pick([3, 1, 2], "batch"), d.pick([2, 1], "kv heads"), d.pick([4, 1, 3], "group")
    sq, s_max = d.pick([1, 2, 4, 16], "seq"), d.pick([37, 1, 7, 130], "kv seq")
    dim = d.pick([64, 16, 128, 256], "dim")
    q = d.main(b, hk * group, sq, dim)
    if d.pick([False, True], "bshd"):  # caches as views of [B, S_max, Hk, D]
        k, v = (d.randn(b, s_max, hk, dim).transpose(1, 2) for _ in range(2))
    else:
        k, v = d.randn(b, hk, s_max, dim), d.randn(b, hk, s_max, dim)
    lengths = torch.randint(0, s_max + 1, (b,), generator=d.gen)
    if d.pick([False, True], "empty sequence"):
        lengths[0] = 0
    for i, n in enumerate(lengths.tolist()):  # rows past a length are never read: NaN there must not show
        k[i, :, n:] = math.nan
        v[i, :, n:] = math.nan
    kwargs = {"cache_seqlens": lengths.to(d.pick([torch.int32, torch.int64], "lengths dtype")),
              "scale": d.pick([None, 0.3, -0.5], "scale"), "window": d.pick([None, (3, None), (0, 0)], "window"),
              "softcap": d.pick([None, 5.0], "softcap")}
    return {"q": q, "k_cache": k, "v_cache": v}, kwargs, (), None


MAKERS: dict[str, Callable[[Draw], Made]] = {
    "rms_norm": _norm("rms_norm"),
    "layer_norm": _norm("layer_norm"),
    "softmax": _softmax,
    "add_rms_norm": _add_rms_norm,
    "swiglu": _gated("swiglu"),
    "geglu": _gated("geglu"),
    "rope": _rope,
    "qk_norm_rope": _qk_norm_rope,
    "cross_entropy": _cross_entropy,
    "fused_linear_cross_entropy": _fused_linear_cross_entropy,
    "matmul": _matmul,
    "grouped_matmul": _grouped_matmul,
    "moe": _moe,
    "attention": _attention,
    "attention_varlen": _attention_varlen,
    "decode_attention": _decode_attention,
}


def test_every_op_is_fuzzed():
    assert sorted(MAKERS) == hkernels.ops()


# ---------------------------------------------------------------------------------------------- checking


def _kind(t: Tensor) -> Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    t = t.double()
    return torch.isnan(t) * 1 + (t == math.inf) * 2 + (t == -math.inf) * 3


def check(name: str, out: Tensor, ref: Tensor, base: Tensor, dtype: torch.dtype, terms: float = 0.0,
          exact_kinds: bool = True) -> str | None:
    """None when ``out`` is non-finite exactly where PyTorch's ``base`` or the float64 ``ref`` is (of the same
    kind, NaN / +inf / -inf, when ``exact_kinds``) and within tolerance of ``ref`` where all are finite; else a
    report."""
    if out.shape != base.shape:
        return f"{name}: shape {list(out.shape)}, PyTorch's {list(base.shape)}"
    if out.dtype != base.dtype:
        return f"{name}: dtype {out.dtype}, PyTorch's {base.dtype}"
    if out.numel() == 0:
        return None
    # PyTorch's same-dtype computation and the float64 math can disagree on finiteness (seen: SDPA on a CPU gives 0
    # where a query holds NaN; the float64 formula gives NaN): either is accepted there.
    got, want, math_kind = _kind(out), _kind(base), _kind(ref)
    if exact_kinds:
        bad = (got != want) & (got != math_kind)
    else:
        bad = ((got == 0) != (want == 0)) & ((got == 0) != (math_kind == 0))
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        where = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), out.shape))
        return (f"{name}: {int(bad.sum())} element(s) where finiteness differs from PyTorch's, first at {where}: "
                f"got {out.flatten()[i].item()}, PyTorch {base.flatten()[i].item()}")
    finite = (got == 0) & (math_kind == 0)  # accuracy wherever ours and the float64 math are finite
    if not finite.any():
        return None
    factor, atol = TOLERANCES[dtype]
    err = (out.double() - ref).abs()[finite]
    both = finite & (want == 0)
    base_err = (base.double() - ref).abs()[both].max().item() if both.any() else 0.0
    scale = max(1.0, ref.abs()[finite].max().item())
    allowed = factor * base_err + atol * scale + TOLERANCES[torch.float32][1] * terms
    limit = ulps(dtype, ref[finite]).clamp_min(allowed)  # never less than one ulp of the element's own size
    i = int((err - limit).argmax())
    if err[i] <= limit[i]:
        return None
    return (f"{name}: error {err[i].item():.3g} where PyTorch's result is finite; allowed {limit[i].item():.3g} = "
            f"{factor} x PyTorch's error {base_err:.3g} + {atol} x {scale:.3g} + float32 floor x terms {terms:.3g}, "
            "at least one ulp of that element")


def _with_grads(fn: Callable[..., Any], inputs: dict[str, Tensor], kwargs: dict[str, Any], grads: tuple[str, ...],
                ups: list[Tensor] | None, gen: torch.Generator,
                unwritten: str | None = None) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...], list]:
    """``fn`` on fresh leaves of ``inputs``, then every gradient. With ``unwritten`` (the call's name), also check
    that no tensor the call received, leaves and tensor arguments, holds anything else afterwards."""
    leaves = _leaves(inputs, grads)
    received = {**leaves, **{k: v for k, v in kwargs.items() if isinstance(v, Tensor)}}
    before = {k: v.detach().clone() for k, v in received.items()} if unwritten else {}
    outs = _outputs(fn(**leaves, **kwargs))
    if ups is None:  # rounded to each output's dtype: the reference and PyTorch get the values the call gets
        ups = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype).double() for o in outs]
    wanted = [o for o in outs if o.requires_grad]
    if not wanted:
        filled = tuple(torch.zeros_like(leaves[n]) for n in grads)
    else:
        used = [u.to(device=o.device, dtype=o.dtype) for o, u in zip(outs, ups, strict=True) if o.requires_grad]
        got = torch.autograd.grad(wanted, [leaves[n] for n in grads], used, allow_unused=True)
        filled = tuple(g if g is not None else torch.zeros_like(leaves[n]) for g, n in zip(got, grads, strict=True))
    changed = [k for k, v in before.items() if not _same(received[k].detach(), v)]
    assert not changed, f"{unwritten} wrote into its inputs {changed}"
    return outs, filled, ups


class Fixed(Draw):
    """A Draw whose choices are given (by label; the first option otherwise): the fixed cells of the bad-input
    matrix (tests/test_bad_inputs.py) run through the same maker and check as the fuzzing."""

    def __init__(self, dtype: torch.dtype, seed: int = 0, **choices: Any) -> None:
        self.dtype, self.choices = dtype, choices
        self.gen = torch.Generator().manual_seed(seed)
        self.regime, self.layout = choices.get("values", "normal"), choices.get("layout", "contiguous")

    def pick(self, options: list[Any], label: str) -> Any:
        return self.choices.get(label, options[0])

    def rows_cols(self) -> tuple[int, int]:
        return self.choices.get("rows", 5), self.choices.get("cols", 17)

    def main(self, *shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        if self.regime != "special":
            return super().main(*shape, scale=scale, shift=shift)
        self.regime = "normal"  # normal values, then one NaN at the first element: its row NaN, the others untouched
        t = super().main(*shape, scale=scale, shift=shift)
        self.regime = "special"
        if t.numel():
            (t._base if t._base is not None else t).view(-1)[0] = math.nan
        return t


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal element for element, NaN where the other is NaN."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0))


def run_case(op: str, backend: str, d: Draw, device: torch.device) -> None:
    """``op`` on ``backend`` with inputs from ``d``, against float64 and PyTorch's same-dtype computation."""
    dtype = d.dtype
    tensors64, kwargs, grads, base_fn = MAKERS[op](d)
    kwargs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    inputs = cast_case(tensors64, dtype, device)
    fn = getattr(hkernels, op)
    with hkernels.use_backend(backend):
        outs, dgrads, ups = _with_grads(fn, inputs, kwargs, grads, None, d.gen, unwritten=f"{op} on {backend}")
    ins64 = {k: v.detach().double() for k, v in inputs.items()}
    refs, ref_grads, _ = _with_grads(getattr(references, op), ins64, kwargs, grads, ups, d.gen)
    bases, base_grads, _ = _with_grads(base_fn or getattr(references, op), inputs, kwargs, grads, ups, d.gen)
    problems = [check(f"out{i}", o.detach(), r.detach(), b.detach(), dtype)
                for i, (o, r, b) in enumerate(zip(outs, refs, bases, strict=True))]
    finite_in = [t[torch.isfinite(t)] for t in inputs.values() if t.is_floating_point()]
    terms = max((u.abs().max().item() for u in ups if u.numel()), default=0.0) * max(
        [1.0, *(t.double().abs().max().item() for t in finite_in if t.numel())])
    # A gradient's NaN and inf are not told apart: PyTorch's autograd of the reference formula and a fused backward
    # may reach a non-finite value by different roads (inf - inf, 0 * inf); where it is finite it must agree.
    # Attention's gradients with a non-finite score are not compared: which keys and heads turn NaN then depends on
    # the algorithm (masked scores as -inf, blocks skipped), and PyTorch's own SDPA and its composite formula
    # disagree with each other there (a documented exception, README "Test").
    if not (op in ("attention", "attention_varlen") and d.regime == "special"):
        problems += [check(f"d{n}", g, r, b, dtype, terms, exact_kinds=False)
                     for n, g, r, b in zip(grads, dgrads, ref_grads, base_grads, strict=True)]
    problems = [p for p in problems if p]
    assert not problems, f"{op} on {backend}, {dtype}, {d.layout} layout, {d.regime} values:\n" + "\n".join(problems)


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("op", sorted(MAKERS))
@FUZZ
@given(data=st.data())
def test_fuzz_against_float64(op, backend, data, device):
    run_case(op, backend, Draw(data, data.draw(st.sampled_from(DTYPES), label="dtype")), device)


def test_an_op_that_writes_into_its_input_fails_the_fuzz_check(monkeypatch, device):
    """The no-input-written check sees the tensors the op receives (the fuzz hands it fresh leaves)."""
    real = hkernels.softmax

    def writes(x, dim=-1):
        y = real(x, dim)
        x.detach().add_(1)
        return y

    monkeypatch.setattr(hkernels, "softmax", writes)
    with pytest.raises(AssertionError, match=r"softmax on triton wrote into its inputs \['x'\]"):
        run_case("softmax", "triton", Fixed(torch.float32), device)


def test_fuzz_report_records_every_example_and_replays_one(tmp_path, device):
    """tests/fuzz_report.py (the tool for GPU runs): a JSON line per example with its choices, replayable."""
    import json

    from tests import fuzz_report

    out = tmp_path / "softmax.jsonl"
    counts = fuzz_report.record("softmax", "triton", 2, str(out), device)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert counts == {"examples": 2, "failed": 0} and [r["i"] for r in rows] == [1, 2]
    assert rows[1]["choices"][0][0] == "dtype"
    fuzz_report.replay("softmax", "triton", rows[1]["choices"], device)
    with pytest.raises(ValueError, match="another version"):
        fuzz_report.replay("softmax", "triton", [*rows[1]["choices"][:1], ["nonsense", 0]], device)
    # a seed draws other inputs than the derandomized ones, the same ones on every run
    seeded = [tmp_path / f"seeded{i}.jsonl" for i in range(2)]
    for path in seeded:
        fuzz_report.record("softmax", "triton", 3, str(path), device, seed=8)
    choices = [[json.loads(line)["choices"] for line in p.read_text().splitlines()] for p in (out, *seeded)]
    assert choices[1] == choices[2] and choices[1][1] != choices[0][1]
