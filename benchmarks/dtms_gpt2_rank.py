"""One rank of a benchmarks/dtms_gpt2.py run: GPT-2 trained under one BluTrain (dtms) or PyTorch strategy.

Started by the driver (blurun for BluTrain ranks, one plain process per rank with torch.distributed's
environment for PyTorch ranks, a single process for the single-device references). Every rank writes
OUT_DIR/<name>.rank<k>.json: per-step global losses, per-step seconds, memory, device.

Same model (BluTrain's init, seed 0, copied into PyTorch), same batches (benchmarks/e2e_gpt2.batches: the
global batch of each step; every rank takes its part), same AdamW (lr 6e-4, betas 0.9/0.95, eps 1e-8,
weight decay 0.1 on every parameter), gradient clipping at 1.0 over the whole model; fp32, TF32 off.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from e2e_gpt2 import batches  # noqa: E402

LR, CLIP, WD, BETAS, EPS = 6e-4, 1.0, 0.1, (0.9, 0.95), 1e-8


def model_config(a):
    from blumodels.config import ModelConfig

    return ModelConfig(n_layer=a.layers, n_head=a.heads, d_model=a.d_model, block_size=max(1024, a.seq),
                       vocab_size=a.vocab, dropout=0.0)


def cpu_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ---------------------------------------------------------------- BluTrain (dtms)

def run_blutrain(a) -> dict:
    import blutensor as bt
    from blumodels.gpt2 import build_model

    cuda = bt.cuda.is_available() and a.device != "cpu"
    dev = "cuda" if cuda else "cpu"
    alloc = None
    if cuda:
        import cupy

        if a.allocator == "caching":
            import bluallocator

            alloc = bluallocator.install()
        bt.set_matmul_precision("fp32")
    model = build_model(model_config(a), device=dev, seed=0)
    par, m, backend = None, model, "none"
    if a.strategy == "layout":  # the Trainer's path: a [parallel] table applied through the registered plugin
        import dtms
        from blumodels.config import apply_overrides, load_preset
        from blumodels.dist import Dist

        pg = dtms.init_process_group()
        backend, W = pg.backend, pg.size()
        over = [f"parallel.{kv}" for kv in a.layout.split(",") if kv]
        sizes = dict(kv.split("=") for kv in a.layout.split(",") if kv)
        dp_total = W // (int(sizes.get("tp", 1)) * int(sizes.get("cp", 1)))
        cfg = apply_overrides(load_preset("tiny"), [
            f"model.n_layer={a.layers}", f"model.n_head={a.heads}", f"model.d_model={a.d_model}",
            f"model.block_size={max(1024, a.seq)}", f"model.vocab_size={a.vocab}", "model.dropout=0",
            f"train.seq_len={a.seq}", f"train.micro_batch={a.batch // dp_total}", f"train.world_size={W}",
            f"train.batch_tokens={a.batch * a.seq}", *over])
        dist = Dist(dtms.get_rank(), W, pg, dtms.get_local_rank())
        m = dist.wrap(model, cfg)
        par = dist.par
    elif a.strategy != "single":
        import dtms
        from blumodels.gpt2_parallelize import gpt2_plan
        from dtms.parallel import ParallelDims, parallelize

        pg = dtms.init_process_group()
        backend = pg.backend
        W = pg.size()
        dims = {"ddp": ParallelDims(dp=W), "fsdp": ParallelDims(dp=W), "tp": ParallelDims(tp=W),
                "cp": ParallelDims(cp=W)}[a.strategy]
        par = parallelize(model, dims, fsdp=a.strategy == "fsdp", async_tp_chunks=a.tp_chunks,
                          cp_rotator=a.rotator, bucket_cap_mb=a.bucket_mb, seq_len=a.seq, plan=gpt2_plan(model))
        m = par.model
    params = par.model.parameters() if par is not None and par.fsdp else (
        model.parameters() if par is not None else m.parameters())
    opt = bt.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True if cuda else None)

    def sync():
        if cuda:
            cupy.cuda.Device().synchronize()

    losses, times = [], []
    for x, y in batches(a.batch, a.seq, a.steps):
        if par is not None:
            x, y = par.local_batch(x), par.local_batch(y)
        xi, yi = bt.tensor(x, device=dev), bt.tensor(y, device=dev)
        sync()
        t0 = time.perf_counter()
        _, loss = m(xi, yi)
        loss.backward()
        lv = float(loss.item())
        if par is not None:
            lv = par.global_loss(lv)
            par.clip_grad_norm_(CLIP)
        else:
            bt.optim.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(lv)
    mem: dict = {}
    if cuda:
        free, total = cupy.cuda.runtime.memGetInfo()
        mem["device_used_gib"] = (total - free) / 2**30
        if alloc is not None:
            st = alloc.memory_stats()
            mem.update(peak_allocated_gib=st["peak_allocated_bytes"] / 2**30,
                       peak_reserved_gib=st["peak_reserved_bytes"] / 2**30, memory_source="bluallocator")
        else:  # CuPy's pool never shrinks here: its size at the end is its peak
            pool = cupy.get_default_memory_pool()
            mem.update(peak_reserved_gib=pool.total_bytes() / 2**30, memory_source="cupy pool total_bytes")
    else:
        mem.update(peak_reserved_gib=cpu_peak_gib(), memory_source="ru_maxrss (host)")
    if par is not None:
        par.close()
        import dtms

        dtms.destroy_process_group()
    return {"losses": losses, "step_s": times, "device": dev, "backend": backend, **mem}


# ---------------------------------------------------------------- PyTorch

def run_torch(a) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from blumodels.gpt2 import build_model
    from torch_gpt2 import from_blutrain

    cuda = torch.cuda.is_available() and a.device != "cpu"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    W, rank, backend = 1, 0, "none"
    if a.strategy != "single":
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, device_id=dev if cuda else None)
        W, rank = dist.get_world_size(), dist.get_rank()
    gpt = from_blutrain(build_model(model_config(a), device="cpu", seed=0), device=dev)

    class WithPositions(nn.Module):
        """TorchGPT2's forward with the token positions as an input (context parallelism shards them)."""

        def __init__(self, g):
            super().__init__()
            self.g = g

        def forward(self, idx, targets, pos):
            g = self.g
            x = g.wte(idx) + g.wpe(pos)
            for b in g.blocks:
                x = b(x)
            logits = F.linear(g.ln_f(x), g.wte.weight)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    model = WithPositions(gpt)
    cp_ctx = None
    if a.strategy in ("ddp", "cp"):
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[0] if cuda else None, bucket_cap_mb=a.bucket_mb)
    elif a.strategy == "tp":  # Megatron's split through torch.distributed.tensor.parallel (DTensor)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(dev.type, (W,))
        d = a.d_model
        order = torch.arange(3 * d).view(3, W, d // W).transpose(0, 1).reshape(-1).to(dev)
        with torch.no_grad():
            for blk in gpt.blocks:
                # fused QKV rows reordered so that an even row split gives each rank q, k and v of its own heads
                blk.c_attn.weight.copy_(blk.c_attn.weight[order])
                blk.c_attn.bias.copy_(blk.c_attn.bias[order])
                blk.h = a.heads // W
        for blk in gpt.blocks:
            parallelize_module(blk, mesh, {"c_attn": ColwiseParallel(), "attn_proj": RowwiseParallel(),
                                           "c_fc": ColwiseParallel(), "mlp_proj": RowwiseParallel()})
    elif a.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for b in gpt.blocks:
            fully_shard(b)
        fully_shard(model)
    if a.strategy == "cp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh(dev.type, (W,))
        cp_ctx = (context_parallel, mesh)
    fused = cuda and a.strategy != "fsdp"  # FSDP2's DTensor parameters: the default (foreach) implementation
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=fused or None)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    dp = W if a.strategy in ("ddp", "fsdp") else 1
    b = a.batch // dp
    for x, y in batches(a.batch, a.seq, a.steps):
        x, y = x[rank % dp * b:(rank % dp + 1) * b], y[rank % dp * b:(rank % dp + 1) * b]  # dp = 1: all rows
        xi, yi = torch.from_numpy(np.ascontiguousarray(x)).to(dev), torch.from_numpy(np.ascontiguousarray(y)).to(dev)
        pos = torch.arange(a.seq, device=dev).unsqueeze(0)
        sync()
        t0 = time.perf_counter()
        if cp_ctx is not None:
            ctx, mesh = cp_ctx
            with ctx(mesh, buffers=[xi, yi, pos], buffer_seq_dims=[1, 1, 1]):
                loss = model(xi, yi, pos)
                loss.backward()
        else:
            loss = model(xi, yi, pos)
            loss.backward()
        lt = loss.detach().clone()
        if W > 1:
            dist.all_reduce(lt)  # SUM (gloo has no AVG)
            lt /= W
        if a.strategy == "tp":  # DTensor and plain gradients together: the global norm by hand
            from torch.distributed.tensor import DTensor

            gs = [p.grad for p in model.parameters() if p.grad is not None]
            full = [g.full_tensor() if isinstance(g, DTensor) else g for g in gs]
            norm = torch.sqrt(sum((f.double() ** 2).sum() for f in full))
            coef = (CLIP / (norm + 1e-6)).clamp(max=1.0)
            for g in gs:
                g.mul_(coef.to(g.dtype).item())
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = float(lt.item())
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(lv)
    mem: dict = {"torch": torch.__version__, "optimizer": "fused" if fused else "foreach/default"}
    if cuda:
        free, total = torch.cuda.mem_get_info()
        mem.update(device_used_gib=(total - free) / 2**30, peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                   peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                   memory_source="torch.cuda.max_memory_reserved")
    else:
        mem.update(peak_reserved_gib=cpu_peak_gib(), memory_source="ru_maxrss (host)")
    if W > 1:
        dist.barrier()
        dist.destroy_process_group()
    return {"losses": losses, "step_s": times, "device": str(dev), "backend": backend, **mem}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=("blutrain", "torch"), required=True)
    p.add_argument("--strategy", choices=("single", "ddp", "fsdp", "tp", "cp", "layout"), required=True)
    p.add_argument("--layout", default="", help="strategy 'layout': [parallel] keys, e.g. fsdp=2,tp=2")
    p.add_argument("--name", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--rotator", default="p2p")
    p.add_argument("--tp-chunks", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--allocator", default="cupy")
    p.add_argument("--device", default="auto", help="auto: CUDA when present; cpu forces the CPU")
    return p


def main() -> None:
    a = parser().parse_args()
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    try:
        r = run_blutrain(a) if a.framework == "blutrain" else run_torch(a)
    except Exception as e:  # noqa: BLE001 - recorded for the driver, then a nonzero exit ends the gang
        r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    r["rank"] = rank
    Path(a.out_dir, f"{a.name}.rank{rank}.json").write_text(json.dumps(r))
    if "error" in r:
        print(r["traceback"], file=sys.stderr, flush=True)
    if a.framework == "torch":
        # The result is on disk. Skip interpreter teardown: gloo's C++ threads can abort a finished rank there
        # ("terminate called without an active exception", seen once in CI), which would fail a good run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if "error" in r else 0)
    if "error" in r:
        sys.exit(1)


if __name__ == "__main__":
    main()
