"""kvgen serve's HTTP API through the official ``openai`` client, on a stand-in model over a real KVCache.

The stand-in's greedy continuation is known (``TableRunner.greedy``), so
every response is checked token for token; request fields (n, stop, seed,
logprobs, top_k, stream_options.include_usage) and each bad request's
status are checked against what OpenAI's API specifies. The tests on the
module's server run twice: engine on a thread, engine in its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .helpers import KINDS, MODEL, ServerThread, metric, set_delay, table_engine  # noqa: E402

PROMPT = "Once upon a time"


@pytest.fixture(scope="module", params=KINDS)
def server(request):
    if request.param == "process":
        yield request.getfixturevalue("process_server")  # shared with test_load (see conftest)
        return
    with ServerThread(table_engine()) as s:
        yield s
    assert s.summary == {"requests": 0, "pages_used": 0, "sequences": 0}


@contextlib.contextmanager
def slow_steps(server, delay=0.05):
    """Each engine step of the module's server takes ``delay`` seconds meanwhile (requests stay running)."""
    server.on_engine(set_delay, delay)
    try:
        yield
    finally:
        server.on_engine(set_delay, 0.0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def expected(server, prompt_ids, n):
    return server.ref.runner.greedy(prompt_ids, n)


def prompt_ids(server, text=PROMPT):
    return list(server.ref.tokenizer(text).input_ids)


def test_completion_greedy_tokens_and_usage(server, client):
    ids = prompt_ids(server)
    want = expected(server, ids, 7)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, logprobs=2)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert c.text == server.ref.tokenizer.decode(want, skip_special_tokens=True)
    assert len(c.logprobs.tokens) == 7 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in c.logprobs.top_logprobs)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 7, len(ids) + 7)
    assert r.object == "text_completion" and r.model == MODEL


def test_completion_token_id_prompts_and_n(server, client):
    ids = prompt_ids(server)
    other = [1, 5, 9]
    r = client.completions.create(model=MODEL, prompt=[ids, other], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    tok = server.ref.tokenizer
    for c in r.choices:
        src = ids if c.index < 2 else other
        assert c.text == tok.decode(expected(server, src, 4), skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) + len(other) and r.usage.completion_tokens == 16


def test_completion_stream_equals_whole_and_reports_usage(server, client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_whole_and_stream(server, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    assert len(c.logprobs.content) == 6 and all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
    # the fallback template (stories260K has none): BOS, "role: content" lines, then "assistant:"
    tok = server.ref.tokenizer
    want_prompt = list(tok("system: Be brief.\nuser: Tell me a story\nassistant:").input_ids)
    assert r.usage.prompt_tokens == len(want_prompt)
    assert c.message.content == tok.decode(expected(server, want_prompt, 6), skip_special_tokens=True)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"


def test_stop_string_is_cut_from_text_and_stream(server, client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert len(stop) == 2 and stop.strip()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True))
    assert streamed == r.choices[0].text


def test_seed_reproducible_and_top_k(server, client):
    def sample(seed, **extra):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=seed,
                                         extra_body=extra).choices[0].text
    assert sample(3) == sample(3)
    assert len({sample(s) for s in range(4)}) > 1  # temperature 1.5 over a 512-token table: seeds differ
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    assert sample(5, top_k=1) == greedy  # top_k=1 leaves only the argmax


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    page = httpx.get(server.base + "/metrics")
    assert page.headers["content-type"].startswith("text/plain")
    text = page.text
    assert metric(text, "kvgen_generation_tokens_total") >= 5
    assert metric(text, "kvgen_time_to_first_token_seconds_count") >= 1
    assert metric(text, "kvgen_time_per_output_token_seconds_count") >= 1
    assert metric(text, "kvgen_requests_running") == 0 and metric(text, "kvgen_requests_waiting") == 0
    pages = server.pages()
    assert metric(text, "kvgen_kv_pages_free") == pages["free"] == pages["total"]
    assert metric(text, "kvgen_kv_pages_used") == 0
    assert 0 <= metric(text, "kvgen_prefix_cache_hit_rate") <= 1
    assert 'kvgen_http_responses_total{status="200"}' in text


def test_prefix_cache_hit_rate_counts_reused_pages(server, client):
    long_prompt = " ".join(["the little dog ran to the park"] * 8)  # several full pages of 16 tokens
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    text = httpx.get(server.base + "/metrics").text
    assert metric(text, "kvgen_prefix_cache_hit_tokens_total") >= 16
    assert metric(text, "kvgen_prefix_cache_hit_rate") > 0


def post(server, path, body, **headers):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.base + path, content=data, headers={"content-type": "application/json", **headers},
                      timeout=30)


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": "5"}, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "n": 1.5}, "n"),
    ({"model": MODEL, "prompt": PROMPT, "stream": "yes"}, "stream"),
    ({"model": MODEL, "prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": PROMPT, "stop": 7}, "stop"),
    ({"model": MODEL, "prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": [99999]}, "prompt"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 300}, "max_tokens"),  # max_model_len is 256
])
def test_bad_completion_requests_are_400(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)


