"""The ``kvgen`` command group. Each command is a thin call into the library.

A KvgenError (a user mistake) prints one line -- what was wrong and what to
do -- and exits 2; so do argument errors. Every command takes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from kvgen.errors import KvgenError


class UsageError(KvgenError):
    """Bad command-line arguments."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + traceback
        raise UsageError(f"{self.prog}: {message}; run '{self.prog} --help' for usage")


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*[str(x) for x in r])
    Console(width=200).print(table)


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
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import COMPUTE_DTYPES, Workload
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
                        page_size=page, compute_dtype=dtype, host_memory_bytes=int(args.host_memory * 2**30))
    model = resolve_model(args.model)
    target = detect_target() if args.target == "auto" else resolve_target(args.target)
    return make_plan(model, target, workload, default_registry().schemes, kv=args.kv)


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


def cmd_compile(args) -> int:
    from kvgen.codegen.package import compile_plan

    plan = build_plan(args)
    result = compile_plan(plan, out_dir=args.out)
    if args.json:
        _print_json(result.to_json())
    else:
        print(f"compiled {plan.name} -> {result.out_dir} ({len(result.files)} files, "
              f"{'unchanged' if result.unchanged else 'written'}, {result.seconds:.2f} s)")
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

    plugins = default_registry().plugins
    if args.json:
        _print_json([p.to_json() for p in plugins])
        return 0
    _table("plugins", ["name", "module", "distribution", "registered", "error"],
           [(p.name, p.module, p.distribution or "-",
             "; ".join(f"{k}: {', '.join(v)}" for k, v in p.registered.items()) or "-", p.error or "") for p in plugins])
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None] | None, Callable]] = {
    "plan": ("plan the KV cache of a model on a GPU", _add_plan_args, cmd_plan),
    "compile": ("plan, then generate the kernels and runtime package", None, cmd_compile),
    "models": ("list model presets", None, cmd_models),
    "targets": ("list GPU targets", None, cmd_targets),
    "schemes": ("list KV compression schemes", None, cmd_schemes),
    "plugins": ("list plugins and what each registered", None, cmd_plugins),
    "eval": ("perplexity, KL and top-1 of KV schemes on a real model and text, vs a float32 cache",
             __import__("kvgen.eval.command", fromlist=["add_args"]).add_args,
             __import__("kvgen.eval.command", fromlist=["run"]).run),
}


def _add_compile_args(p: argparse.ArgumentParser) -> None:
    _add_plan_args(p)
    p.add_argument("--out", default=None, help="output folder (default generated/<plan-name>)")


def make_parser() -> argparse.ArgumentParser:
    from kvgen import __version__

    parser = _Parser(prog="kvgen", description="A compiler for KV-cache attention.")
    parser.add_argument("--version", action="version", version=f"kvgen {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, required=True)
    for name, (help_text, add_args, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        (add_args or (_add_compile_args if name == "compile" else (lambda _p: None)))(p)
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    for name, (_, help_text, builder) in _plugin_commands().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_run=builder(p))
        if not any(a.dest == "json" for a in p._actions):
            p.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _plugin_commands() -> dict:
    from kvgen.registry import default_registry

    return {name: entry for name, entry in default_registry().commands.items() if name not in COMMANDS}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = make_parser()
        args = parser.parse_args(argv)
        run = getattr(args, "_run", None) or COMMANDS[args.command][2]
        return int(run(args) or 0)
    except KvgenError as exc:
        print(f"kvgen: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
