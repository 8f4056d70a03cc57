"""The execution policy (blutensor.policy): field validation, environment defaults read once, scopes that nest and
restore (per thread), the setters as writers of the innermost layer, and each call site reading the active policy."""

from __future__ import annotations

import threading

import blutensor as bt
import numpy as np
import pytest
from blutensor import ext
from blutensor.policy import CHOICES, ENV, ExecutionPolicy


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in [*ENV.values(), bt.policy.KERNELS_ENV]:
        monkeypatch.delenv(var, raising=False)
    bt.policy.reset_defaults()
    yield
    bt.policy.reset_defaults()


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("field", sorted(CHOICES))
def test_a_bad_value_names_the_field_and_the_allowed_values(field):
    allowed = CHOICES[field]
    with pytest.raises(ValueError) as e:
        ExecutionPolicy(**{field: "nonsense"})
    assert f"ExecutionPolicy.{field} must be one of {allowed}, got 'nonsense'" == str(e.value)
    for v in allowed:  # every allowed value is accepted
        assert getattr(ExecutionPolicy(**{field: v}), field) == v


def test_other_fields_are_checked_too():
    with pytest.raises(ValueError, match=r"ExecutionPolicy.deterministic must be True or False, got 1"):
        ExecutionPolicy(deterministic=1)
    with pytest.raises(ValueError, match=r"ExecutionPolicy.max_3xtf32_k must be an integer >= 0, got -1"):
        ExecutionPolicy(max_3xtf32_k=-1)
    with pytest.raises(ValueError, match=r"ExecutionPolicy.max_3xtf32_k must be an integer >= 0, got '8'"):
        ExecutionPolicy(max_3xtf32_k="8")
    with pytest.raises(ValueError, match=r"ExecutionPolicy.gemm must be 'auto' or a registered GEMM provider"):
        ExecutionPolicy(gemm="")
    with pytest.raises(ValueError, match=r"ExecutionPolicy.compiler must be 'auto' or a registered compiler"):
        ExecutionPolicy(compiler=3)
    with pytest.raises(ValueError, match=r"ExecutionPolicy has no field 'fp32_gem'; fields: precision, fp32_gemm"):
        ExecutionPolicy().replace(fp32_gem="3xtf32")
    with pytest.raises(ValueError, match=r"ExecutionPolicy.precision must be one of"):
        bt.policy.scope(precision="fp16")
    with pytest.raises(TypeError, match="ExecutionPolicy"):
        bt.policy.set_default({"precision": "tf32"})
    p = ExecutionPolicy()
    with pytest.raises(AttributeError):
        p.precision = "tf32"  # frozen: a changed policy is a new object
    assert p.replace(precision="tf32") == ExecutionPolicy(precision="tf32") and p.precision == "fp32"
    assert bt.ExecutionPolicy is ExecutionPolicy and ext.ExecutionPolicy is ExecutionPolicy


# ------------------------------------------------------------------------------------------------ environment
@pytest.mark.parametrize("var,raw,field,want", [
    ("BLUTRAIN_FP32_GEMM", "3XTF32", "fp32_gemm", "3xtf32"),
    ("BLUTRAIN_3XTF32_MAX_K", " 1024 ", "max_3xtf32_k", 1024),
    ("BLUTRAIN_SDPA_KERNEL", "mma", "attention", "mma"),
    ("BLUTRAIN_SDPA_FP32", "simt", "attention_fp32", "simt"),
    ("BLUTRAIN_SDPA_BWD", "split", "attention_backward", "split"),
    ("BLUTRAIN_EMBEDDING_BWD", "runs", "embedding_backward", "runs"),
    ("BLUTRAIN_EMBEDDING_SORT", "radix", "embedding_sort", "radix"),
    ("BLUTRAIN_GEMM", "xp", "gemm", "xp"),
    ("BLUTRAIN_DETERMINISTIC", "1", "deterministic", True),
    ("BLUTRAIN_VALIDATE_INDICES", "0", "validate_indices", "off"),
    ("BLUTRAIN_COMPILER", "testcomp.identity", "compiler", "testcomp.identity"),
])
def test_each_variable_sets_its_field(var, raw, field, want):
    assert ENV[field] == var
    p = ExecutionPolicy.from_env({var: raw})
    assert getattr(p, field) == want
    assert p.replace(**{field: getattr(ExecutionPolicy(), field)}) == ExecutionPolicy()  # nothing else changed


