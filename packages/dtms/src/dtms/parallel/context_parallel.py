"""Context parallelism: the sequence sharded over the CP group with the load-balanced causal layout
(2W chunks; rank r holds chunks r and 2W-1-r), ring attention whose forward uses one rotator (K/V)
and whose backward uses two (K/V again, and their gradients back to their owners), each visible chunk pair
computed by blutensor's attention block (flash kernels on CUDA, O(T_local) memory on CPU) that returns its
log-sum-exp, per-block outputs merged with the numerically stable log-sum-exp (sigmoid) update, and three
interchangeable rotator backends: all-to-all, all-gather and peer-to-peer (a ring whose next exchange is in
flight while the current block computes, forward and backward).

Applied from outside the model: :func:`apply_context_parallel` installs a dispatch observer that
turns causal ``sdpa`` calls into ring attention and gives the positional embedding the global
positions of the local tokens; :func:`shard_sequence` lays out a batch at the data boundary.
"""

from __future__ import annotations

import contextlib
import math

import blutensor as bt
import numpy as np
from blutensor import Tensor, ext
from blutensor.autograd import Function
from blutensor.ext import attention_block_backward, attention_block_forward

from dtms.parallel.comm_ops import STATS, TIMELINE
from dtms.process_group import ProcessGroup


def chunk_ids(rank: int, world: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*world) that ``rank`` holds."""
    return rank, 2 * world - 1 - rank


def local_positions(seq_len: int, rank: int, world: int) -> np.ndarray:
    """Global positions of this rank's tokens, in local order."""
    c = seq_len // (2 * world)
    a, b = chunk_ids(rank, world)
    return np.concatenate([np.arange(a * c, (a + 1) * c), np.arange(b * c, (b + 1) * c)])


def shard_sequence(x, rank: int, world: int, dim: int = 1):
    """This rank's load-balanced slice of ``x`` along ``dim`` (NumPy/CuPy array or Tensor)."""
    arr = x._data if isinstance(x, Tensor) else x
    T = arr.shape[dim]
    if T % (2 * world):
        raise ValueError(f"context parallel: sequence length {T} is not divisible by 2*cp={2 * world}")
    pos = local_positions(T, rank, world)
    xp = bt.ext.array_module(arr)
    out = xp.take(arr, xp.asarray(pos), axis=dim)
    return Tensor._from_data(out, x.dtype, x.device) if isinstance(x, Tensor) else out


# ---- rotators: how each rank obtains the other ranks' blocks ----


class Rotator:
    """Yields (owner rank, block arrays) for every rank's block, own first."""

    name = ""

    def __init__(self, group: ProcessGroup):
        self.group = group

    def blocks(self, arrays):
        raise NotImplementedError

    def reduce_to_owners(self, contribs):
        """``contribs[j]``: this rank's gradient contributions for rank j's block -> summed own block."""
        raise NotImplementedError

    def forward_pass(self, arrays, compute) -> None:
        """``compute(j, *block_j)`` for every rank j's block."""
        for s, (j, blk) in enumerate(self.blocks(arrays)):
            TIMELINE.mark("cp_compute_begin", step=s, phase="fwd")
            compute(j, *blk)
            TIMELINE.mark("cp_compute_end", step=s, phase="fwd")

    def backward_pass(self, arrays, compute):
        """``compute(j, *block_j)`` returns this rank's gradient parts for block j; returns the own block's sum."""
        W = self.group.size()
        contribs = [None] * W
        for s, (j, blk) in enumerate(self.blocks(arrays)):
            TIMELINE.mark("cp_compute_begin", step=s, phase="bwd")
            contribs[j] = compute(j, *blk)
            TIMELINE.mark("cp_compute_end", step=s, phase="bwd")
        return self.reduce_to_owners(contribs)


