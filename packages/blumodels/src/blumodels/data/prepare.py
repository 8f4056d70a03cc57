"""``blutrain prepare``: text -> tokenizer + train/val token shards + meta.json, streamed.

Documents come from files/folders (``sources``: text, JSON lines, Parquet; see :mod:`.sources`) and/or a built-in
corpus. Nothing holds the corpus: a reader thread cuts the stream into batches of about ``batch_bytes`` of text,
the tokenizer's batch API encodes each batch on every core (tiktoken and ``tokenizers`` drop the GIL), and the
tokens go into fixed-size shards, so memory stays bounded whatever the corpus size. Every document is preceded by
the EOT token: the stream is ``EOT doc0 EOT doc1 ...`` as in GPT-2's training data.

The validation split is a seeded draw per document (its index hashed with ``seed``; the first document always
trains, and when no other falls into validation the last one does). Shards are written atomically; after every
batch that completed a shard, the position reached is saved (``.prepare_state.json`` with the partial shard
buffers), so running the same command again after an interruption continues there instead of starting over.
Shards are BluTrain's own format or, with ``shard_format="llmc"``, llm.c's (``train_gpt2`` reads them directly).

:func:`import_tokens` makes a data directory of llm.c shards (used in place) and nanoGPT ``train.bin`` /
``val.bin`` files (converted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from .corpus import CorpusError, builtin_corpus
from .formats import FORMATS, detect_format, open_raw_uint16, read_header, write_tokens
from .shards import FORMAT_VERSION, list_shards, shard_name, token_dtype, tokenizer_fingerprint, write_shard
from .sources import Unit, check_sources, iter_units, source_files
from .tokenizer import (
    GPT2_EXTRA_HINT,
    TiktokenGPT2,
    Tokenizer,
    gpt2_tiktoken_available,
    load_tokenizer,
    train_bpe,
)

log = logging.getLogger(__name__)
META_FILE = "meta.json"
STATE_FILE = ".prepare_state.json"
TOKENIZER_CHOICES = ("auto", "gpt2", "bpe")
BATCH_BYTES = 4 << 20  # text per encode batch
BPE_TRAIN_BYTES = 256 << 20  # a trained BPE sees at most this much of the training split
_M64 = (1 << 64) - 1


def _draw(seed: int, idx: int) -> float:
    """A uniform number in [0, 1) from (seed, document index): splitmix64, so the split needs no document count."""
    z = (seed * 0x9E3779B97F4A7C15 + (idx + 1) * 0xD1B54A32D192ED03) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) / 2.0 ** 64


def is_val_document(idx: int, val_fraction: float, seed: int) -> bool:
    """Whether document ``idx`` of the stream goes to validation (document 0 always trains)."""
    return idx > 0 and _draw(seed, idx) < val_fraction


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the documents that go to validation: the rule :func:`prepare` applies while streaming."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    mask = np.array([is_val_document(i, val_fraction, seed) for i in range(n_docs)], dtype=bool)
    if n_docs >= 2 and val_fraction > 0 and not mask.any():
        mask[-1] = True
    return mask


def _say(logf: Callable[[str], Any] | None, msg: str) -> None:
    if logf is not None:
        logf(msg)
    else:
        log.info(msg)


def _make_tokenizer(kind: str, train_texts: Callable[[], Iterable[str]], vocab_size: int, out_dir: Path,
                    logf: Callable[[str], Any] | None = None) -> Tokenizer:
    if kind not in TOKENIZER_CHOICES:
        raise ValueError(f"tokenizer must be one of {TOKENIZER_CHOICES}, got {kind!r}")
    if kind == "gpt2" or (kind == "auto" and gpt2_tiktoken_available()):
        tok: Tokenizer = TiktokenGPT2.from_local()
    else:
        if kind == "auto":
            _say(logf, f"[prepare] GPT-2's tokenizer is not installed ({GPT2_EXTRA_HINT}): training a byte-level "
                       f"BPE of {vocab_size} tokens instead")
        tok = train_bpe(train_texts(), vocab_size)
    tok.save(out_dir)
    return tok


class _SplitWriter:
    """Packs one split's token arrays into shards of ``shard_tokens`` (the last one shorter)."""

    def __init__(self, out: Path, split: str, shard_tokens: int, dtype: np.dtype, fmt: str,
                 fingerprint: bytes | None = None, counts: list[int] | None = None,
                 pending: np.ndarray | None = None, docs: int = 0,
                 last_doc: int = -1) -> None:
        self.out, self.split, self.n, self.dtype, self.fmt = out, split, shard_tokens, dtype, fmt
        self.fingerprint = fingerprint  # the tokenizer's, recorded in BluTrain shard headers
        self.buf = np.empty(shard_tokens, dtype=dtype)
        self.counts = list(counts or [])
        self.fill = 0
        if pending is not None and pending.size:
            self.buf[:pending.size] = pending
            self.fill = pending.size
        self.docs, self.last_doc = docs, last_doc  # buffer position where the newest document starts (-1: flushed)
        self.flushed = False

    def add(self, arr: np.ndarray, new_doc: bool) -> None:
        if new_doc:
            self.docs += 1
            self.last_doc = self.fill
        while arr.size:
            take = min(arr.size, self.n - self.fill)
            self.buf[self.fill:self.fill + take] = arr[:take]
            self.fill += take
            arr = arr[take:]
            if self.fill == self.n:
                self._write(self.n)
                self.last_doc = -1

    def _write(self, count: int) -> None:
        write_tokens(self.out / shard_name(self.split, len(self.counts)), self.buf[:count], self.fmt,
                     self.fingerprint)
        self.counts.append(count)
        self.fill = 0
        self.flushed = True

    def pop_last_doc(self) -> np.ndarray | None:
        """The newest document's tokens, removed, when all of them are still in the buffer."""
        if self.last_doc < 0 or self.docs < 2:
            return None
        arr = self.buf[self.last_doc:self.fill].copy()
        self.fill, self.last_doc, self.docs = self.last_doc, -1, self.docs - 1
        return arr

    def finish(self) -> None:
        if self.fill or not self.counts:
            self._write(self.fill)

    def state(self) -> dict[str, Any]:
        return {"counts": self.counts, "docs": self.docs, "last_doc": self.last_doc}


