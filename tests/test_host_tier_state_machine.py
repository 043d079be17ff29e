"""The runtime state machine (tests/test_runtime_state_machine.py) with a host tier.

Besides add / fork / free / steps, random ``swap_out`` (several sequences at
once, forks sharing pages included), ``swap_in`` and ``make_cold`` calls; the
device pool is small, so prefix-cache pages are evicted -- and spilled to the
host -- and later prompts restore them. After every rule the page books of
all four pools (device and host, compressed and residual) must balance; after
every step and every tier move each affected sequence's ``read_kv`` (which
reads host pages where they are) must equal what was written into it; decode
outputs of steps whose sequences hold cold pages are checked against the
float64 reference as in the base machine.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvgen.registry import default_registry
from kvgen.runtime import KvgenRuntimeError, OutOfPages

from .kernels import harness as hz
from .test_runtime_state_machine import D, HQ, RuntimeMachine, case

# (scheme, compute dtype, page size, layers, examples); budget: about 60 s on 2 CPU cores.
CASES = [
    ("int4", "float32", 8, 2, 12),
    ("fp16", "float16", 8, 1, 12),
    ("int2:residual=16", "float32", 16, 1, 12),
]
CASES = [c for c in CASES if c[0].split(":")[0] in default_registry().schemes]


class TieredMachine(RuntimeMachine):
    HOST_TOKENS = 12 * 16
    MAX_SEQS = 8  # room for the tails of a full batch: steps with cold pages mostly fit
    STATS: Counter = Counter()  # what the examples exercised, checked by the test

    def __init__(self) -> None:
        super().__init__()
        plan_step = self.cache.plan_step

        def counted(*args, **kwargs):
            step = plan_step(*args, **kwargs)
            self.STATS["cold steps"] += step.cold is not None
            return step
        self.cache.plan_step = counted
        add = self.cache.block_manager.add_sequence_plan

        def add_counted(*args, **kwargs):
            hit, plan = add(*args, **kwargs)
            self.STATS["restored pages"] += len(plan.to_device)
            return hit, plan
        self.cache.block_manager.add_sequence_plan = add_counted

    def _check(self, sids) -> None:
        keep = self.tokens
        self.tokens = {s: keep[s] for s in sids if s in keep}
        try:
            self._check_contents()
        finally:
            self.tokens = keep

    @precondition(lambda self: self._steppable())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        if data.draw(st.integers(0, 2)):  # a third as often as other rules: swapped sequences do not step
            return
        ids = data.draw(st.lists(st.sampled_from(self._steppable()), min_size=1, max_size=3, unique=True))
        before = self._snapshot()
        try:
            self.cache.swap_out(ids)
        except OutOfPages:
            assert self._snapshot() == before, "OutOfPages changed the runtime's state"
            return
        assert all(self.bm.is_swapped(s) for s in ids)
        self.STATS["swap_out"] += 1
        self._check(ids)
        if data.draw(st.booleans()):  # straight back: a round trip
            self._swap_in(ids)

    @precondition(lambda self: any(self.bm.host_pages(s) for s in self.tokens))
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        on_host = [s for s in sorted(self.tokens) if self.bm.host_pages(s)]
        self._swap_in(data.draw(st.lists(st.sampled_from(on_host), min_size=1, max_size=3, unique=True)))

    def _swap_in(self, ids: list) -> None:
        before = self._snapshot()
        try:
            self.cache.swap_in(ids)
        except OutOfPages:
            assert self._snapshot() == before, "OutOfPages changed the runtime's state"
            return
        assert not any(self.bm.host_pages(s) for s in ids)
        self.STATS["swap_in"] += 1
        self._check(ids)

    @precondition(lambda self: self._steppable())
    @rule(data=st.data())
    def make_cold(self, data) -> None:
        sid = data.draw(st.sampled_from(self._steppable()))
        limit = min(self.bm.num_compressed(sid), self.bm.seq_len(sid) // self.c.page)
        if limit == 0 and not self._grow(sid):
            return
        limit = min(self.bm.num_compressed(sid), self.bm.seq_len(sid) // self.c.page)
        before = self._snapshot()
        try:
            self.cache.make_cold(sid, data.draw(st.sampled_from([limit, limit, max(0, limit - 1), 0])))
            self.STATS["cold pages"] += self.bm.host_pages(sid)
        except OutOfPages:
            assert self._snapshot() == before, "OutOfPages changed the runtime's state"
            return
        self._check([sid])
        if self.bm.host_pages(sid):  # decode it (with a few others): its cold pages go through the ring
            others = [s for s in self._steppable() if s != sid]
            self._decode([sid] + others[:data.draw(st.integers(0, min(2, len(others))))])

    @precondition(lambda self: self._steppable() and any(self.bm.host_pages(s) for s in self.tokens))
    @rule(data=st.data(), op=st.sampled_from(["swap_in", "restore"]))
    def tier_op_between_plan_and_run(self, data, op: str) -> None:
        """A swap-in or a prefix restore between planning a decode step and running its layers (both hand out
        device pages). The step then runs and gives the expected KV, or it is stale -- it names the swapped
        sequence, or its conversions read pages planning released -- and says so; its sequences are freed."""
        batch = data.draw(st.lists(st.sampled_from(self._steppable()), min_size=1, max_size=3, unique=True))
        new = [[int(x) for x in torch.randint(0, 1000, (1,), generator=self.gen)] for _ in batch]
        before = self._snapshot()
        nc_before = {s: self.bm.num_compressed(s) for s in batch}
        try:
            planned = self.cache.plan_step(batch, 1, token_ids=new)
        except OutOfPages:
            assert self._snapshot() == before, "OutOfPages changed the runtime's state"
            return
        for sid, toks in zip(batch, new):
            self.tokens[sid] = self.tokens[sid] + toks
        if op == "swap_in":
            mover = data.draw(st.sampled_from([s for s in sorted(self.tokens) if self.bm.host_pages(s)]))
            try:
                self.cache.swap_in([mover])
            except OutOfPages:
                pass
            else:
                if mover not in batch:  # (a batch sequence's new token is planned, not written yet)
                    self._check([mover])
        else:
            sid, self.next_id = self.next_id, self.next_id + 1
            prompt = data.draw(st.sampled_from(self.history))
            hit = self.cache.add(sid, prompt)
            self.tokens[sid] = prompt[:hit]
        try:
            self._run_decode(batch, self._read_compressed(planned, batch, nc_before, True))
        except KvgenRuntimeError as e:
            assert "after this step was planned" in str(e), e
            self.STATS["stale steps"] += 1
            for sid in batch:  # planned, never written: a caller drops (or replans) them
                self.cache.free(sid)
                del self.tokens[sid]
            return
        self.STATS["steps across a tier op"] += 1
        self._check(batch)

    def _grow(self, sid) -> bool:
        """Prefill the sequence past its residual window, so it has a full compressed page to make cold."""
        P = self.c.page
        window = (self.bm.residual_tokens or 0) // P
        n = (window + 1) * P + P - self.bm.seq_len(sid) % P
        new = [[int(x) for x in torch.randint(0, 1000, (n,), generator=self.gen)]]
        try:
            self.cache.plan_step([sid], [n], token_ids=new)
        except OutOfPages:
            return False
        start = len(self.tokens[sid])
        self.tokens[sid] = self.tokens[sid] + new[0]
        for layer in range(self.c.layers):
            k, v = self._kv(layer, sid, start, start + n)
            q = torch.randn(n, HQ, D, generator=self.gen).to(self.c.dtype)
            self.cache.prefill(layer, q, k.to(self.c.dtype), v.to(self.c.dtype), [sid])
        return True

    def _decode(self, batch: list) -> None:
        new = [[int(x) for x in torch.randint(0, 1000, (1,), generator=self.gen)] for _ in batch]
        before = self._snapshot()
        try:
            step = self.cache.plan_step(batch, 1, token_ids=new)
        except OutOfPages:
            assert self._snapshot() == before, "OutOfPages changed the runtime's state"
            return
        assert step.cold is not None
        self.STATS["cold decodes"] += 1
        for sid, toks in zip(batch, new):
            self.tokens[sid] = self.tokens[sid] + toks
        self._run_decode(batch)
        self._check(batch)

    def _run_decode(self, batch: list, nc: dict | None = None) -> None:
        """Every layer of the planned decode step: each sequence's newest token's K/V written, outputs checked
        (``nc``: per sequence, the pages read compressed, :meth:`_read_compressed`; default: the books)."""
        for layer in range(self.c.layers):
            parts = [self._kv(layer, s, len(self.tokens[s]) - 1, len(self.tokens[s])) for s in batch]
            k = torch.cat([p[0] for p in parts]).to(self.c.dtype)
            v = torch.cat([p[1] for p in parts]).to(self.c.dtype)
            q = torch.randn(len(batch), HQ, D, generator=self.gen).to(self.c.dtype)
            out = self.cache.decode(layer, q, batch, k, v)
            self._check_decode(layer, batch, q, out, nc)


@pytest.mark.parametrize("kv, dtype, page, layers, examples", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_host_tier_state_machine(kv, dtype, page, layers, examples):
    reason = hz.skip_reason(default_registry().scheme(kv))
    if reason:
        pytest.skip(reason)
    machine = type(f"Tiered_{kv}", (TieredMachine,), {"CASE": (kv, dtype, page, layers), "HOST_TOKENS": 12 * page})
    case(kv, dtype, page, layers)
    test = machine.TestCase
    test.settings = settings(max_examples=examples, stateful_step_count=30, deadline=None, derandomize=True,
                             suppress_health_check=list(HealthCheck), print_blob=True,
                             database=None, phases=(Phase.explicit, Phase.generate))  # reproducible; no slow shrinking
    TieredMachine.STATS.clear()
    test("runTest").runTest()
    stats = TieredMachine.STATS
    print(dict(stats))
    assert stats["swap_out"] and stats["swap_in"] and stats["cold decodes"], stats
    assert stats["steps across a tier op"], stats
