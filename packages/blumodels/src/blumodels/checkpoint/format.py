"""One checkpoint file: safetensors layout, self-describing metadata, SHA-256s, atomic durable write.

File = u64 little-endian header length N, N bytes of JSON header (space padded to 8 bytes), payload.
The header maps each tensor name to ``{"dtype", "shape", "data_offsets"}`` (standard safetensors, so
any safetensors reader opens it) and ``__metadata__`` holds strings:

- ``format`` = "blutrain-checkpoint", ``format_version`` = "2"
- ``meta``: the caller's JSON metadata (step, config, RNG states, data position, ...)
- ``chunk_bytes`` and ``chunk_sha256``: the payload is cut into ``chunk_bytes`` chunks (the last one shorter) and
  ``chunk_sha256`` is the concatenation of their SHA-256 hex digests (64 characters each), so that writing and
  verifying hash on several cores (:mod:`.chunkio`); ``meta_sha256``: SHA-256 of meta + the tensor index
- ``payload_bytes``: payload length

Version 1 files (one ``sha256`` of the whole payload instead of the chunk digests) are still read and verified.
bfloat16 (ml_dtypes) arrays are stored with safetensors' BF16 dtype, byte for byte. Tensors are laid
out by decreasing item size so every one is aligned. Never pickle.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from blumodels.fsio import atomic_write

from . import chunkio
from .chunkio import CHUNK_BYTES, io_threads

FORMAT_NAME = "blutrain-checkpoint"
FORMAT_VERSION = 2
#: format versions this reader verifies (1: one SHA-256 of the whole payload)
READ_VERSIONS = (1, 2)
MAX_HEADER_BYTES = 100 << 20
MAX_HEADER_DEPTH = 4  # {header: {tensor: {"shape": [..]}}}: anything deeper is not a safetensors header
MAX_TENSOR_ELEMENTS = 1 << 50  # no real shape comes near it; a larger product is an overflow attack
_CHUNK = 64 << 20

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_ST_NAME = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file failed verification; ``path`` and ``reason`` say which and why."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"checkpoint {self.path}: {reason}")


class CheckpointSaveError(CheckpointError, OSError):
    """Writing a checkpoint failed (disk full, read-only, file too big, ...): names the path, the OS error and
    what was kept. Nothing of the failed save is left behind; earlier committed checkpoints are untouched."""

    def __init__(self, path: str | os.PathLike, reason: str, errno_: int | None = None) -> None:
        CheckpointError.__init__(self, path, reason)
        self.errno = errno_


def st_dtype_name(dtype: Any) -> str:
    """safetensors dtype name ("F32", "BF16", ...) of a NumPy dtype; ValueError if it has none."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    name = _ST_NAME.get(dt)
    if name is None:
        raise ValueError(f"checkpoint: dtype {dt} has no safetensors equivalent")
    return name


def _bytes_view(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


def _index_and_arrays(tensors: dict[str, np.ndarray]) -> tuple[dict, list[np.ndarray], int]:
    items = []
    for name, a in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"checkpoint: bad tensor name {name!r}")
        if not isinstance(a, np.ndarray):
            raise TypeError(f"checkpoint: tensor {name!r} must be a NumPy array, got {type(a).__name__} "
                            "(copy device arrays to the host first, or use CheckpointManager)")
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if dt != a.dtype:
            a = a.astype(dt)
        items.append((name, a if a.flags.c_contiguous else a.copy(order="C")))
    items.sort(key=lambda t: (-t[1].dtype.itemsize, t[0]))
    index, arrays, off = {}, [], 0
    for name, a in items:
        index[name] = {"dtype": st_dtype_name(a.dtype), "shape": list(a.shape),
                       "data_offsets": [off, off + a.nbytes]}
        arrays.append(a)
        off += a.nbytes
    return index, arrays, off


def _meta_digest(meta_json: str, index: dict) -> str:
    return hashlib.sha256(meta_json.encode() + b"\0" + json.dumps(index, sort_keys=True).encode()).hexdigest()


def _header_bytes(index: dict, metadata: dict) -> bytes:
    head = json.dumps({"__metadata__": metadata, **index}, separators=(",", ":")).encode()
    return head + b" " * (-(len(head) + 8) % 8)


