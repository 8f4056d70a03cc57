"""Bad input is refused up front with an error naming the culprit (config key and value, file and byte offset,
tensor and shapes), before a run starts or any state is overwritten (CPU, micro config)."""

import json
import shutil

import blutensor as bt
import numpy as np
import pytest
from blumodels.checkpoint.format import CheckpointError, load_checkpoint
from blumodels.cli import main
from blumodels.config import ConfigError, ModelConfig, apply_overrides, from_dict, load_config, load_preset
from blumodels.data.loader import LoaderError, TokenLoader
from blumodels.data.shards import HEADER_BYTES, ShardError, write_shard
from blumodels.data.tokenizer import TokenizerError
from blumodels.gpt2 import build_model
from blumodels.state import StateError, restore_training_state
from blumodels.trainer import Trainer
from models_helpers import micro_config, micro_data

# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("data,hint", [
    ({"model": {"n_embd": 64}}, r"unknown key model\.n_embd; did you mean 'model\.d_model'\?"),
    ({"train": {"micro_bach": 2}}, r"did you mean 'train\.micro_batch'\?"),
    ({"train": {"learning_rate": 1e-3}}, r"did you mean 'train\.lr'\?"),
    ({"trian": {"lr": 1e-3}}, r"unknown section \[trian\]; did you mean 'train'\?"),
])
def test_unknown_key_suggests_the_real_one(data, hint):
    with pytest.raises(ConfigError, match=hint):
        from_dict(data)


