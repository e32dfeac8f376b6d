"""``butter serve``: the OpenAI-compatible server on loopback, answered by the real ``openai`` client
(and by plain HTTP where the client hides what is checked), over the tiny test model."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
import uvicorn

from butter_core import LoadOptions
from butter_core.errors import ButterWarning
from butter_core.model import Model
from butter_core.sampling import Sampler
from butter_core.serving.openai_api import make_app
from butter_core.serving.scheduler import Finished, Scheduler, Token
from butter_core.testing.tiny_models import TinySpec, write_tiny_model

pytestmark = pytest.mark.usefixtures("raw_scheme")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BUTTER = [sys.executable, "-c", "import sys; from butter_core.cli import main; sys.exit(main())"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    return Model.load(str(write_tiny_model(tmp_path_factory.mktemp("serve"), TinySpec(family="qwen3"))))


@contextlib.contextmanager
def running(model: Model, **limits):
    """A scheduler and a uvicorn server for it on a free loopback port; yields (scheduler, port)."""
    scheduler = Scheduler(model, capacity_tokens=limits.pop("capacity_tokens", 2048), **limits)
    scheduler.start()
    server = uvicorn.Server(uvicorn.Config(make_app(scheduler, "tiny"), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield scheduler, server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join()
        scheduler.close()


@pytest.fixture(scope="module")
def long_served(model):
    """The tiny model with its context raised to 8192 (a warning: beyond its 512 trained
    positions) behind a server: requests of thousands of tokens, seconds of work, to stop early."""
    with pytest.warns(ButterWarning, match="beyond the 512 positions"):
        long_model = Model.load(str(model.path), LoadOptions(max_context_length=8192))
    with running(long_model, capacity_tokens=8192, max_sessions=2, max_queue=2) as (scheduler, port):
        yield scheduler, port


@pytest.fixture(scope="module")
def served(model):
    with running(model, max_sessions=4, max_queue=16) as (scheduler, port):
        yield scheduler, port


def client(port: int, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", **options)


def expected_text(model: Model, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    tokens = list(model.generate(prompt, max_tokens=max_tokens))
    return model.tokenizer.decode(tokens), len(tokens)


def chat_prompt(model: Model) -> list[int]:
    return model.tokenizer.encode(model.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)


def wait_until_idle(scheduler: Scheduler, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ledger = scheduler.ledger()
        if ledger.waiting == ledger.running == ledger.pages_reserved == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the scheduler still holds {scheduler.ledger()}")


def post(port: int, path: str, body: bytes | dict) -> tuple[int, dict, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", path, body if isinstance(body, bytes) else json.dumps(body),
                       {"Content-Type": "application/json"})  # fmt: skip
    response = connection.getresponse()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())


def test_models_and_health(served):
    scheduler, port = served
    assert [m.id for m in client(port).models.list().data] == ["tiny"]
    health = _health(port)
    assert health["status"] == "ok" and health["pages"] == scheduler.caches.num_pages


def test_greedy_chat_is_what_generate_gives(served, model):
    _, port = served
    text, count = expected_text(model, chat_prompt(model), 12)
    reply = client(port).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == ("length" if count == 12 else "stop")
    assert reply.usage.prompt_tokens == len(chat_prompt(model)) and reply.usage.completion_tokens == count
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_chat_is_the_same_text_then_usage(served, model):
    _, port = served
    text, count = expected_text(model, chat_prompt(model), 12)
    stream = client(port).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length" if count == 12 else "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count


def test_completion_stops_at_a_stop_string_and_samples_reproducibly(served, model):
    _, port = served
    prompt = "The quick brown fox"
    text, _ = expected_text(model, model.tokenizer.encode(prompt), 16)
    assert len(text) > 6
    stop = text[3:6]
    reply = client(port).completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert reply.choices[0].text == text[: text.index(stop)] and reply.choices[0].finish_reason == "stop"
    sampled = [client(port).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=7)
               .choices[0].text for _ in range(2)]  # fmt: skip
    assert sampled[0] == sampled[1]
    tokens = list(model.generate(model.tokenizer.encode(prompt), sampler=Sampler(0.9, 1.0, 7), max_tokens=8))
    assert sampled[0] == model.tokenizer.decode(tokens)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": QUESTION, "n": 2}, "n"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"messages": QUESTION, "max_completion_tokens": "9"}, "max_completion_tokens"),
    ({"messages": QUESTION, "temperature": 3}, "temperature"),
    ({"messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": QUESTION, "logprobs": True}, "logprobs"),
    ({"messages": QUESTION, "max_tokens": 100000}, "messages"),
])  # fmt: skip
def test_bad_requests_get_openai_errors_naming_the_parameter(served, body, param):
    _, port = served
    status, _, answer = post(port, "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client(port).chat.completions.create(model="tiny", **body)


def test_malformed_json_and_unknown_routes(served):
    _, port = served
    status, _, answer = post(port, "/v1/completions", b"{not json")
    assert status == 400 and "not JSON" in answer["error"]["message"]
    status, _, answer = post(port, "/v1/embeddings", {"input": "x"})
    assert status == 404 and answer["error"]["code"] == "not_found"


def test_a_full_queue_is_answered_429_with_retry_after(model):
    with running(model, max_sessions=1, max_queue=0) as (scheduler, port):
        stream = client(port).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=400, temperature=0,
                                                      stream=True)  # fmt: skip
        next(iter(stream))  # the one session is busy
        status, headers, answer = post(port, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4})
        assert status == 429 and headers["retry-after"] == "1" and answer["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            client(port, max_retries=0).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4)
        stream.close()
        wait_until_idle(scheduler)


def test_waiting_requests_start_in_fifo_order(model):
    """One session, held by a long request: four more sent one after another wait, then start (and
    so finish) in the order they came."""
    with running(model, max_sessions=1, max_queue=8) as (scheduler, port):
        finished: list[int] = []

        def ask(index: int) -> None:
            client(port).completions.create(model="tiny", prompt="Once upon a time", max_tokens=300 if index == 0 else 4,
                                            temperature=0)  # fmt: skip
            finished.append(index)

        threads = [threading.Thread(target=ask, args=(index,)) for index in range(5)]
        for index, thread in enumerate(threads):
            thread.start()
            deadline = time.monotonic() + 10
            while (scheduler.ledger().waiting + scheduler.ledger().running <= index) and time.monotonic() < deadline:
                time.sleep(0.002)  # the request reached the scheduler before the next is sent
        assert scheduler.ledger().waiting == 4
        for thread in threads:
            thread.join()
        assert finished == list(range(5))
        wait_until_idle(scheduler)


def test_cancelling_at_every_stage_returns_the_ledger_to_zero(model):
    """Queued, prefilling, decoding: a cancelled request ends ("cancelled") and gives back exactly
    what it held; the others go on."""
    scheduler = Scheduler(model, capacity_tokens=1024, max_sessions=1, max_queue=4, prefill_chunk=4)
    scheduler.start()

    async def stages():
        prefilling = scheduler.submit([5 + i % 50 for i in range(400)], max_tokens=20, sampler=Sampler())  # 100 chunks of 4
        queued = scheduler.submit([5, 6, 7], max_tokens=20, sampler=Sampler())
        while scheduler.ledger().running == 0:
            await asyncio.sleep(0.001)
        assert scheduler.ledger().waiting == 1
        scheduler.cancel(queued)
        scheduler.cancel(prefilling)
        assert [e async for e in queued.events()] == [Finished("cancelled")]
        assert [e async for e in prefilling.events()] == [Finished("cancelled")]
        decoding = scheduler.submit([5, 6, 7], max_tokens=200, sampler=Sampler())
        events = decoding.events()
        tokens = [await anext(events) for _ in range(3)]
        assert all(isinstance(t, Token) for t in tokens)
        scheduler.cancel(decoding)
        async for event in events:
            last = event
        assert last == Finished("cancelled")
        done = scheduler.submit([5, 6, 7], max_tokens=3, sampler=Sampler())
        assert [e async for e in done.events()][-1] == Finished("length")

    try:
        asyncio.run(stages())
        wait_until_idle(scheduler)
    finally:
        scheduler.close()


def test_a_client_that_disconnects_mid_stream_frees_its_session(long_served):
    """Gone after its first token of 6000: its session is freed within a step or two."""
    scheduler, port = long_served
    connection = http.client.HTTPConnection("127.0.0.1", port)
    connection.request("POST", "/v1/chat/completions",
                       json.dumps({"messages": QUESTION, "max_tokens": 6000, "temperature": 0, "stream": True}),
                       {"Content-Type": "application/json"})  # fmt: skip
    response = connection.getresponse()
    assert response.status == 200
    lines = [response.readline() for _ in range(4)]  # the role's chunk, a blank line, the first token's chunk
    assert lines[2].startswith(b"data: ") and b'"content"' in lines[2]
    assert scheduler.ledger().pages_reserved > 0
    connection.sock.close()  # gone mid-stream
    connection.close()
    wait_until_idle(scheduler, timeout=1.5)
    reply = client(port).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3, temperature=0)
    assert reply.choices[0].message.content  # the server is still serving


def test_butter_serve_answers_then_stops_on_ctrl_c(tmp_path, model):
    """The command itself: it loads the model, sizes its pages from --kv-memory, answers the openai
    client, and ends cleanly on SIGINT."""
    port = free_port()
    process = subprocess.Popen(
        [*BUTTER, "serve", "-m", str(model.path), "--port", str(port),
         "--kv-memory", "2000000", "--max-sessions", "2"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
                time.sleep(0.1)
        per_page = health["bytes_total"] / health["pages"]
        whole_contexts = 2 * model.network.args.max_position_embeddings * per_page / 64  # --max-sessions of them
        assert health["bytes_total"] <= 2000000 < health["bytes_total"] + per_page or health["bytes_total"] == whole_contexts
        reply = client(port).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, temperature=0)
        assert reply.choices[0].message.content == expected_text(model, chat_prompt(model), 5)[0]
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert process.returncode in (0, 130), err
    assert "Traceback" not in err and "butter serve: warmed up in" in err


def test_butter_serve_refuses_a_memory_budget_below_one_page(model):
    done = subprocess.run([*BUTTER, "serve", "-m", str(model.path), "--kv-memory", "1000"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "--kv-memory 1000 bytes does not hold one page of 64 positions" in done.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_client_that_disconnects_before_a_whole_answer_frees_its_session(long_served):
    """A request answered whole (no stream) whose client goes away is cancelled within a poll, long
    before its 6000 tokens are done."""
    scheduler, port = long_served
    connection = http.client.HTTPConnection("127.0.0.1", port)
    connection.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 6000}),
                       {"Content-Type": "application/json"})  # fmt: skip
    deadline = time.monotonic() + 10
    while scheduler.ledger().running == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert scheduler.ledger().pages_reserved > 0
    connection.sock.close()  # gone before the answer
    connection.close()
    wait_until_idle(scheduler, timeout=1.5)


def test_a_request_beyond_the_models_context_is_refused_as_generate_refuses_it(served):
    _, port = served
    status, _, answer = post(port, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 600})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert "max_tokens 600 need 609 positions, but the KV cache holds 512" in answer["error"]["message"]


def test_prompts_sharing_a_prefix_reuse_it_and_report_cached_tokens(model):
    """With a prefix cache: the same question again reuses all but its last prompt token, and the next
    turn of the conversation reuses the first turn's prompt; answers are those of `generate` alone."""
    with running(model, max_sessions=2, max_queue=4, prefix_cache_bytes=10**7) as (scheduler, port):
        first_prompt = chat_prompt(model)
        text, _ = expected_text(model, first_prompt, 8)
        replies = [client(port).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=8, temperature=0)
                   for _ in range(2)]  # fmt: skip
        assert [r.choices[0].message.content for r in replies] == [text, text]
        assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, len(first_prompt) - 1]
        turn = [*QUESTION, {"role": "assistant", "content": text}, {"role": "user", "content": "And of Spain?"}]
        second_prompt = model.tokenizer.encode(model.tokenizer.apply_chat_template(turn), add_special_tokens=False)
        shared = len(os.path.commonprefix([first_prompt, second_prompt]))
        reply = client(port).chat.completions.create(model="tiny", messages=turn, max_tokens=8, temperature=0)
        assert reply.usage.prompt_tokens_details.cached_tokens == shared > 0
        assert reply.choices[0].message.content == expected_text(model, second_prompt, 8)[0]
        wait_until_idle(scheduler)
        ledger = scheduler.ledger()
        assert ledger.prefix_cache_entries >= 1 and 0 < ledger.prefix_cache_bytes <= 10**7
        assert _health(port)["prefix_cache_entries"] == ledger.prefix_cache_entries


def _health(port: int) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port)
    connection.request("GET", "/health")
    return json.loads(connection.getresponse().read())
