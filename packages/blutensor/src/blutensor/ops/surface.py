"""The public surface of an op-table row: its ``blutensor.functional`` function(s), Tensor method(s), in-place
variant and operator methods, generated at import from the row's :class:`Api`.

A row's ``api=api("a, b:s, alpha?=1", ...)`` describes the Python signature and how each parameter reaches
:func:`blutensor.ops.dispatch.apply`. The generated functions are plain Python functions compiled from source
(real ``inspect.signature``, ``__name__``, ``__qualname__``, ``__doc__``, ``__module__``), with the same body a
hand-written wrapper would have, so a call costs what the hand-written one did.

Signature language (parameters separated by commas, in the order of the Python signature):

``x``
    a Tensor input, passed to the op positionally (inputs keep their order);
``x:s``
    an operand that may be a Tensor or a Python number (numbers are normalised as the operators do);
``x:t=None``
    an optional Tensor input (None is passed on as None);
``x:T``
    a Tensor input, anything else raises DTypeError naming it;
``x:idx``
    an integer index Tensor (gather, index_select, ...): anything else raises DTypeError naming it;
``x=default`` / ``x:a``
    an op attribute (passed as ``x=x``), with or without a default;
``x:i`` / ``x:i=default``
    an integer attribute (a dim): a non-int raises DTypeError (None passes when it is the default);
``x:f=default``
    a real-number attribute, passed as float;
``x:b=default``
    a flag, passed as ``bool(x)``;
``inplace:inplace=False``
    ``torch.nn.functional``'s ``inplace`` flag of activations: not passed to the op; when true and neither the
    input nor the result needs a gradient, the result is written into the input, which is returned;
``x?=default``
    any of the above, left out of the op call while it equals its default (one per row; the kernel's own
    default then applies, and the common call passes no keyword);
``*``
    the following parameters are keyword-only.

Defaults are Python literals without commas (numbers, strings, True/False/None).

``floating=True`` makes the generated function raise DTypeError unless its first argument is a floating-point
Tensor (ops whose integer result would be silently wrong or truncated).
"""

from __future__ import annotations

import keyword
import linecache
import numbers
from dataclasses import dataclass

from blutensor.errors import ArgumentError, DTypeError
from blutensor.ops.dispatch import apply

_KINDS = ("", "s", "t", "T", "idx", "a", "i", "f", "b", "inplace")
_INPUT_KINDS = ("", "s", "t", "T", "idx")
_ANNOTATION = {"": "Tensor", "s": "Tensor | float", "t": "Tensor | None", "T": "Tensor", "idx": "Tensor",
               "i": "int", "f": "float", "b": "bool", "inplace": "bool"}


@dataclass(frozen=True)
class Param:
    """One parameter of a generated signature."""

    name: str
    kind: str  # one of _KINDS
    has_default: bool
    default: object
    kwonly: bool
    omit_default: bool  # left out of the op call while equal to its default

    @property
    def is_input(self) -> bool:
        return self.kind in _INPUT_KINDS and not (self.kind == "" and self.has_default)


@dataclass(frozen=True)
class Api:
    """The public surface of one op: what :func:`api` builds; see the module docstring."""

    params: tuple[Param, ...]
    doc: str = ""
    functional: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    inplace: tuple[str, ...] = ()
    operators: tuple[str, ...] = ()
    reflected: tuple[str, ...] = ()
    floating: bool = False


def _literal(text: str, where: str):
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ArgumentError(f"{where}: default {text!r} is not a Python literal") from None


