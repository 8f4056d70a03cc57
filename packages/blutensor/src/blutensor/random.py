"""Counter-based Philox4x32-10 random numbers: reproducible from a seed, the same stream on CPU
(NumPy) and CUDA (CuPy) because both evaluate the same integer arithmetic."""

from __future__ import annotations

import operator

import numpy as np

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def philox4x32(counter_lo, counter_hi, key0: int, key1: int, xp):
    """Philox4x32-10 over counters (c0=lo, c1=hi, c2=0, c3=0): returns four uint32 arrays."""
    u64 = xp.uint64
    c0 = counter_lo.astype(u64)
    c1 = counter_hi.astype(u64)
    c2 = xp.zeros_like(c0)
    c3 = xp.zeros_like(c0)
    k0, k1 = key0 & _MASK, key1 & _MASK
    for _ in range(10):
        p0 = c0 * u64(_M0)
        p1 = c2 * u64(_M1)
        c0, c1, c2, c3 = ((p1 >> u64(32)) ^ c1 ^ u64(k0), p1 & u64(_MASK),
                          (p0 >> u64(32)) ^ c3 ^ u64(k1), p0 & u64(_MASK))
        k0 = (k0 + _W0) & _MASK
        k1 = (k1 + _W1) & _MASK
    return c0, c1, c2, c3


class Generator:
    """A seed and a counter offset; each draw of n numbers advances the offset by ceil(n/4).

    ``Generator(seed)``, or PyTorch's ``Generator(device="cpu")`` (then seeded 0 until ``manual_seed``):
    the Philox stream is the same on every device, so ``device`` is only recorded.

    ``device_offset`` (None, or a 1-element uint64 array on the draws' device): the offset the draws read and
    advance IN DEVICE MEMORY, beside the host counter. A CUDA graph that records draws then replays new numbers
    every time (the host offset of a recorded launch would be frozen); the caller keeps the two in step
    (:meth:`advance_host` after a replay)."""

    device_offset = None

    def __init__(self, seed=0, device=None):
        from blutensor.device import as_device
        from blutensor.device import device as _device

        if isinstance(seed, str | _device):  # Generator("cpu") / Generator(bt.device(...)), PyTorch's form
            seed, device = 0, seed

        self.device = as_device(device if device is not None else "cpu")
        self.manual_seed(seed)

    def initial_seed(self) -> int:
        """The seed of the last ``manual_seed`` (PyTorch's name)."""
        return self.seed

    def manual_seed(self, seed: int) -> Generator:
        try:
            seed = operator.index(seed)
        except TypeError:
            from blutensor.errors import DTypeError

            raise DTypeError(f"manual_seed: seed must be an int, got {type(seed).__name__} {seed!r:.40}") from None
        self.seed = seed & 0xFFFFFFFFFFFFFFFF
        self.offset = 0
        return self

    def get_state(self) -> dict:
        return {"seed": self.seed, "offset": self.offset}

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or "seed" not in state or "offset" not in state:
            from blutensor.errors import DTypeError

            raise DTypeError(f"set_rng_state: expected the dict from get_rng_state() ({{'seed': int, 'offset': int}}), "
                             f"got {type(state).__name__} {state!r:.60}")
        self.seed, self.offset = int(state["seed"]), int(state["offset"])

    def use_device_offset(self, xp) -> None:
        """Draw at a device counter from now on (starting at the host offset); ``xp`` = its array module."""
        self.device_offset = xp.asarray(np.array([self.offset], dtype=np.uint64))

    def use_host_offset(self) -> None:
        self.device_offset = None

    def advance_host(self, blocks: int) -> None:
        """Move the host counter by ``blocks`` (the draws a replayed graph made on the device)."""
        self.offset += int(blocks)

    def draw(self, n_blocks: int):
        """Reserve ``n_blocks`` counter blocks: returns their start (an int, or a 1-element device array when a
        device offset is in use, which this call advances on the device) and advances the host counter."""
        start = self.offset
        self.offset += n_blocks
        dev = self.device_offset
        if dev is None:
            return start
        snap = dev.copy()  # this draw's start, read in stream order
        dev += np.uint64(n_blocks)
        return snap

    def _bits(self, n: int, xp):
        """n uint32 random words (as uint64 arrays) and advance the counter."""
        blocks = (n + 3) // 4
        start = self.offset
        self.offset = start + blocks
        if isinstance(start, int | np.integer):
            ctr = xp.arange(start, start + blocks, dtype=xp.uint64)
        else:  # a device counter (a 1-element array): the same counters, computed on the device
            ctr = xp.arange(blocks, dtype=xp.uint64) + start.astype(xp.uint64)
        r = philox4x32(ctr & xp.uint64(_MASK), ctr >> xp.uint64(32), self.seed & _MASK, self.seed >> 32, xp)
        return xp.stack(r, axis=1).reshape(-1)[:n]

    def uniform(self, shape, xp, dtype=np.float32):
        """Uniform [0, 1) of ``shape``: 24 random bits for float32, 53 for float64."""
        n = int(np.prod(shape, dtype=np.int64))
        if np.dtype(dtype) == np.float64:
            w = self._bits(2 * n, xp).reshape(n, 2)
            v = ((w[:, 0] >> xp.uint64(5)) * 67108864 + (w[:, 1] >> xp.uint64(6))) * (1.0 / 9007199254740992.0)
            return v.astype(xp.float64).reshape(shape)
        w = self._bits(n, xp)
        return ((w >> xp.uint64(8)).astype(xp.float32) * xp.float32(1.0 / 16777216.0)).reshape(shape)

    def normal(self, shape, xp, dtype=np.float32):
        """Standard normal of ``shape`` by Box-Muller on pairs of uniforms (computed in float64)."""
        n = int(np.prod(shape, dtype=np.int64))
        m = (n + 1) // 2
        w = self._bits(2 * m, xp).reshape(m, 2)
        u1 = ((w[:, 0] >> xp.uint64(8)).astype(xp.float64) + 1.0) * (1.0 / 16777216.0)  # (0, 1]
        u2 = (w[:, 1] >> xp.uint64(8)).astype(xp.float64) * (1.0 / 16777216.0)
        r = xp.sqrt(-2.0 * xp.log(u1))
        th = 2.0 * np.pi * u2
        z = xp.stack([r * xp.cos(th), r * xp.sin(th)], axis=1).reshape(-1)[:n]
        return z.astype(dtype).reshape(shape)

    def integers(self, low: int, high: int, shape, xp):
        """Uniform integers in [low, high) (64-bit, via two words and a modulo; bias < 2^-32)."""
        n = int(np.prod(shape, dtype=np.int64))
        w = self._bits(2 * n, xp).reshape(n, 2)
        v = (w[:, 0] << xp.uint64(32)) | w[:, 1]
        return (v % xp.uint64(high - low)).astype(xp.int64).reshape(shape) + low


