"""Each package stands alone: its own pyproject, version file, README, CHANGELOG, tests; the allowed
import graph (docs/design.md, section 2) holds, for every package's dev/ tools too; other packages reach
blutensor only through its documented modules and blutensor.ext; CUDA dependencies are extras only."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["blutensor", "blublas", "bluallocator", "dtms", "blucompiler", "bluprofiler", "blumodels"]
# who may import whom (runtime, at module level or lazily)
ALLOWED = {
    "blutensor": set(),
    "blublas": set(),
    "bluallocator": set(),
    "dtms": {"blutensor"},
    "blucompiler": {"blutensor"},
    "bluprofiler": {"blutensor"},
    "blumodels": {"blutensor", "dtms", "blucompiler", "bluprofiler", "bluallocator", "blublas"},
}


def _pyproject(pkg):
    return tomllib.loads((ROOT / "packages" / pkg / "pyproject.toml").read_text())


@pytest.mark.parametrize("pkg", PACKAGES)
def test_layout(pkg):
    d = ROOT / "packages" / pkg
    for f in ("pyproject.toml", "README.md", "CHANGELOG.md", f"src/{pkg}/__about__.py", f"src/{pkg}/__init__.py"):
        assert (d / f).is_file(), f"{pkg}: missing {f}"
    assert (d / "tests").is_dir()
    meta = _pyproject(pkg)
    assert meta["build-system"]["build-backend"] == "hatchling.build"
    assert meta["tool"]["hatch"]["version"]["path"] == f"src/{pkg}/__about__.py"
    assert re.match(r'__version__ = "\d+\.\d+\.\d+"', (d / f"src/{pkg}/__about__.py").read_text())
    eps = meta["project"]["entry-points"]["blutrain"]
    assert eps == {pkg: f"{pkg}.hooks"}, f"{pkg} must register through its own hooks module"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_dependencies(pkg):
    meta = _pyproject(pkg)["project"]
    deps = " ".join(meta["dependencies"])
    assert "cupy" not in deps and "nccl" not in deps, f"{pkg}: CUDA packages must be extras"
    assert "torch" not in deps, f"{pkg}: PyTorch is a test-only dependency"
    internal = {d.split(">")[0].split("<")[0].split("=")[0].strip('"') for d in meta["dependencies"]} & set(PACKAGES)
    assert internal <= ALLOWED[pkg], f"{pkg} depends on {internal - ALLOWED[pkg]}"
    for d in meta["dependencies"]:
        if d.split(">")[0].split("<")[0] in PACKAGES:
            assert "<" in d and ">=" in d, f"{pkg}: internal dependency {d!r} needs a version range"
    if pkg in ("blublas", "bluallocator"):
        assert not internal


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_follow_the_graph(pkg):
    src = ROOT / "packages" / pkg / "src" / pkg
    bad = []
    for f in src.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                top = n.split(".")[0]
                if top in PACKAGES and top != pkg and top not in ALLOWED[pkg]:
                    bad.append(f"{f.relative_to(ROOT)} imports {n}")
                if top == "torch":
                    bad.append(f"{f.relative_to(ROOT)} imports torch at run time")
    assert not bad, "\n".join(bad)


#: blutensor's documented modules: what other packages (their src/, dev/ and tests/, the root benchmarks/ and
#: tests/) may import; everything else (``blutensor._*``, ``ops``, ``backends.cupy``, ``plugin``, ``gemm``, ...) is
#: private and reached through ``blutensor.ext``
PUBLIC_BLUTENSOR = {"blutensor", "blutensor.nn", "blutensor.nn.functional", "blutensor.nn.init", "blutensor.nn.utils",
                    "blutensor.optim", "blutensor.optim.lr_scheduler", "blutensor.utils", "blutensor.utils.data",
                    "blutensor.ext", "blutensor.compat", "blutensor.cuda", "blutensor.amp", "blutensor.random",
                    "blutensor.autograd", "blutensor.policy", "blutensor.backends"}
BLUTENSOR_SRC = ROOT / "packages" / "blutensor" / "src" / "blutensor"


def _consumer_files():
    """Every Python file outside blutensor's own package that may use blutensor."""
    for pkg in PACKAGES:
        if pkg != "blutensor":
            yield from (ROOT / "packages" / pkg).rglob("*.py")
    for d in ("benchmarks", "tests", "dev"):
        yield from (ROOT / d).rglob("*.py")


