"""The ``blutrain`` command: prepare, train, sample, eval, plugins.

Examples::

    blutrain train --preset tiny --out runs/tiny                 # CPU (or GPU) demo on the built-in corpus
    blutrain train --preset gpt2-124m --device cuda --steps 50 train.micro_batch=8
    blutrain train --out runs/tiny --resume                      # continue from the newest good checkpoint
    blutrain train --out runs/tiny --overwrite                   # start over there (deletes its checkpoints)
    blutrain sample --out runs/tiny --prompt "def " --tokens 200
    blutrain eval --out runs/tiny
    blutrain prepare --out data/pydocs --tokenizer bpe --vocab-size 2048
    blutrain prepare --out data/fw --source fineweb.parquet --text-field text --corpus none --tokenizer gpt2
    blutrain export --hf hf/tiny --out runs/tiny                 # weights for transformers' GPT2LMHeadModel
    blutrain export --hf hf/ll --checkpoint runs/ll/checkpoints/step_00000300.rank0.safetensors  # LlamaForCausalLM
    blutrain train --preset gpt2-124m --init-from hf/gpt2         # start from a local Hugging Face directory
    blutrain plugins
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from blumodels.config import (
    BUILTIN_CORPORA,
    ConfigError,
    RunConfig,
    apply_overrides,
    from_dict,
    load_config,
    load_preset,
)


def _in_range(kind: type, lo: float, hi: float | None = None, above: bool = False) -> Any:
    """argparse type: a number of ``kind`` in [lo, hi) ((lo, hi) when ``above``); argparse names the option."""
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'' if kind is float else 'n'} "
                                             f"{'number' if kind is float else 'integer'}") from None
        if not ((v > lo if above else v >= lo) and (hi is None or v < hi)):  # also refuses NaN
            rule = ("positive" if above and lo == 0 else f"{'>' if above else '>='} {lo}") + \
                (f" and < {hi}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return v

    parse.__name__ = kind.__name__
    return parse


def _positive(kind: type) -> Any:
    """argparse type: a number of ``kind`` > 0."""
    return _in_range(kind, 0, above=True)


def _add_common(p: argparse.ArgumentParser, default_out: str | None = None) -> None:
    p.add_argument("--config", help="TOML config file ([model], [train], [data])")
    p.add_argument("--preset", help="a shipped preset (tiny, gpt2-124m, ...); see `blutrain presets`")
    p.add_argument("--device", help="auto (default: cuda when available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--out", default=default_out, help="run directory (log.jsonl, checkpoints/, loss.png)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. train.lr=3e-4 model.n_layer=2 (anywhere on the command line)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="blutrain", description="Train GPT-2 with BluTrain.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("prepare", help="tokenize text into train/val token shards")
    p.add_argument("--out", required=True, help="data directory to write (shards, tokenizer, meta.json)")
    p.add_argument("--source", action="append", default=[], help="text, .jsonl or .parquet file, or a folder of "
                   "them (repeatable)")
    p.add_argument("--text-field", default="text", help="the JSON-lines field / Parquet column holding the text")
    p.add_argument("--format", default="blutrain", choices=("blutrain", "llmc"), dest="shard_format",
                   help="shard format to write: BluTrain's own, or llm.c's (train_gpt2 reads them)")
    p.add_argument("--tokens", action="append", default=[], metavar="PATH",
                   help="instead of text: llm.c shards (used in place) or nanoGPT train.bin/val.bin (converted), "
                   "files or folders (repeatable); GPT-2 tokens")
    p.add_argument("--restart", action="store_true", help="start over even where an interrupted run of the same "
                   "command could be continued")
    p.add_argument("--bpe-train-bytes", type=_in_range(int, 1), default=256 << 20,
                   help="text a trained BPE learns from (the start of the training split)")
    p.add_argument("--corpus", default="pydocs", choices=(*BUILTIN_CORPORA, "none"),
                   help="built-in corpus to add ('none' for only --source)")
    p.add_argument("--tokenizer", default="auto", choices=("auto", "gpt2", "bpe"))
    p.add_argument("--vocab-size", type=_in_range(int, 257), default=4096,
                   help="BPE vocabulary when training one (at least 257: the bytes and end-of-text)")
    p.add_argument("--val-fraction", type=_in_range(float, 0.0, 1.0), default=0.05, help="in [0, 1)")
    p.add_argument("--shard-tokens", type=_in_range(int, 2), default=10_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-bytes", type=_in_range(int, 0), default=0, help="cap on the built-in corpus (0 = all of it)")

    p = sub.add_parser("train", help="train a model (prepares the built-in corpus when data is missing)")
    _add_common(p)
    p.add_argument("--steps", type=int, help="number of optimisation steps (train.steps)")
    p.add_argument("--stop-at", type=int, help="stop after this many steps; the LR schedule still spans "
                   "train.steps (split a run: --stop-at 500, later --resume)")
    p.add_argument("--data", help="prepared data directory (data.dir); default <out>/data")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in --out")
    start.add_argument("--overwrite", action="store_true", help="start from step 0 even though --out holds an "
                       "earlier run's checkpoints (they are deleted); without it such a start is refused")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--init-from", metavar="DIR", help="start from the weights of a local Hugging Face model "
                   "directory (config.json + model.safetensors; train.init_from); its shape must match the model")

    p = sub.add_parser("export", help="write a run's weights as a Hugging Face directory (transformers loads it)")
    _add_common(p)
    p.add_argument("--hf", required=True, metavar="DIR", help="directory to write (model.safetensors, config.json "
                   "and the run's tokenizer files)")
    p.add_argument("--checkpoint", metavar="FILE", help="a checkpoint file (default: the newest good one of --out)")

    p = sub.add_parser("sample", help="generate text from a run's newest good checkpoint")
    _add_common(p)
    p.add_argument("--prompt", default=None)
    p.add_argument("--tokens", type=_positive(int), default=200)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (train.top_p)")
    p.add_argument("--temperature", type=_positive(float), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graph", choices=("auto", "true", "false"), default="auto",
                   help="CUDA: capture the decode step into a CUDA graph (auto: wherever it can, else eager with "
                   "the reason logged; true: required; false: eager)")

    p = sub.add_parser("eval", help="validation loss of a run's newest good checkpoint")
    _add_common(p)
    p.add_argument("--batches", type=_positive(int), default=None,
                   help="validation batches (default train.eval_steps)")

    p = sub.add_parser("profile", help="run a few training steps with bluprofiler on: table, trace, memory PNG")
    _add_common(p)
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after --warmup unprofiled ones)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--data", help="prepared data directory (data.dir); default <out>/data")
    p.add_argument("--no-memory", action="store_true", help="time ops only (no allocation tracking)")

    sub.add_parser("plugins", help="list the plugins found through the `blutrain` entry points")
    sub.add_parser("presets", help="list the shipped presets")
    return ap


def resolve_config(args: argparse.Namespace, fallback_preset: str | None = "tiny") -> RunConfig:
    """Config from --config / --preset / the run directory's config.json, then overrides and flags."""
    if args.config is not None and args.preset is not None:
        raise ConfigError("give --config or --preset, not both")
    run_cfg = Path(args.out) / "config.json" if getattr(args, "out", None) else None
    if args.config is not None:  # --config "" / --preset "" are errors, not the default preset
        cfg = load_config(args.config)
    elif args.preset is not None:
        cfg = load_preset(args.preset)
    elif run_cfg is not None and run_cfg.is_file():
        try:
            saved = json.loads(run_cfg.read_text())
        except (ValueError, OSError) as e:
            raise ConfigError(f"{run_cfg} is not readable JSON ({e}); give --config or --preset") from None
        if not isinstance(saved, dict):
            raise ConfigError(f"{run_cfg} must hold a JSON object, got {type(saved).__name__}")
        cfg = from_dict(saved, origin=str(run_cfg))
    elif fallback_preset:
        cfg = load_preset(fallback_preset)
    else:
        raise ConfigError("no config: give --config FILE, --preset NAME or --out of an existing run")
    extra = list(args.overrides or [])
    if getattr(args, "device", None):
        extra.append(f"train.device={args.device}")
    if getattr(args, "steps", None) is not None:
        extra.append(f"train.steps={args.steps}")
    if getattr(args, "data", None):
        extra.append(f"data.dir={args.data}")
    if getattr(args, "init_from", None):
        extra.append(f"train.init_from={args.init_from}")
    return apply_overrides(cfg, extra) if extra else cfg


