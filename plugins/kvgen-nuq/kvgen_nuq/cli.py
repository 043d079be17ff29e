"""``kvgen nuq ...``: the plugin's command group, added through ``kvgen_register_commands``.

kvgen creates the ``nuq`` subcommand parser and calls :func:`build` with it;
``build`` adds a nested group (``calibrate``, ``show``) and returns the
``run(args) -> int`` kvgen calls after parsing. Each command is a thin call
into the library, like kvgen's own.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

HELP = "nuq4 scheme tools: fit key codebooks on a model (calibrate), print a codebook (show)"


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def cmd_calibrate(args) -> int:
    from kvgen_nuq.calibrate import calibrate

    summary = calibrate(args.model_path, args.text, args.out, page_sizes=args.page_sizes, window=args.window,
                        max_tokens=args.max_tokens, keys=args.keys, gguf_file=args.gguf_file)
    if args.json:
        _print_json(summary)
        return 0
    print(f"wrote {summary['out']}: {summary['model']} on {summary['tokens']:,} tokens of {summary['text']} "
          f"({summary['keys']} keys), codebooks for pages {', '.join(str(p) for p in summary['codebooks'])}")
    for page, fit in summary["codebooks"].items():
        stats = fit["stats"]
        mean = {k: sum(s[k] for s in stats) / len(stats) for k in ("rms_layer", "rms_pooled", "rms_uniform")}
        print(f"  page {page:>3}: pooled {' '.join(f'{c:+.3f}' for c in fit['pooled'])}")
        print(f"            rms error of normalized keys, mean over {len(stats)} layers: layer codebook "
              f"{mean['rms_layer']:.4f}, pooled {mean['rms_pooled']:.4f}, uniform levels {mean['rms_uniform']:.4f}")
    return 0


def cmd_show(args) -> int:
    from kvgen_nuq.codebook import load_codebooks
    from kvgen_nuq.scheme import codebook_path

    path = args.file or codebook_path()
    data = load_codebooks(path)
    books = {p: {"pooled": [float(c) for c in b["pooled"]], "layers": [[float(c) for c in cb] for cb in b["layers"]]}
             for p, b in data["codebooks"].items()}
    if args.json:
        _print_json({"file": str(path), "model": data.get("model"), "keys": data.get("keys"), "codebooks": books})
        return 0
    print(f"codebooks {path}: {data.get('model', '?')}, {data.get('keys', '?')} keys, {data.get('tokens', '?')} tokens")
    for page, b in books.items():
        print(f"  page {page:>3} pooled: {' '.join(f'{c:+.4f}' for c in b['pooled'])}")
        if args.layers:
            for i, cb in enumerate(b["layers"]):
                print(f"      layer {i:>2}: {' '.join(f'{c:+.4f}' for c in cb)}")
    return 0


def _page_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated page sizes like 16,64, got {text!r}") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"page sizes must be at least 2 tokens, got {text!r}")
    return sizes


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def build(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add the ``nuq`` group's subcommands to ``parser``; return the dispatcher kvgen runs."""
    parser.add_argument("--json", action="store_true", help="print JSON")
    sub = parser.add_subparsers(dest="nuq_command", required=True, metavar="{calibrate,show}")

    cal = sub.add_parser("calibrate", help="fit nuq4 key codebooks (per layer + pooled) on a model's keys",
                         description="Run a Hugging Face model over a text, collect its keys per layer, "
                                     "fit 16-level codebooks by k-means and write them as JSON.")
    cal.add_argument("--model-path", required=True, help="local Hugging Face model folder")
    cal.add_argument("--text", required=True, help="calibration text file (documents may be split by <|endoftext|>)")
    cal.add_argument("--out", required=True, help="codebook file to write (JSON)")
    cal.add_argument("--gguf-file", default=None, help="GGUF file name inside --model-path (needs the gguf package)")
    cal.add_argument("--page-sizes", type=_page_sizes, default=(8, 16, 32, 64, 128),
                     help="page sizes (the key group) to fit codebooks for, comma-separated (default 8,16,32,64,128)")
    cal.add_argument("--window", type=_positive, default=None, help="tokens per forward pass (default min(1024, max positions))")
    cal.add_argument("--max-tokens", type=_positive, default=65536, help="calibration tokens to use at most (default 65536)")
    cal.add_argument("--keys", choices=("post-rope", "pre-rope"), default="post-rope",
                     help="post-rope: keys as cached, what kvgen quantizes (default); pre-rope: k_proj outputs")
    cal.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    cal.set_defaults(_nuq_run=cmd_calibrate)

    show = sub.add_parser("show", help="print a codebook file (default: the one nuq4 uses)")
    show.add_argument("file", nargs="?", default=None, help="codebook file (default: $KVGEN_NUQ_CODEBOOK or the shipped one)")
    show.add_argument("--layers", action="store_true", help="also print the per-layer codebooks")
    show.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    show.set_defaults(_nuq_run=cmd_show)

    def run(args: argparse.Namespace) -> int:
        return args._nuq_run(args)

    return run
