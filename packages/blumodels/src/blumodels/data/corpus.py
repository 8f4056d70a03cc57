"""Text sources for ``blutrain prepare``: user files/folders and the offline built-in "pydocs" corpus.

"pydocs" is the documentation text that ships with every Python: module, class and function docstrings
of the standard library (extracted with :mod:`ast`, never imported) plus the reference topics of
``pydoc_data``. Files are walked in sorted order and exact duplicates are dropped, so the corpus is the
same on every run with the same Python version.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

TEXT_EXTENSIONS = frozenset({".txt", ".md", ".rst", ".text", ".py", ".pyi", ".c", ".h", ".cpp", ".hpp",
                             ".cu", ".js", ".ts", ".java", ".go", ".rs", ".toml", ".yaml", ".yml",
                             ".json", ".jsonl", ".csv", ".tsv", ".html", ".htm", ".xml", ".tex", ".sh",
                             ".cfg", ".ini", ".log"})
BUILTIN_CORPORA = ("pydocs",)
# stdlib sub-trees that are not the standard library's own documentation (third-party, test data)
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                        "ensurepip"})


class CorpusError(ValueError):
    """A source file is not text; names the file and the byte offset."""


def read_texts(paths: Iterable[str | os.PathLike]) -> list[str]:
    """Read text files (and folders, recursively, text extensions only) as one document per file.

    Folders are walked in sorted order; bytes that are not UTF-8 become U+FFFD. A missing path is an
    error naming it, and so is a file holding a NUL byte (binary or UTF-16: CorpusError with the offset).
    """
    docs: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(f for f in path.rglob("*")
                           if f.is_file() and f.suffix.lower() in TEXT_EXTENSIONS
                           and not any(part.startswith(".") for part in f.relative_to(path).parts))
        else:
            raise FileNotFoundError(f"read_texts: no such file or folder: {path}")
        for f in files:
            raw = f.read_bytes()
            if (nul := raw.find(b"\0")) >= 0:  # a binary file, or UTF-16 text: would become U+FFFD soup
                raise CorpusError(f"read_texts: {f} is not UTF-8 text (NUL byte at offset {nul}; binary, or "
                                  "UTF-16?): convert it to UTF-8 or leave it out")
            text = raw.decode("utf-8", errors="replace")
            if text.strip():
                docs.append(text)
    return docs


def _docstrings(tree: ast.Module) -> list[str]:
    """Docstrings of a module and of its classes/functions, in source order."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                name = getattr(node, "name", None)
                out.append((getattr(node, "lineno", 0), f"{name}: {doc}" if name else doc))
    return [d for _, d in sorted(out, key=lambda t: t[0])]


def _topics(path: Path) -> list[str]:
    """The reference-manual topics dict of ``pydoc_data/topics.py`` (string values, sorted by key)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return []
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            items = [(k.value, v.value) for k, v in zip(node.value.keys, node.value.values)
                     if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
                     and isinstance(v.value, str)]
            return [inspect.cleandoc(v) for _, v in sorted(items)]
    return []


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


@functools.lru_cache(maxsize=4)
def _pydocs(max_bytes: int | None) -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    docs: list[str] = []
    total = 0

    def add(doc: str) -> bool:
        nonlocal total
        if doc.strip() and doc not in seen:
            seen.add(doc)
            docs.append(doc)
            total += len(doc.encode("utf-8"))
        return max_bytes is not None and total >= max_bytes

    topics = root / "pydoc_data" / "topics.py"
    for t in _topics(topics):
        if add(t):
            return tuple(docs)
    for f in _stdlib_files(root):
        if f == topics:
            continue
        try:
            tree = ast.parse(f.read_bytes(), filename=str(f))
        except (SyntaxError, ValueError, OSError):
            continue
        parts = [d for d in _docstrings(tree) if d not in seen]
        seen.update(parts)
        if parts:
            module = f.relative_to(root).with_suffix("").as_posix().replace("/", ".")
            if add(f"Module {module}\n\n" + "\n\n".join(parts)):
                break
    return tuple(docs)


def builtin_corpus(name: str = "pydocs", max_bytes: int | None = None) -> list[str]:
    """Documents of a built-in offline corpus ("pydocs": the Python standard library's documentation).

    ``max_bytes`` stops after about that many UTF-8 bytes (for quick tests); the result is a prefix of
    the full corpus.
    """
    if name != "pydocs":
        raise ValueError(f"unknown built-in corpus {name!r}; available: {', '.join(BUILTIN_CORPORA)}")
    return list(_pydocs(None if max_bytes is None else int(max_bytes)))