def _fingerprint(args: dict[str, Any], files: list[Path], builtin_bytes: int) -> str:
    stats = []
    for f in files:
        st = f.stat()
        stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"args": args, "files": stats, "builtin_bytes": builtin_bytes, "v": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _save_state(out: Path, state: dict[str, Any], writers: dict[str, _SplitWriter]) -> None:
    for split, w in writers.items():
        tmp = out / f".pending_{split}.tmp.npy"
        np.save(tmp, w.buf[:w.fill])
        os.replace(tmp, out / f".pending_{split}.npy")
    _atomic_json(out / STATE_FILE, {**state, "splits": {s: w.state() for s, w in writers.items()}})


def _load_state(out: Path, fingerprint: str) -> dict[str, Any] | None:
    """The saved position of an interrupted run with the same inputs, when its shards are all still there."""
    p = out / STATE_FILE
    try:
        st = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(st, dict) or st.get("fingerprint") != fingerprint:
        return None
    try:
        for split, s in st["splits"].items():
            for i, n in enumerate(s["counts"]):
                if read_header(out / shard_name(split, i))[1] != n:
                    return None
            s["pending"] = np.load(out / f".pending_{split}.npy")
        return st
    except Exception:  # a shard or pending file damaged or gone: start over
        return None


def _clean(out: Path) -> None:
    (out / META_FILE).unlink(missing_ok=True)  # written last: a crashed run never looks prepared
    for split in ("train", "val"):  # a re-run must not leave shards of a previous, larger run behind
        for old in list_shards(out, split):
            old.unlink()
        (out / f".pending_{split}.npy").unlink(missing_ok=True)
    (out / STATE_FILE).unlink(missing_ok=True)