def parse_signature(sig: str, where: str = "api") -> tuple[Param, ...]:
    """The parameters of signature text ``sig`` (see the module docstring)."""
    params: list[Param] = []
    kwonly = False
    for raw in (p.strip() for p in sig.split(",")):
        if not raw:
            raise ArgumentError(f"{where}: empty parameter in signature {sig!r}")
        if raw == "*":
            if kwonly:
                raise ArgumentError(f"{where}: '*' given twice in signature {sig!r}")
            kwonly = True
            continue
        head, eq, default_text = raw.partition("=")
        head = head.strip()
        omit = head.endswith("?")
        head = head.rstrip("?")
        name, _, kind = (s.strip() for s in head.partition(":"))
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ArgumentError(f"{where}: parameter {name!r} of signature {sig!r} is not a Python identifier")
        if kind not in _KINDS:
            raise ArgumentError(f"{where}: parameter {name!r} has unknown kind {kind!r} (one of "
                                f"{', '.join(repr(k) for k in _KINDS)})")
        if any(p.name == name for p in params):
            raise ArgumentError(f"{where}: parameter {name!r} appears twice in signature {sig!r}")
        has_default = bool(eq)
        default = _literal(default_text.strip(), where) if has_default else None
        if omit and not has_default:
            raise ArgumentError(f"{where}: parameter {name!r} is marked '?' (left out at its default) but has "
                                f"no default")
        if not has_default and not kwonly and params and params[-1].has_default and not params[-1].kwonly:
            raise ArgumentError(f"{where}: parameter {name!r} without a default follows one with a default")
        params.append(Param(name, kind, has_default, default, kwonly, omit))
    if sum(p.omit_default for p in params) > 1:
        raise ArgumentError(f"{where}: at most one parameter may be marked '?', got signature {sig!r}")
    if sum(p.kind == "inplace" for p in params) > (0 if any(p.omit_default for p in params) else 1):
        raise ArgumentError(f"{where}: one 'inplace' parameter at most, and not together with a '?' one")
    if not params or not params[0].is_input or params[0].kind not in ("", "T"):
        raise ArgumentError(f"{where}: the first parameter of {sig!r} must be a Tensor input (it is the "
                            f"tensor a method is called on)")
    return tuple(params)


def api(sig: str, doc: str = "", *, functional: bool | str | tuple[str, ...] = True,
        method: bool | str | tuple[str, ...] = False, inplace: bool | str = False,
        operators: tuple[str, ...] = (), reflected: tuple[str, ...] = (), floating: bool = False) -> Api:
    """The public surface of an op-table row.

    ``sig`` the Python signature (module docstring); ``doc`` the docstring of the generated functions;
    ``functional`` True (the op's name), a name or names in ``blutensor.functional``, or False;
    ``method`` likewise for Tensor methods; ``inplace`` True (``<method>_``) or the in-place method's name;
    ``operators`` operator methods ``op(self, other)`` (``"__add__"``) and ``reflected`` ones ``op(other,
    self)`` (``"__rtruediv__"``), for unary or binary ops; ``floating`` refuse non-floating first arguments.
    The op's name fills the default names when the row is recorded (:func:`attach`)."""
    params = parse_signature(sig, f"api({sig!r})")

    def names(v):
        if v is True:
            return ("",)
        if not v:
            return ()
        return (v,) if isinstance(v, str) else tuple(v)

    fn = names(functional)
    meth = names(method)
    if inplace is True:
        inp = ("",)
    elif inplace:
        inp = (inplace,)
    else:
        inp = ()
    if operators or reflected:
        req = [p for p in params if not p.has_default]
        if len(req) > 2 or req != list(params[:len(req)]) or (len(req) == 2 and req[1].kind != "s"):
            raise ArgumentError(f"api({sig!r}): operator methods need a unary 'x' or binary 'x, y:s' signature "
                                f"(further parameters with defaults, which operators leave at them)")
    return Api(params, doc, fn, meth, inp, tuple(operators), tuple(reflected), floating)


def attach(a: Api, op: str) -> Api:
    """``a`` with its default names ("" placeholders) resolved to op name ``op``."""
    fn = tuple(n or op for n in a.functional)
    meth = tuple(n or op for n in a.methods)
    base = meth[0] if meth else (fn[0] if fn else op)
    inp = tuple(n or f"{base}_" for n in a.inplace)
    for n in fn + meth + inp + a.operators + a.reflected:
        if not n.isidentifier():
            raise ArgumentError(f"op {op!r}: public name {n!r} is not a Python identifier")
    return Api(a.params, a.doc, fn, meth, inp, a.operators, a.reflected, a.floating)


