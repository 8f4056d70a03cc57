"""Token shards: a 64-byte header (magic, format version, token dtype, token count) then raw tokens.

Layout (little-endian)::

    offset 0   magic      8 bytes  b"BLUTOKS1"
    offset 8   version    u32      FORMAT_VERSION
    offset 12  dtype code u32      1 = uint16, 2 = uint32
    offset 16  count      u64      number of tokens
    offset 24  flags      u32      bit 0: checksum recorded, bit 1: tokenizer fingerprint recorded
    offset 28  checksum   16 bytes BLAKE2b-128 of the token bytes
    offset 44  tokenizer  16 bytes fingerprint of the tokenizer that made the tokens (tokenizer_fingerprint)
    offset 60  reserved   4 bytes zero
    offset 64  tokens     count * itemsize bytes

Shards are written atomically (temporary name, fsync, rename) and validated on open: magic, version,
dtype and the exact file size; every error names the file and the byte offset at fault. Shards written before
the checksum and fingerprint existed have zero flags and load as before; :func:`verify_shard` checks both where
recorded (the Trainer does, for every shard, at start). Shards up to 1 GiB are read into memory when opened
(and their checksum checked), so a shard truncated or rewritten under a running job is a ShardError naming it,
never a SIGBUS.
"""

from __future__ import annotations

import hashlib
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
_EXTRA = struct.Struct("<I16s16s")  # flags, checksum, tokenizer fingerprint (at offset 24)
HAS_CHECKSUM, HAS_FINGERPRINT = 1, 2
#: text every tokenizer encodes for its fingerprint: ASCII prose and code, digits, whitespace runs, non-Latin text
FINGERPRINT_PROBE = ("The quick brown fox jumps over the lazy dog. def f(x):\n    return x ** 2  # 1234567890\n"
                     "\t\t  naïve café — Größe, 東京, Москва, 🙂 </s> <|endoftext|>")


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


def pack_header(count: int, dtype: np.dtype, checksum: bytes | None = None,
                fingerprint: bytes | None = None) -> bytes:
    """The 64-byte header for ``count`` tokens of ``dtype`` (uint16 or uint32), with the tokens' checksum and
    the tokenizer fingerprint when given (16 bytes each)."""
    code = _CODE_OF.get(np.dtype(dtype).newbyteorder("<"))
    if code is None:
        raise ValueError(f"token shards hold uint16 or uint32 tokens, not {np.dtype(dtype)}")
    for what, v in (("checksum", checksum), ("fingerprint", fingerprint)):
        if v is not None and len(v) != 16:
            raise ValueError(f"shard header: {what} must be 16 bytes, got {len(v)}")
    flags = (HAS_CHECKSUM if checksum else 0) | (HAS_FINGERPRINT if fingerprint else 0)
    return (_HEADER.pack(MAGIC, FORMAT_VERSION, code, int(count)) +
            _EXTRA.pack(flags, checksum or b"", fingerprint or b"")).ljust(HEADER_BYTES, b"\0")


def token_checksum(tokens: np.ndarray | memoryview, chunk: int = 1 << 24) -> bytes:
    """BLAKE2b-128 of the token bytes (what the header records)."""
    h = hashlib.blake2b(digest_size=16)
    mv = memoryview(np.ascontiguousarray(tokens).view(np.uint8)) if isinstance(tokens, np.ndarray) else tokens
    for i in range(0, len(mv), chunk):
        h.update(mv[i:i + chunk])
    return h.digest()


