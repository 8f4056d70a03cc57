"""The key/value cache of generation: static per-layer buffers, addressed from the host or from the device.

``KVCache(n_layer, max_len)`` holds (B, kv_heads, max_len, head_dim) keys and values per layer, allocated once on
the first write (dtype and device of the keys) and reused for the whole generation. Two ways to address them:

* host positions (``pos``, an int): :meth:`KVCache.attend` with T >= 1 new positions writes them at
  pos..pos+T-1 and attends over positions 0..pos+T-1 (causal within the chunk). Prefill and chunks run this way.
* device positions (after :meth:`KVCache.use_device_positions`): the position lives in device memory
  (``device_pos``, an int64 (1,) array), so one decode step (T = 1) has no host value in it: the new key/value
  is written at ``device_pos`` and attention runs over the whole buffer with an additive mask (-inf past
  ``device_pos``) built on the device; :meth:`advance` adds to ``device_pos`` on the device. A CUDA graph of the
  step replays it token after token. Position tables (RoPE angles, learned position embeddings) are read at the
  same position by :meth:`rows`.
"""

from __future__ import annotations

import math

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np


def _wrap(arr, dtype, device) -> bt.Tensor:
    """A raw array of ``device`` as a Tensor (no copy)."""
    return bt.Tensor._from_data(arr, dtype, bt.device(device) if isinstance(device, str) else device)


