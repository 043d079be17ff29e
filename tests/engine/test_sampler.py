"""Sampling statistics and seeds: chi-square against the filtered softmax, not snapshots."""

from __future__ import annotations

import torch

from kvgen.engine.sampler import SampleSlot, filter_logits, sample
from kvgen.engine.sampling_params import SamplingParams

# chi-square critical values at p = 0.001 by degrees of freedom (a true sampler fails 1 in 1000 runs)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def expected(params: SamplingParams) -> torch.Tensor:
    """The distribution the definitions give (vLLM's order: top-k, then top-p on what is left, then
    min-p), computed independently of the sampler in float64."""
    p = torch.softmax(LOGITS.double() / params.temperature, 0)
    order = torch.argsort(p, descending=True).tolist()
    if params.top_k > 0:
        p[order[params.top_k:]] = 0
        p = p / p.sum()
    mass, keep = 0.0, torch.zeros(8, dtype=torch.bool)
    for i in order:
        if mass >= params.top_p:
            break
        keep[i] = True
        mass += p[i].item()
    p = torch.where(keep, p, 0)
    p = p / p.sum()
    p = torch.where(p >= params.min_p * p.max(), p, 0)
    return p / p.sum()


def draw(params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    slots = [SampleSlot(0, params, None, [], []) for _ in range(n)]
    toks = [s.token for s in sample(LOGITS[None], slots)]
    return torch.bincount(torch.tensor(toks), minlength=8).double()


def chi_square(params: SamplingParams, n: int = 20000) -> None:
    p = expected(params)
    counts = draw(params, n)
    support = p > 0
    assert counts[~support].sum() == 0, "a filtered-out token was drawn"
    e = p[support] * n
    stat = float(((counts[support] - e) ** 2 / e).sum())
    df = int(support.sum()) - 1
    assert df >= 1
    assert stat < CHI2_999[df], (stat, df, counts.tolist(), e.tolist())


def test_temperature_matches_softmax():
    chi_square(SamplingParams(temperature=0.8))


def test_top_k_top_p_min_p_match_the_filtered_distribution():
    chi_square(SamplingParams(temperature=1.3, top_k=5))
    chi_square(SamplingParams(temperature=1.0, top_p=0.8))
    chi_square(SamplingParams(temperature=1.0, min_p=0.2))
    chi_square(SamplingParams(temperature=0.7, top_k=6, top_p=0.95, min_p=0.05))


def test_a_biased_sampler_would_fail():
    # the test has power: sampling at temperature 1 is rejected against temperature 0.8's distribution
    p = expected(SamplingParams(temperature=0.8))
    counts = draw(SamplingParams(temperature=1.0), 20000)
    e = p * 20000
    assert float(((counts - e) ** 2 / e).sum()) > CHI2_999[7]


def test_filter_logits_matches_expected_directly():
    for params in (SamplingParams(temperature=0.5, top_k=3), SamplingParams(top_p=0.6), SamplingParams(min_p=0.3)):
        got = filter_logits(LOGITS[None], torch.tensor([params.temperature]), torch.tensor([params.top_k]),
                            torch.tensor([params.top_p]), torch.tensor([params.min_p]))[0]
        torch.testing.assert_close(got.double(), expected(params), atol=1e-6, rtol=1e-5)


def test_seeded_rows_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(extra: int, seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(extra)  # the unseeded rows draw from the global generator
        slots = [SampleSlot(0, SamplingParams(temperature=1.0), None, [], []) for _ in range(extra)]
        slots.append(SampleSlot(0, params, gen, [], []))
        return [sample(LOGITS[None], slots)[-1].token for _ in range(30)]

    assert run(0, 7) == run(5, 7) == run(17, 7)
    assert run(0, 7) != run(0, 8)


def test_greedy_penalties_and_logprobs():
    x = torch.tensor([[1.0, 3.0, 2.9, -1.0]])
    greedy = SamplingParams(temperature=0, logprobs=2)
    (s,) = sample(x, [SampleSlot(0, greedy, None, [], [])])
    assert s.token == 1
    lp = torch.log_softmax(x[0], 0)
    assert abs(s.logprob - lp[1].item()) < 1e-6 and set(s.top_logprobs) == {1, 2}
    # token 1 was already generated: repetition 1.5 -> 3/1.5 = 2 < 2.9; frequency 0.2 per count, presence 0.5
    rep = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sample(x, [SampleSlot(0, rep, None, [], [1])])[0].token == 2
    pres = SamplingParams(temperature=0, presence_penalty=0.5)
    assert sample(x, [SampleSlot(0, pres, None, [0], [1])])[0].token == 2
    freq = SamplingParams(temperature=0, frequency_penalty=0.05)
    assert sample(x, [SampleSlot(0, freq, None, [], [1])])[0].token == 1  # 3 - 0.05 > 2.9
    assert sample(x, [SampleSlot(0, freq, None, [], [1, 1, 1])])[0].token == 2  # 3 - 0.15 < 2.9
    # min_tokens masking
    assert sample(x, [SampleSlot(0, greedy, None, [], [], banned=(1,))])[0].token == 2


def test_row_argmax_equals_torch_argmax_on_wide_rows():
    """The two-pass argmax of wide rows picks torch's index: ties go to the first maximal entry (across and
    within chunks), NaN counts as maximal, all -inf rows give 0, and padding never wins."""
    from kvgen.engine.sampler import ARGMAX_CHUNK, _argmax_chunk, row_argmax

    gen = torch.Generator().manual_seed(7)
    assert 10007 % _argmax_chunk(10007)  # a prime width: the padded path
    for v in (5, 4 * ARGMAX_CHUNK, 4 * ARGMAX_CHUNK + 1, 5 * ARGMAX_CHUNK, 10007, 128256):
        x = torch.randint(-3, 4, (6, v), generator=gen).float()  # small integers: many ties
        x[1] = float("-inf")
        x[2, -1] = 9.0  # the maximum in the last chunk (padded where no chunk width divides the row)
        x[3, v // 3] = float("nan")
        x[4, :] = 1.0
        x[5] = torch.randn(v, generator=gen)
        got, want = row_argmax(x), x.argmax(dim=1)
        assert torch.equal(got, want), (v, got.tolist(), want.tolist())
    assert row_argmax(torch.empty(0, 10 * ARGMAX_CHUNK)).shape == (0,)


def test_sixteen_bit_logits_draw_what_their_float32_widening_draws():
    """The runner hands the sampler the LM head's logits in the model dtype: every kind of draw -- greedy (argmax
    of the 16-bit values themselves), penalties, bans, seeded temperature with top-k/top-p/min-p, log-probs --
    gives exactly what the float32 widening of the same logits gives."""
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.bfloat16, torch.float16):
        low = (torch.randn(5, 3000, generator=gen) * 4).to(dtype)
        low[0, 17] = low[0, 2900] = low[0].max() + 1  # a tie: the first index wins in both
        wide = low.float()
        cases = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=3),
                 SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.2),
                 SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, seed=5),
                 SamplingParams(temperature=1.2, frequency_penalty=0.1, seed=6, logprobs=2)]
        for params in cases:
            def slots():
                return [SampleSlot(r, params, None if params.seed is None else
                                   torch.Generator().manual_seed(params.seed + r), [1, 2, 3], [17, 17, 40],
                                   banned=(5,) if r == 4 else ()) for r in range(5)]
            got, want = sample(low, slots()), sample(wide, slots())
            assert [s.token for s in got] == [s.token for s in want], (dtype, params)
            assert [(s.logprob, s.top_logprobs) for s in got] == [(s.logprob, s.top_logprobs) for s in want]
        assert sample(low, [SampleSlot(0, SamplingParams(temperature=0), None, [], [])])[0].token == 17
        # forked rows (gathered out of order)
        params = SamplingParams(temperature=0.7, seed=3, logprobs=1)
        forks = [(4, 0), (0, 1), (2, 2)]
        got = sample(low, [SampleSlot(r, params, torch.Generator().manual_seed(i), [], []) for r, i in forks])
        want = sample(wide, [SampleSlot(r, params, torch.Generator().manual_seed(i), [], []) for r, i in forks])
        assert [(s.token, s.logprob) for s in got] == [(s.token, s.logprob) for s in want]


def test_penalties_and_filtering_compute_in_float32_on_sixteen_bit_logits(monkeypatch):
    """A repetition penalty that bfloat16 would round into a tie: 3.0 / 1.3 = 2.3077 is below 2.3125 in float32
    (token 1 wins) and rounds to 2.3125 in bfloat16 (a tie, which token 0 would win). And the filtering of a
    sampled batch gets float32 logits."""
    from kvgen.engine import sampler

    x = torch.tensor([[3.0, 2.3125, -1.0]], dtype=torch.bfloat16)
    rep = SamplingParams(temperature=0, repetition_penalty=1.3)
    assert sample(x, [SampleSlot(0, rep, None, [], [0])])[0].token == 1
    seen = []
    real = sampler.filter_logits
    monkeypatch.setattr(sampler, "filter_logits", lambda x_, *a: seen.append(x_.dtype) or real(x_, *a))
    sample(x, [SampleSlot(0, SamplingParams(temperature=1.0), None, [], [])])
    sample(x, [SampleSlot(0, SamplingParams(temperature=1.0, presence_penalty=0.5), None, [], [1])])
    assert seen == [torch.float32, torch.float32]
