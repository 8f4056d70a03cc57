"""CPU guard of the wgmma selection rule: in the default 'auto' mode a wgmma config is used only after the
self-test passed on this device — never by the heuristic, the autotuner's candidates or a cached autotune
entry otherwise; the self-test never runs during capture; its verdict is cached per kernel-source digest;
a self-test child that dies (e.g. an illegal address) counts as a failure."""

from __future__ import annotations

import subprocess

import kernel_contract
import numpy as np
import pytest
from blublas import autotune, configs, launch, selftest, settings
from blublas.api import plan


@pytest.fixture
def fcp(monkeypatch, tmp_path):
    monkeypatch.delenv("BLUBLAS_WGMMA", raising=False)
    monkeypatch.delenv("BLUBLAS_WGMMA_PROBE", raising=False)
    return kernel_contract.install(monkeypatch, tmp_path, sm90=True)


def _problem(xp, layout="nt", precision="bf16", m=512, n=512, k=256):
    ta, tb = layout[0] == "t", layout[1] == "t"
    dt = np.uint16 if precision == "bf16" else np.float32
    a = xp.zeros((k, m) if ta else (m, k), dtype=dt)
    b = xp.zeros((n, k) if tb else (k, n), dtype=dt)
    out = xp.zeros((m, n), dtype=dt)
    return plan(
        a,
        b,
        out,
        trans_a=ta,
        trans_b=tb,
        alpha=1.0,
        beta=0.0,
        bias=None,
        epilogue="none",
        save_preact=None,
        precision=precision,
        batched=False,
    )


def _fail_probe(monkeypatch, calls):
    def probe(variant, layout, precision, cc, dev):
        calls.append((variant, layout))
        return False, "emulated failure"

    monkeypatch.setattr(selftest, "probe", probe)


@pytest.mark.parametrize("layout,precision", [("nn", "bf16"), ("nt", "bf16"), ("tn", "bf16"), ("nt", "tf32")])
def test_failed_self_test_excludes_wgmma_everywhere(fcp, monkeypatch, layout, precision):
    calls = []
    _fail_probe(monkeypatch, calls)
    p = _problem(fcp, layout, precision, m=16384, n=2304, k=768)
    st = fcp.cuda.get_current_stream()
    with pytest.warns(UserWarning, match="disabled"):
        cfg, _ = launch.select(p, st, None, None, False)  # heuristic
    assert cfg.variant not in configs.ARCH_SPECIFIC
    assert len(calls) == 1
    # the autotuner's candidates
    variants = launch.usable_variants(p, 90, st)
    cands = configs.candidates_for_precision(precision, 90, p.M, p.N, p.K, 1, layout, variants)
    assert cands and all(c.variant not in configs.ARCH_SPECIFIC for c, _ in cands)
    # a cached autotune entry naming a wgmma config (e.g. tuned earlier with BLUBLAS_WGMMA=1) is ignored
    wg = configs.configs_for("wgmma" if precision == "bf16" else "wgmma_tf32", 90)[0]
    key = autotune.problem_key(90, configs.VARIANT_OF_PRECISION[precision], layout, p.M, p.N, p.K, 1, p.out_tag)
    autotune.default_cache().put(key, {"config": wg.name, "splits": 1, "ms": 0.001})
    cfg, _ = launch.select(p, st, None, None, False)
    assert cfg.variant not in configs.ARCH_SPECIFIC
    assert len(calls) == 1  # verdict remembered: the self-test ran once


def test_passed_self_test_allows_wgmma(fcp, monkeypatch):
    monkeypatch.setattr(selftest, "probe", lambda *a: (True, ""))
    p = _problem(fcp, "nt", "bf16", m=16384, n=2304, k=768)
    cfg, _ = launch.select(p, fcp.cuda.get_current_stream(), None, None, False)
    assert cfg.variant == "wgmma"


def test_no_self_test_during_capture(fcp, monkeypatch):
    calls = []
    _fail_probe(monkeypatch, calls)
    p = _problem(fcp, "nn", "bf16", m=16384, n=2304, k=768)
    st = fcp.cuda.Stream()
    monkeypatch.setattr(type(st), "is_capturing", lambda self: True)
    cfg, _ = launch.select(p, st, None, None, False)
    assert cfg.variant == "bf16" and calls == []