class KVCache:
    """Per-layer key/value buffers (B, kv_heads, max_len, head_dim); ``pos`` is the number of positions held
    while positions are addressed from the host, ``device_pos`` (a device int64 (1,) array) after
    :meth:`use_device_positions`."""

    def __init__(self, n_layer: int, max_len: int):
        if isinstance(n_layer, bool) or isinstance(max_len, bool) or n_layer <= 0 or max_len <= 0:
            raise ValueError(f"KVCache: n_layer and max_len must be positive, got {n_layer}, {max_len}")
        self.max_len = max_len
        self.k: list[bt.Tensor | None] = [None] * n_layer
        self.v: list[bt.Tensor | None] = [None] * n_layer
        self.pos = 0
        self.on_device = False  # positions read from device_pos (one position per call)
        self.device_pos = None
        self._keys = None  # 0..max_len-1 on the device (the mask's comparison)
        self._mask: bt.Tensor | None = None  # (max_len,) additive mask of the current device position
        self._masks: dict[tuple[int, int, str], bt.Tensor] = {}

    def reset(self) -> None:
        """Empty the cache (a fresh prefill follows); the buffers stay allocated, positions are host ones again."""
        self.pos = 0
        self.on_device = False

    # ---- host positions ----

    def update(self, layer: int, k: bt.Tensor, v: bt.Tensor):
        """Store ``k``/``v`` (B, H, T, hd) at positions pos..pos+T-1 of ``layer``; returns the keys and values of
        positions 0..pos+T-1 and the attention mask those T queries need (None: causal prefill or one query)."""
        if self.on_device:
            raise RuntimeError("KVCache.update: this cache addresses positions on the device (use_device_positions);"
                               " call attend(), or reset() it first")
        B, H, T, hd = k.shape
        s = self.pos
        if s + T > self.max_len:
            raise ValueError(f"KVCache: {s + T} positions exceed its max_len={self.max_len}")
        if self.k[layer] is None or tuple(self.k[layer].shape) != (B, H, self.max_len, hd) \
                or self.k[layer].dtype != k.dtype or self.k[layer].device != k.device:
            self.k[layer] = bt.zeros(B, H, self.max_len, hd, dtype=k.dtype, device=k.device)
            self.v[layer] = bt.zeros(B, H, self.max_len, hd, dtype=v.dtype, device=v.device)
        self.k[layer][:, :, s:s + T] = k
        self.v[layer][:, :, s:s + T] = v
        mask = None
        if s > 0 and T > 1:  # a chunk after cached positions: query i sees keys 0..s+i
            key = (s, T, str(k.device))
            mask = self._masks.get(key)
            if mask is None:
                m = np.arange(s + T)[None, :] <= (s + np.arange(T))[:, None]
                mask = self._masks[key] = bt.tensor(m, dtype=bt.bool, device=k.device)
        return self.k[layer][:, :, :s + T], self.v[layer][:, :, :s + T], mask

    # ---- device positions ----

    def use_device_positions(self) -> None:
        """Address positions from the device from now on, starting at the host ``pos``: the device position is a
        buffer allocated once (refilled in place, so a graph that captured it stays valid)."""
        if self.k[0] is None:
            raise RuntimeError("KVCache.use_device_positions: nothing cached yet (run the prefill first)")
        if self.pos >= self.max_len:
            raise ValueError(f"KVCache: {self.pos + 1} positions exceed its max_len={self.max_len}")
        k0 = self.k[0]
        xp = bt.ext.array_module_for(k0.device)
        if self.device_pos is None:
            self.device_pos = xp.zeros(1, dtype=np.int64)
            self._keys = xp.arange(self.max_len, dtype=np.int64)
            self._mask = bt.zeros(self.max_len, dtype=bt.float32, device=k0.device)
        self.device_pos[...] = self.pos
        self.on_device = True

    def _step_mask(self) -> bt.Tensor:
        """(max_len,) float32: 0 for keys 0..device_pos, -inf after (written in place, once per step)."""
        m = self._mask._data
        m[...] = bt.ext.array_module(m).where(self._keys <= self.device_pos, 0.0, -np.inf)
        return self._mask

    def rows(self, table: bt.Tensor, T: int) -> bt.Tensor:
        """Rows pos..pos+T-1 of a per-position ``table`` (RoPE angles, position embeddings): a view at host
        positions; at device positions (T = 1) a gather at ``device_pos``, no host value involved."""
        if not self.on_device:
            return table[self.pos:self.pos + T]
        if T != 1:
            raise ValueError(f"KVCache: device positions advance one position per call, got {T}")
        xp = bt.ext.array_module(table._data)
        return _wrap(xp.take(table._data, self.device_pos, axis=0), table.dtype, table.device)

    def attend(self, layer: int, q: bt.Tensor, k: bt.Tensor, v: bt.Tensor) -> bt.Tensor:
        """Attention of the T new queries ``q`` (B, Hq, T, hd) over the cached positions and the new ``k``/``v``
        (B, Hkv, T, hd), stored in ``layer`` first; each key/value head serves Hq/Hkv consecutive query heads.
        Returns (B, Hq, T, hd)."""
        if not self.on_device:
            T = q.shape[2]
            kk, vv, mask = self.update(layer, k, v)
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=mask is None and T > 1,
                                                  enable_gqa=True)
        B, Hq, T, hd = q.shape
        Hk = k.shape[1]
        if T != 1:
            raise ValueError(f"KVCache: device positions advance one position per call, got {T} queries")
        ck, cv = self.k[layer], self.v[layer]
        if ck is None or tuple(ck.shape) != (B, Hk, self.max_len, hd) or ck.dtype != k.dtype:
            raise RuntimeError(f"KVCache: layer {layer} holds no buffers for keys {tuple(k.shape)} {k.dtype} "
                               f"(prefill the cache with this batch first)")
        ck._data[:, :, self.device_pos] = k._data  # position device_pos of every row and head
        cv._data[:, :, self.device_pos] = v._data
        mask = self._step_mask() if layer == 0 else self._mask
        # grouped: the Hq/Hkv queries of one key/value head form the rows of one product (no repeated heads)
        qg = q.reshape(B, Hk, Hq // Hk, hd) * (1.0 / math.sqrt(hd))
        s = bt.matmul(qg, ck.transpose(-1, -2)) + mask  # (B, Hk, G, max_len)
        p = F.softmax(s, dim=-1)
        return bt.matmul(p, cv).reshape(B, Hq, 1, hd)

    def advance(self, T: int) -> None:
        """``T`` positions were written: at device positions the device counter moves (in stream order)."""
        if self.on_device:
            self.device_pos += T
        else:
            self.pos += T