class P2PRotator(Rotator):
    """Ring: at each step send the block held to rank+1 and receive from rank-1; the next block's exchange is
    posted before the current block computes (``forward_pass``/``backward_pass``), so it is in flight meanwhile."""

    name = "p2p"

    def blocks(self, arrays):
        g, W, r = self.group, self.group.size(), self.group.rank()
        cur = [a.copy() for a in arrays]
        for s in range(W):
            yield (r - s) % W, cur
            if s == W - 1:
                break
            nxt = [bt.ext.array_module(a).empty_like(a) for a in cur]
            works = []
            for i, (a, b) in enumerate(zip(cur, nxt)):
                works.append(g.isend(a, (r + 1) % W, tag=i))
                works.append(g.irecv(b, (r - 1) % W, tag=i))
                STATS.add("cp_p2p")
            for w in works:
                w.wait()
            cur = nxt

    def _post(self, arrays, dst: int, src: int, tag0: int):
        g = self.group
        nxt = [bt.ext.array_module(a).empty_like(a) for a in arrays]
        works = []
        for i, (a, b) in enumerate(zip(arrays, nxt)):
            works.append(g.isend(a, dst, tag=tag0 + i))
            works.append(g.irecv(b, src, tag=tag0 + i))
            STATS.add("cp_p2p")
        g.start_p2p()  # NCCL: launched now on the communication stream, not at the first wait
        return nxt, works

    def forward_pass(self, arrays, compute) -> None:
        W, r = self.group.size(), self.group.rank()
        cur = [bt.ext.array_module(a).ascontiguousarray(a) for a in arrays]
        for s in range(W):
            nxt, works = None, []
            if s < W - 1:  # the next block travels while this one computes
                nxt, works = self._post(cur, (r + 1) % W, (r - 1) % W, 0)
                TIMELINE.mark("cp_post", step=s + 1, phase="fwd")
            TIMELINE.mark("cp_compute_begin", step=s, phase="fwd")
            compute((r - s) % W, *cur)
            TIMELINE.mark("cp_compute_end", step=s, phase="fwd")
            for w in works:
                w.wait()
            if nxt is not None:
                TIMELINE.mark("cp_wait", step=s + 1, phase="fwd")
                cur = nxt

    def backward_pass(self, arrays, compute):
        """K/V go around the ring once more; each block's gradient accumulator follows it one step behind
        (posted after this rank's contribution, waited for after the next block computed) and reaches its
        owner after W hops. Returns this rank's own block gradients."""
        W, r = self.group.size(), self.group.rank()
        cur = [bt.ext.array_module(a).ascontiguousarray(a) for a in arrays]
        acc_in, acc_works = None, []
        for s in range(W):
            nxt, works = None, []
            if s < W - 1:
                nxt, works = self._post(cur, (r + 1) % W, (r - 1) % W, 0)
                TIMELINE.mark("cp_post", step=s + 1, phase="bwd")
            TIMELINE.mark("cp_compute_begin", step=s, phase="bwd")
            contrib = compute((r - s) % W, *cur)
            TIMELINE.mark("cp_compute_end", step=s, phase="bwd")
            for w in acc_works:  # the accumulator of this block from rank-1 (sent after its step s-1)
                w.wait()
            acc = contrib if acc_in is None else [a + c for a, c in zip(acc_in, contrib)]
            acc_in, acc_works = self._post(acc, (r + 1) % W, (r - 1) % W, 8)
            for w in works:
                w.wait()
            if nxt is not None:
                cur = nxt
        for w in acc_works:
            w.wait()
        return acc_in

    def reduce_to_owners(self, contribs):
        # pass an accumulator around the ring: after W-1 hops it holds every rank's part for its owner
        g, W, r = self.group, self.group.size(), self.group.rank()
        acc = [c.copy() for c in contribs[(r + 1) % W]]
        for s in range(1, W):
            nxt = [bt.ext.array_module(a).empty_like(a) for a in acc]
            works = []
            for a, b in zip(acc, nxt):
                works.append(g.isend(a, (r - 1) % W))
                works.append(g.irecv(b, (r + 1) % W))
                STATS.add("cp_p2p")
            for w in works:
                w.wait()
            owner = (r + 1 + s) % W
            acc = [b + c for b, c in zip(nxt, contribs[owner])]
        return acc


class AllGatherRotator(Rotator):
    """All-gather every block once; gradients go home with a reduce-scatter."""

    name = "allgather"

    def blocks(self, arrays):
        g, W, r = self.group, self.group.size(), self.group.rank()
        gathered = []
        for a in arrays:
            xp = bt.ext.array_module(a)
            out = xp.empty((W,) + a.shape, dtype=a.dtype)
            g.all_gather(out, xp.ascontiguousarray(a))
            STATS.add("cp_all_gather")
            gathered.append(out)
        for s in range(W):
            j = (r - s) % W
            yield j, [o[j] for o in gathered]

    def reduce_to_owners(self, contribs):
        g, W = self.group, self.group.size()
        out = []
        for k in range(len(contribs[0])):
            xp = bt.ext.array_module(contribs[0][k])
            stacked = xp.ascontiguousarray(xp.stack([contribs[j][k] for j in range(W)]))
            res = xp.empty(stacked.shape[1:], dtype=stacked.dtype)
            g.reduce_scatter(res, stacked, op="sum")
            STATS.add("cp_reduce_scatter")
            out.append(res)
        return out


