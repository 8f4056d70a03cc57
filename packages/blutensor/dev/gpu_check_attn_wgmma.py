"""GPU check of the Hopper flash attention (kernels/sdpa_wgmma.cu) on an sm_90 device, self-checking.

Per config: max abs error against a float64 reference (PyTorch float64 on the GPU from the same bf16 inputs) of
o, lse, dq, dk, dv for ours (wgmma) next to ours (mma.sync) -- 'ok' when wgmma's error is within 2x mma's
(+ 2e-3) -- and bitwise repeatability of the backward; then ms forward / backward for a GPT-2 layer (B=16,
H=12, T=1024, HD=64, causal, the fused-qkv path) for ours (wgmma), ours (mma.sync), PyTorch SDPA with the cuDNN
backend and with PyTorch's flash backend. Each part runs in its own process (a kernel fault ends only that part).
The wgmma kernels are built with an mbarrier watchdog (a deadlock traps instead of hanging).

Usage: python packages/blutensor/dev/gpu_check_attn_wgmma.py [part ...] [--json PATH]   (parts: fwd bwd qkv time;
--json: the printed results also as JSON, for benchmarks/results/)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

PARTS = ("fwd", "bwd", "qkv", "time")
#: seconds a part may take: the first one also compiles kernels/sdpa_mma.cu and sdpa_wgmma.cu on a cold cache
#: (about a minute), and a part killed before its compile finished leaves nothing in the cache for the next
PART_TIMEOUT_S = 240
CONFIGS = [  # (BH, L, S, HD, causal)
    (6, 1000, 1000, 64, True),
    (6, 1000, 1000, 64, False),
    (5, 77, 77, 128, False),
    (5, 77, 77, 128, True),
    (7, 333, 333, 128, True),
    (3, 200, 300, 64, False),
    (2, 300, 200, 128, True),
]


def _setup():
    from blutensor.backends.cupy import _loader

    src = _loader.source

    def watched(file):
        text = src(file)
        return "#define BLU_MBAR_SPIN_LIMIT (1u << 24)\n" + text if file == "sdpa_wgmma.cu" else text

    _loader.source = watched


def _bf16(shape, seed):
    import cupy as cp
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)
    return cp.asarray(x.view(torch.int16)).view(cp.uint16), x


def _t(a):
    import cupy as cp
    import torch

    if a.dtype == cp.uint16:
        return torch.as_tensor(a.view(cp.int16), device="cuda").view(torch.bfloat16).double()
    return torch.as_tensor(a, device="cuda").double()


def _ref(q, k, v, do, causal, sc):
    import torch

    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    s = q @ k.transpose(-1, -2) * sc
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ v
    o.backward(do.double())
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


RESULTS: list[dict] = []


def part_fwd_bwd(with_bwd: bool) -> bool:
    from blutensor.backends.cupy import sdpa

    ok_all = True
    for i, (BH, L, S, hd, causal) in enumerate(CONFIGS):
        sc = 1.0 / math.sqrt(hd)
        q, tq = _bf16((BH, L, hd), 10 * i)
        k, tk = _bf16((BH, S, hd), 10 * i + 1)
        v, tv = _bf16((BH, S, hd), 10 * i + 2)
        do, tdo = _bf16((BH, L, hd), 10 * i + 3)
        ref = _ref(tq, tk, tv, tdo, causal, sc)
        errs = {}
        for var in ("bf16_wgmma", "bf16"):
            o, lse = sdpa.flash_attention_forward(q, k, v, causal, sc, var)
            e = [float((_t(o) - ref[0]).abs().max()), float((_t(lse) - ref[1]).abs().max())]
            if with_bwd:
                g = sdpa.flash_attention_backward(q, k, v, o, lse, do, causal, sc, var)
                e += [float((_t(x) - r).abs().max()) for x, r in zip(g, ref[2:])]
                if var == "bf16_wgmma":
                    g2 = sdpa.flash_attention_backward(q, k, v, o, lse, do, causal, sc, var)
                    det = all(bool((a == b).all()) for a, b in zip(g, g2))
            errs[var] = e
        ok = all(a <= 2 * b + 2e-3 for a, b in zip(errs["bf16_wgmma"], errs["bf16"]))
        ok = ok and (det if with_bwd else True)
        ok_all &= ok
        names = "o lse dq dk dv".split()
        RESULTS.append(dict(part="bwd" if with_bwd else "fwd", BH=BH, L=L, S=S, hd=hd, causal=causal, ok=bool(ok),
                            max_abs_err_wgmma=dict(zip(names, errs["bf16_wgmma"])),
                            max_abs_err_mma=dict(zip(names, errs["bf16"])),
                            deterministic=bool(det) if with_bwd else None))
        cmp = " ".join(f"{n} {a:.1e}/{b:.1e}" for n, a, b in zip(names, errs["bf16_wgmma"], errs["bf16"]))
        print(f"{'ok  ' if ok else 'FAIL'} BH={BH} L={L} S={S} hd={hd} causal={int(causal)} wgmma/mma: {cmp}"
              + (f" det={int(det)}" if with_bwd else ""), flush=True)
    return ok_all


def part_qkv() -> bool:
    import cupy as cp
    from blutensor.backends.cupy import sdpa

    ok_all = True
    for B, T, H, hd, causal in ((2, 1000, 3, 64, True), (3, 77, 2, 128, True), (1, 300, 5, 64, False)):
        sc = 1.0 / math.sqrt(hd)
        qkv, tqkv = _bf16((B, T, 3, H, hd), B * T)
        do, tdo = _bf16((B, T, H, hd), B * T + 1)
        tq, tk, tv = (tqkv[:, :, j].permute(0, 2, 1, 3) for j in range(3))
        ref = _ref(tq, tk, tv, tdo.permute(0, 2, 1, 3), causal, sc)
        res = {}
        for var in ("bf16_wgmma", "bf16"):
            o, lse = sdpa.qkv_attention_forward(qkv, causal, sc, var)
            d = sdpa.qkv_attention_backward(qkv, o, lse, cp.ascontiguousarray(do), causal, sc, var)
            to, td = _t(o).permute(0, 2, 1, 3), _t(d)
            e = [float((to - ref[0]).abs().max()), float((_t(lse).reshape(B, H, T) - ref[1]).abs().max())]
            e += [float((td[:, :, j].permute(0, 2, 1, 3) - ref[2 + j]).abs().max()) for j in range(3)]
            res[var] = e
        ok = all(a <= 2 * b + 2e-3 for a, b in zip(res["bf16_wgmma"], res["bf16"]))
        ok_all &= ok
        RESULTS.append(dict(part="qkv", B=B, T=T, H=H, hd=hd, causal=causal, ok=bool(ok),
                            max_abs_err_wgmma=dict(zip("o lse dq dk dv".split(), res["bf16_wgmma"])),
                            max_abs_err_mma=dict(zip("o lse dq dk dv".split(), res["bf16"]))))
        cmp = " ".join(f"{n} {a:.1e}/{b:.1e}" for n, a, b in zip("o lse dq dk dv".split(), res["bf16_wgmma"],
                                                                   res["bf16"]))
        print(f"{'ok  ' if ok else 'FAIL'} qkv B={B} T={T} H={H} hd={hd} causal={int(causal)} wgmma/mma: {cmp}",
              flush=True)
    return ok_all


def _ms(fn, n=20):
    import torch

    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def _time_config(B, T, H, hd, causal):
    import torch
    from blutensor.backends.cupy import sdpa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qkv, tqkv = _bf16((B, T, 3, H, hd), 7)
    do, tdo = _bf16((B, T, H, hd), 8)
    rows = []
    for var in ("bf16_wgmma", "bf16"):
        st = {}

        def fwd(var=var, st=st):
            st["o"], st["lse"] = sdpa.qkv_attention_forward(qkv, causal, None, var)

        def bwd(var=var, st=st):
            sdpa.qkv_attention_backward(qkv, st["o"], st["lse"], do, causal, None, var)

        fwd()
        rows.append((f"ours ({'wgmma' if var == 'bf16_wgmma' else 'mma.sync'})", _ms(fwd), _ms(bwd)))
    q, k, v = (tqkv[:, :, j].permute(0, 2, 1, 3).detach().requires_grad_(True) for j in range(3))
    g = tdo.permute(0, 2, 1, 3)
    for name, be in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash (PyTorch)", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(be):
                f = _ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                tb = _ms(lambda y=y: torch.autograd.grad(y, (q, k, v), g, retain_graph=True))
            rows.append((name, f, tb))
        except Exception as exc:  # noqa: BLE001 - a backend missing on this build
            print(f"{name}: unavailable ({str(exc).splitlines()[0][:100]})")
    print(f"B={B} H={H} T={T} HD={hd} causal={int(causal)}, ms per call:")
    for name, f, b in rows:
        print(f"  {name:18s} fwd {f:.3f}  bwd {b:.3f}  total {f + b:.3f}")
        RESULTS.append(dict(part="time", B=B, T=T, H=H, hd=hd, causal=causal, impl=name, fwd_ms=f, bwd_ms=b))


def part_time() -> bool:
    _time_config(16, 1024, 12, 64, True)  # a GPT-2 124M layer (x12 = one step's attention)
    _time_config(4, 2048, 32, 128, True)
    return True


def main(argv: list[str]) -> int:
    parts = [a for a in argv if a in PARTS]
    if len(parts) == 1 and os.environ.get("BLU_ATTN_CHILD"):
        _setup()
        p = parts[0]
        ok = {"fwd": lambda: part_fwd_bwd(False), "bwd": lambda: part_fwd_bwd(True), "qkv": part_qkv,
              "time": part_time}[p]()
        if os.environ.get("BLU_ATTN_JSON"):
            with open(os.environ["BLU_ATTN_JSON"], "a") as f:
                for r in RESULTS:
                    f.write(json.dumps(r) + "\n")
        return 0 if ok else 1
    out = argv[argv.index("--json") + 1] if "--json" in argv else None
    lines = out + ".lines" if out else None
    bad = 0
    for p in parts or PARTS:
        print(f"== {p}", flush=True)
        env = dict(os.environ, BLU_ATTN_CHILD="1", **({"BLU_ATTN_JSON": lines} if lines else {}))
        try:
            r = subprocess.run([sys.executable, __file__, p], env=env, timeout=PART_TIMEOUT_S)
            bad += r.returncode != 0
            if r.returncode:
                print(f"== {p}: exit {r.returncode}", flush=True)
        except subprocess.TimeoutExpired:
            bad += 1
            print(f"== {p}: timed out (hang?)", flush=True)
    print("ALL OK" if not bad else f"{bad} part(s) failed")
    if out:
        import torch

        rows = [json.loads(x) for x in open(lines)] if os.path.exists(lines) else []
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "all_ok": not bad,
                       "results": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
