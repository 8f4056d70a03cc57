"""blu-cse: common-subexpression elimination of pure ops (same kind, operands, attributes, type)."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.passes import ModulePass

from blucompiler.passes.common import PURE, body, kind, replace


@dataclass(frozen=True)
class CSEPass(ModulePass):
    name = "blu-cse"

    def apply(self, ctx, op) -> None:
        seen: dict = {}
        for o in list(body(op).ops):
            k = kind(o)
            if k not in PURE or len(o.results) != 1:
                continue
            key = (k, tuple(id(v) for v in o.operands), tuple(sorted((n, str(a)) for n, a in o.attributes.items())),
                   str(o.results[0].type))
            prev = seen.get(key)
            if prev is None:
                seen[key] = o
            else:
                replace(o, prev.results[0])
