"""Shared code generation for fused kernels: scalar expressions and index arithmetic.

A :class:`KernelSpec` is one ``blu.fused`` op specialised to the layouts it meets at run time
(shapes, element strides and dtypes of its inputs; scalar constants as literals; host scalars by
value). :func:`emit` renders it with a C or CUDA template from ``templates/``. Shapes and strides
are compile-time constants, so index arithmetic divides by constants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources

import numpy as np

CTYPE = {"float32": "float", "float64": "double", "int64": "blu_i64", "int32": "blu_i32", "bool": "blu_bool"}
_FSUF = {"float": "f", "double": ""}


class Unsupported(Exception):
    """The kernel uses a dtype or op the generators do not cover (it runs through the array library)."""


def ctype(dt) -> str:
    try:
        return CTYPE[np.dtype(dt).name]
    except KeyError:
        raise Unsupported(f"dtype {dt}") from None


@dataclass
class Input:
    mode: str  # "ptr" | "val" (scalar passed by value) | "lit" (compile-time literal)
    dtype: np.dtype
    shape: tuple = ()
    strides: tuple = ()  # in elements
    value: object = None  # literal value (mode "lit")
    weak: bool = False  # a Python scalar (NumPy's weak promotion)


@dataclass
class KOp:
    kind: str
    args: list  # ("in", k) | ("v", j)
    dtype: np.dtype
    attrs: dict = field(default_factory=dict)


@dataclass
class KernelSpec:
    name: str
    kind: str  # "elementwise" | "reduce"
    domain: tuple
    inputs: list[Input]
    ops: list[KOp]
    outputs: list  # refs ("v", j) | ("in", k)
    out_dtypes: list


def template(name: str) -> str:
    return resources.files("blucompiler").joinpath("templates", name).read_text()


def header() -> str:
    return resources.files("blucompiler").joinpath("kernels", "blu_math.cuh").read_text()


def literal(v, dt) -> str:
    t = ctype(dt)
    if np.dtype(dt).kind == "f":
        f = float(v)
        if f != f:
            return f"(({t})BLU_NAN)"
        if f in (float("inf"), float("-inf")):
            return f"(({t})({'-' if f < 0 else ''}BLU_INF))"
        return f"(({t}){f.hex()})"
    if np.dtype(dt).kind == "b":
        return "((blu_bool)1)" if v else "((blu_bool)0)"
    return f"(({t}){int(v)}LL)"


def _contig(shape) -> tuple:
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


def _offset(inp: Input, domain: tuple, coord: list[str], linear: str | None) -> str:
    """Element offset of input ``inp`` at the domain point ``coord`` (``linear``: the flat index)."""
    nd, r = len(domain), len(inp.shape)
    if linear is not None and tuple(inp.shape) == tuple(domain) and tuple(inp.strides) == _contig(domain):
        return linear
    terms = []
    for d in range(r):
        if inp.shape[d] != 1 and inp.strides[d] != 0:
            terms.append(f"{coord[nd - r + d]} * {inp.strides[d]}LL")
    return " + ".join(terms) if terms else "0"


def _coords(domain, dims, flat: str, prefix: str) -> tuple[str, dict]:
    """C statements decomposing ``flat`` over ``dims`` of ``domain`` (row-major)."""
    lines, names = [], {}
    rest = 1
    for d in reversed(dims):
        names[d] = f"{prefix}{d}"
        lines.append(f"      const long long {prefix}{d} = ({flat} / {rest}LL) % {domain[d]}LL;")
        rest *= domain[d]
    return "\n".join(reversed(lines)) + ("\n" if lines else ""), names


def _compute_type(op: KOp, inputs, vals_dt) -> np.dtype:
    if op.kind in ("eq", "ne", "lt", "le", "gt", "ge"):
        strong, weak = [], []
        for a in op.args:
            if a[0] == "in" and inputs[a[1]].weak:
                weak.append(inputs[a[1]].value)
            else:
                strong.append(vals_dt(a))
        return np.result_type(*strong, *weak) if strong else np.result_type(*weak)
    if op.kind in ("not", "and", "or", "xor"):
        return np.dtype(bool)
    if op.kind == "cast":
        return vals_dt(op.args[0])
    return op.dtype


def _expr(op: KOp, a: list[str], ct: str, target: str) -> str:
    k = op.kind
    suf = _FSUF.get(ct)
    binop = {"add": "+", "sub": "-", "mul": "*", "div": "/", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
             "gt": ">", "ge": ">=", "and": "&&", "or": "||", "xor": "!="}
    if k in binop:
        return f"({a[0]} {binop[k]} {a[1]})"
    if k in ("max", "min"):
        return f"blu_{k}_{ct}({a[0]}, {a[1]})"
    if k in ("exp", "log", "tanh", "sqrt", "sin", "cos"):
        if suf is None:
            raise Unsupported(f"{k} on {ct}")
        return f"{k}{suf}({a[0]})"
    if k == "pow":
        if suf is None:
            raise Unsupported(f"pow on {ct}")
        return f"pow{suf}({a[0]}, {a[1]})"
    if k == "abs":
        return f"fabs{suf}({a[0]})" if suf is not None else f"(({a[0]}) < 0 ? -({a[0]}) : ({a[0]}))"
    if k == "sign":
        if suf is None:
            raise Unsupported("sign on integers")
        return f"blu_sign_{ct}({a[0]})"
    if k == "erf":
        if ct == "float" and target == "c":
            return f"((float)erf((double){a[0]}))"  # NumPy path: math.erf in double, then narrowed
        return f"erf{suf}({a[0]})"
    if k == "neg":
        return f"(-{a[0]})"
    if k == "not":
        return f"(!{a[0]})"
    if k == "recip":
        return f"(({ct})1 / {a[0]})"
    if k == "square":
        return f"({a[0]} * {a[0]})"
    if k == "copy":
        return a[0]
    if k == "cast":
        out = ctype(op.dtype)
        if op.dtype == np.bool_:
            return f"((blu_bool)({a[0]} != 0))"
        return f"(({out}){a[0]})"
    if k == "where":
        return f"({a[0]} ? {a[1]} : {a[2]})"
    raise Unsupported(f"op {k}")


def _body(spec: KernelSpec, coord: list[str], linear: str | None, target: str, indent="      "):
    """Loads, op statements; returns (code, names of op values, needs_coords)."""
    lines = []
    loaded: dict[int, str] = {}
    vdt: list = []

    def in_dt(a):
        return spec.inputs[a[1]].dtype if a[0] == "in" else vdt[a[1]]

    def ref(a) -> str:
        if a[0] == "v":
            return f"t{a[1]}"
        k = a[1]
        if k not in loaded:
            inp = spec.inputs[k]
            t = ctype(inp.dtype)
            if inp.mode == "lit":
                loaded[k] = literal(inp.value, inp.dtype)
            elif inp.mode == "val":
                loaded[k] = f"in{k}"
            else:
                lines.append(f"{indent}const {t} l{k} = in{k}[{_offset(inp, spec.domain, coord, linear)}];")
                loaded[k] = f"l{k}"
        return loaded[k]

    for j, op in enumerate(spec.ops):
        if op.kind == "reduce":
            vdt.append(op.dtype)
            continue
        ct = _compute_type(op, spec.inputs, in_dt)
        cts = ctype(ct)
        args = []
        for i, a in enumerate(op.args):
            r = ref(a)
            if op.kind == "where" and i == 0:
                args.append(r)
            elif op.kind == "cast" or in_dt(a) == ct:
                args.append(r)
            else:
                args.append(f"(({cts}){r})")
        lines.append(f"{indent}const {ctype(op.dtype)} t{j} = {_expr(op, args, cts, target)};")
        vdt.append(op.dtype)
    return lines, ref


def cols_plan(spec: KernelSpec):
    """(splits, chunk) when a reduction runs as a CUDA column reduction (reduced axes leading, kept
    axes trailing: consecutive outputs are consecutive in memory), else None."""
    if spec.kind != "reduce":
        return None
    axes = tuple(spec.ops[-1].attrs["axes"])
    if axes != tuple(range(len(axes))) or len(axes) >= len(spec.domain):
        return None
    nred = int(np.prod([spec.domain[d] for d in axes], dtype=np.int64))
    splits = int(min(64, max(1, -(-nred // 128))))
    chunk = -(-nred // splits)
    return splits, int(chunk)


def emit(spec: KernelSpec, target: str) -> str:
    """Source of one kernel (``target`` "c", "cuda", or "c_cols": the C emulation of the CUDA
    column reduction, for tests)."""
    ext = "c" if target in ("c", "c_cols") else "cu"
    if target == "c_cols":
        target = "c"
        cols_emulation = True
    else:
        cols_emulation = False
    params = []
    for k, inp in enumerate(spec.inputs):
        t = ctype(inp.dtype)
        if inp.mode == "ptr":
            params.append(f"const {t}* __restrict__ in{k}")
        elif inp.mode == "val":
            params.append(f"const {t} in{k}")
    for k, dt in enumerate(spec.out_dtypes):
        params.append(f"{ctype(dt)}* __restrict__ out{k}")
    nd = len(spec.domain)
    if spec.kind == "elementwise":
        coords_code, names = _coords(spec.domain, list(range(nd)), "i", "c")
        coord = [names[d] for d in range(nd)]
        lines, ref = _body(spec, coord, "i", target)
        for k, o in enumerate(spec.outputs):
            lines.append(f"      out{k}[i] = {ref(o)};")
        body = "\n".join(lines)
        needs = any(c in body for c in coord)
        return template(f"elementwise.{ext}.tpl").format(
            name=spec.name, domain="x".join(map(str, spec.domain)) or "scalar", params=", ".join(params),
            numel=int(np.prod(spec.domain, dtype=np.int64)), coords=coords_code if needs else "", body=body)
    red = spec.ops[-1]
    axes = tuple(red.attrs["axes"])
    kept = [d for d in range(nd) if d not in axes]
    kc, kn = _coords(spec.domain, kept, "o", "c")
    rc, rn = _coords(spec.domain, list(axes), "r", "c")
    names = {**kn, **rn}
    coord = [names[d] for d in range(nd)]
    lines, ref = _body(spec, coord, None, target)
    src_dt = spec.inputs[red.args[0][1]].dtype if red.args[0][0] == "in" else spec.ops[red.args[0][1]].dtype
    v = ref(red.args[0])
    rk = red.attrs["kind"]
    out_t = ctype(red.dtype)
    nred = int(np.prod([spec.domain[d] for d in axes], dtype=np.int64))
    nout = int(np.prod([spec.domain[d] for d in kept], dtype=np.int64))
    if rk in ("sum", "mean"):
        acc_t = "double" if np.dtype(red.dtype).kind == "f" else "blu_i64"
        init = "0"
        combine, combine_o = f"acc += ({acc_t}){v};", "acc += other;"
        if rk == "mean":
            finalize = f"(({out_t})(({out_t})acc / ({out_t}){nred}))"
        else:
            finalize = f"(({out_t})acc)"
    elif rk in ("max", "min"):
        acc_t = ctype(src_dt)
        if np.dtype(src_dt).kind == "f":
            init = f"(({acc_t})({'-' if rk == 'max' else ''}BLU_INF))"
        elif np.dtype(src_dt).kind == "b":
            acc_t = "blu_i32"  # warp shuffles have no 1-byte overload
            init = "0" if rk == "max" else "1"
        else:
            init = "(-9223372036854775807LL - 1)" if rk == "max" else "9223372036854775807LL"
        combine = f"acc = blu_{rk}_{acc_t}(acc, ({acc_t}){v});"
        combine_o = f"acc = blu_{rk}_{acc_t}(acc, other);"
        finalize = f"(({out_t})acc)"
    else:
        raise Unsupported(f"reduction {rk}")
    body = "\n".join(lines)
    fields = dict(name=spec.name, domain="x".join(map(str, spec.domain)), kind=rk, axes=list(axes),
                  params=", ".join(params), nout=nout, nred=nred, acc_t=acc_t, init=init, coords=kc + rc, body=body,
                  combine=combine, combine_other=combine_o, finalize=finalize, out_t=out_t)
    plan = cols_plan(spec)
    if plan is not None and (ext == "cu" or cols_emulation):
        splits, chunk = plan
        fields.update(splits=splits, chunk=chunk)
        if cols_emulation:
            return template("reduce_cols.c.tpl").format(**fields)
        if splits == 1:
            fields.update(part_param="", store=f"out0[o] = {finalize};", fin="")
        else:
            fields.update(part_param=f", {acc_t}* __restrict__ part",
                          store=f"part[(long long)blockIdx.y * {nout}LL + o] = acc;",
                          fin=template("reduce_cols_fin.cu.tpl").format(**fields))
        return template("reduce_cols.cu.tpl").format(**fields)
    return template(f"reduce.{ext}.tpl").format(**fields)


def translation_unit(sources: list[str], target: str) -> str:
    pre = header()
    if target == "c":
        pre = "#include <math.h>\n#define __restrict__ restrict\n" + pre
    return pre + "\n" + "\n".join(sources)
