"""The dispatcher's contract: env parsing, per-op overrides, scopes, threads, errors, fallback, introspection."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import warnings
from importlib import resources

import pytest
import torch

import hkernels
from hkernels import configs, dispatch, references, registry
from tests.specs import max_error


@pytest.fixture(autouse=True)
def _no_shipped_auto_table(monkeypatch):
    """These tests hold the dispatcher's rules, not one GPU's measurements: a shipped table (the sm90 one picks
    Triton for decode-size rows, where its host path is shorter) would decide what auto runs for their small
    inputs. Hidden here; a test's own user table still counts."""
    shipped = str(resources.files(configs.__name__).joinpath("auto"))
    real = configs._read
    monkeypatch.setattr(configs, "_read", lambda path: {} if str(path).startswith(shipped) else real(path))
    configs.reload()
    yield
    configs.reload()  # read again (lazily, once monkeypatch has put _read back)


def _x(device: torch.device, n: int = 16) -> torch.Tensor:
    return torch.randn(4, n, device=device)


def test_ops_lists_every_op():
    assert hkernels.ops() == [
        "add_rms_norm", "attention", "attention_varlen", "cross_entropy", "decode_attention",
        "fused_linear_cross_entropy", "geglu",
        "grouped_matmul", "layer_norm", "matmul", "moe", "qk_norm_rope", "rms_norm", "rope", "softmax", "swiglu",
    ]


def test_backends_here_lists_all_three(device):
    for op in hkernels.ops():
        assert hkernels.backends(op) == ["helion", "triton", "torch"]


def test_backends_without_gpu_or_interpret_is_torch_only(monkeypatch):
    monkeypatch.delenv("HKERNELS_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hkernels.backends("softmax") == ["torch"]


def test_a_plain_call_imports_no_compiler_and_no_kernel_backend():
    """``import hkernels`` and an eager call on the torch backend (CPU tensors, no interpret mode) import neither
    Helion, Triton nor torch._dynamo / torch._inductor: those come with the first call routed to a kernel or with
    torch.compile."""
    env = {k: v for k, v in os.environ.items() if k not in ("HKERNELS_INTERPRET", "TRITON_INTERPRET")}
    code = ("import sys, torch, hkernels\n"
            "x = torch.randn(4, 64, requires_grad=True)\n"
            "hkernels.rms_norm(x, torch.ones(64)).sum().backward()\n"
            "hkernels.cross_entropy(torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))\n"
            "print(sorted(m for m in ('helion', 'triton', 'torch._dynamo', 'torch._inductor') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_loading_a_helion_kernel_leaves_scikit_learn_for_the_autotuner():
    """The first call routed to Helion imports Helion without scikit-learn (which its surrogate autotuners import at
    module level, a second of a first call), and autotuning still finds it: Helion's model classes build the real
    scikit-learn models, and a later ``import sklearn`` is the real package."""
    import importlib.util

    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("scikit-learn is not installed here (Helion is then imported as it is)")
    code = ("import sys, hkernels\n"
            "from hkernels import registry\n"
            "assert not isinstance(registry.load('rms_norm', 'helion'), str)\n"
            "print('helion' in sys.modules, 'sklearn' in sys.modules)\n"
            "from helion.autotuner import de_surrogate_hybrid, surrogate_pattern_search as s\n"
            "model = s.RandomForestClassifier(n_estimators=2)\n"
            "print(s.HAS_ML_DEPS, de_surrogate_hybrid.HAS_ML_DEPS, type(model).__module__)\n"
            "import sklearn.ensemble\n"
            "print(type(model) is sklearn.ensemble.RandomForestClassifier)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "True", "True", "sklearn.ensemble._forest", "True"], done.stdout


def test_backends_rejects_unknown_op():
    with pytest.raises(ValueError, match=r"unknown op 'gelu'.*layer_norm, matmul, moe, qk_norm_rope, rms_norm, rope, "
                                         r"softmax, swiglu"):
        hkernels.backends("gelu")


def test_auto_picks_helion(device):
    assert hkernels.selected_backend("rms_norm", _x(device)) == "helion"


def test_auto_picks_torch_for_cpu_tensors_without_interpret(monkeypatch):
    monkeypatch.delenv("HKERNELS_INTERPRET", raising=False)
    assert hkernels.selected_backend("softmax", torch.randn(2, 3)) == "torch"


def test_auto_picks_torch_for_float64(device):
    assert hkernels.selected_backend("softmax", _x(device).double()) == "torch"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ("triton", {"rms_norm": "triton", "layer_norm": "triton", "softmax": "triton"}),
        ("helion,softmax=triton", {"rms_norm": "helion", "layer_norm": "helion", "softmax": "triton"}),
        (" Torch , rms_norm = triton ", {"rms_norm": "triton", "layer_norm": "torch", "softmax": "torch"}),
        ("softmax=torch", {"rms_norm": "helion", "layer_norm": "helion", "softmax": "torch"}),
        ("auto", {"rms_norm": "helion", "layer_norm": "helion", "softmax": "helion"}),
    ],
)
def test_env_parsing_and_per_op_overrides(monkeypatch, device, env, expected):
    monkeypatch.setenv("HKERNELS_BACKEND", env)
    x = _x(device)
    assert {op: hkernels.selected_backend(op, x) for op in expected} == expected


def test_env_is_read_at_call_time(monkeypatch, device):
    x = _x(device)
    monkeypatch.setenv("HKERNELS_BACKEND", "triton")
    assert hkernels.selected_backend("softmax", x) == "triton"
    monkeypatch.setenv("HKERNELS_BACKEND", "torch")
    assert hkernels.selected_backend("softmax", x) == "torch"


VALID = r"(auto, helion, triton, torch|layer_norm, matmul, moe, qk_norm_rope, rms_norm, rope, softmax, swiglu)"


@pytest.mark.parametrize("env", ["cuda", "helion,softmax=fast", "gelu=triton"])
def test_env_errors_name_the_valid_choices(monkeypatch, device, env):
    monkeypatch.setenv("HKERNELS_BACKEND", env)
    with pytest.raises(ValueError, match=VALID):
        hkernels.softmax(_x(device))


@pytest.mark.parametrize(("env", "pattern"), [
    ("helion,triton", r"names two default backends \(helion and triton\); give one"),
    ("softmax=triton,softmax=helion", r"asks for two backends for softmax \(triton and helion\)"),
])
def test_env_asking_for_two_backends_at_once_raises(monkeypatch, device, env, pattern):
    """Two defaults (or two choices for one op) are a mistake, not "the last one wins"; the same one twice is fine."""
    monkeypatch.setenv("HKERNELS_BACKEND", env)
    with pytest.raises(ValueError, match=r"hkernels: HKERNELS_BACKEND=.* " + pattern):
        hkernels.softmax(_x(device))
    monkeypatch.setenv("HKERNELS_BACKEND", "triton,Triton,softmax=torch,softmax=torch")
    assert hkernels.selected_backend("softmax", _x(device)) == "torch"


def test_backends_without_an_op_lists_every_op(device):
    every = hkernels.backends()
    assert list(every) == hkernels.ops() and all(every[op] == hkernels.backends(op) for op in every)


def test_scope_beats_env_and_restores(monkeypatch, device):
    x = _x(device)
    monkeypatch.setenv("HKERNELS_BACKEND", "triton")
    with hkernels.use_backend("torch"):
        assert hkernels.selected_backend("rms_norm", x) == "torch"
        with hkernels.use_backend(softmax="helion"):
            assert hkernels.selected_backend("softmax", x) == "helion"
            assert hkernels.selected_backend("rms_norm", x) == "torch"
    assert hkernels.selected_backend("rms_norm", x) == "triton"


def test_inner_default_beats_outer_per_op(device):
    x = _x(device)
    with hkernels.use_backend(softmax="torch"), hkernels.use_backend("triton"):
        assert hkernels.selected_backend("softmax", x) == "triton"


def test_scope_restores_after_an_exception(device):
    with pytest.raises(RuntimeError, match="inside"), hkernels.use_backend("torch"):
        raise RuntimeError("inside")
    assert hkernels.selected_backend("softmax", _x(device)) == "helion"


@pytest.mark.parametrize(("args", "kwargs"), [(("fast",), {}), ((), {"softmax": "fast"}), ((), {"gelu": "torch"})])
def test_use_backend_rejects_unknown_names(args, kwargs):
    with (
        pytest.raises(ValueError, match=VALID),
        hkernels.use_backend(*args, **kwargs),
    ):
        pass


def test_scopes_are_per_thread(device):
    x = _x(device)
    seen: dict[str, str] = {}
    barrier = threading.Barrier(3)

    def worker(name: str) -> None:
        with hkernels.use_backend(name):
            barrier.wait()  # all three scopes are open at once
            seen[name] = hkernels.selected_backend("softmax", x)
            hkernels.softmax(x)
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(b,)) for b in ("helion", "triton", "torch")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"helion": "helion", "triton": "triton", "torch": "torch"}
    assert hkernels.selected_backend("softmax", x) == "helion"  # nothing leaked into this thread


