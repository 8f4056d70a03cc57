"""GPT-2 trains on real text through the `blutrain` CLI and resumes bit-exactly in a new process:
per-step losses after the resume equal (==) those of an uninterrupted run, and so do the final weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("blumodels")
pytest.importorskip("tokenizers")

MICRO = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.block_size=32", "model.dropout=0.1",
         "train.seq_len=32", "train.micro_batch=4", "train.batch_tokens=256", "train.warmup_steps=2",
         "train.eval_interval=4", "train.eval_steps=2", "train.checkpoint_interval=3", "train.sample_tokens=0",
         "train.plot=false", "train.device=cpu", "train.steps=8"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from blumodels.data.prepare import prepare

    d = tmp_path_factory.mktemp("data")
    prepare(d, corpus="pydocs", tokenizer="bpe", vocab_size=384, val_fraction=0.1, max_corpus_bytes=120_000)
    return d


def blutrain(*args: str) -> None:
    p = subprocess.run([sys.executable, "-m", "blumodels.cli", *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())]


def final_weights(out: Path) -> dict[str, np.ndarray]:
    from blumodels.checkpoint.manager import CheckpointManager

    path, tensors, meta = CheckpointManager(out / "checkpoints").latest_good()
    assert meta["step"] == 8
    return {k: v for k, v in tensors.items() if k.startswith(("model.", "optim."))}


def test_resume_in_new_process_is_bit_exact(tmp_path, data):
    ref, run = tmp_path / "ref", tmp_path / "run"
    blutrain("train", "--preset", "tiny", "--out", str(ref), "--data", str(data), "--quiet", *MICRO)
    blutrain("train", "--preset", "tiny", "--out", str(run), "--data", str(data), "--quiet", *MICRO,
             "--stop-at", "5")
    # kill-like interruption: the log holds steps 0-4, the newest checkpoint is step 5
    blutrain("train", "--out", str(run), "--resume", "--quiet")
    ref_l = losses(ref)
    assert [s for s, _ in ref_l] == list(range(8))
    assert ref_l[-1][1] < ref_l[0][1]  # it learns
    assert losses(run) == ref_l
    a, b = final_weights(ref), final_weights(run)
    assert a.keys() == b.keys() and any(k.startswith("optim.exp_avg_sq.") for k in a)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