def cmd_prepare(args: argparse.Namespace) -> int:
    from blumodels.data.prepare import import_tokens, prepare

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.tokens:
        if args.source:
            raise ConfigError("give --tokens (token files) or --source (text), not both")
        meta = import_tokens(args.out, args.tokens, log_fn=say)
        print(json.dumps(meta, indent=2))
        return 0
    corpus = None if args.corpus in ("none", "") else args.corpus
    meta = prepare(args.out, sources=args.source or None, corpus=corpus, tokenizer=args.tokenizer,
                   vocab_size=args.vocab_size, val_fraction=args.val_fraction, shard_tokens=args.shard_tokens,
                   seed=args.seed, max_corpus_bytes=args.max_bytes or None, text_field=args.text_field,
                   shard_format=args.shard_format, bpe_train_bytes=args.bpe_train_bytes, resume=not args.restart,
                   log_fn=say)
    print(json.dumps(meta, indent=2))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile ``--steps`` training steps of a config; writes OUT/profile/{summary.txt,trace.json,memory.png}."""
    try:
        from bluprofiler import profile_steps
    except ImportError:
        print("blutrain profile needs bluprofiler: pip install bluprofiler (or blumodels[profile])", file=sys.stderr)
        return 2
    from blumodels.trainer import Trainer

    steps = args.steps
    args.steps = None  # not train.steps: the profiled count
    cfg = resolve_config(args)
    out = Path(args.out or "runs/profile")
    cfg = apply_overrides(cfg, ["train.checkpoint_interval=0", "train.eval_interval=0", "train.plot=false",
                                "train.sample_tokens=0"])
    tr = Trainer(cfg, out, quiet=True)
    try:
        prof_dir = out / "profile"
        if tr.dist.world > 1:  # one folder per rank: each has its own trace, op table and collectives
            prof_dir = prof_dir / f"rank{tr.dist.rank}"
        summary = profile_steps(tr.train_step, steps, prof_dir, warmup=args.warmup, memory=not args.no_memory,
                                meta={"workload": f"blutrain {args.preset or args.config or 'tiny'}"})
        table = prof_dir / "summary.txt"
        if table.is_file() and tr.dist.is_main:
            print(table.read_text())
        if not tr.dist.is_main:
            return 0 if summary is not None else 1
        print(f"[blutrain] profile of {steps} step(s) written to {prof_dir} "
              f"(trace.json for Perfetto/chrome://tracing, memory.png, summary.txt)")
        return 0 if summary is not None else 1
    finally:
        tr.close()


def cmd_train(args: argparse.Namespace) -> int:
    from blumodels.trainer import Trainer

    cfg = resolve_config(args)
    if args.stop_at is not None and not 0 < args.stop_at <= cfg.train.steps:
        raise ConfigError(f"--stop-at {args.stop_at} must be in 1..train.steps={cfg.train.steps} (the LR schedule "
                          "ends at train.steps; use --steps to train longer)")
    out = args.out or f"runs/{args.preset or (Path(args.config).stem if args.config else 'tiny')}"
    tr = Trainer(cfg, out, resume=args.resume, overwrite=args.overwrite, quiet=args.quiet)
    try:
        from blumodels.lifecycle import EXIT_PREEMPT_UNSAVED, PreemptionError

        try:
            summary = tr.fit(args.stop_at)
        except PreemptionError as e:  # SIGTERM, but the step is not committed: not a requeue-and-continue (75)
            print(f"[blutrain] {e}", file=sys.stderr)
            return EXIT_PREEMPT_UNSAVED
        if summary.get("preempted"):
            from blumodels.lifecycle import EXIT_PREEMPTED

            print(f"[blutrain] preempted (SIGTERM) at step {summary['steps']}: checkpoint saved in "
                  f"{Path(out) / 'checkpoints'}; continue with --resume", file=sys.stderr)
            return EXIT_PREEMPTED
        if not tr.quiet:
            fv, lv = summary["first_val_loss"], summary["last_val_loss"]
            vals = f", val loss {fv:.3f} -> {lv:.3f}" if fv is not None and lv is not None else ""
            print(f"[blutrain] {summary['steps']} steps in {summary['elapsed_s']:.1f}s on {summary['device']}"
                  f"{vals}; log {summary['log']}" + (f", plot {summary['plot']}" if summary["plot"] else ""))
            if cfg.train.sample_tokens:
                print("[blutrain] sample:")
                print(tr.sample())
    finally:
        tr.close()
    return 0


def _load_run(args: argparse.Namespace):
    """(cfg, model, data_dir, checkpoint path) of a finished or running run directory."""
    from blumodels.checkpoint.manager import CheckpointManager
    from blumodels.families import build_model
    from blumodels.state import restore_training_state
    from blumodels.trainer import check_resume_config, data_meta, fit_vocab, resolve_device

    if not args.out:
        raise ConfigError("give --out RUN_DIR (the directory `blutrain train` wrote)")
    cfg = resolve_config(args, fallback_preset=None)
    out = Path(args.out)
    data_dir = Path(cfg.data.dir) if cfg.data.dir else out / "data"
    fit_vocab(cfg, data_meta(data_dir))
    device = resolve_device(cfg.train.device)
    model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    mgr = CheckpointManager(out / "checkpoints")
    found = mgr.latest_good()
    mgr.close()
    if found is None:
        raise FileNotFoundError(f"no good checkpoint under {out / 'checkpoints'}")
    path, tensors, meta = found
    check_resume_config(path, meta, cfg, sections=("model",))  # a model.* override must not load silently
    restore_training_state(tensors, meta, model, restore_rng=False)
    return cfg, model, data_dir, path, int(meta["step"])


def cmd_export(args: argparse.Namespace) -> int:
    """Weights of a run's newest good checkpoint (or of --checkpoint FILE) as a Hugging Face directory."""
    from blumodels.hf import export_hf, read_hf_config

    if args.checkpoint:
        from blumodels.checkpoint.format import load_checkpoint
        from blumodels.families import build_model
        from blumodels.state import restore_training_state

        path = Path(args.checkpoint)
        tensors, meta = load_checkpoint(path)
        saved = meta.get("config")
        if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
            raise ConfigError(f"{path} holds no run config (written outside the Trainer): export it with "
                              "blumodels.hf.export_hf(model, DIR)")
        cfg = from_dict(saved, origin=str(path))
        if args.overrides:
            cfg = apply_overrides(cfg, list(args.overrides))
        model = build_model(cfg.model, device="cpu")
        restore_training_state(tensors, meta, model, restore_rng=False)
        run = Path(args.out) if args.out else path.parent.parent
        data_dir = Path(cfg.data.dir) if cfg.data.dir else run / "data"
        step = int(meta["step"])
    else:
        cfg, model, data_dir, path, step = _load_run(args)
    d = export_hf(model, args.hf, tokenizer_dir=data_dir if data_dir.is_dir() else None)
    arch = (read_hf_config(d).get("architectures") or ["AutoModelForCausalLM"])[0]  # the one config.json names
    print(f"[blutrain] {path} (step {step}) -> {d} (transformers: {arch}.from_pretrained({str(d)!r}))")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from blumodels.data.tokenizer import load_tokenizer
    from blumodels.sampling import sample_text

    cfg, model, data_dir, path, step = _load_run(args)
    t = cfg.train
    if args.cuda_graph == "true":
        from blumodels.decode import capture_refusal

        why = capture_refusal(next(iter(model.parameters())).device, model)
        if why is not None:
            raise ConfigError(f"--cuda-graph true cannot capture the decode step: {why} (use --cuda-graph auto)")
    tok = load_tokenizer(data_dir)
    text = sample_text(model, tok, t.sample_prompt if args.prompt is None else args.prompt, args.tokens,
                       top_k=args.top_k if args.top_k is not None else t.top_k,
                       temperature=args.temperature if args.temperature is not None else t.temperature,
                       seed=args.seed, top_p=args.top_p if args.top_p is not None else t.top_p,
                       cuda_graph={"auto": "auto", "true": True, "false": False}[args.cuda_graph])
    print(f"[blutrain] {path} (step {step}):", file=sys.stderr)
    print(text)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import blutensor as bt

    from blumodels.data.loader import TokenLoader
    from blumodels.trainer import data_meta

    cfg, model, data_dir, path, step = _load_run(args)
    t = cfg.train
    n = args.batches or t.eval_steps or 20
    device = str(next(iter(model.parameters())).device)
    loader = TokenLoader(data_dir, "val", t.micro_batch, t.seq_len, device=device,
                         vocab_size=int(data_meta(data_dir)["vocab_size"]))
    model.eval()
    total = 0.0
    from tqdm import tqdm

    with bt.no_grad():
        for _ in tqdm(range(n), desc="eval", unit="batch", file=sys.stderr, disable=not sys.stderr.isatty()):
            x, y = loader.next_batch()
            total += float(model(x, y)[1].item())
    print(json.dumps({"checkpoint": str(path), "step": step, "val_loss": total / n, "batches": n}))
    return 0


