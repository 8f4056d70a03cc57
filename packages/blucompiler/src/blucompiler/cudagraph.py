"""Optional CUDA-graph replay of a whole compiled step (``compile(..., cuda_graph=True)``).

After the kernels are compiled, one call runs normally under a private CuPy memory pool holding every
intermediate (this warms the pool with exactly the blocks the step needs); the next call captures
the step on a side stream (same allocations, served from the warmed pool, nothing freed) and launches
the graph; later calls only copy the new arguments into the captured argument buffers, write the
host scalars (learning rate, bias corrections) into their device slots and relaunch. Outputs are
the captured buffers: a step's returned tensors and ``.grad`` arrays are overwritten by the next one.
Anything that cannot be captured (a host sync inside a library kernel, an allocation the pool cannot
serve) turns graph mode off for this program, with the reason in the report.
"""

from __future__ import annotations

import numpy as np


class GraphStep:
    def __init__(self, program):
        import cupy

        self.p = program
        self.pool = cupy.cuda.MemoryPool()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.state = "warm"  # warm -> capture -> replay | off
        self.error: str | None = None
        self.graph = None
        self.outs = None
        self.args: list = []  # (input position, flat arg index, static buffer)
        self.scalars: list = []  # (input position, (fn, j), device 0-d array)
        self.live: list = []  # (tensor, data pointer at capture)
        self.replays = 0

    def _writebacks(self, inputs, outs, xp):
        for val, (kind, what) in zip(outs, self.p.prog.sinks):
            if kind == "write":
                live = inputs[self.p.argpos(what)]
                if val is not live:
                    xp.copyto(live, val)

    def run(self, inputs: list, flat: list, host: list):
        """Execute this call; returns the outputs (write-backs done) or None to run without a graph."""
        import cupy

        if self.state == "off":
            return None
        rt = self.p.runtime
        if self.state == "replay":
            return self._replay(flat, host)
        if self.state == "warm":
            with cupy.cuda.using_allocator(self.pool.malloc):
                outs = rt.run(inputs, keep=True)
                self._writebacks(inputs, outs, cupy)
            rt.kept = None  # every block goes back to the private pool, ready for the capture
            self.state = "capture"
            return outs
        return self._capture(inputs, flat, host)

    def _capture(self, inputs, flat, host):
        import cupy

        rt, prog = self.p.runtime, self.p.prog
        ins = list(inputs)
        for kind, what in prog.sinks:
            if kind == "grad":
                what.grad = None  # this call replaces them: their warm-up blocks go back to the pool
        try:
            with cupy.cuda.using_allocator(self.pool.malloc):
                for k, (kind, what) in enumerate(prog.inputs):
                    if kind == "arg":
                        buf = cupy.empty_like(inputs[k])
                        buf[...] = inputs[k]
                        ins[k] = buf
                        self.args.append((k, what, buf))
                    elif kind == "host":
                        dev = cupy.asarray(np.asarray(host[what[0]][what[1]]))
                        ins[k] = dev
                        self.scalars.append((k, what, dev))
                    elif kind == "live":
                        self.live.append((what, inputs[k].data.ptr))
                cur = cupy.cuda.get_current_stream()
                self.stream.wait_event(cur.record())
                with self.stream:
                    self.stream.begin_capture()
                    try:
                        outs = rt.run(ins, keep=True)
                        self._writebacks(ins, outs, cupy)
                    except BaseException:
                        try:
                            self.stream.end_capture()
                        except Exception:  # noqa: BLE001
                            pass
                        raise
                    self.graph = self.stream.end_capture()
                    self.graph.launch(stream=self.stream)
                cur.wait_event(self.stream.record())
        except Exception as e:  # noqa: BLE001 - graph mode off, the step runs normally
            self.state, self.error = "off", f"{type(e).__name__}: {e}"
            rt.kept = None
            return None
        self.outs = outs
        self.state = "replay"
        return outs

    def _replay(self, flat, host):
        import cupy

        for t, ptr in self.live:
            if t._data.data.ptr != ptr:
                self.state, self.error = "off", "a live tensor's storage moved after capture"
                return None
        cur = cupy.cuda.get_current_stream()
        self.stream.wait_event(cur.record())
        with self.stream:
            for _, what, buf in self.args:
                cupy.copyto(buf, flat[what]._data)
            for _, (fi, j), dev in self.scalars:
                dev.fill(host[fi][j])
            self.graph.launch(stream=self.stream)
        cur.wait_event(self.stream.record())
        self.replays += 1
        return self.outs

    def info(self) -> dict:
        return {"state": self.state, "error": self.error, "replays": self.replays}