class AllToAllRotator(Rotator):
    """All-to-all exchange of blocks (each rank sends its block to every rank) and of gradients."""

    name = "alltoall"

    def blocks(self, arrays):
        g, W, r = self.group, self.group.size(), self.group.rank()
        recv = []
        for a in arrays:
            xp = bt.ext.array_module(a)
            send = xp.ascontiguousarray(xp.broadcast_to(a, (W,) + a.shape))
            out = xp.empty_like(send)
            g.all_to_all(out, send)
            STATS.add("cp_all_to_all")
            recv.append(out)
        for s in range(W):
            j = (r - s) % W
            yield j, [o[j] for o in recv]

    def reduce_to_owners(self, contribs):
        g, W = self.group, self.group.size()
        out = []
        for k in range(len(contribs[0])):
            xp = bt.ext.array_module(contribs[0][k])
            send = xp.ascontiguousarray(xp.stack([contribs[j][k] for j in range(W)]))
            recv = xp.empty_like(send)
            g.all_to_all(recv, send)
            STATS.add("cp_all_to_all")
            out.append(recv.sum(axis=0))
        return out


ROTATORS = {"p2p": P2PRotator, "allgather": AllGatherRotator, "alltoall": AllToAllRotator}


# ---- ring attention ----


def visible_pairs(r: int, j: int, world: int) -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, causal) of rank r's two chunks against rank j's two that any query sees: an
    earlier chunk fully, the same chunk causally, a later one not at all."""
    out = []
    for a, qc in enumerate(chunk_ids(r, world)):
        for b, kc in enumerate(chunk_ids(j, world)):
            if qc >= kc:
                out.append((a, b, qc == kc))
    return out


def _merge(out, lse, bout, blse):
    """Stable merge (the log-sum-exp merge written as a sigmoid) of a block's (output, lse) into the running (output,
    lse) of the same rows: out += sigmoid(blse - lse) * (bout - out); lse = lse + softplus(blse - lse). In place."""
    xp = bt.ext.array_module(out)
    blse = blse.astype(lse.dtype, copy=False)
    both = xp.isfinite(blse)
    first = ~xp.isfinite(lse) & both
    d = xp.where(both & ~first, blse - lse, 0.0)
    w = xp.where(first, 1.0, xp.where(both, 1.0 / (1.0 + xp.exp(-d)), 0.0))
    out += (w[..., None] * (bout - out)).astype(out.dtype, copy=False)
    lse[...] = xp.where(first, blse, xp.where(both, lse + xp.logaddexp(0.0, d), lse))


class RingAttention(Function):
    """Causal attention over the CP group: every rank's K/V block visits every rank (the rotator); per visible
    chunk pair one :func:`blutensor.ext.attention_block_forward` (the flash kernels on CUDA,
    O(T_local) memory on CPU) whose (output, LSE) merge into the rows' running result. Backward: the same
    blocks again, :func:`attention_block_backward` from the merged output and LSE, and the K/V gradients
    sent home to their owners."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cp):
        qa, ka, va = q._data, k._data, v._data
        scale = 1.0 / math.sqrt(qa.shape[-1])
        xp = bt.ext.array_module(qa)
        r, W = cp.group.rank(), cp.group.size()
        c = qa.shape[-2] // 2
        out = xp.zeros(qa.shape[:-1] + (va.shape[-1],), dtype=qa.dtype)
        lse = xp.full(qa.shape[:-1], -xp.inf, dtype=xp.float64 if qa.dtype == xp.float64 else xp.float32)

        def compute(j, kb, vb):
            for a, b, causal in visible_pairs(r, j, W):
                rows = slice(a * c, (a + 1) * c)
                cols = slice(b * c, (b + 1) * c)
                bo, bl = attention_block_forward(qa[..., rows, :], kb[..., cols, :], vb[..., cols, :], causal, scale)
                _merge(out[..., rows, :], lse[..., rows], bo, bl)

        cp.rotator.forward_pass([ka, va], compute)
        ctx.saved = (qa, ka, va, out, lse, scale, cp)
        return Tensor._from_data(out, q.dtype, q.device)

    @staticmethod
    def backward(ctx, g: Tensor):
        qa, ka, va, out, lse, scale, cp = ctx.saved
        xp = bt.ext.array_module(qa)
        r, W = cp.group.rank(), cp.group.size()
        c = qa.shape[-2] // 2
        do = xp.ascontiguousarray(g._data).astype(out.dtype, copy=False)
        dq = xp.zeros_like(qa)

        def compute(j, kb, vb):
            dk, dv = xp.zeros_like(kb), xp.zeros_like(vb)
            for a, b, causal in visible_pairs(r, j, W):
                rows = slice(a * c, (a + 1) * c)
                cols = slice(b * c, (b + 1) * c)
                gq, gk, gv = attention_block_backward(qa[..., rows, :], kb[..., cols, :], vb[..., cols, :],
                                                      out[..., rows, :], lse[..., rows], do[..., rows, :],
                                                      causal, scale)
                dq[..., rows, :] += gq
                dk[..., cols, :] += gk
                dv[..., cols, :] += gv
            return [dk, dv]

        dk, dv = cp.rotator.backward_pass([ka, va], compute)
        mk = lambda a, like: Tensor._from_data(a.astype(like.dtype, copy=False), None, g.device)  # noqa: E731
        return mk(dq, qa), mk(dk, ka), mk(dv, va), None


