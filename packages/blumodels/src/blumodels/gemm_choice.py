"""``train.gemm``: which registered GEMM provider runs the CUDA matmuls of a run, checked by declared capability.

"auto" (the default) is ``BLUTRAIN_GEMM`` when set, else the first available of blutensor's documented order
(cublas, blublas, xp); any other value names a registered provider (``blutrain plugins`` lists them; "cupy" is
the built-in ``xp`` provider, CuPy's matmul). A provider is never recognised by its name: what the rest of the
config asks of it is checked against what it declares (``PRECISIONS``, ``CAPTURE_SAFE``), at validation, so a
misfit is a ConfigError before any work. The Trainer resolves the choice once, at start, on CUDA devices, into the
``gemm`` field of the run's execution policy (blumodels.execution.policy_from_config).
"""

from __future__ import annotations

from typing import Any

#: other names ``train.gemm`` accepts for a provider
ALIASES = {"cupy": "xp"}


def gemm_names() -> tuple[str, ...]:
    """Values ``train.gemm`` accepts: "auto", the aliases and every registered GEMM provider."""
    from blutensor.ext import get_host

    return tuple(dict.fromkeys(("auto", *ALIASES, *get_host().registry("gemm").names())))


def provider_class(name: str) -> type | None:
    """The registered provider class ``train.gemm = name`` names (None for "auto")."""
    if name == "auto":
        return None
    from blutensor.ext import get_host

    return get_host().registry("gemm").get(ALIASES.get(name, name))


def requirements(train: Any) -> list[tuple[str, str, str]]:
    """What the train config asks of the GEMM provider: (capability, required value, the key asking)."""
    need = []
    if train.precision == "tf32":
        need.append(("PRECISIONS", "tf32", "train.precision = 'tf32'"))
    if train.precision == "fp32" and train.fp32_gemm == "3xtf32":
        need.append(("PRECISIONS", "3xtf32", "train.fp32_gemm = '3xtf32'"))
    if train.cuda_graph is True:
        need.append(("CAPTURE_SAFE", "True", "train.cuda_graph = true"))
    return need


def misfits(prov: type, train: Any) -> list[str]:
    """The requirements of ``train`` that provider class ``prov`` does not declare, in words."""
    out = []
    for cap, value, key in requirements(train):
        if cap == "PRECISIONS" and value not in tuple(getattr(prov, "PRECISIONS", ("fp32",))):
            out.append(f"{key} needs precision {value!r} (it declares PRECISIONS = "
                       f"{tuple(getattr(prov, 'PRECISIONS', ('fp32',)))})")
        elif cap == "CAPTURE_SAFE" and not getattr(prov, "CAPTURE_SAFE", False):
            out.append(f"{key} needs a capture-safe provider (it declares CAPTURE_SAFE = False)")
    return out


def check(train: Any) -> None:
    """ConfigError naming ``train.gemm`` when it names no registered provider or one that lacks a capability
    the rest of ``train`` needs ("auto" is resolved, and checked, where the run starts)."""
    from blumodels.config import ConfigError, _did_you_mean

    names = gemm_names()
    if not isinstance(train.gemm, str) or train.gemm not in names:
        raise ConfigError(f"train.gemm must be 'auto' or a registered GEMM provider ({', '.join(names[1:])}), got "
                          f"{train.gemm!r}{_did_you_mean(str(train.gemm), names)}")
    prov = provider_class(train.gemm)
    if prov is not None and (bad := misfits(prov, train)):
        raise ConfigError(f"train.gemm = {train.gemm!r} cannot serve this run: " + "; ".join(bad)
                          + " (choose another provider or change those keys)")


def resolve(train: Any, device: str) -> type | None:
    """The provider class this run's GEMMs use (CUDA devices only: host GEMMs use no provider, None); "auto"
    resolves through ``BLUTRAIN_GEMM`` (the execution policy's environment default, read once) and the documented
    order. An unavailable or misfitting provider is a ConfigError naming ``train.gemm``. Selects nothing."""
    if not str(device).startswith("cuda"):
        return None
    import blutensor as bt
    from blutensor.ext import PluginError, get_host

    from blumodels.config import ConfigError

    name = bt.policy.env_defaults().gemm if train.gemm == "auto" else ALIASES.get(train.gemm, train.gemm)
    try:
        prov = get_host().registry("gemm").select(None if name == "auto" else name)
    except PluginError as e:
        raise ConfigError(f"train.gemm = {train.gemm!r}: {e}") from None
    if train.gemm == "auto" and (bad := misfits(prov, train)):
        raise ConfigError(f"train.gemm = 'auto' resolved to {prov.PLUGIN_NAME!r}, which cannot serve this run: "
                          + "; ".join(bad) + " (name a provider in train.gemm)")
    return prov


def apply(train: Any, device: str) -> type | None:
    """:func:`resolve`, then select that provider for the current execution policy (the active scope's, else the
    process default) and return it. The Trainer does not call this: its policy (blumodels.execution) holds it."""
    prov = resolve(train, device)
    if prov is None:
        return None
    import blutensor as bt
    from blutensor.ext import get_gemm_provider

    bt.set_gemm_provider(prov.PLUGIN_NAME)
    return get_gemm_provider()
