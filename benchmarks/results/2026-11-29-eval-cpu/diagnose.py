"""Where a scheme's error comes from: keys vs values, which layers, outlier channels.

Runs kvgen eval's protocol (prefill half a window, decode the rest through the
reference cache) with extra batch rows, each a variant of a scheme:

    int2        the scheme on every layer, keys and values (as kvgen eval)
    int2:k      keys quantized, values exact        int2:v   values quantized, keys exact
    int2@0-9    the scheme on layers 0..9 only (fp32 pages elsewhere)

and prints the same metrics as kvgen eval per row, plus (with --stats) K/V
outlier statistics of the float32 baseline per layer. Example (from the repo root):

    .venv/bin/python benchmarks/results/2026-11-29-eval-cpu/diagnose.py --smollm2 \
        --text ../shared/data/text/tinyshakespeare.txt --window 1024 --max-tokens 2048 \
        --rows int2,int2:k,int2:v,int2@0-9,int2@10-19,int2@20-29 --json-out diag.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers.cache_utils import Cache

from kvgen.eval import assets
from kvgen.eval.cache import PagedReferenceLayer
from kvgen.eval.command import print_table
from kvgen.eval.metrics import SchemeScore
from kvgen.eval.runner import EvalRun, accumulate, result_row, run_window
from kvgen.registry import default_registry
from kvgen.schemes import Scheme


class Part(Scheme):
    """``inner`` on keys only (``which="k"``) or values only (``"v"``); the other half stays exact."""

    def __init__(self, inner: Scheme, which: str):
        self.inner, self.which = inner, which
        self.name = f"{inner.name}:{which}"
        self.bits = inner.bits
        self.residual_tokens = inner.residual_tokens
        self.page_sizes = inner.page_sizes
        self.head_dims = inner.head_dims

    def quantize_page(self, k, v):
        return {**self.inner.quantize_page(k, v), "_k": k.float().clone(), "_v": v.float().clone()}

    def dequantize_page(self, tensors, head_dim):
        kd, vd = self.inner.dequantize_page({n: t for n, t in tensors.items() if not n.startswith("_")}, head_dim)
        return (kd, tensors["_v"]) if self.which == "k" else (tensors["_k"], vd)


def parse_row(spec: str, reg: dict[str, Scheme], num_layers: int) -> tuple[str, Scheme, set[int]]:
    layers = set(range(num_layers))
    if "@" in spec:
        spec, rng = spec.split("@")
        lo, hi = (int(x) for x in rng.split("-"))
        layers = set(range(lo, hi + 1))
    name, _, part = spec.partition(":")
    scheme = reg[name] if not part else Part(reg[name], part)
    label = spec + (f"@{min(layers)}-{max(layers)}" if len(layers) < num_layers else "")
    return label, scheme, layers


def outlier_stats(cache: Cache, length: int) -> list[dict]:
    """Per layer, from the float32 row: how uneven K and V are across channels and within tokens."""
    out = []
    for i, layer in enumerate(cache.layers):
        k = layer.keys[0, :, :length].float()   # [H, T, D]
        v = layer.values[0, :, :length].float()
        row = {"layer": i}
        for name, x in (("k", k), ("v", v)):
            ch = x.abs().amax(1)                                  # [H, D] channel absmax over tokens
            row[f"{name}_channel_max_over_median"] = (ch.amax(-1) / ch.median(-1).values).max().item()
            tok = x.abs().amax(-1) / x.abs().mean(-1)             # per-token absmax / mean |x|
            row[f"{name}_token_max_over_mean"] = tok.mean().item()
            row[f"{name}_absmax"] = x.abs().max().item()
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path")
    p.add_argument("--gguf")
    p.add_argument("--smollm2", action="store_true", help="the fetched SmolLM2 (kvgen eval --fetch smollm2)")
    p.add_argument("--text", required=True)
    p.add_argument("--rows", required=True, help="comma-separated row specs (see the module docstring)")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--windows", default=None, help="START:END")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--stats", action="store_true", help="print K/V outlier statistics per layer (first window)")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.smollm2:
        f = assets.fetch("smollm2")
        args.model_path, args.gguf = str(f.model_path), f.gguf
    model, tok = assets.load_model(args.model_path, args.gguf)
    reg = default_registry().schemes
    num_layers = model.config.num_hidden_layers
    rows = [parse_row(s, reg, num_layers) for s in args.rows.split(",")]
    docs = assets.tokenize_text(tok, Path(args.text).read_text())
    windows = assets.make_windows(docs, args.window, args.max_tokens)
    if args.windows:
        a, b = (int(x) for x in args.windows.split(":"))
        windows = windows[a:b]
    fp32 = reg["fp32"]
    scores = [SchemeScore() for _ in rows]
    stats = None
    for wi, w in enumerate(windows):
        layer_rows = [[fp32] + [s if i in layers else fp32 for _, s, layers in rows] for i in range(num_layers)]
        cache = Cache(layers=[PagedReferenceLayer(sch, args.page_size) for sch in layer_rows])
        ids = torch.tensor(w.ids)[None].expand(len(rows) + 1, -1).contiguous()
        logits = run_window(model, ids, w.prefill, cache)
        for r in range(len(rows)):
            accumulate(scores[r], logits[0], logits[r + 1], ids[0, 1:], w.prefill)
        if args.stats and stats is None:
            stats = outlier_stats(cache, len(w.ids) - 1)
        print(f"window {wi + 1}/{len(windows)} done", file=sys.stderr, flush=True)
    run = EvalRun(args.gguf or Path(args.model_path).name, Path(args.text).name, [], page_size=args.page_size,
                  window=args.window)
    out = []
    for (label, scheme, _), sc in zip(rows, scores):
        row = result_row(run, scheme, sc, 0, len(windows), 0.0)
        row["scheme"] = label
        out.append(row)
    print_table(out)
    if stats:
        print(json.dumps(stats, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": out, "outliers": stats}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
