"""The lean Triton launch path (hkernels.runtime.launch): its key never merges what Triton specialises apart, and
kernels launched through it give the results of a plain launch across the specialisations it keys on."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from hkernels.runtime import launch as _launch
from tests.conftest import ON_GPU


def _triton_spec(a):
    """Triton's own specialisation of a runtime argument (type and key), as JITFunction's binder computes it."""
    return native_specialize_impl(BaseBackend, a, False, True, True)


def test_key_is_finer_than_triton_specialisation():
    base = torch.zeros(64, dtype=torch.float32)
    values = [
        0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1, 2**32, 2**63 - 1,
        2**63, True, False, 0.0, 1.0, 0.5, None,
        base, base[1:], base[4:], base[3:], base.bfloat16(), base.bfloat16()[8:], base.bfloat16()[1:],
        base.to(torch.int64), base.half(),
    ]
    pairs = 0
    for a, b in itertools.product(values, repeat=2):
        if type(a) is not type(b) and not (isinstance(a, int) and isinstance(b, int)):
            continue
        if _launch._spec(a) == _launch._spec(b):
            pairs += 1
            assert _triton_spec(a) == _triton_spec(b), (a, b, _launch._spec(a), _triton_spec(a), _triton_spec(b))
    assert pairs > len(values)  # the check compared more than each value with itself


def test_no_launch_hook_by_default_and_one_when_a_profiler_adds_it():
    """Triton keeps launch hooks in chains that are never None: an empty chain must leave the lean path on (a
    check for None would turn it off for every launch), a hook added must turn it off."""
    from triton import knobs

    assert not _launch._hooks()
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton has no hook chains")
    hook = lambda metadata: None
    chain.add(hook)
    try:
        assert _launch._hooks()
    finally:
        chain.remove(hook)
    assert not _launch._hooks()


def test_key_refuses_what_it_cannot_describe():
    class Descriptor:  # stands for a host tensor descriptor: unknown to the key, so the call takes plain Triton
        pass

    assert _launch._spec(Descriptor()) is _launch._SLOW
    assert _launch._spec(torch.float32) is _launch._SLOW


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr):
    # y[i] = a * x[i] + b for i < n: x and y may be unaligned views, n and b ints Triton specialises (1, % 16)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, x * a + b, mask=mask)


def test_launch_matches_plain_results_across_specialisations(device):
    """Alternating aligned and unaligned views, n = 1 / a multiple of 16 / other, ints b of each kind: every call
    through the lean path must equal the float64 reference (a kernel reused across a specialisation it was not
    compiled for would read misaligned vectors or bake in a constant)."""
    g = torch.Generator().manual_seed(0)
    base_x = torch.randn(4096 + 64, generator=g).to(device)
    base_y = torch.empty(4096 + 64, device=device)
    for _ in range(2):  # the second round hits the cache for every key of the first
        for off_x, off_y, n, b in itertools.product((0, 1, 4), (0, 3), (1, 16, 33, 4096), (1, 16, 7)):
            x, y = base_x[off_x:off_x + n], base_y[off_y:off_y + n]
            y.fill_(float("nan"))
            _launch.launch(_axpb_kernel, (triton.cdiv(n, 256),), x, y, n, 2.5, b, BLOCK=256)
            want = (x.double() * 2.5 + b).float()
            torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6,
                                       msg=lambda m, o=off_x, p=off_y, n=n, b=b: f"x+{o} y+{p} n={n} b={b}: {m}")


def test_launch_rejects_runtime_argument_by_keyword(device):
    """A runtime argument given by keyword is not described by the key: plain Triton serves the call, right."""
    x = torch.randn(100, device=device)
    y = torch.empty_like(x)
    _launch.launch(_axpb_kernel, (1,), x, y, 100, 1.0, b=3, BLOCK=128)
    torch.testing.assert_close(y, x + 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled-launcher cache exists on a GPU only")
def test_launch_caches_one_compiled_kernel_per_key(device):
    x = torch.randn(1000, device=device)
    y = torch.empty_like(x)
    _launch._COMPILED.clear()
    for _ in range(5):
        _launch.launch(_axpb_kernel, (4,), x, y, 1000, 1.0, 2, BLOCK=256)
    keys = [k for k in _launch._COMPILED if k[0] == id(_axpb_kernel)]
    assert len(keys) == 1
    _launch.launch(_axpb_kernel, (4,), x[1:], y[1:], 999, 1.0, 2, BLOCK=256)  # unaligned, n not % 16: a new key
    assert len([k for k in _launch._COMPILED if k[0] == id(_axpb_kernel)]) == 2


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * FACTOR, mask=mask)


@pytest.mark.skipif(not ON_GPU, reason="the lean path serves compiled kernels only (interpret mode runs plain Triton)")
def test_launch_keys_constexprs_by_type_and_value(device):
    """1 and 1.0 (and True) are one dict key but Triton compiles each (an int and a float constant): the lean path
    must not hand one's kernel to the other."""
    x = torch.randn(100, device=device)
    y = torch.empty_like(x)
    for factor in (1, 1.0, 1, 1.0):
        _launch.launch(_scale_kernel, (1,), x, y, 100, FACTOR=factor, BLOCK=128)
        torch.testing.assert_close(y, x)
    keys = [k for k in _launch._COMPILED if k[0] == id(_scale_kernel)]
    assert len(keys) == 2, keys
