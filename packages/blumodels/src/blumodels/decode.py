"""The token loop of generation: device-side state, one decode step without host values, and its CUDA graph.

Everything a step reads or writes lives in device buffers made once per generation: the tokens (B, W) (prompts
in, continuations written), the prompt lengths, the position being produced (an int64 (1,) counter), the
uniforms of every step (drawn up front from the counter-based ``bt.Generator(seed)`` on the device, one row per
step) and the next step's input token. A step is: the model's forward of the input token at the cache's device
position, :func:`blumodels.sampling.sample_next` on the device, the row's own prompt token where the row is still
inside its prompt, the token written into the token buffer and the next input, the counters advanced. No host
value enters it, so on CUDA it is captured once into a CUDA graph (after warm-up steps that load every kernel and
plan) and replayed once per token; on the CPU the same body runs through :class:`~blumodels.graph_step.EagerCapture`
(the twin). The prefill, and the fresh prefill of each step once the context outgrows ``block_size`` (the window
slides), run eagerly through the same sampling and bookkeeping.

The host reads the token buffer every ``check_every`` steps when a ``stop_token`` is given (to stop once every row
has drawn it) and once at the end; rows cut after their stop token or their length, so the result is the one a
step-by-step host loop gives.

Capture needs a CUDA device, a GEMM provider that declares ``CAPTURE_SAFE`` and float32 keys/values; what is
missing is named by :func:`capture_refusal` (``cuda_graph=True``: an error before any work; ``"auto"``: one logged
line, then the step runs eagerly).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import blutensor as bt
import numpy as np

from blumodels.graph_step import EagerCapture
from blumodels.kv_cache import KVCache
from blumodels.sampling import sample_next

log = logging.getLogger(__name__)

#: eager decode steps before the capture (the first loads every kernel, the second runs with warm plan caches)
WARMUP_STEPS = 2
#: decode steps between two host reads of the tokens when a stop token is given
CHECK_EVERY = 32

_logged: set[str] = set()


def decodes_on_device(model) -> bool:
    """Whether ``model``'s cached forward reads positions from the cache (``KVCache.rows`` / ``attend``), so its
    decode step can run at device positions: GPT-2, and families that set ``decode_on_device = True``."""
    from blumodels.gpt2 import GPT2

    return isinstance(model, GPT2) or bool(getattr(model, "decode_on_device", False))


def capture_refusal(device, model, dtype=None) -> str | None:
    """Why the decode step of ``model`` on ``device`` cannot be captured into a CUDA graph, or None."""
    dev = bt.device(device) if isinstance(device, str) else device
    if dev.type != "cuda":
        return f"the model is on {str(dev)!r} (CUDA graphs need a CUDA device)"
    if not decodes_on_device(model):
        return (f"{type(model).__name__}'s cached forward reads positions on the host (set decode_on_device = True "
                f"on a family whose forward uses KVCache.rows and KVCache.attend)")
    prov = bt.ext.get_gemm_provider()
    if not getattr(prov, "CAPTURE_SAFE", False):
        safe = [p.PLUGIN_NAME for p in bt.ext.capture_safe_gemm_providers()] or ["none installed: install blublas"]
        return (f"the GEMM provider {getattr(prov, 'PLUGIN_NAME', prov)!r} does not declare CAPTURE_SAFE (CuPy's "
                f"cuBLAS refuses stream capture); choose a capture-safe one ({', '.join(safe)}) with "
                f"bt.set_gemm_provider, BLUTRAIN_GEMM or train.gemm")
    if bt.is_autocast_enabled("cuda"):
        return "autocast is on (the captured decode step's attention takes float32 keys/values)"
    if dtype is not None and dtype != bt.float32:
        return f"the keys/values are {dtype} (the captured decode step's attention takes float32)"
    return None


class CudaDecodeCapture:
    """The decode step recorded into a ``bt.cuda.CUDAGraph`` (side stream, private pool); ``replay`` launches it."""

    def __init__(self) -> None:
        self.graph = None
        self.captures = 0

    def capture(self, body: Callable[[], None], pool: Any = None) -> None:
        from blutensor.cuda import CUDAGraph, graph

        g = CUDAGraph()
        with graph(g, pool=pool):
            body()
        self.graph = g
        self.captures += 1

    def replay(self) -> None:
        self.graph.replay()


def _check_cuda_graph(cuda_graph) -> None:
    if cuda_graph not in (True, False, "auto") or isinstance(cuda_graph, int) and not isinstance(cuda_graph, bool):
        raise ValueError(f"generate: cuda_graph must be True, False or 'auto', got {cuda_graph!r}")


class Decoder:
    """One generation: ``rows`` (prompts, lists of ints) continued by ``max_new_tokens`` tokens; :meth:`run`
    returns them. ``fwd(idx, cache)`` is the family's cached forward (None: the whole context every step);
    ``cuda_graph`` True / False / "auto" as in ``generate_batch``; ``make_capture`` builds the capture
    (default: :class:`CudaDecodeCapture` on CUDA, :class:`EagerCapture` on the CPU). After :meth:`run`:
    ``captured`` (whether the decode step ran from a graph), ``refusal`` (why not, or None), ``decode_steps`` and
    ``replays`` (how many decode steps ran, and how many of them were graph replays)."""

    def __init__(self, model, rows: Sequence[Sequence[int]], max_new_tokens: int, *, fwd, device,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 vocab_size: int | None = None, stop_token: int | None = None, cuda_graph: bool | str = "auto",
                 make_capture: Callable[[], Any] | None = None, check_every: int = CHECK_EVERY) -> None:
        _check_cuda_graph(cuda_graph)
        self.model, self.fwd = model, fwd
        self.device = bt.device(device) if isinstance(device, str) else device
        self.cfg = model.config
        self.V = vocab_size or self.cfg.vocab_size
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.stop_token, self.check_every = stop_token, max(1, int(check_every))
        self.rows = [list(r) for r in rows]
        self.lens = [len(r) for r in self.rows]
        self.end = [n + max_new_tokens for n in self.lens]
        self.t0, self.W = min(self.lens), max(self.end)
        self.block = self.cfg.block_size
        self.cuda_graph = cuda_graph
        self.refusal = None
        if fwd is None and cuda_graph is True:
            raise ValueError("generate: cuda_graph=True needs the key/value cache (use_cache=True)")
        if fwd is not None and cuda_graph is not False:
            self.refusal = capture_refusal(self.device, model)
            if self.refusal is not None and self.device.type == "cpu" and cuda_graph == "auto":
                self.refusal = None  # the CPU twin: the same captured code path, run eagerly
            if self.refusal is not None and cuda_graph is True:
                raise ValueError(f"generate: cuda_graph=True cannot capture the decode step: {self.refusal} (or "
                                 f"pass cuda_graph='auto' or False)")
        if make_capture is None:
            make_capture = CudaDecodeCapture if self.device.type == "cuda" else EagerCapture
        self.make_capture = make_capture
        self.captured = False
        self.decode_steps = self.replays = 0
        self._cap = None

    # ---- device state ----

    def _setup(self) -> None:
        B, W, dev = len(self.rows), self.W, self.device
        host = np.zeros((B, W), dtype=np.int64)
        for i, r in enumerate(self.rows):
            host[i, :len(r)] = r
        self.xp = xp = bt.ext.array_module_for(dev)
        self.toks = bt.tensor(host, dtype=bt.int64, device=dev)
        self.lens_dev = xp.asarray(np.asarray(self.lens, dtype=np.int64))
        self.t_dev = xp.asarray(np.array([self.t0], dtype=np.int64))  # the position the next token goes to
        n = max(1, W - self.t0)  # one row of uniforms per produced position, drawn on the device
        self.u = bt.Generator(self.seed).uniform((n, B), xp, np.float64)
        self.tok_in = bt.zeros(B, 1, dtype=bt.int64, device=dev)  # the decode step's static input

    def _emit(self, logits: bt.Tensor) -> None:
        """Sample from the last position's ``logits`` (B, 1, Vp), keep prompt tokens of rows still inside their
        prompt, write the token at t and into the next input, advance t: device operations only."""
        xp, B = self.xp, len(self.rows)
        if logits.dtype != bt.float32:
            logits = logits.to(bt.float32)
        z = logits._data.reshape(B, -1)[:, :self.V]
        u = xp.take(self.u, self.t_dev - self.t0, axis=0)[0]
        nxt = sample_next(z, u, self.temperature, self.top_k, self.top_p)
        toks = self.toks._data
        prompt_tok = xp.take(toks, self.t_dev, axis=1)[:, 0]
        tok = xp.where(self.t_dev < self.lens_dev, prompt_tok, nxt)
        toks[:, self.t_dev] = tok[:, None]
        self.tok_in._data[...] = tok[:, None]
        self.t_dev += 1

    def _decode_body(self) -> None:
        """One decode step at the cache's device position (the body a CUDA graph captures)."""
        self._emit(self.fwd(self.tok_in, self.cache))

    def _decode(self) -> None:
        self.decode_steps += 1
        if self._cap is not None:
            self._cap.replay()
            self.replays += 1
            return
        want = self.cuda_graph is not False and self.refusal is None
        if not want or self.decode_steps <= WARMUP_STEPS:
            self._decode_body()
            return
        self._capture()
        if self._cap is not None:
            self._cap.replay()
            self.replays += 1
        else:
            self._decode_body()

    def _capture(self) -> None:
        dtype = self.cache.k[0].dtype
        why = capture_refusal(self.device, self.model, dtype) if self.device.type == "cuda" else None
        if why is None and self.device.type == "cuda":
            bt.ext.index_flag_array()  # the embedding's index-check flag: allocated outside the capture
        if why is None:
            cap = self.make_capture()
            try:
                cap.capture(self._decode_body)
            except Exception as e:  # noqa: BLE001 - named below; "auto" falls back to the eager step
                why = f"capturing the decode step failed: {type(e).__name__}: {e}"
            else:
                self._cap, self.captured = cap, True
                return
        self.refusal = why
        if self.cuda_graph is True:
            raise RuntimeError(f"generate: cuda_graph=True: {why} (pass cuda_graph='auto' or False)")
        self._log_refusal(why)

    def _log_refusal(self, why: str) -> None:
        if why not in _logged:
            _logged.add(why)
            log.warning("generate: the decode step runs eagerly (no CUDA graph): %s", why)

    # ---- the loop ----

    def run(self) -> list[list[int]]:
        """Generate; returns every row's prompt + continuation (cut after its stop token)."""
        if self.refusal is not None and self.cuda_graph == "auto":
            self._log_refusal(self.refusal)
        if self.W == self.t0:  # nothing to produce
            return [list(r) for r in self.rows]
        self._setup()
        model = self.model
        was_training = model.training
        model.eval()
        max_len = min(self.block, self.W)
        self.cache = KVCache(self.cfg.n_layer, max_len) if self.fwd is not None else None
        out_len = list(self.end)
        done = [False] * len(self.rows)
        start = None  # the window start the cache holds
        since = 0
        try:
            with bt.no_grad():
                t = self.t0
                while t < self.W:
                    lo = max(0, t - self.block)
                    if self.cache is None:
                        logits, _ = model(self.toks[:, lo:t].contiguous())
                        self._emit(logits)
                    elif lo != start:  # the first step, or the window slid: a fresh prefill of the window
                        self.cache.reset()
                        start = lo
                        self._emit(self.fwd(self.toks[:, lo:t].contiguous(), self.cache))
                        if decodes_on_device(model) and max(0, t + 1 - self.block) == start and t + 1 < self.W:
                            self.cache.use_device_positions()  # the next steps decode at device positions
                    elif self.cache.on_device:
                        self._decode()
                    else:  # a family that reads positions on the host: the cache's host path, eagerly
                        self._emit(self.fwd(self.tok_in, self.cache))
                    t += 1
                    since += 1
                    if self.stop_token is not None and (since >= self.check_every or t >= self.W):
                        since = 0
                        if self._stopped(t, out_len, done):
                            break
                toks = self.toks._data
                host = toks.get() if hasattr(toks, "get") else np.asarray(toks)
        finally:
            model.train(was_training)
        if self.stop_token is not None:
            self._stopped(t, out_len, done, host)
        return [host[i, :out_len[i]].tolist() for i in range(len(self.rows))]

    def _stopped(self, t: int, out_len: list[int], done: list[bool], host=None) -> bool:
        """Read the tokens up to position t (one host sync), cut rows at their first generated stop token; True
        when every row is finished."""
        if host is None:
            toks = self.toks._data[:, :t]
            host = toks.get() if hasattr(toks, "get") else np.asarray(toks)
        for i in range(len(self.rows)):
            if done[i]:
                continue
            seg = host[i, self.lens[i]:min(t, self.end[i])]
            hit = np.flatnonzero(seg == self.stop_token)
            if hit.size:
                out_len[i] = self.lens[i] + int(hit[0]) + 1
                done[i] = True
            elif t >= self.end[i]:
                done[i] = True
        return all(done)