# ---- argument checks the generated code calls (each names the op and the argument at fault) ----


def require_floating(a, op: str) -> None:
    """Raise unless ``a`` is a floating-point Tensor (ops whose integer result would be wrong or truncated)."""
    dt = getattr(a, "dtype", None)
    if not getattr(dt, "is_floating_point", False):
        got = a._desc() if hasattr(a, "_desc") else type(a).__name__
        raise DTypeError(f"{op}: needs a floating-point tensor, got {got} (convert with .float())")


def index_tensor(op: str, index, name: str = "index"):
    """``index`` when it is an integer Tensor, else DTypeError naming ``op`` and ``name``."""
    if not isinstance(index, _NS["Tensor"]) or index.dtype.is_floating_point or index.dtype.name == "bool":
        got = index._desc() if isinstance(index, _NS["Tensor"]) else type(index).__name__
        raise DTypeError(f"{op}: {name} must be an integer Tensor (int64), got {got}")
    return index


def int_arg(op: str, name: str, v) -> int:
    """``v`` as an int (a dim), else DTypeError naming ``op`` and ``name``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise DTypeError(f"{op}: {name} must be an int, got {type(v).__name__} {v!r}")
    return int(v)


def real_arg(op: str, name: str, v) -> float:
    """``v`` as a float, else DTypeError naming ``op`` and ``name``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise DTypeError(f"{op}: {name} must be a number, got {type(v).__name__} {v!r}")
    return float(v)


def tensor_arg(op: str, name: str, v):
    """``v`` when it is a Tensor, else DTypeError naming ``op`` and ``name``."""
    if not isinstance(v, _NS["Tensor"]):
        raise DTypeError(f"{op}: {name} must be a Tensor, got {type(v).__name__}")
    return v


def inplace_result(x, out, inplace):
    """``out``, or ``x`` with ``out`` written into it when ``inplace`` and neither needs a gradient (the
    ``inplace=True`` of ``torch.nn.functional``'s activations)."""
    if inplace and not x.requires_grad and not out.requires_grad:
        x._data[...] = out._data
        x._version.v += 1
        return x
    return out


def _inplace_unbound(self, name, fn, *args, **kwargs):
    raise RuntimeError("blutensor._tensor has not bound the in-place helper yet")


#: the globals of every generated function: ``Tensor``, ``_scalar`` and ``_inplace`` are bound by
#: ``blutensor._tensor`` once the Tensor class exists (before any generated function can be called)
_NS: dict = {
    "__name__": "blutensor.ops.surface", "apply": apply, "Tensor": None, "_scalar": None,
    "_inplace": _inplace_unbound, "_floating": require_floating, "_index": index_tensor, "_int": int_arg,
    "_real": real_arg, "_tensor": tensor_arg, "_done": inplace_result,
}


def bind(**names) -> None:
    """Give the generated functions the Tensor class, the scalar normaliser and the in-place helper."""
    unknown = set(names) - {"Tensor", "_scalar", "_inplace"}
    if unknown:
        raise ArgumentError(f"surface.bind: unknown names {sorted(unknown)}")
    _NS.update(names)


def _arg_expr(p: Param, op: str, first: str) -> str:
    """The expression that passes parameter ``p`` (named ``first`` when it is the first) to ``apply``."""
    v = first or p.name
    if p.kind == "s":
        return f"{v} if isinstance({v}, Tensor) else _scalar({v})"
    if p.kind == "T":
        return f"_tensor({op!r}, {p.name!r}, {v})"
    if p.kind == "idx":
        return f"_index({op!r}, {v}, {p.name!r})"
    if p.kind == "i":
        if p.has_default and p.default is None:
            return f"None if {v} is None else _int({op!r}, {p.name!r}, {v})"
        return f"_int({op!r}, {p.name!r}, {v})"
    if p.kind == "f":
        return f"_real({op!r}, {p.name!r}, {v})"
    if p.kind == "b":
        return f"bool({v})"
    return v


