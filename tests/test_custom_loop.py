"""The documented custom training loop (packages/blumodels/examples/custom_loop.py) runs, learns, and
resumes from its own checkpoint with the same losses as an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("blumodels")
pytest.importorskip("tokenizers")

SNIPPET = Path(__file__).resolve().parent.parent / "packages" / "blumodels" / "examples" / "custom_loop.py"


def run(data: Path, out: Path, steps: int) -> list[dict]:
    p = subprocess.run([sys.executable, str(SNIPPET), str(data), str(out), str(steps)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]


def test_custom_loop(tmp_path):
    from blumodels.data.prepare import prepare

    assert len(SNIPPET.read_text().splitlines()) <= 45  # "at most ~40 lines"
    data = tmp_path / "data"
    prepare(data, corpus="pydocs", tokenizer="bpe", vocab_size=384, max_corpus_bytes=120_000)
    full = run(data, tmp_path / "a", 20)
    assert [r["step"] for r in full] == list(range(20))
    assert sum(r["loss"] for r in full[-5:]) < sum(r["loss"] for r in full[:5])  # it learns
    first = run(data, tmp_path / "b", 10)  # checkpoint at step 10
    rest = run(data, tmp_path / "b", 20)  # a new process resumes at 10
    assert first + rest == full
