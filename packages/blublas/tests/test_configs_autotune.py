"""Tile configs per architecture, the shape heuristic, and the on-disk autotune cache."""

from __future__ import annotations

import json
import re

import pytest
from blublas import autotune, configs, loader, settings
from blublas.errors import GemmError, ProviderUnavailable

MACRO = re.compile(r"^BLU_(SIMT|TF32|BF16|WGMMA|WGMMA_TF32)_CONFIG\((\w+),\s*([\d,\s]+)\)", re.M)


def _cu_configs() -> dict[str, dict[str, tuple[int, ...]]]:
    out: dict[str, dict[str, tuple[int, ...]]] = {v: {} for v in configs.FILE_OF_VARIANT}
    for variant, fname in configs.FILE_OF_VARIANT.items():
        text = (loader.KERNEL_DIR / fname).read_text()
        for m in MACRO.finditer(text):
            assert m.group(1).lower() == variant, fname
            out[variant][m.group(2)] = tuple(int(x) for x in m.group(3).replace(" ", "").split(","))
    return out


def test_python_config_table_matches_the_cu_instantiations():
    cu = _cu_configs()
    for variant, table in configs.ALL_CONFIGS.items():
        assert set(table) == set(cu[variant]), variant
        for name, cfg in table.items():
            nums = cu[variant][name]
            if variant in ("wgmma", "wgmma_tf32"):  # + ping-pong flag
                assert nums == (cfg.bm, cfg.bn, cfg.bk, cfg.stages, int("_pp_" in name))
            elif variant == "simt":
                assert nums == (cfg.bm, cfg.bn, cfg.bk, cfg.stages)
            else:
                bm, bn, bk, wm, wn, st = nums
                assert (bm, bn, bk, wm * wn * 32, st) == (cfg.bm, cfg.bn, cfg.bk, cfg.threads, cfg.stages)


def test_every_kernel_name_exists_in_its_source():
    for variant, table in configs.ALL_CONFIGS.items():
        src = (loader.KERNEL_DIR / configs.FILE_OF_VARIANT[variant]).read_text()
        for cfg in table.values():
            for lay in cfg.layouts:
                assert cfg.kernel_name(lay) == f"blu_gemm_{variant}_{cfg.name}_{lay}"
            assert f"_CONFIG({cfg.name}," in src


@pytest.mark.parametrize("cc", [80, 86, 89, 90])
def test_configs_for_each_arch_fit_its_shared_memory(cc):
    info = configs.arch_info(cc)
    for variant in configs.FILE_OF_VARIANT:
        cfgs = configs.configs_for(variant, cc)
        assert cfgs or (variant.startswith("wgmma") and cc != 90), (cc, variant)
        assert all(c.max_smem_bytes() <= info.smem_optin for c in cfgs)


def test_selection_depends_on_compute_capability():
    big = "128x256x32_w2x4_s4"
    assert big in [c.name for c in configs.configs_for("bf16", 90)]
    assert big not in [c.name for c in configs.configs_for("bf16", 86)]  # 123 KB > 99 KB on sm_86
    assert configs.arch_info(100).cc == 90  # newer chips use the closest older table
    assert configs.arch_info(87).cc == 86
    with pytest.raises(ProviderUnavailable, match="compute capability >= 8.0"):
        configs.arch_info(75)


def test_heuristic_splits_k_only_when_the_output_is_small():
    cfg, s = configs.choose("bf16", 90, 768, 768, 16384, sms=132)
    assert s > 1  # 36 output tiles cannot fill 132 SMs
    cfg, s = configs.choose("bf16", 90, 16384, 2304, 768, sms=132)
    assert s == 1
    cfg, s = configs.choose("tf32", 90, 7, 5, 3, sms=132)
    assert s == 1


def test_k_chunk_is_tile_aligned_and_has_no_empty_split():
    cfg = configs.ALL_CONFIGS["bf16"]["128x128x32_w2x2_s4"]
    chunk, s = configs.k_chunk_for(cfg, 1000, 3)
    assert chunk % 32 == 0 and (s - 1) * chunk < 1000 <= s * chunk
    assert configs.k_chunk_for(cfg, 40, 8) == (32, 2)


def test_unknown_config_name_lists_the_known_ones():
    with pytest.raises(GemmError, match="unknown bf16 tile config 'nope'; known:"):
        configs.get_config("bf16", "nope")


