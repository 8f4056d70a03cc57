"""train.gemm: a config key validated against the registered GEMM providers by what they declare (PRECISIONS,
CAPTURE_SAFE), resolved once at Trainer start on CUDA into the run's execution policy; BLUTRAIN_GEMM only feeds
"auto"."""

from __future__ import annotations

import blutensor as bt
import pytest
from blumodels import gemm_choice
from blumodels.config import ConfigError
from blutensor.ext import get_gemm_provider, hookimpl, reset_host
from models_helpers import micro_config


class StrictOnly:
    """A provider that declares only strict fp32 and no capture safety."""

    PLUGIN_NAME = "test-strict"
    PRECISIONS = ("fp32",)
    CAPTURE_SAFE = False

    @classmethod
    def is_available(cls) -> bool:
        return True

    @staticmethod
    def matmul(a, b, **_):
        return a @ b


class Everything(StrictOnly):
    PLUGIN_NAME = "test-all"
    PRECISIONS = ("fp32", "tf32", "bf16", "3xtf32")
    CAPTURE_SAFE = True


class Plugin:
    @hookimpl
    def blutrain_register_gemm_providers(self):
        return [StrictOnly, Everything]


@pytest.fixture
def providers():
    host = reset_host(autoload=True)
    host.register(Plugin(), name="test-gemm-pkg")
    try:
        yield host
    finally:
        bt.policy.reset_defaults()
        reset_host()


def test_default_is_auto_and_names_are_checked(providers):
    assert micro_config().train.gemm == "auto"
    micro_config(gemm="test-all").validate()
    micro_config(gemm="cupy").validate()  # the built-in xp provider
    with pytest.raises(ConfigError, match=r"train.gemm must be 'auto' or a registered GEMM provider \(.*test-strict"
                                          r".*\), got 'test-al'; did you mean 'test-all'"):
        micro_config(gemm="test-al")


@pytest.mark.parametrize("keys,needs", [
    ({"precision": "tf32"}, r"train.precision = 'tf32' needs precision 'tf32' \(it declares PRECISIONS = \('fp32',\)"),
    ({"fp32_gemm": "3xtf32"}, r"train.fp32_gemm = '3xtf32' needs precision '3xtf32'"),
    ({"cuda_graph": True, "device": "cuda"}, r"train.cuda_graph = true needs a capture-safe provider"),
])
def test_a_provider_lacking_a_declared_capability_is_refused(providers, keys, needs):
    with pytest.raises(ConfigError, match=r"train.gemm = 'test-strict' cannot serve this run: " + needs):
        micro_config(gemm="test-strict", **keys)
    micro_config(gemm="test-all", **keys)  # declares all of them


def test_applied_once_at_start_on_cuda_only(providers, monkeypatch):
    t = micro_config(gemm="test-all").train
    assert gemm_choice.apply(t, "cpu") is None  # host GEMMs use no provider
    assert gemm_choice.apply(t, "cuda:0") is Everything
    assert get_gemm_provider() is Everything
    monkeypatch.setenv("BLUTRAIN_GEMM", "test-strict")  # feeds only "auto" (read once: reset_defaults reads it)
    bt.policy.reset_defaults()
    assert gemm_choice.apply(t, "cuda") is Everything
    assert gemm_choice.apply(micro_config().train, "cuda") is StrictOnly
    with pytest.raises(ConfigError, match=r"train.gemm = 'auto' resolved to 'test-strict', which cannot serve this "
                                          r"run: train.precision = 'tf32' needs precision 'tf32'"):
        gemm_choice.apply(micro_config(precision="tf32").train, "cuda")


def test_an_unavailable_provider_names_the_key(providers, monkeypatch):
    monkeypatch.setattr(Everything, "is_available", classmethod(lambda cls: False))
    with pytest.raises(ConfigError, match=r"train.gemm = 'test-all': gemm plugin 'test-all' is installed but not "
                                          r"available here"):
        gemm_choice.apply(micro_config(gemm="test-all").train, "cuda")


def test_the_run_policy_holds_the_resolved_provider(providers, monkeypatch):
    """policy_from_config resolves train.gemm on CUDA into the policy's gemm field ("auto" through BLUTRAIN_GEMM,
    read once), keeps a named provider on CPU, and refuses a misfit by the key's name before any work."""
    from blumodels.execution import policy_from_config

    assert policy_from_config(micro_config(gemm="test-all").train, "cuda:0").gemm == "test-all"
    assert policy_from_config(micro_config(gemm="cupy").train, "cuda").gemm == "xp"  # the alias
    assert policy_from_config(micro_config(gemm="test-all").train, "cpu").gemm == "test-all"
    assert policy_from_config(micro_config().train, "cpu").gemm == "auto"
    monkeypatch.setenv("BLUTRAIN_GEMM", "test-strict")
    bt.policy.reset_defaults()
    p = policy_from_config(micro_config().train, "cuda")
    assert p.gemm == "test-strict" and bt.policy.current().gemm == "test-strict"
    with p.use():
        assert get_gemm_provider() is StrictOnly
    with pytest.raises(ConfigError, match=r"train.gemm = 'auto' resolved to 'test-strict', which cannot serve"):
        policy_from_config(micro_config(precision="tf32").train, "cuda")