def test_a_request_whose_response_cannot_be_built_gives_back_its_slots(server, monkeypatch):
    import kvgen.serve.app as app

    def broken(*args, **kwargs):
        raise RuntimeError("no response for you")

    pending = server.worker._pending
    monkeypatch.setattr(app, "Choices", broken)  # raises between submit and the response
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 50}).status_code == 500
    assert server.worker._pending == pending


def test_bad_chat_requests_and_unknown_model(server, client):
    assert post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}).status_code == 400
    assert post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard",
                                                                               "content": "x"}]}).status_code == 400
    too_long = {"model": MODEL, "messages": [{"role": "user", "content": "dog " * 300}], "max_tokens": 4}
    r = post(server, "/v1/chat/completions", too_long)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000)
    assert httpx.get(server.base + "/v1/nothing").status_code == 404


def test_api_key_is_required_on_v1():
    with ServerThread(table_engine(), api_key="s3cret") as s:
        for key in ("wrong", "s3cret-and-more", ""):
            bad = openai.OpenAI(base_url=s.url, api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert httpx.get(s.url + "/models").status_code == 401
        assert httpx.get(s.url + "/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
        good = openai.OpenAI(base_url=s.url, api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(s.base + "/health").status_code == 200  # probes need no key


def test_queue_full_is_429_with_retry_after(server):
    limit = server.worker.max_pending
    server.worker.max_pending = 2
    try:
        with slow_steps(server):
            async def go():
                c = openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0)
                streams = [await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, stream=True)
                           for _ in range(2)]
                for st in streams:  # both are running: the server holds its limit
                    await st.__anext__()
                r = None
                try:
                    await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
                except openai.RateLimitError as e:
                    r = e.response
                for st in streams:
                    await st.close()
                return r
            r = asyncio.run(go())
    finally:
        server.worker.max_pending = limit
    assert r is not None and r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_exceeded"
    deadline = time.monotonic() + 10
    while not server.all_free():  # the two closed streams were aborted: their pages come back
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_disconnect_aborts_and_frees_pages_at_once(server):
    def aborted():
        try:
            return metric(httpx.get(server.base + "/metrics").text, 'kvgen_request_finished_total{reason="abort"}')
        except KeyError:  # none counted yet: no such sample
            return 0.0

    before = aborted()
    with slow_steps(server):
        async def go():
            c = openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0)
            st = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, stream=True)
            await st.__anext__()
            assert server.pages()["used"] > 0
            await st.close()
            # a non-streaming request whose client gives up
            with pytest.raises(openai.APITimeoutError):
                await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, timeout=0.5)
        asyncio.run(go())
        deadline = time.monotonic() + 3  # well before the 200 tokens (10 s) would have run out
        while not server.all_free():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert aborted() == before + 2


def test_draining_server_refuses_new_requests():
    with ServerThread(table_engine(delay=0.05), drain_timeout=0.5) as s:
        async def go():
            c = openai.AsyncOpenAI(base_url=s.url, api_key="x", max_retries=0)
            st = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, stream=True)
            await st.__anext__()
            s.worker.begin_drain(0.5)
            with pytest.raises(openai.InternalServerError) as e:
                await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert e.value.status_code == 503 and "retry-after" in e.value.response.headers
            chunks = [ch async for ch in st]  # the running stream is aborted at the deadline and ends cleanly
            return chunks
        chunks = asyncio.run(go())
        assert chunks[-1].choices[0].finish_reason == "abort"
        assert httpx.get(s.base + "/health").status_code == 503
        assert s.all_free()
