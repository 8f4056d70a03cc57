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
recorded (the Trainer does, for every shard, at start).

No shard is ever memory-mapped, so a shard truncated or rewritten under a running job is a ShardError naming it,
never a SIGBUS: shards up to :func:`in_memory_max_bytes` (1 GiB; ``BLUTRAIN_SHARD_MEMORY_BYTES`` sets it) are read
into memory when opened and their checksum checked; larger ones are :class:`ShardTokens`, read window by window
with positioned reads (``os.preadv``) after an ``fstat`` that refuses a file whose size or modification time
changed since it was opened.
"""

from __future__ import annotations

import hashlib
import numbers
import os
import re
import struct
from pathlib import Path
from typing import Any

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
        tokens = open_shard(path)
        if not isinstance(tokens, ShardTokens):
            return  # read into memory: open_shard checked the checksum
        with tokens:
            got = tokens.checksum()
        if got != checksum:
            raise ShardError(path, HEADER_BYTES, f"checksum mismatch: the tokens after offset {HEADER_BYTES} hash to "
                                                 f"{got.hex()}, the header at offset 28 records {checksum.hex()}")


IN_MEMORY_MAX_BYTES = 1 << 30  # default of in_memory_max_bytes()
MEMORY_ENV = "BLUTRAIN_SHARD_MEMORY_BYTES"


def in_memory_max_bytes() -> int:
    """Shards with at most this many token bytes are read into memory when opened; larger ones are read window by
    window (:class:`ShardTokens`). ``BLUTRAIN_SHARD_MEMORY_BYTES`` (a byte count >= 0) overrides the 1 GiB default,
    e.g. to bound each rank's host memory."""
    raw = os.environ.get(MEMORY_ENV)
    if raw is None or raw.strip() == "":
        return IN_MEMORY_MAX_BYTES
    try:
        v = int(raw.strip().replace("_", ""))
        if v < 0:
            raise ValueError
    except ValueError:
        from blumodels.config import ConfigError

        raise ConfigError(f"{MEMORY_ENV}={raw[:40]!r} must be a byte count >= 0 (the largest shard read into "
                          "memory; larger ones are read window by window)") from None
    return v


