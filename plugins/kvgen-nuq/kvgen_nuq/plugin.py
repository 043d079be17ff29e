"""The kvgen plugin module (entry point ``nuq`` in group ``kvgen.plugins``).

kvgen loads this module and calls the hooks below; it is the only place the
package talks to kvgen, and only through ``kvgen.plugin_api``:

- ``kvgen_register_schemes``: the ``nuq4`` scheme (layout and reference in
  :mod:`kvgen_nuq.scheme`);
- ``kvgen_register_templates``: the ``macros/`` folder shipped in this
  package, which holds ``nuq4.j2`` (the scheme's Jinja macros);
- ``kvgen_register_commands``: the ``kvgen nuq`` command group
  (``calibrate``, ``show``; see :mod:`kvgen_nuq.cli`).
"""

from __future__ import annotations

import importlib.resources

from kvgen.plugin_api import hookimpl

# Hooks import the scheme (and read its codebook file) and the CLI only when kvgen asks for them: kvgen imports
# this module for every command, ``kvgen --help`` included. Registering nuq4 loads neither torch nor sympy
# (kvgen_nuq.scheme imports them lazily; tests/test_cli_speed.py checks plan and compile of nuq4).


@hookimpl
def kvgen_register_schemes(register):
    from kvgen_nuq.scheme import Nuq4

    # A bad codebook (CodebookError) propagates: kvgen records it on this plugin, warns, says "plugin nuq
    # failed" when nuq4 is asked for, and keeps the other hooks -- ``kvgen nuq calibrate`` (the way to write
    # a good codebook) included.
    register(Nuq4())


@hookimpl
def kvgen_register_templates(register):
    register(importlib.resources.files("kvgen_nuq") / "macros")


@hookimpl
def kvgen_register_commands(register):
    from kvgen_nuq.cli import HELP, build

    register("nuq", HELP, build)