@pytest.mark.parametrize("var,raw,msg", [
    ("BLUTRAIN_FP32_GEMM", "fast", r"BLUTRAIN_FP32_GEMM must be one of \('strict', '3xtf32'\), got 'fast'"),
    ("BLUTRAIN_3XTF32_MAX_K", "lots", r"BLUTRAIN_3XTF32_MAX_K must be an integer, got 'lots'"),
    ("BLUTRAIN_3XTF32_MAX_K", "-2", r"BLUTRAIN_3XTF32_MAX_K must be >= 0, got -2"),
    ("BLUTRAIN_SDPA_BWD", "atomic", r"BLUTRAIN_SDPA_BWD must be one of \('auto', 'fused', 'split'\)"),
    ("BLUTRAIN_EMBEDDING_SORT", "bitonic", r"BLUTRAIN_EMBEDDING_SORT must be one of \('auto', 'radix'\)"),
    ("BLUTRAIN_DETERMINISTIC", "maybe", r"BLUTRAIN_DETERMINISTIC must be 0 or 1, got 'maybe'"),
    ("BLUTRAIN_VALIDATE_INDICES", "later", r"BLUTRAIN_VALIDATE_INDICES must be one of lazy, sync"),
])
def test_a_bad_variable_is_named(var, raw, msg):
    with pytest.raises(ValueError, match=msg):
        ExecutionPolicy.from_env({var: raw})


def test_the_environment_is_read_once_at_first_use(monkeypatch):
    monkeypatch.setenv("BLUTRAIN_SDPA_BWD", "split")
    reads = []
    real = ExecutionPolicy.from_env.__func__

    def counting(cls, environ=None):
        reads.append(1)
        return real(cls, environ)

    monkeypatch.setattr(ExecutionPolicy, "from_env", classmethod(counting))
    bt.policy.reset_defaults()
    for _ in range(5):
        assert bt.policy.current().attention_backward == "split"
    monkeypatch.setenv("BLUTRAIN_SDPA_BWD", "fused")  # later changes of the environment change nothing
    assert bt.policy.current().attention_backward == "split"
    from blutensor.backends.cupy import sdpa

    assert not sdpa.fused_backward("tf32x3", 64)
    assert len(reads) == 1
    bt.policy.reset_defaults()  # tests: read it again
    assert bt.policy.current().attention_backward == "fused" and len(reads) == 2


def test_one_list_of_precision_names():
    """The policy's CHOICES are the one list: the public PRECISIONS / FP32_GEMMS, bt.set_matmul_precision's check
    and blutensor.gemm's (blumodels' config reads the same: packages/blumodels/tests/test_config.py)."""
    from blutensor import gemm

    assert bt.policy.PRECISIONS is CHOICES["precision"] is gemm.PRECISIONS
    assert bt.policy.FP32_GEMMS is CHOICES["fp32_gemm"] is gemm.FP32_GEMMS is ext.FP32_GEMMS
    with pytest.raises(ValueError, match=r"matmul precision must be one of \('fp32', 'tf32', 'bf16'\), got 'fp16'"):
        bt.set_matmul_precision("fp16")
    for p in bt.policy.PRECISIONS:
        bt.set_matmul_precision(p)
        assert bt.get_matmul_precision() == p


def test_kernel_overrides_are_read_once_and_again_after_reset(monkeypatch):
    monkeypatch.setenv("BLUTRAIN_KERNELS", " relu = example.relu , gelu=blutensor.gelu,")
    assert bt.policy.env_kernels() == {"relu": "example.relu", "gelu": "blutensor.gelu"}
    monkeypatch.setenv("BLUTRAIN_KERNELS", "relu=other.relu")  # later changes of the environment change nothing
    assert bt.policy.env_kernels() == {"relu": "example.relu", "gelu": "blutensor.gelu"}
    bt.policy.env_kernels()["relu"] = "mutated"  # a copy: the read-once table stays as read
    assert bt.policy.env_kernels()["relu"] == "example.relu"
    bt.policy.reset_defaults()
    assert bt.policy.env_kernels() == {"relu": "other.relu"}