def save_checkpoint(path: str | os.PathLike, tensors: dict[str, np.ndarray], meta: dict, *,
                    threads: int | None = None) -> None:
    """Write ``tensors`` + JSON ``meta`` to ``path``: temp name, fsync, atomic rename, directory fsync.

    The payload is written in file order straight from the arrays' memory (no copy of a C-contiguous array)
    with positioned writes while ``threads - 1`` other threads hash its ``CHUNK_BYTES`` chunks (default
    :func:`~.chunkio.io_threads`: the usable cores, at most 8).
    """
    path = Path(path)
    threads = io_threads(threads)
    index, arrays, payload = _index_and_arrays(tensors)
    meta_json = json.dumps(meta, sort_keys=True, allow_nan=True)
    chunk = CHUNK_BYTES
    count = chunkio.n_chunks(payload, chunk)
    metadata = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "meta": meta_json,
                "meta_sha256": _meta_digest(meta_json, index), "payload_bytes": str(payload),
                "chunk_bytes": str(chunk), "chunk_sha256": "0" * (64 * count)}
    head = _header_bytes(index, metadata)  # placeholder digests, the same length as the real ones
    with atomic_write(path) as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.flush()
        fd = f.fileno()
        digests = chunkio.write_chunks(fd, 8 + len(head), (_bytes_view(a) for a in arrays), payload, threads,
                                         chunk)
        metadata["chunk_sha256"] = "".join(digests)
        final = _header_bytes(index, metadata)
        assert len(final) == len(head)
        chunkio.pwrite_all(fd, [memoryview(final)], 8)


def _read_header(path: Path, f, size: int) -> tuple[int, dict, dict]:
    """(payload offset, tensor index, metadata) after checking the safetensors framing and our fields."""
    if size < 8:
        raise CheckpointError(path, f"not a safetensors file: {size} bytes, too short for the 8-byte header "
                                    "length at offset 0")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(path, f"not a safetensors file: header length {n} at offset 0 is implausible")
    if 8 + n > size:
        raise CheckpointError(path, f"truncated: header claims {n} bytes at offset 8, file has {size - 8}")
    try:
        header = json.loads(f.read(n))
        assert isinstance(header, dict)
    except (ValueError, AssertionError, UnicodeDecodeError):
        raise CheckpointError(path, "not a safetensors file: header at offset 8 is not a JSON object") \
            from None
    except RecursionError:  # a header nested thousands deep: refused, never a crash
        raise CheckpointError(path, f"not a safetensors file: header at offset 8 nests deeper than "
                                    f"{MAX_HEADER_DEPTH} levels") from None
    if _depth(header) > MAX_HEADER_DEPTH:
        raise CheckpointError(path, f"not a safetensors file: header at offset 8 nests deeper than "
                                    f"{MAX_HEADER_DEPTH} levels")
    md = header.pop("__metadata__", None) or {}
    if not isinstance(md, dict) or not all(isinstance(v, str) for v in md.values()):
        raise CheckpointError(path, "not a safetensors file: __metadata__ at offset 8 is not a map of strings")
    if md.get("format") != FORMAT_NAME or "format_version" not in md:
        raise CheckpointError(path, "not a BluTrain checkpoint: metadata has no format/format_version")
    if md["format_version"] not in [str(v) for v in READ_VERSIONS]:
        raise CheckpointError(path, f"unsupported format_version {md['format_version']} (this reader "
                                    f"knows {', '.join(map(str, READ_VERSIONS))})")
    return 8 + n, header, md