def plugin_rows() -> list[tuple[str, str, str, str]]:
    """(kind, name, package, version) of every plugin the host found, sorted."""
    from blutensor.ext import get_host

    return sorted((r.kind, r.name, r.package, r.version) for r in get_host().records())


def cmd_plugins(args: argparse.Namespace) -> int:
    rows = [("KIND", "NAME", "PACKAGE", "VERSION")] + plugin_rows()
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    from blutensor.ext import get_host

    for name, pkg, err in get_host().broken:
        print(f"BROKEN  {name} (package {pkg}): {err}")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from blumodels.config import preset_names
    from blumodels.families import count_params

    print(f"{'PRESET':<12} {'FAMILY':<6} {'LAYERS':>6} {'HEADS':>5} {'D_MODEL':>7} {'B':>3} {'T':>5} {'PARAMS':>8}")
    rows = []
    for name in preset_names():
        c = load_preset(name)
        m = c.model
        n = count_params(type(m)(**{**m.__dict__, "vocab_size": m.vocab_size or c.data.vocab_size}))
        rows.append((n, name, c))
    for n, name, c in sorted(rows, key=lambda r: (r[0], r[1])):  # size order, not name order
        m = c.model
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        print(f"{name:<12} {m.family:<6} {m.n_layer:>6} {m.n_head:>5} {m.d_model:>7} {c.train.micro_batch:>3} "
              f"{c.train.seq_len:>5} {size:>8}")
    return 0