@pytest.mark.parametrize("spec", ["relu", "relu=", "=example.relu", "relu=a.relu,gelu"])
def test_a_bad_kernel_override_is_named_at_first_use(monkeypatch, spec):
    monkeypatch.setenv("BLUTRAIN_KERNELS", spec)
    bt.policy.reset_defaults()
    with pytest.raises(ValueError, match=r"BLUTRAIN_KERNELS entry '.*' is not of the form op=plugin"):
        bt.tensor([1.0, -1.0]).exp()  # the first op reads it
    with pytest.raises(ValueError, match="BLUTRAIN_KERNELS"):  # every use, not only the first
        bt.policy.env_kernels()


def test_a_bad_variable_fails_at_first_use_naming_it(monkeypatch):
    monkeypatch.setenv("BLUTRAIN_FP32_GEMM", "tf32")
    bt.policy.reset_defaults()
    with pytest.raises(ValueError, match="BLUTRAIN_FP32_GEMM"):
        bt.get_fp32_gemm()
    with pytest.raises(ValueError, match="BLUTRAIN_FP32_GEMM"):  # every use, not only the first
        bt.policy.current()


# ------------------------------------------------------------------------------------------------ scopes
def test_scopes_nest_and_restore_even_on_error():
    base = bt.policy.current()
    assert base == ExecutionPolicy()
    with bt.policy.scope(precision="tf32") as outer:
        assert bt.policy.current() is outer and outer.precision == "tf32"
        with bt.policy.scope(deterministic=True) as inner:
            assert inner == outer.replace(deterministic=True)  # builds on the enclosing scope
            assert bt.get_matmul_precision() == "tf32" and bt.are_deterministic_algorithms_enabled()
        assert bt.policy.current() is outer
        with pytest.raises(RuntimeError), bt.policy.scope(fp32_gemm="3xtf32"):
            raise RuntimeError("boom")
        assert bt.get_fp32_gemm() == "strict"
    assert bt.policy.current() == base


def test_use_is_reentrant_and_scope_takes_a_whole_policy():
    p = ExecutionPolicy(attention="mma", validate_indices="sync")
    cm = p.use()
    with cm:
        with cm:
            assert bt.policy.current() is p
        assert bt.policy.current() is p
    assert bt.policy.current() == ExecutionPolicy()
    with bt.policy.scope(p, validate_indices="off") as q:
        assert q.attention == "mma" and q.validate_indices == "off"


def test_setters_write_the_innermost_layer():
    """Inside a scope a setter changes that scope's policy only (undone at its exit); outside, the default."""
    with bt.policy.scope():
        bt.set_matmul_precision("bf16")
        bt.use_deterministic_algorithms(True)
        bt.set_fp32_gemm("3xtf32")
        assert (bt.get_matmul_precision(), bt.are_deterministic_algorithms_enabled(), bt.get_fp32_gemm()) == (
            "bf16", True, "3xtf32")
    assert bt.policy.current() == ExecutionPolicy()
    bt.set_float32_matmul_precision("high")
    assert bt.policy.get_default().precision == "tf32" and bt.get_float32_matmul_precision() == "high"
    bt.set_fp32_gemm("3xtf32")
    bt.set_fp32_gemm(None)  # back to the environment's value (unset: strict)
    assert bt.policy.current() == ExecutionPolicy(precision="tf32")
    bt.policy.set_default(ExecutionPolicy(embedding_backward="pieces"))
    assert bt.policy.current().embedding_backward == "pieces" and bt.get_matmul_precision() == "fp32"