def _depth(obj: Any, limit: int = MAX_HEADER_DEPTH + 1) -> int:
    """Nesting depth of a parsed JSON value, counted up to ``limit`` (iterative: a deep value costs no recursion)."""
    depth, level = 0, [obj]
    while depth < limit:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            break
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_index(path: str | os.PathLike, index: dict, payload: int) -> list[tuple[str, np.dtype, tuple, int]]:
    """Validate a tensor index as strictly as the ``safetensors`` reader: every entry holds exactly dtype, shape
    and data_offsets; a known dtype; a shape of non-negative integers whose byte size fits; offsets that tile
    ``[0, payload)`` with no gap and no overlap. Returns (name, dtype, shape, start offset) per tensor."""
    out, spans = [], []
    for name, spec in index.items():
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(path, f"bad index entry for tensor {name!r}: {str(spec)[:200]} (needs exactly "
                                        "dtype, shape, data_offsets)")
        dt = _ST_DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dt is None:
            raise CheckpointError(path, f"tensor {name!r}: unknown dtype {str(spec['dtype'])[:40]!r}")
        shape, offs = spec["shape"], spec["data_offsets"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape) or len(shape) > 64:
            raise CheckpointError(path, f"tensor {name!r}: shape {str(shape)[:100]} is not a list of at most 64 "
                                        "non-negative integers")
        count = 1
        for d in shape:  # Python ints: no int64 wrap-around
            count *= d
        if count > MAX_TENSOR_ELEMENTS:
            raise CheckpointError(path, f"tensor {name!r}: shape {shape} has {count} elements, more than any "
                                        f"file can hold (overflow)")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs):
            raise CheckpointError(path, f"tensor {name!r}: data_offsets {str(offs)[:100]} is not [begin, end]")
        a, b = offs
        if not 0 <= a <= b <= payload or b - a != count * dt.itemsize:
            raise CheckpointError(path, f"tensor {name!r}: data_offsets {[a, b]} do not fit its shape/dtype")
        spans.append((a, b, name))
        out.append((name, dt, tuple(shape), a))
    end = 0
    for a, b, name in sorted(spans):
        if a != end:
            what = "overlaps the previous tensor" if a < end else f"leaves a gap of {a - end} bytes before it"
            raise CheckpointError(path, f"tensor {name!r}: data_offsets {[a, b]} {what} (offsets must be "
                                        "contiguous)")
        end = b
    if end != payload:
        raise CheckpointError(path, f"tensors cover {end} of {payload} payload bytes (offsets must be contiguous "
                                    "up to the end)")
    return out


