"""``compile(step_fn)``: trace once per guard signature, optimise, lower, run on live memory."""

from __future__ import annotations

import difflib
import os
import shutil
import time
import warnings
from pathlib import Path

import numpy as np

from blucompiler.builder import build_module
from blucompiler.passes.pipeline import run_pipeline
from blucompiler.runtime import Runtime
from blucompiler.session import Session, fill
from blucompiler.trace import CompileError


def _tensor_cls():
    from blutensor import Tensor

    return Tensor


def guard_key(args, kwargs) -> tuple:
    """What a compiled program is specialised to: tensor shapes/dtypes/devices/strides, other values."""
    T = _tensor_cls()
    key = []
    for i, a in enumerate(list(args) + [kwargs[k] for k in sorted(kwargs)]):
        if isinstance(a, T):
            d = a._data
            key.append(("tensor", i, tuple(d.shape), a.dtype.name, str(a.device), tuple(d.strides)))
        elif isinstance(a, bool | int | float | str | type(None)):
            key.append(("value", i, a))
        elif isinstance(a, list | tuple | dict):
            # tensors inside a container are compiled in as live inputs (like parameters): a container that
            # now holds other tensors (same object mutated, or an equal new one) must trace again, not replay
            # the old tensors' memory
            key.append(("object", i, type(a).__name__, id(a), _held_tensor_ids(a, T)))
        else:
            key.append(("object", i, type(a).__name__, id(a)))
    return tuple(key) + (tuple(sorted(kwargs)),)


def _held_tensor_ids(a, T, depth: int = 0) -> tuple:
    """Identities of the tensors held by a (nested) list/tuple/dict argument, in order."""
    if isinstance(a, T):
        return (id(a),)
    if depth > 4 or not isinstance(a, list | tuple | dict):
        return ()
    out: tuple = ()
    for v in (a.values() if isinstance(a, dict) else a):
        out += _held_tensor_ids(v, T, depth + 1)
    return out


def describe_change(old: tuple, new: tuple) -> str:
    names = {2: "shape", 3: "dtype", 4: "device", 5: "strides"}
    for o, n in zip(old, new):
        if o != n:
            if o[0] == n[0] == "tensor":
                j = next(j for j in range(2, 6) if o[j] != n[j])
                return f"argument {o[1]}: {names[j]} {o[j]} -> {n[j]}"
            if o[0] == n[0] == "object" and o[2:4] == n[2:4] and len(o) == len(n) == 5:
                return (f"argument {o[1]}: the {o[2]} now holds other tensors (tensors inside a container are "
                        f"compiled in; pass them as direct arguments to avoid tracing again)")
            return f"argument {o[1]}: {o[2:]} -> {n[2:]}"
    return "argument count changed" if len(old) != len(new) else "keyword arguments changed"


