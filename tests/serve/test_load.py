"""kvgen serve under load: 100 concurrent streaming clients, a fifth of them leaving mid-stream.

Stand-in model over a real KVCache (see helpers): the 80 that stay get
their exact greedy continuation, the 20 that leave are aborted (they asked
for 200 tokens and could not have finished), and afterwards every page is
free (and at the server's end nothing is left in the engine). Run with the
engine on a thread and in its own process.
"""

from __future__ import annotations

import asyncio
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from .helpers import KINDS, MODEL, ServerThread, metric, set_delay, table_engine  # noqa: E402

CLIENTS = 100
LEAVERS = 20
TOKENS = 8


@pytest.fixture(params=KINDS)
def server(request):
    """A server sized for the load; the engine process's is the session's (see conftest), slowed down meanwhile."""
    if request.param == "thread":
        with ServerThread(table_engine(delay=0.005, max_num_seqs=128, max_tokens=1 << 15)) as s:
            yield s
        assert s.summary == {"requests": 0, "pages_used": 0, "sequences": 0}
        return
    s = request.getfixturevalue("process_server")
    s.on_engine(set_delay, 0.005)
    try:
        yield s
    finally:
        s.on_engine(set_delay, 0.0)


def counts(s) -> dict[str, float]:
    text = httpx.get(s.base + "/metrics").text
    out = {}
    for name in ('kvgen_request_finished_total{reason="abort"}', 'kvgen_request_finished_total{reason="length"}',
                 "kvgen_generation_tokens_total", "kvgen_time_to_first_token_seconds_count"):
        try:
            out[name] = metric(text, name)
        except KeyError:  # not counted yet
            out[name] = 0.0
    return out


def test_100_streaming_clients_a_fifth_disconnecting_leave_all_pages_free(server):
    s = server
    started = time.monotonic()
    before = counts(s)
    tok = s.ref.tokenizer
    prompts = [f"Once upon a time there was a dog number {i}" for i in range(CLIENTS)]
    want = [tok.decode(s.ref.runner.greedy(list(tok(p).input_ids), TOKENS), skip_special_tokens=True)
            for p in prompts]

    async def client(c, i):
        leaver = i % 5 == 0
        st = await c.completions.create(model=MODEL, prompt=prompts[i], temperature=0, stream=True,
                                        max_tokens=200 if leaver else TOKENS)
        text, reason = "", None
        async for ch in st:
            text += ch.choices[0].text
            reason = ch.choices[0].finish_reason or reason
            if leaver:
                await st.close()
                return None
        return text, reason

    async def go():
        c = openai.AsyncOpenAI(base_url=s.url, api_key="x", max_retries=0, timeout=60)
        return await asyncio.gather(*(client(c, i) for i in range(CLIENTS)))

    results = asyncio.run(go())
    for i, r in enumerate(results):
        if i % 5 == 0:
            assert r is None
        else:
            assert r == (want[i], "length"), i
    deadline = time.monotonic() + 10
    while not s.all_free():
        assert time.monotonic() < deadline, s.pages()
        time.sleep(0.05)
    after = counts(s)
    new = {k: after[k] - before[k] for k in after}
    assert new['kvgen_request_finished_total{reason="abort"}'] == LEAVERS
    assert new['kvgen_request_finished_total{reason="length"}'] == CLIENTS - LEAVERS
    assert new["kvgen_generation_tokens_total"] >= (CLIENTS - LEAVERS) * TOKENS
    assert new["kvgen_time_to_first_token_seconds_count"] == CLIENTS
    assert time.monotonic() - started < 90