def tokenizer_fingerprint(tokenizer) -> bytes:
    """16 bytes naming a tokenizer by what it does: its name, vocabulary size, end-of-text id and the ids it gives
    FINGERPRINT_PROBE. Two BPEs trained on different text differ; the same tokenizer saved twice does not."""
    ids = list(tokenizer.encode(FINGERPRINT_PROBE))
    text = f"{getattr(tokenizer, 'name', '?')}|{int(tokenizer.vocab_size)}|{int(tokenizer.eot_token)}|{ids}"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def write_shard(path: str | os.PathLike, tokens: np.ndarray, fingerprint: bytes | None = None) -> None:
    """Write ``tokens`` (1-D uint16/uint32) as a shard at ``path`` atomically (tmp + fsync + rename), with their
    checksum and, when given, the fingerprint of the tokenizer that made them."""
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"write_shard {path}: tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype not in (np.uint16, np.uint32):
        raise ValueError(f"write_shard {path}: tokens must be uint16 or uint32, got {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    with atomic_write(path) as f:
        f.write(pack_header(arr.size, arr.dtype, token_checksum(arr), fingerprint))
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


def read_recorded(path: str | os.PathLike) -> tuple[bytes | None, bytes | None]:
    """(checksum, tokenizer fingerprint) recorded in the header of the shard at ``path`` (None where not)."""
    read_header(path)
    with open(path, "rb") as f:
        f.seek(24)
        flags, checksum, fingerprint = _EXTRA.unpack(f.read(_EXTRA.size))
    return (checksum if flags & HAS_CHECKSUM else None), (fingerprint if flags & HAS_FINGERPRINT else None)


def verify_shard(path: str | os.PathLike, fingerprint: bytes | None = None) -> None:
    """ShardError naming the file unless its tokens match the recorded checksum and, when both ``fingerprint``
    and a recorded one exist, the recorded tokenizer fingerprint equals ``fingerprint``."""
    checksum, recorded = read_recorded(path)
    if fingerprint is not None and recorded is not None and recorded != fingerprint:
        raise ShardError(path, 44, f"made by another tokenizer (fingerprint {recorded.hex()} at offset 44, the data's "
                                   f"tokenizer has {fingerprint.hex()}): re-run `blutrain prepare`")
    if checksum is not None:
        dtype, count = read_header(path)
        if count * dtype.itemsize <= IN_MEMORY_MAX_BYTES:
            open_shard(path, in_memory=True)  # reads and checks the checksum
            return
        tokens = open_shard(path, in_memory=False)
        got = token_checksum(memoryview(np.asarray(tokens).view(np.uint8)))
        if got != checksum:
            raise ShardError(path, HEADER_BYTES, f"checksum mismatch: the tokens after offset {HEADER_BYTES} hash to "
                                                 f"{got.hex()}, the header at offset 28 records {checksum.hex()}")


IN_MEMORY_MAX_BYTES = 1 << 30  # shards up to this size are read into memory when opened, larger ones mapped


def open_shard(path: str | os.PathLike, in_memory: bool | None = None) -> np.memmap:
    """Validated, read-only tokens of the shard at ``path`` (1-D uint16/uint32, a ``np.memmap``).

    Shards up to IN_MEMORY_MAX_BYTES (or any, with ``in_memory=True``) are read into memory and checked against
    their recorded checksum: a shard truncated or rewritten under a running job is then a ShardError naming it when
    it is opened, never a SIGBUS in the middle of a step. Larger ones are memory-mapped (``in_memory=False``)."""
    dtype, count = read_header(path)
    if count == 0:
        return np.zeros(0, dtype=dtype).view(np.memmap)
    nbytes = count * dtype.itemsize
    if not (nbytes <= IN_MEMORY_MAX_BYTES if in_memory is None else in_memory):
        return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
    arr = np.empty(count, dtype=dtype)
    with open(path, "rb") as f:
        f.seek(24)
        flags, checksum, _ = _EXTRA.unpack(f.read(_EXTRA.size))
        f.seek(HEADER_BYTES)
        got = f.readinto(memoryview(arr).cast("B"))
    if got != nbytes:
        raise ShardError(path, HEADER_BYTES + got, f"changed while being read: {got} of the {nbytes} token bytes "
                                                   f"after offset {HEADER_BYTES} were there (truncated under the run?)")
    if flags & HAS_CHECKSUM and token_checksum(arr) != checksum:
        raise ShardError(path, HEADER_BYTES, f"checksum mismatch: the tokens after offset {HEADER_BYTES} do not hash "
                                             f"to the {checksum.hex()} its header records at offset 28 (changed "
                                             "under the run, or damaged)")
    arr.flags.writeable = False
    return arr.view(np.memmap)


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


def verify_shards(data_dir: str | os.PathLike, meta: dict, tokenizer=None) -> int:
    """Check every train/val shard of a prepared directory against its checksum and against the tokenizer
    fingerprint of meta.json (and meta.json's against ``tokenizer``'s own when given); returns the shards checked.

    Shards of another tokenizer would otherwise train silently whenever their ids fit the vocabulary."""
    d = Path(data_dir)
    fp = None
    raw = meta.get("tokenizer_fingerprint")
    if raw is not None:
        try:
            fp = bytes.fromhex(raw)
            assert len(fp) == 16
        except (TypeError, ValueError, AssertionError):
            raise ShardError(d / "meta.json", 0, f"tokenizer_fingerprint {str(raw)[:40]!r} is not 32 hex digits "
                                                 "(in meta.json)") from None
        if tokenizer is not None and tokenizer_fingerprint(tokenizer) != fp:
            raise ShardError(d / "meta.json", 0, f"the tokenizer in {d} (fingerprint "
                                                 f"{tokenizer_fingerprint(tokenizer).hex()}) is not the one the shards "
                                                 f"were made with ({raw}, in meta.json): re-run `blutrain prepare`")
    shards = list_shards(d, "train") + list_shards(d, "val")
    for p in shards:
        verify_shard(p, fp)
    return len(shards)
