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
    keys with no counterpart; ``crop``: patterns of our keys whose arrays may be larger than the
    reference's (a padded vocabulary) and are compared on the reference's leading slice."""

    rules: list[tuple[str, str]] = field(default_factory=list)
    transforms: list[tuple[str, Callable[[np.ndarray], np.ndarray]]] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    crop: list[str] = field(default_factory=list)

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

    def then(self, other: Adapter) -> Adapter:
        """This adapter followed by ``other`` (rules chained; other's transforms, drops and crops added)."""
        return Adapter(self.rules + other.rules, self.transforms + other.transforms, self.drop,
                       self.crop + other.crop)


#: keys of blumodels.gpt2.GPT2 -> bluprofiler.demo.GPT (nanoGPT names under ``transformer.``)
_TO_DEMO = [(r"^(module|grad):blocks\.", r"\1:transformer.h."),
            (r"^(module|grad):(wte|wpe|ln_f)\b", r"\1:transformer.\2")]


def gpt2_adapter(source: str = "reference", ours: str = "blumodels") -> Adapter:
    """Name adapter from a PyTorch GPT-2 to a BluTrain GPT-2 for :func:`compare`.

    source: ``"reference"`` benchmarks/torch_gpt2.py ``TorchGPT2`` (``blocks.<i>.{c_attn, attn_proj,
    c_fc, mlp_proj}``, forward returns the loss); ``"hf"`` Hugging Face ``GPT2LMHeadModel``
    (``transformer.h.<i>...``, Conv1D weights stored (in, out): their gradients are transposed;
    attention/block tuple extras dropped; ``lm_head`` is our root's logits); ``"nanogpt"`` the HF
    names with nn.Linear (no transposes).
    ours: ``"blumodels"`` (blumodels.gpt2.GPT2: ``wte``, ``blocks.<i>.attn.c_attn`` ..., forward
    returns (logits, loss), vocabulary padded to 64: wte gradients and logits are cropped to the
    reference's vocabulary) or ``"demo"`` (bluprofiler.demo.GPT, nanoGPT names).
    """
    if source == "reference":
        a = Adapter(rules=[(r"\.c_attn\b", ".attn.c_attn"), (r"\.attn_proj\b", ".attn.c_proj"),
                           (r"\.c_fc\b", ".mlp.c_fc"), (r"\.mlp_proj\b", ".mlp.c_proj"),
                           (r"^module:<root>$", "module:<root>.out1")])
    elif source in ("hf", "nanogpt"):
        a = Adapter(rules=[(r"^(module|grad):transformer\.h\.", r"\1:blocks."),
                           (r"^(module|grad):transformer\.", r"\1:"), (r"^module:lm_head$", "module:<root>")],
                    transforms=[(r"^grad:.*\.(c_attn|c_proj|c_fc)\.weight$", np.transpose)] if source == "hf" else [],
                    drop=[r"\.out\d+$"])
    else:
        raise ValueError(f"gpt2_adapter: source must be 'reference', 'hf' or 'nanogpt', got {source!r}")
    a.crop = [r"^grad:(transformer\.)?wte\.weight$", r"^module:<root>$", r"^module:lm_head$"]
    if ours == "demo":
        a = a.then(Adapter(rules=_TO_DEMO))
        if source in ("hf", "nanogpt"):
            a.rules.append((r"^module:<root>$", "module:lm_head"))  # the demo has an lm_head module
    elif ours != "blumodels":
        raise ValueError(f"gpt2_adapter: ours must be 'blumodels' or 'demo', got {ours!r}")
    return a


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
    for name, v in (("rtol", rtol), ("atol", atol)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise PrecisionError(f"compare: {name} must be a number >= 0, got {v!r}")
    if keys is not None:
        try:
            re.compile(keys)
        except (re.error, TypeError) as e:
            raise PrecisionError(f"compare: keys={keys!r} is not a regular expression: {e}") from None
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
    crop = adapter.crop if adapter is not None else []
    for k in common:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        note = ""
        if (x.shape != y.shape and x.ndim == y.ndim and any(re.search(p, k) for p in crop)
                and all(i >= j for i, j in zip(x.shape, y.shape))):
            x = x[tuple(slice(0, n) for n in y.shape)]
            note = f"ours cropped to {tuple(y.shape)}"
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
        rows.append(Row(k, tuple(x.shape), r, li, r <= rtol and li <= atol, note))
    only_ours = [k for k in sel if k not in b]
    only_ref = [k for k in b if k not in a]
    return Comparison(rows, only_ours, only_ref, rtol, atol)


def main(argv: list[str] | None = None) -> int:
    """``python -m bluprofiler.compare OURS REFERENCE [--adapter gpt2:reference] [--rtol 1e-5]``:
    print the comparison of two dump files; exit status 1 when they diverge."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m bluprofiler.compare", description=main.__doc__.split(":")[0])
    p.add_argument("ours")
    p.add_argument("reference")
    p.add_argument("--adapter", default=None,
                   help="gpt2:<reference|hf|nanogpt>[:<blumodels|demo>] (default: keys compared as they are)")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative L2 tolerance (default 1e-5)")
    p.add_argument("--atol", type=float, default=float("inf"), help="L-inf tolerance (default none)")
    p.add_argument("--keys", default=None, help="regex on our keys to compare")
    p.add_argument("--json", default=None, help="also write the comparison as JSON here")
    a = p.parse_args(argv)
    adapter = None
    if a.adapter:
        parts = a.adapter.split(":")
        if parts[0] != "gpt2" or len(parts) not in (2, 3):
            p.error(f"--adapter {a.adapter!r}: expected gpt2:<reference|hf|nanogpt>[:<blumodels|demo>]")
        try:
            adapter = gpt2_adapter(parts[1], *(parts[2:]))
        except ValueError as e:
            p.error(f"--adapter {a.adapter!r}: {e}")
    try:
        r = compare(a.ours, a.reference, adapter=adapter, rtol=a.rtol, atol=a.atol, keys=a.keys)
    except PrecisionError as e:
        p.error(str(e))
    print(r.report(), end="")
    if a.json:
        Path(a.json).write_text(json.dumps(r.to_dict(), indent=1))
    return 0 if r.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
