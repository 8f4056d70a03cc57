"""Shared micro config and prepared micro data for blumodels' model/trainer/CLI tests."""

from __future__ import annotations

import tempfile
from pathlib import Path

from blumodels.config import from_dict

_DATA: dict[str, Path] = {}


def micro_data() -> Path:
    """A small prepared corpus (byte-level BPE, vocab 512), made once per test process."""
    if "d" not in _DATA:
        from blumodels.data.prepare import prepare

        d = Path(tempfile.mkdtemp(prefix="blumodels-micro-")) / "data"
        prepare(d, corpus="pydocs", tokenizer="bpe", vocab_size=512, val_fraction=0.1, max_corpus_bytes=150_000)
        _DATA["d"] = d
    return _DATA["d"]


def micro_config(data_dir: Path | None = None, **train):
    """A 2-layer d_model 32 GPT-2 with T=32, B=4 and 2 micro-steps per step (exercises accumulation)."""
    t = {"steps": 8, "batch_tokens": 256, "micro_batch": 4, "seq_len": 32, "lr": 3e-3, "min_lr": 3e-4,
         "warmup_steps": 2, "eval_interval": 4, "eval_steps": 2, "checkpoint_interval": 4, "device": "cpu",
         "plot": False, "seed": 7}
    t.update(train)
    return from_dict({
        "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32, "dropout": 0.0},
        "train": t,
        "data": {"dir": str(data_dir or micro_data())},
    })


def record_all_reduces(ddp, on_launch) -> None:
    """Make ``ddp`` (a dtms DistributedDataParallel) call ``on_launch()`` before each bucket all-reduce it issues
    on the host; everything else of its process group is passed through."""
    launch = ddp.pg.all_reduce

    def recording(buf, *a, **k):
        on_launch()
        return launch(buf, *a, **k)

    proxy = {"all_reduce": staticmethod(recording), "__getattr__": lambda s, name: getattr(launch.__self__, name)}
    object.__setattr__(ddp, "pg", type("PG", (), proxy)())
