"""A Hugging Face ``Cache`` that keeps K/V the way kvgen pages do, in plain torch.

This is the *reference backend* of ``kvgen eval``: the model's own attention
(sdpa or eager) runs in float32 over exactly the K/V a kvgen kernel would
see, computed with each scheme's torch reference (``quantize_page`` /
``dequantize_page``, the oracle the kernel tests pin), without the Triton
interpreter. Per layer and sequence:

- a per-token scheme (``residual_tokens is None``) quantizes every token when
  it is written. Tokens are cut into page-shaped chunks ``[*, page, D]`` (the
  tail chunk zero-padded: per-token schemes are token-local, so padding never
  changes a token's codes) and attention reads their dequantized values;
- a residual scheme keeps the last, partly filled page and its
  ``residual_tokens // page`` most recent full pages exact, in the compute
  dtype, and quantizes a full page with ``quantize_page`` once it leaves that
  window (``Scheme.compressed_pages`` says how many pages are compressed),
  exactly when the runtime's ``page_quantize`` would.

Which K/V attention gets from an update -- the same rule as the kernels
(``kvgen.integrations.transformers``: a forward of several tokens runs
``KVCache.prefill(layer, q, k, v)``, a one-token forward ``KVCache.decode``):

- a *prefill* step (more than one new token): the cached prefix as stored
  (dequantized pages, exact residual), then the step's own tokens exactly as
  given (``key_states``/``value_states`` in the compute dtype), as serving
  systems attend a fresh prompt chunk. The step's tokens are still written
  and quantized first, so pages leaving the residual window convert as in
  the runtime and later steps read the stored form;
- a *decode* step (one new token): everything as stored, the new token too
  (the decode kernel reads it back from the pages), except the pages that
  leave the residual window in this step: those exactly, as before their
  conversion (``KVCache.decode`` given k and v attends before the step's
  conversions: ``kvgen.runtime.preconversion``); later steps read them
  stored.

Quantized data never changes once written, so every layer keeps a float
*mirror* ``[B, H, capacity, D]`` of what is stored (dequantized pages,
exact residual tokens) and only does work for new tokens: a decode step costs
one token's quantization (or one page every ``page`` steps), not the whole
history. The compressed tensors themselves are kept too (``stored_pages``), so
a test can rebuild the mirror from storage.

Each batch row may use a different scheme (``schemes[b]``): ``kvgen eval``
runs the float32 baseline and every scheme as rows of one batch, so the
weights are read once per decode step for all of them. Rows must be fed the
same number of tokens at every step (no padding); the model needs no sliding
window. Quantization is vectorized across rows, heads and pages: each scheme
sees one ``quantize_page`` call of shape ``[rows * pages * H, page, D]`` per
update (the leading axis of the reference is a batch of independent
(page, head) blocks).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvgen.eval import EvalError
from kvgen.integrations.hf_config import head_dim, text_config
from kvgen.schemes import Scheme


class _Group:
    """The batch rows that share one scheme, and that scheme's stored pages."""

    def __init__(self, scheme: Scheme, rows: list[int]):
        self.scheme = scheme
        self.rows = rows
        self.index: torch.Tensor | None = None  # rows as a device tensor, set once the device is known
        self.num_compressed = 0  # compressed pages per row (all rows have the same length)
        self.stored: list[tuple[int, int, dict[str, torch.Tensor]]] = []
        """(first token, tokens, page tensors [rows, pages, H, *shape]) per quantize call."""


