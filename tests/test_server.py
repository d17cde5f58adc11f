"""`verispec serve`: the OpenAI-compatible server on loopback, driven by the official client.

A tiny native-runtime Llama behind a byte tokenizer (with a toy chat template) is served by
uvicorn in a background thread. Batched rows on the native runtime decode exactly as alone, so
every temperature-0 response must equal `decoder.generate` on the same prompt, also under load.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn
from conftest import EOS_ID, byte_tokenizer, tiny_llama
from openai import OpenAI

from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import NgramDrafter
from verispec.engine import Engine
from verispec.server import ServerConfig, create_app
from verispec.server.loadtest import percentile, run_load
from verispec.server.prompts import Prompts
from verispec.server.protocol import APIError

MODEL = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPTS = ["abcabcabc", "hello world, hello", "the quick brown fox", "zz", "one two one two",
           "lorem ipsum dolor", "aaaa bbbb aaaa", "0123456789", "xyzzy", "tick tock tick",
           "red green blue red", "the cat sat on the", "print('hi')", "ababababab", "q",
           "speculative decoding"]
LONG = 1500  # tokens: with slow_rounds, a request still running when the test acts on it


@pytest.fixture(scope="module")
def decoder() -> SpeculativeDecoder:
    tokenizer = byte_tokenizer()  # a fresh one: the chat template must not leak to other tests
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_llama(EOS_ID + 1, seed=11, dtype=torch.float32)
    return SpeculativeDecoder(model, tokenizer, NgramDrafter(), k=3, runtime="native")


@contextlib.contextmanager
def running(app):
    """Serve app on 127.0.0.1 (a free port) in a thread -> the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def app(decoder):
    return create_app(decoder, MODEL, ServerConfig(max_batch=16, max_queue=64))