def _first_private(dotted: str) -> str | None:
    """The shortest prefix of ``dotted`` (``blutensor.x.y...``) that is one of blutensor's private modules, else
    None: what an import, a module name given as a string or an attribute chain such as ``bt.backends.cupy.sdpa`` or
    ``"blutensor.backends.cupy._loader.cupy"`` (a monkeypatch target) reaches into. The prefixes are resolved on
    blutensor itself: a name that is a class or function there (``bt.device``, ``bt.compile``) or a module
    re-exported under a documented name (``blutensor.ext.kernel_cache``) is public, whatever file shares its name."""
    import importlib
    import types

    parts = dotted.split(".")
    obj: object = importlib.import_module("blutensor")
    for n in range(2, len(parts) + 1):
        prefix = ".".join(parts[:n])
        try:
            nxt = getattr(obj, parts[n - 1], None)
        except Exception:  # a lazy name whose import needs CuPy (blutensor.ext's): a documented name, not a module
            return None
        if nxt is None and isinstance(obj, types.ModuleType):
            path = BLUTENSOR_SRC.joinpath(*parts[1:n])
            if not (path.with_suffix(".py").is_file() or path.is_dir()):
                return None
            try:
                nxt = importlib.import_module(prefix)
            except ImportError:  # a module that needs CuPy: private all the same, unless documented
                return None if prefix in PUBLIC_BLUTENSOR else prefix
        if not isinstance(nxt, types.ModuleType) or nxt.__name__ != prefix:
            return None  # a function, class or value, or a module re-exported under a documented name
        if prefix not in PUBLIC_BLUTENSOR:
            return prefix
        obj = nxt
    return None


#: calls whose first argument is a module name or a dotted path into a module, and the callee names they go by
#: (``pytest.importorskip``, ``importlib.import_module``, ``__import__``, ``importlib.util.find_spec``,
#: ``monkeypatch.setattr``/``delattr``, ``mock.patch``/``patch``)
_STRING_IMPORTERS = {"importorskip", "import_module", "__import__", "find_spec", "setattr", "delattr", "patch"}


