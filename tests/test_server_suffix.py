"""`verispec serve --draft suffix`: the lookup cache is kept per API key (or shared, or off),
checked on what the cache proposes to each request, not on the text (which is the target's
either way)."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import EOS_ID, byte_tokenizer, tiny_llama
from openai import OpenAI
from test_server import running

from verispec import SpeculativeDecoder
from verispec.drafters import SuffixDrafter
from verispec.server import ServerConfig, create_app

PROMPT = "the cat sat on the mat and the dog"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(EOS_ID + 1, seed=11, dtype=torch.float32)


def serve_and_spy(model, mode: str, monkeypatch):
    """A server in `mode` over a fresh suffix drafter, and the list its cache's proposals are
    recorded in: (scope, tokens) per lookup."""
    decoder = SpeculativeDecoder(model, byte_tokenizer(), SuffixDrafter(), k=4,
                                 runtime="native")
    cache = decoder.drafter.cache
    proposals = []
    propose = cache.propose

    def spy(scope, context, k, min_probability=0.0):
        proposal = propose(scope, context, k, min_probability)
        proposals.append((scope, proposal.tokens))
        return proposal

    monkeypatch.setattr(cache, "propose", spy)
    return create_app(decoder, "tiny", ServerConfig(suffix_cache=mode)), proposals, cache


def complete(url: str, key: str) -> str:
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=48,
                                     temperature=0, extra_body={"ignore_eos": True}
                                     ).choices[0].text


def scopes_of(proposals) -> dict:
    """scope -> the tokens the cache proposed to requests of that scope, all lookups."""
    found: dict = {}
    for scope, tokens in proposals:
        found.setdefault(scope, []).extend(tokens)
    return found


def test_per_key_a_request_never_gets_proposals_from_another_keys_text(model, monkeypatch):
    app, proposals, cache = serve_and_spy(model, "per-key", monkeypatch)
    config = ServerConfig(suffix_cache="per-key")
    key_a, key_b = (config.lookup_scope(f"Bearer {k}") for k in ("key-a", "key-b"))
    with running(app) as url:
        first = complete(url, "key-a")
        assert cache.usage().documents == 1
        proposals.clear()
        assert complete(url, "key-b") == first  # the target's text either way
        from_b = scopes_of(proposals)
        assert set(from_b) == {key_b} and from_b[key_b] == []  # nothing of key A's text
        proposals.clear()
        assert complete(url, "key-a") == first
        assert len(scopes_of(proposals)[key_a]) > 24  # key A reuses its own first answer
        assert "suffix_cache_documents 3.0" in httpx.get(f"{url}/metrics").text


def test_shared_cache_proposes_across_keys(model, monkeypatch):
    """The positive control of the test above: shared, key B is proposed key A's text."""
    app, proposals, _ = serve_and_spy(model, "shared", monkeypatch)
    with running(app) as url:
        complete(url, "key-a")
        proposals.clear()
        complete(url, "key-b")
    assert len(scopes_of(proposals)[""]) > 24


def test_off_keeps_nothing_and_proposes_nothing_from_earlier_requests(model, monkeypatch):
    app, proposals, cache = serve_and_spy(model, "off", monkeypatch)
    with running(app) as url:
        complete(url, "key-a")
        complete(url, "key-a")
    assert cache.usage().documents == 0
    assert {scope for scope, _ in proposals} <= {None}


def test_lookup_scope_by_mode():
    per_key = ServerConfig(suffix_cache="per-key")
    assert per_key.lookup_scope("Bearer sk-a") == per_key.lookup_scope("bearer  sk-a ")
    assert per_key.lookup_scope("Bearer sk-a") != per_key.lookup_scope("Bearer sk-b")
    assert "sk-a" not in per_key.lookup_scope("Bearer sk-a")
    assert per_key.lookup_scope(None) == per_key.lookup_scope("Basic xyz")  # no bearer key
    assert ServerConfig(suffix_cache="shared").lookup_scope("Bearer sk-a") == ""
    assert ServerConfig(suffix_cache="off").lookup_scope("Bearer sk-a") is None
    with pytest.raises(ValueError, match="suffix_cache"):
        ServerConfig(suffix_cache="global")