def _source(pyname: str, op: str, a: Api, self_name: str | None, defaults: list) -> str:
    """Source text of one generated function (``self_name``: the first parameter's name in a method)."""
    sig, call_in, call_attr = [], [], []
    star = False
    omit = done = None
    for i, p in enumerate(a.params):
        pname = self_name if (i == 0 and self_name) else p.name
        if p.kwonly and not star:
            sig.append("*")
            star = True
        if p.has_default:
            defaults.append(p.default)
            sig.append(f"{pname}=_d{len(defaults) - 1}")
        else:
            sig.append(pname)
        expr = _arg_expr(p, pyname, pname if pname != p.name else "")
        if p.kind == "inplace":
            done = pname
        elif p.is_input:
            call_in.append(expr)
        else:
            call_attr.append(f"{p.name}={expr}")
        if p.omit_default:
            omit = (p, pname, len(defaults) - 1)
    first = self_name or a.params[0].name
    body = []
    if a.floating:
        body.append(f"_floating({first}, {pyname!r})")

    def call(skip: str | None) -> str:
        ins = [e for e, p in zip(call_in, [p for p in a.params if p.is_input])
               if not (skip is not None and p.name == skip)]
        ats = [e for e in call_attr if skip is None or not e.startswith(f"{skip}=")]
        return f"apply({op!r}, " + ", ".join(ins + ats) + ")"

    if omit is not None:
        p, pname, di = omit
        if p.default is None:
            test = f"{pname} is not None"
        elif type(p.default) in (bool, int, str) or (type(p.default) is float and p.default == p.default):
            test = f"{pname} != {p.default!r}"  # a literal, as a hand-written wrapper has it
        else:
            test = f"{pname} != _d{di}"
        body.append(f"if {test}:\n        return {call(None)}")
        body.append(f"return {call(p.name)}")
    elif done is not None:
        body.append(f"if {done}:\n        return _done({first}, {call(None)}, True)")
        body.append(f"return {call(None)}")
    else:
        body.append(f"return {call(None)}")
    return f"def {pyname}(" + ", ".join(sig) + "):\n    " + "\n    ".join(body) + "\n"


def _compile(src: str, pyname: str, defaults: list, cells: dict | None = None, qualname: str = ""):
    """Compile ``src`` (one ``def``) with defaults ``_d0, _d1, ...`` and closure values ``cells``; the source is
    registered with ``linecache`` so that tracebacks and ``inspect.getsource`` show the generated lines."""
    free = list(cells or {})
    args = [f"_d{i}" for i in range(len(defaults))] + free
    wrapper = f"def _make({', '.join(args)}):\n" + "".join(f"    {ln}\n" for ln in src.splitlines()) + \
        f"    return {pyname}\n"
    filename = f"<blutensor op table: {qualname or pyname}>"
    linecache.cache[filename] = (len(wrapper), None, wrapper.splitlines(True), filename)
    code = compile(wrapper, filename, "exec")
    scope: dict = {}
    exec(code, _NS, scope)  # noqa: S102 - source built from the op table's validated signatures
    return scope["_make"](*defaults, *(cells or {}).values())


def _finish(fn, pyname: str, qualname: str, module: str, doc: str, a: Api, self_name: str | None):
    fn.__name__ = pyname
    fn.__qualname__ = qualname
    fn.__module__ = module
    fn.__doc__ = doc or None
    ann = {}
    for i, p in enumerate(a.params):
        if i == 0 and self_name:
            continue
        hint = _ANNOTATION.get(p.kind)
        if p.kind in ("", "a") and p.has_default and not p.is_input:
            hint = type(p.default).__name__ if isinstance(p.default, bool | int | float | str) else None
            if p.default is None:
                hint = None
        if hint:
            ann[p.name] = hint
    ann["return"] = "Tensor"
    fn.__annotations__ = ann
    return fn


