"""Helion's generated code on disk (hkernels/ops/_helion.py): a later process loads it instead of binding the kernel
and generating the code again; what it loads computes what the binding would."""

from __future__ import annotations

import torch

import hkernels
from hkernels import dispatch, references


def _forget_in_memory() -> None:
    """What a new process would not have: compiled functions, plans and routes, and Helion's own bindings."""
    import sys

    import helion

    from hkernels.ops import _helion

    _helion._compiled.clear()
    _helion._replays.clear()
    dispatch.forget()
    for name, module in list(sys.modules.items()):
        if name.startswith("hkernels.ops.") and module is not None:
            for value in vars(module).values():
                if isinstance(value, helion.Kernel):
                    value._bound_kernels.clear()


def test_a_second_process_loads_the_code_instead_of_binding(tmp_path, monkeypatch, device):
    import helion

    monkeypatch.setenv("HKERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("HKERNELS_CODE_CACHE", raising=False)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=g).to(device).requires_grad_()
    w = torch.randn(96, generator=g).to(device).requires_grad_()
    dy = torch.randn(5, 96, generator=g).to(device)

    def run() -> tuple[torch.Tensor, ...]:
        with hkernels.use_backend("helion"):
            y = hkernels.rms_norm(x, w)
        return (y.detach(), *torch.autograd.grad(y, (x, w), dy))

    _forget_in_memory()
    first = run()
    files = sorted((tmp_path / "helion-code").glob("*/*.py"))
    assert len(files) >= 2, files  # the forward's and the backward's code
    assert all(f.read_text().startswith("# hkernels: Helion's generated code; host function ") for f in files)

    _forget_in_memory()
    bound: list[str] = []
    real_bind = helion.Kernel.bind

    def spy(self: helion.Kernel, *args: object, **kwargs: object) -> object:
        bound.append(self.name)
        return real_bind(self, *args, **kwargs)

    monkeypatch.setattr(helion.Kernel, "bind", spy)
    second = run()
    assert bound == [], f"bound again: {bound}"
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(second[0], references.rms_norm(x.detach(), w.detach()), atol=1e-5, rtol=1e-5)

    # a damaged file is generated again, and the call is right
    for f in files:
        f.write_text("# not hkernels' code\n")
    _forget_in_memory()
    third = run()
    assert bound and all(torch.equal(a, b) for a, b in zip(first, third, strict=True))

    # off: every process binds
    monkeypatch.setenv("HKERNELS_CODE_CACHE", "0")
    _forget_in_memory()
    bound.clear()
    run()
    assert bound


def test_the_key_follows_settings_config_and_signature(tmp_path, monkeypatch, device):
    """Two kernels of one name (an index-dtype twin), another config or another signature: other files."""
    from hkernels.ops import _helion
    from hkernels.ops import softmax as helion_softmax

    monkeypatch.setenv("HKERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("HKERNELS_CODE_CACHE", raising=False)
    kernel = helion_softmax._softmax_fwd
    twin = helion_softmax._WIDE[kernel.name]
    assert twin.name == kernel.name
    x = torch.randn(4, 300, device=device)
    config = _helion.config_for(kernel.name, 300, x.device, x.dtype)
    other = type(config)(**{**config.config, "num_warps": 2 if config.config.get("num_warps") != 2 else 4})
    keys = {_helion._code_key(kernel, config, (x,), x.device), _helion._code_key(twin, config, (x,), x.device),
            _helion._code_key(kernel, other, (x,), x.device),
            _helion._code_key(kernel, config, (torch.randn(4, 301, device=device),), x.device)}
    assert None not in keys and len(keys) == 4
    assert _helion._code_key(kernel, config, (x,), x.device) == _helion._code_key(kernel, config, (x.clone(),),
                                                                                    x.device)


def test_a_bound_helion_call_is_replayed_from_its_first_call(device):
    """After its first call a bound Helion function replays the launches it recorded (the host function does not
    run): the same results for new inputs of the signature, fresh outputs each call. Host code with a step a replay
    would skip (a filled allocation, a copy, a loop) is never replayed."""
    from hkernels.ops import _helion
    from hkernels.ops import rms_norm as helion_rms_norm

    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(3, 96, generator=g).to(device), torch.randn(96, generator=g).to(device)
    host = _helion.compiled(helion_rms_norm._rms_norm_fwd, (x, None, w, 1e-6, 0.0, None, None), 96, x.device)
    assert _helion.replayable(host)
    fn, launcher = _helion.bind(helion_rms_norm._rms_norm_fwd, (x, None, w, 1e-6, 0.0, None, None), 96, x.device)
    assert fn is not host
    launches: list[object] = []

    def counting(kernel, *args, **kwargs):
        launches.append(kernel)
        return launcher(kernel, *args, **kwargs)

    first = fn(x, None, w, 1e-6, 0.0, None, None, _launcher=counting)
    for _ in range(2):
        x2 = torch.randn(3, 96, generator=g).to(device)
        y = fn(x2, None, w, 1e-6, 0.0, None, None, _launcher=counting)
        assert torch.equal(y, host(x2, None, w, 1e-6, 0.0, None, None, _launcher=launcher))
        assert y.data_ptr() != first.data_ptr()
    assert len(launches) == 3 and len(set(map(id, launches))) == 1  # one launch per call, of the same kernel
    again, _ = _helion.bind(helion_rms_norm._rms_norm_fwd, (x, None, w, 1e-6, 0.0, None, None), 96, x.device)
    assert again is fn  # a caller that binds on every call gets the same replay, recorded once

    line = _helion._HOST_LINE.fullmatch
    assert line("    y = torch.empty([m, n], dtype=x.dtype, device=x.device)")
    assert line("    programs = (m + rows_per_program - 1) // rows_per_program")
    for step in ("    slots = torch.full([m, chunks], -1, dtype=torch.int64, device=x.device)",
                 "    acc = torch.zeros([m], dtype=torch.float32, device=x.device)", "    y.zero_()",
                 "    for i in range(m):", "    z = x.contiguous()", "    n = int(lengths.max())",
                 "    n = int(lengths)", "    m = f(x) + 1"):
        assert not line(step), step
