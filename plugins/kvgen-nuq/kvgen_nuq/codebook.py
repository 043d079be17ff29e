"""Key normalization, 1-D k-means codebooks, and the codebook file format.

Everything here is plain torch and shared by the scheme's torch reference
(:mod:`kvgen_nuq.scheme`) and by calibration (:mod:`kvgen_nuq.calibrate`), so
the values the codebook is fitted on are normalized exactly as the kernels
normalize them. torch loads on first use (``lazy_import``): reading and
checking codebook files, and the float32 thresholds the kernels bake in
(:func:`level_midpoints`), are plain Python, so kvgen registers, plans and
compiles nuq4 without importing torch. A codebook is a tuple of 16 floats,
each exactly a float32 value.

Key normalization of one page (``k``: ``[..., P, D]``):

1. per token, the ``n_out`` entries of largest magnitude are *outliers*
   (kept apart in float16), chosen one at a time by ``argmax |k|`` with the
   lowest channel winning ties (what ``torch.argmax`` and Triton's
   ``tl.argmax(tie_break_left=True)`` both do);
2. per channel, over the page's remaining (inlier) entries:
   ``zero = (max + min) / 2``, ``scale = (max - min) / 2``, both rounded to
   float16; a channel with no inlier or no range gets ``scale = 0``;
3. ``x = (k - zero) / scale`` (float32, correctly rounded), so inliers lie in
   about ``[-1, 1]``; the 4-bit code is the nearest of 16 codebook levels,
   computed as the number of level midpoints ``x`` is above.

The normalized distribution depends on the page size (the group): with 16
tokens a channel's min and max are 1/8 of its values and the rest spread
almost evenly, with 128 tokens the values bunch in the middle. So the
codebook file (JSON) holds, per page size, one codebook per layer and one
``pooled`` codebook fitted on every layer's values at once; see
:func:`save_codebooks`.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from typing import TYPE_CHECKING, Any, Sequence

from kvgen.plugin_api import KvgenError, lazy_import, write_atomic

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")  # normalization, k-means and encoding only; files and checks never need it

LEVELS = 16
FORMAT = "kvgen-nuq-codebook/1"
OUTLIER_FRACTION = 0.01
"""Fraction of each token's key entries kept exactly (float16)."""


class CodebookError(KvgenError):
    """A codebook file that cannot be read or does not hold a valid 16-level codebook."""


def outliers_per_token(head_dim: int) -> int:
    """Outliers kept per token and KV head: 1% of ``head_dim`` rounded down, at least one."""
    return max(1, int(head_dim * OUTLIER_FRACTION))


# --------------------------------------------------------------------------- normalization