def test_smem_bytes_formula():
    cfg = configs.ALL_CONFIGS["bf16"]["128x128x32_w2x2_s4"]
    assert cfg.smem_bytes("nn") == 4 * 2 * (128 * 40 + 32 * 136)
    assert cfg.smem_bytes("nt") == 4 * 2 * (128 * 40 + 128 * 40)
    assert cfg.smem_bytes("tn") == 4 * 2 * (32 * 136 + 32 * 136)


def test_autotune_picks_fastest_caches_on_disk_and_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("BLUBLAS_CACHE_DIR", str(tmp_path))
    cache = autotune.default_cache()
    assert cache.path == tmp_path / "autotune.json"
    times = {"a": 3.0, "b": 1.0, "c": 2.0, "bad": None}
    calls = []

    def timer(c):
        calls.append(c)
        if times[c] is None:
            raise RuntimeError("launch failed")
        return times[c]

    key = autotune.problem_key(90, "bf16", "nt", 16384, 2304, 768, 1, "bf16")
    rec = autotune.tune(key, ["a", "b", "bad", "c"], timer, describe=lambda c: {"config": c, "splits": 1})
    assert rec == {"config": "b", "splits": 1, "ms": 1.0}
    assert calls == ["a", "b", "bad", "c"]
    on_disk = json.loads((tmp_path / "autotune.json").read_text())
    assert on_disk["entries"][key]["config"] == "b"
    # a fresh cache object (a new process) reads the file and does not time anything
    fresh = autotune.AutotuneCache(tmp_path / "autotune.json")
    calls.clear()
    rec2 = autotune.tune(key, ["a", "b"], timer, cache=fresh)
    assert rec2["config"] == "b" and calls == []


def test_autotune_cache_merges_entries_written_by_another_process(tmp_path):
    p = tmp_path / "autotune.json"
    c1, c2 = autotune.AutotuneCache(p), autotune.AutotuneCache(p)
    c1.put("k1", {"config": "x", "splits": 1})
    c2.put("k2", {"config": "y", "splits": 2})
    data = json.loads(p.read_text())["entries"]
    assert set(data) == {"k1", "k2"}


def test_corrupt_autotune_cache_names_the_file(tmp_path):
    p = tmp_path / "autotune.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match=str(p)):
        autotune.AutotuneCache(p).get("k")


def test_all_candidates_failing_is_an_error(tmp_path):
    def timer(c):
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="every candidate failed"):
        autotune.tune("k", [1, 2], timer, cache=autotune.AutotuneCache(tmp_path / "a.json"))


def test_wgmma_only_on_sm90_and_only_when_enabled(monkeypatch):
    monkeypatch.setenv("BLUBLAS_WGMMA", "0")
    assert configs.variants_for("bf16", 90) == ["bf16"]
    monkeypatch.delenv("BLUBLAS_WGMMA")
    assert configs.wgmma_mode() == "off"  # read once: unchanged until blublas.settings.reset()
    settings.reset()
    assert configs.wgmma_mode() == "auto"  # considered, used once the on-device self-test passed
    assert configs.variants_for("bf16", 90) == ["bf16", "wgmma"]
    monkeypatch.setenv("BLUBLAS_WGMMA", "1")
    settings.reset()
    assert configs.wgmma_mode() == "on"
    assert configs.variants_for("bf16", 90) == ["bf16", "wgmma"]
    assert configs.variants_for("bf16", 100) == ["bf16"]  # sm_90a code does not run on sm_100
    assert configs.variants_for("tf32", 90) == ["tf32", "wgmma_tf32"]
    assert configs.variants_for("fp32", 90) == ["simt"]
    assert configs.configs_for("wgmma", 89) == []
    cfg, s = configs.choose("bf16", 90, 16384, 2304, 768, sms=132, precision="bf16")
    assert cfg.variant == "wgmma"
    cfg, s = configs.choose("tf32", 90, 16384, 2304, 768, sms=132, precision="tf32", layout="nt")
    assert cfg.variant == "wgmma_tf32"
    cfg, s = configs.choose("tf32", 90, 16384, 2304, 768, sms=132, precision="tf32", layout="nn")
    assert cfg.variant == "wgmma_tf32"  # NN: W copied K-major first (cheap next to the GEMM)


def test_arch_specific_kernel_file_declares_its_target():
    assert loader.arch_suffix("gemm_wgmma_bf16.cu", 90) == "a"
    assert loader.arch_suffix("gemm_wgmma_bf16.cu", 89) == ""
    assert loader.arch_suffix("gemm_mma_bf16.cu", 90) == ""
    assert loader.arch_suffix("gemm_wgmma_tf32.cu", 90) == "a"