def test_key_outside_any_table_names_its_table(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("lr = 1e-3\n[model]\nn_layer = 2\n")
    with pytest.raises(ConfigError, match=r"key 'lr' = 0\.001 is outside any table; put it under \[train\]"):
        load_config(p)  # was: unknown section [lr]


def test_override_typo_suggests_the_real_one():
    with pytest.raises(ConfigError, match=r"override: unknown key train\.lrr; did you mean 'train\.lr'\?"):
        apply_overrides(load_preset("tiny"), ["train.lrr=1e-3"])


@pytest.mark.parametrize("data,msg", [
    ({"train": {"lr": float("nan")}}, r"train\.lr must be a finite number, got nan"),
    ({"train": {"peak_flops": float("inf")}}, r"train\.peak_flops must be a finite number, got inf"),
    ({"train": {"lr": 0, "min_lr": 0}}, r"train\.lr must be positive, got 0\.0"),
    ({"train": {"eps": 0}}, r"train\.eps must be positive, got 0\.0"),
    ({"train": {"temperature": 0}}, r"train\.temperature must be positive"),
    ({"model": {"ln_eps": 0}}, r"model\.ln_eps must be positive"),
    ({"model": {"family": "gtp2"}}, r"model\.family='gtp2' is not a family .*did you mean 'gpt2'"),
    ({"data": {"tokenizer": "bep"}}, r"data\.tokenizer must be one of auto, gpt2, bpe, got 'bep'; did you mean 'bpe'"),
    ({"data": {"shard_tokens": 1}}, r"data\.shard_tokens must be at least 2, got 1"),
    ({"train": {"device": "cudax"}}, r"train\.device must be .*got 'cudax'"),
    ({"train": {"device": "cuda:-1"}}, r"train\.device must be .*got 'cuda:-1'"),
    ({"train": {"precision": "BF16"}}, r"train\.precision must be 'fp32', 'tf32' or 'bf16', got 'BF16'; did you "
                                       r"mean 'bf16'\?"),
    ({"train": {"precision": "fp-32"}}, r"got 'fp-32'; did you mean 'fp32'\?"),
    ({"train": {"nan_policy": "Skip"}}, r"train\.nan_policy must be 'stop' or 'skip', got 'Skip'; did you mean 'skip'"),
    ({"train": {"sample_interval": 10}}, r"train\.sample_interval=10 samples nothing with train\.sample_tokens = 0"),
    ({"data": {"corpus": "pydoc"}}, r"data\.corpus must be a built-in corpus \(pydocs\), got 'pydoc'; did you mean"),
    ({"data": {"tokenizer": "bpe", "vocab_size": 100}}, r"data\.vocab_size=100 is too small for a byte-level BPE"),
])
def test_value_out_of_range_names_key_and_value(data, msg):
    with pytest.raises(ConfigError, match=msg):
        from_dict(data)


def test_config_lists_mirror_the_data_package():
    from blumodels import config
    from blumodels.data.corpus import BUILTIN_CORPORA
    from blumodels.data.prepare import TOKENIZER_CHOICES

    assert config.BUILTIN_CORPORA == BUILTIN_CORPORA and config.TOKENIZERS == TOKENIZER_CHOICES


def test_nan_override_is_refused():
    with pytest.raises(ConfigError, match=r"train\.lr must be a finite number, got nan"):
        apply_overrides(load_preset("tiny"), ["train.lr=nan"])  # NaN compared False against min_lr: slipped through


def test_toml_that_is_not_text_or_not_a_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_bytes(b"[model]\nn_layer = 2 # \xff\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not UTF-8 text \(byte b'\\xff' at offset 22\)"):
        load_config(p)
    with pytest.raises(ConfigError, match=rf"config file {tmp_path} cannot be read"):
        load_config(tmp_path)


# ---------------------------------------------------------------------------------------------- model


def test_hand_built_model_config_is_checked():
    with pytest.raises(ConfigError, match=r"model\.n_head=5 does not divide model\.d_model=32"):
        build_model(ModelConfig(n_layer=1, n_head=5, d_model=32, block_size=16, vocab_size=50))


def test_model_family_plugin_checks_a_dict_config():
    from blumodels.hooks import GPT2Family

    m = GPT2Family.build({"n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8, "vocab_size": 50}, seed=0)
    assert m.wte.weight.shape == (64, 16)
    with pytest.raises(ConfigError, match=r"unknown key model\.n_embd; did you mean 'model\.d_model'"):
        GPT2Family.build({"n_embd": 16})  # was AttributeError: 'dict' object has no attribute ...
    with pytest.raises(ConfigError, match="expected a ModelConfig, RunConfig or dict"):
        GPT2Family.build(42)


def test_forward_names_bad_shapes():
    m = build_model(ModelConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=50), seed=0)
    ones = lambda *s: bt.tensor(np.ones(s, np.int64), dtype=bt.int64)  # noqa: E731
    with pytest.raises(ValueError, match=r"idx must be \(batch, seq\) token ids, got shape \(8,\)"):
        m(ones(8))
    with pytest.raises(ValueError, match=r"targets shape \(2, 7\) != idx shape \(2, 8\)"):
        m(ones(2, 8), ones(2, 7))


# ---------------------------------------------------------------------------------------------- data


def _copy_data(tmp_path, name="data"):
    d = tmp_path / name
    shutil.copytree(micro_data(), d)
    return d


def test_token_beyond_vocab_named_by_file_and_offset_at_open(tmp_path):
    toks = (np.arange(3000) % 500).astype(np.uint16)
    toks[2500] = 777
    write_shard(tmp_path / "train_00000.bin", toks)
    TokenLoader(tmp_path, "train", 2, 8)  # no vocab_size: no scan, as before
    with pytest.raises(ShardError, match=rf"train_00000\.bin: token id 777 \(token 2500\) is >= the vocabulary "
                                         rf"size 512 at offset {HEADER_BYTES + 2 * 2500}") as e:
        TokenLoader(tmp_path, "train", 2, 8, vocab_size=512)
    assert e.value.offset == HEADER_BYTES + 5000
    TokenLoader(tmp_path, "train", 2, 8, vocab_size=778)  # every id below it: fine


def test_trainer_refuses_tokens_beyond_the_data_vocab_before_step_0(tmp_path):
    d = _copy_data(tmp_path)
    toks = (np.arange(4000) % 512).astype(np.uint16)
    toks[3999] = 600  # inside the padded rows of model.vocab_size 640: used to train silently
    write_shard(d / "train_00000.bin", toks)
    cfg = micro_config(d, steps=2, eval_interval=0)
    cfg.model.vocab_size = 640
    with pytest.raises(ShardError, match=r"train_00000\.bin: token id 600 \(token 3999\) is >= the vocabulary "
                                         r"size 512"):
        Trainer(cfg, tmp_path / "run", quiet=True)


def test_empty_shard_says_so(tmp_path):
    (tmp_path / "train_00000.bin").write_bytes(b"")
    with pytest.raises(ShardError, match=r"train_00000\.bin: empty file \(0 bytes"):
        TokenLoader(tmp_path, "train", 2, 8)


def test_given_data_dir_without_meta_is_an_error_and_keeps_its_shards(tmp_path):
    d = _copy_data(tmp_path)
    (d / "meta.json").unlink()
    shards = sorted(p.name for p in d.glob("*.bin"))
    with pytest.raises(ConfigError, match=r"data\.dir='.*' has token shards but no meta\.json: run `blutrain prepare"):
        Trainer(micro_config(d), tmp_path / "run", quiet=True)
    assert sorted(p.name for p in d.glob("*.bin")) == shards  # prepare() used to replace them with pydocs
    with pytest.raises(ConfigError, match=r"data\.dir='.*nope' does not exist"):
        Trainer(micro_config(tmp_path / "nope"), tmp_path / "run", quiet=True)


@pytest.mark.parametrize("text,msg", [
    ("{oops", r"meta\.json is not readable JSON"),
    ("[1, 2]", r"meta\.json must hold a JSON object, got list"),
    ('{"vocab_size": "lots"}', r"meta\.json: vocab_size must be a positive integer, got 'lots'"),
])
def test_malformed_meta_json_names_the_file(tmp_path, text, msg):
    d = _copy_data(tmp_path)
    (d / "meta.json").write_text(text)
    with pytest.raises(ConfigError, match=msg):
        Trainer(micro_config(d), tmp_path / "run", quiet=True)


def test_damaged_tokenizer_fails_before_training_when_sampling_is_on(tmp_path):
    d = _copy_data(tmp_path)
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    Trainer(micro_config(d, sample_tokens=0), tmp_path / "a", quiet=True).close()  # not needed: not read
    with pytest.raises(TokenizerError, match=r"tokenizer\.json cannot be read"):
        Trainer(micro_config(d, sample_tokens=8), tmp_path / "b", quiet=True)  # used to fail after the last step


def test_failed_data_preparation_is_told_to_every_rank(tmp_path, monkeypatch):
    """Rank 0 prepares <out>/data while the others wait: a failure must reach them, not leave them in a barrier."""
    import importlib

    import blumodels.trainer as trainer_mod
    from blumodels.dist import Dist

    votes, rank0 = [], []

    class TwoRanks(Dist):  # the collectives as rank ``rank`` of 2 would see them, against rank 0's votes
        def min_int(self, value, device="cpu"):
            votes.append(value)
            if self.rank == 0:
                rank0.append(value)
                return value
            return min(value, rank0[len(votes) - len(rank0) - 1])

    def broken_prepare(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(importlib.import_module("blumodels.data.prepare"), "prepare", broken_prepare)
    cfg = micro_config()
    cfg.data.dir = ""
    for rank, err, msg in ((0, OSError, "disk full"), (1, ConfigError, "rank 0 could not prepare the data")):
        monkeypatch.setattr(trainer_mod.Dist, "from_config", classmethod(lambda c, w, r=rank: TwoRanks(r, 2)))
        with pytest.raises(err, match=msg):
            Trainer(cfg, tmp_path / f"rank{rank}", quiet=True)
    # rank 0 took the run lock (1), voted "failed" (0) and still took part; rank 1 learnt it from that vote
    assert votes == [1, 0, 1, 1]


# ---------------------------------------------------------------------------------------------- run directory


def test_unwritable_run_or_checkpoint_directory_is_refused_at_start(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"the run directory \(--out\) .*file is not a writable directory"):
        Trainer(micro_config(), tmp_path / "file", quiet=True)
    (tmp_path / "run" / "checkpoints").parent.mkdir()
    (tmp_path / "run" / "checkpoints").write_text("x")
    with pytest.raises(ConfigError, match=r"the checkpoint directory .*checkpoints is not a writable directory"):
        Trainer(micro_config(), tmp_path / "run", quiet=True)


# ---------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 2-step run with its final checkpoint (step 2)."""
    out = tmp_path_factory.mktemp("finished")
    tr = Trainer(micro_config(steps=2, eval_interval=0, checkpoint_interval=0), out, quiet=True)
    tr.fit()
    tr.close()
    return out


def _clone(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out, out / "checkpoints" / "step_00000002.rank0.safetensors"


def test_resume_refuses_when_no_checkpoint_verifies(finished, tmp_path):
    out, ck = _clone(finished, tmp_path)
    data = ck.read_bytes()
    ck.write_bytes(data[: len(data) // 2])
    log = (out / "log.jsonl").read_text()
    with pytest.raises(CheckpointError, match=r"none that verifies .*step_00000002\.rank0\.safetensors: truncated"):
        Trainer(micro_config(steps=2, eval_interval=0), out, resume=True, quiet=True)  # was: silently step 0
    assert (out / "log.jsonl").read_text() == log and ck.stat().st_size == len(data) // 2


def test_resume_refuses_another_model_config_and_keeps_config_json(finished, tmp_path):
    out, _ = _clone(finished, tmp_path)
    before = (out / "config.json").read_text()
    cfg = micro_config(steps=2, eval_interval=0)
    cfg.model.n_head = 4  # same parameter shapes: used to resume silently
    with pytest.raises(ConfigError, match=r"model\.n_head=2 in the checkpoint, 4 now"):
        Trainer(cfg, out, resume=True, quiet=True)
    assert (out / "config.json").read_text() == before
    with pytest.raises(ConfigError, match=r"train\.micro_batch=4 in the checkpoint, 2 now"):
        Trainer(micro_config(steps=2, micro_batch=2, batch_tokens=64), out, resume=True, quiet=True)


def test_damaged_checkpoint_header_is_a_checkpoint_error(finished, tmp_path):
    from blumodels.checkpoint.format import read_checkpoint_meta

    def craft(metadata):
        head = json.dumps({"__metadata__": metadata}).encode()
        head += b" " * (-(len(head) + 8) % 8)
        p = tmp_path / "c.safetensors"
        p.write_bytes(len(head).to_bytes(8, "little") + head)
        return p

    for md, msg in [(5, "is not a map of strings"), ({"format": "blutrain-checkpoint", "format_version": 1},
                                                     "is not a map of strings")]:
        for fn in (load_checkpoint, read_checkpoint_meta):  # were AttributeError / TypeError
            with pytest.raises(CheckpointError, match=msg):
                fn(craft(md))
    p = craft({"format": "blutrain-checkpoint", "format_version": "1", "meta": "{"})
    with pytest.raises(CheckpointError, match="lacks a JSON 'meta' entry"):  # was a JSONDecodeError
        read_checkpoint_meta(p)


def test_resume_past_the_schedule_and_sample_with_another_model(finished, tmp_path, capsys):
    out, _ = _clone(finished, tmp_path)
    with pytest.raises(ConfigError, match=r"it is at step 2, past train\.steps=1"):  # was a silent no-op
        Trainer(micro_config(steps=1, eval_interval=0), out, resume=True, quiet=True)
    Trainer(micro_config(steps=2, eval_interval=0), out, resume=True, quiet=True).close()  # finished: fine
    assert main(["sample", "--out", str(out), "--tokens", "2", "model.n_head=4"]) == 2  # sampled silently
    assert "model.n_head=2 in the checkpoint, 4 now" in capsys.readouterr().err


def test_resume_failure_on_another_rank_stops_this_one(finished, tmp_path, monkeypatch):
    """This rank's checkpoint is fine, another rank's is not: the vote after the checks stops both (this rank
    would otherwise train on, into the first all-reduce, and wait forever)."""
    import blumodels.trainer as trainer_mod
    from blumodels.dist import Dist

    class PeerFailed(Dist):
        calls = 0

        def min_int(self, value, device="cpu"):  # 1st: the agreed step; 2nd: the vote, where a peer said 0
            PeerFailed.calls += 1
            return value if PeerFailed.calls == 1 else 0

    out, _ = _clone(finished, tmp_path)
    monkeypatch.setattr(trainer_mod.Dist, "from_config", classmethod(lambda c, w: PeerFailed()))
    with pytest.raises(CheckpointError, match="another rank cannot restore its checkpoint of this step"):
        Trainer(micro_config(steps=2, eval_interval=0), out, resume=True, quiet=True)
    assert PeerFailed.calls == 2


def test_restore_checks_everything_before_writing(finished):
    tensors, meta = load_checkpoint(finished / "checkpoints" / "step_00000002.rank0.safetensors")
    cfg = micro_config()
    cfg.model.vocab_size = 512
    model = build_model(cfg.model, seed=3)
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    bad = {**tensors, "model.ln_f.weight": np.zeros(7, np.float32)}  # the last parameter restored
    with pytest.raises(StateError, match=r"model\.ln_f\.weight has shape \(7,\), the model's parameter has \(32,\)"):
        restore_training_state(bad, meta, model)
    assert all(np.array_equal(before[n], p.numpy()) for n, p in model.named_parameters())
    with pytest.raises(StateError, match=r"model\.ln_f\.weight has dtype int64"):
        restore_training_state({**tensors, "model.ln_f.weight": np.zeros(32, np.int64)}, meta, model)
    with pytest.raises(StateError, match=r"no integer 'step'"):
        restore_training_state(tensors, {k: v for k, v in meta.items() if k != "step"}, model)
    loader = TokenLoader(micro_data(), "train", 2, 32)
    with pytest.raises(LoaderError, match=r"saved batch_size=4 but this loader has batch_size=2"):
        restore_training_state(tensors, meta, model, loader=loader)
    assert all(np.array_equal(before[n], p.numpy()) for n, p in model.named_parameters())


def test_resume_without_checkpoints_drops_the_stale_log(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")  # killed before its first save
    tr = Trainer(micro_config(steps=2, eval_interval=0), out, resume=True, quiet=True)
    assert tr.step == 0 and (out / "log.jsonl").read_text() == ""  # step 0 is redone, not logged twice
    tr.close()


def test_resume_drops_a_log_line_cut_short(finished, tmp_path):
    out, _ = _clone(finished, tmp_path)
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # killed mid-write: used to be a JSONDecodeError on --resume
    tr = Trainer(micro_config(steps=2, eval_interval=0), out, resume=True, quiet=True)
    assert tr.step == 2 and [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [0, 1]
    tr.close()


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_stop_at_outside_the_schedule(tmp_path, capsys):
    args = ["train", "--preset", "tiny", "--steps", "5", "--out", str(tmp_path / "run"), "--data", str(micro_data())]
    assert main([*args, "--stop-at", "9"]) == 2
    assert "--stop-at 9 must be in 1..train.steps=5" in capsys.readouterr().err
    assert main([*args, "--stop-at", "0"]) == 2
    assert not (tmp_path / "run").exists()  # refused before the run directory is touched


@pytest.mark.parametrize("args,msg", [(["sample", "--tokens", "-5"], "argument --tokens: must be positive, got -5"),
                                      (["eval", "--batches", "0"], "argument --batches: must be positive, got 0"),
                                      (["sample", "--temperature", "nan"], "argument --temperature: must be positive")])
def test_cli_numbers_must_be_positive(args, msg, capsys):
    with pytest.raises(SystemExit):
        main([*args, "--out", "unused"])
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("args,msg", [(["--vocab-size", "10"], "argument --vocab-size: must be >= 257, got 10"),
                                      (["--val-fraction", "1.5"], "argument --val-fraction: must be >= 0.0 and < 1.0"),
                                      (["--shard-tokens", "1"], "argument --shard-tokens: must be >= 2, got 1"),
                                      (["--max-bytes", "-5"], "argument --max-bytes: must be >= 0, got -5"),
                                      (["--corpus", "pydoc"], "argument --corpus: invalid choice: 'pydoc'")])
def test_cli_prepare_refuses_bad_numbers_before_reading_the_corpus(args, msg, tmp_path, capsys):
    with pytest.raises(SystemExit):  # --max-bytes -5 used to prepare a corpus; the others failed after reading it
        main(["prepare", "--out", str(tmp_path / "d"), *args])
    assert msg in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_prepare_source_that_is_not_text(tmp_path, capsys):
    from blumodels.data.corpus import CorpusError, read_texts

    (tmp_path / "a.txt").write_text("plain text\n")
    (tmp_path / "b.txt").write_bytes("utf-16 text".encode("utf-16"))  # used to become U+FFFD soup, silently
    with pytest.raises(CorpusError, match=r"b\.txt is not UTF-8 text \(NUL byte at offset 3; binary, or UTF-16\?\)"):
        read_texts([tmp_path])
    (tmp_path / "e").mkdir()
    assert main(["prepare", "--out", str(tmp_path / "d"), "--source", str(tmp_path / "e"), "--corpus", "none"]) == 1
    assert "prepare: no documents in" in capsys.readouterr().err


def test_cli_reports_bad_checkpoints_without_traceback(finished, tmp_path, capsys):
    out, ck = _clone(finished, tmp_path)
    raw = bytearray(ck.read_bytes())
    raw[-100] ^= 0xFF
    ck.write_bytes(bytes(raw))
    assert main(["train", "--out", str(out), "--resume", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "blutrain: error: checkpoint" in err and "checksum mismatch" in err and "Traceback" not in err
    (out / "config.json").write_text("{oops")
    assert main(["sample", "--out", str(out)]) == 2
    assert "config.json is not readable JSON" in capsys.readouterr().err


def test_fit_beyond_the_schedule_is_refused(tmp_path):
    tr = Trainer(micro_config(steps=2, eval_interval=0), tmp_path, quiet=True)
    with pytest.raises(ConfigError, match=r"stop step 3 must be in 1\.\.train\.steps=2"):
        tr.fit(3)
    tr.close()