COMMANDS = {"prepare": cmd_prepare, "train": cmd_train, "sample": cmd_sample, "eval": cmd_eval,
            "export": cmd_export, "profile": cmd_profile, "plugins": cmd_plugins, "presets": cmd_presets}


BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _gpu_visible() -> bool:
    """Cheap guess (no CuPy/NumPy import) whether `--device auto` will pick a GPU."""
    if importlib.util.find_spec("cupy") is None:
        return False
    gpus = "/proc/driver/nvidia/gpus"
    return os.path.exists("/dev/nvidia0") or (os.path.isdir(gpus) and bool(os.listdir(gpus)))


def limit_cpu_blas_threads(args: argparse.Namespace) -> bool:
    """One BLAS thread for CPU runs unless the user set a thread count (must run before NumPy loads).

    The GEMMs of small models gain little from more threads, and OpenBLAS's spinning threads collapse
    on a shared machine (tiny demo on 2 busy cores: 2 min 6 s with one thread, 6 min 24 s with two).
    """
    if args.cmd not in ("train", "sample", "eval", "profile") or "numpy" in sys.modules:
        return False
    if any(v in os.environ for v in BLAS_THREAD_VARS):
        return False
    dev = getattr(args, "device", None) or "auto"
    if dev == "cpu" or (dev == "auto" and not _gpu_visible()):
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        return True
    return False


