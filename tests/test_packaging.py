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
PRIVATE_SUBMODULES = {p.stem if p.suffix == ".py" else p.name for p in BLUTENSOR_SRC.iterdir()
                      if (p.suffix == ".py" or (p / "__init__.py").is_file() or p.is_dir()) and p.name != "__init__.py"
                      and f"blutensor.{p.stem}" not in PUBLIC_BLUTENSOR and not p.name.startswith("__")}


def _consumer_files():
    """Every Python file outside blutensor's own package that may use blutensor."""
    for pkg in PACKAGES:
        if pkg != "blutensor":
            yield from (ROOT / "packages" / pkg).rglob("*.py")
    for d in ("benchmarks", "tests", "dev"):
        yield from (ROOT / d).rglob("*.py")


def _private_uses(f: Path) -> list[str]:
    """Imports of blutensor's private modules in ``f``, and attribute reads of them through an alias of blutensor
    (``bt.ops.dispatch``); ``from blutensor.autograd import X`` must name a documented (``__all__``) part."""
    import blutensor.autograd

    tree = ast.parse(f.read_text(), str(f))
    aliases, bad = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "blutensor":
                    if a.name not in PUBLIC_BLUTENSOR:
                        bad.append(f"import {a.name}")
                    elif a.asname is None or a.name == "blutensor":
                        aliases.add(a.asname or "blutensor")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "blutensor":
            if node.module not in PUBLIC_BLUTENSOR:
                bad.append(f"from {node.module} import ...")
            elif node.module == "blutensor":
                bad += [f"from blutensor import {a.name}" for a in node.names if a.name in PRIVATE_SUBMODULES]
            elif node.module == "blutensor.autograd":
                bad += [f"from blutensor.autograd import {a.name}" for a in node.names
                        if a.name not in blutensor.autograd.__all__]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr in PRIVATE_SUBMODULES and isinstance(getattr(_blutensor(), node.attr, None),
                                                                    type(ast)):
            bad.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    return bad


def _blutensor():
    import blutensor

    return blutensor


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