class PagedReferenceLayer(CacheLayerMixin):
    """One decoder layer's paged K/V for every batch row (see the module docstring)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, schemes: Sequence[Scheme], page_size: int = 16,
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.schemes = list(schemes)
        self.page_size = page_size
        self.compute_dtype = compute_dtype
        self.length = 0
        self.groups: list[_Group] = []
        by_name: dict[str, _Group] = {}
        for row, scheme in enumerate(self.schemes):
            group = by_name.get(scheme.label)  # the label: one scheme may appear with different options
            if group is None:
                group = by_name[scheme.label] = _Group(scheme, [])
                self.groups.append(group)
            group.rows.append(row)

    # -- HF layer API ---------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        if b != len(self.schemes):
            raise EvalError(f"the cache was built for {len(self.schemes)} batch rows (one scheme each), "
                            f"the model fed {b}; build it with one scheme per row")
        self.device = key_states.device
        for group in self.groups:
            group.index = torch.tensor(group.rows, device=self.device)
        self.num_kv_heads, self.head_dim = h, d
        self._alloc(4 * self.page_size)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        start, end = self.length, self.length + n
        k_new = key_states.to(self.compute_dtype)
        v_new = value_states.to(self.compute_dtype)
        # Room for the new tokens rounded up to whole pages (the pad of a per-token scheme's last chunk).
        self._reserve(-(-end // self.page_size) * self.page_size)
        self.keys[:, :, start:end] = k_new
        self.values[:, :, start:end] = v_new
        self.length = end
        exact = []  # decode: the pages this token pushes out of a residual window, read before their conversion
        for group in self.groups:
            if group.scheme.residual_tokens is None:
                self._quantize_tokens(group, start, end)
                continue
            a, b = self._leaving_window(group)
            if n == 1 and b > a:  # (advanced indexing: copies, taken before the mirror is overwritten)
                exact.append((group.index, a, b, self.keys[group.index, :, a:b], self.values[group.index, :, a:b]))
            self._quantize_full_pages(group)
        if n == 1:  # decode: the new token is read back from the pages too
            k, v = self.keys[:, :, :end], self.values[:, :, :end]
            if exact:
                k, v = k.clone(), v.clone()
                for rows, a, b, ek, ev in exact:
                    k[rows, :, a:b] = ek
                    v[rows, :, a:b] = ev
            return k, v
        # prefill: the stored prefix, then this step's tokens exactly
        return (torch.cat([self.keys[:, :, :start], k_new], dim=2),
                torch.cat([self.values[:, :, :start], v_new], dim=2))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.length = 0
        for group in self.groups:
            group.num_compressed = 0
            group.stored.clear()

    # generate() features this cache refuses on purpose (an EvalError, not a missing feature):
    # eval scores one prompt per scheme row, so nothing needs to rewind or regroup rows.
    def crop(self, tokens_to_remove: int) -> None:
        raise EvalError("a kvgen paged cache cannot be cropped (quantized pages are not reversible); do not use assisted decoding")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise EvalError("kvgen's reference cache holds one scheme per row; beam search is not supported, use greedy scoring")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise EvalError("kvgen's reference cache holds one scheme per row; it cannot be repeated (num_return_sequences=1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise EvalError("kvgen's reference cache holds one scheme per row; rows cannot be selected")

    # -- storage ----------------------------------------------------------------
    def _reserve(self, tokens: int) -> None:
        """Make the mirror hold ``tokens`` plus a page of pad (growing geometrically)."""
        need = tokens + self.page_size
        if need > self.keys.shape[-2]:
            self._alloc(max(need, 2 * self.keys.shape[-2]))

    def _alloc(self, capacity: int) -> None:
        shape = (len(self.schemes), self.num_kv_heads, capacity, self.head_dim)
        keys = torch.zeros(shape, dtype=self.compute_dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.compute_dtype, device=self.device)
        if self.keys is not None and self.length:
            keys[:, :, :self.length] = self.keys[:, :, :self.length]
            values[:, :, :self.length] = self.values[:, :, :self.length]
        self.keys, self.values = keys, values

    def _roundtrip(self, group: _Group, first: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``pages`` whole pages from token ``first`` of the group's rows; write back what is stored (dequantized)."""
        p, h, d = self.page_size, self.num_kv_heads, self.head_dim
        rows = group.rows
        sl = slice(first, first + pages * p)
        # [R, H, pages*P, D] -> [R, pages, H, P, D] -> [R*pages*H, P, D]: one block per (row, page, head).
        def blocks(x: torch.Tensor) -> torch.Tensor:
            x = x[group.index, :, sl] if len(rows) < len(self.schemes) else x[:, :, sl]
            return x.reshape(len(rows), h, pages, p, d).transpose(1, 2).reshape(-1, p, d).contiguous()

        kb, vb = blocks(self.keys), blocks(self.values)
        tensors = group.scheme.quantize_page(kb, vb)
        kd, vd = group.scheme.dequantize_page(tensors, d)
        group.stored.append((first, pages * p, {name: t.reshape(len(rows), pages, h, *t.shape[1:])
                                                for name, t in tensors.items()}))

        def back(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(len(rows), pages, h, p, d).transpose(1, 2).reshape(len(rows), h, pages * p, d)

        return back(kd).to(self.compute_dtype), back(vd).to(self.compute_dtype)

    def _write(self, group: _Group, start: int, end: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if len(group.rows) == len(self.schemes):
            self.keys[:, :, start:end] = k
            self.values[:, :, start:end] = v
        else:
            self.keys[group.index, :, start:end] = k
            self.values[group.index, :, start:end] = v

    def _quantize_tokens(self, group: _Group, start: int, end: int) -> None:
        """Per-token scheme: quantize tokens [start, end) in page-shaped chunks (tail zero-padded)."""
        p = self.page_size
        pages = -(-(end - start) // p)
        # Slots past `end` were never written (zeros): the pad of the last chunk. Only [start, end) is
        # written back, so they stay zero until real tokens land there.
        k, v = self._roundtrip(group, start, pages)
        n = end - start
        self._write(group, start, end, k[:, :, :n], v[:, :, :n])

    def _leaving_window(self, group: _Group) -> tuple[int, int]:
        """Residual scheme: the token range ``[a, b)`` of the full pages that left the residual window and are not
        compressed yet (empty: ``a == b``)."""
        target = max(group.scheme.compressed_pages(self.length, self.page_size), group.num_compressed)
        return group.num_compressed * self.page_size, target * self.page_size

    def _quantize_full_pages(self, group: _Group) -> None:
        """Residual scheme: compress the full pages that left the residual window."""
        first, last = self._leaving_window(group)
        if last <= first:
            return
        k, v = self._roundtrip(group, first, (last - first) // self.page_size)
        self._write(group, first, last, k, v)
        group.num_compressed = last // self.page_size

    # -- inspection ----------------------------------------------------------------
    def stored_pages(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of one row rebuilt from the stored compressed tensors plus the exact residual: ``[H, length, D]``."""
        group = next(g for g in self.groups if row in g.rows)
        r = group.rows.index(row)
        k = self.keys[row, :, :self.length].clone()
        v = self.values[row, :, :self.length].clone()
        p, d = self.page_size, self.head_dim
        for first, count, tensors in group.stored:
            pages = count // p
            flat = {name: t[r].reshape(pages * self.num_kv_heads, *t.shape[3:]) for name, t in tensors.items()}
            kd, vd = group.scheme.dequantize_page(flat, d)
            kd = kd.reshape(pages, self.num_kv_heads, p, d).transpose(0, 1).reshape(self.num_kv_heads, count, d)
            vd = vd.reshape(pages, self.num_kv_heads, p, d).transpose(0, 1).reshape(self.num_kv_heads, count, d)
            n = min(count, self.length - first)
            k[:, first:first + n] = kd[:, :n].to(k.dtype)
            v[:, first:first + n] = vd[:, :n].to(v.dtype)
        return k, v

    def num_compressed_pages(self, row: int) -> int:
        """Pages of ``row`` held compressed (for a per-token scheme: every page written)."""
        group = next(g for g in self.groups if row in g.rows)
        if group.scheme.residual_tokens is None:
            return -(-self.length // self.page_size)
        return group.num_compressed


class PagedReferenceCache(Cache):
    """A ``transformers`` Cache of :class:`PagedReferenceLayer`, one per decoder layer.

    ``schemes`` holds one scheme per batch row (a single scheme for the usual
    batch of one). Pass it to the model as its cache (``cache=`` in
    transformers 5, ``past_key_values=`` before) with ``use_cache=True``.
    """

    def __init__(self, schemes: Sequence[Scheme], num_layers: int, page_size: int = 16,
                 compute_dtype: torch.dtype = torch.float32):
        if not schemes:
            raise EvalError("a reference cache needs at least one scheme")
        for s in schemes:
            s.check_page_size(page_size)
        self.schemes = list(schemes)
        self.page_size = page_size
        super().__init__(layers=[PagedReferenceLayer(schemes, page_size, compute_dtype)
                                 for _ in range(num_layers)])

    @classmethod
    def for_model(cls, model, schemes: Sequence[Scheme], page_size: int = 16) -> "PagedReferenceCache":
        """A cache sized from ``model.config`` (decoder layers), in the model's dtype."""
        config = text_config(model.config)
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise EvalError(f"model {getattr(config, 'model_type', '?')} uses a sliding window; "
                            "kvgen eval's reference cache covers full attention only")
        for s in schemes:
            s.check(head_dim(model.config), page_size)
        dtype = next(model.parameters()).dtype
        return cls(schemes, config.num_hidden_layers, page_size, dtype)