def _spy(monkeypatch, backend: str, op: str, fn: str) -> list[int]:
    module = importlib.import_module(registry.OPS[op].module_name(backend))
    calls: list[int] = []
    real = getattr(module, fn)

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(module, fn, spy)
    return calls


def test_torch_backend_norms_without_a_gradient_are_pytorchs_own(monkeypatch, device):
    """On the torch backend a norm's forward that keeps no statistics (no gradient wanted) is F.rms_norm /
    F.layer_norm, from the first call of a signature on; its result is the reference's within the dtype's
    rounding; with a gradient wanted it is not (the backward needs the statistics)."""
    import torch.nn.functional as F

    ran: list[str] = []
    for name in ("rms_norm", "layer_norm"):
        real = getattr(F, name)
        monkeypatch.setattr(F, name, lambda *a, real=real, name=name, **k: (ran.append(name), real(*a, **k))[1])
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(3, 5, 96, generator=g).to(device, torch.bfloat16) for _ in range(2))
    w, b = (torch.randn(96, generator=g).to(device, torch.bfloat16) for _ in range(2))
    with hkernels.use_backend("torch"), torch.no_grad():
        for _ in range(2):
            got = [hkernels.rms_norm(x, w), hkernels.layer_norm(x, w, b), *hkernels.add_rms_norm(x, r, w)]
    assert ran == ["rms_norm", "layer_norm", "rms_norm"] * 2
    want = [references.rms_norm(x, w), references.layer_norm(x, w, b), *references.add_rms_norm(x, r, w)]
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, atol=2e-2, rtol=2e-2)
    ran.clear()
    with hkernels.use_backend("torch"):
        hkernels.rms_norm(x.clone().requires_grad_(), w)
    assert ran == []


@pytest.mark.parametrize("backend", ["helion", "triton", "torch"])
def test_named_backend_really_runs_forward_and_backward(monkeypatch, device, backend):
    fwd = _spy(monkeypatch, backend, "rms_norm", "rms_norm_fwd")
    bwd = _spy(monkeypatch, backend, "rms_norm", "rms_norm_bwd")
    x = _x(device).requires_grad_()
    monkeypatch.setenv("HKERNELS_BACKEND", backend)
    y = hkernels.rms_norm(x, torch.ones(16, device=device))
    monkeypatch.delenv("HKERNELS_BACKEND")  # the backward must follow the forward's choice, not the env now
    y.sum().backward()
    assert (len(fwd), len(bwd)) == (1, 1)


def test_named_backend_that_cannot_run_says_why(monkeypatch):
    monkeypatch.delenv("HKERNELS_INTERPRET", raising=False)
    x = torch.randn(2, 8)  # CPU tensors, interpret mode off
    with hkernels.use_backend("triton"), pytest.raises(hkernels.BackendUnavailableError) as info:
        hkernels.softmax(x)
    msg = str(info.value)
    assert "hkernels.softmax" in msg and "'triton'" in msg and "cpu" in msg and "Backends that can: torch" in msg


