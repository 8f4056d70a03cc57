"""One tracing run of a step: install the observer and rules, run, turn the end state into outputs.

``trace_step(fn, args, kwargs)`` returns the graph plus the step's real result (the tracing run is
the step's eager run: its effects on parameters, optimizer state and gradients are applied).
"""

from __future__ import annotations

import numpy as np

from blucompiler.rules import Rules
from blucompiler.tarray import TracedArray, TraceUnsupported
from blucompiler.trace import CompileError, Tracer


class Slot:
    """Placeholder for a graph value inside a Python structure (results, eager contexts)."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __repr__(self):
        return f"Slot({self.k})"


def template(obj, found: list):
    """``obj`` with every TracedArray (and Tensor holding one) replaced by a Slot; values in ``found``."""
    from blutensor import Tensor

    if isinstance(obj, TracedArray):
        found.append(obj)
        return Slot(len(found) - 1)
    if isinstance(obj, Tensor) and isinstance(obj._data, TracedArray):
        found.append(obj._data)
        return ("__tensor__", Slot(len(found) - 1), obj.dtype, obj.device)
    if isinstance(obj, tuple):
        return tuple(template(o, found) for o in obj)
    if isinstance(obj, list):
        return [template(o, found) for o in obj]
    if isinstance(obj, dict):
        return {k: template(v, found) for k, v in obj.items()}
    return obj


def fill(tmpl, values):
    """Inverse of :func:`template`: Slots replaced by ``values`` (raw arrays)."""
    if isinstance(tmpl, Slot):
        return values[tmpl.k]
    if isinstance(tmpl, tuple):
        if len(tmpl) == 4 and tmpl[0] == "__tensor__":
            from blutensor import Tensor

            return Tensor._from_data(values[tmpl[1].k], tmpl[2], tmpl[3])
        return tuple(fill(t, values) for t in tmpl)
    if isinstance(tmpl, list):
        return [fill(t, values) for t in tmpl]
    if isinstance(tmpl, dict):
        return {k: fill(v, values) for k, v in tmpl.items()}
    return tmpl


class EagerOp:
    """An op the tracer could not trace: replayed through its blutensor kernel at run time."""

    def __init__(self, op, kernel, attrs, in_tmpl, needs, reason):
        self.op, self.kernel, self.attrs, self.in_tmpl, self.needs, self.reason = \
            op, kernel, attrs, in_tmpl, needs, reason

    def forward(self, values):
        from blutensor.ext import Ctx

        ctx = Ctx()
        ctx.needs = self.needs
        arrays = fill(self.in_tmpl, values)
        out = self.kernel.forward(ctx, *arrays, **fill(self.attrs, values))
        if isinstance(out, np.generic):
            out = np.asarray(out)
        return (out, ctx)


class EagerBackward:
    """A backward formula replayed eagerly: from the eager forward's context, or from a rebuilt one."""

    def __init__(self, op, kernel, ctx_tmpl, needs, reason):
        self.op, self.kernel, self.ctx_tmpl, self.needs, self.reason = op, kernel, ctx_tmpl, needs, reason

    def backward(self, values, grad, fwd=None):
        from blutensor.ext import Ctx

        if fwd is not None:
            ctx = fwd[1]
        else:
            ctx = Ctx()
            ctx.needs = self.needs
            ctx.saved = fill(self.ctx_tmpl[0], values)
            for k, v in self.ctx_tmpl[1].items():
                setattr(ctx, k, fill(v, values))
        out = self.kernel.backward(ctx, grad)
        return out if isinstance(out, tuple) else (out,)


class _TracingBackward:
    """Wraps a recorded node's kernel: trace its backward formula, or replay it eagerly."""

    def __init__(self, sess, kernel, op):
        self.sess, self.kernel, self.op = sess, kernel, op
        for f in ("SAVES", "SAVES_OUTPUT", "VIEW", "DIFFERENTIABLE"):
            if hasattr(kernel, f):
                setattr(self, f, getattr(kernel, f))

    def backward(self, ctx, grad):
        try:
            return self.kernel.backward(ctx, grad)
        except CompileError:
            raise
        except Exception as e:  # noqa: BLE001 - anything untraceable runs eagerly
            return self.sess.eager_backward(self.op, self.kernel, ctx, grad, f"{type(e).__name__}: {e}")


