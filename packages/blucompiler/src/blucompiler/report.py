"""What the compiler did: traces and retraces, eager fallbacks, kernel counts, buffer plan."""

from __future__ import annotations

from collections import Counter

from blucompiler.dialect import attrs_of


def build_report(step) -> dict:
    """A JSON-able summary of a :class:`CompiledStep`."""
    progs = [p for p in step.cache.values() if p != "eager"]
    rep = {
        "specialisations": len(progs),
        "retraces": list(step.retraces),
        "eager_steps": list(step.eager_reasons.values()),
        "trace_seconds": [round(s, 4) for s in step.trace_seconds],
    }
    if getattr(step, "backend_note", None):
        rep["backend_note"] = step.backend_note
    p = step.last
    if p is None:
        return rep
    rt = p.runtime
    fb = Counter(op for op, _ in p.sess.tr.fallbacks)
    reasons = {}
    for op, why in p.sess.tr.fallbacks:
        reasons.setdefault(op, why)
    plan = {}
    for o in p.mod.body.block.ops:
        if o.name == "func.func" and "blu.buffer_plan" in o.attributes:
            plan = {k: attrs_of_value(v) for k, v in o.attributes["blu.buffer_plan"].data.items()}
    matmuls = []
    for o in p.mod.walk():
        if o.name == "blu.matmul":
            a = attrs_of(o)
            keys = ("m", "n", "k", "batch", "intensity", "class", "provider", "epilogue")
            matmuls.append({k: a.get(k) for k in keys})
    rep.update({
        "backend": rt.backend,
        "fallback_ops": dict(fb),
        "fallback_reasons": reasons,
        "kernels": {
            "eager_primitive_ops": p.sess.tr.primitives,
            "compiled_launches": rt.launches,
            "fused_kernels": rt.counts["fused"],
            "generated_kernels": sum(fk.fn is not None for fk in rt.kernels),
            "library_calls": rt.counts["library"],
            "eager_calls": rt.counts["eager"],
            "not_generated": {fk.name: fk.unsupported for fk in rt.kernels if fk.unsupported},
            "compile_error": rt.compile_error,
        },
        "matmuls": Counter(m["class"] for m in matmuls),
        "matmuls_with_epilogue": sum(1 for m in matmuls if m.get("epilogue")),
        "buffer_plan": plan,
        "passes": p.stats,
        "cuda_graph": p.graph.info() if p.graph is not None else None,
        "calls": p.calls,
    })
    return rep


def attrs_of_value(a):
    from blucompiler.dialect import from_attr

    return from_attr(a)


def format_report(rep: dict) -> str:
    k = rep.get("kernels", {})
    lines = [f"blucompiler: {rep.get('specialisations', 0)} specialisation(s), backend {rep.get('backend')}",
             f"  kernels: {k.get('compiled_launches')} launches compiled vs {k.get('eager_primitive_ops')} eager ops "
             f"({k.get('fused_kernels')} fused, {k.get('library_calls')} library, {k.get('eager_calls')} eager)"]
    if rep.get("backend_note"):
        lines.append(f"  backend: {rep['backend_note']}")
    if rep.get("fallback_ops"):
        lines.append(f"  eager fallbacks: {rep['fallback_ops']}")
    for r in rep.get("retraces", []):
        lines.append(f"  retrace: {r}")
    for r in rep.get("eager_steps", []):
        lines.append(f"  step ran eagerly: {r}")
    return "\n".join(lines)
