"""Trainer: gradient accumulation, AdamW, warmup+cosine LR, clipping, validation, NaN policy,
JSON-lines logs, progress bar, checkpoints with bit-exact resume, loss-curve PNG.

AdamW decays 2-D weights only (matmul weights and the embeddings), never biases or LayerNorm
parameters, as nanoGPT and llm.c do.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import numbers
import os
import sys
import time
from pathlib import Path
from typing import Any

import blutensor as bt
import numpy as np
from blutensor.optim.lr_scheduler import warmup_cosine

from blumodels import metrics
from blumodels.checkpoint.format import CheckpointError
from blumodels.config import ConfigError, RunConfig
from blumodels.dist import Dist
from blumodels.families import build_model
from blumodels.gpt2 import GPT2
from blumodels.state import (
    check_sharded_state,
    check_training_state,
    restore_sharded_state,
    restore_training_state,
    sharded_training_state,
    training_state,
)


class NonFiniteError(RuntimeError):
    """A loss or gradient became NaN/Inf; the message names the step and the tensor."""

    fatal = True  # raised only under train.nan_policy = "stop": an orchestrator must not retry it


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when bt.cuda.is_available() else 'cpu'; 'cuda' without a GPU is an error."""
    if name == "auto":
        return "cuda" if bt.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not bt.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but no CUDA GPU is usable here "
                          "(install cupy-cuda12x/cupy-cuda13x on a GPU machine, or use --device cpu)")
    return name


def ensure_data(cfg: RunConfig, out_dir: Path, log=print) -> Path:
    """The data directory: ``data.dir`` must hold prepared data; "" = ``<out>/data``, where ``prepare`` runs on
    the configured corpus when meta.json is missing (a mistyped data.dir is an error, not a new corpus)."""
    if cfg.data.dir:
        d = Path(cfg.data.dir)
        if not (d / "meta.json").is_file():
            from blumodels.data.shards import list_shards

            what = ("does not exist" if not d.exists() else "is not a directory" if not d.is_dir() else
                    "has token shards but no meta.json" if list_shards(d, "train") or list_shards(d, "val")
                    else "holds no prepared data (no meta.json)")
            raise ConfigError(f"data.dir={str(d)!r} {what}: run `blutrain prepare --out {d}` first, or leave "
                              "data.dir empty to prepare the configured corpus under <out>/data")
        return d
    d = out_dir / "data"
    if not (d / "meta.json").is_file():
        from blumodels.data.prepare import prepare

        log(f"[blutrain] no prepared data in {d}: preparing corpus {cfg.data.corpus!r} "
            f"(tokenizer {cfg.data.tokenizer}, vocab {cfg.data.vocab_size}) ...")
        t0 = time.perf_counter()
        prepare(d, corpus=cfg.data.corpus, tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.vocab_size,
                val_fraction=cfg.data.val_fraction, shard_tokens=cfg.data.shard_tokens, seed=cfg.data.seed,
                max_corpus_bytes=cfg.data.max_bytes or None, log_fn=log)
        log(f"[blutrain] prepared {d} in {time.perf_counter() - t0:.1f}s")
    return d


def data_meta(data_dir: Path) -> dict[str, Any]:
    """meta.json of a prepared data directory; ConfigError naming the file when missing or malformed."""
    p = Path(data_dir) / "meta.json"
    try:
        meta = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"data.dir={str(data_dir)!r} has no meta.json: run `blutrain prepare --out "
                          f"{data_dir}` first") from None
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{p} is not readable JSON ({e}): re-run `blutrain prepare --out {data_dir}`") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{p} must hold a JSON object, got {type(meta).__name__}")
    dv = meta.get("vocab_size")
    if isinstance(dv, bool) or not isinstance(dv, int) or dv <= 0:
        raise ConfigError(f"{p}: vocab_size must be a positive integer, got {dv!r}")
    return meta


def fit_vocab(cfg: RunConfig, meta: dict[str, Any]) -> None:
    """Set model.vocab_size from the data when 0; refuse a model vocabulary smaller than the data's."""
    dv = int(meta["vocab_size"])
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = dv
    elif cfg.model.vocab_size < dv:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's vocabulary "
                          f"({dv}, tokenizer {meta.get('tokenizer')})")


