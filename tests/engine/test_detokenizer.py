"""Incremental detokenization and the engine's output kinds, on stories260K's byte-fallback tokenizer.

The script below decodes to multi-byte characters (an emoji, CJK) spelled
with byte tokens, so a prefix of it often ends inside a UTF-8 character
(a whole decode of such a prefix ends in '\\ufffd'). Streaming must never
show that, and what it streams must add up to the final text exactly.
"""

from __future__ import annotations

import pytest
import torch

from kvgen.engine import EngineError, SamplingParams
from kvgen.engine.detokenizer import IncrementalDetokenizer

from .helpers import STORIES, all_free, fake_engine, stories_cache

TEXT = "Lily saw a \U0001f436 and said h\u00e9llo \u4e16\u754c. \u4e16 ok"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(STORIES)


@pytest.fixture(scope="module")
def script(tok):
    ids = list(tok(TEXT, add_special_tokens=False).input_ids)
    # the test means something only if some prefix splits a character
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
    return ids


class ScriptRunner:
    """Each sampled row's logits pick ``script[i]`` for the i-th draw (one request at a time)."""

    def __init__(self, script, vocab: int) -> None:
        self.script = script
        self.vocab = vocab
        self.draws = 0
        self.table = torch.empty(vocab, 0)  # fake_engine reads the vocabulary size from it

    def run(self, step, input_ids, positions, sample_rows):
        if not sample_rows:
            return None
        logits = torch.zeros(len(sample_rows), self.vocab)
        for j in range(len(sample_rows)):
            logits[j, self.script[min(self.draws, len(self.script) - 1)]] = 10.0
            self.draws += 1
        return logits


def engine_for(tok, script, kind):
    cache = stories_cache(1024)
    eng = fake_engine(cache, ScriptRunner(script, len(tok)), tokenizer=tok, vocab_size=len(tok))
    eng.output_kind = kind
    return eng, cache


def run(eng, params):
    rid = eng.add_request(None, [1], params)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def test_incremental_detokenizer_never_splits_a_character(tok, script):
    d = IncrementalDetokenizer(tok)
    pieces = []
    held = 0
    for k in range(1, len(script) + 1):
        new = d.update(script[:k])
        held += not new
        assert "\ufffd" not in new
        pieces.append(new)
        assert d.text == "".join(pieces) and tok.decode(script).startswith(d.text)
    assert "".join(pieces) == tok.decode(script)
    assert held > 0  # some tokens only completed a character later
    assert d.update(script) == ""  # nothing new: nothing decoded


def test_delta_outputs_add_up_to_the_final_text(tok, script):
    eng, cache = engine_for(tok, script, "delta")
    outs = run(eng, SamplingParams(temperature=0, max_tokens=len(script), ignore_eos=True, logprobs=1))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    deltas = [o.outputs[0] for o in outs]
    assert all(len(c.token_ids) <= 1 for c in deltas)  # one new token per step, never the history
    assert [t for c in deltas for t in c.token_ids] == script
    assert sum(len(c.logprobs) for c in deltas) == len(script)
    assert not any("\ufffd" in c.text for c in deltas)
    assert "".join(c.text for c in deltas) == tok.decode(script, skip_special_tokens=True)
    assert all_free(cache)


def test_cumulative_stream_texts_grow_without_replacement_characters(tok, script):
    eng, _ = engine_for(tok, script, "cumulative")
    outs = run(eng, SamplingParams(temperature=0, max_tokens=len(script), ignore_eos=True))
    texts = [o.outputs[0].text for o in outs]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert not any("\ufffd" in t for t in texts)
    assert texts[-1] == tok.decode(script, skip_special_tokens=True)
    assert outs[-1].outputs[0].token_ids == script


def test_delta_with_stop_string_streams_only_the_cut_text(tok, script):
    stop = "\u4e16\u754c"
    eng, _ = engine_for(tok, script, "delta")
    outs = run(eng, SamplingParams(temperature=0, max_tokens=len(script), ignore_eos=True, stop=[stop]))
    full = tok.decode(script)
    c = outs[-1].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert "".join(o.outputs[0].text for o in outs) == full[:full.index(stop)]


def test_an_aborted_requests_delta_is_the_rest_its_deltas_did_not_carry(tok, script):
    eng, cache = engine_for(tok, script, "delta")
    params = SamplingParams(temperature=0, max_tokens=len(script), ignore_eos=True, logprobs=1, stop=["never"])
    rid = eng.add_request(None, [1], params)
    req = eng.requests[rid]
    sent = [o.outputs[0] for _ in range(6) for o in eng.step()]
    eng.abort_request(rid)
    rest = eng.delta_of(req).outputs[0]
    ids = req.seqs[0].output_ids
    assert rest.finish_reason == "abort" and rest.text  # a stop string's length - 1 characters were held back
    assert [t for c in sent + [rest] for t in c.token_ids] == ids == script[:len(ids)]
    assert sum(len(c.logprobs) for c in sent + [rest]) == len(ids)
    assert "".join(c.text for c in sent + [rest]) == tok.decode(ids)
    assert eng.delta_of(req).outputs[0].text == "" and all_free(cache)


def test_final_kind_outputs_only_finished_requests_and_bad_kinds_are_refused(tok, script):
    eng, _ = engine_for(tok, script, "final")
    outs = run(eng, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].token_ids == script[:5]
    assert outs[0].outputs[0].text == tok.decode(script[:5])
    with pytest.raises(EngineError, match="output_kind"):
        eng.output_kind = "snapshots"


def test_request_finished_is_a_flag_kept_by_the_engine(tok, script):
    eng, _ = engine_for(tok, script, "cumulative")
    rid = eng.add_request(None, [1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, n=2))
    req = eng.requests[rid]
    eng.step()
    eng.step()
    assert not req.finished and len(req.seqs) == 2
    eng.abort_request(rid)
    assert req.finished and all(s.completion.finish_reason == "abort" for s in req.seqs)
    assert req.seqs[0].completion.text == tok.decode(req.seqs[0].output_ids)