def functional(op: str, a: Api) -> dict:
    """``{name: function}`` of op ``op``'s ``blutensor.functional`` entries."""
    out = {}
    for pyname in a.functional:
        defaults: list = []
        src = _source(pyname, op, a, None, defaults)
        fn = _compile(src, pyname, defaults, qualname=f"functional.{pyname}")
        out[pyname] = _finish(fn, pyname, pyname, "blutensor.functional", a.doc, a, None)
    return out


def methods(op: str, a: Api, fns: dict) -> dict:
    """``{name: function}`` of op ``op``'s Tensor methods (plain, in-place and operators); ``fns`` the
    functional entries the in-place variants run (from :func:`functional`, or generated here)."""
    out = {}
    for pyname in a.methods:
        defaults: list = []
        src = _source(pyname, op, a, "self", defaults)
        fn = _compile(src, pyname, defaults, qualname=f"Tensor.{pyname}")
        out[pyname] = _finish(fn, pyname, f"Tensor.{pyname}", "blutensor._tensor", a.doc, a, "self")
    if a.inplace:
        base = fns.get(a.functional[0]) if a.functional else None
        if base is None:  # an in-place variant of an op without a functional entry
            defaults = []
            base = _compile(_source(op, op, a, None, defaults), op, defaults, qualname=f"{op} (in place)")
        for pyname in a.inplace:
            sig, call, defaults = ["self"], [], []
            star = False
            for p in a.params[1:]:
                if p.kwonly and not star:
                    sig.append("*")
                    star = True
                if p.has_default:
                    defaults.append(p.default)
                    sig.append(f"{p.name}=_d{len(defaults) - 1}")
                else:
                    sig.append(p.name)
                call.append(f"{p.name}={p.name}" if p.kwonly else p.name)
            src = (f"def {pyname}(" + ", ".join(sig) + "):\n    return _inplace(self, " + repr(pyname)
                   + ", _fn" + "".join(f", {c}" for c in call) + ")\n")
            fn = _compile(src, pyname, defaults, {"_fn": base}, qualname=f"Tensor.{pyname}")
            doc = f"In-place ``{base.__name__}``: the result is written into this tensor."
            out[pyname] = _finish(fn, pyname, f"Tensor.{pyname}", "blutensor._tensor", doc, a, "self")
    unary = sum(not p.has_default for p in a.params) == 1
    for pyname, reflected in [(n, False) for n in a.operators] + [(n, True) for n in a.reflected]:
        if unary:
            src = f"def {pyname}(self):\n    return apply({op!r}, self)\n"
        elif reflected:
            src = f"def {pyname}(self, other):\n    return apply({op!r}, _scalar(other), self)\n"
        else:
            src = (f"def {pyname}(self, other):\n    return apply({op!r}, self, other if isinstance(other, Tensor) "
                   f"else _scalar(other))\n")
        fn = _compile(src, pyname, [], qualname=f"Tensor.{pyname}")
        out[pyname] = _finish(fn, pyname, f"Tensor.{pyname}", "blutensor._tensor", a.doc, a, "self")
    return out


def generate(apis: dict) -> tuple[dict, dict]:
    """(functional ``{name: function}``, Tensor ``{name: function}``) of every op in ``apis`` (op -> Api);
    a name claimed by two ops raises ArgumentError."""
    fns: dict = {}
    meths: dict = {}
    owner: dict = {}
    for op, a in apis.items():
        f = functional(op, a)
        m = methods(op, a, f)
        for kind, got, into in (("functional", f, fns), ("Tensor", m, meths)):
            for n, fn in got.items():
                if n in into:
                    raise ArgumentError(f"op {op!r}: {kind} name {n!r} is already generated for op {owner[kind, n]!r}")
                owner[kind, n] = op
                into[n] = fn
    return fns, meths
