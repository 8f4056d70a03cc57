"""Megatron-style tensor parallelism: column- and row-parallel linears (fused-QKV aware), async TP
(the row-parallel forward's all-reduce and the column-parallel backward's input-gradient all-reduce in token
chunks, each behind the next chunk's GEMM and the weight-gradient GEMM), vocabulary-parallel embedding and
cross-entropy, split heads.

Applied from outside the model: :func:`apply_tensor_parallel` swaps linears for their parallel
versions and intercepts the tied-vocabulary ops (embedding, LM head, cross-entropy) at blutensor's
dispatch layer, so the model code stays the single-device code.
"""

from __future__ import annotations

import fnmatch

import blutensor as bt
import numpy as np
from blutensor import Tensor, ext
from blutensor.autograd import Function
from blutensor.ext import gemm
from blutensor.nn import Module, Parameter

from dtms.parallel.comm_ops import STATS, TIMELINE, CopyToGroup, ReduceFromGroup
from dtms.process_group import ProcessGroup


def _shard_rows(w: np.ndarray, rank: int, size: int, chunks: int = 1):
    """Rows of ``w`` owned by ``rank``; a fused weight of ``chunks`` stacked parts is split per part."""
    parts = np.split(w, chunks, axis=0)
    return np.concatenate([np.split(p, size, axis=0)[rank] for p in parts], axis=0)


def _param(arr, like: Tensor) -> Parameter:
    t = Tensor._from_data(arr.copy() if hasattr(arr, "copy") else arr, like.dtype, like.device)
    return Parameter(t)


def _bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    b = np.linspace(0, n, chunks + 1).astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(b[:-1], b[1:]) if hi > lo]


def _wide(x: Tensor) -> Tensor:
    """bfloat16 activations (autocast) widened for async TP's chunked float32 GEMMs: the chunks' partial sums
    are all-reduced in float32 and rounded once, not per rank."""
    return x.to(bt.float32) if x.dtype is bt.bfloat16 else x


