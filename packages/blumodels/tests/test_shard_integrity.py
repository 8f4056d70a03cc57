"""Token shards carry a checksum of their tokens and the fingerprint of the tokenizer that made them; the Trainer
checks both for every shard at start (a flipped byte, or shards of another tokenizer, are named errors)."""

import json
import shutil

import numpy as np
import pytest
from blumodels.data.shards import (
    HEADER_BYTES,
    ShardError,
    list_shards,
    open_shard,
    read_recorded,
    tokenizer_fingerprint,
    verify_shard,
    verify_shards,
    write_shard,
)
from blumodels.data.tokenizer import load_tokenizer
from blumodels.trainer import Trainer
from models_helpers import micro_config, micro_data


def _copy(tmp_path):
    d = tmp_path / "data"
    shutil.copytree(micro_data(), d)
    return d


def test_checksum_recorded_and_checked(tmp_path):
    p = tmp_path / "s.bin"
    toks = np.arange(1000, dtype=np.uint16)
    write_shard(p, toks, b"f" * 16)
    checksum, fp = read_recorded(p)
    assert fp == b"f" * 16 and len(checksum) == 16
    verify_shard(p, b"f" * 16)
    raw = bytearray(p.read_bytes())
    raw[HEADER_BYTES + 501] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"s\.bin: checksum mismatch"):
        verify_shard(p)
    with pytest.raises(ShardError, match="made by another tokenizer"):
        verify_shard(p, b"g" * 16)


def test_shard_without_checksum_loads_as_before(tmp_path):
    p = tmp_path / "old.bin"
    write_shard(p, np.arange(10, dtype=np.uint16))
    raw = bytearray(p.read_bytes())
    raw[24:64] = bytes(40)  # what the earlier writer left: reserved zeros
    p.write_bytes(bytes(raw))
    assert read_recorded(p) == (None, None)
    verify_shard(p, b"f" * 16)
    assert open_shard(p).tolist() == list(range(10))


def test_prepared_data_records_the_tokenizer(tmp_path):
    d = micro_data()
    meta = json.loads((d / "meta.json").read_text())
    fp = tokenizer_fingerprint(load_tokenizer(d))
    assert meta["tokenizer_fingerprint"] == fp.hex()
    assert all(read_recorded(p)[1] == fp for p in list_shards(d, "train") + list_shards(d, "val"))
    assert verify_shards(d, meta, load_tokenizer(d)) == len(list_shards(d, "train")) + len(list_shards(d, "val"))


def test_trainer_refuses_a_shard_of_another_tokenizer(tmp_path):
    d = _copy(tmp_path)
    p = list_shards(d, "train")[0]
    write_shard(p, np.asarray(open_shard(p)).copy(), b"\x01" * 16)  # same ids, another tokenizer's shard
    with pytest.raises(ShardError, match=r"train_00000\.bin: made by another tokenizer"):
        Trainer(micro_config(d), tmp_path / "run", quiet=True)


def test_trainer_refuses_a_damaged_shard(tmp_path):
    d = _copy(tmp_path)
    p = list_shards(d, "val")[0]
    raw = bytearray(p.read_bytes())
    raw[HEADER_BYTES + 10] ^= 0x01  # still a valid token id: only the checksum can tell
    p.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"val_00000\.bin: checksum mismatch"):
        Trainer(micro_config(d), tmp_path / "run", quiet=True)


def test_tokenizer_of_another_run_is_named(tmp_path):
    d = _copy(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    meta["tokenizer_fingerprint"] = "00" * 16
    with pytest.raises(ShardError, match="is not the one the shards were made with"):
        verify_shards(d, meta, load_tokenizer(d))


_UNDER_A_RUN = """
import sys
from pathlib import Path
import numpy as np
from blumodels.data.loader import TokenLoader
from blumodels.data.shards import ShardError, write_shard
d = Path(sys.argv[1])
for i in range(2):
    write_shard(d / f"train_0000{i}.bin", (np.arange(4096) % 500).astype(np.uint16))
ld = TokenLoader(d, "train", 4, 32, vocab_size=512)
ld.next_batch()
with open(d / "train_00000.bin", "r+b") as f:  # the shard being read is cut short under the run
    f.truncate(100)
for _ in range(20):
    ld.next_batch()  # the loader's copy is whole: no SIGBUS
try:  # back at the cut shard: named when it is opened again
    for _ in range(50):
        ld.next_batch()
except ShardError as e:
    print("ERR", e)
"""


def test_shard_changed_under_a_run_is_an_error_not_a_signal(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _UNDER_A_RUN, str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]  # -7 (SIGBUS) with a memory map
    assert "train_00000.bin" in p.stdout and "ERR" in p.stdout, p.stdout