class ContextParallel:
    """Dispatch observer: causal sdpa -> ring attention; positional embedding, or the rotary tables of ``rope``
    ops (``rotary``: device -> full-length (cos, sin)), -> the local tokens' global positions."""

    def __init__(self, group: ProcessGroup, rotator: str = "p2p", position_weight=None, rotary=None):
        if rotator not in ROTATORS:
            raise ValueError(f"context parallel: rotator must be one of {sorted(ROTATORS)}, got {rotator!r}")
        self.group = group
        self.rotator = ROTATORS[rotator](group)
        self.position_weight = position_weight
        self.rotary = rotary
        self._tables: dict = {}  # (device, T_local) -> the local positions' (cos, sin)
        self._busy = False

    def __call__(self, op, inputs, attrs, run):
        if self._busy:
            return run()
        if op == "sdpa":
            if not attrs.get("is_causal") or inputs[3] is not None or attrs.get("dropout_p", 0.0) > 0:
                raise NotImplementedError("context parallel supports causal attention without mask or dropout")
            q, k, v = inputs[:3]
            if q.dtype is bt.bfloat16:  # autocast: the ring exchanges and merges float32 blocks, output bf16
                self._busy = True
                try:
                    q, k, v = (t.to(bt.float32) for t in (q, k, v))
                    return RingAttention.apply(q, k, v, self).to(bt.bfloat16)
                finally:
                    self._busy = False
            if q.dtype.name not in ("float32", "float64"):
                raise NotImplementedError(f"context parallel ring attention runs float32/float64/bfloat16, got "
                                          f"{q.dtype.name}")
            return RingAttention.apply(q, k, v, self)
        if op == "rope" and self.rotary is not None:
            x = inputs[0]
            cos, sin = self._local_tables(x.device, x.shape[-3])
            self._busy = True
            try:
                return bt.nn.functional.rope(x, cos, sin, transpose=bool(attrs.get("transpose", False)))
            finally:
                self._busy = False
        if op == "embedding" and self.position_weight is not None and inputs[1] is self.position_weight:
            idx = inputs[0]
            T_local = idx.shape[-1]
            pos = local_positions(T_local * self.group.size(), self.group.rank(), self.group.size())
            xp = bt.ext.array_module_for(idx.device)
            self._busy = True
            try:
                return bt.nn.functional.embedding(Tensor._from_data(xp.asarray(pos), idx.dtype, idx.device),
                                                  inputs[1])
            finally:
                self._busy = False
        return run()

    def _local_tables(self, device, T_local: int):
        """Rows of the full rotary tables at this rank's global positions (built once per device and length)."""
        key = (str(device), T_local)
        got = self._tables.get(key)
        if got is None:
            cos, sin = self.rotary(device)
            W = self.group.size()
            if T_local * W > cos.shape[0]:
                raise ValueError(f"context parallel: sequence of {T_local * W} positions exceeds the rotary "
                                 f"tables' {cos.shape[0]}")
            xp = ext.array_module_for(cos.device)
            pos = xp.asarray(local_positions(T_local * W, self.group.rank(), W))
            got = self._tables[key] = tuple(Tensor._from_data(xp.ascontiguousarray(xp.take(t._data, pos, axis=0)),
                                                              t.dtype, t.device) for t in (cos, sin))
        return got

    @contextlib.contextmanager
    def paused(self):
        """Attention and embeddings run as on one process inside (e.g. sampling from a full copy of the model)."""
        busy, self._busy = self._busy, True
        try:
            yield
        finally:
            self._busy = busy

    def close(self) -> None:
        ext.remove_op_observer(self)


def apply_context_parallel(group: ProcessGroup, rotator: str = "p2p", position_weight=None,
                           rotary=None) -> ContextParallel:
    """Install ring attention for causal sdpa over ``group``; returns a handle with ``close()``."""
    cp = ContextParallel(group, rotator, position_weight, rotary)
    ext.add_op_observer(cp)
    return cp
