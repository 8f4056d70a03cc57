"""Streaming document sources for ``blutrain prepare``: text files and folders, JSON lines, Parquet.

:func:`iter_units` yields :class:`Unit` pieces of documents one at a time, never a whole corpus: a JSON-lines
record or a Parquet row is one document (its ``text_field``); a text file is one document, read in pieces of
about ``piece_bytes`` cut at a line start (so a 10 GB file needs no 10 GB of memory; BPE's pre-tokenisation
never merges across a newline followed by a non-space, so the tokens equal those of the whole file).

Folders are walked in sorted order, hidden entries skipped; inside a folder, files with a text extension, ``.jsonl``
/ ``.ndjson`` and ``.parquet`` are read. A missing path, a NUL byte in a text file, a record without the field, or
Parquet without pyarrow is an error naming the file (and line or row).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .corpus import TEXT_EXTENSIONS, CorpusError

JSONL_EXTENSIONS = frozenset({".jsonl", ".ndjson"})
PARQUET_EXTENSIONS = frozenset({".parquet", ".pq"})
PIECE_BYTES = 8 << 20
PARQUET_HINT = "pip install 'blumodels[parquet]' (pyarrow)"


@dataclass
class Unit:
    """One piece of text: ``new_doc`` starts a document (an EOT goes before it); ``nbytes`` of input consumed."""

    text: str
    new_doc: bool
    nbytes: int


def kind_of(path: Path) -> str:
    """'jsonl', 'parquet' or 'text' by file extension."""
    suf = path.suffix.lower()
    if suf in JSONL_EXTENSIONS:
        return "jsonl"
    if suf in PARQUET_EXTENSIONS:
        return "parquet"
    return "text"


def source_files(paths: list[str | os.PathLike]) -> list[Path]:
    """The files the sources name, in reading order (FileNotFoundError naming a missing one)."""
    files: list[Path] = []
    readable = TEXT_EXTENSIONS | JSONL_EXTENSIONS | PARQUET_EXTENSIONS
    for p in paths:
        path = Path(p)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(f for f in path.rglob("*")
                            if f.is_file() and f.suffix.lower() in readable
                            and not any(part.startswith(".") for part in f.relative_to(path).parts))
        else:
            raise FileNotFoundError(f"prepare: no such file or folder: {path}")
    return files


def check_sources(files: list[Path], text_field: str) -> None:
    """Errors that can be found before any work: pyarrow missing, a Parquet file without ``text_field``."""
    pq_files = [f for f in files if kind_of(f) == "parquet"]
    if not pq_files:
        return
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"prepare: {pq_files[0]} is Parquet, which needs pyarrow: {PARQUET_HINT}") from None
    for f in pq_files:
        try:
            names = pq.ParquetFile(f).schema_arrow.names
        except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) or OSError for a damaged file
            raise CorpusError(f"prepare: {f} is not a readable Parquet file ({type(e).__name__}: {e})") from None
        if text_field not in names:
            raise CorpusError(f"prepare: {f} has no column {text_field!r} (columns: {', '.join(names)}); "
                              "name the text column with --text-field")


def _cut(data: bytes) -> int:
    """End of the last line of ``data`` that a non-space starts the next of (0 when there is none)."""
    i = len(data) - 1
    while (i := data.rfind(b"\n", 0, i)) >= 0:
        if data[i + 1] not in b" \t\r\n\x0b\x0c":
            return i + 1
    return 0


def _text_units(f: Path, piece_bytes: int) -> Iterator[Unit]:
    first, offset, carry = True, 0, b""
    with open(f, "rb") as fh:
        while True:
            block = fh.read(piece_bytes)
            if (nul := block.find(b"\0")) >= 0:
                raise CorpusError(f"prepare: {f} is not UTF-8 text (NUL byte at offset {offset + nul}; binary, or "
                                  "UTF-16?): convert it to UTF-8 or leave it out")
            offset += len(block)
            data = carry + block
            if block:
                cut = _cut(data)
                if cut == 0:
                    if len(data) < 4 * piece_bytes:
                        carry = data  # one long line so far: wait for its end
                        continue
                    cut = len(data)  # a line of > 4 pieces: cut anyway, at a UTF-8 character boundary
                    while cut > 0 and data[cut - 1] & 0xC0 == 0x80:
                        cut -= 1
                    cut = cut - 1 if cut and data[cut - 1] >= 0xC0 else cut
                    cut = cut or len(data)
                data, carry = data[:cut], data[cut:]
            elif first and not data.strip():
                return  # an empty or all-whitespace file is no document
            if data:
                yield Unit(data.decode("utf-8", errors="replace"), first, len(data))
                first = False
            if not block:
                return


def _jsonl_units(f: Path, text_field: str) -> Iterator[Unit]:
    with open(f, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise CorpusError(f"prepare: {f}:{lineno} is not JSON ({e})") from None
            if not isinstance(rec, dict) or text_field not in rec:
                keys = ", ".join(rec) if isinstance(rec, dict) else type(rec).__name__
                raise CorpusError(f"prepare: {f}:{lineno} has no field {text_field!r} (has: {keys}); name the "
                                  "text field with --text-field")
            text = rec[text_field]
            if not isinstance(text, str):
                raise CorpusError(f"prepare: {f}:{lineno}: field {text_field!r} is {type(text).__name__}, not a "
                                  "string")
            if text.strip():
                yield Unit(text, True, len(line))


def _parquet_units(f: Path, text_field: str) -> Iterator[Unit]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    rows = max(1, pf.metadata.num_rows)
    size = f.stat().st_size
    done = row = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        col = batch.column(0)
        texts = col.to_pylist()
        for text in texts:
            row += 1
            share = size * row // rows - done  # input bytes, spread over the rows
            done += share
            if text is None:
                continue
            if not isinstance(text, str):
                raise CorpusError(f"prepare: {f} row {row - 1}: column {text_field!r} is {type(text).__name__}, "
                                  "not a string")
            if text.strip():
                yield Unit(text, True, share)
            elif share:
                yield Unit("", False, share)  # progress only


def iter_units(files: list[Path], text_field: str = "text", piece_bytes: int = PIECE_BYTES) -> Iterator[Unit]:
    """Every piece of every document of ``files``, in order (see the module doc)."""
    for f in files:
        kind = kind_of(f)
        if kind == "jsonl":
            yield from _jsonl_units(f, text_field)
        elif kind == "parquet":
            yield from _parquet_units(f, text_field)
        else:
            yield from _text_units(f, piece_bytes)