class _EagerNodeBackward:
    def __init__(self, sess, kernel, op, fwd_vid, key):
        self.sess, self.kernel, self.op, self.fwd_vid, self.key = sess, kernel, op, fwd_vid, key

    def backward(self, ctx, grad):
        tr = self.sess.tr
        real = self.kernel.backward(ctx, grad.v if isinstance(grad, TracedArray) else grad)
        real = real if isinstance(real, tuple) else (real,)
        tr.primitives += 1
        eb = EagerBackward(self.op, self.kernel, None, ctx.needs, "forward ran eagerly")
        key = tr.g.keep(eb)
        vid = tr.g.add("eager_backward", [self.fwd_vid, tr.operand(grad)], {"op": self.op, "key": key,
                                                                            "from_forward": True}, (), None)
        return self.sess.extract(vid, real)


def _plugin_kernel(op, inputs) -> str | None:
    """PLUGIN_NAME of the kernel dispatch would pick for this call when it is not blutensor's
    built-in (hand-written CUDA kernels are opaque to an array-level tracer: called as a library)."""
    from blutensor import Tensor, ext

    tens = [x for x in inputs if isinstance(x, Tensor)]
    if not tens:
        return None
    k = ext.op_rule(op, missing_ok=True)
    i = k.DTYPE_ARG if k is not None else 0
    sel = inputs[i] if i < len(inputs) and isinstance(inputs[i], Tensor) else tens[0]
    try:
        kcls = ext.resolve_kernel(op, tens[0].device.type, sel.dtype.name)
    except Exception:  # noqa: BLE001 - dispatch will raise the real error
        return None
    name = getattr(kcls, "PLUGIN_NAME", "")
    # blutensor's compiled CPU kernels compute the built-in op (within float32 rounding): lowered like it
    return None if name in (f"blutensor.{op}", f"blutensor.cpu.{op}") else name


