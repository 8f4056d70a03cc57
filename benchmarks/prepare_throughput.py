"""`blutrain prepare` throughput (GB of input per minute) and peak memory on a generated corpus.

    .venv/bin/python benchmarks/prepare_throughput.py --mb 1024 --cores 1 \
        --out benchmarks/results/prepare_throughput_cpu.json

The corpus is generated first (not timed): JSON-lines documents of 0.5-8 KB of words drawn with a Zipf law from
the vocabulary of the Python standard library's documentation (the built-in corpus), so that the tokenizer meets
real words at realistic frequencies; ``--format parquet`` or ``text`` writes the same documents as Parquet or as
one text file per 1000 documents. Then ``blutrain prepare`` runs in a child process pinned to ``--cores`` CPUs;
reported: wall time, input GB per minute, the child's peak RSS (``getrusage`` of the child), tokens written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def vocabulary() -> list[str]:
    from blumodels.data.corpus import builtin_corpus

    words: dict[str, int] = {}
    for doc in builtin_corpus(max_bytes=4_000_000):
        for w in re.findall(r"[A-Za-z][A-Za-z'-]*|[0-9]+|[.,;:()]", doc):
            words[w] = words.get(w, 0) + 1
    return [w for w, _ in sorted(words.items(), key=lambda kv: -kv[1])]


def generate(path: Path, target_bytes: int, fmt: str, seed: int = 0) -> int:
    """Write ~``target_bytes`` of documents at ``path``; returns the bytes written."""
    vocab = np.array(vocabulary(), dtype=object)
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, len(vocab) + 1) ** 1.1)
    cdf /= cdf[-1]
    written, docs = 0, []
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "w", encoding="utf-8") if fmt == "jsonl" else None
    text_dir = path if fmt == "text" else None
    if text_dir is not None:
        text_dir.mkdir(parents=True, exist_ok=True)
    chunk: list[str] = []
    n_chunk = 0
    while written < target_bytes:
        n_words = int(rng.integers(80, 1300))
        words = vocab[np.minimum(np.searchsorted(cdf, rng.random(n_words)), len(vocab) - 1)]
        breaks = rng.random(n_words) < 0.04
        text = " ".join(w + ("\n" if b else "") for w, b in zip(words.tolist(), breaks.tolist()))
        if fmt == "jsonl":
            line = json.dumps({"text": text}) + "\n"
            fh.write(line)
            written += len(line.encode())
        else:
            written += len(text.encode())
            chunk.append(text)
            if len(chunk) == 1000 or written >= target_bytes:
                if fmt == "parquet":
                    docs.extend(chunk)
                else:
                    (text_dir / f"part_{n_chunk:05d}.txt").write_text("\n\n".join(chunk))
                chunk, n_chunk = [], n_chunk + 1
    if fh is not None:
        fh.close()
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), path, row_group_size=2000)
        written = path.stat().st_size
    elif fmt == "text":
        written = sum(f.stat().st_size for f in text_dir.iterdir())
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64, help="corpus size in MiB")
    ap.add_argument("--format", choices=("jsonl", "parquet", "text"), default="jsonl")
    ap.add_argument("--tokenizer", choices=("gpt2", "bpe"), default="gpt2")
    ap.add_argument("--cores", type=int, default=1, help="CPUs the prepare process may use")
    ap.add_argument("--workdir", default=None, help="where the corpus and shards go (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="result JSON")
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="blutrain-prepare-bench-"))
    src = work / {"jsonl": "corpus.jsonl", "parquet": "corpus.parquet", "text": "corpus"}[args.format]
    t0 = time.perf_counter()
    size = generate(src, args.mb << 20, args.format)
    gen_s = time.perf_counter() - t0
    data = work / "data"
    cores = sorted(os.sched_getaffinity(0))[:args.cores]
    cmd = [sys.executable, "-m", "blumodels.cli", "prepare", "--out", str(data), "--source", str(src),
           "--corpus", "none", "--tokenizer", args.tokenizer, "--shard-tokens", "100000000", "--restart"]
    env = {**os.environ, "RAYON_NUM_THREADS": str(len(cores)), "OPENBLAS_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        print(err, file=sys.stderr)
        return 1
    meta = json.loads(out)
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    result = {
        "benchmark": "blutrain prepare throughput",
        "command": f".venv/bin/python benchmarks/prepare_throughput.py --mb {args.mb} --format {args.format} "
                   f"--tokenizer {args.tokenizer} --cores {args.cores}" + (f" --out {args.out}" if args.out else ""),
        "corpus": {"format": args.format, "bytes": size, "generate_s": round(gen_s, 1),
                   "documents": meta["train_documents"] + meta["val_documents"]},
        "tokenizer": meta["tokenizer"], "cores": len(cores), "wall_s": round(wall, 2),
        "gb_per_min": round(size / 1e9 / (wall / 60), 3), "mb_per_s": round(size / 1e6 / wall, 2),
        "peak_rss_mib": round(rss / 2**20, 1), "tokens": meta["train_tokens"] + meta["val_tokens"],
        "tokens_per_s": round((meta["train_tokens"] + meta["val_tokens"]) / wall),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus_visible": os.cpu_count(),
                    "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
