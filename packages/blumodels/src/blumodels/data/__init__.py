"""Data pipeline: built-in corpus and text files -> tokenizer -> token shards -> TokenLoader."""

from .corpus import builtin_corpus, read_texts
from .loader import LoaderError, TokenLoader
from .prepare import load_meta, prepare
from .shards import (
    FORMAT_VERSION,
    MAGIC,
    ShardError,
    ShardTokens,
    check_token_range,
    list_shards,
    open_shard,
    write_shard,
)
from .tokenizer import Tokenizer, gpt2_tiktoken_available, load_tokenizer, train_bpe

__all__ = ["FORMAT_VERSION", "MAGIC", "LoaderError", "ShardError", "ShardTokens", "TokenLoader", "Tokenizer",
           "builtin_corpus", "check_token_range", "gpt2_tiktoken_available", "list_shards", "load_meta",
           "load_tokenizer", "open_shard", "prepare", "read_texts", "train_bpe", "write_shard"]
