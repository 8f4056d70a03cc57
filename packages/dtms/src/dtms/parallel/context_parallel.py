"""Context parallelism: the sequence sharded over the CP group with the load-balanced causal layout
(2W chunks; rank r holds chunks r and 2W-1-r), ring attention whose forward uses one rotator (K/V)
and whose backward uses two (K/V again, and their gradients back to their owners), per-block outputs
merged with the numerically stable log-sum-exp (sigmoid) update, and three interchangeable rotator
backends: all-to-all, all-gather and peer-to-peer.

Applied from outside the model: :func:`apply_context_parallel` installs a dispatch observer that
turns causal ``sdpa`` calls into ring attention and gives the positional embedding the global
positions of the local tokens; :func:`shard_sequence` lays out a batch at the data boundary.
"""

from __future__ import annotations

import math

import blutensor as bt
import numpy as np
from blutensor import Tensor
from blutensor.autograd import Function
from blutensor.ops import dispatch
from blutensor.ops.linalg import gemm

from dtms.parallel.comm_ops import STATS
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
    xp = bt.backend.array_module(arr)
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


class P2PRotator(Rotator):
    """Ring: at each step send the block held to rank+1 and receive from rank-1."""

    name = "p2p"

    def blocks(self, arrays):
        g, W, r = self.group, self.group.size(), self.group.rank()
        cur = [a.copy() for a in arrays]
        for s in range(W):
            yield (r - s) % W, cur
            if s == W - 1:
                break
            nxt = [bt.backend.array_module(a).empty_like(a) for a in cur]
            works = []
            for a, b in zip(cur, nxt):
                works.append(g.isend(a, (r + 1) % W))
                works.append(g.irecv(b, (r - 1) % W))
                STATS.add("cp_p2p")
            for w in works:
                w.wait()
            cur = nxt

    def reduce_to_owners(self, contribs):
        # pass an accumulator around the ring: after W-1 hops it holds every rank's part for its owner
        g, W, r = self.group, self.group.size(), self.group.rank()
        acc = [c.copy() for c in contribs[(r + 1) % W]]
        for s in range(1, W):
            nxt = [bt.backend.array_module(a).empty_like(a) for a in acc]
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
            xp = bt.backend.array_module(a)
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
            xp = bt.backend.array_module(contribs[0][k])
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
            xp = bt.backend.array_module(a)
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
            xp = bt.backend.array_module(contribs[0][k])
            send = xp.ascontiguousarray(xp.stack([contribs[j][k] for j in range(W)]))
            recv = xp.empty_like(send)
            g.all_to_all(recv, send)
            STATS.add("cp_all_to_all")
            out.append(recv.sum(axis=0))
        return out


ROTATORS = {"p2p": P2PRotator, "allgather": AllGatherRotator, "alltoall": AllToAllRotator}


# ---- ring attention ----


