"""Trainer: gradient accumulation, AdamW, warmup+cosine LR, clipping, validation, NaN policy,
JSON-lines logs, progress bar, checkpoints with bit-exact resume, loss-curve PNG.

AdamW decays 2-D weights only (matmul weights and the embeddings), never biases or LayerNorm
parameters, as nanoGPT and llm.c do.
"""

from __future__ import annotations

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
from blumodels.gpt2 import GPT2, build_model
from blumodels.state import check_training_state, restore_training_state, training_state


class NonFiniteError(RuntimeError):
    """A loss or gradient became NaN/Inf; the message names the step and the tensor."""


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
                max_corpus_bytes=cfg.data.max_bytes or None)
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
                         "bias", "ln_eps"),
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
            diff += [f"{sec}.{k}={old[k]!r} in the checkpoint, {getattr(now, k)!r} now" for k in keys
                     if k in old and old[k] != getattr(now, k)]
    if diff:
        raise ConfigError(f"cannot resume from {path}: it was written with another config ({'; '.join(diff)})")


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
    from blutensor.plugin.manager import get_host

    return get_host().hook


class Trainer:
    """Trains a GPT-2 from a RunConfig into ``out_dir`` (log.jsonl, checkpoints/, loss.png).

    ``resume=True`` continues from the newest verified checkpoint in ``out_dir/checkpoints`` (falling
    back past corrupt ones); the losses that follow equal those of an uninterrupted run. Without it, a directory
    holding an earlier run's checkpoints is refused unless ``overwrite=True`` (which deletes them).
    """

    def __init__(self, cfg: RunConfig, out_dir: str | Path, resume: bool = False, quiet: bool = False,
                 progress: bool | None = None, overwrite: bool = False):
        if resume and overwrite:
            raise ConfigError("Trainer: resume=True and overwrite=True contradict each other (continue the earlier "
                              "run, or delete it and start over)")
        self.overwrite = overwrite
        self.cfg = cfg.validate()
        self.dist = Dist.from_config(cfg.train.world_size)
        self.out = Path(out_dir)
        _check_writable_dir(self.out, "the run directory (--out)")
        _check_writable_dir(self.out / "checkpoints", "the checkpoint directory")
        self.quiet = quiet or not self.dist.is_main
        self.progress = sys.stdout.isatty() if progress is None else progress
        self.device = self.dist.device(resolve_device(cfg.train.device))
        if cfg.train.cuda_graph and not self.device.startswith("cuda"):
            raise ConfigError(f"train.cuda_graph = true needs a CUDA device; train.device={cfg.train.device!r} "
                              f"resolved to {self.device!r} (set train.cuda_graph = false on CPU)")
        bt.use_deterministic_algorithms(bool(cfg.train.deterministic))
        # CPU threads (GEMM row blocks and the compiled kernels): train.threads, else blutensor's default (an
        # earlier bt.set_num_threads call by a launcher, or the usable cores divided by the ranks on this node)
        bt.set_num_threads(cfg.train.threads or bt.get_num_threads())
        if self.device.startswith("cuda"):
            bt.set_matmul_precision(cfg.train.precision)
            from blutensor.gemm import set_fp32_gemm

            set_fp32_gemm(cfg.train.fp32_gemm)
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
        self._tokenizer = None
        if cfg.train.sample_tokens:  # every rank: a broken tokenizer fails now, not after training, and everywhere
            from blumodels.data.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.data_dir)
        from blumodels.memory import DeviceMemory

        self.memory = DeviceMemory(self.device, cfg.train.allocator)  # before the model: it allocates through it
        self.model = build_model(cfg.model, device=self.device, seed=cfg.train.seed)
        self.model.lean_logits = True  # CUDA: the loss writes the logits' gradient over them (one buffer less)
        if cfg.train.activation_checkpointing:
            from blutensor.utils import checkpoint_modules

            checkpoint_modules(self.model, "blocks.*")
        self.module = self.dist.wrap(self.model)  # DDP when world_size > 1 (averages gradients)
        self.optimizer = make_optimizer(self.model, cfg, self.device)
        if cfg.train.optimizer_in_backward:
            from blutensor.utils import OptimizerInBackward

            self.optimizer = OptimizerInBackward(self.optimizer)  # config refused accum/clip/DDP/skip
        self.params = dict(self.model.named_parameters())
        from blumodels.data.loader import TokenLoader

        t, r, w = cfg.train, self.dist.rank, self.dist.world
        dv = int(self.meta["vocab_size"])  # every token id is checked against it now, not at the step that meets it
        self.train_loader = TokenLoader(self.data_dir, "train", t.micro_batch, t.seq_len, rank=r, world_size=w,
                                        device=self.device, vocab_size=dv)
        self.val_loader = TokenLoader(self.data_dir, "val", t.micro_batch, t.seq_len, rank=r, world_size=w,
                                      device=self.device, vocab_size=dv)
        from blumodels.checkpoint.manager import CheckpointManager

        self.ckpt = CheckpointManager(self.out / "checkpoints", rank=r, keep=t.keep_checkpoints,
                                      async_save=t.async_checkpoint)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.resumed_from: str | None = None
        self.flops_per_token = self.model.flops_per_token(t.seq_len)
        self.peak = metrics.peak_flops(self.device.split(":")[0], t.precision, t.peak_flops)
        if resume:
            self.resume()
        else:
            self._fresh_start()
        if self.dist.is_main:  # after resume() accepted the checkpoint: a refused resume leaves it as it was
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    # ------------------------------------------------------------------ bookkeeping
    def log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, flush=True)

    @property
    def log_path(self) -> Path:
        return self.out / "log.jsonl"

    def resume(self) -> bool:
        """Restore the newest good checkpoint; returns False when there is none.

        Checkpoint files none of which verifies, or a checkpoint of another model shape, are errors (the
        run's files are left as they are) rather than a silent start from step 0.
        """
        found = self.ckpt.latest_good()
        step = int(found[2]["step"]) if found is not None else (-2 if self.ckpt.list() else -1)
        agreed = self.dist.min_int(step, self.device)  # every rank resumes from the same step
        if agreed == -2:  # some rank (maybe this one) has checkpoint files but none that verifies
            raise CheckpointError(self.out / "checkpoints", self._unusable_report())
        if agreed == -1 and (newest := -self.dist.min_int(-step, self.device)) >= 0:
            raise CheckpointError(self.out / "checkpoints", f"--resume: some rank has no checkpoint file while "
                                  f"another has up to step {newest} (this rank: "
                                  f"{'none' if step < 0 else f'step {step}'}); restore the missing rank's files, or "
                                  f"start over with --overwrite")
        if agreed < 0:
            self.log(f"[blutrain] no checkpoint in {self.out / 'checkpoints'} (on every rank): starting from step 0")
            self._truncate_log(0)
            return False
        path = self.ckpt.path_for(agreed)
        failed: BaseException | None = None
        try:
            if agreed != step:  # an older step that every rank has: this rank loads that one
                from blumodels.checkpoint.format import load_checkpoint

                found = (path, *load_checkpoint(path))
            path, tensors, meta = found
            check_resume_config(path, meta, self.cfg)
            if int(meta["step"]) > self.cfg.train.steps:
                raise ConfigError(f"cannot resume from {path}: it is at step {meta['step']}, past train.steps="
                                  f"{self.cfg.train.steps} (the end of the LR schedule); raise train.steps (--steps)")
            check_training_state(tensors, meta, self.model, self.optimizer, self.train_loader)
        except Exception as e:  # every rank learns of it below: one rank alone must not go on into a collective
            failed = e
        self._agree(failed, CheckpointError(path, "another rank cannot restore its checkpoint of this step (its error "
                                                  "says why)"))
        self.step = restore_training_state(tensors, meta, self.model, self.optimizer, self.train_loader)
        self.resumed_from = str(path)
        self._truncate_log(self.step)
        _hook().blutrain_on_checkpoint_loaded(path=str(path), step=self.step)
        self.log(f"[blutrain] resumed from {path} at step {self.step}")
        return True

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

    def save_checkpoint(self) -> None:
        tensors, meta = training_state(self.model, self.optimizer, self.step, self.train_loader,
                                       self.cfg.to_dict(), {"data_meta": self.meta})
        path = self.ckpt.save(self.step, tensors, meta)
        if not self.cfg.train.async_checkpoint:  # durable now; async saves are durable after wait()
            _hook().blutrain_on_checkpoint_saved(path=str(path), step=self.step)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, steps: int | None = None) -> float:
        """Mean validation loss over ``eval_steps`` batches from the start of the validation split."""
        n = steps or self.cfg.train.eval_steps
        self.val_loader.reset()
        self.model.eval()
        total = 0.0
        with bt.no_grad():
            for _ in range(n):
                x, y = self.val_loader.next_batch()
                with self._autocast():
                    _, loss = self.model(x, y)
                total += float(loss.item())
        if self.device.startswith("cuda"):  # a bad validation target recorded on device: raise it now
            from blutensor.cuda_ops import index_check

            index_check.raise_pending()
        self.model.train()
        return self.dist.mean([total / n], self.device)[0]

    def sample(self, prompt: str | None = None, tokens: int | None = None, seed: int | None = None) -> str:
        from blumodels.data.tokenizer import load_tokenizer
        from blumodels.sampling import sample_text

        t = self.cfg.train
        tok = self._tokenizer = self._tokenizer or load_tokenizer(self.data_dir)
        return sample_text(self.model, tok, t.sample_prompt if prompt is None else prompt,
                           tokens or t.sample_tokens or 100, top_k=t.top_k, temperature=t.temperature,
                           seed=t.seed if seed is None else seed)

    # ------------------------------------------------------------------ training
    def _nonfinite_grad_name(self) -> str:
        for n, p in self.params.items():
            if p.grad is not None and not bool(np.isfinite(p.grad.detach().to("cpu").numpy()).all()):
                return f"grad of {n}"
        return "gradient norm"

    def _autocast(self) -> bt.autocast:
        """bf16 autocast around forward + loss when train.precision is 'bf16' (fp32 masters and AdamW state)."""
        return bt.autocast(self.device.split(":")[0], dtype=bt.bfloat16, enabled=self.cfg.train.precision == "bf16")

    def train_step(self) -> dict[str, Any]:
        """One optimisation step (grad_accum micro-steps); returns its log record."""
        cfg, t = self.cfg, self.cfg.train
        if t.cuda_graph and not getattr(self, "_graph_eager", False):
            from blumodels.graph_step import graph_train_step

            return graph_train_step(self)  # eager warm-up steps come back here with _graph_eager set
        s = self.step
        accum = cfg.grad_accum
        lr = lr_at(s, cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        loss_sum = 0.0
        bad = None
        for micro in range(accum):
            x, y = self.train_loader.next_batch()
            with self.dist.no_sync(self.module, micro < accum - 1):  # DDP: reduce on the last micro-step
                with self._autocast():  # train.precision 'bf16': forward + loss only; backward outside
                    if t.precision == "bf16":
                        bt.amp.precast(self.params.values())  # all weight casts in one launch (CUDA)
                    _, loss = self.module(x, y)
                lv = float(loss.item())
                loss_sum += lv
                if not math.isfinite(lv) and bad is None:
                    bad = f"loss (micro-step {micro}: {lv})"
                (loss if accum == 1 else loss * (1.0 / accum)).backward()
        loss_val = self.dist.mean([loss_sum / accum], self.device)[0]  # over ranks: the global batch's loss
        if self.device.startswith("cuda"):  # bad targets/indices recorded on device (the loss read synced)
            from blutensor.cuda_ops import index_check

            index_check.raise_pending()
        if bad is None and not math.isfinite(loss_val):
            bad = "loss (on another rank)"
        params = list(self.params.values())
        if t.optimizer_in_backward:
            gnorm = None  # every gradient was used and freed during backward
        elif t.grad_clip > 0:
            gnorm = float(bt.optim.clip_grad_norm_(params, t.grad_clip).item())
        else:
            gnorm = math.sqrt(sum(float((p.grad.detach().to("cpu").numpy().astype(np.float64) ** 2).sum())
                                  for p in params if p.grad is not None))
        if bad is None and gnorm is not None and not math.isfinite(gnorm):
            bad = self._nonfinite_grad_name()
        skipped = False
        if bad is not None:
            if t.nan_policy == "stop":
                self.optimizer.zero_grad()
                raise NonFiniteError(f"step {s}: non-finite {bad}; stopping (train.nan_policy='stop'; "
                                     f"use 'skip' to drop such steps)")
            skipped = True
            self.log(f"[blutrain] step {s}: non-finite {bad}; step skipped (nan_policy='skip')")
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        dt = time.perf_counter() - t0
        tokens = accum * t.micro_batch * t.seq_len * t.world_size  # the global batch
        tps = tokens / dt if dt > 0 else 0.0
        rec: dict[str, Any] = {
            "step": s, "loss": loss_val, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tps,
            "mfu": metrics.mfu(self.flops_per_token, tps / self.dist.world, self.peak), "mem_bytes":
            metrics.memory_bytes(self.device.split(":")[0]), "step_ms": dt * 1e3,
            "tokens": (s + 1) * tokens,
        }
        rec.update(self.memory.after_step())  # peak_allocated/reserved_bytes; flushes start-up memory once
        if skipped:
            rec["skipped"] = True
        return rec

    def fit(self, steps: int | None = None, save_final: bool = True) -> dict[str, Any]:
        """Train until ``steps`` (default train.steps) steps are done, checkpoint, return a summary."""
        t = self.cfg.train
        total = steps if steps is not None else t.steps
        if isinstance(total, bool) or not isinstance(total, numbers.Integral) or not 0 < total <= t.steps:
            raise ConfigError(f"stop step {total!r} must be in 1..train.steps={t.steps} (the LR schedule ends at "
                              "train.steps; raise train.steps to train longer)")
        hook = _hook()
        t_start = time.perf_counter()
        first_val = last_val = None
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
                if s % t.log_interval == 0 or val is not None or self.step == total:
                    logf.write(json.dumps(rec) + "\n")
                    logf.flush()
                hook.blutrain_on_step_end(step=s, metrics=rec)
                self._report(rec, total)
                if (t.sample_interval and t.sample_tokens and self.step % t.sample_interval == 0
                        and self.dist.is_main):
                    text = self.sample(seed=t.seed + self.step)
                    self.log(f"[blutrain] sample at step {self.step}:\n{text}")
                if t.checkpoint_interval and self.step % t.checkpoint_interval == 0 and self.step < total:
                    self.save_checkpoint()
        finally:
            logf.close()
            if self.progress and not self.quiet:
                print(flush=True)
        if self.history and save_final:
            self.save_checkpoint()
        self.ckpt.wait()
        elapsed = time.perf_counter() - t_start
        png = None
        if t.plot and self.dist.is_main and self.log_path.is_file() and self.log_path.stat().st_size:
            from blumodels.plot import plot_losses

            m = self.cfg.model
            title = f"GPT-2 {m.n_layer}L d{m.d_model} on {self.meta.get('corpus', 'data')}"
            try:
                png = str(plot_losses(self.log_path, self.out / "loss.png", title=title))
            except ImportError:
                self.log("[blutrain] matplotlib is not installed: no loss.png (pip install matplotlib)")
        summary = {"steps": self.step, "elapsed_s": elapsed, "first_val_loss": first_val,
                   "last_val_loss": last_val, "final_loss": self.history[-1]["loss"] if self.history else None,
                   "device": self.device, "log": str(self.log_path), "plot": png,
                   "resumed_from": self.resumed_from}
        if self.dist.is_main:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _report(self, rec: dict[str, Any], total: int) -> None:
        if self.quiet:
            return
        s = rec["step"] + 1
        val = f" val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
        gn = f"gnorm {rec['grad_norm']:.2f} " if rec["grad_norm"] is not None else ""
        text = (f"step {s:>{len(str(total))}}/{total} loss {rec['loss']:.4f}{val} lr {rec['lr']:.2e} "
                f"{gn}{rec['tokens_per_s']:,.0f} tok/s")
        if self.progress:
            width = 24
            done = int(width * s / total)
            sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {text}\x1b[K")
            sys.stdout.flush()
        elif "val_loss" in rec or s == total or s % max(1, total // 20) == 0:
            print(text, flush=True)

    def close(self) -> None:
        self.ckpt.close()
