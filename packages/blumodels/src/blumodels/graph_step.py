"""The training step (step.py) captured into CUDA graphs and replayed: capture wraps the step, it does not copy it.

After warm-up steps run eagerly (they create the optimizer state, DDP's bucket order and every kernel/plan
cache), the step's phases are recorded once:

* with gradient accumulation, graph ``micro`` holds one micro-step under no-sync (forward + backward, the loss
  added to the device loss sum); it is replayed ``accum - 1`` times, each time after the next micro-batch was
  copied into the static inputs;
* graph ``last`` holds the last micro-step (with DDP's bucketed all-reduces, launched during its backward) and
  :meth:`TrainStep.finish` (norm/clipping, the non-finite flag, the fused AdamW update that flag skips on the
  device, the device step index advanced). With optimizer-in-backward the graph holds the per-parameter AdamW
  launches inside backward instead (each reads the lr and update count :meth:`TrainStep.begin` wrote on the
  device, each gradient freed into the graph's pool after its update), and no update in ``finish``.

The two graphs share one private memory pool (their activations are never alive at once). The few launches of
:meth:`TrainStep.begin` (one fill per gradient buffer, the loss reset, the lr read from the device schedule)
run eagerly before the replays. Learning rate, AdamW step count, the skip flag and the step index live in
device memory, so replays need no host decision; the host reads the loss, norm and flag once per step.

Dropout draws at the default generator's device counter (``TrainStep(device_rng=True)``), so every replay
draws new masks, equal to the eager step's; the host counter moves by the graph's draws after each replay.

What cannot be captured is refused by name (``train.cuda_graph = true``) or, with ``"auto"``, named in one log
line while the step runs eagerly: see :func:`config_refusal` and :func:`runtime_refusal`.

``capture`` is pluggable: :class:`CudaCapture` (real) or :class:`EagerCapture`, the CPU twin whose replay runs
the recorded body, so the capture logic (static buffers, device schedule, no host reads) is tested on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import blutensor as bt

from blumodels.config import ConfigError
from blumodels.step import TrainStep

#: eager steps before the capture (the first creates AdamW's moments, the first synchronised backward fixes
#: DDP's bucket order; the next fills plan caches)
WARMUP_STEPS = 2


def config_refusal(cfg) -> str | None:
    """Why the configured step cannot be captured (the config alone decides), or None."""
    t = cfg.train
    if t.device == "cpu":
        return "train.device = 'cpu' (CUDA graphs need a CUDA device)"
    if not t.fused_adamw:
        return "train.fused_adamw = false: only the fused AdamW kernel reads lr, step count and skip flag on the device"
    if cfg.parallel.sharded:
        return ("a [parallel] fsdp/tp/cp layout: its collectives and the mesh's gradient norm are issued on the "
                "host around each op")
    if getattr(t, "compile", False):
        return ("train.compile = true: the micro-step runs as the compiler plugin's traced program, which the Trainer "
                "does not record into its graphs")
    return None


def runtime_refusal(device: str, world_size: int = 1) -> str | None:
    """Why this process cannot capture the step (device, GEMM provider, process group), or None."""
    if not str(device).startswith("cuda"):
        return f"the run resolved to device {device!r} (CUDA graphs need a CUDA device)"
    from blutensor.ext import get_gemm_provider

    prov = get_gemm_provider()
    if not getattr(prov, "CAPTURE_SAFE", False):  # a provider declares it; unknown = no
        from blutensor.ext import capture_safe_gemm_providers

        safe = [p.PLUGIN_NAME for p in capture_safe_gemm_providers()] or ["none installed: install blublas"]
        return (f"the GEMM provider {getattr(prov, 'PLUGIN_NAME', prov)!r} does not declare CAPTURE_SAFE (CuPy's "
                f"cuBLAS refuses stream capture); set train.gemm to a capture-safe one ({', '.join(safe)})")
    if world_size > 1:
        import dtms

        be = getattr(dtms.get_default_group(), "backend", "?")
        if be != "nccl":
            return f"the process group's backend is {be!r}: only NCCL collectives can be captured"
    return None


def check_config(cfg) -> None:
    """ConfigError naming the key when ``train.cuda_graph = true`` cannot honour the rest of the config."""
    if cfg.train.cuda_graph is True and (why := config_refusal(cfg)) is not None:
        raise ConfigError(f"train.cuda_graph = true cannot capture this step: {why} (or set train.cuda_graph = "
                          f"false)")


class CudaCapture:
    """Real capture: the body is recorded into a bt.cuda.CUDAGraph (private pool, side stream)."""

    def __init__(self) -> None:
        self.graph = None

    def capture(self, body: Callable[[], None], pool: Any = None) -> None:
        from blutensor.cuda import CUDAGraph, graph

        self.graph = CUDAGraph()
        try:
            with graph(self.graph, pool=pool):
                body()
        except Exception as e:
            from blutensor.ext import get_gemm_provider

            raise RuntimeError(
                f"capturing the training step into a CUDA graph failed: {type(e).__name__}: {e}. Something in the "
                f"step synchronised with the host or called a library that refuses capture (GEMM provider: "
                f"{getattr(get_gemm_provider(), 'PLUGIN_NAME', '?')}); run with train.cuda_graph = false"
            ) from e

    @property
    def pool(self) -> Any:
        return self.graph.pool() if self.graph is not None else None

    def replay(self) -> None:
        self.graph.replay()


class EagerCapture:
    """CPU twin of :class:`CudaCapture`: 'capture' records the body, 'replay' runs it (the same code path)."""

    def __init__(self) -> None:
        self.body = None
        self.captures = 0
        self.pool = None

    def capture(self, body: Callable[[], None], pool: Any = None) -> None:
        self.body = body
        self.captures += 1

    def replay(self) -> None:
        self.body()


class CapturedStep:
    """``step`` (a :class:`TrainStep` that has run at least one eager step) captured for batches of
    ``batch_shape``; :meth:`run` is the captured counterpart of :meth:`TrainStep.run`."""

    def __init__(self, step: TrainStep, batch_shape: tuple, make_capture: Callable[[], Any] = CudaCapture) -> None:
        if step.oib and not step.oib_on_device:
            raise ConfigError("CapturedStep: this optimizer-in-backward step reads lr and step count on the host "
                              "(TrainStep(fused=False) on CUDA); only the fused per-parameter AdamW reads them on "
                              "the device")
        self.step = step
        dev = step.device
        self.x = bt.zeros(*batch_shape, dtype=bt.int64, device=dev)
        self.y = bt.zeros(*batch_shape, dtype=bt.int64, device=dev)
        self.micro = make_capture() if step.accum > 1 else None
        self.last = make_capture()
        self._keep: list = []
        self._rng_blocks = {"micro": 0, "last": 0}  # counter blocks each graph's dropout draws (on the device)

    def _prepare(self) -> None:
        """Everything that copies host data to the device happens now, not in the capture: the multi-tensor
        tables the captured launches read (built and held as long as the graphs), index flags, kernel loads."""
        st = self.step
        missing = [i for i, p in enumerate(st.params) if p.requires_grad and p not in st.optimizer.state]
        if missing:
            raise RuntimeError(f"CapturedStep: parameters {missing[:5]} have no optimizer state yet; run at least "
                               f"one eager step first (their moments must not be created inside the graph)")
        st.bind_grads()
        if st.xp.__name__ == "numpy":
            return
        from blutensor.ext import grad_norm_table, index_flag_array, prepare_adamw_group

        index_flag_array()
        self._keep = []
        if not st.oib:  # optimizer-in-backward: one table-free launch per parameter, its gradient made in backward
            copies = st._copies()
            if copies is not None:  # the graph reads the copies as the weight casts: current before the capture
                copies.ensure_current()
            self._keep = [prepare_adamw_group(st.optimizer, grp, copies) for grp in st.optimizer.param_groups]
            self._keep.append(grad_norm_table([g._data for g in st.grads]))
        if st.autocast is not None:  # the multi-tensor weight cast's table and kernel, built by one real call
            from blutensor.ext import cast_tables

            with st.autocast():
                bt.amp.precast(st.params)
            self._keep.extend(cast_tables())
        # every CuPy kernel the body launches was loaded by the warm-up steps, which ran this same code eagerly

    def capture(self) -> None:
        """Record the micro-step and last-micro-step + update graphs (nothing runs on a real GPU)."""
        self._prepare()
        st = self.step
        gen = bt.random.default_generator
        real = not isinstance(self.last, EagerCapture)

        def record(name, cap, body, **kw) -> None:
            before = gen.offset
            cap.capture(body, **kw)
            if real:  # the draws were recorded, not made: the host counter moves with each replay instead
                self._rng_blocks[name] = gen.offset - before
                gen.offset = before

        if self.micro is not None:
            record("micro", self.micro, lambda: st.micro(self.x, self.y, sync=False))
        applied = st.applied

        def last() -> None:
            st.micro(self.x, self.y, sync=True)
            st.finish()

        record("last", self.last, last, pool=self.micro.pool if self.micro is not None else None)
        if real:  # a real capture ran fused_step's host bookkeeping, no step
            st.applied = applied
            for p in st.params:
                if p in st.optimizer.state:
                    st.optimizer.state[p]["step"] = applied

    def run(self, batches: Callable[[], tuple], lr: float) -> None:
        st = self.step
        copies = st.weight_copies
        if copies is not None:  # weights changed outside the graph (a load, an edit): re-cast them before the replay
            copies.ensure_current()
        st.begin(lr)
        for i in range(st.accum):
            x, y = batches()
            for dst, src in ((self.x, x), (self.y, y)):
                s = getattr(src, "_data", src)
                if tuple(s.shape) != tuple(dst.shape):
                    raise ValueError(f"CapturedStep: batch shape {tuple(s.shape)} != captured {tuple(dst.shape)}")
                dst._data[...] = s
            name = "last" if i == st.accum - 1 else "micro"
            getattr(self, name).replay()
            if self._rng_blocks[name]:
                bt.random.default_generator.advance_host(self._rng_blocks[name])
        for p in st.params:
            p._version.v += 1  # the graph wrote them in place
        if copies is not None:  # ... and the fused AdamW in it wrote their bf16 copies with them
            copies.mark(st.params)