def _batches(units: Iterator[Unit], skip: int, val_fraction: float, seed: int,
             batch_bytes: int) -> Iterator[list[tuple[Unit, bool]]]:
    """Units after the first ``skip``, tagged with their split, grouped into batches of ~``batch_bytes``."""
    doc = -1
    val = False
    batch: list[tuple[Unit, bool]] = []
    size = 0
    for i, u in enumerate(units):
        if u.new_doc:
            doc += 1
            val = is_val_document(doc, val_fraction, seed)
        if i < skip:
            continue
        batch.append((u, val))
        size += len(u.text)
        if size >= batch_bytes or len(batch) >= 8192:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _threaded(it: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """Run ``it`` in a reader thread, ``depth`` items ahead (reading/parsing overlaps encoding)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def work() -> None:
        try:
            for item in it:
                while not stop.is_set():
                    try:
                        q.put((None, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((None, done))
        except BaseException as e:  # handed to the consumer, raised there
            q.put((e, None))

    t = threading.Thread(target=work, name="blutrain-prepare-reader", daemon=True)
    t.start()
    try:
        while True:
            err, item = q.get()
            if err is not None:
                raise err
            if item is done:
                return
            yield item
    finally:
        stop.set()
        t.join(timeout=5)


def prepare(out_dir: str | os.PathLike, sources: list[str] | None = None, corpus: str | None = "pydocs",
            tokenizer: str = "auto", vocab_size: int = 4096, val_fraction: float = 0.05,
            shard_tokens: int = 10_000_000, seed: int = 0, max_corpus_bytes: int | None = None,
            text_field: str = "text", shard_format: str = "blutrain", bpe_train_bytes: int = BPE_TRAIN_BYTES,
            batch_bytes: int = BATCH_BYTES, resume: bool = True, progress: bool | None = None,
            log_fn: Callable[[str], Any] | None = None) -> dict:
    """Tokenize ``sources`` and/or the built-in ``corpus`` into ``out_dir``; returns (and writes) meta.json.

    ``tokenizer``: "gpt2" (tiktoken with GPT-2's files: ``blumodels[gpt2-tokenizer]``), "bpe" (train a byte-level
    BPE of ``vocab_size`` on the first ``bpe_train_bytes`` of the train documents) or "auto" (gpt2 when
    available, else bpe). ``text_field``: the JSON-lines field / Parquet column holding the text.
    ``shard_format``: "blutrain" or "llmc". ``max_corpus_bytes`` caps the built-in corpus (quick runs and tests).
    ``resume``: continue an interrupted run of the same inputs and arguments (else start over).
    ``progress``: a progress bar on stderr (default: when stderr is a terminal); ``log_fn`` gets status lines.
    """
    if shard_tokens < 2:
        raise ValueError(f"shard_tokens must be >= 2, got {shard_tokens}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if tokenizer not in TOKENIZER_CHOICES:
        raise ValueError(f"tokenizer must be one of {TOKENIZER_CHOICES}, got {tokenizer!r}")
    if shard_format not in FORMATS:
        raise ValueError(f"shard_format must be one of {', '.join(FORMATS)}, got {shard_format!r}")
    out = Path(out_dir)
    files = source_files(sources or [])
    check_sources(files, text_field)
    builtin = builtin_corpus(corpus, max_bytes=max_corpus_bytes) if corpus else []
    builtin_bytes = sum(len(d.encode("utf-8")) for d in builtin)
    total_bytes = sum(f.stat().st_size for f in files) + builtin_bytes
    if not files and not builtin:
        where = f" in {', '.join(map(str, sources))} (in folders, only text, .jsonl and .parquet files are read)" \
            if sources else ""
        raise CorpusError(f"prepare: no documents{where}; give sources=[files or folders] and/or corpus='pydocs'")

    def units() -> Iterator[Unit]:
        return chain(iter_units(files, text_field), (Unit(d, True, len(d.encode("utf-8"))) for d in builtin))

    args = {"corpus": corpus, "tokenizer": tokenizer, "vocab_size": vocab_size, "val_fraction": val_fraction,
            "shard_tokens": shard_tokens, "seed": seed, "max_corpus_bytes": max_corpus_bytes,
            "text_field": text_field, "shard_format": shard_format, "bpe_train_bytes": bpe_train_bytes}
    fingerprint = _fingerprint(args, files, builtin_bytes)
    out.mkdir(parents=True, exist_ok=True)
    state = _load_state(out, fingerprint) if resume else None
    if state is not None:
        try:
            tok = load_tokenizer(out)
        except Exception:  # the saved tokenizer is gone or damaged: the saved position means nothing
            state = None
    if state is None:
        _clean(out)
    show = sys.stderr.isatty() if progress is None else progress
    t0 = time.perf_counter()

    if state is not None:
        done = ", ".join(f"{len(sp['counts'])} {name}" for name, sp in state["splits"].items())
        _say(log_fn, f"[prepare] resuming {out} at document {state['docs_done']} ({done} shard(s) done)")
    else:
        def train_texts() -> Iterator[str]:
            seen, doc, val = 0, -1, False
            for u in units():
                if u.new_doc:
                    doc += 1
                    val = is_val_document(doc, val_fraction, seed)
                if not val and u.text:
                    yield u.text
                    seen += len(u.text)
                    if seen >= bpe_train_bytes:
                        return

        tok = _make_tokenizer(tokenizer, train_texts, vocab_size, out, log_fn)
    dtype = token_dtype(tok.vocab_size)
    fp = tokenizer_fingerprint(tok)  # in every shard header and meta.json: checked at the start of a run
    st = state or {"units_done": 0, "docs_done": 0, "bytes_done": 0, "splits": {}}
    writers = {s: _SplitWriter(out, s, shard_tokens, dtype, shard_format, fp,
                               **{k: v for k, v in st["splits"].get(s, {}).items()
                                  if k in ("counts", "pending", "docs", "last_doc")})
               for s in ("train", "val")}
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, initial=st["bytes_done"], unit="B", unit_scale=True, unit_divisor=1024,
               desc="prepare", file=sys.stderr, disable=not show, dynamic_ncols=True)
    units_done, bytes_done, docs_done = st["units_done"], st["bytes_done"], st["docs_done"]
    eot = int(tok.eot_token)
    batch_encode = getattr(tok, "encode_batch", None)
    try:
        for batch in _threaded(_batches(units(), units_done, val_fraction, seed, batch_bytes)):
            texts = [u.text for u, _ in batch]
            ids = batch_encode(texts) if batch_encode is not None else [tok.encode(t) for t in texts]
            for (u, val), t in zip(batch, ids):
                if u.new_doc:
                    arr = np.empty(len(t) + 1, dtype=dtype)
                    arr[0] = eot
                    arr[1:] = t
                    docs_done += 1
                elif t:
                    arr = np.asarray(t, dtype=dtype)
                else:
                    arr = None
                if arr is not None:
                    writers["val" if val else "train"].add(arr, u.new_doc)
                units_done += 1
                bytes_done += u.nbytes
            bar.update(sum(u.nbytes for u, _ in batch))
            if any(w.flushed for w in writers.values()):
                _save_state(out, {"fingerprint": fingerprint, "units_done": units_done, "docs_done": docs_done,
                                  "bytes_done": bytes_done}, writers)
                for w in writers.values():
                    w.flushed = False
                if not show:
                    el = time.perf_counter() - t0
                    _say(log_fn, f"[prepare] {sum(len(w.counts) for w in writers.values())} shard(s), "
                                 f"{bytes_done / 1e6:,.0f} of {total_bytes / 1e6:,.0f} MB read, "
                                 f"{bytes_done / 1e6 / max(el, 1e-9):.1f} MB/s")
    finally:
        bar.close()
    train, val = writers["train"], writers["val"]
    if val_fraction > 0 and val.docs == 0:
        moved = train.pop_last_doc()
        if moved is None:
            raise CorpusError(f"prepare: no document fell into the validation split ({train.docs} document(s), "
                              f"val_fraction={val_fraction}); raise val_fraction or add documents")
        val.add(moved, True)
    train.finish()
    val.finish()
    elapsed = time.perf_counter() - t0
    meta = {
        "format_version": FORMAT_VERSION, "tokenizer": tok.name, "vocab_size": int(tok.vocab_size),
        "eot_token": int(tok.eot_token), "token_dtype": dtype.name, "shard_format": shard_format,
        "train_tokens": int(sum(train.counts)), "val_tokens": int(sum(val.counts)),
        "train_shards": len(train.counts), "val_shards": len(val.counts),
        "train_documents": train.docs, "val_documents": val.docs,
        "sources": [str(s) for s in (sources or [])], "corpus": corpus, "max_corpus_bytes": max_corpus_bytes,
        "text_field": text_field, "val_fraction": val_fraction, "shard_tokens": int(shard_tokens),
        "seed": int(seed), "input_bytes": int(total_bytes), "elapsed_s": round(elapsed, 3),
        "resumed": state is not None, "tokenizer_fingerprint": fp.hex(),
    }
    _atomic_json(out / META_FILE, meta)
    for split in ("train", "val"):
        (out / f".pending_{split}.npy").unlink(missing_ok=True)
    (out / STATE_FILE).unlink(missing_ok=True)
    return meta


def load_meta(data_dir: str | os.PathLike) -> dict:
    """meta.json written by :func:`prepare` (FileNotFoundError naming the directory if absent)."""
    p = Path(data_dir) / META_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: run `blutrain prepare` to create token shards in {data_dir}")
    return json.loads(p.read_text())


# ---------------------------------------------------------------- other trainers' token files
GPT2_VOCAB, GPT2_EOT = 50257, 50256


def _token_files(paths: list[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(f for f in path.iterdir() if f.is_file() and f.suffix == ".bin")
        else:
            raise FileNotFoundError(f"import_tokens: no such file or folder: {path}")
    if not files:
        raise CorpusError(f"import_tokens: no .bin token files in {', '.join(map(str, paths))}")
    return files


def import_tokens(out_dir: str | os.PathLike, paths: list[str | os.PathLike], vocab_size: int = GPT2_VOCAB,
                  eot_token: int = GPT2_EOT, shard_tokens: int = 100_000_000,
                  log_fn: Callable[[str], Any] | None = None) -> dict:
    """A data directory from llm.c shards and nanoGPT token files (GPT-2 tokens unless told otherwise).

    A file whose name holds "val" is validation, every other one training. llm.c shards are linked in place
    (read directly, never copied); nanoGPT's headerless uint16 files are converted into BluTrain shards of
    ``shard_tokens`` (a headerless file cannot be told from a damaged shard at open time). Every token id is
    checked against ``vocab_size`` (ShardError naming file and offset). GPT-2's tokenizer is saved beside them
    when installed (for sampling).
    """
    from .formats import check_token_range

    out = Path(out_dir)
    files = _token_files(paths)
    kinds = {f: detect_format(f) for f in files}
    by_split: dict[str, list[Path]] = {"train": [], "val": []}
    for f in files:
        by_split["val" if "val" in f.name.lower() else "train"].append(f)
    for split, fs in by_split.items():
        if not fs:
            raise CorpusError(f"import_tokens: no {split} file among {', '.join(f.name for f in files)} (a file whose "
                              "name holds 'val' is validation, every other one training)")
    for f in files:  # every check before the directory is touched
        if kinds[f] == "unknown":
            raw = open_raw_uint16(f)
            for a in range(0, raw.size, 1 << 24):  # in chunks: a large file is read window by window
                part = np.asarray(raw[a:a + (1 << 24)])
                if int(part.max()) >= vocab_size:
                    i = a + int(np.argmax(part >= vocab_size))
                    raise CorpusError(f"import_tokens: {f}: token id {int(raw[i])} at offset {2 * i} is >= the "
                                      f"vocabulary size {vocab_size} (not GPT-2 uint16 tokens?)")
        else:
            check_token_range(f, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    _clean(out)
    counts: dict[str, list[int]] = {"train": [], "val": []}
    dtypes = set()
    for split, fs in by_split.items():
        for f in fs:
            if kinds[f] == "unknown":  # nanoGPT: convert
                raw = open_raw_uint16(f)
                for a in range(0, max(raw.size, 1), shard_tokens):
                    part = np.asarray(raw[a:a + shard_tokens])
                    write_shard(out / shard_name(split, len(counts[split])), part)
                    counts[split].append(int(part.size))
                dtypes.add("uint16")
                continue
            dst = out / shard_name(split, len(counts[split]))
            dst.unlink(missing_ok=True)
            try:
                dst.symlink_to(f.resolve())
            except OSError:  # no symlinks here: a copy
                import shutil

                shutil.copyfile(f, dst)
            dt, n = read_header(dst)
            counts[split].append(int(n))
            dtypes.add(np.dtype(dt).name)
    tok_name = "gpt2"
    if vocab_size == GPT2_VOCAB and gpt2_tiktoken_available():
        TiktokenGPT2.from_local().save(out)
    else:
        _say(log_fn, f"[prepare] no tokenizer saved beside the tokens ({GPT2_EXTRA_HINT} for sampling)")
    meta = {"format_version": FORMAT_VERSION, "tokenizer": tok_name, "vocab_size": int(vocab_size),
            "eot_token": int(eot_token), "token_dtype": "uint32" if "uint32" in dtypes else "uint16",
            "train_tokens": sum(counts["train"]), "val_tokens": sum(counts["val"]),
            "train_shards": len(counts["train"]), "val_shards": len(counts["val"]),
            "imported_from": {str(f): kinds[f] if kinds[f] != "unknown" else "nanogpt" for f in files},
            "corpus": None, "sources": [str(p) for p in paths]}
    _atomic_json(out / META_FILE, meta)
    return meta
