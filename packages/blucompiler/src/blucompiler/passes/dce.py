"""blu-dce: dead-code elimination (ops whose results nobody uses; eager replays included)."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.passes import ModulePass

from blucompiler.passes.common import _erase, body, kind


@dataclass(frozen=True)
class DCEPass(ModulePass):
    name = "blu-dce"

    def apply(self, ctx, op) -> None:
        for o in reversed(list(body(op).ops)):
            if kind(o) and all(r.uses.get_length() == 0 for r in o.results):
                _erase(o)