def _block(q, k, v, qpos, kpos, scale):
    """Causal attention of q against one K/V block: (output, log-sum-exp) with -inf for empty rows."""
    xp = bt.backend.array_module(q)
    s = gemm(q, k.swapaxes(-1, -2)) * scale
    vis = qpos[:, None] >= kpos[None, :]
    s = xp.where(vis, s, -xp.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = xp.where(xp.isfinite(m), m, 0.0)
    e = xp.exp(s - m_safe)
    den = e.sum(axis=-1, keepdims=True)
    out = gemm(e / xp.where(den > 0, den, 1.0), v)
    lse = xp.where(den > 0, xp.log(xp.where(den > 0, den, 1.0)) + m_safe, -xp.inf)
    return out, lse


def _merge(out, lse, bout, blse):
    """Stable merge (the log-sum-exp merge written as a sigmoid): out += sigmoid(blse - lse) * (bout - out)."""
    xp = bt.backend.array_module(out)
    both = xp.isfinite(blse)
    first = ~xp.isfinite(lse) & both
    d = xp.where(both & ~first, blse - lse, 0.0)
    w = xp.where(first, 1.0, xp.where(both, 1.0 / (1.0 + xp.exp(-d)), 0.0))
    new_out = out + w * (bout - out)
    new_lse = xp.where(first, blse, xp.where(both, lse + xp.logaddexp(0.0, d), lse))
    return new_out, new_lse


class RingAttention(Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cp):
        qa, ka, va = q._data, k._data, v._data
        scale = 1.0 / math.sqrt(qa.shape[-1])
        xp = bt.backend.array_module(qa)
        r, W = cp.group.rank(), cp.group.size()
        T = qa.shape[-2] * W
        qpos = xp.asarray(local_positions(T, r, W))
        out = xp.zeros_like(qa)
        lse = xp.full(qa.shape[:-1] + (1,), -xp.inf, dtype=qa.dtype)
        for j, (kb, vb) in cp.rotator.blocks([ka, va]):
            kpos = xp.asarray(local_positions(T, j, W))
            bout, blse = _block(qa, kb, vb, qpos, kpos, scale)
            out, lse = _merge(out, lse, bout, blse)
        ctx.saved = (qa, ka, va, out, lse, qpos, T, scale, cp)
        return Tensor._from_data(out.astype(qa.dtype, copy=False), q.dtype, q.device)

    @staticmethod
    def backward(ctx, g: Tensor):
        qa, ka, va, out, lse, qpos, T, scale, cp = ctx.saved
        xp = bt.backend.array_module(qa)
        W = cp.group.size()
        do = g._data
        D = (do * out).sum(axis=-1, keepdims=True)
        dq = xp.zeros_like(qa)
        contribs = [None] * W
        for j, (kb, vb) in cp.rotator.blocks([ka, va]):  # first rotator: K/V again
            kpos = xp.asarray(local_positions(T, j, W))
            s = gemm(qa, kb.swapaxes(-1, -2)) * scale
            vis = qpos[:, None] >= kpos[None, :]
            p = xp.where(vis, xp.exp(s - xp.where(xp.isfinite(lse), lse, 0.0)), 0.0)
            dv = gemm(p.swapaxes(-1, -2), do)
            dp = gemm(do, vb.swapaxes(-1, -2))
            ds = p * (dp - D) * scale
            dq += gemm(ds, kb)
            dk = gemm(ds.swapaxes(-1, -2), qa)
            contribs[j] = [dk, dv]
        dk, dv = cp.rotator.reduce_to_owners(contribs)  # second rotator: gradients home
        mk = lambda a, like: Tensor._from_data(a.astype(like.dtype, copy=False), None, g.device)  # noqa: E731
        return mk(dq, qa), mk(dk, ka), mk(dv, va), None


class ContextParallel:
    """Dispatch observer: causal sdpa -> ring attention; positional embedding -> global positions."""

    def __init__(self, group: ProcessGroup, rotator: str = "p2p", position_weight=None):
        if rotator not in ROTATORS:
            raise ValueError(f"context parallel: rotator must be one of {sorted(ROTATORS)}, got {rotator!r}")
        self.group = group
        self.rotator = ROTATORS[rotator](group)
        self.position_weight = position_weight
        self._busy = False

    def __call__(self, op, inputs, attrs, run):
        if self._busy:
            return run()
        if op == "sdpa":
            if not attrs.get("is_causal") or inputs[3] is not None or attrs.get("dropout_p", 0.0) > 0:
                raise NotImplementedError("context parallel supports causal attention without mask or dropout")
            return RingAttention.apply(inputs[0], inputs[1], inputs[2], self)
        if op == "embedding" and self.position_weight is not None and inputs[1] is self.position_weight:
            idx = inputs[0]
            T_local = idx.shape[-1]
            pos = local_positions(T_local * self.group.size(), self.group.rank(), self.group.size())
            xp = bt.backend.xp_of(idx.device)
            self._busy = True
            try:
                return bt.nn.functional.embedding(Tensor._from_data(xp.asarray(pos), idx.dtype, idx.device),
                                                  inputs[1])
            finally:
                self._busy = False
        return run()

    def close(self) -> None:
        dispatch.remove_observer(self)


def apply_context_parallel(group: ProcessGroup, rotator: str = "p2p", position_weight=None) -> ContextParallel:
    """Install ring attention for causal sdpa over ``group``; returns a handle with ``close()``."""
    cp = ContextParallel(group, rotator, position_weight)
    dispatch.add_observer(cp)
    return cp