class Program_:
    """One traced, optimised and lowered specialisation of the step."""

    def __init__(self, sess: Session, mod, prog, runtime: Runtime, stats: dict, key, cuda_graph: bool = False):
        self.sess, self.mod, self.prog, self.runtime, self.stats, self.key = sess, mod, prog, runtime, stats, key
        self.graph = None
        if cuda_graph and runtime.backend == "cuda":
            from blucompiler.cudagraph import GraphStep

            self.graph = GraphStep(self)
        self.ret_tmpl = sess.ret_tmpl
        self.live = [(k, b[1], tuple(b[1]._data.shape), b[1]._data.dtype)
                     for k, b in enumerate(prog.inputs) if b[0] == "live"]
        self.calls = 0
        self.writes = [(j, self.argpos(what)) for j, (kind, what) in enumerate(prog.sinks) if kind == "write"]

    def argpos(self, in_vid: int) -> int:
        """Function-argument position of the graph input node ``in_vid``."""
        m = getattr(self, "_argpos", None)
        if m is None:
            ids = [i for i, n in enumerate(self.sess.tr.g.nodes) if n.op == "input"]
            m = self._argpos = {vid: k for k, vid in enumerate(ids)}
        return m[in_vid]

    def live_ok(self) -> str | None:
        for k, t, shape, dt in self.live:
            d = t._data
            if d.shape != shape or d.dtype != dt:
                return f"live tensor (input {k}) changed from {shape}/{dt} to {tuple(d.shape)}/{d.dtype}"
        return None

    def __call__(self, args, kwargs):
        T = _tensor_cls()
        prog, rt = self.prog, self.runtime
        for e in prog.effects:
            e()
        host = [fn() for fn in prog.host_fns]
        flat = list(args) + [kwargs[k] for k in sorted(kwargs)]
        inputs = []
        for kind, what in prog.inputs:
            if kind == "arg":
                inputs.append(flat[what]._data)
            elif kind == "live":
                inputs.append(what._data)
            elif kind == "const":
                inputs.append(what)
            else:
                inputs.append(host[what[0]][what[1]])
        outs = None
        writes = self.writes
        if self.graph is not None and rt.compiled:
            if self.graph.state == "replay":
                outs = self.graph.run(inputs, flat, host)
            if outs is None:
                for k, (kind, _) in enumerate(prog.inputs):
                    if kind == "host":  # kernels read host scalars by pointer in graph mode
                        inputs[k] = rt.xp.asarray(np.asarray(inputs[k]))
                if self.graph.state != "off":
                    outs = self.graph.run(inputs, flat, host)
        xp = rt.xp
        if outs is None:
            outs = rt.run(inputs)
            for j, k in writes:
                if outs[j] is not inputs[k]:
                    xp.copyto(inputs[k], outs[j])
        rets = []
        for val, (kind, what) in zip(outs, prog.sinks):
            if kind == "ret":
                rets.append(val)
            elif kind == "grad":
                what.grad = T._from_data(val, what.dtype, what.device)
        for t in prog.nograd:
            t.grad = None
        self.calls += 1
        if not rt.compiled:
            rt.compile_kernels()
        return fill(self.ret_tmpl, rets)


BACKENDS = ("auto", "c", "cuda", "numpy")


def known_ops() -> set[str]:
    """Op names the installed kernels implement (what ``force_eager`` may name)."""
    from blutensor.ext import get_host

    return {op for r in get_host().registry("kernel") if (op := getattr(r.cls, "OP", None))}


def check_force_eager(force_eager) -> tuple[str, ...]:
    """``force_eager`` as a tuple of known op names, else an error naming the entry at fault."""
    if isinstance(force_eager, str):
        raise TypeError(f"blucompiler.compile: force_eager must be a list of op names, got the string "
                        f"{force_eager!r} (write force_eager=({force_eager!r},))")
    try:
        names = tuple(force_eager)
    except TypeError:
        raise TypeError(f"blucompiler.compile: force_eager must be a list of op names, got "
                        f"{type(force_eager).__name__} {force_eager!r}") from None
    ops = None
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"blucompiler.compile: force_eager entries must be op names (str), got "
                            f"{type(n).__name__} {n!r}")
        ops = known_ops() if ops is None else ops
        if n not in ops:
            near = difflib.get_close_matches(n, sorted(ops), n=3)
            raise ValueError(f"blucompiler.compile: force_eager names unknown op {n!r}"
                             + (f" (did you mean {', '.join(map(repr, near))}?)" if near else "")
                             + f"; known ops: {', '.join(sorted(ops))}")
    return names


