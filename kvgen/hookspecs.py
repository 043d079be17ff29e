"""Hook specifications of kvgen's plugin API (pluggy project name ``kvgen``).

Only specifications live here. Plugins are modules (or objects) exposed
through the entry-point group ``kvgen.plugins`` that implement some of these
hooks with ``@kvgen.hookimpl``. Every hook receives a ``register`` callback;
calling it is the only way to contribute something, so a plugin never
mutates kvgen's registries directly.

What kvgen guarantees and expects (see ``kvgen.registry``): a name (scheme,
target, model, command, template file) belongs to one plugin -- registering
a name another plugin registered is an error naming both, so nothing
replaces a built-in; a hook that raises is recorded on its plugin and the
rest of kvgen goes on; hooks of one kind run only when kvgen first needs
that kind, and kvgen imports every plugin module for every command, so a
module imports nothing heavy at its top (``kvgen.plugin_api.lazy_import``).
"""

import pluggy

hookspec = pluggy.HookspecMarker("kvgen")


@hookspec
def kvgen_register_schemes(register):
    """Register KV compression schemes: ``register(scheme)`` with a ``kvgen.schemes.Scheme`` instance."""


@hookspec
def kvgen_register_targets(register):
    """Register GPU targets: ``register(target)`` with a ``kvgen.targets.Target``."""


@hookspec
def kvgen_register_models(register):
    """Register model presets: ``register(model_spec)`` with a ``kvgen.models.ModelSpec``."""


@hookspec
def kvgen_register_templates(register):
    """Register template directories: ``register(traversable)`` with a directory
    (``importlib.resources.files(...)`` or a path) searched for Jinja templates,
    e.g. the macro file a scheme names in ``macro_template``."""


@hookspec
def kvgen_register_commands(register):
    """Register CLI subcommands: ``register(name, help, build)`` where ``build(subparsers_parser)``
    adds arguments to an argparse parser and returns ``run(args) -> int``."""
