"""The pre-conversion view of a decode step (kvgen/runtime/preconversion.py): against a plain-Python model of
the block tables, on random tables with padding pairs, rows that convert nothing and rows with no compressed
page; and a real step's view against the block manager's books before and after it."""

from __future__ import annotations

import random

import torch

from kvgen.runtime.preconversion import pre_conversion_view


def _model(tables, ncomp, pairs):
    """Row by row: the last compressed entry that is some pair's dst becomes its src, one compressed page fewer."""
    dst_to_src = {d: s for s, d in pairs if s >= 0}
    out_t, out_n = [list(r) for r in tables], list(ncomp)
    for i, (row, n) in enumerate(zip(tables, ncomp)):
        if n > 0 and row[n - 1] in dst_to_src:
            out_t[i][n - 1] = dst_to_src[row[n - 1]]
            out_n[i] = n - 1
    return out_t, out_n


def test_matches_the_model_on_random_tables():
    rng = random.Random(0)
    for _ in range(50):
        B, W = rng.randint(1, 9), rng.randint(1, 7)
        ids = rng.sample(range(1000), B * W)  # compressed ids, distinct, as the block manager hands them out
        tables = [ids[i * W:(i + 1) * W] for i in range(B)]
        ncomp = [rng.randint(0, W) for _ in range(B)]
        converting = [i for i in range(B) if ncomp[i] > 0 and rng.random() < 0.5]
        pairs = [(rng.randrange(500), tables[i][ncomp[i] - 1]) for i in converting]
        rng.shuffle(pairs)
        pairs += [(-1, rng.randrange(1000))] * rng.randint(0, 3)  # a graph's padding: src -1, any dst
        src = torch.tensor([s for s, _ in pairs] or [-1], dtype=torch.int32)
        dst = torch.tensor([d for _, d in pairs] or [0], dtype=torch.int32)
        t = torch.tensor(tables, dtype=torch.int32)
        n = torch.tensor(ncomp, dtype=torch.int32)
        got_t, got_n = pre_conversion_view(t, n, src, dst)
        want_t, want_n = _model(tables, ncomp, pairs)
        assert got_t.tolist() == want_t and got_n.tolist() == want_n
        assert got_t.dtype == torch.int32 and got_n.dtype == torch.int32
        assert t.tolist() == tables and n.tolist() == ncomp  # the inputs are left as they were
        # into given buffers (a graph's static ones)
        bt, bn = torch.full_like(t, -7), torch.full_like(n, -7)
        rt, rn = pre_conversion_view(t, n, src, dst, bt, bn)
        assert rt is bt and rn is bn and bt.tolist() == want_t and bn.tolist() == want_n


def test_a_real_steps_view_is_the_books_before_it():
    """int4 with a residual window: plan a decode step that converts pages; its pre-conversion view is each
    sequence's table and compressed count as the block manager had them, with the converted page's residual id."""
    from kvgen.runtime.block_manager import BlockManager

    bm = BlockManager(4, 64, 32, 4)  # page 4, a residual window of one full page
    seqs = ["a", "b", "c"]
    for s, n in zip(seqs, (7, 8, 11)):  # the next token of "a" and "c" fills a page
        bm.add_sequence(s)
        bm.append(s, n)
    before = {s: (bm.block_table(s), bm.num_compressed(s)) for s in seqs}
    plan = bm.reserve_step(seqs, [1, 1, 1])
    conversions = [c for ph in plan.phases for c in ph.conversions]
    assert conversions, "the step should convert a page"
    tables, lens, ncomp = bm.step_view(seqs)
    W = max(map(len, tables))
    t = torch.tensor([list(r) + [0] * (W - len(r)) for r in tables], dtype=torch.int32)
    src = torch.tensor([s for s, _ in conversions], dtype=torch.int32)
    dst = torch.tensor([d for _, d in conversions], dtype=torch.int32)
    pt, pn = pre_conversion_view(t, torch.tensor(list(ncomp), dtype=torch.int32), src, dst)
    for i, s in enumerate(seqs):
        old_table, old_nc = before[s]
        assert int(pn[i]) == old_nc
        # the pages the sequence had keep their ids in the view (the new token's page, if any, follows)
        assert pt[i, :len(old_table)].tolist() == list(old_table)
