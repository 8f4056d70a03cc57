"""``blutrain prepare``: text -> tokenizer + train/val token shards + meta.json.

Documents come from files/folders (``sources``) and/or a built-in corpus; the validation split is a
deterministic (seeded) choice of whole documents. Every document is preceded by the EOT token, so the
token stream is ``EOT doc0 EOT doc1 ...`` as in GPT-2's training data.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from .corpus import CorpusError, builtin_corpus, read_texts
from .shards import FORMAT_VERSION, list_shards, shard_name, token_dtype, tokenizer_fingerprint, write_shard
from .tokenizer import TiktokenGPT2, Tokenizer, gpt2_tiktoken_available, train_bpe

log = logging.getLogger(__name__)
META_FILE = "meta.json"
TOKENIZER_CHOICES = ("auto", "gpt2", "bpe")


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the documents that go to validation (seeded, at least one each when n >= 2)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    mask = np.zeros(n_docs, dtype=bool)
    if n_docs < 2 or val_fraction == 0.0:
        return mask
    n_val = min(n_docs - 1, max(1, round(val_fraction * n_docs)))
    mask[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return mask


def _make_tokenizer(kind: str, train_docs: list[str], vocab_size: int, out_dir: Path) -> Tokenizer:
    if kind not in TOKENIZER_CHOICES:
        raise ValueError(f"tokenizer must be one of {TOKENIZER_CHOICES}, got {kind!r}")
    if kind == "gpt2" or (kind == "auto" and gpt2_tiktoken_available()):
        tok: Tokenizer = TiktokenGPT2.from_local()
    else:
        if kind == "auto":
            log.info("GPT-2 encoding files not found locally; training a byte-level BPE (vocab %d)",
                     vocab_size)
        tok = train_bpe(train_docs, vocab_size)
    tok.save(out_dir)
    return tok


def _encode_stream(tok: Tokenizer, docs: list[str], dtype: np.dtype, chunk: int = 256):
    """Yield uint token arrays ``EOT + doc`` per document, encoding in batches."""
    batch = getattr(tok, "encode_batch", None)
    for i in range(0, len(docs), chunk):
        part = docs[i:i + chunk]
        ids = batch(part) if batch is not None else [tok.encode(d) for d in part]
        for t in ids:
            arr = np.empty(len(t) + 1, dtype=dtype)
            arr[0] = tok.eot_token
            arr[1:] = t
            yield arr


def _write_split(out_dir: Path, split: str, arrays, shard_tokens: int, dtype: np.dtype,
                 fingerprint: bytes | None = None) -> list[int]:
    """Pack the token arrays into shards of ``shard_tokens``; returns the token count of each shard."""
    buf = np.empty(shard_tokens, dtype=dtype)
    fill, counts = 0, []
    for arr in arrays:
        while arr.size:
            take = min(arr.size, shard_tokens - fill)
            buf[fill:fill + take] = arr[:take]
            fill += take
            arr = arr[take:]
            if fill == shard_tokens:
                write_shard(out_dir / shard_name(split, len(counts)), buf, fingerprint)
                counts.append(fill)
                fill = 0
    if fill or not counts:
        write_shard(out_dir / shard_name(split, len(counts)), buf[:fill], fingerprint)
        counts.append(fill)
    return counts


def prepare(out_dir: str | os.PathLike, sources: list[str] | None = None, corpus: str | None = "pydocs",
            tokenizer: str = "auto", vocab_size: int = 4096, val_fraction: float = 0.05,
            shard_tokens: int = 10_000_000, seed: int = 0, max_corpus_bytes: int | None = None) -> dict:
    """Tokenize ``sources`` and/or the built-in ``corpus`` into ``out_dir``; returns (and writes) meta.json.

    ``tokenizer``: "gpt2" (tiktoken, local files required), "bpe" (train a byte-level BPE of
    ``vocab_size`` on the train documents) or "auto" (gpt2 when available, else bpe).
    ``max_corpus_bytes`` caps the built-in corpus (quick runs and tests).
    """
    if shard_tokens < 2:
        raise ValueError(f"shard_tokens must be >= 2, got {shard_tokens}")
    out = Path(out_dir)
    docs: list[str] = []
    if sources:
        docs += read_texts(sources)
    if corpus:
        docs += builtin_corpus(corpus, max_bytes=max_corpus_bytes)
    if not docs:
        where = f" in {', '.join(map(str, sources))} (empty files and, in folders, non-text extensions are " \
                "skipped)" if sources else ""
        raise CorpusError(f"prepare: no documents{where}; give sources=[files or folders] and/or corpus='pydocs'")
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)  # written last: a crashed run never looks prepared
    for split in ("train", "val"):  # a re-run must not leave shards of a previous, larger run behind
        for old in list_shards(out, split):
            old.unlink()

    is_val = split_documents(len(docs), val_fraction, seed)
    train_docs = [d for d, v in zip(docs, is_val) if not v]
    val_docs = [d for d, v in zip(docs, is_val) if v]
    tok = _make_tokenizer(tokenizer, train_docs, vocab_size, out)
    dtype = token_dtype(tok.vocab_size)
    fp = tokenizer_fingerprint(tok)  # in every shard header and meta.json: checked at the start of a run
    train_counts = _write_split(out, "train", _encode_stream(tok, train_docs, dtype), shard_tokens, dtype, fp)
    val_counts = _write_split(out, "val", _encode_stream(tok, val_docs, dtype), shard_tokens, dtype, fp)
    meta = {
        "format_version": FORMAT_VERSION, "tokenizer": tok.name, "vocab_size": int(tok.vocab_size),
        "eot_token": int(tok.eot_token), "token_dtype": dtype.name,
        "train_tokens": int(sum(train_counts)), "val_tokens": int(sum(val_counts)),
        "train_shards": len(train_counts), "val_shards": len(val_counts),
        "train_documents": len(train_docs), "val_documents": len(val_docs),
        "sources": [str(s) for s in (sources or [])], "corpus": corpus, "max_corpus_bytes": max_corpus_bytes,
        "val_fraction": val_fraction, "shard_tokens": int(shard_tokens), "seed": int(seed),
        "tokenizer_fingerprint": fp.hex(),
    }
    tmp = out / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / META_FILE)
    return meta


def load_meta(data_dir: str | os.PathLike) -> dict:
    """meta.json written by :func:`prepare` (FileNotFoundError naming the directory if absent)."""
    p = Path(data_dir) / META_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: run `blutrain prepare` to create token shards in {data_dir}")
    return json.loads(p.read_text())