def _input_errors() -> tuple[type[BaseException], ...]:
    """Exceptions whose message already names the file/tensor at fault: printed without a traceback."""
    from blumodels.checkpoint.format import CheckpointError
    from blumodels.data.corpus import CorpusError
    from blumodels.data.loader import LoaderError
    from blumodels.data.shards import ShardError
    from blumodels.data.tokenizer import TokenizerError
    from blumodels.hf import HFError
    from blumodels.state import StateError

    return (ShardError, LoaderError, CorpusError, TokenizerError, CheckpointError, StateError, HFError,
            FileNotFoundError)


_OVERRIDE = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*=")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``section.key=value`` overrides may stand anywhere (before, between, after options)."""
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    stray = [a for a in rest if not _OVERRIDE.match(a)]
    if stray:
        ap.error(f"unrecognized arguments: {' '.join(stray)}")
    if rest:
        if not hasattr(args, "overrides"):
            ap.error(f"`blutrain {args.cmd}` takes no section.key=value overrides: {' '.join(rest)}")
        args.overrides = list(args.overrides or []) + rest
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    limit_cpu_blas_threads(args)
    try:
        return COMMANDS[args.cmd](args)
    except ConfigError as e:
        print(f"blutrain: config error: {e}", file=sys.stderr)
        return 2
    except _input_errors() as e:  # a bad data file, checkpoint or run directory: the message names it
        print(f"blutrain: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("blutrain: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, read-only, name too long, ...: one line naming the file
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"blutrain: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except RecursionError:  # a structure nested beyond reason in some input file
        print("blutrain: error: an input file nests too deeply to read", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
