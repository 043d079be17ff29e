"""Loads plugins from the ``kvgen.plugins`` entry-point group and collects what they register.

Contracts:

- A plugin that fails -- its import raises anything but KeyboardInterrupt
  (``SystemExit`` included), or one of its hooks does -- is recorded with its
  error and skipped; every other plugin still loads. Each hook is called on
  its own, so a plugin whose scheme hook fails keeps its other contributions.
- A name registered twice (a scheme, target, model, command, a template file
  found in two folders, or two entry points of one name) is a
  :class:`PluginError` naming both plugins when that kind is used: a
  third-party plugin can never silently replace a built-in.
- A scheme that is missing because its plugin failed (or ``KVGEN_PLUGINS``
  left it out) is reported as such, not as an unknown name
  (:meth:`SchemeTable.missing_reason`).
- ``KVGEN_PLUGINS`` (see ``kvgen.env``) restricts which entry points load;
  a name in it that no entry point has is a :class:`PluginError`.
- Hooks of one kind run the first time that kind is read (``registry.schemes``
  ...), so ``kvgen --help`` (commands only) never builds a scheme. Plugin
  modules are imported by :func:`load_registry`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pluggy

from kvgen import hookspecs
from kvgen.errors import PluginError

ENTRY_POINT_GROUP = "kvgen.plugins"
PLUGINS_VARIABLE = "KVGEN_PLUGINS"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    return _one_line(f"{type(exc).__name__}: {exc}")


@dataclass
class PluginRecord:
    """One plugin: its entry point, what it registered, and its errors (``error`` joins them) if it failed."""

    name: str
    module: str
    distribution: str | None
    registered: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None
    errors: dict[str, str] = field(default_factory=dict)
    """Where it failed (``"import"``, a kind such as ``"schemes"``, or ``"conflict"``) -> one-line error."""
    traceback: str | None = None

    def fail(self, where: str, message: str) -> None:
        self.errors[where] = message if where not in self.errors else f"{self.errors[where]}; {message}"
        self.error = "; ".join(self.errors.values())

    def failed_for(self, kind: str) -> str | None:
        """The error that kept this plugin from registering ``kind`` (its import's or that hook's), or None."""
        return self.errors.get("import") or self.errors.get(kind)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.distribution})" if self.distribution and self.distribution != self.name else self.name

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "distribution": self.distribution,
            "registered": self.registered,
            "error": self.error,
        }


@dataclass(frozen=True)
class _Kind:
    hook: str
    singular: str
    key: Callable[..., str]


KINDS: dict[str, _Kind] = {
    "schemes": _Kind("kvgen_register_schemes", "scheme", lambda s: s.name),
    "targets": _Kind("kvgen_register_targets", "target", lambda t: t.name),
    "models": _Kind("kvgen_register_models", "model", lambda m: m.name),
    "commands": _Kind("kvgen_register_commands", "command", lambda name, *rest: name),
    "templates": _Kind("kvgen_register_templates", "template folder", lambda path: str(path)),
}
"""Each kind a plugin can register: its hook, its name in messages, and the name of a registered object."""


class SchemeTable(dict):
    """Scheme name -> registered Scheme; also says why a name is missing (see :meth:`missing_reason`)."""

    def __init__(self, registry: "Registry"):
        super().__init__()
        self._registry = registry

    def missing_reason(self, name: str) -> str | None:
        """Why scheme ``name`` is not here when a plugin failed or was left out, else None (one line)."""
        return self._registry.missing_reason("schemes", name)


class Registry:
    """Everything the loaded plugins registered, by kind and name; hooks of a kind run when it is first read."""

    def __init__(self, loaded: list[tuple[PluginRecord, pluggy.PluginManager]], excluded: list[str] = (),
                 allowed: frozenset[str] | None = None):
        self._loaded = loaded
        self._records: list[PluginRecord] = [record for record, _ in loaded]
        self.excluded = list(excluded)
        """Entry-point names ``KVGEN_PLUGINS`` left out."""
        self.allowed = allowed
        """The ``KVGEN_PLUGINS`` allow-list, or None (every installed plugin loads)."""
        self._store: dict[str, Any] = {}
        self._owners: dict[str, dict[str, PluginRecord]] = {}
        self._conflicts: dict[str, list[str]] = {}

    @property
    def plugins(self) -> list[PluginRecord]:
        """Every loaded plugin's record, complete: reading it runs every kind's hooks (see :meth:`collect_all`)."""
        self.collect_all()
        return self._records

    def owner(self, kind: str, name: str) -> PluginRecord | None:
        """The plugin that registered ``name`` of ``kind`` (running that kind's hooks if not yet run)."""
        self._collect(kind)
        return self._owners[kind].get(name)

    # -- the kinds -------------------------------------------------------------
    @property
    def schemes(self) -> SchemeTable:
        return self._get("schemes")

    @property
    def targets(self) -> dict[str, Any]:
        return self._get("targets")

    @property
    def models(self) -> dict[str, Any]:
        return self._get("models")

    @property
    def commands(self) -> dict[str, tuple[str, str, Callable]]:
        """Command name -> (name, help, build) as the plugin registered it."""
        return self._get("commands")

    @property
    def template_dirs(self) -> list[Path]:
        """Template folders plugins registered (each once), after kvgen's own templates on the search path."""
        return self._get("templates")

    def scheme(self, text: str):
        """The scheme ``text`` names, with its options applied (``"nuq4:codebook=f.json"``); see
        :func:`kvgen.schemes.resolve_scheme`, which this calls (so a failed plugin is named)."""
        from kvgen.schemes import resolve_scheme

        return resolve_scheme(text, self.schemes)

    def collect_all(self) -> "Registry":
        """Run every kind's hooks now (conflicts are recorded on the plugins, not raised): for ``kvgen plugins``."""
        for kind in KINDS:
            self._collect(kind)
        return self

    def failed(self) -> list[PluginRecord]:
        """Plugins with an error so far (import, a hook of a kind already read, or a conflict); runs no hook."""
        return [r for r in self._records if r.error]

    # -- collection -------------------------------------------------------------
    def _get(self, kind: str):
        store = self._collect(kind)
        if self._conflicts.get(kind):
            raise PluginError(self._conflicts[kind][0] + "; uninstall one, or leave one out with "
                              f"{PLUGINS_VARIABLE}=NAME,... (kvgen plugins lists them)")
        return store

    def _collect(self, kind: str):
        if kind in self._store:
            return self._store[kind]
        spec = KINDS[kind]
        store: Any = SchemeTable(self) if kind == "schemes" else ({} if kind != "templates" else [])
        owners: dict[str, PluginRecord] = {}
        for record, pm in self._loaded:
            if record.errors.get("import"):
                continue

            def register(obj, *rest, _record=record):
                if kind == "schemes":
                    _check_scheme(obj)
                name = spec.key(obj, *rest)
                if kind == "templates":
                    path = Path(str(obj))
                    if path not in store:
                        store.append(path)
                    owners.setdefault(str(path), _record)
                elif name in store:
                    self._conflict(kind, f"plugins {owners[name].label} and {_record.label} both register "
                                         f"{spec.singular} {name!r}", owners[name], _record)
                    return
                else:
                    store[name] = (obj, *rest) if rest else obj
                    owners[name] = _record
                _record.registered.setdefault(kind, []).append(name)

            try:
                getattr(pm.hook, spec.hook)(register=register)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: a plugin never ends kvgen
                record.fail(kind, f"{spec.hook}: {_describe(exc)}")
        if kind == "templates":
            self._template_conflicts(store, owners)
        self._store[kind] = store
        self._owners[kind] = owners
        return store

    def _conflict(self, kind: str, message: str, *records: PluginRecord) -> None:
        self._conflicts.setdefault(kind, []).append(message)
        for i, r in enumerate(records):
            if all(r is not other for other in records[:i]):
                r.fail("conflict", message)

    def _template_conflicts(self, dirs: list[Path], owners: dict[str, PluginRecord]) -> None:
        """Two folders holding one template name: the loader would silently use the first."""
        core = Path(str(importlib.resources.files("kvgen_templates")))
        seen: dict[str, tuple[Path, PluginRecord | None]] = {}
        for root, owner in [(core, None)] + [(d, owners[str(d)]) for d in dirs]:
            if not root.is_dir():
                continue
            for f in sorted(root.rglob("*.j2")):
                name = f.relative_to(root).as_posix()
                if name in seen and seen[name][0] != root:
                    first = seen[name][1]
                    who = f"kvgen's own templates ({seen[name][0]})" if first is None else f"plugin {first.label}"
                    self._conflict("templates", f"{who} and plugin {owner.label} ({root}) both provide "
                                                f"template {name!r}", *[r for r in (first, owner) if r])
                else:
                    seen.setdefault(name, (root, owner))

    # -- why something is missing ------------------------------------------------
    def missing_reason(self, kind: str, name: str) -> str | None:
        """One line saying that ``name`` (of ``kind``) comes, or may come, from a plugin that failed or was left out."""
        singular = KINDS[kind].singular
        self._collect(kind)
        failed = [r for r in self._records if r.failed_for(kind)]
        for r in failed:
            if r.name == name:
                return (f"{singular} {name!r} comes from plugin {r.label}, which failed to load: {r.failed_for(kind)} "
                        f"(fix or uninstall it; kvgen plugins shows every plugin's state)")
        allow = ",".join(sorted(self.allowed or ()))
        if name in self.excluded:
            return (f"{singular} {name!r} comes from plugin {name}, which {PLUGINS_VARIABLE}={allow} leaves out; "
                    f"add it there or unset {PLUGINS_VARIABLE}")
        notes = []
        if failed:
            notes.append("plugin " + ", ".join(f"{r.label} failed to load ({r.failed_for(kind)})" for r in failed)
                         + (" and may be the one that provides it" if len(failed) == 1 else "; one of them may provide it"))
        if self.excluded:
            notes.append(f"{PLUGINS_VARIABLE}={allow} leaves out plugins {', '.join(self.excluded)}, which may provide it")
        if not notes:
            return None
        what = f"--kv {singular}" if kind == "schemes" else singular
        return f"unknown {what} {name!r}; " + "; ".join(notes)


def _check_scheme(scheme: Any) -> None:
    """Contract checks a scheme must pass to be registered (a plugin author's error, reported per plugin)."""
    from kvgen.schemes import Scheme

    if isinstance(scheme, Scheme) and scheme.options and type(scheme).configure is Scheme.configure:
        raise PluginError(f"scheme {scheme.name} declares options {sorted(scheme.options)} "
                          f"but does not implement configure()")


def _plugin_manager(record: PluginRecord, plugin: object) -> pluggy.PluginManager:
    pm = pluggy.PluginManager("kvgen")
    pm.add_hookspecs(hookspecs)
    pm.register(plugin, name=record.name)
    return pm


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    """Entry points of the group, sorted by name, one per name; a name two distributions give differently is a
    PluginError (whichever sorted first would silently win)."""
    by_name: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        first = by_name.setdefault(ep.name, ep)
        if first.value != ep.value:  # the same entry point seen twice (an editable install) is fine
            raise PluginError(f"two installed plugins are both named {ep.name!r}: {first.value} ({_dist(first)}) and "
                              f"{ep.value} ({_dist(ep)}); uninstall one of the two distributions")
    return list(by_name.values())


def _dist(ep: importlib.metadata.EntryPoint) -> str | None:
    return ep.dist.name if getattr(ep, "dist", None) is not None else None


def load_registry(extra_plugins: tuple[object, ...] = (), lazy: bool = False) -> Registry:
    """Import every allowed entry-point plugin (plus ``extra_plugins``, in-process plugins for tests) into a
    fresh Registry. ``lazy=False`` runs every hook now (errors and conflicts land on the records at once);
    ``lazy=True`` runs each kind's hooks when it is first read."""
    from kvgen import env

    allow = env.plugin_allow_list()
    eps = _entry_points()
    if allow is not None:
        unknown = sorted(allow - {ep.name for ep in eps})
        if unknown:
            raise PluginError(f"{PLUGINS_VARIABLE} names {', '.join(map(repr, unknown))}, which no installed plugin "
                              f"provides; available: {', '.join(ep.name for ep in eps) or 'none'}")
    loaded: list[tuple[PluginRecord, Any]] = []
    excluded = []
    for ep in eps:
        if allow is not None and ep.name not in allow:
            excluded.append(ep.name)
            continue
        record = PluginRecord(name=ep.name, module=ep.value, distribution=_dist(ep))
        try:
            pm = _plugin_manager(record, ep.load())
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit included: a broken plugin is reported, never fatal
            record.fail("import", _describe(exc))
            record.traceback = traceback.format_exc()
            pm = None
        loaded.append((record, pm))
    for i, plugin in enumerate(extra_plugins):
        name = getattr(plugin, "__name__", None) or getattr(type(plugin), "__name__", f"extra{i}")
        record = PluginRecord(name=name, module=repr(plugin), distribution=None)
        loaded.append((record, _plugin_manager(record, plugin)))
    registry = Registry(loaded, excluded, allow)
    return registry if lazy else registry.collect_all()


@functools.lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The process-wide registry of installed plugins (imported once; each kind's hooks run when first read)."""
    return load_registry(lazy=True)
