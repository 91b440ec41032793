"""The shared suite for the LLM op set: every case × backend × dtype, forward and every gradient, vs float64."""

from __future__ import annotations

import zlib

import pytest
import torch

import hkernels
from hkernels import references
from hkernels.runtime import chunked as _chunked
from tests.specs import BACKENDS, CASES_LLM, DTYPES, cast_case, max_error

Tensor = torch.Tensor


def _leaves(tensors: dict[str, Tensor], grads: tuple[str, ...]) -> dict[str, Tensor]:
    """Fresh inputs; those in ``grads`` require grad, views staying views of a leaf (so strides are kept)."""
    out = {}
    for name, t in tensors.items():
        if name not in grads:
            out[name] = t.detach().clone()
            continue
        base = t._base if t._base is not None else t
        leaf = base.detach().clone().requires_grad_()
        out[name] = leaf.as_strided(t.shape, t.stride(), t.storage_offset()) if base is not t else leaf
    return out


def _outputs(out: Tensor | tuple[Tensor | None, ...]) -> tuple[Tensor, ...]:
    """An op's outputs as a tuple; a loss's CrossEntropyOutput without the fields not asked for (None)."""
    return tuple(o for o in out if o is not None) if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES_LLM, ids=lambda c: c.id)
def test_llm_op_forward_and_gradients(case, backend, dtype, device, monkeypatch):
    if case.kernels is not None and backend not in (*case.kernels, "torch"):
        pytest.skip(f"{backend} refuses this case (a clear error, tested apart)")
    if case.min_chunk is not None:
        monkeypatch.setattr(_chunked, "MIN_CHUNK", case.min_chunk)
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.id}{dtype}".encode()))
    tensors64, kwargs = case.make(g)
    kwargs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    inputs = cast_case(tensors64, dtype, device)
    fn = getattr(hkernels, case.op)

    ins = _leaves(inputs, case.grads)
    with hkernels.use_backend(backend):
        assert hkernels.selected_backend(case.op, **ins, **kwargs) == backend
        outs = _outputs(fn(**ins, **kwargs))
    ups = []
    for o in outs:
        if o.dim() == 0 and case.unit_upstream:
            ups.append(torch.ones_like(o))
        else:
            ups.append(torch.randn(o.shape, generator=g, dtype=torch.float64).to(device=device, dtype=o.dtype))
    # (outside the scope: the backward follows the forward; a forward-only op names no gradients). Outputs without
    # a gradient of their own (a loss's z term, returned for logging) take no upstream gradient.
    diff = [i for i, o in enumerate(outs) if o.requires_grad]
    pick = lambda ts: [ts[i] for i in diff]
    grads = torch.autograd.grad(pick(outs), [ins[n] for n in case.grads], pick(ups)) if case.grads else ()

    ins64 = {k: v.detach().double().requires_grad_(k in case.grads) for k, v in inputs.items()}
    refs = _outputs(getattr(references, case.op)(**ins64, **kwargs))
    ref_grads = (torch.autograd.grad(pick(refs), [ins64[n] for n in case.grads], [u.double() for u in pick(ups)])
                 if case.grads else ())

    base_ins = _leaves(inputs, case.grads)
    bases = _outputs((case.base or getattr(references, case.op))(**base_ins, **kwargs))
    base_grads = torch.autograd.grad(pick(bases), [base_ins[n] for n in case.grads], pick(ups)) if case.grads else ()

    problems = []
    for i, (o, r, b) in enumerate(zip(outs, refs, bases, strict=True)):
        assert o.dtype == b.dtype and o.shape == b.shape, f"output {i}: {o.dtype} {list(o.shape)}"
        problems.append(max_error(f"out{i}", o.detach(), r.detach(), b.detach(), dtype))
    terms = max(u.abs().max().item() for u in ups if u.numel()) * max(
        1.0, *(torch.nan_to_num(t.double().abs(), nan=0.0).max().item() for t in inputs.values() if t.numel())
    )
    for name, got, want, base in zip(case.grads, grads, ref_grads, base_grads, strict=True):
        assert got.dtype == inputs[name].dtype and got.shape == inputs[name].shape, name
        problems.append(max_error(f"d{name}", got, want, base, dtype, terms))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_frozen_experts_skip_the_weight_gradients(backend, device, monkeypatch):
    """With the experts' weights frozen (LoRA, router-only training) the backward computes dx and the routing
    weights' gradient only: no weight-gradient kernel runs, and the two gradients are the same as with every
    gradient wanted. float64 routing weights with float32 x run on the kernels (read as float32), their gradient
    float64."""
    import triton_fallback.moe as triton_moe
    from hkernels.ops import _helion

    g = torch.Generator().manual_seed(5)
    x = torch.randn(13, 32, generator=g).to(device)
    gu, dn = (torch.randn(s, generator=g).to(device) * 0.2 for s in ((3, 32, 32), (3, 32, 16)))
    ids = torch.randint(0, 3, (13, 2), generator=g).to(device)
    tw = torch.rand(13, 2, generator=g, dtype=torch.float64).to(device)
    up = torch.randn(13, 32, generator=g).to(device)

    def grads(*params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = [t.clone().requires_grad_() for t in (x, tw)]
        with hkernels.use_backend(backend):
            out = hkernels.moe(leaves[0], *params, ids, leaves[1])
        return torch.autograd.grad(out, leaves, up)

    want = grads(gu.clone().requires_grad_(), dn.clone().requires_grad_())
    calls = []
    real, run = triton_moe.dweight_into, _helion.run
    monkeypatch.setattr(triton_moe, "dweight_into", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(_helion, "run",
                        lambda k, *a, **kw: (k.name == "_moe_dweight" and calls.append(1)) or run(k, *a, **kw))
    got = grads(gu, dn)
    assert got[1].dtype == torch.float64 and not calls
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("sizes, rows, block", [
    ([5, 0, 17, 3], 30, 4),  # an empty group, a tail of 5 rows past the groups
    ([0, 0], 7, 4),  # no routed row: every row in the tail
    ([8, 8], 16, 8),  # whole tiles only
    ([1], 1, 16),  # one row
    ([100, 3], 50, 16),  # sizes past the rows: clamped, the second group empty
    ([16] * 9 + [1], 145, 16),  # every group ending one row into a tile: the bound's most tiles
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, list) else str(v))
def test_tile_map_cuts_every_group_into_tiles_inside_it(sizes, rows, block, device):
    """The grouped kernels' row tiles (routing.tile_map): every row of every group, the tail included, in exactly
    one tile; a tile at most ``block`` rows, all of one group and starting where the group's tiles are due (its
    first row, then every ``block``); the group's tiles in order; the entries past them empty."""
    from hkernels.runtime.routing import group_ends, tile_map

    ends = group_ends(torch.tensor(sizes, device=device), rows)
    group, first, end = (t.cpu() for t in tile_map(ends, block, rows))
    ends = ends.cpu()
    assert group.dtype == first.dtype == end.dtype == torch.int32
    assert group.shape == first.shape == end.shape == (rows // block + len(ends),)
    covered = torch.zeros(rows, dtype=torch.int64)
    tiles = []
    for g, a, b in zip(group.tolist(), first.tolist(), end.tolist(), strict=True):
        if a == b:
            continue
        start = ends[g - 1].item() if g else 0
        assert start <= a < b <= ends[g].item() and b - a <= block and (a - start) % block == 0, (g, a, b)
        assert b - a == block or b == ends[g].item(), (g, a, b)
        covered[a:b] += 1
        tiles.append((g, a))
    assert tiles == sorted(tiles) and tiles == [(g, a) for g, a, b in zip(group.tolist(), first.tolist(),
                                                                           end.tolist(), strict=True) if a < b]
    assert (covered == 1).all(), covered
    assert (first[len(tiles):] == 0).all() and (end[len(tiles):] == 0).all()


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 8), (5, 2), (64, 8), (128, 8)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_moe_routing_kernels_match_the_torch_routing(backend, shape, device):
    """The one-launch routing of the decode sizes (a counting sort) gives exactly the torch routing: the stable
    order, each slot's row, the group ends and the bounds or tile schedule, with repeated experts in a row, experts
    with no slot and ids outside [0, E) (sorted past the last group). 128 × 8 slots fill several tiles of slots."""
    from hkernels.runtime.routing import ROUTE_MAX, bounds, routing, tile_ends

    T, k = shape
    E = 6
    assert T * k <= ROUTE_MAX
    g = torch.Generator().manual_seed(T * 31 + k)
    ids = torch.randint(-2, E + 2, (T, k), generator=g).to(device)
    if T * k > 4:
        ids[0, :] = 3  # a row repeating one expert
    want = routing(ids, E)
    if backend == "triton":
        import triton_fallback.moe as triton_moe

        *got, tiles = triton_moe.route(ids, E, 16)
        want_more = (tile_ends(want[3], 16),)
        got_more = (tiles,)
    else:
        from hkernels.ops import moe as helion_moe

        *got, starts, group_ends, tails = helion_moe._route(ids, E)
        want_more = bounds(want[3])
        got_more = (starts, group_ends, tails)
    names = ("src", "order", "pos", "ends", *(f"schedule[{i}]" for i in range(len(want_more))))
    for name, a, b in zip(names, (*got, *got_more), (*want, *want_more), strict=True):
        assert a.dtype == torch.int32, name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
