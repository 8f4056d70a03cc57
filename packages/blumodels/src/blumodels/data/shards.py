"""Token shards: a 64-byte header (magic, format version, token dtype, token count) then raw tokens.

Layout (little-endian)::

    offset 0   magic      8 bytes  b"BLUTOKS1"
    offset 8   version    u32      FORMAT_VERSION
    offset 12  dtype code u32      1 = uint16, 2 = uint32
    offset 16  count      u64      number of tokens
    offset 24  reserved   40 bytes zero
    offset 64  tokens     count * itemsize bytes

Shards are written atomically (temporary name, fsync, rename) and validated on open: magic, version,
dtype and the exact file size; every error names the file and the byte offset at fault.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import numpy as np

from blumodels.fsio import atomic_write

MAGIC = b"BLUTOKS1"
FORMAT_VERSION = 1
HEADER_BYTES = 64
DTYPE_CODES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
_CODE_OF = {np.dtype("<u2"): 1, np.dtype("<u4"): 2}
_HEADER = struct.Struct("<8sIIQ")


class ShardError(ValueError):
    """A token shard is malformed; ``path`` and ``offset`` say where."""

    def __init__(self, path: str | os.PathLike, offset: int, msg: str) -> None:
        self.path = str(path)
        self.offset = int(offset)
        self.msg = msg if "offset" in msg else f"{msg} at offset {offset}"
        super().__init__(f"shard {self.path}: {self.msg}")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits (vocab <= 65536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def pack_header(count: int, dtype: np.dtype) -> bytes:
    """The 64-byte header for ``count`` tokens of ``dtype`` (uint16 or uint32)."""
    code = _CODE_OF.get(np.dtype(dtype).newbyteorder("<"))
    if code is None:
        raise ValueError(f"token shards hold uint16 or uint32 tokens, not {np.dtype(dtype)}")
    return _HEADER.pack(MAGIC, FORMAT_VERSION, code, int(count)).ljust(HEADER_BYTES, b"\0")


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write ``tokens`` (1-D uint16/uint32) as a shard at ``path`` atomically (tmp + fsync + rename)."""
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"write_shard {path}: tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype not in (np.uint16, np.uint32):
        raise ValueError(f"write_shard {path}: tokens must be uint16 or uint32, got {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    with atomic_write(path) as f:
        f.write(pack_header(arr.size, arr.dtype))
        f.write(arr.view(np.uint8).data)


def read_header(path: str | os.PathLike) -> tuple[np.dtype, int]:
    """Validate the shard at ``path`` (magic, version, dtype, exact size); returns (dtype, count)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise ShardError(path, 0, "no such file") from None
    if size == 0:
        raise ShardError(path, 0, f"empty file (0 bytes; a shard starts with the {HEADER_BYTES}-byte header "
                                  f"{MAGIC!r}...) at offset 0")
    if len(head) < 8 or head[:8] != MAGIC:
        raise ShardError(path, 0, f"bad magic {head[:8]!r} (expected {MAGIC!r}) at offset 0")
    if len(head) < HEADER_BYTES:
        raise ShardError(path, len(head), f"truncated header: file has {size} bytes, the header needs "
                                          f"{HEADER_BYTES} (ends at offset {len(head)})")
    _, version, code, count = _HEADER.unpack_from(head)
    if version != FORMAT_VERSION:
        raise ShardError(path, 8, f"unsupported format version {version} (this reader knows "
                                  f"{FORMAT_VERSION}) at offset 8")
    dtype = DTYPE_CODES.get(code)
    if dtype is None:
        raise ShardError(path, 12, f"unknown token dtype code {code} (1=uint16, 2=uint32) at offset 12")
    want = count * dtype.itemsize
    have = size - HEADER_BYTES
    if have < want:
        raise ShardError(path, HEADER_BYTES + have,
                         f"truncated: header says {count} tokens ({want} bytes) after offset "
                         f"{HEADER_BYTES}, file has {have} bytes (ends at offset {size})")
    if have > want:
        raise ShardError(path, HEADER_BYTES + want,
                         f"{have - want} trailing bytes after the {count} tokens the header declares, "
                         f"at offset {HEADER_BYTES + want}")
    return dtype, int(count)


def open_shard(path: str | os.PathLike) -> np.memmap:
    """Validated read-only memory map of the tokens of the shard at ``path`` (1-D uint16/uint32)."""
    dtype, count = read_header(path)
    if count == 0:
        return np.zeros(0, dtype=dtype).view(np.memmap)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def check_token_range(path: str | os.PathLike, vocab_size: int, chunk: int = 1 << 24) -> None:
    """ShardError naming the file and byte offset of the first token id >= ``vocab_size`` in the shard.

    A linear scan of the memory map (chunks of ``chunk`` tokens; ~0.1 ms per million uint16 tokens when
    cached), so a bad token is found when the data is opened, not when training reaches it.
    """
    dtype, count = read_header(path)
    if vocab_size > np.iinfo(dtype).max:
        return  # no id of this dtype can reach the vocabulary size
    tokens = open_shard(path)
    for start in range(0, count, chunk):
        part = tokens[start:start + chunk]
        if int(part.max()) >= vocab_size:
            i = start + int(np.argmax(part >= vocab_size))
            raise ShardError(path, HEADER_BYTES + i * dtype.itemsize,
                             f"token id {int(tokens[i])} (token {i}) is >= the vocabulary size {vocab_size} "
                             f"at offset {HEADER_BYTES + i * dtype.itemsize} (shards made with another tokenizer "
                             f"than meta.json names?)")


def shard_name(split: str, idx: int) -> str:
    """``{split}_{idx:05d}.bin``."""
    return f"{split}_{idx:05d}.bin"


def list_shards(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """Shards ``{split}_NNNNN.bin`` in ``data_dir``, sorted by index (temporary files never match)."""
    d = Path(data_dir)
    if not d.is_dir():
        return []
    pat = re.compile(rf"^{re.escape(split)}_(\d{{5,}})\.bin$")
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := pat.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]
