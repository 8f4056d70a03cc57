"""TokenLoader: double-buffered batch production over token shards (docs/design.md, section 6).

Cursor semantics (identical on every path): shards ``{split}_NNNNN.bin`` are visited in sorted order;
rank ``r`` of ``W`` starts at ``pos = B*T*r`` and after each batch moves ``B*T*W`` tokens, so the ranks
read disjoint interleaved windows ``tokens[pos : pos+B*T+1]`` (x = window[:-1], y = window[1:]). When the
next global step (the windows of all W ranks) no longer fits, every rank moves to the next shard
(wrapping to the first) at ``pos = B*T*r``. Shards too small for one global step are skipped.

The "does the next step fit" test is made on the rank-0-aligned base of the step, not on the rank's own
``pos``: the same for W = 1, and all ranks change shard on the same step for W > 1.

On CUDA the batch goes shard -> pinned host buffer -> device through two channels (pinned ``Px/Py``,
device ``X/Y``) filled by ``cudaMemcpyAsync`` on a copy stream; event ``h2d_done[i]`` orders the compute
stream after the copy, event ``consumer_done`` keeps the copy stream from overwriting a buffer still in
use. ``pinned=False`` (or a failed pinned allocation) takes the synchronous path: same batches.

Shards are never memory-mapped (:func:`blumodels.data.shards.open_shard`), and the size, modification time and
inode of every shard are taken when the loader starts: a shard truncated, rewritten or replaced under the run is a
ShardError naming it when the loader opens it again or reads from it, never a SIGBUS.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from .formats import check_token_range, open_shard, read_header  # BluTrain or llm.c shards, by their magic
from .shards import ShardError, list_shards

log = logging.getLogger(__name__)
STATE_VERSION = 1


def _identity(path: Path) -> tuple[int, int, int, int]:
    """(size, mtime_ns, inode, device) of a shard: what must not change while a run reads it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ShardError(path, 0, "no such file (removed under the run?)") from None
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


class LoaderError(ValueError):
    """The shards or a saved position do not fit this loader's batch shape / rank / split (names which)."""