def test_scopes_are_per_thread_and_the_default_is_shared():
    """A scope in one thread is invisible to another (which sees the process default); the order of events is
    forced by events so each read happens while the other thread's scope is open."""
    seen: list[tuple[str, str]] = []
    main_in, worker_in, worker_done = threading.Event(), threading.Event(), threading.Event()

    def worker():
        main_in.wait(5)
        seen.append(("worker outside", bt.get_fp32_gemm()))  # main's scope is open now
        with bt.policy.scope(fp32_gemm="3xtf32", deterministic=True):
            worker_in.set()
            worker_done.wait(5)
            seen.append(("worker inside", bt.get_fp32_gemm()))
        seen.append(("worker after", bt.policy.current().precision))

    bt.policy.set_default(ExecutionPolicy(precision="tf32"))
    t = threading.Thread(target=worker)
    t.start()
    with bt.policy.scope(precision="bf16"):
        main_in.set()
        worker_in.wait(5)
        seen.append(("main inside", bt.get_fp32_gemm()))  # the worker's scope is open now
        assert not bt.are_deterministic_algorithms_enabled() and bt.get_matmul_precision() == "bf16"
        worker_done.set()
        t.join(5)
    assert seen == [("worker outside", "strict"), ("main inside", "strict"), ("worker inside", "3xtf32"),
                    ("worker after", "tf32")]
    assert bt.get_matmul_precision() == "tf32"


# ------------------------------------------------------------------------------------------------ call sites
class _Recorder:
    """A GEMM provider recording the precision blutensor asks of it (it declares every one)."""

    PLUGIN_NAME = "policy-recorder"
    PRECISIONS = ("fp32", "tf32", "bf16", "3xtf32")
    calls: list = []

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def matmul(cls, a, b, *, trans_a=False, trans_b=False, precision="fp32", **_):
        cls.calls.append(precision)
        return (a.T if trans_a else a) @ (b.T if trans_b else b)


@pytest.fixture
def recorder_host():
    h = ext.reset_host(autoload=False)

    class Plugin:
        @ext.hookimpl
        def blutrain_register_gemm_providers(self):
            return [_Recorder]

    h.register(Plugin(), name="test-policy-gemm")
    _Recorder.calls.clear()
    try:
        yield h
    finally:
        ext.reset_host()


def test_gemm_precision_and_fp32_mode_follow_the_scope(recorder_host):
    from blutensor import gemm

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    with bt.policy.scope(gemm="policy-recorder"):
        assert gemm.get_gemm_provider() is _Recorder and ext.get_gemm_provider() is _Recorder
        for changes, prec in (({}, "fp32"), ({"fp32_gemm": "3xtf32"}, "3xtf32"), ({"precision": "tf32"}, "tf32"),
                              ({"precision": "bf16", "fp32_gemm": "3xtf32"}, "tf32"),
                              ({"fp32_gemm": "3xtf32", "max_3xtf32_k": 4}, "fp32")):  # K = 5 > 4: strict
            with bt.policy.scope(**changes):
                out = gemm.provider_matmul(gemm.get_gemm_provider(), a, b, np)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
            assert _Recorder.calls[-1] == prec, changes
    with pytest.raises(ext.PluginError, match="no gemm plugin named 'nope'"):
        bt.set_gemm_provider("nope")  # refused before the policy changes
    assert bt.policy.current().gemm == "auto"


def test_attention_variants_follow_the_scope(monkeypatch):
    from blutensor.backends.cupy import sdpa

    monkeypatch.setattr(sdpa, "_compute_capability", lambda: 90)
    monkeypatch.setattr(sdpa, "smem_optin", lambda: 227 * 1024)
    f32, u16 = np.dtype(np.float32), np.dtype(np.uint16)
    assert (sdpa.pick_variant(f32, 64), sdpa.pick_variant(u16, 64)) == ("tf32x3", "bf16_wgmma")
    with bt.policy.scope(attention="mma", attention_fp32="simt"):
        assert (sdpa.pick_variant(f32, 64), sdpa.pick_variant(u16, 64)) == ("f32", "bf16")
        with bt.policy.scope(precision="tf32"):
            assert sdpa.pick_variant(f32, 64) == "tf32_wgmma"  # attention_tf32 'auto' on sm_90
            with bt.policy.scope(attention_tf32="mma"):
                assert sdpa.pick_variant(f32, 64) == "tf32"
    assert sdpa.fused_backward("tf32x3", 64)
    with bt.policy.scope(deterministic=True):
        assert not sdpa.fused_backward("tf32x3", 64)
    with bt.policy.scope(attention_backward="fused"):
        assert sdpa.fused_backward("tf32", 64)
    assert (sdpa.pick_variant(f32, 64), sdpa.fused_backward("tf32", 64)) == ("tf32x3", False)