class ShardTokens:
    """Read-only tokens of a shard too large to hold in memory: 1-D, indexed and sliced like an array, each read a
    positioned read (``os.preadv``) into a fresh buffer, never a memory map.

    The file's size and modification time are taken when it is opened and compared (``fstat``) before every read:
    a shard truncated, extended or rewritten in place under the run is a ShardError naming it, and a read that
    comes back short is one too. A shard replaced by rename keeps being read from the file that was opened."""

    def __init__(self, path: str | os.PathLike, offset: int, dtype: np.dtype, count: int) -> None:
        self.path, self.offset = Path(path), int(offset)
        self.dtype, self.size = np.dtype(dtype), int(count)
        self.shape, self.ndim = (self.size,), 1
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(self._fd)
        self._ident = (st.st_size, st.st_mtime_ns)
        want = self.offset + self.size * self.dtype.itemsize
        if st.st_size != want:
            self.close()
            raise ShardError(path, min(st.st_size, want), f"changed before it was opened: {st.st_size} bytes, the "
                                                          f"header declares {want} (ends at offset {st.st_size})")

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"ShardTokens({str(self.path)!r}, {self.size} x {self.dtype})"

    def _check(self) -> None:
        if self._fd < 0:
            raise ShardError(self.path, 0, "read after close at offset 0")
        st = os.fstat(self._fd)
        if (st.st_size, st.st_mtime_ns) != self._ident:
            raise ShardError(self.path, min(st.st_size, self._ident[0]),
                             f"changed under the run: {st.st_size} bytes now, {self._ident[0]} when opened"
                             + ("" if st.st_size != self._ident[0] else " (rewritten in place)")
                             + f" at offset {min(st.st_size, self._ident[0])}")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` (clipped to the shard) as a new read-only array."""
        start, stop = max(0, min(int(start), self.size)), max(0, min(int(stop), self.size))
        out = np.empty(max(0, stop - start), self.dtype)
        if out.size:
            self._check()
            mv, pos, done = memoryview(out).cast("B"), self.offset + start * self.dtype.itemsize, 0
            while done < len(mv):
                n = os.preadv(self._fd, [mv[done:]], pos + done)
                if n <= 0:
                    raise ShardError(self.path, pos + done, f"changed under the run: {done} of the {len(mv)} bytes "
                                                            f"at offset {pos} could be read (truncated?)")
                done += n
        out.flags.writeable = False
        return out

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step == 1:
                return self.read(start, stop)
            lo, hi = (start, stop) if step > 0 else (stop + 1, start + 1)
            part = self.read(lo, hi)
            return part[::step] if step > 0 else part[::-1][::-step]
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):
            i = int(key) + (self.size if key < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError(f"index {int(key)} is out of bounds for a shard of {self.size} tokens ({self.path})")
            return self.read(i, i + 1)[0]
        raise TypeError(f"ShardTokens takes an int or a slice, not {type(key).__name__}")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.read(0, self.size)
        return a if dtype is None else a.astype(dtype)

    def tolist(self) -> list:
        return self.read(0, self.size).tolist()

    def checksum(self, chunk: int = 1 << 24) -> bytes:
        """BLAKE2b-128 of the token bytes (what the header records), read in chunks of ``chunk`` tokens."""
        h = hashlib.blake2b(digest_size=16)
        for i in range(0, self.size, chunk):
            h.update(memoryview(self.read(i, i + chunk)).cast("B"))
        return h.digest()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ShardTokens:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def read_tokens(path: str | os.PathLike, offset: int, dtype: np.dtype, count: int, checksum: bytes | None = None,
                in_memory: bool | None = None) -> np.ndarray | ShardTokens:
    """``count`` tokens of ``dtype`` at byte ``offset`` of ``path``: in memory (checked against ``checksum`` when
    given) up to :func:`in_memory_max_bytes` or with ``in_memory=True``, else a :class:`ShardTokens`."""
    dtype = np.dtype(dtype)
    if count == 0:
        return np.zeros(0, dtype=dtype).view(np.memmap)
    nbytes = count * dtype.itemsize
    if not (nbytes <= in_memory_max_bytes() if in_memory is None else in_memory):
        return ShardTokens(path, offset, dtype, count)
    arr = np.empty(count, dtype=dtype)
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(memoryview(arr).cast("B"))
    if got != nbytes:
        raise ShardError(path, offset + got, f"changed while being read: {got} of the {nbytes} token bytes "
                                             f"after offset {offset} were there (truncated under the run?)")
    if checksum is not None and token_checksum(arr) != checksum:
        raise ShardError(path, offset, f"checksum mismatch: the tokens after offset {offset} do not hash "
                                       f"to the {checksum.hex()} its header records at offset 28 (changed "
                                       "under the run, or damaged)")
    arr.flags.writeable = False
    return arr.view(np.memmap)


def open_shard(path: str | os.PathLike, in_memory: bool | None = None) -> np.ndarray | ShardTokens:
    """Validated, read-only tokens of the shard at ``path`` (1-D uint16/uint32), never memory-mapped.

    Shards up to :func:`in_memory_max_bytes` (or any, with ``in_memory=True``) are read into memory and checked
    against their recorded checksum: a shard truncated or rewritten under a running job is then a ShardError naming
    it when it is opened, never a SIGBUS in the middle of a step. Larger ones (or any, with ``in_memory=False``)
    come as a :class:`ShardTokens`, whose every read checks that the file has not changed."""
    dtype, count = read_header(path)
    with open(path, "rb") as f:
        f.seek(24)
        flags, checksum, _ = _EXTRA.unpack(f.read(_EXTRA.size))
    return read_tokens(path, HEADER_BYTES, dtype, count, checksum if flags & HAS_CHECKSUM else None, in_memory)


def check_token_range(path: str | os.PathLike, vocab_size: int, chunk: int = 1 << 24) -> None:
    """ShardError naming the file and byte offset of the first token id >= ``vocab_size`` in the shard.

    A linear scan (chunks of ``chunk`` tokens; ~0.1 ms per million uint16 tokens when cached), so a bad token is
    found when the data is opened, not when training reaches it.
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
