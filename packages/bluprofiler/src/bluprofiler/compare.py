"""Compare two precision dumps: per-tensor relative L2 and L-infinity differences, first divergence.

``compare(ours, reference, adapter=None)``: rows follow ``ours``' recording order (forward outputs in
execution order, then gradients), so the first row over tolerance is where the runs first part.
An :class:`Adapter` renames the reference's keys to ours (PyTorch module names -> BluTrain's) and
may transform arrays (e.g. transpose a Conv1D weight gradient).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bluprofiler.precision import PrecisionError, load_dump


@dataclass
class Adapter:
    """Maps reference keys to ours: regex ``rules`` [(pattern, replacement)] applied in order, each
    to the result of the previous (keys no rule matches pass unchanged); ``transforms``
    [(pattern on OUR key, fn(array))], the first match applies; ``drop``: patterns of reference
    keys with no counterpart."""

    rules: list[tuple[str, str]] = field(default_factory=list)
    transforms: list[tuple[str, Callable[[np.ndarray], np.ndarray]]] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)

    def map_key(self, key: str) -> str | None:
        if any(re.search(p, key) for p in self.drop):
            return None
        for pat, rep in self.rules:
            key = re.sub(pat, rep, key)
        return key

    def apply(self, dump: dict) -> dict:
        """The reference dump under our names, transformed."""
        out = {}
        for k, v in dump.items():
            nk = self.map_key(k)
            if nk is None:
                continue
            for pat, fn in self.transforms:
                if re.search(pat, nk):
                    v = fn(v)
                    break
            out[nk] = v
        return out


def gpt2_adapter(conv1d: bool = True) -> Adapter:
    """PyTorch GPT-2 (Hugging Face ``GPT2LMHeadModel`` names) -> BluTrain GPT-2 (nanoGPT-style names:
    ``transformer.wte``, ``transformer.h.<i>.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}``,
    ``transformer.ln_f``, ``lm_head``). Names agree; HF's Conv1D stores weights (in, out) where a
    Linear stores (out, in), so with ``conv1d`` their weight gradients are transposed. Attention
    and block modules return tuples in HF: their extra outputs (``.out<i>``) are dropped."""
    return Adapter(
        rules=[(r"^(module|grad):(model\.)?", r"\1:")],
        transforms=[(r"^grad:.*\.(c_attn|c_proj|c_fc)\.weight$", np.transpose)] if conv1d else [],
        drop=[r"\.out\d+$"],
    )


@dataclass
class Row:
    key: str
    shape: tuple
    rel_l2: float
    linf: float
    ok: bool
    note: str = ""


@dataclass
class Comparison:
    """Result of :func:`compare`: rows, keys missing on either side, and the first divergence."""

    rows: list[Row]
    only_ours: list[str]
    only_reference: list[str]
    rtol: float
    atol: float

    @property
    def first_divergence(self) -> Row | None:
        return next((r for r in self.rows if not r.ok), None)

    @property
    def ok(self) -> bool:
        return self.first_divergence is None

    def worst(self, n: int = 5) -> list[Row]:
        return sorted(self.rows, key=lambda r: -r.rel_l2)[:n]

    def report(self, max_rows: int | None = None) -> str:
        """A text table; the first divergent row is marked ``>>>``, later divergent ones ``!``."""
        first = self.first_divergence
        w = max([len("key")] + [len(r.key) for r in self.rows])
        lines = [f"    {'key':<{w}}  {'shape':<18} {'rel L2':>10} {'L-inf':>10}  status",
                 "-" * (w + 54)]
        rows = self.rows if max_rows is None else self.rows[:max_rows]
        for r in rows:
            mark = ">>>" if r is first else (" ! " if not r.ok else "   ")
            lines.append(f"{mark} {r.key:<{w}}  {str(r.shape):<18} {r.rel_l2:>10.3e} {r.linf:>10.3e}  "
                         f"{'ok' if r.ok else 'DIVERGES'}{(' ' + r.note) if r.note else ''}")
        if max_rows is not None and len(self.rows) > max_rows:
            lines.append(f"... {len(self.rows) - max_rows} more rows")
        n_bad = sum(not r.ok for r in self.rows)
        lines.append(f"{len(self.rows)} tensors compared (rel L2 tolerance {self.rtol:g}, L-inf {self.atol:g}): "
                     f"{n_bad} diverge")
        if first is not None:
            lines.append(f"first divergence: {first.key} (rel L2 {first.rel_l2:.3e}, L-inf {first.linf:.3e})")
        if self.only_ours:
            lines.append(f"only in ours ({len(self.only_ours)}): {', '.join(self.only_ours[:8])}"
                         + (" ..." if len(self.only_ours) > 8 else ""))
        if self.only_reference:
            lines.append(f"only in the reference ({len(self.only_reference)}): "
                         f"{', '.join(self.only_reference[:8])}" + (" ..." if len(self.only_reference) > 8 else ""))
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict:
        f = self.first_divergence
        return {"ok": self.ok, "rtol": self.rtol, "atol": self.atol,
                "first_divergence": f.key if f is not None else None,
                "rows": [{"key": r.key, "shape": list(r.shape), "rel_l2": r.rel_l2, "linf": r.linf, "ok": r.ok,
                          "note": r.note} for r in self.rows],
                "only_ours": self.only_ours, "only_reference": self.only_reference}


def _as_dump(d: Any, what: str) -> dict:
    if isinstance(d, str | Path):
        return load_dump(d)
    if hasattr(d, "tensors"):
        return d.tensors
    if isinstance(d, dict):
        return d
    raise PrecisionError(f"compare: {what} must be a dump path, a logger or a dict of arrays, got {type(d).__name__}")


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b||_2 / ||b||_2 in float64 (absolute when ||b|| is 0)."""
    a64, b64 = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
    d = float(np.linalg.norm((a64 - b64).ravel()))
    n = float(np.linalg.norm(b64.ravel()))
    return d / n if n > 0 else d