def make_optimizer(model: GPT2, cfg: RunConfig, device: str = "cpu") -> bt.optim.AdamW:
    """AdamW over the decay / no-decay groups; fused (one launch) on CUDA when train.fused_adamw."""
    t = cfg.train
    fused = bool(t.fused_adamw and device.startswith("cuda"))
    return bt.optim.AdamW(model.param_groups(t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                          weight_decay=t.weight_decay, fused=fused)


def lr_at(step: int, cfg: RunConfig) -> float:
    t = cfg.train
    return warmup_cosine(step, t.lr, t.min_lr, t.warmup_steps, t.steps)


#: keys a checkpoint must agree on to be resumed: the model's shape (dropout may change; init_std no longer
#: matters) and the batch shape the saved data position counts in
RESUME_KEYS = {"model": ("family", "n_layer", "n_head", "d_model", "block_size", "vocab_size", "vocab_multiple",
                         "bias", "ln_eps", "n_kv_heads", "rope_theta", "rope_scaling", "rope_factor",
                         "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len", "ffn_hidden",
                         "ffn_dim_multiple", "ffn_dim_multiplier", "tie_embeddings"),
               "train": ("micro_batch", "seq_len", "world_size")}


def check_resume_config(path: str | Path, meta: dict[str, Any], cfg: RunConfig,
                        sections: tuple[str, ...] = ("model", "train")) -> None:
    """ConfigError naming each key of ``sections`` where the checkpoint's config differs from ``cfg``, before any
    state is touched (n_head, for one, changes no shape and would otherwise resume silently)."""
    saved = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(saved, dict):
        return  # written without a config (a custom loop): the checks of restore_training_state remain
    diff = []
    for sec, keys in ((k, v) for k, v in RESUME_KEYS.items() if k in sections):
        old, now = saved.get(sec), getattr(cfg, sec)
        if isinstance(old, dict):
            if sec == "train" and _resharded(saved, cfg):  # another layout of the same global batch: resharded
                keys = tuple(k for k in keys if k not in ("micro_batch", "world_size"))
                rows = _global_rows(saved), cfg.train.micro_batch * cfg.data_parallel_size
                if rows[0] != rows[1]:
                    diff.append(f"micro_batch*data-parallel ranks={rows[0]} in the checkpoint, {rows[1]} now")
            diff += [f"{sec}.{k}={old[k]!r} in the checkpoint, {getattr(now, k)!r} now" for k in keys
                     if k in old and old[k] != getattr(now, k)]
    if diff:
        raise ConfigError(f"cannot resume from {path}: it was written with another config ({'; '.join(diff)})")


def _sharded_dict(par: Any) -> bool:
    return isinstance(par, dict) and any(int(par.get(k, 1)) > 1 for k in ("fsdp", "tp", "cp"))


def _resharded(saved: dict, cfg: RunConfig) -> bool:
    """True when the checkpoint or this run keeps a full (single-process format) state of a sharded layout."""
    return _sharded_dict(saved.get("parallel")) or cfg.parallel.sharded


def _global_rows(saved: dict) -> int:
    """Batch rows per micro-step over all data-parallel ranks in a saved config."""
    t, p = saved.get("train", {}), saved.get("parallel") or {}
    return int(t.get("micro_batch", 0)) * max(int(t.get("world_size", 1)) //
                                                max(int(p.get("tp", 1)) * int(p.get("cp", 1)), 1), 1)


def _check_writable_dir(d: Path, what: str) -> None:
    """Create ``d`` and write a probe file in it: ConfigError naming it now instead of an OSError at the first save."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".blutrain-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{what} {d} is not a writable directory: {e.strerror or e}") from None


def _hook():
    from blutensor.ext import get_host

    return get_host().hook


def _eta(tr: Any, step: int, total: int) -> str:
    """'elapsed 12s, ETA 1m05s' for progress lines (from the first step this process reported)."""
    now = time.perf_counter()
    t0, s0 = tr.__dict__.setdefault("_eta_start", (now, step))
    done = step + 1 - s0
    left = (now - t0) / done * (total - step - 1) if done > 0 and now > t0 else 0.0

    def fmt(sec: float) -> str:
        m, sec = divmod(int(round(sec)), 60)
        h, m = divmod(m, 60)
        return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"

    return f"elapsed {fmt(now - t0)}, ETA {fmt(left)}"


def _in_policy(fn):
    """Run a Trainer method under the run's execution policy (``self.policy``, once built)."""

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        pol = getattr(self, "policy", None)
        if pol is None:
            return fn(self, *args, **kwargs)
        with pol.use():
            return fn(self, *args, **kwargs)

    return run


class Trainer:
    """Trains a GPT-2 from a RunConfig into ``out_dir`` (log.jsonl, checkpoints/, loss.png).

    ``resume=True`` continues from the newest verified checkpoint in ``out_dir/checkpoints`` (falling
    back past corrupt ones); the losses that follow equal those of an uninterrupted run. Without it, a directory
    holding an earlier run's checkpoints is refused unless ``overwrite=True`` (which deletes them).
    """

    def __init__(self, cfg: RunConfig, out_dir: str | Path, resume: bool = False, quiet: bool = False,
                 progress: bool | None = None, overwrite: bool = False):
        self._run_lock = None
        try:
            self._init(cfg, out_dir, resume, quiet, progress, overwrite)
        except BaseException as e:  # the directory is free again, and an orchestrator learns why
            from blumodels.lifecycle import report_end

            report_end("failed", 0, e)
            self.close_lock()
            raise

    def _init(self, cfg: RunConfig, out_dir: str | Path, resume: bool, quiet: bool, progress: bool | None,
              overwrite: bool) -> None:
        if resume and overwrite:
            raise ConfigError("Trainer: resume=True and overwrite=True contradict each other (continue the earlier "
                              "run, or delete it and start over)")
        self.overwrite = overwrite
        self.cfg = cfg.validate()
        if cfg.train.init_from:  # a Hugging Face directory that does not fit the model is named before any work
            from blumodels.hf import check_init_from

            check_init_from(cfg.train.init_from, cfg)
        self.dist = Dist.from_config(cfg.train.world_size)
        self.out = Path(out_dir)
        _check_writable_dir(self.out, "the run directory (--out)")
        _check_writable_dir(self.out / "checkpoints", "the checkpoint directory")
        self.quiet = quiet or not self.dist.is_main
        self.progress = sys.stdout.isatty() if progress is None else progress
        self.device = self.dist.device(resolve_device(cfg.train.device))
        self._own_run_dir()  # before anything in --out is read or changed
        from blumodels.limits import check_fits

        check_fits(cfg, self.device)  # before preparing data for a model that cannot fit (again once vocab is known)
        if cfg.train.cuda_graph is True and not self.device.startswith("cuda"):
            raise ConfigError(f"train.cuda_graph = true needs a CUDA device; train.device={cfg.train.device!r} "
                              f"resolved to {self.device!r} (set train.cuda_graph = false or \"auto\" on CPU)")
        # CPU threads (GEMM row blocks and the compiled kernels): train.threads, else blutensor's default (an
        # earlier bt.set_num_threads call by a launcher, or the usable cores divided by the ranks on this node)
        bt.set_num_threads(cfg.train.threads or bt.get_num_threads())
        from blumodels.execution import policy_from_config

        # precision, fp32_gemm, the GEMM provider and determinism: one policy, the one place they are chosen; the
        # rest of the set-up and every public method run inside it (_in_policy)
        self.policy = policy_from_config(cfg.train, self.device)
        with self.policy.use():
            self._init_run(cfg, resume)

    def _init_run(self, cfg: RunConfig, resume: bool) -> None:
        """The set-up that runs under the run's execution policy: data, model, optimizer, loaders, step, resume."""
        if not cfg.data.dir:  # rank 0 prepares <out>/data when missing, the other ranks then find it prepared
            failed: BaseException | None = None
            if self.dist.is_main:
                try:
                    self.data_dir = ensure_data(cfg, self.out, self.log)
                except Exception as e:  # told to the other ranks below instead of leaving them in a barrier
                    failed = e
            self._agree(failed, ConfigError(f"rank 0 could not prepare the data in {self.out / 'data'} (its error "
                                            f"says why)"))  # the barrier, with a verdict
        self.data_dir = ensure_data(cfg, self.out, self.log)  # a given data.dir: every rank checks it (no barrier)
        self.meta = data_meta(self.data_dir)
        fit_vocab(cfg, self.meta)
        if cfg.train.init_from:
            from blumodels.hf import check_init_vocab

            check_init_vocab(cfg.train.init_from, cfg, self.meta)
        self._tokenizer = None
        if cfg.train.sample_tokens:  # every rank: a broken tokenizer fails now, not after training, and everywhere
            from blumodels.data.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.data_dir)
        from blumodels.data.shards import verify_shards

        verify_shards(self.data_dir, self.meta, self._tokenizer)  # checksums and the tokenizer, before any step
        from blumodels.limits import check_fits
        from blumodels.memory import DeviceMemory

        check_fits(cfg, self.device)  # a model that cannot fit is refused by its sizes before it is built
        self.memory = DeviceMemory(self.device, cfg.train.allocator)  # before the model: it allocates through it
        self.model = build_model(cfg.model, device=self.device, seed=cfg.train.seed)
        self.model.lean_logits = True  # CUDA: the loss writes the logits' gradient over them (one buffer less)
        if cfg.train.activation_checkpointing:
            from blutensor.utils import checkpoint_modules

            checkpoint_modules(self.model, getattr(self.model, "block_pattern", "blocks.*"))  # the repeated blocks
        flops_per_token = self.model.flops_per_token(cfg.train.seq_len)  # of the whole model, before sharding
        self.module = self.dist.wrap(self.model, cfg)  # [parallel] mesh (FSDP/TP/CP), DDP when world_size > 1
        self.sharded = self.dist.par is not None
        self.optimizer = make_optimizer(self.dist.param_source(self.model), cfg, self.device)
        if cfg.train.optimizer_in_backward:
            from blutensor.utils import OptimizerInBackward

            self.optimizer = OptimizerInBackward(self.optimizer)  # config refused accum/clip/DDP/skip
        self.params = self.dist.local_parameters(self.model, self.module)
        from blumodels.data.loader import TokenLoader

        t, r, w = cfg.train, self.dist.data_rank, self.dist.data_world  # rows: dp x fsdp; TP/CP ranks share them
        cps = self.dist.seq_shard  # CP: this rank's load-balanced sequence chunks, cut by the loader
        dv = int(self.meta["vocab_size"])  # every token id is checked against it now, not at the step that meets it
        self.train_loader = TokenLoader(self.data_dir, "train", t.micro_batch, t.seq_len, rank=r, world_size=w,
                                        device=self.device, vocab_size=dv, seq_shard=cps)
        self.val_loader = TokenLoader(self.data_dir, "val", t.micro_batch, t.seq_len, rank=r, world_size=w,
                                      device=self.device, vocab_size=dv, seq_shard=cps)
        from blumodels.checkpoint.manager import CheckpointManager

        # a sharded run keeps one full checkpoint (single-process format, written by rank 0, read by all), so its
        # commit is rank 0's alone
        self.ckpt = CheckpointManager(self.out / "checkpoints", rank=0 if self.sharded else self.dist.rank,
                                      keep=t.keep_checkpoints, async_save=t.async_checkpoint,
                                      world_size=1 if self.sharded else self.dist.world, on_saved=self._on_saved)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.resumed_from: str | None = None
        self.flops_per_token = flops_per_token
        self.peak = metrics.peak_flops(self.device.split(":")[0], t.precision, t.peak_flops)
        self._build_step()
        if resume:
            self.resume()
        else:
            self._fresh_start()
        if cfg.train.init_from and self.resumed_from is None:  # a resumed run keeps its checkpoint's weights
            from blumodels.hf import load_into

            load_into(self.model, cfg.train.init_from)
            self.log(f"[blutrain] weights from the Hugging Face directory {cfg.train.init_from}")
        if self.dist.is_main:  # after resume() accepted the checkpoint: a refused resume leaves it as it was
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        from blumodels.loggers import start_loggers

        self.loggers = start_loggers(cfg, self.out, self.dist.is_main, log=self.log)  # plugins on the step hooks

    # ------------------------------------------------------------------ bookkeeping
    def log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, flush=True)

    @property
    def log_path(self) -> Path:
        return self.out / "log.jsonl"

    @_in_policy
    def resume(self) -> bool:
        """Restore the newest good checkpoint; returns False when there is none.

        Checkpoint files none of which verifies, or a checkpoint of another model shape, are errors (the
        run's files are left as they are) rather than a silent start from step 0.
        """
        found, step, agreed = self._agree_resume_step()  # every rank resumes from the same committed step
        if agreed == -2:  # some rank (maybe this one) has checkpoint files but none that verifies
            raise CheckpointError(self.out / "checkpoints", self._unusable_report())
        if agreed == -1 and (newest := -self.dist.min_int(-step, self.device)) >= 0:
            raise CheckpointError(self.out / "checkpoints", f"--resume: some rank has no checkpoint file while "
                                  f"another has up to step {newest} (this rank: "
                                  f"{'none' if step < 0 else f'step {step}'}); restore the missing rank's files, or "
                                  f"start over with --overwrite")
        if agreed < 0:
            self.log(f"[blutrain] no checkpoint in {self.out / 'checkpoints'} (on every rank): starting from step 0")
            self.ckpt.discard_after(-1)  # uncommitted parts of a save that never completed
            self._truncate_log(0)
            return False
        path = self.ckpt.path_for(agreed)
        failed: BaseException | None = None
        try:
            if found is None or agreed != step:  # the agreed committed step (maybe older than this rank's newest)
                found = self.ckpt.load(agreed)
            path, tensors, meta = found
            check_resume_config(path, meta, self.cfg)
            if int(meta["step"]) > self.cfg.train.steps:
                raise ConfigError(f"cannot resume from {path}: it is at step {meta['step']}, past train.steps="
                                  f"{self.cfg.train.steps} (the end of the LR schedule); raise train.steps (--steps)")
            if self.sharded:
                check_sharded_state(tensors, meta, self.dist.par, self.optimizer, self.train_loader)
            else:
                check_training_state(tensors, meta, self.model, self.optimizer, self.train_loader)
        except Exception as e:  # every rank learns of it below: one rank alone must not go on into a collective
            failed = e
        self._agree(failed, CheckpointError(path, "another rank cannot restore its checkpoint of this step (its error "
                                                  "says why)"))
        if self.sharded:  # resharded from the full state: any layout resumes any other
            self.step = restore_sharded_state(tensors, meta, self.dist.par, self.optimizer, self.train_loader)
        else:
            self.step = restore_training_state(tensors, meta, self.model, self.optimizer, self.train_loader)
        self.ckpt.discard_after(self.step)  # later, uncommitted or abandoned steps are redone from here
        self._saved_step = self.step  # committed already: never rewritten (that would uncommit it for a while)
        self.resumed_from = str(path)
        self._truncate_log(self.step)
        _hook().blutrain_on_checkpoint_loaded(path=str(path), step=self.step)
        self.log(f"[blutrain] resumed from {path} at step {self.step}")
        return True

    def _own_run_dir(self) -> None:
        """Rank 0 takes the run directory's lock (blumodels.runlock) for the run's life; every rank learns if it
        could not, so a second job on the same --out is refused everywhere, before it touches anything."""
        failed: BaseException | None = None
        if self.dist.is_main:
            from blumodels.runlock import RunLock

            try:
                self._run_lock = RunLock(self.out).acquire()
            except Exception as e:
                failed = e
            else:
                if self._run_lock.previous and not self.quiet:
                    prev = self._run_lock.previous
                    print(f"[blutrain] took over the lock of {self.out} from pid {prev.get('pid')} on "
                          f"{prev.get('host')} (no longer running)", flush=True)
        if self.dist.world == 1:
            if failed is not None:
                raise failed
            return
        self._agree(failed, ConfigError(f"rank 0 could not take the lock of the run directory {self.out} (its "
                                        "error says why)"))

    def close_lock(self) -> None:
        """Release the run directory's lock (close() does; so does the process's end, however it ends)."""
        lock, self._run_lock = getattr(self, "_run_lock", None), None
        if lock is not None:
            lock.release()

    def _on_saved(self, path: str, step: int) -> None:
        """This rank's part of the checkpoint of ``step`` is durable and verified (sync, or on the writer thread)."""
        self._saved_step = step
        _hook().blutrain_on_checkpoint_saved(path=path, step=step)

    def _agree_resume_step(self) -> tuple[Any, int, int]:
        """(None, this rank's proposal, agreed step): the newest committed step whose file verifies on every rank.

        The proposal is -2 when this rank has committed checkpoints none of which verifies, -1 when it has none.
        Each round proposes the newest good step at most the last disagreement, so it ends."""
        good = self.ckpt.good_steps()
        has = bool(self.ckpt.candidates())
        cap: int | None = None
        for _ in range(len(good) + 1):  # each round drops at least one step of ``good``: a bounded loop
            mine = max((s for s in good if cap is None or s <= cap), default=None)
            step = mine if mine is not None else (-2 if has else -1)
            agreed = self.dist.min_int(step, self.device)
            if agreed < 0 or self.dist.world == 1 or \
                    self.dist.min_int(1 if agreed in good else 0, self.device) == 1:
                break
            cap = agreed - 1
        return None, step, agreed

    def _agree(self, failed: BaseException | None, elsewhere: BaseException) -> None:
        """A vote of every rank on ``failed``: when any rank failed, the failing rank raises its own error and the
        others ``elsewhere`` (instead of going on alone into the next collective)."""
        if self.dist.min_int(0 if failed is not None else 1, self.device) == 0:
            raise failed if failed is not None else elsewhere

    def _unusable_report(self) -> str:
        """Why resume found nothing: each of this rank's checkpoint files and its verification error."""
        from blumodels.checkpoint.format import load_checkpoint

        why = []
        for p in self.ckpt.list():
            try:
                load_checkpoint(p)
            except (CheckpointError, OSError) as e:
                why.append(f"{p.name}: {getattr(e, 'reason', e)}")
        files = "; ".join(why) if why else "this rank's files verify, another rank's do not"
        return (f"--resume found checkpoint files but none that verifies on every rank ({files}); move them "
                "away to start from step 0")

    def _fresh_start(self) -> None:
        """A run without --resume owns its directory: drop an earlier run's log and, with --overwrite only, its
        checkpoints (without it they are kept and the start is refused on every rank)."""
        old = self.ckpt.list()
        keep = bool(old) and not self.overwrite
        if self.dist.min_int(0 if keep else 1, self.device) == 0:
            raise ConfigError(f"{self.out / 'checkpoints'} holds an earlier run's checkpoints ({len(old)} on this "
                              f"rank{', newest ' + old[-1].name if old else ''}): pass --resume to continue that "
                              f"run, or --overwrite (Trainer(overwrite=True)) to delete them and start over")
        if old or (self.log_path.is_file() and self.log_path.stat().st_size):
            self.log(f"[blutrain] starting a new run in {self.out}: removing the earlier run's log and "
                     f"{len(old)} checkpoint(s) (use --resume to continue it instead)")
        for p in old:
            p.unlink()
        self.ckpt.remove_all()  # receipts and commit records of the earlier run
        if self.dist.is_main:
            self.log_path.write_text("")

    def _truncate_log(self, step: int) -> None:
        """Drop log records of steps >= ``step`` (they were run after the checkpoint and are redone)."""
        if not self.dist.is_main or not self.log_path.is_file():
            return
        keep = []
        for i, ln in enumerate(self.log_path.read_text(errors="replace").splitlines(), 1):
            try:
                rec = json.loads(ln) if ln.strip() else None
            except ValueError:  # a line cut short by a killed process: its step is redone
                self.log(f"[blutrain] {self.log_path}:{i}: dropping a line that is not JSON ({ln[:40]!r}...)")
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] < step:
                keep.append(ln)
        self.log_path.write_text("".join(ln + "\n" for ln in keep))

    @_in_policy
    def save_checkpoint(self) -> None:
        if getattr(self, "_saved_step", None) == self.step:
            return  # this step is committed already
        if self.sharded:  # every rank gathers; rank 0 writes the full state
            tensors, meta = sharded_training_state(self.dist.par, self.optimizer, self.step, self.train_loader,
                                                   self.cfg.to_dict(), {"data_meta": self.meta})
            self._full_params = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
            if not self.dist.is_main:
                return
        else:
            tensors, meta = training_state(self.model, self.optimizer, self.step, self.train_loader,
                                           self.cfg.to_dict(), {"data_meta": self.meta}, copy=False)
        self.ckpt.save(self.step, tensors, meta)  # _on_saved reports it once durable and verified

    def _reserve_snapshot(self) -> None:
        """Page-locked snapshot buffers for the async checkpoints, allocated once after the first step (when the
        optimizer moments exist), so a save returns after its queued device-to-host copies."""
        tensors, _ = training_state(self.model, self.optimizer, self.step, copy=False)
        secs = self.ckpt.reserve(tensors)
        nbytes = sum(v.nbytes for v in tensors.values())
        self.log(f"[blutrain] async checkpoint: {nbytes / 2**30:.2f} GiB of pinned snapshot buffers in {secs:.2f} s")

    # ------------------------------------------------------------------ evaluation
    @_in_policy
    def evaluate(self, steps: int | None = None) -> float:
        """Mean validation loss over ``eval_steps`` batches from the start of the validation split."""
        n = steps or self.cfg.train.eval_steps
        self.val_loader.reset()
        self.model.eval()
        net = self.module if self.sharded else self.model  # FSDP gathers its shards in its forward
        total = 0.0
        with bt.no_grad():
            for _ in range(n):
                x, y = self.val_loader.next_batch()
                with self._autocast():
                    _, loss = net(x, y)
                total += float(loss.item())
        if self.device.startswith("cuda"):  # a bad validation target recorded on device: raise it now
            from blutensor.ext import raise_pending_index_error

            raise_pending_index_error()
        self.model.train()
        return self.dist.mean([total / n], self.device)[0]

    @_in_policy
    def sample(self, prompt: str | None = None, tokens: int | None = None, seed: int | None = None) -> str:
        from blumodels.data.tokenizer import load_tokenizer
        from blumodels.sampling import sample_text

        t = self.cfg.train
        tok = self._tokenizer = self._tokenizer or load_tokenizer(self.data_dir)
        if self.sharded:  # one process samples from a full copy (the last gathered state) outside the mesh
            return self._sample_full(tok, prompt, tokens, seed)
        return sample_text(self.model, tok, t.sample_prompt if prompt is None else prompt,
                           tokens or t.sample_tokens or 100, top_k=t.top_k, temperature=t.temperature,
                           seed=t.seed if seed is None else seed, top_p=t.top_p)

    @_in_policy
    def gather_for_sample(self) -> None:
        """Sharded runs: gather the full parameters (a collective on every rank) for :meth:`sample`."""
        params, _, _ = self.dist.par.full_state(None)
        from blumodels.state import _host_array

        self._full_params = {n: _host_array(a) for n, a in params.items()}

    def _sample_full(self, tok: Any, prompt: str | None, tokens: int | None, seed: int | None) -> str:
        from blumodels.sampling import sample_text

        full = getattr(self, "_full_params", None)
        if full is None:
            raise RuntimeError("Trainer.sample() of a sharded run needs gather_for_sample() on every rank first "
                               "(fit() and save_checkpoint() do it)")
        t = self.cfg.train
        m = build_model(self.cfg.model, device=self.device, seed=t.seed)
        with bt.no_grad():
            for n, p in m.named_parameters():
                p.copy_(bt.tensor(full[n], dtype=p.dtype, device=p.device))
        cp = self.dist.par.cp
        with cp.paused() if cp is not None else contextlib.nullcontext():  # this copy is not sequence-sharded
            return sample_text(m, tok, t.sample_prompt if prompt is None else prompt, tokens or t.sample_tokens or 100,
                               top_k=t.top_k, temperature=t.temperature, seed=t.seed if seed is None else seed)

    # ------------------------------------------------------------------ training
    def _nonfinite_grad_name(self) -> str:
        for n, p in self.params.items():
            if p.grad is not None and not bool(np.isfinite(p.grad.detach().to("cpu").numpy()).all()):
                return f"grad of {n}"
        return "gradient norm"

    def _autocast(self) -> bt.autocast:
        """bf16 autocast around forward + loss when train.precision is 'bf16' (fp32 masters and AdamW state)."""
        return self.policy.autocast(self.device.split(":")[0])

    def _build_step(self) -> None:
        """The step (step.py) and how it runs: captured after warm-up when train.cuda_graph allows it, through
        the compiler plugin when train.compile, else eagerly."""
        from blumodels import graph_step
        from blumodels.step import TrainStep

        cfg, t = self.cfg, self.cfg.train
        cuda = self.device.startswith("cuda")
        fused = bool(cuda and t.fused_adamw)  # optimizer-in-backward: its per-parameter updates read the device lr
        lrs = [lr_at(s, cfg) for s in range(t.steps)]  # fit() and resume never go past train.steps
        self._step = TrainStep(self.module, self.optimizer, list(self.params.values()), device=self.device,
                               lr_schedule=lrs, accum=cfg.grad_accum, grad_clip=t.grad_clip,
                               autocast=self._autocast if t.precision == "bf16" else None,
                               no_sync=lambda skip: self.dist.no_sync(self.module, skip), fused=fused,
                               optimizer_in_backward=t.optimizer_in_backward,
                               # a [parallel] layout: the norm (and clipping) of the unsharded model, gradients
                               # as the mesh leaves them
                               norm=self.dist.clip_grad_norm_ if self.sharded else None,
                               static_grads=not self.sharded,
                               device_rng=cuda and cfg.model.dropout > 0)
        self._step.precast_accumulate = cuda and bool(self._step.grads)
        self._captured = None
        self._warm_left = graph_step.WARMUP_STEPS
        self._graph_why: str | None = None
        if t.cuda_graph is False:
            self._graph_why = "train.cuda_graph = false"
        else:
            self._graph_why = graph_step.config_refusal(cfg) or graph_step.runtime_refusal(self.device,
                                                                                            self.dist.world)
            if self._graph_why is not None and t.cuda_graph is True:
                raise ConfigError(f"train.cuda_graph = true cannot capture this step: {self._graph_why}")
            if self._graph_why is not None and cuda:
                self.log(f"[blutrain] train.cuda_graph = 'auto': the step runs eagerly: {self._graph_why}")
        self._compiled = None
        if t.compile:
            self._compiled = bt.compile(self._step.micro)  # the compiler plugin traces the step's micro-step

    def _report_compile(self) -> None:
        """Say once, after the first compiled step, when the compiler ran (part of) the step eagerly."""
        if getattr(self, "_compile_told", False):
            return
        self._compile_told = True
        rep = self._compiled.report() if hasattr(self._compiled, "report") else {}
        eager = list(rep.get("eager_steps") or [])
        ops = dict(rep.get("fallback_reasons") or {})
        if eager:
            self.log(f"[blutrain] train.compile: the compiler ran the step eagerly: {eager[0]}")
        elif ops:
            self.log(f"[blutrain] train.compile: {len(ops)} op(s) run eagerly inside the compiled step: "
                     + "; ".join(f"{k}: {v}" for k, v in list(ops.items())[:3]))

    @property
    def captured(self) -> bool:
        """Whether the steps now replay CUDA graphs (after the eager warm-up steps)."""
        return self._captured is not None

    def _runner(self):
        """What runs this step: the captured step (capturing it first after the warm-up), or the eager one."""
        if self._graph_why is not None:
            return self._step
        if self._captured is None:
            if self._warm_left > 0:
                self._warm_left -= 1
                return self._step
            from blumodels.graph_step import CapturedStep, CudaCapture

            cap = CapturedStep(self._step, (self.cfg.train.micro_batch, self.cfg.train.seq_len),
                               make_capture=getattr(self, "_make_capture", CudaCapture))
            self.memory.empty_cache()  # the graphs' pool takes the warm-up steps' activation memory back
            cap.capture()
            self._captured = cap
        return self._captured

    @_in_policy
    def train_step(self) -> dict[str, Any]:
        """One optimisation step (grad_accum micro-steps) of the one step definition (step.py), eager, captured
        or compiled; returns its log record. The host reads the step's loss, norm and verdict once, after it."""
        cfg, t = self.cfg, self.cfg.train
        s = self.step
        accum = cfg.grad_accum
        lr = lr_at(s, cfg)
        st = self._step
        if getattr(self, "_step_at", None) != s:  # a fresh start, a resume, or a jump: the device index follows
            st.seek(s)
        t0 = time.perf_counter()
        runner = self._runner()
        if self._compiled is not None:  # the compiled micro-step inside the eager step's phases
            st.run(self.train_loader.next_batch, lr, micro=self._compiled)
            self._report_compile()
        else:
            runner.run(self.train_loader.next_batch, lr)
        res = st.read()  # the one host read of the step (it waits for the GPU)
        self._step_at = s + 1
        loss_val = self.dist.mean([res.loss], self.device)[0]  # over ranks: the global batch's loss
        if self.device.startswith("cuda"):  # bad targets/indices recorded on device (the read above synced)
            from blutensor.ext import raise_pending_index_error

            raise_pending_index_error()
        bad = None
        if res.nonfinite or not math.isfinite(loss_val):
            bad = (f"loss ({res.loss})" if not math.isfinite(res.loss) else "loss (on another rank)"
                   if not math.isfinite(loss_val) else self._nonfinite_grad_name())
        gnorm = res.grad_norm
        skipped = False
        if bad is not None:
            if t.nan_policy == "stop":
                raise NonFiniteError(f"step {s}: non-finite {bad}; stopping (train.nan_policy='stop'; the update "
                                     f"was not applied; use 'skip' to drop such steps)")
            skipped = True
            self.log(f"[blutrain] step {s}: non-finite {bad}; step skipped (nan_policy='skip')")
        dt = time.perf_counter() - t0
        tokens = accum * t.micro_batch * t.seq_len * cfg.data_parallel_size  # the global batch
        tps = tokens / dt if dt > 0 else 0.0
        rec: dict[str, Any] = {
            "step": s, "loss": loss_val, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tps,
            "mfu": metrics.mfu(self.flops_per_token, tps / self.dist.world, self.peak), "mem_bytes":
            metrics.memory_bytes(self.device.split(":")[0]), "step_ms": dt * 1e3,
            "tokens": (s + 1) * tokens,
        }
        if runner is self._captured:
            rec["cuda_graph"] = True
        rec.update(self.memory.after_step())  # peak_allocated/reserved_bytes; flushes start-up memory once
        if skipped:
            rec["skipped"] = True
        return rec

    @_in_policy
    def fit(self, steps: int | None = None, save_final: bool = True) -> dict[str, Any]:
        """Train until ``steps`` (default train.steps) steps are done, checkpoint, return a summary.

        SIGTERM (preemption) ends the run at the next step end on every rank, with a checkpoint of that step and
        ``summary["preempted"] = True``. The end, and any error, is reported through ``blutrain_on_train_end``."""
        from blumodels.lifecycle import Preemption, report_end

        with Preemption() as pre:
            try:
                summary = self._fit(steps, save_final, pre)
            except BaseException as e:
                report_end("failed", self.step, e)
                raise
        if summary["preempted"]:
            report_end("preempted", self.step)
        elif self.step >= self.cfg.train.steps:
            report_end("ok", self.step)
        return summary

    def _fit(self, steps: int | None, save_final: bool, pre: Any) -> dict[str, Any]:
        t = self.cfg.train
        total = steps if steps is not None else t.steps
        if isinstance(total, bool) or not isinstance(total, numbers.Integral) or not 0 < total <= t.steps:
            raise ConfigError(f"stop step {total!r} must be in 1..train.steps={t.steps} (the LR schedule ends at "
                              "train.steps; raise train.steps to train longer)")
        hook = _hook()
        t_start = time.perf_counter()
        first_val = last_val = None
        preempted = False
        start = self.step
        logf = open(self.log_path, "a") if self.dist.is_main else open(os.devnull, "w")
        try:
            while self.step < total:
                s = self.step
                val = None
                if t.eval_interval and (s % t.eval_interval == 0 or s == total - 1):
                    val = self.evaluate()
                    first_val = val if first_val is None else first_val
                    last_val = val
                hook.blutrain_on_step_begin(step=s, state={"lr": lr_at(s, self.cfg)})
                rec = self.train_step()
                if val is not None:
                    rec["val_loss"] = val
                self.step = s + 1
                self.history.append(rec)
                if s == start and t.async_checkpoint and not self.sharded and self.device.startswith("cuda"):
                    self._reserve_snapshot()
                if s % t.log_interval == 0 or val is not None or self.step == total:
                    logf.write(json.dumps(rec) + "\n")
                    logf.flush()
                hook.blutrain_on_step_end(step=s, metrics=rec)
                self._report(rec, total)
                if (t.sample_interval and t.sample_tokens and self.step % t.sample_interval == 0
                        and self.sharded):
                    self.gather_for_sample()  # every rank takes part; rank 0 samples below
                if (t.sample_interval and t.sample_tokens and self.step % t.sample_interval == 0
                        and self.dist.is_main):
                    text = self.sample(seed=t.seed + self.step)
                    self.log(f"[blutrain] sample at step {self.step}:\n{text}")
                if t.checkpoint_interval and self.step % t.checkpoint_interval == 0 and self.step < total:
                    self.save_checkpoint()
                self.ckpt.check()  # an async save that failed ends the run at this step, not at the next save
                if pre.agreed(self.dist, self.device):  # SIGTERM on any rank: every rank saves this step, leaves
                    preempted = True
                    self.log(f"[blutrain] SIGTERM: saving a checkpoint at step {self.step} and stopping")
                    break
        finally:
            logf.close()
            if getattr(self, "_bar", None) is not None:
                self._bar.close()
                self._bar = None
        if preempted:
            self._commit_on_preemption()
        elif self.history and save_final:
            self.save_checkpoint()
        self.ckpt.wait()
        elapsed = time.perf_counter() - t_start
        png = None
        if t.plot and self.dist.is_main and self.log_path.is_file() and self.log_path.stat().st_size:
            from blumodels.plot import plot_losses

            m = self.cfg.model
            name = "GPT-2" if m.family == "gpt2" else m.family.capitalize()
            title = f"{name} {m.n_layer}L d{m.d_model} on {self.meta.get('corpus', 'data')}"
            try:
                png = str(plot_losses(self.log_path, self.out / "loss.png", title=title))
            except ImportError:
                self.log("[blutrain] matplotlib is not installed: no loss.png (pip install matplotlib)")
        summary = {"steps": self.step, "elapsed_s": elapsed, "first_val_loss": first_val,
                   "last_val_loss": last_val, "final_loss": self.history[-1]["loss"] if self.history else None,
                   "device": self.device, "log": str(self.log_path), "plot": png,
                   "resumed_from": self.resumed_from, "preempted": preempted}
        if self.dist.is_main:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _commit_on_preemption(self) -> None:
        """Save this step on every rank and agree (two collectives, reached by every rank whatever its save did)
        that it is committed; PreemptionError naming why and the step kept when it is not."""
        from blumodels.lifecycle import PreemptionError

        why = None
        try:
            self.save_checkpoint()
            self.ckpt.wait()
        except (OSError, ValueError, RuntimeError) as e:  # CheckpointSaveError / CheckpointError name the file
            why = f"rank {self.dist.rank}: {e}"
        written = self.dist.min_int(0 if why else 1, self.device)  # every rank's part written and verified
        committed = written and (not self.dist.is_main and self.sharded or self.step in self.ckpt.committed_steps())
        if self.dist.min_int(1 if committed else 0, self.device):
            # a rank that finished its part before the last one wrote the commit record pruned without it
            self.ckpt.prune()
            return
        kept = [s for s in self.ckpt.committed_steps() if s < self.step]
        raise PreemptionError(self.step, why or ("another rank could not save its part" if not written else
                                                 "no commit record was written"), kept[-1] if kept else None)

    def _report(self, rec: dict[str, Any], total: int) -> None:
        if self.quiet:
            return
        s = rec["step"] + 1
        val = f" val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
        gn = f"gnorm {rec['grad_norm']:.2f} " if rec["grad_norm"] is not None else ""
        text = (f"step {s:>{len(str(total))}}/{total} loss {rec['loss']:.4f}{val} lr {rec['lr']:.2e} "
                f"{gn}{rec['tokens_per_s']:,.0f} tok/s")
        if self.progress:  # a tqdm bar (elapsed, rate, ETA); validation lines are printed above it and kept
            bar = getattr(self, "_bar", None)
            if bar is None:
                from tqdm import tqdm

                bar = self._bar = tqdm(total=total, initial=rec["step"], unit="step", file=sys.stdout,
                                       dynamic_ncols=True, desc="train")
            if "val_loss" in rec:
                bar.write(text)
            bar.set_postfix_str(f"loss {rec['loss']:.4f} lr {rec['lr']:.2e} {rec['tokens_per_s']:,.0f} tok/s",
                                refresh=False)
            bar.update(1)
        elif "val_loss" in rec or s == total or s % max(1, total // 20) == 0:
            print(f"{text} | {_eta(self, rec['step'], total)}", flush=True)

    def close(self) -> None:
        try:
            self._step.release()
            self.ckpt.close()
            from blumodels.loggers import stop_loggers

            stop_loggers(getattr(self, "loggers", []))
            if getattr(self, "_bar", None) is not None:
                self._bar.close()
                self._bar = None
            if self.sharded:  # the mesh's dispatch observers (TP, CP, FSDP root shards) leave the process
                self.dist.par.close()
        finally:
            self.close_lock()
