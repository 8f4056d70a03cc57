"""Registries that collect plugin classes by ``PLUGIN_NAME`` and choose one by name (the caller passes it: a config
key or an execution-policy field), else by the documented defaults."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


class PluginError(RuntimeError):
    """A plugin is missing, duplicated, malformed or cannot be selected."""


@dataclass(frozen=True)
class PluginRecord:
    """One registered plugin class and where it came from."""

    kind: str
    name: str
    cls: type
    package: str
    version: str


class Registry:
    """Plugin classes of one kind, keyed by ``PLUGIN_NAME``.

    ``select(name)`` resolves an explicit name, else the first available name in ``defaults`` (the documented
    "best available"); it reads no environment variable (the execution policy's fields carry those).
    """

    def __init__(self, kind: str, defaults: tuple[str, ...] = ()):
        self.kind = kind
        self.defaults = defaults
        self._records: dict[str, PluginRecord] = {}

    def register(self, cls: type, package: str = "?", version: str = "?") -> None:
        name = getattr(cls, "PLUGIN_NAME", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"{self.kind} plugin {cls!r} from {package} has no PLUGIN_NAME string")
        key = self.key(cls)
        old = self._records.get(key)
        if old is not None and old.cls is not cls:
            raise PluginError(
                f"duplicate {self.kind} plugin {key!r}: {old.cls.__module__}.{old.cls.__qualname__} "
                f"(package {old.package}) and {cls.__module__}.{cls.__qualname__} (package {package})"
            )
        self._records[key] = PluginRecord(self.kind, key, cls, package, version)

    def key(self, cls: type) -> str:
        return cls.PLUGIN_NAME

    def unregister(self, name: str) -> None:
        """Forget the plugin registered as ``name`` (PluginError when there is none)."""
        if self._records.pop(name, None) is None:
            raise PluginError(f"no {self.kind} plugin named {name!r} to unregister")

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def __iter__(self) -> Iterator[PluginRecord]:
        return iter(self._records.values())

    def __len__(self) -> int:
        return len(self._records)

    def names(self) -> list[str]:
        return sorted(self._records)

    def get(self, name: str) -> type:
        try:
            return self._records[name].cls
        except KeyError:
            raise PluginError(
                f"no {self.kind} plugin named {name!r}; available: {', '.join(self.names()) or 'none'}"
            ) from None

    def select(self, name: str | None = None) -> type:
        """The class registered as ``name``, else (None) the first available of the defaults, else the first
        available plugin. No environment variable is read here: the ones that choose a plugin
        (``BLUTRAIN_GEMM``, ``BLUTRAIN_COMPILER``) feed the execution policy's fields, read once, and the caller
        passes the field's value (``bt.policy.current().gemm`` / ``.compiler``)."""
        if name:
            cls = self.get(name)
            avail = getattr(cls, "is_available", None)
            if avail is not None and not avail():
                raise PluginError(f"{self.kind} plugin {name!r} is installed but not available here")
            return cls
        for cand in self.defaults:
            rec = self._records.get(cand)
            if rec is None:
                continue
            avail = getattr(rec.cls, "is_available", None)
            if avail is None or avail():
                return rec.cls
        for rec in self._records.values():
            avail = getattr(rec.cls, "is_available", None)
            if avail is None or avail():
                return rec.cls
        raise PluginError(f"no available {self.kind} plugin (install one, or register one through the "
                          f"plugin host)")


class BackendRegistry(Registry):
    """Array backends keyed by ``PLUGIN_NAME``; each must carry ``DEVICE_TYPE`` and the methods of
    ``blutensor.backends.Backend`` (``is_available``, ``module``, ``owns``, ``device_of``), checked when it
    registers so a malformed backend is refused by name instead of failing at its first array."""

    REQUIRED = ("is_available", "module", "owns", "device_of")

    def register(self, cls: type, package: str = "?", version: str = "?") -> None:
        missing = [] if isinstance(getattr(cls, "DEVICE_TYPE", None), str) and cls.DEVICE_TYPE else ["DEVICE_TYPE"]
        missing += [m for m in self.REQUIRED if not callable(getattr(cls, m, None))]
        if missing:
            raise PluginError(f"backend plugin {cls!r} from {package} lacks {', '.join(missing)} "
                              "(subclass blutensor.backends.Backend)")
        super().register(cls, package, version)


class KernelRegistry(Registry):
    """Op kernels keyed by ``PLUGIN_NAME`` and looked up by (op, backend, dtype)."""

    def for_op(self, op: str, backend: str, dtype: str) -> list[PluginRecord]:
        out = []
        for rec in self._records.values():
            c = rec.cls
            if getattr(c, "OP", None) != op or getattr(c, "BACKEND", None) != backend:
                continue
            dts = getattr(c, "DTYPES", ("*",))
            if "*" in dts or dtype in dts:
                out.append(rec)
        return out