def compare(ours: Any, reference: Any, adapter: Adapter | None = None, rtol: float = 1e-5,
            atol: float = float("inf"), keys: str | None = None) -> Comparison:
    """Per-tensor rel L2 and L-inf of ``ours`` against ``reference`` (paths, loggers or dicts).

    A row diverges when rel L2 > ``rtol`` or L-inf > ``atol``; a shape mismatch or a non-finite
    value is a divergence. ``keys``: a regex restricting which of our keys are compared.
    """
    a = _as_dump(ours, "ours")
    b = _as_dump(reference, "reference")
    if adapter is not None:
        b = adapter.apply(b)
    sel = [k for k in a if keys is None or re.search(keys, k)]
    common = [k for k in sel if k in b]
    if not common:
        raise PrecisionError(f"compare: no common keys (ours: {list(a)[:5]}..., reference: {list(b)[:5]}...); "
                             f"is an adapter needed?")
    rows = []
    for k in common:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        if x.shape != y.shape:
            if x.size == y.size and x.squeeze().shape == y.squeeze().shape:
                y = y.reshape(x.shape)
            else:
                rows.append(Row(k, tuple(x.shape), float("inf"), float("inf"), False,
                                f"shape {tuple(x.shape)} vs reference {tuple(y.shape)}"))
                continue
        if x.dtype.kind in "biu" and y.dtype.kind in "biu":
            diff = int(np.count_nonzero(x != y))
            rows.append(Row(k, tuple(x.shape), float(diff), float(diff), diff == 0, "integer" if diff == 0 else
                            f"{diff} integer values differ"))
            continue
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
            same_nan = bool(np.array_equal(np.isfinite(x), np.isfinite(y)))
            fin = np.isfinite(x) & np.isfinite(y)
            r = rel_l2(x[fin], y[fin]) if fin.any() else 0.0
            li = float(np.max(np.abs(x[fin].astype(np.float64) - y[fin]))) if fin.any() else 0.0
            rows.append(Row(k, tuple(x.shape), r, li, False, "non-finite values" + ("" if same_nan else
                            " (at different places)")))
            continue
        r = rel_l2(x, y)
        li = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.size else 0.0
        rows.append(Row(k, tuple(x.shape), r, li, r <= rtol and li <= atol))
    only_ours = [k for k in sel if k not in b]
    only_ref = [k for k in b if k not in a]
    return Comparison(rows, only_ours, only_ref, rtol, atol)
