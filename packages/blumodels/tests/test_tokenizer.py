"""Tokenizers: byte-level BPE round trips, GPT-2/tiktoken detection and loading from local files only."""

import hashlib
import json

import pytest
from blumodels.data import tokenizer as tk
from blumodels.data.tokenizer import Tokenizer, gpt2_tiktoken_available, load_tokenizer, train_bpe

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "def f(x):\n    return x * 2  # doubles\n" * 20,
    "Naïve café, résumé; Ünïcödé façade — “quotes” … " * 10,
    "数据管道 トークン 토큰 данные δεδομένα " * 10,
]
ROUND_TRIP = [
    "", "hello world", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n\n",
    "Ünïcödé façade", "日本語のテキスト", "emoji 🎉🚀 and ZWJ 👩‍👩‍👧", "\x00\x01\x7f control",
    "never seen: qzxjv wkpf", "<|endoftext|> inside text", "a" * 300, "mixed 123.456e-7 +=-*/",
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    return train_bpe(TEXTS, 400, save_dir=d), d


def test_bpe_round_trip(bpe):
    tok, _ = bpe
    assert isinstance(tok, Tokenizer)
    assert 257 <= tok.vocab_size <= 400 and tok.name == "bpe"
    for s in ROUND_TRIP:
        ids = tok.encode(s)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == s, s
    # merges were learnt: frequent text compresses below one token per byte
    s = "The quick brown fox jumps over the lazy dog."
    assert len(tok.encode(s)) < len(s.encode()) / 2


def test_bpe_eot_is_special(bpe):
    tok, _ = bpe
    assert tok.decode([tok.eot_token]) == "<|endoftext|>"
    assert tok.eot_token not in tok.encode("plain text without the marker")


def test_bpe_saved_and_loaded(bpe):
    tok, d = bpe
    assert (d / "tokenizer.json").is_file()
    meta = json.loads((d / "tokenizer_meta.json").read_text())
    assert meta == {"kind": "bpe", "name": "bpe", "vocab_size": tok.vocab_size, "eot_token": tok.eot_token}
    tok2 = load_tokenizer(d)
    for s in ROUND_TRIP:
        assert tok2.encode(s) == tok.encode(s)
    assert (tok2.vocab_size, tok2.eot_token) == (tok.vocab_size, tok.eot_token)


def test_train_bpe_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size must be >= 257"):
        train_bpe(TEXTS, 100)


def test_load_tokenizer_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer in"):
        load_tokenizer(tmp_path)


# ------------------------------------------------------------ GPT-2 through tiktoken (synthetic files)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's data-gym byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_fake_gpt2(directory, merges=(("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"))):
    """A small but well-formed pair of GPT-2 data-gym files (vocab.bpe, encoder.json)."""
    b2u = _bytes_to_unicode()
    order = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    order += [b for b in range(256) if b not in order]
    enc = {b2u[b]: i for i, b in enumerate(order)}
    for a, b in merges:
        enc[a + b] = len(enc)
    enc["<|endoftext|>"] = len(enc)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = directory / "vocab.bpe"
    vocab.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    encoder = directory / "encoder.json"
    encoder.write_text(json.dumps(enc), encoding="utf-8")
    return vocab, encoder, len(enc)


def _clear_env(monkeypatch, tmp_path):
    for k in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR", "BLUTRAIN_GPT2_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tk, "_packaged_gpt2_dir", lambda: None)  # the gpt2-tokenizer extra hidden too


def test_gpt2_unavailable_falls_back(monkeypatch, tmp_path):
    pytest.importorskip("tiktoken")
    _clear_env(monkeypatch, tmp_path)
    assert not gpt2_tiktoken_available()
    with pytest.raises(FileNotFoundError, match="GPT-2 encoding files"):
        tk.TiktokenGPT2.from_local()


def test_gpt2_from_tiktoken_cache(monkeypatch, tmp_path):
    """Files in tiktoken's cache, named by the SHA-1 of their URL, are found and used offline."""
    pytest.importorskip("tiktoken")
    _clear_env(monkeypatch, tmp_path)
    src, cache = tmp_path / "src", tmp_path / "cache"
    vocab, encoder, n = write_fake_gpt2(src)
    cache.mkdir()
    (cache / hashlib.sha1(tk.GPT2_VOCAB_BPE_URL.encode()).hexdigest()).write_bytes(vocab.read_bytes())
    (cache / hashlib.sha1(tk.GPT2_ENCODER_JSON_URL.encode()).hexdigest()).write_bytes(encoder.read_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    assert gpt2_tiktoken_available()
    tok = tk.TiktokenGPT2.from_local()
    assert (tok.name, tok.vocab_size, tok.eot_token) == ("gpt2", n, n - 1)
    ids = tok.encode(" the thin")
    assert ids[0] == n - 3  # the merged token "Ġthe"
    for s in ROUND_TRIP:
        assert tok.decode(tok.encode(s)) == s
    # saved beside the shards: loads with the cache gone
    out = tmp_path / "data"
    tok.save(out)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    assert not gpt2_tiktoken_available()
    tok2 = load_tokenizer(out)
    assert tok2.name == "gpt2" and tok2.encode("the thin in") == tok.encode("the thin in")


def test_gpt2_env_dir_and_mismatch(monkeypatch, tmp_path):
    pytest.importorskip("tiktoken")
    _clear_env(monkeypatch, tmp_path)
    write_fake_gpt2(tmp_path / "g")
    monkeypatch.setenv("BLUTRAIN_GPT2_DIR", str(tmp_path / "g"))
    assert gpt2_tiktoken_available()
    enc = json.loads((tmp_path / "g" / "encoder.json").read_text())
    enc["he"] += 1
    (tmp_path / "g" / "encoder.json").write_text(json.dumps(enc))
    with pytest.raises(ValueError, match="disagree"):
        tk.TiktokenGPT2.from_local()


def test_gpt2_from_the_registry_package_is_hash_checked(monkeypatch, tmp_path):
    """The gpt2-tokenizer extra's files are GPT-2's (tiktoken's pinned SHA-256) and give GPT-2's ids; a changed
    byte is refused, naming the file, before anything is encoded."""
    pytest.importorskip("tiktoken")
    pkg = tk._packaged_gpt2_dir()
    if pkg is None:
        pytest.skip("blumodels[gpt2-tokenizer] is not installed")
    for k in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR", "BLUTRAIN_GPT2_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    for name, want in tk.GPT2_SHA256.items():
        assert hashlib.sha256((pkg / name).read_bytes()).hexdigest() == want
    assert gpt2_tiktoken_available()
    tok = tk.TiktokenGPT2.from_local()
    assert (tok.vocab_size, tok.eot_token) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995] and tok.encode(" the") == [262]
    bad = tmp_path / "pkg"
    bad.mkdir()
    (bad / "encoder.json").write_bytes((pkg / "encoder.json").read_bytes())
    data = bytearray((pkg / "vocab.bpe").read_bytes())
    data[-2] ^= 1
    (bad / "vocab.bpe").write_bytes(bytes(data))
    monkeypatch.setattr(tk, "_packaged_gpt2_dir", lambda: bad)
    with pytest.raises(tk.TokenizerError, match=r"vocab.bpe: SHA-256 [0-9a-f]{64} is not GPT-2's vocab.bpe"):
        tk.TiktokenGPT2.from_local()
    monkeypatch.setattr(tk, "_packaged_gpt2_dir", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"blumodels\[gpt2-tokenizer\]"):
        tk.TiktokenGPT2.from_local()