def read_checkpoint_meta(path: str | os.PathLike) -> dict:
    """The JSON meta of a checkpoint from its header alone (no payload read, no checksum)."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(path, "no such file") from None
    with f:
        _, _, md = _read_header(path, f, os.fstat(f.fileno()).st_size)
    try:
        meta = json.loads(md["meta"])
    except (KeyError, ValueError, RecursionError):  # unverified: the header may be damaged
        raise CheckpointError(path, "metadata lacks a JSON 'meta' entry") from None
    if not isinstance(meta, dict):
        raise CheckpointError(path, f"metadata 'meta' is a JSON {type(meta).__name__}, not an object")
    return meta


def _open(path: Path):
    try:
        return open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise CheckpointError(path, "no such file") from None


def _payload_spec(path: Path, f, size: int) -> tuple[int, dict, dict, int, list]:
    """(payload offset, index, metadata, payload bytes, index entries) after every check that needs no payload."""
    start, index, md = _read_header(path, f, size)
    try:
        payload = int(md["payload_bytes"])
        md["meta"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(path, "metadata lacks payload_bytes/meta") from None
    if payload < 0:
        raise CheckpointError(path, f"metadata payload_bytes={payload} is negative")
    have = size - start
    if have < payload:
        raise CheckpointError(path, f"truncated: header claims {payload} payload bytes at offset "
                                    f"{start}, file has {have}")
    if have > payload:
        raise CheckpointError(path, f"{have - payload} trailing bytes after the payload at offset "
                                    f"{start + payload}")
    entries = check_index(path, index, payload)  # before reading (or allocating) the payload
    if _meta_digest(md["meta"], index) != md.get("meta_sha256"):
        raise CheckpointError(path, "checksum mismatch: metadata/tensor index differ from meta_sha256")
    return start, index, md, payload, entries


def _chunk_digests(path: Path, md: dict, payload: int) -> tuple[int, list[str]]:
    """(chunk size, recorded SHA-256 per chunk) of a version 2 header."""
    try:
        chunk = int(md["chunk_bytes"])
        joined = md["chunk_sha256"]
    except (KeyError, ValueError):
        raise CheckpointError(path, "metadata lacks chunk_bytes/chunk_sha256 (format_version 2)") from None
    if not 0 < chunk <= 1 << 40:
        raise CheckpointError(path, f"metadata chunk_bytes={chunk} is not a positive chunk size")
    count = chunkio.n_chunks(payload, chunk)
    if len(joined) != 64 * count or joined.strip("0123456789abcdef"):
        raise CheckpointError(path, f"metadata chunk_sha256 holds {len(joined)} characters, not {count} SHA-256 "
                                    f"hex digests of {chunk}-byte chunks")
    return chunk, [joined[i:i + 64] for i in range(0, len(joined), 64)]


def _check_payload(path: Path, f, start: int, md: dict, payload: int, into: memoryview | None,
                   threads: int) -> None:
    """Read the payload (into ``into``, or through small reused buffers) and check it against its digests."""
    fd = f.fileno()
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, start, payload, os.POSIX_FADV_SEQUENTIAL)
    if md["format_version"] == "1":  # one SHA-256 of the whole payload: a serial stream
        h = hashlib.sha256()
        scratch = None if into is not None else memoryview(bytearray(min(_CHUNK, payload)))
        for i in range(0, payload, _CHUNK):
            n = min(_CHUNK, payload - i)
            mv = into[i:i + n] if into is not None else scratch[:n]
            if chunkio.pread_into(fd, mv, start + i) != n:
                raise CheckpointError(path, f"truncated while reading at offset {start + i}")
            h.update(mv)
        if h.hexdigest() != md.get("sha256"):
            raise CheckpointError(path, f"checksum mismatch: payload sha256 {h.hexdigest()[:16]}... != recorded "
                                        f"{str(md.get('sha256'))[:16]}...")
        return
    chunk, digests = _chunk_digests(path, md, payload)
    chunkio.read_chunks(fd, start, payload, digests, threads, into, lambda why: CheckpointError(path, why), chunk)


def _parse_meta(path: Path, meta_json: str) -> dict:
    try:
        meta = json.loads(meta_json)
    except (ValueError, RecursionError):  # verified by meta_sha256, so only a hostile writer gets here
        raise CheckpointError(path, "metadata 'meta' is not readable JSON") from None
    if not isinstance(meta, dict):
        raise CheckpointError(path, f"metadata 'meta' is a JSON {type(meta).__name__}, not an object")
    return meta


def load_checkpoint(path: str | os.PathLike, *, threads: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """Read and verify ``path`` (framing, format version, sizes, SHA-256s); returns (tensors, meta).

    Raises :class:`CheckpointError` naming the file and what failed; nothing is returned before every byte is
    checked. The arrays are views into one buffer holding the payload, read in place (positioned reads, each
    chunk hashed as it arrives) on ``threads`` I/O threads (default: the usable cores, at most 8).
    """
    path = Path(path)
    threads = io_threads(threads)
    with _open(path) as f:
        start, index, md, payload, entries = _payload_spec(path, f, os.fstat(f.fileno()).st_size)
        buf = chunkio.alloc(payload)
        _check_payload(path, f, start, md, payload, memoryview(buf), threads)
    meta = _parse_meta(path, md["meta"])
    tensors = {}
    for name, dt, shape, a in entries:
        tensors[name] = np.frombuffer(buf, dtype=dt, count=math.prod(shape), offset=a).reshape(shape)
    return tensors, meta


def verify_checkpoint(path: str | os.PathLike, *, threads: int | None = None) -> dict:
    """Check ``path`` as :func:`load_checkpoint` does (every byte against its digest) without keeping the
    payload: it is read through a few reused chunk buffers. Returns the meta; CheckpointError when it fails."""
    path = Path(path)
    threads = io_threads(threads)
    with _open(path) as f:
        start, _, md, payload, _ = _payload_spec(path, f, os.fstat(f.fileno()).st_size)
        _check_payload(path, f, start, md, payload, None, threads)
    return _parse_meta(path, md["meta"])


def header_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a checkpoint's first 8 + N bytes (length and header). The header holds the payload's digests
    and meta_sha256, so this one digest pins the whole verified file (what a commit receipt records)."""
    path = Path(path)
    with _open(path) as f:
        start, _, _ = _read_header(path, f, os.fstat(f.fileno()).st_size)
        f.seek(0)
        head = f.read(start)
    return hashlib.sha256(head).hexdigest()