def _string_target(node: ast.Call) -> str | None:
    """The blutensor dotted name a call such as ``importorskip("blutensor.x")`` or ``monkeypatch.setattr(
    "blutensor.x.y", v)`` names, else None (builtin ``setattr(obj, ...)`` takes an object, not a string)."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in _STRING_IMPORTERS or not node.args:
        return None
    a = node.args[0]
    if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.split(".")[0] == "blutensor":
        return a.value
    return None


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private_uses(f: Path) -> list[str]:
    """Uses of blutensor's private modules in ``f``: imports (``import``, ``from ... import``, also of a private
    submodule by name from a documented package: ``from blutensor.backends import cupy``), module names given as
    strings (``importorskip``, ``import_module``, ``__import__``, ``monkeypatch.setattr``/``mock.patch``
    targets), and attribute reads of them through an alias of blutensor (``bt.ops.dispatch``,
    ``bt.backends.cupy``); ``from blutensor.autograd import X`` must name a documented (``__all__``) part."""
    import blutensor.autograd

    tree = ast.parse(f.read_text(), str(f))
    aliases: dict[str, str] = {}  # local name -> the documented blutensor module it is bound to
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "blutensor":
                    if _first_private(a.name):
                        bad.append(f"import {a.name}")
                    elif a.asname is None:
                        aliases["blutensor"] = "blutensor"
                    else:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "blutensor":
            if node.module not in PUBLIC_BLUTENSOR:
                bad.append(f"from {node.module} import ...")
                continue
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if _first_private(full):
                    bad.append(f"from {node.module} import {a.name}")
                elif full in PUBLIC_BLUTENSOR:
                    aliases[a.asname or a.name] = full
            if node.module == "blutensor.autograd":
                bad += [f"from blutensor.autograd import {a.name}" for a in node.names
                        if a.name not in blutensor.autograd.__all__]
        elif isinstance(node, ast.Call) and (target := _string_target(node)) is not None:
            if _first_private(target):
                bad.append(f"{target!r} (line {node.lineno})")
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (chain := _dotted(node)) is not None:
            head, _, rest = chain.partition(".")
            if head not in aliases or not rest:
                continue
            mod = _first_private(f"{aliases[head]}.{rest}")
            if mod is not None and (node.lineno, mod) not in seen:
                seen.add((node.lineno, mod))
                shown = head + mod[len(aliases[head]):]
                bad.append(f"{shown} (line {node.lineno})")
    return bad


def test_other_packages_use_only_blutensors_documented_modules():
    bad = [f"{f.relative_to(ROOT)}: {b}" for f in _consumer_files() for b in _private_uses(f)]
    assert not bad, "use blutensor's documented modules or blutensor.ext:\n" + "\n".join(bad)


def test_private_use_check_sees_imports_and_attribute_reads(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import blutensor as bt\nfrom blutensor.ops import dispatch\nfrom blutensor import gemm\n"
                 "from blutensor.autograd.node import Node\nfrom blutensor.ext import Node as N\nbt.ops.dispatch\n"
                 "bt.device('cpu')\nfrom blutensor.autograd import Function\n")
    assert _private_uses(f) == ["from blutensor.ops import ...", "from blutensor import gemm",
                                "from blutensor.autograd.node import ...", "bt.ops (line 6)"]


def test_private_use_check_sees_module_names_in_strings_and_private_submodules(tmp_path):
    """Module names given as strings (importorskip, import_module, __import__, monkeypatch and mock.patch targets)
    and private submodules named from a documented package count as imports; documented ones do not."""
    f = tmp_path / "m.py"
    f.write_text("import importlib\nimport pytest\nfrom unittest import mock\nimport blutensor as bt\n"
                 "kc = pytest.importorskip('blutensor.kernel_cache')\n"
                 "importlib.import_module('blutensor.backends.cupy.sdpa')\n"
                 "__import__('blutensor.ops')\n"
                 "def test_x(monkeypatch):\n"
                 "    monkeypatch.setattr('blutensor.backends.cupy._loader.cupy', None)\n"
                 "    with mock.patch('blutensor.gemm.get_gemm_provider'):\n"
                 "        pass\n"
                 "    monkeypatch.setattr('blutensor.ext.kernel_cache', None)\n"
                 "    setattr(bt, 'x', 1)\n"
                 "from blutensor.backends import cupy, get\nfrom blutensor import nn, kernel_cache as k\n"
                 "from blutensor.nn import functional as F\n"
                 "import blutensor.backends.numpy\nbt.backends.cupy.sdpa\nbt.backends.get('cuda')\n"
                 "bt.kernel_cache.store\nbt.nn.functional.relu\nF.relu\n"
                 "pytest.importorskip('blutensor.ext')\nimportlib.util.find_spec('blutensor.gemm')\n")
    assert sorted(_private_uses(f)) == sorted([
        "'blutensor.kernel_cache' (line 5)", "'blutensor.backends.cupy.sdpa' (line 6)", "'blutensor.ops' (line 7)",
        "'blutensor.backends.cupy._loader.cupy' (line 9)", "'blutensor.gemm.get_gemm_provider' (line 10)",
        "from blutensor.backends import cupy", "from blutensor import kernel_cache",
        "import blutensor.backends.numpy", "bt.backends.cupy (line 18)", "bt.kernel_cache (line 20)",
        "'blutensor.gemm' (line 24)"])


def _imported_tops(f: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("pkg", PACKAGES)
def test_dev_tools_follow_the_dependency_order(pkg):
    """A package's dev/ (kernel-development variants and their references) imports only what the package itself
    may import: a lower package's tools never pull in a higher one."""
    bad = [f"{f.relative_to(ROOT)} imports {top}" for f in (ROOT / "packages" / pkg / "dev").rglob("*.py")
           for top in _imported_tops(f) if top in PACKAGES and top != pkg and top not in ALLOWED[pkg]]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_blublas_installs_alone(tmp_path):
    """`pip install packages/blublas` in a fresh venv does not pull blutensor, and imports."""
    venv.create(tmp_path, with_pip=True)
    py = str(tmp_path / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(ROOT / "packages" / "blublas"), str(ROOT / "packages" / "bluallocator")],
                   check=True, timeout=600)
    out = subprocess.run([py, "-c", "import blublas, bluallocator, importlib.util as u; "
                          "print(u.find_spec('blutensor') is None)"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_root_is_a_workspace_without_project():
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "project" not in root
    assert root["tool"]["hatch"]["envs"]["default"]["workspace"]["members"] == ["packages/*"]
    assert sys.version_info >= (3, 11)


@pytest.mark.slow
def test_blumodels_pulls_blutensor_by_its_range(tmp_path):
    """`pip install blumodels` from a wheelhouse resolves blutensor through blumodels' declared range."""
    house = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(house),
                    str(ROOT / "packages" / "blutensor"), str(ROOT / "packages" / "blumodels")],
                   check=True, timeout=600)
    src = ROOT / "packages" / "blutensor" / "src"  # the kernel sources ship where the backends load them from
    kernels = {p.relative_to(src).as_posix() for pat in ("*.cu", "*.cuh", "*.c") for p in src.rglob(pat)}
    with zipfile.ZipFile(next(house.glob("blutensor-*.whl"))) as whl:
        missing = kernels - set(whl.namelist())
    assert {"blutensor/backends/numpy/kernels.c", "blutensor/backends/cupy/kernels/sdpa.cu"} <= kernels
    assert not missing, f"the blutensor wheel lacks {sorted(missing)}"
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--find-links", str(house),
                    "blumodels"], check=True, timeout=900)
    out = subprocess.run([py, "-c", "import importlib.metadata as m, blumodels, blutensor; "
                          "print(m.version('blutensor'), m.requires('blumodels'))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    version, requires = out.stdout.split(" ", 1)
    assert version.strip() == "0.1.0"
    assert "blutensor<0.2,>=0.1" in requires
