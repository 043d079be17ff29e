"""Loads plugins from the ``kvgen.plugins`` entry-point group and collects what they register.

A plugin that fails to import or whose hook raises is recorded with its
error and skipped: one broken third-party package must not take the CLI
down. ``KVGEN_PLUGINS`` (see ``kvgen.env``) may restrict which entry points
load.
"""

from __future__ import annotations

import functools
import importlib.metadata
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy

from kvgen import env, hookspecs
from kvgen.errors import PluginError

ENTRY_POINT_GROUP = "kvgen.plugins"


@dataclass
class PluginRecord:
    """One plugin: its entry point, what it registered, and its error if it failed."""

    name: str
    module: str
    distribution: str | None
    registered: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "distribution": self.distribution,
            "registered": self.registered,
            "error": self.error,
        }


@dataclass
class Registry:
    """Everything the loaded plugins registered, by kind and name."""

    schemes: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, Any] = field(default_factory=dict)
    models: dict[str, Any] = field(default_factory=dict)
    template_dirs: list[Any] = field(default_factory=list)
    commands: dict[str, tuple[str, Callable]] = field(default_factory=dict)
    plugins: list[PluginRecord] = field(default_factory=list)

    def scheme(self, text: str):
        """The scheme ``text`` names, with its options applied (``"nuq4:codebook=f.json"``); see
        :func:`kvgen.schemes.resolve_scheme`, which this calls."""
        from kvgen.schemes import resolve_scheme

        return resolve_scheme(text, self.schemes)


def _collect(record: PluginRecord, plugin: object, registry: Registry) -> None:
    """Call each hook the plugin implements with a register callback bound to the record."""
    pm = pluggy.PluginManager("kvgen")
    pm.add_hookspecs(hookspecs)
    pm.register(plugin, name=record.name)

    def keyed(kind: str, store: dict, key: Callable[[Any], str], check: Callable[[Any], None] = lambda obj: None):
        def register(obj, *rest):
            check(obj)
            name = key(obj)
            if name in store:
                raise PluginError(f"plugin {record.name} registers {kind} {name!r}, which another plugin already registered")
            store[name] = (obj, *rest) if rest else obj
            record.registered.setdefault(kind, []).append(name)
        return register

    def register_template_dir(path):
        registry.template_dirs.append(path)
        record.registered.setdefault("templates", []).append(str(path))

    calls = [
        ("kvgen_register_schemes", keyed("schemes", registry.schemes, lambda s: s.name, _check_scheme)),
        ("kvgen_register_targets", keyed("targets", registry.targets, lambda t: t.name)),
        ("kvgen_register_models", keyed("models", registry.models, lambda m: m.name)),
        ("kvgen_register_templates", register_template_dir),
        ("kvgen_register_commands", keyed("commands", registry.commands, lambda n: n)),
    ]
    errors = []
    for hook_name, register in calls:
        # Each hook on its own: a plugin whose scheme hook fails keeps its
        # other contributions (say, the command that repairs its data file).
        try:
            getattr(pm.hook, hook_name)(register=register)
        except Exception as exc:
            errors.append(f"{hook_name}: {type(exc).__name__}: {exc}")
    if errors:
        record.error = "; ".join(errors)


def _check_scheme(scheme: Any) -> None:
    """Contract checks a scheme must pass to be registered (a plugin author's error, reported per plugin)."""
    from kvgen.schemes import Scheme

    if isinstance(scheme, Scheme) and scheme.options and type(scheme).configure is Scheme.configure:
        raise PluginError(f"scheme {scheme.name} declares options {sorted(scheme.options)} "
                          f"but does not implement configure()")


def load_registry(extra_plugins: tuple[object, ...] = ()) -> Registry:
    """Load every allowed entry-point plugin (plus ``extra_plugins``, for tests) into a fresh Registry."""
    registry = Registry()
    allow = env.plugin_allow_list()
    seen: set[str] = set()
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in seen or (allow is not None and ep.name not in allow):
            continue
        seen.add(ep.name)
        dist = ep.dist.name if getattr(ep, "dist", None) is not None else None
        record = PluginRecord(name=ep.name, module=ep.value, distribution=dist)
        registry.plugins.append(record)
        try:
            _collect(record, ep.load(), registry)
        except Exception as exc:  # a broken plugin is reported, never fatal
            record.error = f"{type(exc).__name__}: {exc}"
            record.traceback = traceback.format_exc()  # type: ignore[attr-defined]
    for i, plugin in enumerate(extra_plugins):
        record = PluginRecord(name=getattr(plugin, "__name__", f"extra{i}"), module=repr(plugin), distribution=None)
        registry.plugins.append(record)
        _collect(record, plugin, registry)
    return registry


@functools.lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The process-wide registry of installed plugins (loaded once)."""
    return load_registry()
