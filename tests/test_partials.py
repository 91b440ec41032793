"""The norms' last backward step, ``sum_partials``, on its own: the op tests reach it with few partial rows on a
CPU (interpret mode runs 4 programs), so rows spanning several blocks and ragged edges are checked here."""

from __future__ import annotations

import pytest
import torch

from hkernels.ops import _partials as helion_partials
from triton_fallback import _partials as triton_partials

BACKENDS = {"triton": triton_partials, "helion": helion_partials}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("p", "n"), [(1, 1), (1, 300), (16, 64), (37, 101), (264, 130)])
def test_sum_partials_against_float64(backend, dtype, p, n, device):
    mod = BACKENDS[backend]
    g = torch.Generator(device=device).manual_seed(p * 1000 + n)
    part = torch.randn(p, n, device=device, generator=g) * 10
    param = torch.empty(n, device=device, dtype=dtype)
    got = mod.sum_partials(part, param)
    assert got.dtype == dtype and got.shape == (n,)
    want = part.double().sum(0)
    # float32 sums of p terms, then one rounding to dtype
    tol = torch.finfo(dtype).eps * want.abs() + p * torch.finfo(torch.float32).eps * part.double().abs().sum(0)
    err = (got.double() - want).abs()
    worst = int((err - tol).argmax())
    assert bool((err <= tol).all()), f"{backend} P={p} N={n}: column {worst}: {got[worst]} vs {want[worst]}"
    assert torch.equal(mod.sum_partials(part, param), got)  # run to run: bitwise


def test_sum_partials_of_a_strided_partial(device):
    """A partial whose rows are further apart than N (a slice of a wider buffer) sums the right elements."""
    part = torch.randn(40, 96, device=device)[:, :70]
    param = torch.empty(70, device=device, dtype=torch.float32)
    for mod in BACKENDS.values():
        torch.testing.assert_close(mod.sum_partials(part, param), part.sum(0), rtol=1e-5, atol=1e-5)
