"""Token shards: round trip, atomic write, and errors that name the file and the offset."""

import struct

import numpy as np
import pytest
from blumodels.data.shards import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    ShardError,
    list_shards,
    open_shard,
    token_dtype,
    write_shard,
)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, np.iinfo(dtype).max, size=12345, dtype=np.int64).astype(dtype)
    p = tmp_path / "train_00000.bin"
    write_shard(p, toks)
    assert p.stat().st_size == HEADER_BYTES + toks.nbytes
    raw = p.read_bytes()
    assert raw[:8] == MAGIC
    assert struct.unpack_from("<IIQ", raw, 8) == (FORMAT_VERSION, 1 if dtype == np.uint16 else 2, toks.size)
    m = open_shard(p)
    assert isinstance(m, np.memmap) and m.dtype == dtype
    np.testing.assert_array_equal(m, toks)
    assert not m.flags.writeable
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]  # no temp file left


def test_token_dtype():
    assert token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_write_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="uint16 or uint32"):
        write_shard(tmp_path / "a.bin", np.arange(5, dtype=np.int64))
    with pytest.raises(ValueError, match="1-D"):
        write_shard(tmp_path / "a.bin", np.zeros((2, 2), np.uint16))


def _good(tmp_path, n=1000):
    p = tmp_path / "train_00000.bin"
    write_shard(p, np.arange(n, dtype=np.uint16))
    return p


def test_bad_magic(tmp_path):
    p = _good(tmp_path)
    b = bytearray(p.read_bytes())
    b[:8] = b"XXXXXXXX"
    p.write_bytes(bytes(b))
    with pytest.raises(ShardError) as e:
        open_shard(p)
    msg = str(e.value)
    assert str(p) in msg and "bad magic b'XXXXXXXX'" in msg and "offset 0" in msg
    assert e.value.offset == 0 and isinstance(e.value, ValueError)


def test_bad_version(tmp_path):
    p = _good(tmp_path)
    b = bytearray(p.read_bytes())
    struct.pack_into("<I", b, 8, 7)
    p.write_bytes(bytes(b))
    with pytest.raises(ShardError, match=r"version 7.*offset 8") as e:
        open_shard(p)
    assert str(p) in str(e.value)


def test_bad_dtype_code(tmp_path):
    p = _good(tmp_path)
    b = bytearray(p.read_bytes())
    struct.pack_into("<I", b, 12, 9)
    p.write_bytes(bytes(b))
    with pytest.raises(ShardError, match=r"dtype code 9.*offset 12"):
        open_shard(p)


def test_truncated(tmp_path):
    p = _good(tmp_path)
    with open(p, "r+b") as f:
        f.truncate(HEADER_BYTES + 1500)
    with pytest.raises(ShardError) as e:
        open_shard(p)
    msg = str(e.value)
    assert str(p) in msg
    assert "truncated: header says 1000 tokens (2000 bytes) after offset 64, file has 1500 bytes" in msg
    assert e.value.offset == HEADER_BYTES + 1500


def test_truncated_header_and_trailing(tmp_path):
    p = _good(tmp_path)
    p.write_bytes(p.read_bytes()[:30])
    with pytest.raises(ShardError, match="truncated header.*offset 30"):
        open_shard(p)
    p = _good(tmp_path)
    p.write_bytes(p.read_bytes() + b"\0\0\0")
    with pytest.raises(ShardError, match="3 trailing bytes.*offset 2064"):
        open_shard(p)


def test_list_shards_sorted_ignores_others(tmp_path):
    for i in (2, 0, 10, 1):
        write_shard(tmp_path / f"train_{i:05d}.bin", np.zeros(3, np.uint16))
    write_shard(tmp_path / "val_00000.bin", np.zeros(3, np.uint16))
    (tmp_path / ".train_00003.bin.tmp-1-abc").write_bytes(b"junk")
    (tmp_path / "train_00004.bin.partial").write_bytes(b"junk")
    names = [p.name for p in list_shards(tmp_path, "train")]
    assert names == ["train_00000.bin", "train_00001.bin", "train_00002.bin", "train_00010.bin"]
    assert [p.name for p in list_shards(tmp_path, "val")] == ["val_00000.bin"]
    assert list_shards(tmp_path / "missing", "train") == []