@pytest.fixture(scope="module")
def url(app):
    with running(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def alone(decoder, prompt, max_tokens: int, **params) -> str:
    """The text of the same request decoded alone (call only while the server is idle)."""
    return decoder.generate(prompt, SamplingParams(max_new_tokens=max_tokens, **params),
                            chat=False).text


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def metric(url: str, name: str) -> float:
    """A metric's value from /metrics (summed over labels)."""
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


def test_completion_equals_the_request_decoded_alone(client, decoder):
    response = client.completions.create(model=MODEL, prompt="abcabcabc", max_tokens=24,
                                         temperature=0)
    choice = response.choices[0]
    assert choice.text == alone(decoder, "abcabcabc", 24)
    assert response.object == "text_completion" and response.model == MODEL
    assert response.usage.prompt_tokens == 9
    assert response.usage.completion_tokens == response.verispec["new_tokens"]
    assert choice.finish_reason in ("stop", "length")
    assert {"acceptance_rate", "tokens_per_forward"} <= set(response.verispec)
    ids = decoder.tokenizer("abcabcabc")["input_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == choice.text


def test_defaults_stop_and_seeded_sampling(client, decoder):
    default = client.completions.create(model=MODEL, prompt="hello", seed=3,
                                        extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens
    assert default.choices[0].text == alone(decoder, "hello", 16, temperature=1.0, seed=3,
                                            ignore_eos=True)  # OpenAI's default temperature
    sampled = dict(model=MODEL, prompt="hello", max_tokens=20, temperature=0.8, top_p=0.9,
                   seed=5, extra_body={"top_k": 40})
    first, second = (client.completions.create(**sampled).choices[0].text for _ in range(2))
    assert first == second == alone(decoder, "hello", 20, temperature=0.8, top_p=0.9, top_k=40,
                                    seed=5)
    text = alone(decoder, "abcabcabc", 24)
    stop = text[4:6]
    stopped = client.completions.create(model=MODEL, prompt="abcabcabc", max_tokens=24,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_applies_the_template_to_all_messages(client, decoder):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "},
                                             {"type": "text", "text": "there"}]}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                              temperature=0)
    rendered = "<system>be brief\n<user>hi there\n<assistant>"
    assert response.choices[0].message.content == alone(decoder, rendered, 20)
    assert response.choices[0].message.role == "assistant"
    assert response.object == "chat.completion"
    assert response.usage.prompt_tokens == len(rendered)
    assert response.verispec["target_forwards"] >= 1


def test_a_prediction_is_bounded_by_the_context_not_the_prompt_limit(decoder):
    """A server's prompt limit bounds prompts; a prediction (the output expected) may be as long
    as the context."""
    prompts = Prompts(decoder, max_prompt_tokens=8)
    text = "abc " * 10
    with pytest.raises(APIError, match="prompt"):
        prompts._completion_ids(text)
    assert len(prompts._prediction_ids(text)) == len(text)
    with pytest.raises(APIError, match="context"):
        prompts._prediction_ids("x" * (prompts.context * prompts.max_token_bytes + 1))


def test_chat_needs_a_chat_template(tokenizer, text_target):
    decoder = SpeculativeDecoder(text_target, tokenizer, None)  # the plain byte tokenizer
    with pytest.raises(APIError, match="no chat template"):
        Prompts(decoder)._chat_ids([{"role": "user", "content": "hi"}])


def test_streaming_sends_openai_chunks_then_done(client, url, decoder):
    expected = alone(decoder, "abcabcabc", 40)
    chunks = list(client.completions.create(model=MODEL, prompt="abcabcabc", max_tokens=40,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert len(chunks) > 3
    *_, last, usage = chunks
    assert last.choices[0].finish_reason in ("stop", "length") and "acceptance_rate" in \
        last.verispec
    assert usage.choices == [] and usage.usage.completion_tokens == last.verispec["new_tokens"]

    messages = [{"role": "user", "content": "hi"}]
    chat = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                               temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == alone(
        decoder, "<user>hi\n<assistant>", 20)
    assert chat[-1].choices[0].finish_reason is not None

    with httpx.stream("POST", f"{url}/v1/completions", json={
            "model": MODEL, "prompt": "zz", "max_tokens": 5, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(line[6:]) for line in events[:-1])

    # with include_usage, every chunk before the usage chunk says "usage": null (as OpenAI's)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line and line != "data: [DONE]"]
    *before, final = chunks
    assert before and all("usage" in chunk and chunk["usage"] is None for chunk in before)
    assert final["choices"] == [] and final["usage"]["completion_tokens"] > 0


BAD_REQUESTS = [
    # (body, status, param or None, a piece of the message)
    (b"{not json", 400, None, "invalid JSON"),
    (b'{"prompt": "hi"}', 400, "model", "required"),
    (b'{"model": "tiny"}', 400, "prompt", "required"),
    (b'{"model": "gpt-4", "prompt": "hi"}', 404, "model", "does not exist"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": 3}', 400, "temperature", "2"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": 0}', 400, "top_p", "greater than 0"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens", "1"),
    (b'{"model": "tiny", "prompt": "hi", "n": 2}', 400, "n", "not supported"),
    (b'{"model": "tiny", "prompt": "hi", "logprobs": 2}', 400, "logprobs", "not supported"),
    (b'{"model": "tiny", "prompt": ""}', 400, "prompt", "empty"),
    (b'{"model": "tiny", "prompt": [1, 999]}', 400, "prompt", "token ids"),
    (b'{"model": "tiny", "prompt": "' + b"a" * 2100 + b'"}', 400, "prompt", "context"),
    (b'{"model": "tiny", "prompt": "hi", "stop": [""]}', 400, "stop", "stop"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature", "finite"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": Infinity}', 400, "top_p", "finite"),
    (b'{"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": true}}', 400,
     "stream_options", "stream is true"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": true}', 400, "temperature", "number"),
    (b'{"model": "tiny", "prompt": ["a", "b"]}', 400, "prompt", "one prompt a request"),
    (b'{"model": "tiny", "prompt": [[1, 2], [3]]}', 400, "prompt", "one prompt a request"),
    (b'{"model": "tiny", "prompt": [1, "a"]}', 400, "prompt", "valid integer"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": 0.5, "verify": "invariant"}', 400,
     "verify", "needs a seed"),
    (b'', 400, None, "no body"),
    (b'[1, 2]', 400, None, "a JSON object"),
]


def test_a_list_of_one_text_is_that_prompt(client):
    """Clients that always send `prompt` as a list: one text in a list is that text."""
    texts = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                       temperature=0).choices[0].text
             for prompt in ("the cat", ["the cat"])]
    assert texts[0] == texts[1]


def test_a_body_sent_as_another_content_type_is_named_so(url):
    """A JSON body sent as text/plain was refused as "Input should be a valid dictionary":
    the answer says what to send. (A body with no type at all is read as JSON or refused
    alike, as the installed FastAPI decides.)"""
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    response = httpx.post(f"{url}/v1/completions", content=body,
                          headers={"content-type": "text/plain"})
    assert response.status_code == 400
    assert "Content-Type: application/json" in response.json()["error"]["message"]
    response = httpx.post(f"{url}/v1/completions", content=b"[1, 2]",
                          headers={"content-type": "application/vnd.api+json"})
    assert response.json()["error"]["message"] == "the body must be a JSON object"


@pytest.mark.parametrize(("body", "status", "param", "message"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(url, body, status, param,
                                                                message):
    response = httpx.post(f"{url}/v1/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_the_client_raises_openai_errors(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi")
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="needs content"):
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": None}])
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model=MODEL, n=2, max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=3)


def test_models_health_and_metrics(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{url}/v1/models/").json()["data"][0]["id"] == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")
    assert httpx.get(f"{url}/health").status_code == 200
    before = metric(url, "verispec_generated_tokens_total")
    client.completions.create(model=MODEL, prompt="abcabcabc", max_tokens=10, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(f"{url}/metrics").text
    assert metric(url, "verispec_generated_tokens_total") == before + 10
    for name in ("verispec_requests_total{", "verispec_draft_tokens_total",
                 "verispec_draft_tokens_accepted_total", "verispec_draft_position_checked_total{",
                 "verispec_draft_position_accepted_total{",
                 "verispec_time_to_first_token_seconds_bucket",
                 "verispec_request_latency_seconds_bucket", "verispec_requests_in_flight",
                 "verispec_idle_cache_bytes"):
        assert name in text, name
    assert 'verispec_requests_total{path="/v1/completions",status="200"}' in text
    # a model asked about by id is counted under its route, found or not
    assert 'verispec_requests_total{path="/v1/models/{id}",status="200"}' in text
    assert 'verispec_requests_total{path="/v1/models/{id}",status="404"}' in text
    assert metric(url, "verispec_time_to_first_token_seconds_count") >= 1


def test_a_failed_round_fails_its_requests_and_the_server_goes_on(client, decoder, monkeypatch):
    # Every round fails while patched (a round that failed once could have been spent on
    # another test's leftover request, and this one would then succeed).
    def fail(engine):
        raise RuntimeError("boom")

    with monkeypatch.context() as patch:
        patch.setattr(Engine, "step", fail)
        with pytest.raises(openai.InternalServerError, match="internal error") as err:
            client.completions.create(model=MODEL, prompt="abc", max_tokens=8)
        assert "boom" not in str(err.value)  # the cause is logged, never sent
        chunks = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, stream=True)
        with pytest.raises(openai.APIError, match="internal error") as err:
            list(chunks)
        assert "boom" not in str(err.value)
    # Afterwards the server answers again, and right (greedy, so a sampled end-of-text at the
    # first token cannot make an empty answer pass or fail by chance).
    choice = client.completions.create(model=MODEL, prompt="abc", max_tokens=8,
                                       temperature=0).choices[0]
    assert choice.finish_reason == "length"
    assert choice.text == alone(decoder, "abc", 8, temperature=0.0)


@pytest.fixture
def slow_rounds(monkeypatch):
    """Every scheduler round takes at least 5 ms, so a LONG request lasts seconds anywhere."""
    step = Engine.step

    def slow_step(engine):
        time.sleep(0.005)
        return step(engine)

    monkeypatch.setattr(Engine, "step", slow_step)


def read_a_little_then_leave(url: str, chunks: int = 3) -> None:
    """Open a long stream, read a few events, and disconnect."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": LONG, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(chunks):
            next(lines)


def test_a_client_that_disconnects_has_its_request_cancelled(url, app, slow_rounds):
    engine = app.state.engine
    cancelled = metric(url, "verispec_requests_cancelled_total")
    generated = metric(url, "verispec_generated_tokens_total")
    read_a_little_then_leave(url)
    assert wait_until(lambda: engine.outstanding == 0)
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up waiting
        httpx.post(f"{url}/v1/completions", timeout=0.3, json={
            "model": MODEL, "prompt": "abc", "max_tokens": LONG, "ignore_eos": True})
    assert wait_until(lambda: engine.outstanding == 0)
    assert metric(url, "verispec_requests_cancelled_total") == cancelled + 2
    assert metric(url, "verispec_generated_tokens_total") == generated  # neither finished


def test_load_64_mixed_requests_from_16_clients(url, decoder, capsys):
    """Chat and completions, streamed or not, greedy and seeded, 4 clients that leave."""
    max_tokens = 32
    report = run_load(f"{url}/v1", requests=64, concurrency=16, prompts=PROMPTS,
                      max_tokens=max_tokens, temperature=0.0, model=MODEL, mixed=True)
    summary = report.summary()
    with capsys.disabled():
        print(f"\nload test on the tiny model: {json.dumps(summary)}")
    assert summary["ok"] == 60 and summary["errors"] == {} and summary["left_on_purpose"] == 4
    assert summary["lost"] == summary["mixed"] == summary["5xx"] == 0
    for result in report.results:
        job = result.job
        if job.seed is None and not job.leave:
            prompt = f"<user>{job.prompt}\n<assistant>" if job.chat else job.prompt
            assert result.text == alone(decoder, prompt, max_tokens), result.index
    assert wait_until(lambda: metric(url, "verispec_requests_in_flight") == 0)


def test_seeded_requests_under_invariant_verification_answer_as_alone(url):
    """The server's seeded requests, verified with verify="invariant", give the very text they
    give alone, whatever else the batch holds (block verification need not: see run_load)."""
    report = run_load(f"{url}/v1", requests=32, concurrency=8, prompts=PROMPTS, max_tokens=24,
                      model=MODEL, mixed=True, verify="invariant")
    summary = report.summary()
    seeded = sum(r.job.seed is not None and not r.job.leave for r in report.results)
    assert summary["lost"] == summary["mixed"] == summary["5xx"] == 0 and seeded == 14
    assert summary["seeded_equal_solo"] == f"{seeded}/{seeded}"


def test_load_test_percentiles_are_nearest_rank():
    values = [1.0, 2.0, 3.0, 4.0]
    assert [percentile(values, q) for q in (1, 50, 90, 99, 100)] == [1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_full_queue_answers_429_at_once(decoder, monkeypatch):
    """With one request running and one waiting, a third is answered 429 while the engine's
    round is held: the answer waits for no round and no free slot. (No round runs before the
    second request is in, so the first cannot finish early on a fast machine.)"""
    held, step = threading.Event(), Engine.step

    def held_step(engine):
        if held.is_set():
            return step(engine)
        if len(engine.scheduler.running) + len(engine.scheduler.waiting) < 2:
            time.sleep(0.001)  # no round yet: back to the engine's commands
            return []
        assert held.wait(60), "the round was never let go"
        return step(engine)

    monkeypatch.setattr(Engine, "step", held_step)
    app = create_app(decoder, MODEL, ServerConfig(max_batch=1, max_queue=1))
    with running(app) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)
        body = {"model": MODEL, "prompt": "abc", "max_tokens": LONG, "stream": True,
                "ignore_eos": True}
        with httpx.Client() as http, contextlib.ExitStack() as streams:
            for _ in range(2):  # one running, one waiting: the capacity
                response = streams.enter_context(http.stream("POST", f"{base}/v1/completions",
                                                             json=body))
                assert response.status_code == 200
            try:
                with pytest.raises(openai.RateLimitError) as err:
                    client.completions.create(model=MODEL, prompt="one more", max_tokens=2)
                assert not held.is_set() and app.state.engine.outstanding == 2
                assert err.value.body["code"] == "queue_full"
            finally:
                held.set()
        # both streams were closed: their slots are free again
        assert wait_until(lambda: app.state.engine.outstanding == 0)
        assert client.completions.create(model=MODEL, prompt="abc", max_tokens=2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def httpx_connects(base: str) -> bool:
    try:
        httpx.get(f"{base}/health", timeout=1)
    except httpx.TransportError:
        return False
    return True


def test_predicted_outputs_report_accepted_and_rejected_tokens(client, decoder):
    """`prediction` is a draft source: the text is the one decoded without it, and usage says
    how much of the prediction was accepted, as OpenAI reports it."""
    expected = alone(decoder, "abcabcabc", 24)
    for prediction in (expected, "zzzz"):
        response = client.completions.create(
            model=MODEL, prompt="abcabcabc", max_tokens=24, temperature=0,
            extra_body={"prediction": {"type": "content", "content": prediction}})
        assert response.choices[0].text == expected
        details = response.usage.completion_tokens_details
        predicted = len(decoder.tokenizer(prediction, add_special_tokens=False)["input_ids"])
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == \
            predicted
        if prediction == "zzzz":
            assert details.accepted_prediction_tokens == 0
    bad = httpx.post(f"{client.base_url}completions", json={
        "model": MODEL, "prompt": "abc", "prediction": {"type": "file", "content": "x"}})
    assert bad.status_code == 400


def test_verify_is_an_extension_field(client, decoder):
    """verify="invariant" with a seed: the server's output is plain sampling's for that seed,
    the same as the request decoded alone; an unknown procedure is a 400."""
    seeded = dict(temperature=1.0, seed=7)
    response = client.completions.create(model=MODEL, prompt="abcabcabc", max_tokens=16,
                                         extra_body={"verify": "invariant"}, **seeded)
    assert response.choices[0].text == alone(decoder, "abcabcabc", 16, verify="invariant",
                                             **seeded)
    assert response.verispec["verify"] == "invariant"
    bad = httpx.post(f"{client.base_url}completions", json={
        "model": MODEL, "prompt": "abc", "verify": "fast"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
