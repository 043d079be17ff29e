"""Errors a user can cause.

Every mistake a user can make (a bad flag, an unknown model, a plan that
cannot fit) raises a subclass of :class:`KvgenError`. Its message is one
line that says what was wrong and what to do; the CLI prints it and exits 2.
Anything else escaping kvgen is a bug.
"""


class KvgenError(Exception):
    """Base class of every user-facing kvgen error. The message is one line."""


class UnknownModelError(KvgenError):
    """A --model that is neither a preset, a readable config, nor a reachable hub id."""


class ModelConfigError(KvgenError):
    """A config.json that cannot be read or lacks fields kvgen needs."""


class UnknownTargetError(KvgenError):
    """A --target that is not a preset (or 'auto' with no usable device)."""


class UnknownSchemeError(KvgenError):
    """A --kv scheme that no plugin registered."""


class SchemeOptionError(KvgenError):
    """A scheme option that is malformed (``--kv name:key=value``), unknown to the scheme, or has a bad value."""


class WorkloadError(KvgenError):
    """A workload value out of range (context, concurrency, tp, utilization...)."""


class PlanError(KvgenError):
    """The workload cannot be planned on the target (does not fit, even tiered)."""


class SchemeCapabilityError(KvgenError):
    """A scheme was asked for a head dim, page size or arch it does not declare."""


class PluginError(KvgenError):
    """A plugin registered something invalid (duplicate name, bad object)."""


def is_user_error(exc: BaseException) -> bool:
    """A user's mistake: a KvgenError, or a ``KvgenRuntimeError`` of kvgen's runtime or of a generated package's copy.

    The runtime imports nothing of kvgen (it ships in every package), so its
    error class is not a KvgenError and each package has its own copy of
    it: it is recognized by name and module.
    """
    return isinstance(exc, KvgenError) or any(
        c.__name__ == "KvgenRuntimeError" and c.__module__.endswith("runtime.errors") for c in type(exc).__mro__)
