"""Runtime: execute the optimised module on live tensor memory.

The function body becomes a flat instruction list over value slots. ``blu.fused`` kernels run the
generated code (C via ctypes on the CPU, CUDA via NVRTC on the GPU) directly on the arrays' memory:
inputs are the live parameter/optimizer arrays and the step's arguments, outputs go to planned
buffer slots, fresh arrays (values that leave the step) or, for in-place updates, the live buffers
themselves. Other ops go through the array library (GEMMs through the GEMM provider).

The first call runs every kernel through the array library ("interpret") while recording the
strides each kernel meets; then all kernels are generated, compiled together and bound, and
later calls take the compiled path. A kernel that meets a different layout is re-specialised.
"""

from __future__ import annotations

import numpy as np

from blucompiler.builder import Program, step_func
from blucompiler.codegen import Input, KernelSpec, KOp, Unsupported
from blucompiler.dialect import attrs_of, np_type, op_kind
from blucompiler.ops_impl import const_value, gemm, run_op

LIB_LAUNCHES = {"setitem": 2, "scatter_add": 2, "setitem_inplace": 1, "scatter_add_inplace": 1,
                "reshape": 0, "transpose": 0, "broadcast": 0, "slice": 0,
                "extract": 0}


class FusedKernel:
    """One ``blu.fused`` op: its region as kernel ops, specialised per input layout."""

    def __init__(self, op, consts: dict, host_args: set, name: str):
        self.name = name
        a = attrs_of(op)
        self.kind, self.domain = a["kind"], tuple(a["domain"])
        self.slots = tuple(a.get("slots", ()))
        self.inplace = tuple(a.get("inplace", ()))
        block = op.regions[0].block
        self.inputs: list[Input] = []
        for v in op.operands:
            shape, dt = np_type(v.type)
            if v in consts:
                cv, weak = consts[v]
                self.inputs.append(Input("lit", dt, shape, (), cv, weak))
            elif v in host_args and shape == ():
                self.inputs.append(Input("val", dt, shape))
            else:
                self.inputs.append(Input("ptr", dt, shape))
        ref = {b: ("in", k) for k, b in enumerate(block.args)}
        self.kops: list[KOp] = []
        self.outputs = []
        for o in block.ops:
            if o.name == "blu.yield":
                self.outputs = [ref[v] for v in o.operands]
                break
            self.kops.append(KOp(op_kind(o), [ref[v] for v in o.operands], np_type(o.results[0].type)[1],
                                 attrs_of(o)))
            ref[o.results[0]] = ("v", len(self.kops) - 1)
        self.out_types = [np_type(r.type) for r in op.results]
        self.out_bytes = [int(np.prod(sh, dtype=np.int64)) * np.dtype(dt).itemsize for sh, dt in self.out_types]
        self.passed = [k for k, i in enumerate(self.inputs) if i.mode != "lit"]
        self.ptr_mask = [self.inputs[k].mode == "ptr" for k in self.passed]
        self.byte_layout = None
        self.layout = None  # strides seen in the interpreting run
        self.fn = None
        self.unsupported = None

    # ---- interpretation (first run, and fallback) ----
    def interpret(self, ins: list, xp):
        vals = []
        full = []
        it = iter(ins)
        for i in self.inputs:
            if i.mode == "lit":
                full.append(i.value if i.weak else np.dtype(i.dtype).type(i.value))
            else:
                full.append(next(it))

        def get(r):
            return full[r[1]] if r[0] == "in" else vals[r[1]]

        for op in self.kops:
            vals.append(run_op(op.kind, op.attrs, op.dtype, self.domain, [get(r) for r in op.args], xp, None))
        outs = []
        for r, (shape, dt) in zip(self.outputs, self.out_types):
            v = xp.asarray(get(r))
            if v.dtype != dt:
                v = v.astype(dt)
            if v.shape != shape:
                v = xp.broadcast_to(v, shape)
            outs.append(v if v.flags.c_contiguous else v.copy(order="C"))
        return outs

    def layout_of(self, ins) -> tuple:
        """Element strides of the pointer inputs (None for by-value scalars)."""
        lay = []
        for k, a in zip(self.passed, ins):
            if self.inputs[k].mode == "ptr":
                lay.append(tuple(s // a.itemsize for s in a.strides))
            else:
                lay.append(None)
        return tuple(lay)

    def byte_strides_of(self, ins) -> tuple:
        """The fast-path key: byte strides of every pointer input."""
        return tuple(a.strides if m else None for m, a in zip(self.ptr_mask, ins))

    def spec(self) -> KernelSpec:
        inputs = []
        lay = dict(zip(self.passed, self.layout))
        for k, i in enumerate(self.inputs):
            if i.mode == "ptr":
                inputs.append(Input("ptr", i.dtype, i.shape, lay[k]))
            else:
                inputs.append(i)
        return KernelSpec(self.name, self.kind, self.domain, inputs, self.kops, self.outputs,
                          [dt for _, dt in self.out_types])


class Runtime:
    """Executable form of one optimised module + Program."""

    def __init__(self, mod, prog: Program, backend: str, xp, host_by_value: bool = True):
        self.prog, self.backend, self.xp = prog, backend, xp
        self.kept: list | None = None
        fn = step_func(mod)
        block = fn.regions[0].block
        labels = [a.data for a in fn.attributes["blu.inputs"].data]
        self.nargs = len(block.args)
        slot: dict = {a: k for k, a in enumerate(block.args)}
        # host scalars are kernel arguments by value, or (CUDA graphs) 0-d device arrays read by pointer
        host_args = {a for a, lab in zip(block.args, labels) if lab.startswith("host:")} if host_by_value else set()
        self.env0: list = [None] * self.nargs
        consts: dict = {}
        plan = []
        self.kernels: list[FusedKernel] = []
        self.counts = {"fused": 0, "library": 0, "eager": 0}
        ret_op = None
        for op in block.ops:
            if op.name == "func.return":
                ret_op = op
                break
            k = op_kind(op)
            outs = []
            for r in op.results:
                slot[r] = len(self.env0)
                self.env0.append(None)
                outs.append(slot[r])
            if k == "const":
                a = attrs_of(op)
                shape, dt = np_type(op.results[0].type)
                from blucompiler.graph import Node

                v = const_value(Node("const", [], a, shape, dt))
                self.env0[outs[0]] = v
                consts[op.results[0]] = (a["value"], a.get("weak", False))
                continue
            ins = [slot[v] for v in op.operands]
            if k == "fused":
                fk = FusedKernel(op, consts, host_args, f"blu_{attrs_of(op).get('id', len(self.kernels))}")
                self.kernels.append(fk)
                ins = [ins[j] for j in fk.passed]
                plan.append(("fused", fk, ins, outs))
                self.counts["fused"] += 1
            else:
                a = attrs_of(op)
                shape, dt = np_type(op.results[0].type)
                plan.append(("lib", _lib_fn(k, a, shape, dt, xp, prog.side), ins, outs))
                self.counts["eager" if k.startswith("eager") else "library"] += 1
        self.ret = [slot[v] for v in ret_op.operands]
        # liveness: free each slot after its last reader (returned values and arguments stay)
        keep = set(self.ret) | set(range(self.nargs)) | {i for i, v in enumerate(self.env0) if v is not None}
        last: dict[int, int] = {}
        for n, (_, _, ins, _) in enumerate(plan):
            for s in ins:
                last[s] = n
        frees: list[list[int]] = [[] for _ in plan]
        for s, n in last.items():
            if s not in keep:
                frees[n].append(s)
        # a setitem/scatter-add into a fresh `full` buffer read by nothing else writes into it (no copy)
        made_by = {o: getattr(f, "kind", kind) for kind, f, _, outs in plan for o in outs}
        for n, (kind, f, ins, outs) in enumerate(plan):
            k = getattr(f, "kind", "")
            if k in ("setitem", "scatter_add") and made_by.get(ins[0]) == "full" and last.get(ins[0]) == n \
                    and ins[0] not in keep and ins.count(ins[0]) == 1:
                plan[n] = (kind, _inplace_fn(k, f.attrs), ins, outs)
        self.plan = [(kind, f, ins, outs, tuple(frees[n])) for n, (kind, f, ins, outs) in enumerate(plan)]
        self.compiled = False
        self.compile_error: str | None = None
        self.slot_arrays: list = []
        self.slot_bytes = _slot_sizes(self.kernels)
        self.launches = self._launches(plan)

    def _launches(self, plan) -> int:
        n = 0
        for kind, f, _, _ in plan:
            if kind == "fused":
                n += 1
            else:
                n += LIB_LAUNCHES.get(getattr(f, "kind", ""), 1)
        return n

    # ---- compile ----
    def compile_kernels(self) -> dict:
        """Generate and compile every kernel seen in the interpreting run; return counts."""
        specs, todo = [], []
        for fk in self.kernels:
            if fk.layout is None:
                continue
            try:
                specs.append(fk.spec())
                todo.append(fk)
            except Unsupported as e:
                fk.unsupported = str(e)
        fns = {}
        self.compile_error = None
        try:
            if self.backend == "c" and specs:
                from blucompiler.lower_c import compile_c

                fns = compile_c(specs)
            elif self.backend == "cuda" and specs:
                from blucompiler.lower_cuda import compile_cuda

                fns = compile_cuda(specs)
        except Exception as e:  # noqa: BLE001 - kernels stay interpreted by the array library; reported
            self.compile_error = f"{type(e).__name__}: {str(e)[:2000]}"
        for fk in todo:
            fk.fn = fns.get(fk.name)
        xp = self.xp
        self.slot_arrays = [xp.empty(max(nb, 1), dtype=np.uint8) for nb in self.slot_bytes]
        self.compiled = True
        return {"kernels": len(self.kernels), "generated": sum(fk.fn is not None for fk in self.kernels)}

    # ---- run ----
    def run(self, inputs: list, keep: bool = False) -> list:
        """Execute once; ``keep``: hold every intermediate (graph capture: nothing freed or reused)."""
        env = list(self.env0)
        if keep:
            self.kept = env
        env[: self.nargs] = inputs
        xp = self.xp
        compiled = self.compiled
        for kind, f, ins, outs, frees in self.plan:
            args = [env[s] for s in ins]
            if kind == "fused":
                if compiled and f.fn is not None:
                    res = self._launch(f, args, env)
                else:
                    res = f.interpret(args, xp)
                    if f.layout is None:
                        f.layout = f.layout_of(args)
                        f.byte_layout = f.byte_strides_of(args)
                for s, r in zip(outs, res):
                    env[s] = r
            else:
                env[outs[0]] = f(*args)
            if not keep:
                for s in frees:
                    env[s] = None
        return [env[s] for s in self.ret]

    def _launch(self, f: FusedKernel, args, env):
        if f.byte_strides_of(args) != f.byte_layout:
            return f.interpret(args, self.xp)  # a layout the kernel was not specialised for
        xp = self.xp
        outs = []
        for j, (shape, dt) in enumerate(f.out_types):
            s = f.slots[j] if j < len(f.slots) else -1
            ip = f.inplace[j] if j < len(f.inplace) else -1
            if ip >= 0:
                live = env[ip]
                if live.flags.c_contiguous and live.dtype == dt and live.shape == shape:
                    outs.append(live)
                    continue
            if s >= 0:
                outs.append(self.slot_arrays[s][:f.out_bytes[j]].view(dt).reshape(shape))
            else:
                outs.append(xp.empty(shape, dtype=dt))
        f.fn(args, outs)
        return outs


def _slot_sizes(kernels) -> list[int]:
    sizes: dict[int, int] = {}
    for fk in kernels:
        for s, (shape, dt) in zip(fk.slots, fk.out_types):
            if s >= 0:
                nb = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
                sizes[s] = max(sizes.get(s, 0), nb)
    return [sizes.get(i, 0) for i in range(max(sizes, default=-1) + 1)]


class _Lib:
    __slots__ = ("kind", "f", "attrs")

    def __init__(self, kind, f, attrs=None):
        self.kind, self.f, self.attrs = kind, f, attrs

    def __call__(self, *a):
        return self.f(*a)


def _lib_fn(k, a, shape, dt, xp, side):
    if k == "reshape":
        return _Lib(k, lambda x: x.reshape(shape))
    if k == "transpose":
        perm = a["perm"]
        return _Lib(k, lambda x: x.transpose(perm))
    if k == "broadcast":
        return _Lib(k, lambda x: xp.broadcast_to(x, shape))
    if k == "matmul":
        ta, tb = a.get("ta", False), a.get("tb", False)
        # routing by the contraction pass: GEMMs to the GEMM provider, matrix-vector shapes to the
        # array library's matmul (cuBLAS gemv through CuPy on the GPU)
        mat = gemm if a.get("provider", "gemm") == "gemm" or xp is np else xp.matmul

        def mm(x, y):
            return mat(x.swapaxes(-1, -2) if ta else x, y.swapaxes(-1, -2) if tb else y)

        return _Lib(k, mm)
    if k == "extract":
        i = a["index"]

        def ex(t):
            r = t[i]
            return np.asarray(r) if isinstance(r, np.generic) else r

        return _Lib(k, ex)
    return _Lib(k, lambda *args: run_op(k, a, dt, shape, args, xp, side), a)


def _inplace_fn(k, a):
    from blucompiler.ops_impl import index_fn, scatter_add

    idx = index_fn(a["index"])

    def setitem(x, v, *arrays):
        x[idx(arrays)] = v
        return x

    def scat(x, v, *arrays):
        scatter_add(x, idx(arrays), v)
        return x

    return _Lib(k + "_inplace", setitem if k == "setitem" else scat, a)