def test_named_kernel_backend_refuses_float64(device):
    with hkernels.use_backend("helion"), pytest.raises(hkernels.BackendUnavailableError, match="float64"):
        hkernels.layer_norm(_x(device).double())


def _break_helion(monkeypatch, message: str = "simulated compile failure") -> None:
    module = importlib.import_module("hkernels.ops.rms_norm")

    def broken(*args):
        raise RuntimeError(message)

    monkeypatch.setattr(module, "rms_norm_fwd", broken)


def test_auto_falls_back_to_triton_with_one_warning(monkeypatch, device):
    _break_helion(monkeypatch)
    triton_calls = _spy(monkeypatch, "triton", "rms_norm", "rms_norm_fwd")
    x, w = _x(device), torch.randn(16, device=device)
    with pytest.warns(hkernels.HKernelsFallbackWarning, match="rms_norm.*simulated compile failure.*Triton"):
        y = hkernels.rms_norm(x, w)
    torch.testing.assert_close(y, references.rms_norm(x, w))
    assert hkernels.selected_backend("rms_norm", x, w) == "triton"  # the failure is remembered
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call must not warn again
        hkernels.rms_norm(x, w)
        hkernels.rms_norm(x[:2], w)
    assert len(triton_calls) == 3


def test_explicit_helion_failure_raises_with_alternatives(monkeypatch, device):
    _break_helion(monkeypatch)
    with hkernels.use_backend("helion"), pytest.raises(hkernels.BackendUnavailableError) as info:
        hkernels.rms_norm(_x(device))
    msg = str(info.value)
    assert "hkernels.rms_norm" in msg and "'helion'" in msg and "simulated compile failure" in msg
    assert "triton, torch" in msg


def test_selected_backend_takes_the_op_signature(device):
    x = _x(device)
    assert hkernels.selected_backend("layer_norm", x, weight=None, bias=None, eps=1e-3) == "helion"
    with pytest.raises(TypeError):
        hkernels.selected_backend("softmax", x, nonsense=1)


class _NoOpMode(torch.overrides.TorchFunctionMode):
    """A function mode that changes nothing: it makes hkernels take the custom-op path instead of its eager fast
    path (functional._call)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["helion", "triton", "torch"])
def test_eager_fast_path_equals_the_custom_op_path(backend, device):
    """Plain eager calls skip the torch.library layers (which cost more than a kernel at decode shapes): results and
    gradients must be bitwise those of the custom-op path, for an op with saved statistics (layer_norm), a loss
    whose gradient is made in the forward and scaled in place (cross_entropy) and a two-output op (rope)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=g).to(device)
    w, b = torch.randn(40, generator=g).to(device), torch.randn(40, generator=g).to(device)
    target = torch.randint(0, 40, (3,), generator=g).to(device)
    q, k = torch.randn(1, 2, 5, 8, generator=g).to(device), torch.randn(1, 1, 5, 8, generator=g).to(device)
    cos, sin = torch.randn(5, 8, generator=g).to(device), torch.randn(5, 8, generator=g).to(device)

    def run() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (x, w, b, q, k)]
        xl, wl, bl, ql, kl = leaves
        with hkernels.use_backend(backend):
            y = hkernels.layer_norm(xl, wl, bl)
            loss = hkernels.cross_entropy(xl * 2, target)
            qr, kr = hkernels.rope(ql, kl, cos, sin)
            nograd = hkernels.rms_norm(x, w)
        (y.square().sum() + loss * 3 + qr.sum() + kr.square().sum()).backward()
        return [y, loss, qr, kr, nograd, *(t.grad for t in leaves)]

    fast = run()
    with _NoOpMode():
        slow = run()
    for a, s in zip(fast, slow, strict=True):
        assert torch.equal(a, s)


@pytest.fixture
def user_auto_table(device, monkeypatch, tmp_path):
    """Write an auto table into a fresh user cache for this machine's arch; the tables are re-read around the test."""
    from hkernels import configs

    monkeypatch.setenv("HKERNELS_CACHE_DIR", str(tmp_path))
    arch = configs.cuda_arch(device) if device.type == "cuda" else "interpret"
    path = tmp_path / "auto" / f"{arch}.json"
    path.parent.mkdir(parents=True)

    def write(text: str) -> None:
        path.write_text(text)
        configs.reload()

    yield write
    configs.reload()  # monkeypatch restores the cache dir after this; the tables are read again lazily


def test_auto_follows_the_measured_table(user_auto_table, monkeypatch, device):
    """Under auto, the tuned table's bucket decides (rows ≤ 8 → triton here), the call really runs there, and
    selected_backend says why; a named backend still wins."""
    user_auto_table('{"softmax": [{"max_rows": 8, "max_n": null, "backend": "triton", "measured": "rows=8: t"},'
                    ' {"max_rows": null, "max_n": null, "backend": "helion", "measured": "rows=64: h"}]}')
    small, large = _x(device), torch.randn(64, 16, device=device)
    chosen = hkernels.selected_backend("softmax", small)
    assert chosen == "triton" and "measured faster" in chosen.reason and "tuned" in chosen.reason
    assert "rows=8: t" in chosen.reason
    assert hkernels.selected_backend("softmax", large) == "helion"
    assert hkernels.selected_backend("rms_norm", small) == "helion"  # an op the table does not name
    calls = _spy(monkeypatch, "triton", "softmax", "softmax_fwd")
    torch.testing.assert_close(hkernels.softmax(small), references.softmax(small))
    assert calls == [1]
    with hkernels.use_backend("helion"):
        assert hkernels.selected_backend("softmax", small) == "helion"