default_generator = Generator(0)


def manual_seed(seed: int) -> Generator:
    """Seed the default generator (used by randn, rand, dropout and init)."""
    return default_generator.manual_seed(seed)


def get_rng_state() -> dict:
    return default_generator.get_state()


def set_rng_state(state: dict) -> None:
    default_generator.set_state(state)


def initial_seed() -> int:
    """The default generator's seed."""
    return default_generator.seed


def randperm(n: int, generator: Generator | None = None, dtype=None, device=None, requires_grad: bool = False):
    """A random permutation of ``0 .. n-1`` (int64 by default): a stable argsort of 64-bit Philox keys,
    so the same seed gives the same permutation on every device."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        from blutensor.errors import ArgumentError

        raise ArgumentError(f"randperm: n must be a non-negative int, got {type(n).__name__} {n!r:.40}")
    from blutensor.creation import _generator, tensor
    from blutensor.dtypes import as_dtype, int64

    gen = _generator(generator)
    w = gen._bits(2 * int(n), np).reshape(int(n), 2)
    perm = np.argsort((w[:, 0] << np.uint64(32)) | w[:, 1], kind="stable")
    dt = as_dtype(dtype) if dtype is not None else int64
    return tensor(perm.astype(dt.np), dtype=dt, device=device, requires_grad=requires_grad)
