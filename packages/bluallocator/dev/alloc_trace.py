"""Synthetic allocation traces shaped like a transformer training step (GPT-2 style), for benchmarks.

A trace is a list of events: ``("alloc", id, nbytes)``, ``("free", id)`` and ``("step", k)`` marking the
start of step k. Forward keeps activations per layer and frees temporaries; backward frees them in
reverse and allocates activation gradients; parameter gradients and optimizer moments appear in step 0
and persist; the logits and their gradient are the biggest buffers. With several ``seq_lens`` the
sequence length changes from step to step (bucketed batches): many distinct sizes, the case where the
step-0 alignment profile matters.
"""

from __future__ import annotations

Event = tuple


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def transformer_trace(batch: int = 4, seq_lens: tuple[int, ...] = (1024,), d_model: int = 768,
                      n_layers: int = 12, vocab: int = 50257, steps: int = 3,
                      itemsize: int = 4) -> list[Event]:
    """Allocation events of model set-up plus ``steps`` training steps of a GPT-2-like model."""
    ev: list[Event] = []
    counter = [0]

    def alloc(n: int) -> int:
        counter[0] += 1
        ev.append(("alloc", counter[0], int(n)))
        return counter[0]

    def free(i: int) -> None:
        ev.append(("free", i))

    C, L, V, B, f = d_model, n_layers, vocab, batch, itemsize
    H = max(1, C // 64)
    shapes = [(C, 3 * C), (3 * C,), (C, C), (C,), (C, 4 * C), (4 * C,), (4 * C, C)] + [(C,)] * 5
    persistent = [alloc(_numel(s) * f) for _ in range(L) for s in shapes]
    persistent += [alloc(V * C * f), alloc(1024 * C * f)]
    staging = alloc(256 << 20)  # start-up only: e.g. a checkpoint read buffer, freed before training
    free(staging)
    for step in range(steps):
        ev.append(("step", step))
        T = seq_lens[step % len(seq_lens)]
        BT = B * T
        tokens = alloc(BT * 8)
        x = alloc(BT * C * f)
        saved: list[list[int]] = []
        for _layer in range(L):
            keep = [alloc(BT * C * f), alloc(BT * 4), alloc(BT * 4)]       # ln1 out, mean, rstd
            qkv = alloc(BT * 3 * C * f)
            tmp = alloc(BT * C * f)                                       # head-transpose scratch
            att = alloc(BT * C * f)
            lse = alloc(B * H * T * 4)
            free(tmp)
            proj = alloc(BT * C * f)
            x2 = alloc(BT * C * f)
            free(proj)
            ln2 = [alloc(BT * C * f), alloc(BT * 4), alloc(BT * 4)]
            fc = alloc(BT * 4 * C * f)
            gelu = alloc(BT * 4 * C * f)
            out = alloc(BT * C * f)
            x3 = alloc(BT * C * f)
            free(out)
            saved.append(keep + [qkv, att, lse, x2] + ln2 + [fc, gelu, x])
            x = x3
        lnf = alloc(BT * C * f)
        logits = alloc(BT * V * f)
        loss = alloc(BT * 4)
        free(logits)  # fused softmax/cross-entropy: the logits gradient is written in place
        dlogits = alloc(BT * V * f)
        dx = alloc(BT * C * f)
        free(dlogits)
        free(lnf)
        free(x)
        for layer in reversed(range(L)):
            d_fc = alloc(BT * 4 * C * f)
            d_gelu = alloc(BT * 4 * C * f)
            free(d_fc)
            d_qkv = alloc(BT * 3 * C * f)
            d_att = alloc(BT * C * f)
            free(d_att)
            free(d_gelu)
            new_dx = alloc(BT * C * f)
            free(d_qkv)
            free(dx)
            dx = new_dx
            for i in saved[layer]:
                free(i)
            if step == 0:  # parameter gradients and AdamW moments appear during the first backward
                persistent += [alloc(_numel(s) * f) for s in shapes for _ in range(3)]
        if step == 0:
            persistent += [alloc(V * C * f) for _ in range(3)]
        free(dx)
        free(loss)
        free(tokens)
        norm_tmp = alloc(len(persistent) * 4)
        free(norm_tmp)
    for i in persistent:
        free(i)
    return ev


def replay(ev: list[Event], malloc, free, on_step=None) -> None:
    """Run a trace through ``malloc(nbytes) -> handle`` / ``free(handle)``; ``on_step(k)`` at step marks."""
    live: dict[int, object] = {}
    for e in ev:
        if e[0] == "alloc":
            live[e[1]] = malloc(e[2])
        elif e[0] == "free":
            free(live.pop(e[1]))
        elif on_step is not None:
            on_step(e[1])
