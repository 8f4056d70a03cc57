"""The sm_90 SIMT (fp32) choice: the register-staged 128x128x8_s2 config with the split-K counts the H200
run measured best (benchmarks/blublas/bench_gemm_configs.py), through the heuristic the library uses when not
autotuning."""

from __future__ import annotations

import pytest
from blublas import configs

GPT2 = [  # (name, layout, M, N, K, splits the heuristic must pick)
    ("fwd_qkv", "nt", 16384, 2304, 768, {1}),
    ("fwd_attn_proj", "nt", 16384, 768, 768, {1}),
    ("fwd_lm_head", "nt", 16384, 50304, 768, {1}),
    ("dx_fc", "nn", 16384, 768, 3072, {1}),
    ("dx_lm_head", "nn", 16384, 768, 50304, {1, 2}),
    ("dw_qkv", "tn", 2304, 768, 16384, {7, 12}),  # measured 1.275 / 1.280 ms (the best two)
    ("dw_attn_proj", "tn", 768, 768, 16384, {7}),  # 0.451 ms; 6: 0.489, 8: > 0.5
    ("dw_fc", "tn", 3072, 768, 16384, {9, 11}),  # 1.657 / 1.661 ms; 8: 1.841
    ("dw_fc_proj", "tn", 768, 3072, 16384, {9, 11}),
    ("dw_lm_head", "tn", 50304, 768, 16384, {1}),
]


@pytest.mark.parametrize("name,layout,m,n,k,want", GPT2, ids=[g[0] for g in GPT2])
def test_sm90_heuristic_picks_the_register_staged_config_and_the_measured_split(name, layout, m, n, k, want):
    cfg, s = configs.choose("simt", 90, m, n, k, sms=132, layout=layout, precision="fp32")
    assert cfg.name == "128x128x8_s2" and cfg.stages == 2
    assert s in want, (name, s)


def test_autotuner_candidates_include_the_wave_filling_splits():
    splits = {s for c, s in configs.candidates("simt", 90, 768, 768, 16384, 1, "tn")}
    assert {1, 7, 11, 14} <= splits
    # other variants keep the shared list
    assert {s for c, s in configs.candidates("tf32", 90, 768, 768, 16384, 1, "tn")} <= set(configs.SPLIT_CHOICES)


def test_register_staged_config_is_an_autotune_candidate_but_not_the_default_elsewhere():
    for cc in (80, 86, 89):
        names = [c.name for c in configs.configs_for("simt", cc)]
        assert names[-1] == "128x128x8_s2" and names[0] == "128x128x8_s4"
        cfg, _ = configs.choose("simt", cc, 4096, 4096, 1024, layout="nn", precision="fp32")
        assert cfg.name != "128x128x8_s2"  # unmeasured there: the tie goes to the earlier config
