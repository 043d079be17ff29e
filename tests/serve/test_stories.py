"""kvgen serve with the real stories260K (fp32, kernels in the Triton interpreter).

Greedy outputs through the ``openai`` client (completions and chat,
streaming and not) equal ``LLM.generate`` token for token, with the
engine served on a thread (the very engine ``LLM`` holds) and in its own
process (built there with the same settings); ``python -m kvgen.serve``
(the ``kvgen serve`` command; engine in its own process, and with
``--engine-in-process``) drains on SIGTERM under load and exits 0 with no
request or page left and no engine process behind. Sizes are small: an
interpreted step costs about a second of CPU per sequence here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from kvgen.serve.engine_process import EngineSpec  # noqa: E402

from .helpers import KINDS, MODEL, STORIES, ServerThread, pid_gone  # noqa: E402

TOKENS = 6
PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story about a dog."}]
ENGINE = dict(kv="fp32", max_tokens=2048, max_num_seqs=4, verbose=False)


@pytest.fixture(scope="module")
def reference():
    """An LLM on stories260K and its greedy outputs for PROMPT and CHAT (token ids of the fallback template)."""
    from kvgen.engine import SamplingParams
    from kvgen.engine.llm import LLM

    llm = LLM(str(STORIES), **ENGINE)
    tok = llm.get_tokenizer()
    # the server's fallback chat template for a model without one: BOS, "role: content" lines, "assistant:"
    chat_ids = list(tok("user: Tell me a story about a dog.\nassistant:").input_ids)
    ref_text, ref_chat = llm.generate([PROMPT, chat_ids], SamplingParams(temperature=0, max_tokens=TOKENS))
    assert len(ref_text.outputs[0].token_ids) == TOKENS and ref_text.outputs[0].text
    return llm, ref_text, ref_chat, chat_ids


@pytest.mark.parametrize("kind", KINDS)
def test_openai_client_greedy_equals_llm_generate(kind, reference):
    llm, ref_text, ref_chat, chat_ids = reference
    served = llm.engine if kind == "thread" else EngineSpec("kvgen.engine.loader:build_engine",
                                                             dict(model=str(STORIES), **ENGINE))
    with ServerThread(served) as s:
        c = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0, timeout=300)
        whole = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True))
        chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=TOKENS, temperature=0)
        chat_streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=TOKENS, temperature=0, stream=True))
        assert s.all_free()
    assert whole.choices[0].text == streamed == ref_text.outputs[0].text
    assert whole.usage.completion_tokens == TOKENS and whole.usage.prompt_tokens == len(ref_text.prompt_token_ids)
    assert chat.choices[0].message.content == chat_streamed == ref_chat.outputs[0].text
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert s.summary == {"requests": 0, "pages_used": 0, "sequences": 0}


def _read_port(proc: subprocess.Popen, lines: list[str], timeout: float) -> tuple[int, int | None]:
    """Read stderr until 'listening on http://host:PORT' (keeping every line), or fail; (port, engine pid or None)."""
    found: list[tuple[int, int | None]] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening on http://[^ ]+:(\d+)", line)
            if m and not found:
                pid = re.search(r"engine process (\d+)", line)
                found.append((int(m.group(1)), int(pid.group(1)) if pid else None))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    assert ready.wait(timeout) and found, "".join(lines)
    return found[0]


def _until_refused(url: str, limit: float = 30.0) -> None:
    """Post until the server stops listening; until then (its loop notices the signal within a tick, later on a
    loaded machine) every answer must be 503: a draining server takes no new work."""
    deadline = time.monotonic() + limit
    while True:
        try:
            r = httpx.post(url + "/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=30)
        except httpx.TransportError:  # refused, or reset in the accept queue as the listener closed
            return
        assert r.status_code == 503, r.text
        assert time.monotonic() < deadline, "the server still listens 30 s after SIGTERM"
        time.sleep(0.1)


@pytest.mark.parametrize("flags", [[], ["--engine-in-process", "--async-scheduling"]],
                         ids=["engine-process", "engine-in-process-async"])
def test_sigterm_under_load_drains_and_exits_0(tmp_path, flags):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "kvgen.serve", "--model", str(STORIES), "--kv", "fp32", "--port", "0",
           "--max-num-seqs", "4", "--cache-tokens", "2048", "--drain-timeout", "3", "--served-model-name", MODEL,
           *flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    try:
        port, engine_pid = _read_port(proc, lines, 180)
        assert (engine_pid is None) == ("--engine-in-process" in flags), lines
        url = f"http://127.0.0.1:{port}/v1"
        results: list[tuple[str, str | None, bool]] = []
        first = threading.Barrier(4)

        def client(i: int) -> None:
            c = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300)
            text, reason, saw_first = "", None, False
            for ch in c.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=150, temperature=0,
                                           stream=True):
                text += ch.choices[0].text
                reason = ch.choices[0].finish_reason or reason
                if not saw_first:
                    saw_first = True
                    first.wait(300)
            results.append((text, reason, saw_first))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        first.wait(300)  # every stream is running
        proc.send_signal(signal.SIGTERM)
        _until_refused(url)
        for t in threads:
            t.join(120)
        assert proc.wait(120) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(results) == 3 and all(saw and reason == "abort" for _, reason, saw in results), results
    assert any("0 requests left, 0 of" in ln and "KV pages in use, 0 sequences" in ln for ln in lines), "".join(lines)
    if engine_pid is not None:
        assert pid_gone(engine_pid)  # the server waited for its engine process: none left, no zombie