def test_auto_routes_each_shape_by_its_bucket_and_rereads_a_new_table(user_auto_table, monkeypatch, device):
    """auto remembers its route per shape (no table lookup per call): a second shape still gets its own bucket, and
    a table written later (the tune command's) takes effect for shapes routed before."""
    user_auto_table('{"softmax": [{"max_rows": 8, "max_n": null, "backend": "triton", "measured": "t"},'
                    ' {"max_rows": null, "max_n": null, "backend": "helion", "measured": "h"}]}')
    small, large = _x(device), torch.randn(64, 16, device=device)
    triton_calls = _spy(monkeypatch, "triton", "softmax", "softmax_fwd")
    helion_calls = _spy(monkeypatch, "helion", "softmax", "softmax_fwd")
    for x in (small, small, large, large, small):
        torch.testing.assert_close(hkernels.softmax(x), references.softmax(x))
    assert (len(triton_calls), len(helion_calls)) == (3, 2)
    user_auto_table('{"softmax": [{"max_rows": null, "max_n": null, "backend": "helion", "measured": "h"}]}')
    hkernels.softmax(small)
    assert (len(triton_calls), len(helion_calls)) == (3, 3)


def test_a_route_chosen_while_the_tables_reload_is_not_kept(monkeypatch, device):
    """A reload (another thread re-reading the tables) while a call chooses its route from the old ones: the call
    runs, but its route is not remembered for the next call."""
    real = dispatch.select

    def select_during_a_reload(*args, **kwargs):
        chosen = real(*args, **kwargs)
        configs.reload()
        return chosen

    monkeypatch.setattr(dispatch, "select", select_during_a_reload)
    x = _x(device)
    torch.testing.assert_close(hkernels.softmax(x), references.softmax(x))
    assert not [key for key in dispatch._routes if key[0] == "softmax"]
    monkeypatch.setattr(dispatch, "select", real)
    hkernels.softmax(x)
    assert [key for key in dispatch._routes if key[0] == "softmax"]


def test_remembered_routes_stay_bounded(monkeypatch, device):
    """auto remembers a route per shape, so a caller whose row count changes every call (variable-length batches)
    would grow the route memory without end: past _MAX_ROUTES it starts over, and every call stays right."""
    monkeypatch.setattr(dispatch, "_MAX_ROUTES", 5)
    for rows in range(1, 13):
        x = torch.randn(rows, 16, device=device)
        torch.testing.assert_close(hkernels.softmax(x), references.softmax(x))
        assert 0 < len(dispatch._routes) <= 5


def test_selected_backend_buckets_softmax_by_the_dim_it_runs_on(user_auto_table, monkeypatch, device):
    """softmax over dim 0 runs on a moved view whose last dim is x.shape[0]: selected_backend and the call both
    bucket by that length, not by x's last dim."""
    user_auto_table('{"softmax": [{"max_rows": null, "max_n": 8, "backend": "triton", "measured": "n<=8: t"},'
                    ' {"max_rows": null, "max_n": null, "backend": "helion", "measured": "wide: h"}]}')
    x = torch.randn(4, 64, device=device)
    assert hkernels.selected_backend("softmax", x) == "helion"
    assert hkernels.selected_backend("softmax", x, dim=0) == "triton"
    assert hkernels.selected_backend("softmax", x, 0) == "triton"
    calls = _spy(monkeypatch, "triton", "softmax", "softmax_fwd")
    torch.testing.assert_close(hkernels.softmax(x, dim=0), references.softmax(x.T).T)
    assert calls == [1]


def test_a_loss_backward_runs_where_its_forward_did_under_auto(user_auto_table, monkeypatch, device):
    """cross_entropy's backward kernel takes (per-row factors [T], gradient [T, V]): auto buckets it by the
    gradient, as the forward by the logits, so both run on the backend measured for rows of V logits (bucketed by
    the factors, the backward would run on the backend measured for rows of T elements, not the one the table
    chose for it)."""
    user_auto_table('{"cross_entropy": [{"max_rows": null, "max_n": 64, "backend": "helion", "measured": "h"},'
                    ' {"max_rows": null, "max_n": null, "backend": "triton", "measured": "t"}]}')
    logits = torch.randn(32, 128, device=device, requires_grad=True)  # T = 32 <= 64 < V = 128
    target = torch.randint(0, 128, (32,), device=device)
    fwd = _spy(monkeypatch, "triton", "cross_entropy", "cross_entropy_fwd")
    bwd = _spy(monkeypatch, "triton", "cross_entropy", "cross_entropy_bwd")
    (hkernels.cross_entropy(logits, target) * 2.0).backward()  # an upstream factor of 2: the scaling kernel runs
    assert fwd == [1] and bwd == [1]
    x64 = logits.detach().double().requires_grad_()
    want = torch.autograd.grad(references.cross_entropy(x64, target) * 2.0, x64)[0]
    torch.testing.assert_close(logits.grad.double(), want, atol=1e-5, rtol=1e-4)


def test_attention_forward_follows_buckets_of_its_own_under_auto(user_auto_table, monkeypatch, device):
    """A table may route one function of an op apart ("attention:attention_fwd"): the forward runs on Triton, the
    backward on the op's bucket (Helion), and the output and gradients are those of the reference."""
    user_auto_table('{"attention:attention_fwd": [{"max_rows": null, "max_n": null, "backend": "triton", '
                    '"measured": "fwd: t"}], "attention": [{"max_rows": null, "max_n": null, "backend": "helion", '
                    '"measured": "fwd + fwd_bwd: h"}]}')
    q, k, v = (torch.randn(1, 2, 24, 16, device=device, requires_grad=True) for _ in range(3))
    fwd_t = _spy(monkeypatch, "triton", "attention", "attention_fwd")
    fwd_h = _spy(monkeypatch, "helion", "attention", "attention_fwd")
    bwd_t = _spy(monkeypatch, "triton", "attention", "attention_bwd")
    bwd_h = _spy(monkeypatch, "helion", "attention", "attention_bwd")
    out = hkernels.attention(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    assert (fwd_t, fwd_h, bwd_t, bwd_h) == ([1], [], [], [1])
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = references.attention(*leaves, causal=True)
    want.backward(torch.ones_like(want))
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    for got, ref in zip((q, k, v), leaves, strict=True):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-4, rtol=1e-4)
    chosen = hkernels.selected_backend("attention", q, k, v)  # the forward's, and the backward's in the reason
    assert chosen == "triton" and "fwd: t" in chosen.reason and "the backward: auto: helion" in chosen.reason