class _ColumnParallelAsync(Function):
    """y = x @ w_local^T + b_local (x replicated). Backward, in token chunks: chunk i's input gradient (dgrad
    GEMM) has its all-reduce posted at once (the communication stream on NCCL) while chunk i+1's dgrad and then
    the weight-gradient GEMM compute; the all-reduces are waited for last."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b, group: ProcessGroup, chunks: int):
        ctx.save_for_backward(x, w)
        ctx.group, ctx.chunks, ctx.has_bias = group, chunks, b is not None
        x2 = x._data.reshape(-1, x.shape[-1])
        y = gemm(x2, w._data.T)
        if b is not None:
            y = y + b._data
        return Tensor._from_data(y.reshape(*x.shape[:-1], w.shape[0]), x.dtype, x.device)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, w = ctx.saved_tensors
        xp = bt.ext.array_module_for(g.device)
        g2 = g._data.reshape(-1, g.shape[-1])
        x2 = x._data.reshape(-1, x.shape[-1])
        gx = xp.empty((g2.shape[0], w.shape[1]), dtype=g2.dtype)
        works = []
        for i, (lo, hi) in enumerate(_bounds(g2.shape[0], ctx.chunks)):
            TIMELINE.mark("tp_gemm_begin", kind="dgrad", chunk=i)
            gx[lo:hi] = gemm(g2[lo:hi], w._data)
            TIMELINE.mark("tp_gemm_end", kind="dgrad", chunk=i)
            works.append(ctx.group.all_reduce(gx[lo:hi], op="sum", async_op=True))
            TIMELINE.mark("tp_comm_post", kind="dgrad", chunk=i)
            STATS.add("tp_async_bwd_chunk")
        TIMELINE.mark("tp_gemm_begin", kind="wgrad")
        gw = gemm(g2.T, x2)
        gb = g2.sum(axis=0) if ctx.has_bias else None
        TIMELINE.mark("tp_gemm_end", kind="wgrad")
        for wk in works:
            wk.wait()
        TIMELINE.mark("tp_comm_wait", kind="dgrad")
        mk = lambda a, like: Tensor._from_data(a, like.dtype, like.device)  # noqa: E731
        return (mk(gx.reshape(x.shape), x), mk(gw, w), mk(gb, g) if gb is not None else None, None, None)


class ColumnParallelLinear(Module):
    """Output features split across the group; input replicated (gradient all-reduced). ``async_chunks > 1``
    overlaps that all-reduce, chunk by chunk, with the backward's dgrad and wgrad GEMMs."""

    def __init__(self, linear: Module, group: ProcessGroup, chunks: int = 1, async_chunks: int = 1):
        super().__init__()
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "async_chunks", async_chunks)
        r, n = group.rank(), group.size()
        w = linear.weight._data
        if (w.shape[0] // chunks) % n:
            raise ValueError(f"ColumnParallelLinear: {w.shape[0] // chunks} output features per part are not "
                             f"divisible by tp={n}")
        self.weight = _param(_shard_rows(w, r, n, chunks), linear.weight)
        self.bias = _param(_shard_rows(linear.bias._data, r, n, chunks), linear.bias) \
            if getattr(linear, "bias", None) is not None else None

    def forward(self, x):
        if self.async_chunks > 1:
            return _ColumnParallelAsync.apply(_wide(x), self.weight, self.bias, self.group, self.async_chunks)
        x = CopyToGroup.apply(x, self.group)
        return bt.nn.functional.linear(x, self.weight, self.bias)


class _RowParallelAsync(Function):
    """y = all_reduce(x_local @ w_local^T) computed in token chunks: chunk i's all-reduce runs on the
    communication stream (async) while chunk i+1's GEMM computes; backward needs no communication."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, group: ProcessGroup, chunks: int):
        ctx.save_for_backward(x, w)
        x2 = x._data.reshape(-1, x.shape[-1])
        xp = bt.ext.array_module_for(x.device)
        out = xp.empty((x2.shape[0], w.shape[0]), dtype=x2.dtype)
        works = []
        for i, (lo, hi) in enumerate(_bounds(x2.shape[0], chunks)):
            TIMELINE.mark("tp_gemm_begin", kind="fwd", chunk=i)
            out[lo:hi] = gemm(x2[lo:hi], w._data.T)
            TIMELINE.mark("tp_gemm_end", kind="fwd", chunk=i)
            works.append(group.all_reduce(out[lo:hi], op="sum", async_op=True))
            TIMELINE.mark("tp_comm_post", kind="fwd", chunk=i)
            STATS.add("tp_async_chunk")
        for wk in works:
            wk.wait()
        TIMELINE.mark("tp_comm_wait", kind="fwd")
        return Tensor._from_data(out.reshape(*x.shape[:-1], w.shape[0]), x.dtype, x.device)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, w = ctx.saved_tensors
        g2 = g._data.reshape(-1, g.shape[-1])
        gx = gemm(g2, w._data).reshape(x.shape)
        gw = gemm(g2.T, x._data.reshape(-1, x.shape[-1]))
        return (Tensor._from_data(gx, x.dtype, x.device), Tensor._from_data(gw, w.dtype, w.device), None, None)


class RowParallelLinear(Module):
    """Input features split across the group; partial outputs summed by an all-reduce; bias after it.
    ``async_chunks > 1`` splits the tokens into chunks whose all-reduces overlap the next GEMM."""

    def __init__(self, linear: Module, group: ProcessGroup, async_chunks: int = 1):
        super().__init__()
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "async_chunks", async_chunks)
        r, n = group.rank(), group.size()
        w = linear.weight._data
        if w.shape[1] % n:
            raise ValueError(f"RowParallelLinear: {w.shape[1]} input features are not divisible by tp={n}")
        self.weight = _param(np.split(w, n, axis=1)[r] if isinstance(w, np.ndarray) else
                             w[:, r * (w.shape[1] // n):(r + 1) * (w.shape[1] // n)], linear.weight)
        self.bias = _param(linear.bias._data, linear.bias) if getattr(linear, "bias", None) is not None else None

    def forward(self, x):
        if self.async_chunks > 1:
            y = _RowParallelAsync.apply(_wide(x), self.weight, self.group, self.async_chunks)
        else:
            y = ReduceFromGroup.apply(bt.nn.functional.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class _VocabEmbedding(Function):
    """Rows [lo, hi) of the vocabulary live here: look up local ids, zero elsewhere, all-reduce."""

    @staticmethod
    def forward(ctx, idx: Tensor, w: Tensor, group: ProcessGroup, lo: int):
        xp = bt.ext.array_module_for(w.device)
        ids = idx._data - lo
        mask = (ids >= 0) & (ids < w.shape[0])
        ids = xp.where(mask, ids, 0)
        out = w._data[ids] * mask[..., None]
        group.all_reduce(out, op="sum")
        STATS.add("tp_vocab_embedding")
        ctx.saved = (ids, mask, w.shape)
        return Tensor._from_data(out, w.dtype, w.device)

    @staticmethod
    def backward(ctx, g: Tensor):
        ids, mask, shape = ctx.saved
        xp = bt.ext.array_module_for(g.device)
        gw = xp.zeros(shape, dtype=g._data.dtype)
        gg = (g._data * mask[..., None]).reshape(-1, shape[1])
        xp.add.at(gw, ids.reshape(-1), gg)
        return None, Tensor._from_data(gw, g.dtype, g.device), None, None


class _VocabCrossEntropy(Function):
    """Mean cross-entropy over logits sharded on the vocabulary (global max, sum-exp and target logit
    by all-reduces); backward writes softmax - onehot for the local slice."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: ProcessGroup, lo: int, ignore_index: int):
        xp = bt.ext.array_module_for(logits.device)
        z = logits._data.reshape(-1, logits.shape[-1])
        t = target._data.reshape(-1)
        valid = t != ignore_index
        m = z.max(axis=1)
        group.all_reduce(m, op="max")
        e = xp.exp(z - m[:, None])
        s = e.sum(axis=1)
        group.all_reduce(s, op="sum")
        local = t - lo
        own = valid & (local >= 0) & (local < z.shape[1])
        li = xp.where(own, local, 0)
        zt = xp.take_along_axis(z, li[:, None], axis=1)[:, 0] * own
        group.all_reduce(zt, op="sum")
        loss = (xp.log(s) + m - zt) * valid
        count = max(int(valid.sum()), 1)
        STATS.add("tp_vocab_ce", 3)
        ctx.saved = (e / s[:, None], li, own, valid, count, logits.shape)
        return Tensor._from_data(xp.asarray(loss.sum() / count, dtype=z.dtype), logits.dtype, logits.device)

    @staticmethod
    def backward(ctx, g: Tensor):
        p, li, own, valid, count, shape = ctx.saved
        xp = bt.ext.array_module_for(g.device)
        grad = p.copy()
        rows = xp.arange(grad.shape[0])
        grad[rows[own], li[own]] -= 1.0
        grad *= (valid[:, None] * (g._data / count))
        return Tensor._from_data(grad.reshape(shape), g.dtype, g.device), None, None, None, None


class VocabParallel:
    """Dispatch observer: ops on the sharded tied embedding become their vocabulary-parallel forms."""

    def __init__(self, weight: Parameter, group: ProcessGroup, lo: int):
        self.weight, self.group, self.lo = weight, group, lo
        self._logits = set()
        self._wcast = None
        self._busy = False

    def __call__(self, op, inputs, attrs, run):
        if self._busy:
            return run()
        if op == "embedding" and inputs[1] is self.weight:
            return _VocabEmbedding.apply(inputs[0], self.weight, self.group, self.lo)
        if op == "cast" and inputs[0] is self.weight:  # autocast's bf16 copy of the shard (kept to recognise it)
            self._wcast = run()
            return self._wcast
        if op == "linear" and len(inputs) >= 2 and (inputs[1] is self.weight or self._is_weight_cast(inputs[1])):
            x = CopyToGroup.apply(inputs[0], self.group)
            self._busy = True
            try:
                out = bt.nn.functional.linear(x, inputs[1])  # the weight, or autocast's bf16 copy of it
            finally:
                self._busy = False
            self._logits.add(id(out))
            return out
        if op in ("view", "reshape", "cast") and id(inputs[0]) in self._logits:
            out = run()
            self._logits.add(id(out))
            return out
        if op == "cross_entropy" and id(inputs[0]) in self._logits:
            self._logits.clear()
            if attrs.get("reduction", "mean") != "mean" or attrs.get("label_smoothing", 0.0):
                raise NotImplementedError("vocabulary-parallel cross_entropy supports reduction='mean' only")
            logits = inputs[0]
            if logits.dtype is bt.bfloat16:  # autocast's bf16 logits: the sharded softmax runs in float32
                self._busy = True
                try:
                    logits = logits.to(bt.float32)
                finally:
                    self._busy = False
            return _VocabCrossEntropy.apply(logits, inputs[1], self.group, self.lo,
                                            attrs.get("ignore_index", -100))
        return run()

    def _is_weight_cast(self, w) -> bool:
        """Whether ``w`` is a cast of the sharded weight (autocast's cached bf16 copy, made here or precast)."""
        if w is self._wcast:
            return True
        fn = getattr(w, "grad_fn", None)
        if fn is None or getattr(fn, "op", None) != "cast" or not fn.next:
            return False
        return getattr(fn.next[0], "tensor", None) is self.weight


class TensorParallel:
    """Handle returned by :func:`apply_tensor_parallel`; ``close()`` removes the dispatch observer."""

    def __init__(self, observer):
        self.observer = observer

    def close(self) -> None:
        if self.observer is not None:
            ext.remove_op_observer(self.observer)
            self.observer = None


def apply_tensor_parallel(model: Module, group: ProcessGroup, plan: dict,
                          async_chunks: int = 1) -> TensorParallel:
    """Shard ``model`` in place over ``group`` following ``plan`` (pattern -> (style, options), the
    ``tp`` field of a :class:`~dtms.parallel.plan.ParallelPlan`; the model's package provides it)."""
    if not isinstance(plan, dict) or not plan:
        raise ValueError("apply_tensor_parallel: plan must be a non-empty dict of module pattern -> (style, "
                         "options) (e.g. blumodels.gpt2_parallelize.gpt2_plan(model).tp)")
    n, r = group.size(), group.rank()
    observer = None
    for name, mod in list(model.named_modules()):
        for pat, (style, opts) in plan.items():
            if not fnmatch.fnmatchcase(name, pat):
                continue
            if style == "heads":
                attrs = tuple(opts.get("attrs", ("n_head",)))
                for a in attrs:
                    if getattr(mod, a) % n:
                        raise ValueError(f"tensor parallel: {name}.{a}={getattr(mod, a)} not divisible by tp={n}")
                if not hasattr(mod, "head_dim"):
                    object.__setattr__(mod, "head_dim", mod.d_model // mod.n_head)
                for a in attrs:
                    object.__setattr__(mod, a, getattr(mod, a) // n)
                continue
            parent, leaf = _parent(model, name)
            if style == "colwise":
                setattr(parent, leaf, ColumnParallelLinear(mod, group, opts.get("chunks", 1),
                                                           opts.get("async_chunks", async_chunks)))
            elif style == "rowwise":
                setattr(parent, leaf, RowParallelLinear(mod, group, opts.get("async_chunks", async_chunks)))
            elif style == "vocab":
                w = mod.weight
                V = w.shape[0]
                if V % n:
                    raise ValueError(f"tensor parallel: vocabulary {V} of {name} is not divisible by tp={n}")
                lo = r * (V // n)
                mod.weight = _param(w._data[lo:lo + V // n], w)
                observer = VocabParallel(mod.weight, group, lo)
            else:
                raise ValueError(f"tensor parallel plan: unknown style {style!r} for {pat!r}")
    if observer is not None:
        ext.add_op_observer(observer)
    return TensorParallel(observer)


def _parent(model: Module, name: str):
    parts = name.split(".")
    m = model
    for p in parts[:-1]:
        m = getattr(m, p) if not p.isdigit() else m[int(p)]
    return m, parts[-1]