def _pinned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Page-locked host array: bluallocator's pinned allocator when installed, else CuPy's."""
    try:
        from bluallocator import PinnedHostAllocator
    except ImportError:
        PinnedHostAllocator = None  # noqa: N806
    if PinnedHostAllocator is not None:
        global _PINNED_ALLOC
        if _PINNED_ALLOC is None:
            _PINNED_ALLOC = PinnedHostAllocator(pinned=True)
        return _PINNED_ALLOC.empty(shape, dtype)
    import cupy as cp

    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    mem = cp.cuda.alloc_pinned_memory(max(n * dt.itemsize, 1))
    return np.frombuffer(mem, dt, n).reshape(shape)


_PINNED_ALLOC: Any = None


def _require_cupy(device: Any) -> None:
    """Clear error (before any work) when a CUDA loader is asked for without CuPy or a GPU."""
    try:
        import cupy as cp

        ok = cp.cuda.runtime.getDeviceCount() > 0 if hasattr(cp.cuda, "runtime") else True
    except Exception:
        ok = False
    if not ok:
        raise RuntimeError(f"TokenLoader(device={str(device)!r}) needs CuPy and a CUDA GPU "
                           "(pip install 'blutensor[cuda12]' or 'blutensor[cuda13]'), or use device='cpu'")


class TokenLoader:
    """Batches ``(x, y)`` of int64 token ids, shape (B, T), from the token shards of one split.

    On the pinned CUDA path the returned tensors live in reused device buffers: they stay valid until
    the next call to :meth:`next_batch` (copy them to keep them longer). ``state_dict()`` describes the
    next batch to be returned, so a loader restored from it continues exactly where this one stands.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str, batch_size: int, seq_len: int,
                 rank: int = 0, world_size: int = 1, device: Any = "cpu", pinned: bool | None = None,
                 vocab_size: int | None = None, seq_shard: tuple[int, int] | None = None) -> None:
        """``vocab_size``: when given, every shard is scanned once here and a token id >= it is a ShardError
        naming the file and byte offset (instead of an index error at the step that reaches it).
        ``seq_shard = (i, n)``: context parallelism; every batch is cut to the ``T/n`` positions of rank ``i``
        in the load-balanced causal layout (chunks ``i`` and ``2n-1-i`` of ``2n``), x and y alike."""
        from blutensor.ext import as_device

        if batch_size < 1 or seq_len < 1:
            raise LoaderError(f"TokenLoader: batch_size and seq_len must be >= 1, got B={batch_size} "
                             f"T={seq_len}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise LoaderError(f"TokenLoader: rank {rank} out of range for world_size {world_size}")
        self.data_dir, self.split = Path(data_dir), split
        self.B, self.T, self.rank, self.world_size = int(batch_size), int(seq_len), int(rank), int(world_size)
        self._cols = None
        if seq_shard is not None:
            ci, cn = (int(v) for v in seq_shard)
            if cn < 1 or not 0 <= ci < cn or self.T % (2 * cn):
                raise LoaderError(f"TokenLoader: seq_shard {seq_shard} does not fit seq_len {self.T} (needs 0 <= i "
                                  f"< n and seq_len divisible by 2n)")
            c = self.T // (2 * cn)
            self._cols = np.concatenate([np.arange(ci * c, (ci + 1) * c),
                                         np.arange((2 * cn - 1 - ci) * c, (2 * cn - ci) * c)])
        self.BT = self.B * self.T
        self.device = as_device(device)
        self.shards = list_shards(self.data_dir, split)
        if not self.shards:
            raise FileNotFoundError(f"TokenLoader: no '{split}' shards ({split}_NNNNN.bin) in "
                                    f"{self.data_dir}; "
                                    "run `blutrain prepare` first")
        self.shard_sizes = [read_header(p)[1] for p in self.shards]
        self._idents = [_identity(p) for p in self.shards]  # a shard replaced or rewritten later is named
        need = self.BT * self.world_size + 1
        small = [p.name for p, n in zip(self.shards, self.shard_sizes) if n < need]
        if len(small) == len(self.shards):
            raise LoaderError(f"TokenLoader: every '{split}' shard in {self.data_dir} is smaller than one "
                             "step "
                             f"(B*T*W+1 = {need} tokens; largest has {max(self.shard_sizes)}): lower "
                             "batch_size/seq_len or prepare more data")
        if vocab_size is not None:
            for p in self.shards:
                check_token_range(p, int(vocab_size))
        if small:
            log.warning("TokenLoader: skipping %d shard(s) smaller than one step (%d tokens): %s",
                        len(small), need, ", ".join(small[:5]))
        self._tokens: np.ndarray | None = None
        self._open_idx = -1
        self._cuda = self.device.type == "cuda"
        self._pinned_ok = False
        if self._cuda:
            _require_cupy(self.device)
        if pinned and not self._cuda:
            raise ValueError(f"TokenLoader(pinned=True) needs a CUDA device, got device={self.device}")
        if self._cuda and pinned is not False:
            try:
                self._setup_pinned()
                self._pinned_ok = True
            except Exception as e:
                if pinned:
                    raise
                log.warning("TokenLoader: pinned buffers unavailable (%s); using the synchronous path", e)
        self.reset()

    # ---------------------------------------------------------------- cursor (rank-strided, shard by shard)
    def reset(self) -> None:
        """Back to the first shard, ``pos = B*T*rank`` (and forget prefetched batches)."""
        self._cur = -1
        self._advance_shard()
        self._primed = False
        self._buf = 0

    def _advance_shard(self) -> None:
        need = self.BT * self.world_size + 1
        for _ in range(len(self.shards)):
            self._cur = (self._cur + 1) % len(self.shards)
            if self.shard_sizes[self._cur] >= need:
                break
        self._pos = self.BT * self.rank

    def _shard_tokens(self) -> np.ndarray:
        if self._open_idx != self._cur:
            close = getattr(self._tokens, "close", None)
            if close is not None:
                close()  # a ShardTokens' descriptor
            self._tokens, self._open_idx = None, -1
            path = self.shards[self._cur]
            now = _identity(path)
            if now != self._idents[self._cur]:
                raise ShardError(path, 0, f"changed under the run (size, modification time or file differ from when "
                                          f"the loader started: {self._idents[self._cur][:2]} -> {now[:2]}) at "
                                          "offset 0; re-run `blutrain prepare` and resume")
            self._tokens = open_shard(path)
            self._open_idx = self._cur
        return self._tokens

    def _take(self) -> tuple[tuple[int, int], np.ndarray]:
        """(cursor the window was read at, window of B*T+1 tokens); moves the cursor one global step."""
        if self._pos + self.BT + 1 > self.shard_sizes[self._cur]:  # line 18
            self._advance_shard()
        at = (self._cur, self._pos)
        window = self._shard_tokens()[self._pos:self._pos + self.BT + 1]
        self._pos += self.BT * self.world_size  # line 24
        base = self._pos - self.BT * self.rank
        if base + self.BT * self.world_size + 1 > self.shard_sizes[self._cur]:  # line 25 (rank-aligned)
            self._advance_shard()
        return at, window

    # ---------------------------------------------------------------- batches
    def next_batch(self):
        """The next ``(x, y)``: blutensor int64 tensors of shape (B, T) on the loader's device."""
        if self._pinned_ok:
            return self._next_pinned()
        return self._next_sync()

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()

    def _wrap(self, arr):
        import blutensor as bt

        return bt.Tensor._from_data(arr, bt.int64, self.device)

    def _next_sync(self):
        _, w = self._take()
        x = w[:-1].astype(np.int64).reshape(self.B, self.T)
        y = w[1:].astype(np.int64).reshape(self.B, self.T)
        if self._cols is not None:
            x, y = np.ascontiguousarray(x[:, self._cols]), np.ascontiguousarray(y[:, self._cols])
        if self._cuda:
            import cupy as cp

            with cp.cuda.Device(self.device.index or 0):
                x, y = cp.asarray(x), cp.asarray(y)
        return self._wrap(x), self._wrap(y)

    # ---------------------------------------------------------------- pinned double buffer (lines 1-23)
    def _setup_pinned(self) -> None:
        import cupy as cp

        with cp.cuda.Device(self.device.index or 0):
            shape = (self.B, self.T if self._cols is None else len(self._cols))
            self._Px = [_pinned_empty(shape, np.int64) for _ in range(2)]
            self._Py = [_pinned_empty(shape, np.int64) for _ in range(2)]
            self._X = [cp.empty(shape, dtype=cp.int64) for _ in range(2)]
            self._Y = [cp.empty(shape, dtype=cp.int64) for _ in range(2)]
            self._copy_stream = cp.cuda.Stream(non_blocking=True)
            self._h2d_done = [cp.cuda.Event(disable_timing=True) for _ in range(2)]
            self._h2d_used = [False, False]
            self._consumer_done = cp.cuda.Event(disable_timing=True)
        self._issued: list[tuple[int, int]] = [(0, 0), (0, 0)]

    def _issue_prefetch(self, i: int) -> None:
        if self._h2d_used[i]:  # the last copy out of Px[i]/Py[i] must end before the host rewrites them
            self._h2d_done[i].synchronize()
        self._issued[i], w = self._take()
        x, y = w[:-1].reshape(self.B, self.T), w[1:].reshape(self.B, self.T)
        if self._cols is not None:
            x, y = x[:, self._cols], y[:, self._cols]
        np.copyto(self._Px[i], x)
        np.copyto(self._Py[i], y)
        self._X[i].set(self._Px[i], stream=self._copy_stream)
        self._Y[i].set(self._Py[i], stream=self._copy_stream)
        self._h2d_done[i].record(self._copy_stream)
        self._h2d_used[i] = True

    def _next_pinned(self):
        import cupy as cp

        with cp.cuda.Device(self.device.index or 0):
            compute = cp.cuda.get_current_stream()
            if not self._primed:
                if any(self._h2d_used):  # re-priming after reset/load: X/Y may still be read by compute
                    self._consumer_done.record(compute)
                    self._copy_stream.wait_event(self._consumer_done)
                self._issue_prefetch(0)
                self._issue_prefetch(1)
                self._primed, self._buf = True, 0
            else:
                self._consumer_done.record(compute)
                self._copy_stream.wait_event(self._consumer_done)
                self._issue_prefetch(1 - self._buf)
            compute.wait_event(self._h2d_done[self._buf])
            b = self._buf
            self._buf = (self._buf + 1) % 2
            return self._wrap(self._X[b]), self._wrap(self._Y[b])

    @property
    def pinned(self) -> bool:
        """True when batches go through pinned buffers and the copy stream."""
        return self._pinned_ok

    # ---------------------------------------------------------------- checkpointed position
    def state_dict(self) -> dict:
        """Position of the next batch this loader returns (JSON-serialisable ints and strings)."""
        shard, pos = self._issued[self._buf] if (self._pinned_ok and self._primed) else (self._cur, self._pos)
        return {"version": STATE_VERSION, "split": self.split, "shard": int(shard), "pos": int(pos),
                "rank": self.rank, "world_size": self.world_size, "batch_size": self.B, "seq_len": self.T,
                "num_shards": len(self.shards)}

    def check_state_dict(self, state: dict) -> tuple[int, int]:
        """ValueError naming the field when ``state`` does not fit this loader; else its (shard, pos) here."""
        if not isinstance(state, dict):
            raise LoaderError(f"TokenLoader.load_state_dict: state must be a dict, got {type(state).__name__}")
        for key, mine in (("seq_len", self.T), ("num_shards", len(self.shards))):
            if key in state and int(state[key]) != mine:
                raise LoaderError(f"TokenLoader.load_state_dict: saved {key}={state[key]} but this loader has "
                                 f"{key}={mine} ({self.data_dir}, split {self.split!r})")
        sb, sw = int(state.get("batch_size", self.B)), int(state.get("world_size", self.world_size))
        if sb * sw != self.B * self.world_size and sw == self.world_size:
            raise LoaderError(f"TokenLoader.load_state_dict: saved batch_size={sb} but this loader has batch_size="
                             f"{self.B} ({self.data_dir}, split {self.split!r})")
        if sb * sw != self.B * self.world_size:  # another split of the same global rows resumes (resharding)
            raise LoaderError(f"TokenLoader.load_state_dict: saved batch_size*world_size={sb}*{sw} but this loader "
                             f"has {self.B}*{self.world_size} (the global batch differs; {self.data_dir}, split "
                             f"{self.split!r})")
        try:
            shard, pos = int(state["shard"]), int(state["pos"])
        except (KeyError, TypeError, ValueError):
            raise LoaderError(f"TokenLoader.load_state_dict: state lacks integer 'shard'/'pos': {state!r}") from None
        pos += self.BT * self.rank - sb * self.T * int(state.get("rank", self.rank))  # same step base here
        if not 0 <= shard < len(self.shards) or not 0 <= pos <= self.shard_sizes[shard]:
            raise LoaderError(f"TokenLoader.load_state_dict: shard {shard} pos {pos} out of range for "
                             f"{len(self.shards)} '{self.split}' shards in {self.data_dir}")
        return shard, pos

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next batches equal those of the loader that saved it."""
        self._cur, self._pos = self.check_state_dict(state)
        self._primed, self._buf = False, 0