def test_auto_takes_the_torch_backend_where_the_table_measured_it_faster(user_auto_table, monkeypatch, device):
    """A bucket may name torch (PyTorch's own call, measured faster): auto runs the torch backend's functions,
    forward and backward, and says why."""
    user_auto_table('{"rms_norm": [{"max_rows": null, "max_n": null, "backend": "torch", "measured": "p"}]}')
    x = torch.randn(6, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)
    fwd = _spy(monkeypatch, "torch", "rms_norm", "rms_norm_fwd")
    bwd = _spy(monkeypatch, "torch", "rms_norm", "rms_norm_bwd")
    kernels = [_spy(monkeypatch, b, "rms_norm", f) for b in ("helion", "triton") for f in ("rms_norm_fwd",
                                                                                        "rms_norm_bwd")]
    y = hkernels.rms_norm(x, w)
    y.backward(torch.ones_like(y))
    assert (fwd, bwd, kernels) == ([1], [1], [[], [], [], []])
    chosen = hkernels.selected_backend("rms_norm", x, w)
    assert chosen == "torch" and "measured faster" in chosen.reason and "p" in chosen.reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's fused attention kernels need a GPU")
@pytest.mark.parametrize("order", [("torch", "triton"), ("triton", "torch")], ids=lambda o: "_then_".join(o))
def test_attention_forward_and_backward_on_pytorchs_fused_kernel_and_triton_agree(user_auto_table, order,
                                                                                  device):
    """The torch backend's attention (cuDNN or flash where PyTorch takes the call) saves o and lse as the kernels
    do: a forward on one and a backward on the other (auto's buckets route them apart) give the reference's
    output and gradients, GQA and a transposed [B, S, H, D] layout included."""
    fwd, bwd = order
    user_auto_table(json.dumps({"attention:attention_fwd": [{"max_rows": None, "max_n": None, "backend": fwd,
                                                             "measured": "f"}],
                                "attention": [{"max_rows": None, "max_n": None, "backend": bwd, "measured": "b"}]}))
    g = torch.Generator(device="cpu").manual_seed(3)
    q = torch.randn(2, 200, 8, 64, generator=g).to(device, torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(2, 200, 2, 64, generator=g).to(device, torch.bfloat16).transpose(1, 2) for _ in range(2))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = hkernels.attention(*leaves, causal=True)
    do = torch.randn(out.shape, generator=g).to(device, torch.bfloat16)
    out.backward(do)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = references.attention(*refs, causal=True)
    want.backward(do.double())
    bases = [t.detach().clone().requires_grad_() for t in (q, k, v)]  # the reference math in bfloat16
    base = references.attention(*bases, causal=True)
    base.backward(do)
    problems = [max_error("out", out.detach(), want.detach(), base.detach(), torch.bfloat16)]
    problems += [max_error(f"d{n}", a.grad, r.grad, b.grad, torch.bfloat16, do.abs().max().item())
                 for n, a, r, b in zip("qkv", leaves, refs, bases, strict=True)]
    assert not any(problems), "\n".join(p for p in problems if p)


def test_a_torch_bucket_of_attention_holds_only_where_pytorchs_fused_kernel_takes_the_call(user_auto_table,
                                                                                         monkeypatch, device):
    """The table's torch buckets for attention were measured on PyTorch's fused kernels: a call those do not take
    (float32 here; on a CPU, every call) runs a kernel backend, not the torch backend's reference math."""
    user_auto_table(json.dumps({"attention:attention_fwd": [{"max_rows": None, "max_n": None, "backend": "torch",
                                                             "measured": "f"}],
                                "attention": [{"max_rows": None, "max_n": None, "backend": "torch", "measured": "b"}]}))
    q, k, v = (torch.randn(1, 2, 40, 16, device=device, requires_grad=True) for _ in range(3))
    math = [_spy(monkeypatch, "torch", "attention", f) for f in ("attention_fwd", "attention_bwd")]
    out = hkernels.attention(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    assert math == [[], []]
    chosen = hkernels.selected_backend("attention", q, k, v)
    assert chosen == "helion", chosen.reason
    torch.testing.assert_close(out, references.attention(q, k, v, causal=True), atol=1e-4, rtol=1e-4)


def test_torch_backend_attention_moves_past_a_fused_kernel_that_fails(monkeypatch):
    """Where a fused kernel PyTorch's checks accepted raises, the torch backend's attention runs the next one
    (here flash's, then the math), warns once per kernel, and keeps the choice for the call's key. (On a CPU: the
    fused kernels stood in for, the key made by hand.)"""
    from hkernels.functional import attention as att

    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    key = ("stand-in",)
    monkeypatch.setattr(att, "_fused_key", lambda *a: key)
    monkeypatch.setitem(att._FUSED, key, ("cudnn", "flash"))
    calls = []

    def fails(*args, **kwargs):
        calls.append("cudnn")
        raise RuntimeError("cuDNN: no plan for this graph")

    def flash(q, k, v, dropout, causal, debug, scale):
        calls.append("flash")
        o, lse = att.math_fwd(q, k, v, causal, scale)
        return o, lse, None, None, 8, 8, None, None, None

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", fails)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", flash)
    with pytest.warns(hkernels.HKernelsFallbackWarning, match="cudnn kernel failed.*run flash from now on"):
        o, lse = att.attention_fwd(q, k, v, True, 0.25)
    want, want_lse = att.math_fwd(q, k, v, True, 0.25)
    assert calls == ["cudnn", "flash"] and torch.equal(o, want) and torch.equal(lse, want_lse)
    assert att._FUSED[key] == ("flash",)
    att.attention_fwd(q, k, v, True, 0.25)  # the next call goes straight to flash
    assert calls == ["cudnn", "flash", "flash"]

    def flash_fails(*args, **kwargs):
        raise RuntimeError("flash: head dim")

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", flash_fails)
    with pytest.warns(hkernels.HKernelsFallbackWarning, match="flash kernel failed.*the reference math"):
        o, _ = att.attention_fwd(q, k, v, True, 0.25)
    assert torch.equal(o, want) and att._FUSED[key] == ()

    # the backward the same way: cuDNN's raises, flash's (here the math) gives the gradients
    monkeypatch.setitem(att._FUSED, key, ("cudnn", "flash"))
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", fails)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward",
                        lambda do, q, k, v, o, lse, *rest, scale: att.math_bwd(do, q, k, v, o, lse, True, scale))
    do = torch.randn_like(want)
    with pytest.warns(hkernels.HKernelsFallbackWarning, match="cudnn kernel failed.*run flash from now on"):
        grads = att.attention_bwd(do, q, k, v, want, want_lse, True, 0.25)
    for got, ref in zip(grads, att.math_bwd(do, q, k, v, want, want_lse, True, 0.25), strict=True):
        assert torch.equal(got, ref)


