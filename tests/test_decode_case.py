"""benchmarks.run.DecodeCase on the CPU: the pages and pools a decode benchmark times, at lengths that end inside a
page (the runtime's usual case: int4 keeps such a tail page in its residual pool)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.run import PAGE, DecodeCase
from kvgen.registry import default_registry


def _case(scheme: str, L: int) -> DecodeCase:
    return DecodeCase(default_registry().schemes[scheme], 2, L, 4, 2, 64, dtype=torch.float16, device="cpu")


@pytest.mark.parametrize("L", [37, 48])
def test_int4_keeps_whole_pages_compressed_and_the_tail_in_its_residual_pool(L):
    case = _case("int4", L)
    full, rest = divmod(L, PAGE)
    assert case.block_tables.shape == (2, full + (rest > 0))
    assert case.seq_lens.tolist() == [L, L] and case.num_compressed.tolist() == [full, full]
    assert case.k_raw.shape == (2, 2, L, 64)
    scheme = default_registry().schemes["int4"]
    for b in range(2):
        if rest:  # the tail page's written rows are the sequence's last tokens, exactly
            rid = int(case.block_tables[b, full])
            assert torch.equal(case.pools["rk"][rid][:, :rest], case.k_raw[b][:, full * PAGE:])
            assert torch.equal(case.pools["rv"][rid][:, :rest], case.v_raw[b][:, full * PAGE:])
        # a compressed page holds its tokens within int4's error
        pid = int(case.block_tables[b, 0])
        k, v = scheme.dequantize_page({n: case.pools[n][pid] for n in case.pools if n not in ("rk", "rv")}, 64)
        for got, want in ((k, case.k_raw[b][:, :PAGE]), (v, case.v_raw[b][:, :PAGE])):
            err = (got.float() - want.float()).norm() / want.float().norm()
            assert 0 < err < 0.2
    # bytes: the compressed pages whole, the residual pool's rows as written
    per_page = sum(case.pools[t.name][0].numel() * case.pools[t.name].element_size()
                   for t in scheme.page_tensors(64, PAGE))
    assert case.bytes == 2 * (full * per_page + rest * 2 * 2 * 64 * 2) + case.block_tables.numel() * 4


def test_int8_quantizes_a_partial_last_page_and_the_reference_sees_only_written_tokens():
    case = _case("int8", 37)
    assert case.num_compressed.tolist() == [3, 3] and case.block_tables.shape == (2, 3)
    q = case.q.float().view(2, 2, 2, 64)
    for b in range(2):
        s = torch.einsum("hgd,hld->hgl", q[b], case.k_raw[b].float()) / 8.0
        want = torch.einsum("hgl,hld->hgd", s.softmax(-1), case.v_raw[b].float()).reshape(4, 64)
        assert torch.allclose(case.reference()[b], want, atol=1e-5)
