"""prepare(): text -> tokenizer + train/val shards + meta.json; the built-in offline corpus."""

import json

import numpy as np
import pytest
from blumodels.data import corpus as corpus_mod
from blumodels.data.corpus import builtin_corpus, read_texts
from blumodels.data.prepare import load_meta, prepare, split_documents
from blumodels.data.shards import list_shards, open_shard
from blumodels.data.tokenizer import load_tokenizer


def _folder(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    docs = {f"doc{i:02d}.txt": f"Document {i}: " + ("lorem ipsum dolor sit amet, " * (5 + i))
            for i in range(20)}
    for name, text in docs.items():
        (src / name).write_text(text, encoding="utf-8")
    (src / "sub" / "notes.md").write_text("# Notes\nünïcödé text ✓\n", encoding="utf-8")
    (src / "sub" / "binary.bin").write_bytes(b"\x00\xff" * 10)  # not a text extension: ignored
    (src / "sub" / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))  # invalid UTF-8 replaced
    return src


def test_read_texts(tmp_path):
    src = _folder(tmp_path)
    docs = read_texts([src])
    assert len(docs) == 22
    assert docs[0].startswith("Document 0:")  # sorted walk
    assert "caf\ufffd au lait" in docs and any("✓" in d for d in docs)
    assert read_texts([src / "doc03.txt"]) == [(src / "doc03.txt").read_text()]
    with pytest.raises(FileNotFoundError, match="nope"):
        read_texts([tmp_path / "nope"])


def test_split_documents_deterministic():
    a = split_documents(100, 0.1, seed=3)
    assert a.sum() == 10 and np.array_equal(a, split_documents(100, 0.1, seed=3))
    assert not np.array_equal(a, split_documents(100, 0.1, seed=4))
    assert split_documents(2, 0.01, 0).sum() == 1 and split_documents(1, 0.5, 0).sum() == 0
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(10, 1.0, 0)


def test_prepare_folder(tmp_path):
    src, out = _folder(tmp_path), tmp_path / "data"
    meta = prepare(out, sources=[str(src)], corpus=None, tokenizer="bpe", vocab_size=300, val_fraction=0.2,
                   shard_tokens=500, seed=1)
    assert meta == load_meta(out) == json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe" and meta["train_documents"] + meta["val_documents"] == 22
    assert meta["val_documents"] == 4 and meta["token_dtype"] == "uint16"
    train, val = list_shards(out, "train"), list_shards(out, "val")
    assert len(train) == meta["train_shards"] > 1 and len(val) == meta["val_shards"]
    assert all(open_shard(p).size == 500 for p in train[:-1])
    assert sum(open_shard(p).size for p in train) == meta["train_tokens"]
    # stream = EOT doc EOT doc ...: decoding between EOTs gives the documents back exactly
    tok = load_tokenizer(out)
    assert tok.eot_token == meta["eot_token"] and tok.vocab_size == meta["vocab_size"]
    for split, n_docs in (("train", meta["train_documents"]), ("val", meta["val_documents"])):
        stream = np.concatenate([open_shard(p) for p in list_shards(out, split)]).astype(np.int64)
        assert stream[0] == tok.eot_token
        cuts = np.flatnonzero(stream == tok.eot_token)
        assert len(cuts) == n_docs
        docs = [tok.decode(stream[a + 1:b].tolist()) for a, b in zip(cuts, list(cuts[1:]) + [len(stream)])]
        assert set(docs) <= set(read_texts([src]))
    # deterministic: a second run gives byte-identical shards; a smaller rerun leaves no stale shards
    before = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    prepare(out, sources=[str(src)], corpus=None, tokenizer="bpe", vocab_size=300, val_fraction=0.2,
            shard_tokens=500, seed=1)
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == before
    prepare(out, sources=[str(src)], corpus=None, tokenizer="bpe", vocab_size=300, shard_tokens=10**6)
    assert sorted(p.name for p in out.glob("*.bin")) == ["train_00000.bin", "val_00000.bin"]


def test_prepare_errors(tmp_path):
    with pytest.raises(ValueError, match="no documents"):
        prepare(tmp_path / "d", sources=None, corpus=None)
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        prepare(tmp_path / "d", sources=None, corpus="pydocs", tokenizer="wordpiece", max_corpus_bytes=1000)
    with pytest.raises(ValueError, match="unknown built-in corpus"):
        builtin_corpus("wikipedia")


def test_prepare_builtin_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "no-cache"))  # "auto" must fall back to bpe
    monkeypatch.delenv("BLUTRAIN_GPT2_DIR", raising=False)
    meta = prepare(tmp_path / "d", corpus="pydocs", tokenizer="auto", vocab_size=512,
                   max_corpus_bytes=150_000, shard_tokens=20_000)
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == 512
    assert meta["train_tokens"] > 30_000 and meta["val_tokens"] > 0 and meta["train_shards"] >= 2
    tok = load_tokenizer(tmp_path / "d")
    s = "Return the number of items in a container."
    assert tok.decode(tok.encode(s)) == s


def test_builtin_corpus_prefix_deterministic():
    a = corpus_mod._pydocs.__wrapped__(200_000)
    b = corpus_mod._pydocs.__wrapped__(200_000)
    assert a == b and 200_000 <= sum(len(d.encode()) for d in a) < 400_000
    assert len(set(a)) == len(a)
    assert builtin_corpus(max_bytes=200_000) == list(a)


@pytest.mark.slow
def test_builtin_corpus_full():
    docs = builtin_corpus("pydocs")
    size = sum(len(d.encode()) for d in docs)
    assert 1_500_000 < size < 30_000_000 and len(docs) > 300 and len(set(docs)) == len(docs)
    assert any(d.startswith("Module json") for d in docs)
