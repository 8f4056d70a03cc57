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
    """A seeded draw per document index (no document count needed: prepare streams); document 0 trains."""
    a = split_documents(100, 0.1, seed=3)
    assert 5 <= a.sum() <= 16 and np.array_equal(a, split_documents(100, 0.1, seed=3))
    assert not np.array_equal(a, split_documents(100, 0.1, seed=4))
    assert np.array_equal(split_documents(50, 0.1, seed=3), a[:50])  # a prefix decides the same
    big = split_documents(20_000, 0.05, seed=0)
    assert not big[0] and abs(big.mean() - 0.05) < 0.006
    assert split_documents(2, 0.01, 0).sum() == 1 and split_documents(1, 0.5, 0).sum() == 0
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(10, 1.0, 0)


def test_prepare_folder(tmp_path):
    src, out = _folder(tmp_path), tmp_path / "data"
    meta = prepare(out, sources=[str(src)], corpus=None, tokenizer="bpe", vocab_size=300, val_fraction=0.2,
                   shard_tokens=500, seed=1)
    assert meta == load_meta(out) == json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe" and meta["train_documents"] + meta["val_documents"] == 22
    assert meta["val_documents"] == split_documents(22, 0.2, 1).sum() > 0 and meta["token_dtype"] == "uint16"
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
    from blumodels.data import tokenizer as tk

    monkeypatch.setattr(tk, "_packaged_gpt2_dir", lambda: None)
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


# ---------------------------------------------------------------- streaming sources, formats, resume
def _records(n=40):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "über", "naïve", "\n", "42", "x_y"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 60)))) for _ in range(n)]


def _stream(out, split):
    from blumodels.data.formats import open_shard as open_any  # BluTrain or llm.c shards

    return np.concatenate([open_any(p) for p in list_shards(out, split)]).astype(np.int64)


def _docs(out, split):
    tok = load_tokenizer(out)
    s = _stream(out, split)
    cuts = list(np.flatnonzero(s == tok.eot_token)) + [len(s)]
    return [tok.decode(s[a + 1:b].tolist()) for a, b in zip(cuts, cuts[1:])]


def test_prepare_jsonl_and_parquet_give_the_same_shards(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    recs = _records()
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "content": t}) + "\n" for i, t in enumerate(recs)))
    pq.write_table(pa.table({"id": list(range(len(recs))), "content": recs}), tmp_path / "a.parquet",
                   row_group_size=7)
    kw = dict(corpus=None, tokenizer="bpe", vocab_size=300, val_fraction=0.2, shard_tokens=300, seed=2,
              text_field="content", batch_bytes=200)
    mj = prepare(tmp_path / "j", sources=[str(tmp_path / "a.jsonl")], **kw)
    mp = prepare(tmp_path / "p", sources=[str(tmp_path / "a.parquet")], **kw)
    assert mj["train_documents"] + mj["val_documents"] == len(recs) and mj["train_shards"] > 2
    assert (mp["train_documents"], mp["val_documents"]) == (mj["train_documents"], mj["val_documents"])
    for split in ("train", "val"):
        assert np.array_equal(_stream(tmp_path / "j", split), _stream(tmp_path / "p", split))
    mask = split_documents(len(recs), 0.2, 2)
    assert _docs(tmp_path / "j", "train") == [t for t, v in zip(recs, mask) if not v]
    assert _docs(tmp_path / "j", "val") == [t for t, v in zip(recs, mask) if v]
    assert mj["input_bytes"] == (tmp_path / "a.jsonl").stat().st_size


def test_prepare_source_errors_are_named_before_work(tmp_path):
    from blumodels.data.corpus import CorpusError

    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(CorpusError, match=r"a.jsonl:2 has no field 'text' \(has: body\)"):
        prepare(tmp_path / "d", sources=[str(tmp_path / "a.jsonl")], corpus=None, tokenizer="bpe", vocab_size=300)
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(CorpusError, match=r"b.parquet has no column 'text' \(columns: body\)"):
        prepare(tmp_path / "e", sources=[str(tmp_path / "b.parquet")], corpus=None)
    assert not (tmp_path / "e").exists()


def test_big_text_file_is_read_in_pieces_with_the_same_tokens(tmp_path):
    """A text file read in 1 KB pieces (cut at line starts) tokenizes exactly as the whole file."""
    from blumodels.data import sources

    text = "\n".join(_records(200)) + "\n  indented\n\n\nend"
    (tmp_path / "big.txt").write_text(text)
    assert len(list(sources.iter_units([tmp_path / "big.txt"], piece_bytes=1000))) > 5
    meta = prepare(tmp_path / "d", sources=[str(tmp_path / "big.txt")], corpus=None, tokenizer="bpe",
                   vocab_size=300, val_fraction=0.0, shard_tokens=10**6, batch_bytes=1000)
    assert meta["train_documents"] == 1
    tok = load_tokenizer(tmp_path / "d")
    assert _stream(tmp_path / "d", "train")[1:].tolist() == tok.encode(text)


