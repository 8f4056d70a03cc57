"""Ops are served through the plugin host: a plugin kernel class registered on a fresh PluginHost
replaces a built-in op; BLUTRAIN_DISABLE_PLUGIN_AUTOLOAD, blocking by name, duplicate refusal,
explicit selection (use_kernel / BLUTRAIN_KERNELS)."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blutensor.ops import dispatch
from blutensor.plugin import PluginError, PluginHost, get_host, hookimpl, reset_host
from conftest import host

CALLS = {"forward": 0, "backward": 0}


class FastExp:
    """A float32 CPU exp kernel (here: NumPy's exp plus a call counter)."""

    PLUGIN_NAME = "testplug.exp"
    OP = "exp"
    BACKEND = "cpu"
    DTYPES = ("float32",)
    PRIORITY = 10
    SAVES_OUTPUT = True

    @staticmethod
    def forward(ctx, a):
        CALLS["forward"] += 1
        out = np.exp(a)
        ctx.saved = out
        return out

    @staticmethod
    def backward(ctx, g):
        CALLS["backward"] += 1
        return (g * ctx.saved,)


class MinimalTanh:
    """A plugin kernel that carries only the required attributes (flags come from the built-in)."""

    PLUGIN_NAME = "testplug.tanh"
    OP = "tanh"
    BACKEND = "cpu"
    DTYPES = ("*",)

    @staticmethod
    def forward(ctx, a):
        out = np.tanh(a) + 0  # distinguishable from the built-in only through the selection
        ctx.saved = out
        return out

    @staticmethod
    def backward(ctx, g):
        return (g * (1 - ctx.saved ** 2),)


class Plugin:
    @hookimpl
    def blutrain_register_kernels(self):
        return [FastExp, MinimalTanh]


@pytest.fixture
def fresh(monkeypatch):
    """A fresh host with autoload off; the default host is restored afterwards."""
    monkeypatch.delenv("BLUTRAIN_KERNELS", raising=False)
    CALLS.update(forward=0, backward=0)
    h = reset_host(autoload=False)
    yield h
    dispatch.use_kernel("exp", None)
    dispatch.use_kernel("tanh", None)
    reset_host()


def test_plugin_kernel_replaces_builtin(fresh):
    x = bt.tensor([0.5, -1.0], requires_grad=True)
    x.exp()
    assert CALLS["forward"] == 0  # not registered yet
    fresh.register(Plugin(), name="testplug", package="testplug", version="1.0")
    rec = [r for r in fresh.records() if r.name == "testplug.exp"][0]
    assert (rec.kind, rec.package, rec.version) == ("kernel", "testplug", "1.0")
    y = x.exp()  # PRIORITY 10 beats the built-in for cpu/float32
    y.sum().backward()
    assert CALLS == {"forward": 1, "backward": 1}
    np.testing.assert_allclose(host(x.grad), np.exp([0.5, -1.0]), rtol=1e-6)
    bt.tensor([1.0], dtype=bt.float64).exp()  # float64 is not served by the plugin
    assert CALLS["forward"] == 1


def test_explicit_selection_overrides_priority(fresh, monkeypatch):
    fresh.register(Plugin(), name="testplug")
    x = bt.tensor([0.5])
    dispatch.use_kernel("exp", "blutensor.exp")
    x.exp()
    assert CALLS["forward"] == 0
    dispatch.use_kernel("exp", None)
    x.exp()
    assert CALLS["forward"] == 1  # back to automatic: the plugin's PRIORITY wins
    monkeypatch.setenv("BLUTRAIN_KERNELS", "exp=blutensor.exp")
    dispatch.clear_cache()
    x.exp()
    assert CALLS["forward"] == 2  # read once, at the first op: a later change is not seen ...
    bt.policy.reset_defaults()  # ... until the defaults are read again
    x.exp()
    assert CALLS["forward"] == 2
    dispatch.use_kernel("exp", "testplug.exp")  # use_kernel wins over the variable
    x.exp()
    assert CALLS["forward"] == 3
    dispatch.use_kernel("exp", None)
    monkeypatch.setenv("BLUTRAIN_KERNELS", "exp=nope.exp")
    bt.policy.reset_defaults()
    with pytest.raises(bt.BluTensorError, match=r"kernel 'nope.exp' configured for op 'exp' does not exist"):
        x.exp()


def test_minimal_plugin_class_gets_builtin_flags(fresh):
    fresh.register(Plugin(), name="testplug")
    dispatch.use_kernel("tanh", "testplug.tanh")
    x = bt.tensor([0.3, -0.2], requires_grad=True)
    y = x.tanh()
    y.sum().backward()
    np.testing.assert_allclose(host(x.grad), 1 - np.tanh([0.3, -0.2]) ** 2, rtol=1e-6)


def test_disable_autoload_env(monkeypatch):
    monkeypatch.setenv("BLUTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    h = PluginHost()
    assert not h.autoload
    pkgs = {r.package for r in h.records()}
    assert pkgs == {"blutensor"}, pkgs  # only the host's own pieces
    assert "blutensor.exp" in h.registry("kernel")
    monkeypatch.delenv("BLUTRAIN_DISABLE_PLUGIN_AUTOLOAD")
    assert PluginHost().autoload


def test_blocking_by_name(monkeypatch):
    monkeypatch.setenv("BLUTRAIN_BLOCK_PLUGINS", "testplug,blutensor")
    h = PluginHost(autoload=False)
    h.register(Plugin(), name="testplug")
    assert "testplug.exp" not in h.registry("kernel")
    assert "blutensor.exp" in h.registry("kernel")  # the host itself cannot be blocked
    h2 = PluginHost(autoload=False, blocked=())
    h2.register(Plugin(), name="testplug")
    assert "testplug.exp" in h2.registry("kernel")


def test_duplicate_refused():
    class Other(FastExp):
        pass

    class Dup:
        @hookimpl
        def blutrain_register_kernels(self):
            return [Other]

    h = PluginHost(autoload=False)
    h.register(Plugin(), name="testplug")
    with pytest.raises(PluginError, match=r"duplicate kernel plugin 'testplug.exp'"):
        h.register(Dup(), name="dup")


def test_builtin_ops_are_registered_like_plugins():
    reg = get_host().registry("kernel")
    for op in ("add", "matmul", "softmax", "cross_entropy", "sdpa", "dropout", "embedding", "layer_norm"):
        rec = [r for r in reg if r.name == f"blutensor.{op}"]
        assert rec and rec[0].package == "blutensor"