def test_torch_backend_grouped_matmuls_are_pytorchs_grouped_gemm(monkeypatch, device):
    """On the torch backend grouped_matmul and moe at bfloat16 run ``torch._grouped_mm`` (forward, input and weight
    gradients); their rows past the groups and their out-of-range slots still give zeros, and the results are the
    float64 reference's within bfloat16's rounding. Where it raises, the loop runs, with one warning; an operand it
    cannot take (a dim not a multiple of 8) goes to the loop without a try."""
    from hkernels.functional import grouped_matmul as gm
    from hkernels.functional import moe as moe_module

    def make(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16)

    g = torch.Generator().manual_seed(3)
    x, w = make(20, 16).requires_grad_(), make(3, 24, 16, scale=0.25).requires_grad_()
    sizes = torch.tensor([6, 0, 9], device=device)  # rows 15.. are in no group
    try:
        torch._grouped_mm(x.detach(), w.detach().transpose(1, 2), offs=sizes.cumsum(0).int())
    except (AttributeError, RuntimeError, NotImplementedError):
        pytest.skip("this PyTorch has no torch._grouped_mm for this device")
    calls: list[int] = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    monkeypatch.setattr(gm, "_GROUPED_MM_REFUSED", set())
    with hkernels.use_backend("torch"):
        y = hkernels.grouped_matmul(x, w, sizes)
        y.backward(dy := make(*y.shape))
    assert len(calls) == 3  # forward, dx, dw
    assert torch.equal(y[15:], torch.zeros_like(y[15:])) and torch.equal(x.grad[15:], torch.zeros_like(x.grad[15:]))
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    (gm.reference(x64, w64, sizes) * dy.double()).sum().backward()
    want = gm.reference(x64.detach(), w64.detach(), sizes)
    for got, ref in ((y, want), (x.grad, x64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(got.double(), ref, atol=5e-2, rtol=2e-2)

    calls.clear()
    ids = torch.randint(0, 3, (20, 2), generator=g)
    ids[4, 1], ids[7, 0] = -1, 5  # out of range: these slots add nothing, whatever the rows past the groups hold
    ids = ids.to(device)
    tw = torch.rand(20, 2, generator=g).to(device, torch.bfloat16).requires_grad_()
    gu, down = make(3, 32, 16, scale=0.25).requires_grad_(), make(3, 16, 16, scale=0.25).requires_grad_()
    with hkernels.use_backend("torch"):
        out = hkernels.moe(x.detach(), gu, down, ids, tw)
        out.backward(dout := make(*out.shape))
    assert len(calls) == 2 + 3  # forward: gate_up, down; backward: dh, dgate_up, ddown (x wants no gradient)
    leaves64 = [t.detach().double().requires_grad_() for t in (gu, down, tw)]
    ref = moe_module.reference(x.detach().double(), leaves64[0], leaves64[1], ids, leaves64[2])
    (ref * dout.double()).sum().backward()
    for got, expected in ((out, ref), (gu.grad, leaves64[0].grad), (down.grad, leaves64[1].grad),
                          (tw.grad, leaves64[2].grad)):
        torch.testing.assert_close(got.double(), expected.detach(), atol=6e-2, rtol=2e-2)

    calls.clear()
    with hkernels.use_backend("torch"):
        hkernels.grouped_matmul(make(5, 12), make(2, 8, 12), sizes[:2])
        padded = make(20, 24)[:, :16]  # rows 24 elements apart: a multiple of 8, taken
        hkernels.grouped_matmul(padded, w.detach(), sizes)
        assert len(calls) == 1
        odd = make(20, 20)[:, :16]  # rows 20 elements apart (40 bytes): not taken, and not tried
        expanded = make(1, 16).expand(20, 16)  # one row for all (stride 0), as a sum's gradient comes
        for a in (odd, expanded):
            torch.testing.assert_close(hkernels.grouped_matmul(a, w.detach(), sizes).double(),
                                       gm.reference(a.double(), w.detach().double(), sizes), atol=5e-2, rtol=2e-2)
    assert len(calls) == 1 and not gm._GROUPED_MM_REFUSED  # K = 12, the odd and the stride-0 rows: the loop

    def fails(*args, **kwargs):
        raise RuntimeError("no grouped GEMM for this device")

    monkeypatch.setattr(torch, "_grouped_mm", fails)
    with hkernels.use_backend("torch"), pytest.warns(hkernels.HKernelsFallbackWarning, match="loop of matmuls"):
        again = hkernels.grouped_matmul(x.detach(), w.detach(), sizes)
    torch.testing.assert_close(again.double(), want, atol=5e-2, rtol=2e-2)
    assert device.type in gm._GROUPED_MM_REFUSED


def test_grouped_weight_gradient_of_an_empty_group_is_zero_where_the_gemm_leaves_it(monkeypatch):
    """Where ``torch._grouped_mm`` does not write an empty group's weight gradient (pytorch#172439), the torch backend
    sets it to zero (on a CPU: the GEMM's result stood in for, garbage in the empty groups)."""
    from hkernels.functional import grouped_matmul as gm

    offs = torch.tensor([3, 3, 7, 7], dtype=torch.int32)  # groups 1 and 3 are empty
    dw = torch.randn(4, 8, 16)
    dw[1], dw[3] = float("nan"), 1e30
    assert gm.weight_grads(dw, offs) is dw  # (a CPU's loop of matmuls writes the zeros itself)
    monkeypatch.setattr(gm, "zeroes_empty_groups", lambda device: False)
    got = gm.weight_grads(dw, offs)
    assert torch.equal(got[[0, 2]], dw[[0, 2]]) and not got[[1, 3]].any()


def test_torch_backend_attention_on_an_empty_batch(device):
    """An empty batch on the torch backend: empty results and gradients, not a fused kernel's None (cuDNN's checks
    take B = 0, and its kernel then returns no tensors)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(0, 4, 64, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    with hkernels.use_backend("torch"):
        for causal in (False, True):
            o = hkernels.attention(q, k, v, causal=causal)
            assert o.shape == q.shape
            grads = torch.autograd.grad(o.float().sum(), (q, k, v), allow_unused=True)
            assert all(g is None or g.shape == t.shape for g, t in zip(grads, (q, k, v), strict=True))


def test_torch_backend_attention_varlen_runs_flash_varlen_and_masks_what_it_leaves(monkeypatch):
    """The torch backend's attention_varlen calls PyTorch's FlashAttention varlen kernels where they take the call;
    what they leave unwritten (rows past the last sequence) gives zeros, a row that sees no key has lse −inf here
    and +inf where the kernel reads it, and a kernel that raises sends the device to the loop with one warning.
    (On a CPU: the kernels stood in for by the loop, their unwritten rows filled with NaN.)"""
    from hkernels.functional import attention_varlen as av

    g = torch.Generator().manual_seed(4)
    q = torch.randn(11, 4, 16, generator=g).bfloat16()  # rows 9, 10: in no sequence
    k, v = (torch.randn(9, 2, 16, generator=g).bfloat16() for _ in range(2))
    cu_q = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 2, 5, 9], dtype=torch.int32)  # the first: 3 queries, 2 keys (causal: one sees no key)
    args = (cu_q, cu_k, 6, 4, True, 0.25)
    want_o, want_lse = av.attention_varlen_fwd(q, k, v, *args)
    do = torch.randn(q.shape, generator=g).bfloat16()
    want_grads = av.attention_varlen_bwd(do, q, k, v, want_o, want_lse, *args)
    seen: dict[str, torch.Tensor] = {}

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale, window_size_left,
                window_size_right):
        o, lse = want_o.clone(), want_lse.clone()
        o[9:], lse[:, 9:] = float("nan"), float("nan")
        return o, lse.masked_fill(lse == float("-inf"), float("inf")), None, None, None

    def backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, *, scale,
                 window_size_left, window_size_right):
        seen["lse"] = lse
        grads = [t.clone() for t in want_grads]
        for t in grads:
            t[9:] = float("nan")
        return grads

    monkeypatch.setattr(av, "_flash", lambda q, *rest: True)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", backward)
    o, lse = av.attention_varlen_fwd(q, k, v, *args)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse) and bool((lse[:, 0] == float("-inf")).all())
    grads = av.attention_varlen_bwd(do, q, k, v, o, lse, *args)
    assert bool((seen["lse"][:, 0] == float("inf")).all())
    for got, ref in zip(grads, want_grads, strict=True):
        assert torch.equal(got, ref)

    def fails(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fails)
    monkeypatch.setattr(av, "_FLASH_REFUSED", set())
    with pytest.warns(hkernels.HKernelsFallbackWarning, match="one sequence at a time"):
        o, _ = av.attention_varlen_fwd(q, k, v, *args)
    assert torch.equal(o, want_o) and q.device in av._FLASH_REFUSED


def test_auto_falls_back_to_helion_where_measured_triton_fails(user_auto_table, monkeypatch, device):
    """The table picks Triton; Triton cannot run the input: Helion runs it, with one warning; if Helion fails
    too, Triton's error is what the caller sees."""
    user_auto_table('{"rms_norm": [{"max_rows": null, "max_n": null, "backend": "triton", "measured": "t"}]}')
    module = importlib.import_module("triton_fallback.rms_norm")
    tried = []

    def broken(*args):
        tried.append(1)
        raise RuntimeError("simulated Triton compile failure")

    monkeypatch.setattr(module, "rms_norm_fwd", broken)
    x = torch.randn(4, 32, device=device)
    assert hkernels.selected_backend("rms_norm", x) == "triton"
    with pytest.warns(hkernels.HKernelsFallbackWarning, match="Triton kernel.*simulated.*Helion"):
        got = hkernels.rms_norm(x)
    torch.testing.assert_close(got, references.rms_norm(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per (op, reason)
        hkernels.rms_norm(torch.randn(9, 32, device=device))  # another row count: the failure is remembered
    assert tried == [1]  # Triton was not retried
    dispatch.forget()  # the failure, and the plans that ran on Helion because of it
    helion = importlib.import_module("hkernels.ops.rms_norm")
    monkeypatch.setattr(helion, "rms_norm_fwd", lambda *a: (_ for _ in ()).throw(ValueError("helion too")))
    with pytest.raises(RuntimeError, match="simulated Triton compile failure"):
        hkernels.rms_norm(x)


def test_broken_user_table_is_ignored_with_a_warning(user_auto_table, device):
    user_auto_table("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring .*auto"):
        assert hkernels.selected_backend("softmax", _x(device)) == "helion"


def test_selected_backend_says_why(device):
    x = _x(device)
    with hkernels.use_backend("triton"):
        assert hkernels.selected_backend("softmax", x).reason == "asked for by name"
    assert hkernels.selected_backend("softmax", x.cpu().double()).reason.startswith("auto")


def test_fallback_for_one_row_length_does_not_spread(monkeypatch, device):
    """A Helion failure is remembered for its (dtype, row length); other row lengths keep running on Helion, and
    selected_backend says the same as what runs (the route cache must not keep the one shape's fallback)."""
    module = importlib.import_module("hkernels.ops.rms_norm")
    real = module.rms_norm_fwd

    def fails_at_64(x, *rest):
        if x.shape[-1] == 64:
            raise RuntimeError("simulated failure at N = 64")
        return real(x, *rest)

    monkeypatch.setattr(module, "rms_norm_fwd", fails_at_64)
    helion_calls = _spy(monkeypatch, "helion", "rms_norm", "rms_norm_fwd")
    narrow, wide = torch.randn(4, 64, device=device), torch.randn(4, 128, device=device)
    with pytest.warns(hkernels.HKernelsFallbackWarning):
        hkernels.rms_norm(narrow)
    hkernels.rms_norm(narrow)  # the fallback, again (now remembered)
    assert hkernels.selected_backend("rms_norm", narrow) == "triton"
    before = len(helion_calls)
    torch.testing.assert_close(hkernels.rms_norm(wide), references.rms_norm(wide))
    assert hkernels.selected_backend("rms_norm", wide) == "helion" and len(helion_calls) == before + 1


def test_selection_survives_copy_and_pickle(device):
    import copy
    import pickle

    chosen = hkernels.selected_backend("softmax", _x(device))
    for clone in (copy.copy(chosen), copy.deepcopy(chosen), pickle.loads(pickle.dumps(chosen))):
        assert clone == chosen and clone.reason == chosen.reason


def test_jit_trace_records_the_custom_op(device):
    """torch.jit.trace records custom ops, not what runs inside them: a traced call must go through the op."""
    x = _x(device)
    traced = torch.jit.trace(lambda t: hkernels.softmax(t), (x,), check_trace=False)
    assert "hkernels::softmax_fwd" in str(traced.graph)
    torch.testing.assert_close(traced(x), references.softmax(x))


def test_auto_routes_windowed_attention_by_its_own_buckets(user_auto_table, monkeypatch, device):
    """A call with a window or a cap runs where the table's ``attention:attention_masked_*`` buckets say, a plain
    call where attention's own say: here Triton for the masked forward and backward, Helion for the plain ones."""
    user_auto_table('{"attention": [{"max_rows": null, "max_n": null, "backend": "helion", "measured": "h"}],'
                    ' "attention:attention_masked_fwd": [{"max_rows": null, "max_n": null, "backend": "triton",'
                    ' "measured": "t"}],'
                    ' "attention:attention_masked_bwd": [{"max_rows": null, "max_n": null, "backend": "triton",'
                    ' "measured": "t"}]}')
    q, k, v = (torch.randn(1, 2, 20, 16, device=device, requires_grad=True) for _ in range(3))
    calls = {(b, fn): _spy(monkeypatch, b, "attention", fn) for b in ("helion", "triton")
             for fn in ("attention_fwd", "attention_bwd", "attention_masked_fwd", "attention_masked_bwd")}
    hkernels.attention(q, k, v, causal=True, window=(5, 0)).sum().backward()
    hkernels.attention(q, k, v, causal=True, softcap=3.0).sum().backward()
    hkernels.attention(q, k, v, causal=True).sum().backward()
    ran = {key: len(c) for key, c in calls.items() if c}
    assert ran == {("triton", "attention_masked_fwd"): 2, ("triton", "attention_masked_bwd"): 2,
                   ("helion", "attention_fwd"): 1, ("helion", "attention_bwd"): 1}
    assert hkernels.selected_backend("attention", q, k, v, causal=True, window=(5, 0)) == "triton"
    assert hkernels.selected_backend("attention", q, k, v, softcap=3.0) == "triton"
    assert hkernels.selected_backend("attention", q, k, v, causal=True) == "helion"


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpret mode's routing (CPU tensors); a GPU runs the "
                    "compiled five-length tests instead")
def test_auto_sends_a_symbolic_length_to_a_backend_that_traces_it():
    """Inside a graph, under auto, a call whose row count is symbolic goes to Triton where it traces at any length
    (its module's SYMBOLIC), else to Helion where it does, never to one that would keep it opaque; the same call at
    a static length is routed as before, and a backend asked for by name is kept."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    rows = env.create_symintnode(env.create_symbol(12, ConstantSource("rows"), dynamic_dim=DimDynamic.DYNAMIC),
                                 hint=12)
    with FakeTensorMode(shape_env=env):
        x, w = torch.empty(rows, 64), torch.empty(64)
        q, k, cos = torch.empty(1, 4, rows, 16), torch.empty(1, 2, rows, 16), torch.empty(1, rows, 16)
        static = torch.empty(1, 4, 12, 16), torch.empty(1, 2, 12, 16), torch.empty(1, 12, 16), torch.empty(1, 12, 16)
    for backend in ("triton", "helion"):
        assert dispatch.takes_symbolic("rms_norm", backend, "rms_norm_fwd")
    for backend in ("triton", "helion"):
        assert dispatch.takes_symbolic("rope", backend, "rope_fwd")
    for backend in ("triton", "helion"):
        assert dispatch.takes_symbolic("moe", backend, "moe_fwd")
    # (Helion's packed attention stays opaque there)
    assert not dispatch.takes_symbolic("attention_varlen", "helion", "attention_varlen_fwd")
    with FakeTensorMode(shape_env=env):
        long_rows = torch.empty(rows, 100000)
    for backend in ("triton", "helion"):
        assert dispatch.takes_symbolic("softmax", backend, "softmax_fwd", (x,))  # rows kept in registers
        assert not dispatch.takes_symbolic("softmax", backend, "softmax_fwd", (long_rows,))  # split rows: opaque
    for op, args in (("rms_norm", (x, w)), ("rope", (q, k, cos, cos))):  # (both backends trace both: Triton's the
        # measured path)
        backend, why = dispatch.select_compiled(op, "auto", args, f"{op}_fwd")
        assert backend == "triton", why
    assert dispatch.select_compiled("rms_norm", "helion", (x, w), "rms_norm_fwd")[0] == "helion"  # (asked for)
    assert dispatch.select_compiled("rope", "auto", static, "rope_fwd")[0] == "helion"
    assert dispatch.select_compiled("softmax", "auto", (long_rows,), "softmax_fwd")[0] == "helion"  # (opaque)
    assert not [str(g.expr) for g in env.guards if g.expr.free_symbols]  # routing read nothing of the length