def test_off_mode_never_probes_and_on_mode_forces(fcp, monkeypatch):
    calls = []
    _fail_probe(monkeypatch, calls)
    monkeypatch.setenv("BLUBLAS_WGMMA", "0")
    p = _problem(fcp, "nt", "bf16", m=16384, n=2304, k=768)
    assert launch.usable_variants(p, 90, fcp.cuda.get_current_stream()) == ["bf16"] and calls == []
    monkeypatch.setenv("BLUBLAS_WGMMA", "1")
    settings.reset()
    assert launch.usable_variants(p, 90, fcp.cuda.get_current_stream()) == ["bf16", "wgmma"] and calls == []


def test_not_sm90_never_considers_wgmma(fcp, monkeypatch):
    calls = []
    _fail_probe(monkeypatch, calls)
    p = _problem(fcp, "nt", "bf16")
    assert launch.usable_variants(p, 89, fcp.cuda.get_current_stream()) == ["bf16"] and calls == []


def test_dead_self_test_child_is_a_failure(fcp, monkeypatch):
    def run(cmd, **kw):
        assert cmd[1:3] == ["-m", "blublas.selftest"]
        return subprocess.CompletedProcess(cmd, -11, stdout="", stderr="cudaErrorIllegalAddress")

    monkeypatch.setattr(selftest.subprocess, "run", run)
    ok, why = selftest.probe("wgmma", "nn", "bf16", 90, 0)
    assert not ok and "without a verdict" in why and "IllegalAddress" in why


def test_child_verdict_is_parsed_and_cached_per_kernel_digest(fcp, monkeypatch):
    runs = []

    def run(cmd, **kw):
        runs.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='noise\nBLUBLAS_SELFTEST {"ok": true, "why": ""}\n')

    monkeypatch.setattr(selftest.subprocess, "run", run)
    assert selftest.probe("wgmma", "nt", "bf16", 90, 0) == (True, "")
    assert selftest.probe("wgmma", "nt", "bf16", 90, 0) == (True, "")
    assert len(runs) == 1  # second verdict from the disk cache
    monkeypatch.setattr(selftest, "cache_key", lambda v, lay, d: f"other-digest|{v}|{lay}")
    assert selftest.probe("wgmma", "nt", "bf16", 90, 0) == (True, "")
    assert len(runs) == 2  # a changed kernel source is tested again


def test_probe_shapes_wrap_every_pipeline_stage():
    """The H200 fault needed the last pipeline stage (k tiles >= stages): every config's self-test reaches it."""
    for v in ("wgmma", "wgmma_tf32"):
        for c in configs.ALL_CONFIGS[v].values():
            assert any(-(-k // c.bk) >= c.stages for _m, _n, k in selftest.PROBE_SHAPES), c.name


def test_hung_self_test_child_is_a_failure(fcp, monkeypatch):
    monkeypatch.setenv("BLUBLAS_SELFTEST_TIMEOUT", "5")

    def run(cmd, **kw):
        assert kw["timeout"] == 5.0
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(selftest.subprocess, "run", run)
    ok, why = selftest.probe("wgmma", "tn", "bf16", 90, 0)
    assert not ok and "TimeoutExpired" in why


def test_self_test_child_encodes_with_the_parents_tensor_map_encoder(fcp, monkeypatch):
    """The probe's child process is handed the import name of the encoder this process was given (blutensor's,
    from the plugin host), and its main() installs that module before probing."""
    import blutensor as bt
    from blublas import tma

    runs = []

    def run(cmd, **kw):
        runs.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='BLUBLAS_SELFTEST {"ok": true, "why": ""}\n')

    monkeypatch.setattr(selftest.subprocess, "run", run)
    assert selftest.probe_subprocess("wgmma", "nt", "bf16", 90, 0) == (True, "")
    assert runs[-1][-2:] == ["--tma-encoder", bt.ext.tma.__name__]
    seen = []
    monkeypatch.setattr(selftest, "probe_inproc", lambda *a: (seen.append((a, tma.encoder())), (True, ""))[1])
    monkeypatch.setattr(tma, "_encoder", None)
    monkeypatch.setattr(tma, "_searched", True)
    assert selftest.main(["wgmma", "nt", "bf16", "90", "--tma-encoder", bt.ext.tma.__name__]) == 0
    assert seen == [(("wgmma", "nt", "bf16", 90), bt.ext.tma)]
    monkeypatch.setattr(tma, "_encoder", None)
    monkeypatch.setattr(tma, "_searched", True)
    runs.clear()
    selftest.probe_subprocess("wgmma", "nt", "bf16", 90, 0)
    assert "--tma-encoder" not in runs[-1]
