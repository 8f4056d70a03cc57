"""Run PyTorch-style code on blutensor without editing its imports.

``import blutensor as torch`` already gives ``torch.nn``, ``torch.nn.functional``, ``torch.optim`` and
``torch.utils.data``. Code that writes ``import torch.nn as nn`` or ``from torch.utils.data import
DataLoader`` needs the module names themselves: :func:`install_torch_alias` registers ``torch`` and every
``torch.<sub>`` as blutensor's module of the same name in ``sys.modules`` (a ``torch.<sub>`` that blutensor
does not have fails with an ImportError that says so). From the shell::

    python -m blutensor.compat train.py --its --own --args

runs ``train.py`` as ``__main__`` with the alias installed. The alias refuses to install when the real
PyTorch is already imported in the process (the two would be mixed silently).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

_PREFIX = "torch"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        return self.target

    def exec_module(self, module) -> None:
        return None


class _TorchAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``torch.<sub>`` to ``blutensor.<sub>``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _PREFIX and not fullname.startswith(_PREFIX + "."):
            return None
        real = "blutensor" + fullname[len(_PREFIX):]
        try:
            mod = importlib.import_module(real)
        except ModuleNotFoundError as e:
            if e.name is None or not (e.name == real or real.startswith(e.name + ".")):
                raise
            parent, _, leaf = real.rpartition(".")  # a module bound as an attribute (blutensor.cuda.amp)
            mod = getattr(sys.modules.get(parent), leaf, None)
            if not isinstance(mod, types.ModuleType):
                raise ModuleNotFoundError(f"No module named {fullname!r}: blutensor has no {real!r} (under the "
                                          f"torch alias of blutensor.compat)", name=fullname) from None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(mod), is_package=hasattr(mod, "__path__"))


_FINDER = _TorchAliasFinder()
_EAGER = ("nn", "nn.functional", "nn.init", "nn.utils", "optim", "optim.lr_scheduler", "utils", "utils.data",
          "autograd", "cuda", "amp")
_ATTR_MODULES = {"cuda.amp": "amp"}  # torch.<key> is blutensor.<value>


def is_torch_alias_installed() -> bool:
    import blutensor

    return sys.modules.get(_PREFIX) is blutensor


def install_torch_alias() -> None:
    """Make ``import torch`` (and ``torch.nn``, ``torch.utils.data``, ...) import blutensor. Idempotent;
    raises RuntimeError when the real ``torch`` is already imported."""
    import blutensor

    cur = sys.modules.get(_PREFIX)
    if cur is blutensor:
        return
    if cur is not None:
        raise RuntimeError(f"blutensor.compat.install_torch_alias: the real PyTorch is already imported "
                           f"({getattr(cur, '__file__', cur)!r}); install the alias before anything imports torch, "
                           f"or run the script with 'python -m blutensor.compat script.py'")
    stale = [n for n in sys.modules if n.startswith(_PREFIX + ".")]
    if stale:
        raise RuntimeError(f"blutensor.compat.install_torch_alias: torch submodules are already imported "
                           f"({', '.join(sorted(stale)[:3])}, ...)")
    sys.modules[_PREFIX] = blutensor
    for sub in _EAGER:
        try:
            sys.modules[f"{_PREFIX}.{sub}"] = importlib.import_module(f"blutensor.{sub}")
        except ModuleNotFoundError:  # a submodule this build lacks resolves (and fails clearly) on demand
            pass
    for alias, target in _ATTR_MODULES.items():
        sys.modules[f"{_PREFIX}.{alias}"] = importlib.import_module(f"blutensor.{target}")
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall_torch_alias() -> None:
    """Remove what :func:`install_torch_alias` registered (modules already bound by importers stay bound)."""
    import blutensor

    if sys.modules.get(_PREFIX) is blutensor:
        for n in [n for n in sys.modules if n == _PREFIX or n.startswith(_PREFIX + ".")]:
            del sys.modules[n]
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def main(argv: list[str] | None = None) -> int:
    """``python -m blutensor.compat script.py [args...]``: run ``script.py`` as ``__main__`` on blutensor."""
    import runpy

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m blutensor.compat script.py [args...]\n\nRuns script.py with 'torch' (and "
              "torch.nn, torch.utils.data, ...) importing blutensor.", file=sys.stderr)
        return 0 if argv else 2
    install_torch_alias()
    sys.argv = list(argv)
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
