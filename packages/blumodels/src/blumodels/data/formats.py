"""Token files of other trainers: llm.c shards (read and written) and nanoGPT's raw uint16 files (read).

llm.c (``dev/data/data_common.py``) writes a 256 x int32 header, then the tokens::

    int32[0]  magic    20240520 (GPT-2 tokens, uint16, version 1) or 20240801 (Llama 3, uint32, version 7)
    int32[1]  version  1 / 7
    int32[2]  count    number of tokens
    offset 1024        count tokens (little-endian)

nanoGPT's ``prepare.py`` writes the uint16 tokens alone (``train.bin``, ``val.bin``): no header, so such a file
cannot be told from a damaged shard by its bytes; :func:`open_raw_uint16` reads one when asked for by name.

:func:`read_header` / :func:`open_shard` / :func:`check_token_range` dispatch on the first bytes: BluTrain's own
shards go to :mod:`blumodels.data.shards`, llm.c shards are read here, so a data directory may hold either.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from blumodels.fsio import atomic_write

from . import shards
from .shards import ShardError

LLMC_HEADER_BYTES = 256 * 4
#: magic -> (version, token dtype) of the llm.c shard kinds
LLMC_KINDS: dict[int, tuple[int, np.dtype]] = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}
LLMC_MAGIC_OF = {np.dtype("<u2"): 20240520, np.dtype("<u4"): 20240801}
_LLMC_HEAD = struct.Struct("<iii")
FORMATS = ("blutrain", "llmc")  # what prepare writes


def detect_format(path: str | os.PathLike) -> str:
    """'blutrain' (BLUTOKS1 header), 'llmc' (an llm.c magic) or 'unknown' from the first bytes of ``path``."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except FileNotFoundError:
        raise ShardError(path, 0, "no such file") from None
    if head[:8] == shards.MAGIC:
        return "blutrain"
    if len(head) >= 4 and struct.unpack_from("<i", head)[0] in LLMC_KINDS:
        return "llmc"
    return "unknown"


def read_llmc_header(path: str | os.PathLike) -> tuple[np.dtype, int]:
    """Validate an llm.c shard (magic, version, exact size); returns (dtype, count)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(LLMC_HEADER_BYTES)
    if len(head) < LLMC_HEADER_BYTES:
        raise ShardError(path, len(head), f"truncated llm.c header: file has {size} bytes, the header needs "
                                          f"{LLMC_HEADER_BYTES} (ends at offset {len(head)})")
    magic, version, count = _LLMC_HEAD.unpack_from(head)
    want_version, dtype = LLMC_KINDS[magic]
    if version != want_version:
        raise ShardError(path, 4, f"llm.c magic {magic} with version {version} (expected {want_version}) at offset 4")
    if count < 0:
        raise ShardError(path, 8, f"llm.c token count {count} is negative at offset 8")
    want = LLMC_HEADER_BYTES + count * dtype.itemsize
    if size != want:
        raise ShardError(path, min(size, want), f"llm.c header says {count} tokens ({want} bytes in all), file has "
                                                f"{size} bytes (at offset {min(size, want)})")
    return dtype, int(count)


def read_header(path: str | os.PathLike) -> tuple[np.dtype, int]:
    """(dtype, count) of a BluTrain or llm.c shard, validated (ShardError naming file and offset)."""
    if detect_format(path) == "llmc":
        return read_llmc_header(path)
    return shards.read_header(path)


def open_shard(path: str | os.PathLike) -> np.ndarray | shards.ShardTokens:
    """Read-only tokens of a BluTrain or llm.c shard, never memory-mapped (see :func:`shards.open_shard`): a file
    changed under the run is a ShardError naming it, not a SIGBUS."""
    if detect_format(path) != "llmc":
        return shards.open_shard(path)
    dtype, count = read_llmc_header(path)
    return shards.read_tokens(path, LLMC_HEADER_BYTES, dtype, count)


def check_token_range(path: str | os.PathLike, vocab_size: int, chunk: int = 1 << 24) -> None:
    """ShardError naming the file and byte offset of the first token id >= ``vocab_size`` (either format)."""
    if detect_format(path) != "llmc":
        return shards.check_token_range(path, vocab_size, chunk)
    dtype, count = read_llmc_header(path)
    if vocab_size > np.iinfo(dtype).max:
        return
    tokens = open_shard(path)
    for start in range(0, count, chunk):
        part = tokens[start:start + chunk]
        if part.size and int(part.max()) >= vocab_size:
            i = start + int(np.argmax(part >= vocab_size))
            off = LLMC_HEADER_BYTES + i * dtype.itemsize
            raise ShardError(path, off, f"token id {int(tokens[i])} (token {i}) is >= the vocabulary size "
                                        f"{vocab_size} at offset {off}")


def write_llmc(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write ``tokens`` as an llm.c shard (uint16: magic 20240520 v1; uint32: 20240801 v7), atomically."""
    arr = np.asarray(tokens)
    dt = arr.dtype.newbyteorder("<")
    if arr.ndim != 1 or dt not in LLMC_MAGIC_OF:
        raise ValueError(f"write_llmc {path}: tokens must be 1-D uint16 or uint32, got {arr.dtype} {arr.shape}")
    if arr.size >= 1 << 31:
        raise ValueError(f"write_llmc {path}: llm.c counts tokens in an int32; {arr.size} tokens do not fit")
    magic = LLMC_MAGIC_OF[dt]
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, LLMC_KINDS[magic][0], arr.size)
    with atomic_write(Path(path)) as f:
        f.write(header.tobytes())
        f.write(np.ascontiguousarray(arr, dtype=dt).view(np.uint8).data)


def write_tokens(path: str | os.PathLike, tokens: np.ndarray, fmt: str = "blutrain",
                 fingerprint: bytes | None = None) -> None:
    """Write one shard in ``fmt`` ('blutrain', with its checksum and the tokenizer ``fingerprint``; or 'llmc',
    whose header has no room for them)."""
    if fmt == "llmc":
        write_llmc(path, tokens)
    elif fmt == "blutrain":
        shards.write_shard(path, tokens, fingerprint)
    else:
        raise ValueError(f"shard format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def open_raw_uint16(path: str | os.PathLike) -> np.ndarray | shards.ShardTokens:
    """nanoGPT's headerless uint16 token file, read-only and never memory-mapped (an odd byte count is refused)."""
    path = Path(path)
    size = path.stat().st_size
    if size % 2:
        raise ShardError(path, size - 1, f"a raw uint16 token file has an even size; {size} bytes leave one over "
                                         f"at offset {size - 1}")
    return shards.read_tokens(path, 0, np.dtype("<u2"), size // 2)
