"""`verispec serve` against bad input, big bodies, missing keys and shutdown.

Every class of input a decoding round could fail on is refused at submission with a 400 in
OpenAI's error object, quickly, on a connection that stays open; limits answer before any work
(413 from Content-Length, 400 before tokenising); /v1/* wants the API key; after SIGTERM the
requests in flight get --shutdown-timeout seconds, then the process exits 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from conftest import EOS_ID, tiny_llama
from fastapi.testclient import TestClient
from openai import OpenAI
from test_server import MODEL, alone, decoder, free_port, httpx_connects, running, wait_until

from verispec.engine import Engine, Event
from verispec.server import ServerConfig, create_app
from verispec.server.prompts import Prompts
from verispec.server.protocol import APIError

__all__ = ["decoder"]  # the tiny model, shared with test_server.py

KEY = "sk-test-key"
AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
CONTEXT = 2048  # the tiny model's


@pytest.fixture(scope="module")
def app(decoder):
    return create_app(decoder, MODEL, ServerConfig(api_key=KEY))


@pytest.fixture(scope="module")
def url(app):
    with running(app) as base:
        yield base


def post(url: str, body: dict, path: str = "/v1/completions") -> tuple[httpx.Response, float]:
    """POST a body serialised by json.dumps (escapes lone surrogates as httpx would not)."""
    started = time.perf_counter()
    response = httpx.post(f"{url}{path}", content=json.dumps(body), headers=AUTH, timeout=30)
    return response, time.perf_counter() - started


def exchange(url: str, requests: list[bytes]) -> list[bytes]:
    """Send raw HTTP/1.1 requests one after another on ONE connection -> each status line."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    lines = []
    with socket.create_connection((host, port), timeout=30) as sock:
        reader = sock.makefile("rb")
        for request in requests:
            sock.sendall(request)
            lines.append(reader.readline().strip())
            length = 0
            while (header := reader.readline().strip()):
                name, _, value = header.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            reader.read(length)
    return lines


def raw_post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            ).encode() + body


HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"

# (class, body fields over {"model", "prompt": "hi"}, endpoint, status, param)
BAD_INPUTS = [
    ("seed 2**64", {"seed": 2**64}, "completions", 400, "seed"),
    ("seed 10**30", {"seed": 10**30}, "completions", 400, "seed"),
    ("seed -1", {"seed": -1}, "completions", 400, "seed"),
    ("temperature 1e-300", {"temperature": 1e-300}, "completions", 400, "temperature"),
    ("token id outside the vocabulary", {"prompt": [1, EOS_ID + 1]}, "completions", 400,
     "prompt"),
    ("negative token id", {"prompt": [-1]}, "completions", 400, "prompt"),
    ("lone surrogate in the prompt", {"prompt": "a\ud800b"}, "completions", 400, "prompt"),
    ("lone surrogate in a message", {"messages": [{"role": "user", "content": "a\ud800b"}]},
     "chat", 400, "messages"),
    ("lone surrogate in a stop string", {"stop": ["\udfff"]}, "completions", 400, "stop"),
    ("lone surrogate in the model", {"model": "x\ud800"}, "completions", 400, "model"),
    ("max_tokens beyond the context", {"max_tokens": CONTEXT}, "completions", 400,
     "max_tokens"),
    ("max_tokens 10**9", {"max_tokens": 10**9, "messages": [{"role": "user", "content": "hi"}]},
     "chat", 400, "max_tokens"),
    ("prompt over the token limit", {"prompt": "a" * CONTEXT}, "completions", 400, "prompt"),
    ("logit_bias", {"logit_bias": {"1": 5}}, "completions", 400, "logit_bias"),
    ("tools", {"tools": [{"type": "function"}], "messages": [{"role": "user", "content": "hi"}]},
     "chat", 400, "tools"),
    ("repetition_penalty", {"repetition_penalty": 1.2}, "completions", 400,
     "repetition_penalty"),
]


@pytest.mark.parametrize(("name", "fields", "endpoint", "status", "param"), BAD_INPUTS,
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_refused_at_submission(url, app, name, fields, endpoint, status, param,
                                            monkeypatch):
    engine, submitted = app.state.engine, []
    submit = engine.submit

    async def counted(*args, **kwargs):
        submitted.append(args)
        return await submit(*args, **kwargs)

    monkeypatch.setattr(engine, "submit", counted)
    body = {"model": MODEL, "prompt": "hi", **fields}
    if endpoint == "chat":
        body.pop("prompt")
    response, _ = post(url, body, "/v1/chat/completions" if endpoint == "chat"
                       else "/v1/completions")
    error = response.json()["error"]
    assert response.status_code == status, error
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param)
    assert submitted == [] and engine.outstanding == 0  # refused before the engine


