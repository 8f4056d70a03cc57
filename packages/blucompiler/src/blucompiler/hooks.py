"""Plugin registration: blucompiler is the compiler backend "blucompiler"."""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("blutrain")


class BluCompilerBackend:
    """Compiler backend plugin: ``compile(fn, **options)`` returns a :class:`CompiledStep`."""

    PLUGIN_NAME = "blucompiler"

    @staticmethod
    def compile(fn, **options):
        from blucompiler import compile as _compile

        return _compile(fn, **options)


@hookimpl
def blutrain_register_compiler_backends():
    return [BluCompilerBackend]