def test_embedding_and_index_checks_follow_the_scope():
    from blutensor.backends.cupy import embedding, index_check

    assert (embedding.backward_mode(), embedding.radix_sort(), index_check.mode()) == ("segments", False, "lazy")
    with bt.policy.scope(embedding_backward="pieces", embedding_sort="radix", validate_indices="sync"):
        assert (embedding.backward_mode(), embedding.radix_sort(), index_check.mode()) == ("pieces", True, "sync")
    assert index_check.mode() == "lazy"


def test_plugins_read_the_policy_through_ext():
    seen = []

    def observer(op, inputs, attrs, run):
        seen.append((op, ext.current_policy().deterministic, ext.current_policy().precision))
        return run()

    ext.add_op_observer(observer)
    try:
        x = bt.ones(2, 2)
        with bt.policy.scope(deterministic=True, precision="tf32"):
            (x @ x).sum()
        (x + x).sum()
    finally:
        ext.remove_op_observer(observer)
    assert seen and all(s[1:] == (True, "tf32") for s in seen if s[0] == "matmul")
    assert seen[-1][1:] == (False, "fp32")
    assert {s[0] for s in seen} >= {"matmul", "add", "sum"}


def _attention_grads_f64(q, k, v, g):
    """Causal attention's (dq, dk, dv) in float64 (NumPy), (B, H, T, HD) inputs."""
    q, k, v, g = (a.astype(np.float64) for a in (q, k, v, g))
    scale = 1.0 / np.sqrt(q.shape[-1])
    s = q @ k.swapaxes(-1, -2) * scale
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dv = p.swapaxes(-1, -2) @ g
    dp = g @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, dv


@pytest.mark.cuda
@pytest.mark.skipif(not bt.cuda.is_available(), reason="needs CuPy and a CUDA GPU")
def test_cuda_attention_backward_follows_the_scope():
    """GPU twin of test_attention_variants_follow_the_scope: on the device the scoped attention_backward picks the
    kernels that run (the launches are recorded by name) and both give float64's gradients."""
    import blutensor.nn.functional as F

    rng = np.random.default_rng(4)
    q, k, v, g = (rng.standard_normal((2, 2, 96, 64)).astype(np.float32) for _ in range(4))
    want = _attention_grads_f64(q, k, v, g)
    for mode, ran, not_ran in (("split", "backward_dkdv", "backward_fused"),
                               ("fused", "backward_fused", "backward_dkdv")):
        with bt.policy.scope(precision="fp32", attention_fp32="tf32x3", attention_backward=mode):
            ts = [bt.tensor(a, device="cuda", requires_grad=True) for a in (q, k, v)]
            with ext.recording_kernel_launches() as names:
                F.scaled_dot_product_attention(*ts, is_causal=True).backward(bt.tensor(g, device="cuda"))
        launched = " ".join(names)
        assert ran in launched and not_ran not in launched, (mode, sorted(names))
        for t, w in zip(ts, want):
            err = np.abs(t.grad.numpy().astype(np.float64) - w).max() / np.abs(w).max()
            assert err < 1e-3, (mode, err)


def test_backends_allow_tf32_is_the_policy_precision():
    """PyTorch's torch.backends.cuda.matmul.allow_tf32 and set_float32_matmul_precision are one setting, here too."""
    m = bt.backends.cuda.matmul
    assert m.allow_tf32 is False and bt.get_float32_matmul_precision() == "highest"
    with bt.policy.scope():
        m.allow_tf32 = True
        assert bt.get_matmul_precision() == "tf32" and bt.get_float32_matmul_precision() == "high"
        with bt.policy.scope(precision="bf16"):
            assert m.allow_tf32 is True  # 'medium' also allows TF32, as in PyTorch
        m.allow_tf32 = False
        assert bt.policy.current().precision == "fp32"
        m.allow_tf32 = True
    assert m.allow_tf32 is False  # the scope's change ended with it
    with pytest.raises(TypeError, match="allow_tf32 must be True or False"):
        m.allow_tf32 = 1
    with pytest.raises(AttributeError, match="no flag 'allow_fp16'"):
        m.allow_fp16 = True