class Session:
    """Install observer + rules, run ``fn``, finalize into graph outputs."""

    def __init__(self, args, force_eager=(), xp=np):
        self.tr = Tracer(args, xp)
        self.force_eager = set(force_eager)

    # ---- observer ----
    def observe(self, op, inputs, attrs, run):
        from blutensor import Tensor
        from blutensor.ext import Node

        tr = self.tr
        for x in inputs:
            if isinstance(x, Tensor) and not isinstance(x._data, TracedArray):
                tr.lift(x)
        if (op == "dropout" and attrs.get("p", 0) > 0) or (op == "sdpa" and attrs.get("dropout_p", 0) > 0):
            raise CompileError(f"op '{op}' draws random numbers (dropout > 0): its seed/offset are Python state "
                               f"that a replayed graph would freeze")
        if op in self.force_eager:
            return self.eager_forward(op, inputs, attrs, run, "forced eager (force_eager option)")
        lib = _plugin_kernel(op, inputs)
        if lib is not None:
            return self.eager_forward(op, inputs, attrs, run, f"library kernel {lib} (opaque call)")
        try:
            res = run()
        except CompileError:
            raise
        except Exception as e:  # noqa: BLE001 - the op runs eagerly; a genuine error re-raises there
            return self.eager_forward(op, inputs, attrs, run, f"{type(e).__name__}: {e}")
        if isinstance(res.grad_fn, Node):
            res.grad_fn.kernel = _TracingBackward(self, res.grad_fn.kernel, op)
        return res

    def extract(self, vid, real):
        tr = self.tr
        out = []
        for k, r in enumerate(real):
            if r is None:
                out.append(None)
                continue
            if isinstance(r, np.generic):
                r = np.asarray(r)
            e = tr.g.add("extract", [vid], {"index": k}, r.shape, r.dtype)
            out.append(TracedArray(tr, e, r))
        return tuple(out)

    def eager_forward(self, op, inputs, attrs, run, reason):
        from blutensor import Tensor, ext
        from blutensor.ext import Node

        tr = self.tr
        tens = [x for x in inputs if isinstance(x, Tensor)]
        saved = [(t, t._data) for t in tens]
        found: list = []
        in_tmpl = template([x._data if isinstance(x, Tensor) else x for x in inputs], found)
        attr_tmpl = template(dict(attrs), found)  # attributes may hold traced arrays (index masks)
        orig_attrs = dict(attrs)
        attrs.update(fill(attr_tmpl, [f.v for f in found]))
        for t in tens:
            t._data = t._data.v
        try:
            res = run()
        finally:
            for t, d in saved:
                t._data = d
            attrs.clear()
            attrs.update(orig_attrs)
        first = tens[0]
        kernel = res.grad_fn.kernel if isinstance(res.grad_fn, Node) else \
            ext.resolve_kernel(op, first.device.type, first.dtype.name)
        needs = tuple(isinstance(t, Tensor) and t.requires_grad for t in inputs)
        eo = EagerOp(op, kernel, attr_tmpl, in_tmpl, needs, reason)
        key = tr.g.keep(eo)
        tr.fallbacks.append((op, reason))
        tr.primitives += 1  # the eager step launches this kernel too
        vid = tr.g.add("eager", [tr.operand(a) for a in found], {"op": op, "key": key}, (), None)
        (out,) = self.extract(vid, (res._data,))
        res._data = out
        if isinstance(res.grad_fn, Node):
            res.grad_fn.kernel = _EagerNodeBackward(self, kernel, op, vid, key)
        return res

    def eager_backward(self, op, kernel, ctx, grad, reason):
        from blutensor.ext import Ctx

        tr = self.tr
        found: list = []
        extra = {k: v for k, v in getattr(ctx, "__dict__", {}).items()}
        ctx_tmpl = (template(ctx.saved, found), {k: template(v, found) for k, v in extra.items()})
        real_ctx = Ctx()
        real_ctx.needs = ctx.needs
        vals = [f.v for f in found]
        real_ctx.saved = fill(ctx_tmpl[0], vals)
        for k, v in ctx_tmpl[1].items():
            setattr(real_ctx, k, fill(v, vals))
        real = kernel.backward(real_ctx, grad.v if isinstance(grad, TracedArray) else grad)
        real = real if isinstance(real, tuple) else (real,)
        eb = EagerBackward(op, kernel, ctx_tmpl, ctx.needs, reason)
        key = tr.g.keep(eb)
        tr.fallbacks.append((f"{op}.backward", reason))
        tr.primitives += 1
        vid = tr.g.add("eager_backward", [tr.operand(a) for a in found] + [tr.operand(grad)],
                       {"op": op, "key": key, "from_forward": False}, (), None)
        return self.extract(vid, real)

    # ---- run ----
    def run(self, fn, args, kwargs):
        from blutensor import ext

        tr = self.tr
        for a in args:
            from blutensor import Tensor

            if isinstance(a, Tensor):
                tr.lift(a)
        ext.add_op_observer(self.observe)
        ok = False
        try:
            with Rules(tr):
                result = fn(*args, **kwargs)
            ok = True
        except TraceUnsupported as e:
            raise CompileError(f"the step reads a traced value on the host outside any op ({e}); "
                               f"e.g. loss.item() inside the step") from None
        finally:
            ext.remove_op_observer(self.observe)
            if not ok:
                self.abort()
        return self.finalize(result)

    def abort(self) -> None:
        """Undo the storage swap after a failed trace (parameters keep their original arrays)."""
        for t, arr, grad, _, _ in self.tr.swapped:
            t._data = arr
            t.grad = grad

    def finalize(self, result):
        g = self.tr.g
        found: list = []
        ret_tmpl = template(result, found)
        for k, ta in enumerate(found):
            g.outputs.append((self.tr.operand(ta), ("ret", k)))
        real_result = fill(ret_tmpl, [ta.v for ta in found])
        for t, arr, _, _, in_vid in self.tr.swapped:
            cur = t._data
            t._data = arr
            if isinstance(cur, TracedArray) and cur.vid != in_vid:
                g.outputs.append((self.tr.operand(cur), ("write", in_vid)))
                arr[...] = cur.v
            gr = t.grad
            if gr is not None and id(gr) in self.tr.lifted:
                pass  # a lifted gradient buffer: written back in place as live memory (its own entry)
            elif gr is not None and isinstance(gr._data, TracedArray):
                g.outputs.append((self.tr.operand(gr._data), ("grad", t)))
                gr._data = gr._data.v
            elif gr is None and self.tr.swapped and t.requires_grad:
                g.outputs.append((None, ("nograd", t)))
        self.ret_tmpl = ret_tmpl
        # drop the tracing run's concrete values (a copy of every parameter and state array)
        tr = self.tr
        tr.swapped, tr.lifted, tr.host_cache, tr.consts, tr.captured = [], {}, {}, {}, {}
        tr._keep = []
        return real_result