def test_a_lone_surrogate_in_a_prediction_is_named_alone(url):
    """A union field (text, or a list of text parts) whose text member refused the value says
    why, without the list member's complaint."""
    response, _ = post(url, {"model": MODEL, "prompt": "hi",
                             "prediction": {"type": "content", "content": "a\ud800b"}},
                       "/v1/completions")
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prediction"
    assert "not valid Unicode" in error["message"] and "valid list" not in error["message"]


def test_a_lone_surrogate_keeps_the_connection(url):
    bad = json.dumps({"model": MODEL, "prompt": "a\ud800b"}).encode()
    assert exchange(url, [raw_post("/v1/completions", bad), HEALTH]) == [
        b"HTTP/1.1 400 Bad Request", b"HTTP/1.1 200 OK"]


def test_top_p_below_float32_decodes_as_greedy_and_other_fields_are_ignored(url, decoder):
    response, _ = post(url, {"model": MODEL, "prompt": "abcabc", "max_tokens": 12,
                             "temperature": 1.0, "top_p": 1e-300, "seed": 2**64 - 1,
                             "user": "someone", "metadata": {"a": "b"}})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == alone(decoder, "abcabc", 12)


def test_a_default_max_tokens_is_cut_to_the_context(url, decoder):
    rendered = len("<user>\n<assistant>")  # the template's bytes around the message
    prompt = "ab" * ((CONTEXT - 4 - rendered) // 2)  # 4 tokens of room, under chat's 256
    response, _ = post(url, {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                             "temperature": 0, "ignore_eos": True}, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert response.json()["usage"]["total_tokens"] == CONTEXT


def test_an_internal_error_answers_an_id_not_its_text(url, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("secret /path/to/weights")

    monkeypatch.setattr(Prompts, "fit", crash)
    response, _ = post(url, {"model": MODEL, "prompt": "hi"})
    error = response.json()["error"]
    assert response.status_code == 500 and error["type"] == "server_error"
    assert error["message"].startswith("internal error (id ") and "secret" not in response.text
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    assert exchange(url, [raw_post("/v1/completions", body), HEALTH]) == [
        b"HTTP/1.1 500 Internal Server Error", b"HTTP/1.1 200 OK"]


def test_a_failed_row_fails_alone(url, decoder, monkeypatch):
    if "error" not in Event.__dataclass_fields__:
        pytest.skip("this engine reports no per-row errors")
    step = Engine.step
    poisoned = decoder.encode("poison", chat=False).tolist()

    def poisoning_step(engine):
        events = step(engine)
        bad = {r.request_id for r in engine.scheduler.running if r.prompt_ids.tolist() == poisoned}
        for request_id in bad:
            engine.cancel(request_id)
        return [Event(e.request_id, "", [], error=RuntimeError("poison"))
                if e.request_id in bad else e for e in events]

    monkeypatch.setattr(Engine, "step", poisoning_step)
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    prompts = ["abcabc", "poison", "hello hello", "xyz xyz", "poison"]  # one poison streams
    results: dict[int, object] = {}

    def one(index: int) -> None:
        try:
            chunks = client.completions.create(model=MODEL, prompt=prompts[index], max_tokens=30,
                                               temperature=0, stream=index % 2 == 0,
                                               extra_body={"ignore_eos": True})
            results[index] = "".join(c.choices[0].text for c in chunks if c.choices) \
                if index % 2 == 0 else chunks.choices[0].text
        except openai.APIError as err:
            results[index] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    monkeypatch.undo()
    for index, prompt in enumerate(prompts):
        if prompt == "poison":
            assert isinstance(results[index], openai.APIError)
            assert "internal error" in str(results[index]) and "poison" not in str(
                results[index])
        else:
            assert results[index] == alone(decoder, prompt, 30, ignore_eos=True), index


def test_a_20_mb_prompt_is_refused_at_once_and_delays_no_one(url):
    """The server answers from the Content-Length, before the body: the 413 comes back while
    only the body's first bytes were sent, and a small request made while that upload stands
    half-sent completes (with the answer it gets alone) before the upload goes on or the 413 is
    read."""
    small = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0}
    expected, _ = post(url, small)
    with socket.create_connection((urlsplit(url).hostname, urlsplit(url).port),
                                  timeout=30) as sock:
        sock.sendall(raw_post("/v1/completions", b"")[:-len(b"content-length: 0\r\n\r\n")] +
                     b"content-length: 20000000\r\n\r\n" + b'{"model": "tiny", "prompt": "')
        response, _ = post(url, small)  # the upload stands, 20 MB short
        assert response.status_code == 200
        assert response.json()["choices"] == expected.json()["choices"]
        assert sock.makefile("rb").readline().startswith(b"HTTP/1.1 413")
    # ... and a client that uploads it all still reads the 413, not a reset connection.
    huge = json.dumps({"model": MODEL, "prompt": "x" * 20_000_000}).encode()
    response = httpx.post(f"{url}/v1/completions", content=huge, headers=AUTH, timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_an_upload_without_length_is_cut_at_the_limit(decoder):
    app = create_app(decoder, MODEL, ServerConfig(max_body_bytes=4096))
    with TestClient(app) as http:
        chunks = (b'{"model": "tiny", "prompt": "' + b"x" * 1000 for _ in range(10))
        response = http.post("/v1/completions", content=chunks,
                             headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                  "max_tokens": 2}).status_code == 200


def test_a_long_text_is_refused_before_tokenising(url, monkeypatch):
    monkeypatch.setattr(Prompts, "_encode", lambda *args: pytest.fail("tokenised"))
    response, _ = post(url, {"model": MODEL, "prompt": "x" * 1_000_000})
    assert response.status_code == 400 and "cannot fit" in response.json()["error"]["message"]
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_every_prompt_over_the_context_is_answered_alike(decoder):
    """A prompt found too long only once tokenised (its text passed the bytes check) gets
    the same error as one refused before: code context_length_exceeded, param prompt; text,
    chat messages and token ids alike."""
    prompts = Prompts(decoder)
    prompts.max_token_bytes = 10 ** 6  # let every text through the bytes check
    context = prompts.context
    try:
        for encode, prompt in [(prompts._completion_ids, "x" * (context + 5)),
                               (prompts._completion_ids, [5] * (context + 5)),
                               (prompts._chat_ids, [{"role": "user", "content": "x" * context}])]:
            with pytest.raises(APIError) as refused:
                encode(prompt)
            assert (refused.value.code, refused.value.param) == ("context_length_exceeded",
                                                                 "prompt")
    finally:
        prompts.close()


def test_the_api_key_guards_v1_and_not_health(url):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"},
                    {"authorization": KEY}):
        response = httpx.get(f"{url}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_metrics_protected_and_docs_off_unless_asked(decoder, url):
    assert httpx.get(f"{url}/docs").status_code == 404
    assert httpx.get(f"{url}/openapi.json").status_code == 404
    guarded = TestClient(create_app(decoder, MODEL, ServerConfig(api_key=KEY,
                                                                 protect_metrics=True)))
    assert guarded.get("/metrics").status_code == 401 and guarded.get("/health").status_code \
        == 401
    assert guarded.get("/health", headers=AUTH).status_code == 200
    documented = TestClient(create_app(decoder, MODEL, ServerConfig(docs=True)))
    assert documented.get("/openapi.json").status_code == 200
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(protect_metrics=True)


def test_draining_answers_503(url, app):
    app.state.draining = True
    try:
        response = httpx.get(f"{url}/v1/models", headers=AUTH)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "shutting_down"
    finally:
        app.state.draining = False
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200


@pytest.fixture(scope="module")
def long_context_target(tmp_path_factory, tokenizer):
    """The tiny target with a long context: a stream that runs for a minute."""
    folder = tmp_path_factory.mktemp("long") / "target"
    model = tiny_llama(EOS_ID + 1, seed=0)
    model.config.max_position_embeddings = 32768
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_sigterm_finishes_short_requests_cuts_long_ones_and_exits_0(long_context_target):
    timeout = 4.0
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "verispec.cli", "serve", "--target", str(long_context_target),
         "--draft", "ngram", "--k", "3", "--port", str(port), "--shutdown-timeout",
         str(timeout)], env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def healthy() -> bool:
            assert process.poll() is None, process.stderr.read()
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"{base}/health").status_code == 200
            return False

        assert wait_until(healthy, timeout=180)
        # A client that never reads a stream that would run for minutes.
        never_read = socket.create_connection(("127.0.0.1", port))
        body = json.dumps({"model": "target", "prompt": "abc", "max_tokens": 30000,
                           "ignore_eos": True, "stream": True}).encode()
        never_read.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                           f"application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                           .encode() + body)
        short = {"model": "target", "prompt": "abc", "max_tokens": 100, "ignore_eos": True,
                 "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base}/v1/completions", json=short) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert wait_until(lambda: not httpx_connects(base), timeout=5)  # stopped accepting
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["usage"]["completion_tokens"] == 100
        assert process.wait(timeout=timeout + 20) == 0
        assert time.monotonic() - signalled < timeout + 10
        never_read.close()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_a_client_that_leaves_midway_through_its_body_is_not_a_server_error(url):
    """Half a body, then the connection closed: counted under 499 (the client closed it), not
    500, which would page whoever watches the server's errors."""
    def counted(status: str) -> float:
        text = httpx.get(f"{url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("verispec_requests_total{") and
                   f'status="{status}"' in line and "/v1/completions" in line)

    errors, closed = counted("500"), counted("499")
    with socket.create_connection((urlsplit(url).hostname, urlsplit(url).port),
                                  timeout=30) as sock:
        sock.sendall(raw_post("/v1/completions", b'{"model": ' + b" " * 490)[:-400])
    assert wait_until(lambda: counted("499") > closed)
    assert counted("500") == errors
