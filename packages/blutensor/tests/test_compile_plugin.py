"""bt.compile picks its compiler through the plugin host: by name, by BLUTRAIN_COMPILER, or the default;
options reach the plugin; bad names, options and functions are refused with the culprit named."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blutensor.plugin import PluginError, hookimpl, reset_host
from conftest import host

SEEN: list = []


class Doubling:
    """A compiler backend that 'compiles' fn into a function returning twice fn's result."""

    PLUGIN_NAME = "testcomp.double"

    @staticmethod
    def compile(fn, scale: float = 2.0):
        SEEN.append(("double", scale))
        return lambda *a: fn(*a) * scale


class Identity:
    PLUGIN_NAME = "testcomp.identity"

    @staticmethod
    def compile(fn):
        SEEN.append(("identity",))
        return fn


class Plugin:
    @hookimpl
    def blutrain_register_compiler_backends(self):
        return [Doubling, Identity]


@pytest.fixture
def fresh(monkeypatch):
    """A fresh host with autoload off (no blucompiler), the test compilers registered; restored afterwards."""
    monkeypatch.delenv("BLUTRAIN_COMPILER", raising=False)
    SEEN.clear()
    h = reset_host(autoload=False)
    yield h
    reset_host()


def step(x):
    return (x * x).sum()


def test_no_compiler_installed_names_the_fix(fresh):
    with pytest.raises(PluginError, match="no compiler plugin is installed.*blucompiler"):
        bt.compile(step)


def test_backend_by_name_and_options(fresh):
    fresh.register(Plugin(), name="testcomp")
    assert {"testcomp.double", "testcomp.identity"} <= set(bt.compiler_backends())
    x = bt.tensor([1.0, 2.0, 3.0])
    f = bt.compile(step, backend="testcomp.double", options={"scale": 3.0})
    np.testing.assert_allclose(host(f(x)), 3.0 * 14.0)
    assert SEEN == [("double", 3.0)]


def test_env_selects_and_decorator_form(fresh, monkeypatch):
    fresh.register(Plugin(), name="testcomp")
    monkeypatch.setenv("BLUTRAIN_COMPILER", "testcomp.identity")

    @bt.compile
    def f(x):
        return step(x)

    np.testing.assert_allclose(host(f(bt.tensor([2.0]))), 4.0)
    g = bt.compile(backend="testcomp.double")(step)  # the argument wins over the environment
    np.testing.assert_allclose(host(g(bt.tensor([2.0]))), 8.0)
    assert SEEN == [("identity",), ("double", 2.0)]


def test_bad_input_names_the_culprit(fresh):
    fresh.register(Plugin(), name="testcomp")
    with pytest.raises(PluginError, match=r"no compiler plugin named 'nope'; available: .*testcomp.double"):
        bt.compile(step, backend="nope")
    with pytest.raises(TypeError, match=r"rejected options \['bogus'\]"):
        bt.compile(step, backend="testcomp.identity", options={"bogus": 1})
    with pytest.raises(TypeError, match="options must be a dict"):
        bt.compile(step, backend="testcomp.identity", options=[("scale", 2)])
    with pytest.raises(TypeError, match="expected a function to compile, got int"):
        bt.compile(3, backend="testcomp.identity")
    with pytest.raises(TypeError, match="backend must be a plugin name"):
        bt.compile(step, backend=Identity)


def test_compiler_is_a_policy_field_read_once_and_scoped(fresh, monkeypatch):
    """BLUTRAIN_COMPILER feeds the policy's ``compiler`` (read once: a later change needs reset_defaults); a scope
    chooses the compiler of bt.compile for a region; an unknown name is refused naming it."""
    fresh.register(Plugin(), name="testcomp")
    monkeypatch.setenv("BLUTRAIN_COMPILER", "testcomp.double")
    bt.policy.reset_defaults()
    x = bt.tensor([2.0])
    np.testing.assert_allclose(host(bt.compile(step)(x)), 8.0)
    monkeypatch.setenv("BLUTRAIN_COMPILER", "testcomp.identity")  # not read again ...
    np.testing.assert_allclose(host(bt.compile(step)(x)), 8.0)
    with bt.policy.scope(compiler="testcomp.identity"):  # ... but a scope chooses for its region
        np.testing.assert_allclose(host(bt.compile(step)(x)), 4.0)
    bt.policy.reset_defaults()
    assert bt.policy.current().compiler == "testcomp.identity"
    np.testing.assert_allclose(host(bt.compile(step)(x)), 4.0)
    with bt.policy.scope(compiler="nope"), pytest.raises(PluginError, match=r"no compiler plugin named 'nope'"):
        bt.compile(step)
