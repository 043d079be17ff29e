"""The ``kvgen`` command group. Each command is a thin call into the library.

A KvgenError (a user mistake) prints one line -- what was wrong and what to
do -- and exits 2; so do argument errors. Every command takes ``--json``.

Adding a command is one line in :data:`COMMANDS`: its name, its help, and
the import path of an object (usually a module) with ``add_args(parser)``
and ``run(args) -> int``. Only the command being run is imported, so
``kvgen --help`` and the light commands never pay for torch, triton or
transformers; a command that needs them imports them itself.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Callable, NamedTuple, Sequence

from kvgen.errors import KvgenError, is_user_error

COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("plan the KV cache of a model on a GPU", "kvgen.cli:PLAN"),
    "compile": ("plan, then generate the kernels and runtime package", "kvgen.cli:COMPILE"),
    "models": ("list model presets", "kvgen.cli:MODELS"),
    "targets": ("list GPU targets", "kvgen.cli:TARGETS"),
    "schemes": ("list KV compression schemes", "kvgen.cli:SCHEMES"),
    "plugins": ("list plugins and what each registered", "kvgen.cli:PLUGINS"),
    "eval": ("perplexity, KL and top-1 of KV schemes on a real model and text, vs a float32 cache",
             "kvgen.eval.command"),
    "generate": ("generate text with a model on kvgen's KV cache (continuous-batching engine)", "kvgen.engine.cli"),
    "serve": ("serve a model over an OpenAI-compatible HTTP API", "kvgen.serve.cli"),
    "tune": ("tune a compiled package's kernels ahead of time for given batch sizes and contexts",
             "kvgen.tune_command"),
    "probe": ("measure this GPU's host link and copy bandwidth for --target auto", "kvgen.probe"),
}
"""Command name -> (help, ``"module"`` or ``"module:attribute"`` of an object with ``add_args`` and ``run``)."""


class Command(NamedTuple):
    """A command defined in this module: ``add_args(parser)`` and ``run(args) -> int``."""

    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UsageError(KvgenError):
    """Bad command-line arguments."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + traceback
        raise UsageError(f"{self.prog}: {message}; run '{self.prog} --help' for usage")


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _is_terminal() -> bool:
    return sys.stdout.isatty()


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A table on stdout: on a terminal a rich table that fits its width (long cells wrap inside their
    column); piped, or on a terminal too narrow for its short columns, plain aligned text with one row per
    line and nothing cut, for grep and awk."""
    import shutil

    cells = [[str(x) for x in r] for r in rows]
    # A short column (names, numbers) never shrinks below its longest cell; only long ones wrap.
    longest = [max([len(w) for w in c.split()] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    floor = [n if n <= 16 else 12 for n in longest]
    width = shutil.get_terminal_size().columns
    if not _is_terminal() or sum(floor) + 2 * len(columns) > width:
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
        print(title)
        for line in [list(columns)] + cells:
            print("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip())
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    # No vertical rules (one space either side of a column), so 80 columns hold every kvgen table.
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, collapse_padding=True,
                  show_edge=False)
    for c, n in zip(columns, longest):
        table.add_column(c, min_width=n if n <= 16 else None, overflow="fold")
    for r in cells:
        table.add_row(*r)
    Console(width=width).print(table)


def _positive_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"expected an integer, got {text!r}") from None


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name, config.json, model folder or hub id")
    p.add_argument("--target", required=True, help="GPU preset (kvgen targets) or 'auto'")
    p.add_argument("--kv", default="auto",
                   help="scheme (kvgen schemes), with options as NAME:key=value[:key=value...], or 'auto'")
    p.add_argument("--context", type=_positive_int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--concurrency", type=_positive_int, default=1, help="sequences served at once (default 1)")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--weight-bits", default="auto", help="16, 8, 4 or auto: the most bits that fit (default auto)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90, help="fraction of GPU memory kvgen may plan for")
    p.add_argument("--page-size", default="auto", help="tokens per page or 'auto'")
    p.add_argument("--dtype", default="bf16", help="compute dtype: bf16, fp16 or fp32 (default bf16)")
    p.add_argument("--host-memory", type=float, default=256.0, help="GiB of host memory for a host tier (default 256)")


def build_plan(args: argparse.Namespace):
    """Resolve model, target and workload from parsed arguments and plan."""
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan, plan_warnings
    from kvgen.planner.workload import COMPUTE_DTYPES, Workload, host_memory_bytes
    from kvgen.registry import default_registry
    from kvgen.targets import detect_target, resolve_target

    page = None
    if args.page_size != "auto":
        try:
            page = int(args.page_size)
        except ValueError:
            raise UsageError(f"--page-size must be a number of tokens or 'auto', got {args.page_size!r}") from None
    weight_bits = None if args.weight_bits == "auto" else _positive_int(args.weight_bits)
    dtype = COMPUTE_DTYPES.get(args.dtype.lower())
    if dtype is None:
        raise UsageError(f"--dtype must be bf16, fp16 or fp32, got {args.dtype!r}")
    workload = Workload(context=args.context, concurrency=args.concurrency, tp=args.tp,
                        gpu_memory_utilization=args.gpu_memory_utilization, weight_bits=weight_bits,
                        page_size=page, compute_dtype=dtype, host_memory_bytes=host_memory_bytes(args.host_memory))
    registry = default_registry()
    if args.kv != "auto":
        registry.scheme(args.kv)  # a scheme whose plugin failed is named as such, not as an unknown name
    model = resolve_model(args.model)
    target = detect_target() if args.target == "auto" else resolve_target(args.target)
    plan = make_plan(model, target, workload, registry.schemes, kv=args.kv)
    for warning in plan_warnings(plan):
        print(f"kvgen: warning: {warning}", file=sys.stderr)
    return plan


def cmd_plan(args) -> int:
    plan = build_plan(args)
    if args.json:
        _print_json(plan.to_json())
        return 0
    gib = 2**30
    print(f"plan {plan.name}")
    print(f"  model {plan.model}: {plan.num_layers} layers, {plan.num_q_heads}/{plan.num_kv_heads} heads, head_dim {plan.head_dim}")
    print(f"  target {plan.target} ({plan.arch}); scheme {plan.scheme}; page {plan.page_size}; tp {plan.tp}; tiering {plan.tiering}")
    print(f"  KV per token: {plan.kv_bytes_per_token:,} B (model), {plan.kv_bytes_per_token_per_gpu:,} B (per GPU)")
    print(f"  weights {plan.weight_bytes / gib:.1f} GiB; KV budget {plan.kv_budget_bytes / gib:.2f} GiB per GPU")
    print(f"  capacity {plan.capacity_tokens:,} tokens = {plan.capacity_sequences:,} sequences of {plan.context} tokens")
    print("  memory model:")
    for f in plan.formulas:
        print(f"    {f}")
    print("  why:")
    for r in plan.reasons:
        print(f"    - {r}")
    return 0


def _add_compile_args(p: argparse.ArgumentParser) -> None:
    from kvgen.codegen.spec import BACKEND_CHOICES  # light: no Jinja, no torch

    _add_plan_args(p)
    p.add_argument("--out", default=None, help="output folder (default generated/<plan-name>)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="triton",
                   help="kernel language: triton (default); cuda (CUDA C++ where a template exists, Triton "
                        "elsewhere; nvcc builds at compile or first load); auto (both are packaged)")


def cmd_compile(args) -> int:
    from kvgen.codegen.package import compile_plan

    plan = build_plan(args)
    result = compile_plan(plan, out_dir=args.out, backend=args.backend)
    if args.json:
        _print_json(result.to_json())
    else:
        print(f"compiled {plan.name} -> {result.out_dir} ({len(result.files)} files, "
              f"{'unchanged' if result.unchanged else 'written'}, {result.seconds:.2f} s)")
        for note in result.notes:
            print(f"  note: {note}")
        print(f"  import it: sys.path.insert(0, {str(result.out_dir.parent)!r}); "
              f"import {result.out_dir.name} as k; rt = k.load()")
    return 0


def cmd_models(args) -> int:
    from kvgen.models import list_models

    models = list_models()
    if args.json:
        _print_json([m.to_json() for m in models])
        return 0
    _table("models", ["name", "layers", "q/kv heads", "head_dim", "hidden", "vocab", "params", "window"],
           [(m.name, m.num_layers, f"{m.num_q_heads}/{m.num_kv_heads}", m.head_dim, m.hidden_size, m.vocab_size,
             f"{m.num_params / 1e9:.2f}B", m.sliding_window or "-") for m in models])
    return 0


def cmd_targets(args) -> int:
    from kvgen.targets import list_targets

    targets = list_targets()
    if args.json:
        _print_json([t.to_json() for t in targets])
        return 0
    _table("targets", ["name", "memory GB", "bandwidth TB/s", "SMs", "arch", "fp8", "host link GB/s"],
           [(t.name, f"{t.memory_bytes / 1e9:.0f}", f"{t.memory_bandwidth / 1e12:.2f}", t.sm_count, t.arch,
             "yes" if t.fp8 else "no", f"{t.host_link_bandwidth / 1e9:.0f}") for t in targets])
    return 0


def cmd_schemes(args) -> int:
    from kvgen.registry import default_registry

    schemes = sorted(default_registry().schemes.values(), key=lambda s: (s.precision_rank(), s.name))
    rows = [s.describe(head_dim=128, page_size=16) for s in schemes]
    if args.json:
        _print_json(rows)
        return 0
    _table("schemes (bytes at head_dim 128, page 16)",
           ["name", "bits", "B/token/KV head", "residual", "options (--kv NAME:key=value)", "summary"],
           [(r["name"], r["bits"], f"{r['bytes_per_token_per_kv_head']:g}",
             "-" if r["residual_tokens"] is None else r["residual_tokens"], ", ".join(r["options"]) or "-",
             r["summary"]) for r in rows])
    return 0


def cmd_plugins(args) -> int:
    from kvgen.registry import default_registry

    registry = default_registry()
    plugins = registry.plugins  # complete: every hook has run, so every failure and conflict shows
    if args.json:
        _print_json([p.to_json() for p in plugins])
        return 0
    _table("plugins", ["name", "module", "distribution", "registered", "error"],
           [(p.name, p.module, p.distribution or "-",
             "; ".join(f"{k}: {', '.join(v)}" for k, v in p.registered.items()) or "-", p.error or "") for p in plugins]
           + [(name, "-", "-", "-", "left out by KVGEN_PLUGINS") for name in registry.excluded])
    return 0


PLAN = Command(_add_plan_args, cmd_plan)
COMPILE = Command(_add_compile_args, cmd_compile)
MODELS = Command(lambda p: None, cmd_models)
TARGETS = Command(lambda p: None, cmd_targets)
SCHEMES = Command(lambda p: None, cmd_schemes)
PLUGINS = Command(lambda p: None, cmd_plugins)


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def _command_name(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (kvgen's own options take no values, so it is the first non-option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _plugin_commands() -> dict[str, tuple[str, Callable]]:
    """Commands plugins registered: name -> (help, build). One named like a built-in is reported on its plugin
    (a warning at exit) and ignored: a plugin never replaces a kvgen command."""
    from kvgen.registry import default_registry

    registry = default_registry()
    out = {}
    for name, (_, help_text, build) in registry.commands.items():
        if name in COMMANDS:
            record = registry.owner("commands", name)
            record.fail("conflict", f"plugin {record.label} registers command {name!r}, which is kvgen's own; ignored")
            continue
        out[name] = (help_text, build)
    return out


def make_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser. Every command is listed; only ``command``'s arguments are built (all when None
    is given and no command is selected: e.g. for documentation, pass each name in turn)."""
    from kvgen import __version__

    parser = _Parser(prog="kvgen", description="A compiler for KV-cache attention.")
    parser.add_argument("--version", action="version", version=f"kvgen {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, required=True)
    entries: dict[str, tuple[str, Callable[[argparse.ArgumentParser], Callable]]] = {}
    for name, (help_text, path) in COMMANDS.items():
        def build(p, _path=path):
            target = _resolve(_path)
            target.add_args(p)
            return target.run
        entries[name] = (help_text, build)
    if command not in COMMANDS:  # --help, a plugin's command, or a typo: plugins' commands are listed too
        entries.update(_plugin_commands())
    for name, (help_text, build) in entries.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            p.set_defaults(_run=build(p))
            if not any(a.dest == "json" for a in p._actions):
                p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _warn_failed_plugins() -> None:
    """One stderr line per plugin that failed in what this run loaded (the command itself went on without it)."""
    from kvgen.registry import default_registry

    if "kvgen.registry" not in sys.modules or not default_registry.cache_info().currsize:
        return
    for record in default_registry().failed():
        print(f"kvgen: warning: plugin {record.label} failed and was skipped: {record.error} "
              f"(kvgen plugins shows every plugin's state)", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command = _command_name(argv)
        args = make_parser(command).parse_args(argv)
        if command in _MODEL_COMMANDS:
            _interpret_without_gpu(args)
        code = int(args._run(args) or 0)
        if args.command != "plugins":  # that one shows the failures as its output
            _warn_failed_plugins()
        return code
    except BrokenPipeError:
        return 0
    except Exception as exc:
        if not is_user_error(exc):
            raise
        print(f"kvgen: error: {exc}", file=sys.stderr)
        return 2


_MODEL_COMMANDS = ("generate", "serve")
"""Commands that run a model's kernels: without a GPU they use the Triton CPU interpreter."""


def _interpret_without_gpu(args: argparse.Namespace) -> None:
    """On a machine (or ``--device cpu``) without CUDA, switch Triton to its CPU interpreter.

    Must happen before triton is imported; a user who set TRITON_INTERPRET
    (either way) or already imported triton is left alone.
    """
    import os

    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    device = getattr(args, "device", None)
    if device is not None and not str(device).startswith("cpu"):
        return
    if device is None:
        import torch

        if torch.cuda.is_available():
            return
    os.environ["TRITON_INTERPRET"] = "1"
    print("kvgen: no GPU: the kernels run on the Triton CPU interpreter (slow; fine for small models)",
          file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