def split_outliers(k: torch.Tensor, n_out: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token (last axis = channels) the ``n_out`` largest-magnitude entries of float32 ``k``.

    Returns ``(idx int64 [..., n_out], val float32 [..., n_out], mask bool [..., D])``;
    ``val`` holds the exact float32 entries (the scheme stores them as float16).
    Selection is one ``argmax`` at a time, lowest channel first on ties, the same
    order the Triton ``store_page`` macro uses, so both pick the same channels.
    """
    a = k.abs()
    idx = []
    for _ in range(n_out):
        i = a.argmax(-1, keepdim=True)
        idx.append(i)
        a = a.scatter(-1, i, -1.0)
    index = torch.cat(idx, -1) if idx else torch.zeros(*k.shape[:-1], 0, dtype=torch.int64)
    mask = torch.zeros_like(k, dtype=torch.bool).scatter(-1, index, True)
    return index, k.gather(-1, index), mask


def channel_range(k: torch.Tensor, outlier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel over the tokens (axis -2) of float32 ``k``, ignoring ``outlier`` entries:
    ``(scale, zero)`` float16 ``[..., D]`` with ``x ~= zero + scale * u``, ``u`` in [-1, 1]."""
    inf = torch.tensor(float("inf"))
    mx = torch.where(outlier, -inf, k).amax(-2)
    mn = torch.where(outlier, inf, k).amin(-2)
    ok = mx >= mn
    mx = torch.where(ok, mx, torch.zeros_like(mx))
    mn = torch.where(ok, mn, torch.zeros_like(mn))
    return ((mx - mn) * 0.5).to(torch.float16), ((mx + mn) * 0.5).to(torch.float16)


def normalize(k: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``(k - zero) / scale`` in float32 against the float16 ``scale``/``zero`` of :func:`channel_range`
    (``[..., D]``, broadcast over tokens); channels with ``scale == 0`` divide by 1."""
    s = scale.float().unsqueeze(-2)
    z = zero.float().unsqueeze(-2)
    return (k - z) / torch.where(s > 0, s, torch.ones_like(s))


def normalized_inliers(k: torch.Tensor, page_size: int, n_out: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalized inlier values of keys ``[..., T, D]`` cut into pages, and their weights.

    What a codebook is fitted on: every entry the scheme encodes with the
    codebook (outliers and channels without range left out), as flat float32
    ``(x, w)``. The weight is the entry's squared channel scale: a level
    error ``du`` costs ``(scale * du)**2`` in the key, so weighting makes
    k-means minimize the key's squared error rather than the normalized one
    (unweighted, a few near-constant channels whose float16-rounded zero
    lands far from their values would pull a level out to |x| >> 1). A
    trailing partial page is dropped.
    """
    k = k.float()
    t, d = k.shape[-2], k.shape[-1]
    pages = t // page_size
    if pages == 0:
        return torch.zeros(0), torch.zeros(0)
    k = k[..., : pages * page_size, :].reshape(*k.shape[:-2], pages, page_size, d)
    _, _, mask = split_outliers(k, n_out if n_out is not None else outliers_per_token(d))
    scale, zero = channel_range(k, mask)
    x = normalize(k, scale, zero)
    s = scale.float().unsqueeze(-2).expand_as(x)
    keep = ~mask & (s > 0)
    return x[keep], s[keep] ** 2


# --------------------------------------------------------------------------- codebooks


def float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (as a Python float); OverflowError past float32's range."""
    return struct.unpack("f", struct.pack("f", x))[0]


def midpoints(codebook: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Float32 decision thresholds between consecutive (ascending) levels."""
    c = torch.as_tensor(codebook, dtype=torch.float32)
    return (c[:-1] + c[1:]) * 0.5


def level_midpoints(levels: Sequence[float]) -> tuple[float, ...]:
    """:func:`midpoints` without torch: the same float32 values, for float32 ``levels`` (a checked codebook).

    ``a + b`` of two float32 values is computed in float64 and rounded to float32: float64 carries more
    than twice float32's precision plus two bits, so the double rounding equals float32's own sum (and
    ``* 0.5`` is exact); a test compares this with :func:`midpoints` on every shipped codebook."""
    return tuple(float32(float32(a + b) * 0.5) for a, b in zip(levels[:-1], levels[1:]))


def encode(x: torch.Tensor, codebook: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Nearest-level codes of float32 ``x`` (int64): the number of midpoints ``x`` is above."""
    # bucketize(right=False) counts the midpoints strictly below x: the same as (x > mids).sum(-1).
    return torch.bucketize(x, midpoints(codebook).to(x.device), right=False)


def check_codebook(values: Sequence[float], what: str = "codebook") -> tuple[float, ...]:
    """16 finite, strictly ascending levels rounded to float32 (a tuple of floats), or CodebookError.

    Plain Python: loading and checking a codebook never imports torch."""
    try:
        cb = tuple(float32(float(v)) for v in values)
    except (TypeError, ValueError) as exc:
        raise CodebookError(f"{what}: expected {LEVELS} numbers ({exc}); refit it with 'kvgen nuq calibrate'") from None
    except OverflowError:  # beyond float32's range: infinite once stored as float32
        cb = (math.inf,)
    if len(cb) != LEVELS or not all(map(math.isfinite, cb)) or not all(b > a for a, b in zip(cb, cb[1:])):
        raise CodebookError(f"{what}: expected {LEVELS} finite, strictly ascending levels, got {values!r}; "
                            "refit it with 'kvgen nuq calibrate'")
    return cb


def fit_codebook(x: torch.Tensor, weights: torch.Tensor | None = None, levels: int = LEVELS, iters: int = 100,
                 max_samples: int = 4_000_000, seed: int = 0, bins: int = 2048) -> tuple[torch.Tensor, float]:
    """Weighted 1-D k-means of the values ``x``: ``(levels ascending float32, weighted mean squared error)``.

    Lloyd's iterations alone stall in local optima when clusters differ in
    size (two levels share one cluster while two clusters share one level).
    In one dimension the optimum is a dynamic program over sorted data, so:
    the values are binned into ``bins`` equal-width bins, the optimal
    partition of the bins into ``levels`` contiguous runs is found exactly
    (squared error from prefix sums), and Lloyd's iterations on the raw
    values then refine it (1-D Lloyd on sorted data: assignment is a
    ``searchsorted`` on the midpoints, the update a segment mean). At most
    ``max_samples`` values (a seeded random subset) are used. ``weights``
    (default all 1) weigh each value's squared error.
    """
    x = x.detach().flatten().to(torch.float64)
    w = torch.ones_like(x) if weights is None else weights.detach().flatten().to(torch.float64)
    ok = torch.isfinite(x) & torch.isfinite(w) & (w > 0)
    x, w = x[ok], w[ok]
    if x.numel() > max_samples:
        gen = torch.Generator().manual_seed(seed)
        pick = torch.randperm(x.numel(), generator=gen)[:max_samples]
        x, w = x[pick], w[pick]
    x, order = torch.sort(x)
    w = w[order]
    n = x.numel()
    lo, hi = (float(x[0]), float(x[-1])) if n else (0.0, 0.0)
    width = (hi - lo) / bins
    b = ((x - lo) / width).long().clamp_(0, bins - 1) if width > 0 else torch.zeros(n, dtype=torch.long)
    bw = torch.bincount(b, weights=w, minlength=bins)
    keep = bw > 0
    if int(keep.sum()) < levels:
        raise CodebookError(f"need at least {levels} distinct values to fit a codebook, got {int(keep.sum())} "
                            f"(of {n} values); give more calibration text")
    s1 = torch.bincount(b, weights=w * x, minlength=bins)[keep]
    s2 = torch.bincount(b, weights=w * x * x, minlength=bins)[keep]
    c = _optimal_partition(bw[keep], s1, s2, levels)
    zero = torch.zeros(1, dtype=torch.float64)
    cw = torch.cat([zero, torch.cumsum(w, 0)])
    cx = torch.cat([zero, torch.cumsum(w * x, 0)])
    for _ in range(iters):
        bounds = torch.searchsorted(x, (c[:-1] + c[1:]) * 0.5, right=True)
        edges = torch.cat([torch.zeros(1, dtype=torch.long), bounds, torch.tensor([n])])
        mass = cw[edges[1:]] - cw[edges[:-1]]
        new = torch.where(mass > 0, (cx[edges[1:]] - cx[edges[:-1]]) / mass.clamp(min=1e-300), c)
        done = torch.equal(new, c)
        c = new
        if done:
            break
    c32 = _spread(c.to(torch.float32).to(torch.float64), x).to(torch.float32)
    err = (x - c32.double()[encode(x.float(), c32)]) ** 2
    return c32, float((w * err).sum() / w.sum())


def _optimal_partition(w: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, levels: int) -> torch.Tensor:
    """Means of the minimum-squared-error split of weighted bins (counts, sums, sums of squares; all
    non-empty, in order) into ``levels`` contiguous non-empty runs."""
    m = w.numel()
    pw, p1, p2 = (torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(t, 0)]) for t in (w, s1, s2))
    i = torch.arange(m + 1)
    # cost[i, j]: squared error of bins i..j-1 as one cluster (j > i), inf otherwise
    cw = pw[None, :] - pw[:, None]
    cost = (p2[None, :] - p2[:, None]) - (p1[None, :] - p1[:, None]) ** 2 / cw.clamp(min=1e-300)
    cost = torch.where(i[None, :] > i[:, None], cost.clamp(min=0), torch.full_like(cost, float("inf")))
    best = cost[0].clone()                      # best[j]: first j bins in one cluster
    back = []
    for _ in range(levels - 1):
        total = best[:, None] + cost            # [split i, end j]
        best, arg = total.min(0)
        back.append(arg)
    cuts, j = [m], m
    for arg in reversed(back):
        j = int(arg[j])
        cuts.append(j)
    cuts = [0] + cuts[::-1]                     # [0, b1, ..., m]: levels non-empty runs
    return torch.stack([(p1[b] - p1[a]) / (pw[b] - pw[a]) for a, b in zip(cuts[:-1], cuts[1:])])


def _spread(c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Make levels strictly ascending (float32 rounding may merge two close levels)."""
    c = c.clone()
    span = float(x[-1] - x[0]) or 1.0
    eps = span * 1e-6
    for i in range(1, c.numel()):
        if c[i] <= c[i - 1]:
            c[i] = c[i - 1] + eps
    return c


# --------------------------------------------------------------------------- files


def save_codebooks(path: str | os.PathLike, fits: dict[int, dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write a codebook file (JSON) atomically.

    ``fits`` maps a page size to ``{"pooled": levels, "layers": [levels per
    layer], "stats": [...]}``. The file holds ``format``, ``levels``, the
    ``meta`` (model, text, tokens, key position...) and ``codebooks``: per
    page size (a string key, JSON objects have no integer keys) the
    ``pooled`` codebook (the one kvgen's kernels use today), the per-layer
    ``layers`` (for a runtime that can feed per-layer codebooks) and the fit
    statistics. Levels are float32 values written exactly. The write is
    atomic (kvgen's :func:`~kvgen.plugin_api.write_atomic`): a reader never
    sees half a file, and concurrent writers never share a temporary file.
    """
    data = {"format": FORMAT, "levels": LEVELS, **meta, "codebooks": {}}
    for page, fit in sorted(fits.items()):
        data["codebooks"][str(page)] = {
            "pooled": [float32(float(v)) for v in fit["pooled"]],
            "layers": [[float32(float(v)) for v in cb] for cb in fit["layers"]],
            "stats": fit.get("stats", []),
        }
    write_atomic(path, json.dumps(data, indent=1) + "\n")


MAX_FILE_BYTES = 16 * 2**20
"""Largest codebook file read (the shipped ones are under 100 KB; per-layer books of a 128-layer model ~1 MB)."""


def _read_bounded(path: str | os.PathLike | Any) -> str:
    """The text of a codebook file: a regular file of at most MAX_FILE_BYTES, else OSError/ValueError.

    Opened non-blocking and checked with fstat on the open descriptor: a FIFO
    would block the open (and the read) forever, a device such as /dev/zero
    would be read until memory runs out.
    """
    if not isinstance(path, (str, os.PathLike)):  # a shipped file (importlib Traversable): ours, small
        return path.read_text()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES >> 20} MiB")
    return data.decode("utf-8")


def load_codebooks(path: str | os.PathLike | Any) -> dict[str, Any]:
    """Read and validate a codebook file.

    Returns the file's data with ``codebooks`` as ``{page_size (int): {"pooled":
    levels, "layers": [levels], "stats": [...]}}``, levels as :func:`check_codebook` returns them
    (tuples of float32 values; no torch).
    """
    try:
        text = _read_bounded(path)
        data = json.loads(text)
    except (OSError, ValueError) as exc:
        raise CodebookError(f"cannot read codebook file {path}: {exc}; pass a file written by 'kvgen nuq calibrate'") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise CodebookError(f"{path} nests JSON too deeply to be a codebook file; pass a file written by "
                            "'kvgen nuq calibrate'") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("codebooks"), dict):
        raise CodebookError(f"{path} is not a {FORMAT} file; write one with 'kvgen nuq calibrate'")
    books = {}
    for page, fit in data["codebooks"].items():
        try:
            p = int(page)
        except ValueError:
            raise CodebookError(f"{path}: page size {page!r} is not an integer; refit it with 'kvgen nuq calibrate'") from None
        if not isinstance(fit, dict) or not isinstance(fit.get("layers", []), list):
            got = f"'layers' a JSON {type(fit['layers']).__name__}" if isinstance(fit, dict) else f"a JSON {type(fit).__name__}"
            raise CodebookError(f"{path}: page {p} must be an object with 'pooled' levels and a 'layers' list, got {got}; "
                                "refit it with 'kvgen nuq calibrate'")
        books[p] = {
            "pooled": check_codebook(fit.get("pooled", ()), f"{path}: page {p} pooled codebook"),
            "layers": [check_codebook(cb, f"{path}: page {p} layer {i} codebook") for i, cb in enumerate(fit.get("layers", []))],
            "stats": fit.get("stats", []),
        }
    if not books:
        raise CodebookError(f"{path} holds no codebook; refit it with 'kvgen nuq calibrate'")
    data["codebooks"] = books
    return data


def rms_error(x: torch.Tensor, codebook: torch.Tensor | Sequence[float], weights: torch.Tensor | None = None) -> float:
    """Root (weighted) mean squared quantization error of normalized values ``x`` under ``codebook``."""
    x = x.float().flatten()
    if x.numel() == 0:
        return 0.0
    codebook = torch.as_tensor(codebook, dtype=torch.float32)
    err = (x.double() - codebook.double()[encode(x, codebook)]) ** 2
    if weights is None:
        return math.sqrt(float(err.mean()))
    w = weights.double().flatten()
    return math.sqrt(float((w * err).sum() / w.sum()))
