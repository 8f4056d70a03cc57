"""A third-party plugin installed into a fresh virtual environment is found, selected and called."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "tests" / "plugins" / "blutrain-example-kernels"
BROKEN = ROOT / "tests" / "plugins" / "blutrain-broken-plugin"

CHECK = textwrap.dedent("""
    import json, os
    import blutensor as bt
    import blutrain_example_kernels as ex
    from blutensor.ext import get_host
    host = get_host()
    rec = [r for r in host.records() if r.name == "example.relu"]
    x = bt.tensor([-1.0, 2.0, -3.0, 4.0], requires_grad=True)
    y = bt.relu(x)  # not configured: the built-in runs
    before = dict(ex.CALLS)
    os.environ["BLUTRAIN_KERNELS"] = "relu=example.relu"
    bt.policy.reset_defaults()  # read once, at the first op: read it again
    y = bt.relu(x)
    y.sum().backward()
    print(json.dumps({"found": len(rec), "package": rec[0].package if rec else None,
                      "version": rec[0].version if rec else None, "before": before, "after": ex.CALLS,
                      "y": y.tolist(), "grad": x.grad.tolist()}))
""")


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    d = tmp_path_factory.mktemp("venv")
    venv.create(d, with_pip=True)
    py = d / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(ROOT / "packages" / "blutensor"), str(PLUGIN), str(BROKEN)], check=True, timeout=600)
    return py


@pytest.mark.slow
def test_plugin_found_selected_called(fresh_venv):
    out = subprocess.run([str(fresh_venv), "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["found"] == 1
    assert r["package"] == "blutrain-example-kernels" and r["version"] == "0.1.0"
    assert r["before"] == {"forward": 0, "backward": 0}  # not used until configured
    assert r["after"] == {"forward": 1, "backward": 1}
    assert r["y"] == [0.0, 2.0, 0.0, 4.0]
    assert r["grad"] == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.slow
def test_autoload_can_be_disabled_and_blocked(fresh_venv):
    code = ("from blutensor.ext import get_host; "
            "print(sorted({r.package for r in get_host().records()}))")
    for env, expect in (({"BLUTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"}, False),
                        ({"BLUTRAIN_BLOCK_PLUGINS": "example-kernels"}, False), ({}, True)):
        import os

        out = subprocess.run([str(fresh_venv), "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env})
        assert out.returncode == 0, out.stderr
        assert ("blutrain-example-kernels" in out.stdout) is expect, (env, out.stdout)


def test_plugin_dist_has_entry_point():
    text = (PLUGIN / "pyproject.toml").read_text()
    assert '[project.entry-points.blutrain]' in text
    assert sys.version_info >= (3, 11)


@pytest.mark.slow
def test_broken_plugin_is_reported_not_fatal(fresh_venv):
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import blutensor as bt\nfrom blutensor.ext import get_host\n"
            "h = get_host(); print(h.broken); print(bt.relu(bt.tensor([-1.0, 1.0])).tolist())")
    out = subprocess.run([str(fresh_venv), "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "('broken', 'blutrain-broken-plugin', 'ImportError: this plugin needs a library" in out.stdout
    assert "[0.0, 1.0]" in out.stdout
    assert "blutrain plugin 'broken' from package blutrain-broken-plugin failed to load" in out.stderr