def test_prepare_resumes_after_an_interruption(tmp_path, monkeypatch):
    from blumodels.data.prepare import STATE_FILE
    from blumodels.data.tokenizer import ByteLevelBPE

    recs = _records(60)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in recs))
    kw = dict(sources=[str(tmp_path / "a.jsonl")], corpus=None, tokenizer="bpe", vocab_size=300,
              val_fraction=0.1, shard_tokens=200, batch_bytes=300)
    ref = prepare(tmp_path / "ref", **kw)
    calls = {"n": 0}
    real = ByteLevelBPE.encode_batch

    def flaky(self, texts, num_threads=0):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return real(self, texts, num_threads)

    monkeypatch.setattr(ByteLevelBPE, "encode_batch", flaky)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "d", **kw)
    assert (tmp_path / "d" / STATE_FILE).is_file() and not (tmp_path / "d" / "meta.json").exists()
    done = len(list_shards(tmp_path / "d", "train"))
    assert done >= 2
    seen = []
    monkeypatch.setattr(ByteLevelBPE, "encode_batch", lambda self, texts, num_threads=0:
                        seen.append(len(texts)) or real(self, texts, num_threads))
    meta = prepare(tmp_path / "d", **kw)
    assert meta["resumed"] and sum(seen) < len(recs) - 5  # only what was not yet written is encoded again
    for k in ("train_tokens", "val_tokens", "train_documents", "val_documents", "train_shards"):
        assert meta[k] == ref[k], k
    for split in ("train", "val"):
        assert np.array_equal(_stream(tmp_path / "d", split), _stream(tmp_path / "ref", split))
    assert not (tmp_path / "d" / STATE_FILE).exists()
    assert not list((tmp_path / "d").glob(".pending_*"))


def test_llmc_shards_written_read_and_imported(tmp_path):
    """--format llmc writes llm.c's header (magic 20240520, v1, count) that the loader reads; llm.c and nanoGPT
    token files are imported (llm.c in place, nanoGPT converted) and trained on by TokenLoader."""
    from blumodels.data.formats import LLMC_HEADER_BYTES, detect_format
    from blumodels.data.loader import TokenLoader
    from blumodels.data.prepare import import_tokens
    from blumodels.data.shards import ShardError

    src = _folder(tmp_path)
    a = prepare(tmp_path / "b", sources=[str(src)], corpus=None, tokenizer="bpe", vocab_size=300, seed=1,
                shard_tokens=500)
    m = prepare(tmp_path / "l", sources=[str(src)], corpus=None, tokenizer="bpe", vocab_size=300, seed=1,
                shard_tokens=500, shard_format="llmc")
    assert m["shard_format"] == "llmc" and m["train_tokens"] == a["train_tokens"]
    p = list_shards(tmp_path / "l", "train")[0]
    head = np.fromfile(p, dtype="<i4", count=256)
    assert head[:3].tolist() == [20240520, 1, 500] and not head[3:].any()
    assert p.stat().st_size == LLMC_HEADER_BYTES + 2 * 500 and detect_format(p) == "llmc"
    for split in ("train", "val"):
        assert np.array_equal(_stream(tmp_path / "l", split), _stream(tmp_path / "b", split))
    xb, yb = TokenLoader(tmp_path / "b", "train", 2, 16, vocab_size=300).next_batch()
    xl, yl = TokenLoader(tmp_path / "l", "train", 2, 16, vocab_size=300).next_batch()
    assert np.array_equal(xb.numpy(), xl.numpy()) and np.array_equal(yb.numpy(), yl.numpy())

    # llm.c files (as llm.c names them) and nanoGPT raw uint16 files -> a data directory
    ext = tmp_path / "ext"
    ext.mkdir()
    import shutil

    for i, q in enumerate(list_shards(tmp_path / "l", "train")):
        shutil.copyfile(q, ext / f"fineweb_train_{i:06d}.bin")
    shutil.copyfile(list_shards(tmp_path / "l", "val")[0], ext / "fineweb_val_000000.bin")
    imp = import_tokens(tmp_path / "imp", [ext], vocab_size=300)
    assert imp["train_tokens"] == a["train_tokens"] and list_shards(tmp_path / "imp", "train")[0].is_symlink()
    assert np.array_equal(_stream(tmp_path / "imp", "train"), _stream(tmp_path / "b", "train"))
    nano = tmp_path / "nano"
    nano.mkdir()
    _stream(tmp_path / "b", "train").astype("<u2").tofile(nano / "train.bin")
    _stream(tmp_path / "b", "val").astype("<u2").tofile(nano / "val.bin")
    imp = import_tokens(tmp_path / "imp2", [nano], vocab_size=300, shard_tokens=700)
    assert imp["imported_from"][str(nano / "train.bin")] == "nanogpt" and imp["train_shards"] > 1
    assert np.array_equal(_stream(tmp_path / "imp2", "val"), _stream(tmp_path / "b", "val"))
    x, _ = TokenLoader(tmp_path / "imp2", "train", 2, 16, vocab_size=300).next_batch()
    assert np.array_equal(x.numpy(), xb.numpy())
    # a token id past the vocabulary and a damaged llm.c header are named
    with pytest.raises(ValueError, match="is >= the vocabulary size 100"):
        import_tokens(tmp_path / "imp3", [nano], vocab_size=100)
    bad = ext / "fineweb_train_000000.bin"
    data = bytearray(bad.read_bytes())
    data[8:12] = np.int32(10**6).tobytes()
    bad.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="llm.c header says 1000000 tokens"):
        TokenLoader(tmp_path / "imp", "train", 2, 16)
