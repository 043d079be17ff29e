"""Quality of each KV scheme on a real model and text, against a float32 cache.

The protocol (``kvgen eval``): the text is cut into windows
(:func:`kvgen.eval.assets.make_windows`); in each window the first half is
prefilled in one forward and the rest is decoded one token at a time through
the cache, teacher-forced (the true next token is fed, whatever the model
predicted). Every prediction of the window is scored; those made by decode
steps -- each reading the whole history back from the quantized cache -- are
counted apart (``decode_tokens``) and get their own metrics (``*_decode``).
The baseline is the same model and protocol with a float32 cache (scheme
``fp32``: pages stored exactly).

The prefill forward attends the prompt's own K/V exactly (compute dtype), as
serving systems attend a fresh prompt chunk, while it stores them in the
scheme's format; the decode steps then read everything from the stored form.
With one prefill per window, the prefill predictions therefore match the
baseline's up to float noise, and the scheme's cost shows in the decode
predictions. Both backends follow this rule (``KVCache.prefill(layer, q, k,
v)`` for the kernels, :mod:`kvgen.eval.cache` for the reference); result
rows say so with ``prefill_chunk_kv: "fresh"``.

Backends:

- ``reference``: :class:`kvgen.eval.cache.PagedReferenceCache`; the model's own
  attention runs in float32 over the K/V each scheme's torch reference
  produces. The baseline and every scheme are rows of one batch (same tokens,
  one scheme per row), so a decode step reads the weights once for all.
- ``kernels``: ``kvgen.integrations.transformers.attach(model, scheme=...)`` on
  a copy of the model per scheme: the generated kernels do the attention. The
  baseline is the reference backend's float32 row.
- ``auto``: kernels on CUDA, reference on the CPU (the Triton interpreter is
  far too slow for a 30-layer model).
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kvgen.errors import UnknownSchemeError
from kvgen.eval import BACKENDS, EvalError
from kvgen.eval.assets import Window
from kvgen.eval.cache import PagedReferenceCache
from kvgen.eval.metrics import SchemeScore, score
from kvgen.integrations.hf_config import head_dim as hf_head_dim
from kvgen.schemes import Scheme, parse_scheme_spec, resolve_scheme, unknown_scheme_error

BASELINE = "fp32"
PREFILL_CHUNK_KV = "fresh"
"""How a prefill forward attends its own tokens (result rows' ``prefill_chunk_kv``): exactly, from the fresh K/V.

Results of the earlier protocol (the chunk read back from the quantized pages) lack the key."""

Progress = Callable[[int], None]
"""Called with the number of forward passes just run (for a progress bar): 1 per prefill and per decode step.

Forward passes, not predictions: a prefill makes half a window's predictions
in one pass, so counting predictions made the time-left estimate far too low."""


def resolve_backend(backend: str, device: str) -> str:
    if backend not in BACKENDS:
        raise EvalError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "kernels" if torch.device(device).type == "cuda" else "reference"
    return backend


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"--device {device}: no CUDA device is available; use --device cpu")
    return device


def resolve_schemes(spec: str | Sequence[str], registry_schemes: dict[str, Scheme]) -> list[Scheme]:
    """Schemes named in ``spec`` ("int8,int4,nuq4:codebook=f.json", a list, or "all": every registered one
    but the fp32 baseline). Each item goes through :func:`kvgen.schemes.resolve_scheme`, so it may carry
    options; a scheme may appear several times with different options (rows are keyed by ``label``)."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not items:
        raise EvalError("--kv needs at least one scheme, e.g. --kv int8,int4 (see 'kvgen schemes') or --kv all")
    if items == ["all"]:
        return [registry_schemes[n] for n in sorted(registry_schemes, key=lambda n: (registry_schemes[n].precision_rank(), n))
                if n != BASELINE]
    unknown = [name for name in (parse_scheme_spec(n)[0] for n in items) if name not in registry_schemes]
    if unknown:
        # The shared error says when the scheme's plugin failed to load or KVGEN_PLUGINS left it out.
        error = unknown_scheme_error(unknown[0], registry_schemes)
        if len(unknown) > 1:
            error = UnknownSchemeError(f"{error}; also unknown: {', '.join(map(repr, unknown[1:]))}")
        raise error
    out: dict[str, Scheme] = {}
    for item in items:
        scheme = resolve_scheme(item, registry_schemes)
        out.setdefault(scheme.label, scheme)
    return list(out.values())


# -- running one window -----------------------------------------------------------------

def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _forward(model, ids: torch.Tensor, cache, cache_kw: str):
    kw = {} if cache is None else {cache_kw: cache}
    out = model(input_ids=ids, use_cache=True, **kw)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = getattr(out, "past_key_values", None)
    return out.logits, new_cache


@torch.inference_mode()
def run_window(model, ids: torch.Tensor, prefill: int, cache=None, progress: Progress | None = None) -> torch.Tensor:
    """Prefill ``ids[:, :prefill]`` in one forward, then decode ``ids[:, prefill:-1]`` one token a step.

    ``ids``: ``[B, n]``. ``cache``: the cache to fill (None: the model's default
    cache, i.e. plain float K/V). Returns float32 logits ``[B, n-1, V]``:
    position ``t`` predicts ``ids[:, t+1]``; the first ``prefill`` come from the prefill.
    """
    n = ids.shape[1]
    cache_kw = _cache_kwarg(model)  # inspect once per window, not per decoded token
    logits, cache = _forward(model, ids[:, :prefill], cache, cache_kw)
    steps = [logits.float()]
    if progress:
        progress(1)
    for t in range(prefill, n - 1):
        logits, cache = _forward(model, ids[:, t:t + 1], cache, cache_kw)
        steps.append(logits.float())
        if progress:
            progress(1)
    return torch.cat(steps, 1)


# -- the evaluation -------------------------------------------------------------------------

@dataclass
class EvalRun:
    """Everything ``evaluate`` needs besides the model and the windows."""

    model_name: str
    text_name: str
    schemes: list[Scheme]
    backend: str = "reference"
    page_size: int = 16
    window: int = 1024
    device: str = "cpu"


def evaluate(model, windows: Sequence[Window], run: EvalRun, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Score every scheme of ``run`` on ``windows``; one JSON-able dict per scheme (see ``result_row``)."""
    if not windows:
        raise EvalError("the text gave no window of 2 tokens or more; pass a longer text or a larger --max-tokens")
    head_dim = hf_head_dim(model.config)
    for s in run.schemes:
        s.check(head_dim, run.page_size)
    baseline = _baseline_scheme()
    scores = {s.label: SchemeScore() for s in run.schemes}
    compressed = {s.label: 0 for s in run.schemes}
    t0 = time.perf_counter()
    if run.backend == "reference":
        _evaluate_reference(model, windows, run, baseline, scores, compressed, progress)
    elif run.backend == "kernels":
        _evaluate_kernels(model, windows, run, baseline, scores, compressed, progress)
    else:
        raise EvalError(f"backend {run.backend!r} is not resolved; use reference or kernels")
    seconds = time.perf_counter() - t0
    return [result_row(run, s, scores[s.label], compressed[s.label], len(windows), seconds) for s in run.schemes]


def _baseline_scheme() -> Scheme:
    from kvgen.registry import default_registry

    scheme = default_registry().schemes.get(BASELINE)
    if scheme is None:
        raise EvalError(f"the baseline scheme {BASELINE!r} is not registered; is the built-in 'float' plugin installed?")
    return scheme


def _ids(window: Window, rows: int, device: str) -> torch.Tensor:
    return torch.tensor(window.ids, dtype=torch.long, device=device)[None].expand(rows, -1).contiguous()


def accumulate(score_: SchemeScore, base: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, p: int) -> None:
    """Add one window's scores: predictions before ``p`` came from the prefill forward, the rest from decode steps."""
    score_.prefill.add(score(base[:p], logits[:p], targets[:p]))
    if targets.shape[0] > p:
        score_.decode.add(score(base[p:], logits[p:], targets[p:]))


def _evaluate_reference(model, windows, run, baseline, scores, compressed, progress) -> None:
    rows = [baseline, *run.schemes]
    for w in windows:
        cache = PagedReferenceCache.for_model(model, rows, run.page_size)
        ids = _ids(w, len(rows), run.device)
        logits = run_window(model, ids, w.prefill, cache, progress)
        targets = ids[0, 1:]
        for r, s in enumerate(run.schemes, 1):
            accumulate(scores[s.label], logits[0], logits[r], targets, w.prefill)
            compressed[s.label] += cache.layers[0].num_compressed_pages(r)
        del logits, cache


def _evaluate_kernels(model, windows, run, baseline, scores, compressed, progress) -> None:
    attached = {s.label: attach_copy(model, s, run.page_size) for s in run.schemes}
    for w in windows:
        ids = _ids(w, 1, run.device)
        base = run_window(model, ids, w.prefill, PagedReferenceCache.for_model(model, [baseline], run.page_size),
                          progress)[0]
        targets = ids[0, 1:]
        for s in run.schemes:
            m, new_cache = attached[s.label]
            cache = new_cache()
            try:
                logits = run_window(m, ids, w.prefill, cache, progress)[0]
            finally:
                cache.release()  # the window's pages go back to the runtime's pool
            accumulate(scores[s.label], base, logits, targets, w.prefill)
            compressed[s.label] += s.compressed_pages(len(w.ids) - 1, run.page_size)


def attach_copy(model, scheme: Scheme, page_size: int):
    """(a copy of ``model`` on kvgen's generated kernels for ``scheme``, a function making a fresh cache).

    The model's attention runs the kernels only with the integration's
    ``KvgenCache`` passed as its cache (without one it falls back to SDPA), so
    every window gets a new cache from the runtime ``attach`` loaded.
    """
    try:
        from kvgen.integrations import transformers as integration
    except ImportError as exc:
        raise EvalError(f"--backend kernels needs kvgen.integrations.transformers ({exc}); "
                        "use --backend reference") from None
    m = copy.deepcopy(model)
    first = integration.attach(m, scheme=scheme.label, page_size=page_size)
    first.release()
    runtime = integration.runtime_of(m)
    return m, lambda: integration.KvgenCache(runtime)


def result_row(run: EvalRun, scheme: Scheme, sc: SchemeScore, compressed_pages: int, windows: int,
               seconds: float) -> dict[str, Any]:
    total, dec = sc.total().summary(), sc.decode.summary()
    return {
        "model": run.model_name,
        "text": run.text_name,
        "scheme": scheme.label,
        "backend": run.backend,
        "baseline": f"{BASELINE} cache, same protocol",
        "ppl": total["ppl"],
        "base_ppl": total["base_ppl"],
        "delta_ppl": total["delta_ppl"],
        "rel_delta_ppl": total["rel_delta_ppl"],
        "kl": total["kl"],
        "top1": total["top1"],
        "scored_tokens": sc.total().tokens,
        "decode_tokens": sc.decode.tokens,
        "prefill_tokens": sc.prefill.tokens,
        "ppl_decode": dec["ppl"],
        "base_ppl_decode": dec["base_ppl"],
        "rel_delta_ppl_decode": dec["rel_delta_ppl"],
        "kl_decode": dec["kl"],
        "top1_decode": dec["top1"],
        "windows": windows,
        "window": run.window,
        "page_size": run.page_size,
        "residual_tokens": scheme.residual_tokens,
        "compressed_pages": compressed_pages,
        "prefill_chunk_kv": PREFILL_CHUNK_KV,
        "seconds": round(seconds, 2),
    }