def check_dump(dump, source: str) -> Path:
    """The dump folder, created; an error naming ``source`` (the option or the variable) if it cannot be."""
    out = Path(dump)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CompileError(f"blucompiler: {source}={str(dump)!r} cannot be used as the MLIR dump folder: "
                           f"{e.strerror or e}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise CompileError(f"blucompiler: {source}={str(dump)!r}: the MLIR dump folder is not writable")
    return out


def c_compiler() -> str | None:
    """The C compiler the C backend runs (``$CC``, else cc or gcc), or None when none is found."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


class CompiledStep:
    """The callable ``compile`` returns; ``.report()`` says what happened."""

    def __init__(self, fn, backend: str = "auto", force_eager=(), dump: str | None = None, cuda_graph: bool = False):
        if not callable(fn):
            raise TypeError(f"blucompiler.compile: expected a function to compile, got {type(fn).__name__} {fn!r}")
        if backend not in BACKENDS:
            raise ValueError(f"blucompiler.compile: unknown backend {backend!r}; expected one of "
                             f"{', '.join(map(repr, BACKENDS))}")
        if not isinstance(cuda_graph, bool):
            raise TypeError(f"blucompiler.compile: cuda_graph must be True or False, got {cuda_graph!r}")
        if dump is not None:
            if not isinstance(dump, str | os.PathLike):
                raise TypeError(f"blucompiler.compile: dump must be a folder path, got {type(dump).__name__}")
            check_dump(dump, "dump")
        self.fn, self.backend, self.force_eager, self.dump = fn, backend, check_force_eager(force_eager), dump
        self.cuda_graph = cuda_graph
        self.backend_note: str | None = None  # why the backend differs from the one asked for
        self.cache: dict = {}
        self.eager_reasons: dict = {}
        self.retraces: list[str] = []
        self.last_key = None
        self.last: Program_ | None = None
        self.trace_seconds: list[float] = []

    def reset(self) -> None:
        """Forget every compiled specialisation (after replacing parameters or optimizer state)."""
        self.cache.clear()
        self.last = None

    def __call__(self, *args, **kwargs):
        key = guard_key(args, kwargs)
        p = self.cache.get(key)
        if p is not None:
            if p == "eager":
                return self.fn(*args, **kwargs)
            why = p.live_ok()
            if why is None:
                self.last, self.last_key = p, key
                return p(args, kwargs)
            self.retraces.append(why)
        elif self.last_key is not None:
            self.retraces.append(describe_change(self.last_key, key))
        self.last_key = key
        return self._trace(key, args, kwargs)

    def _backend(self, args) -> tuple[str, object]:
        T = _tensor_cls()
        cuda = any(isinstance(a, T) and a.device.type == "cuda" for a in args)
        if cuda:
            import cupy

            return ("cuda" if self.backend in ("auto", "cuda") else "numpy"), cupy
        if self.backend == "cuda":
            raise CompileError("backend 'cuda' asked for, but the step's tensors are on the CPU")
        if self.backend in ("auto", "c"):
            if c_compiler() is not None:
                return "c", np
            cc = os.environ.get("CC")
            if self.backend == "c" or cc:
                note = (f"backend {self.backend!r}: no C compiler ({'$CC=' + repr(cc) if cc else 'cc/gcc'} not found): "
                        f"kernels run through NumPy instead")
                if note != self.backend_note:
                    warnings.warn(f"blucompiler: {note}", RuntimeWarning, stacklevel=4)
                self.backend_note = note
            if cc:  # the C path stays: its compile fails once, recorded in report()["kernels"]["compile_error"]
                return "c", np
        return "numpy", np

    def _trace(self, key, args, kwargs):
        backend, xp = self._backend(list(args) + list(kwargs.values()))
        dump = self.dump
        if dump is None and os.environ.get("BLU_COMPILER_DUMP"):  # checked before the step runs, not after
            dump = str(check_dump(os.environ["BLU_COMPILER_DUMP"], "$BLU_COMPILER_DUMP"))
        sess = Session(list(args) + [kwargs[k] for k in sorted(kwargs)], self.force_eager, xp)
        t = time.perf_counter()
        try:
            result = sess.run(self.fn, args, kwargs)
        except CompileError as e:
            if e.retry:
                self.retraces.append(f"ran eagerly, will trace again: {e}")
                self.last_key = None
            else:
                self.cache[key] = "eager"
                self.eager_reasons[key] = str(e)
            return self.fn(*args, **kwargs)
        self.trace_seconds.append(time.perf_counter() - t)
        mod, prog = build_module(sess.tr.g)
        stats = run_pipeline(mod, dump)
        graph = self.cuda_graph and backend == "cuda"
        rt = Runtime(mod, prog, backend, xp, host_by_value=not graph)
        p = Program_(sess, mod, prog, rt, stats, key, graph)
        self.cache[key] = p
        self.last = p
        return result

    # ---- introspection ----
    def ir(self) -> str:
        """MLIR text of the last compiled program (after all passes)."""
        from blucompiler.dialect import print_ir

        return print_ir(self.last.mod) if self.last else ""

    def report(self) -> dict:
        from blucompiler.report import build_report

        return build_report(self)
