"""blu-buffers: buffer planning with reuse, and in-place write-back into live memory.

* Every fused-kernel output that does not leave the step gets a buffer slot; a slot is reused by a
  later output of the same byte size once every value aliasing the previous occupant (views,
  eager results) is dead. Annotates ``slots`` on ``blu.fused`` ops and ``blu.buffer_plan`` on the
  function (slots, planned bytes, bytes without reuse).
* A returned value that is written back into a live input (parameters, optimizer state) is
  computed in place when its kernel reads that input only at the element it writes and nothing
  later reads the input: ``inplace`` on the fused op gives, per output, the argument it overwrites
  (-1: none), and the write-back copy disappears.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects.builtin import DictionaryAttr
from xdsl.passes import ModulePass

from blucompiler.dialect import attrs_of, to_attr
from blucompiler.passes.common import body, dtype_of, kind, shape_of

ALIASING = {"reshape", "transpose", "broadcast", "slice", "copy", "extract", "eager", "eager_backward"}


def _step(mod):
    for o in mod.body.block.ops:
        if o.name == "func.func":
            return o
    raise ValueError("no func.func")


@dataclass(frozen=True)
class BufferPass(ModulePass):
    name = "blu-buffers"

    def apply(self, ctx, op) -> None:
        fn = _step(op)
        block = body(op)
        ops = list(block.ops)
        pos = {o: i for i, o in enumerate(ops)}
        ret = ops[-1]
        returned = set(ret.operands)
        labels = [a.data for a in fn.attributes["blu.outputs"].data]
        self._inplace(ops, pos, ret, labels, block)

        # lifetime of a value = last position where it or any alias of it is read
        def last_use(v, seen=None):
            seen = seen or set()
            end = pos.get(v.owner, -1) if hasattr(v, "owner") else -1
            for u in v.uses:
                o = u.operation
                if o is ret:
                    return len(ops)
                end = max(end, pos.get(o, len(ops)))
                if kind(o) in ALIASING and o not in seen:
                    seen.add(o)
                    for r in o.results:
                        end = max(end, last_use(r, seen))
            return end

        free: dict[int, list[int]] = {}
        busy: list[tuple[int, int]] = []  # (end, slot)
        slot_bytes: list[int] = []
        naive = 0
        for o in ops:
            if o.name != "blu.fused":
                continue
            p = pos[o]
            for _, s in [b for b in busy if b[0] < p]:
                free.setdefault(slot_bytes[s], []).append(s)
            busy = [b for b in busy if b[0] >= p]
            inpl = attrs_of(o).get("inplace", ())
            slots = []
            for j, r in enumerate(o.results):
                nb = int(dtype_of(r).itemsize * _prod(shape_of(r)))
                end = last_use(r)
                if r in returned or (inpl and inpl[j] >= 0) or end >= len(ops):
                    slots.append(-1)  # leaves the step (directly or through a view): a fresh array
                    continue
                naive += nb
                lst = free.get(nb)
                s = lst.pop() if lst else None
                if s is None:
                    s = len(slot_bytes)
                    slot_bytes.append(nb)
                busy.append((end, s))
                slots.append(s)
            o.attributes["slots"] = to_attr(tuple(slots))
        fn.attributes["blu.buffer_plan"] = DictionaryAttr({
            "slots": to_attr(len(slot_bytes)), "bytes": to_attr(sum(slot_bytes)),
            "bytes_without_reuse": to_attr(naive)})

    @staticmethod
    def _inplace(ops, pos, ret, labels, block) -> None:
        args = list(block.args)
        for j, v in enumerate(ret.operands):
            lab = labels[j]
            if not lab.startswith("write:"):
                continue
            arg = args[int(lab[6:])]
            f = v.owner
            if getattr(f, "name", "") != "blu.fused" or attrs_of(f).get("kind") != "elementwise":
                continue
            if _alias_end(arg, pos, ret, len(ops)) > pos[f]:
                continue
            dom = tuple(attrs_of(f)["domain"])
            if shape_of(arg) != dom or sum(1 for u in ret.operands if u is v) != 1:
                continue
            k = [i for i, a in enumerate(f.operands) if a is arg]
            if k and not _aligned(f, k[0], dom):
                continue
            inpl = list(attrs_of(f).get("inplace", (-1,) * len(f.results)))
            inpl[list(f.results).index(v)] = int(lab[6:])
            f.attributes["inplace"] = to_attr(tuple(inpl))


def _alias_end(v, pos, ret, n) -> int:
    """Last position reading ``v`` directly or through a view/alias of it (the return excluded)."""
    end, stack, seen = -1, [v], set()
    while stack:
        x = stack.pop()
        for u in x.uses:
            o = u.operation
            if o is ret:
                continue
            end = max(end, pos.get(o, n))
            if kind(o) in ALIASING and o not in seen:
                seen.add(o)
                stack.extend(o.results)
    return end


def _aligned(f, k, dom) -> bool:
    """The fused kernel reads its operand ``k`` only through ops whose result has the domain shape."""
    barg = f.regions[0].block.args[k]
    return all(shape_of(u.operation.results[0]) == dom for u in barg.uses if u.operation.name != "blu.yield")


def _prod(s) -> int:
    p = 1
    for x in s:
        p *= x
    return p
