"""Prefix affinity: which replica has already seen the start of a prompt.

A replica that served a prompt keeps what makes the next request with the same opening cheap:
its pooled caches hold the prompt's keys and values (GGUF models: `verispec.scheduler`), so the
opening is not computed again, and its lookup across requests (the default drafter's and
--draft suffix's suffix cache) holds the prompt and its answer, to be proposed again. So a
request goes where the longest run of its opening was seen before. The opening is cut into
blocks of BLOCK_CHARS characters and each block is named by a hash chained over all blocks
before it, so two prompts share the key of block i exactly when their first (i + 1) blocks are
equal:

    prefix_keys({"prompt": "a" * 300})  ->  (k0, k1)        # two whole blocks; the rest is cut
    prefix_keys({"prompt": "a" * 256 + "b" * 44})  ->  (k0, k1), the same keys

A prompt shorter than one block has no keys and goes to the least loaded replica.
`PrefixTable` remembers, for the most recent keys, the replica each went to.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

BLOCK_CHARS = 128  # about 32 tokens of English or code
MAX_BLOCKS = 32  # the opening that counts: 4,096 characters
TABLE_ENTRIES = 65_536  # keys remembered, least recently used dropped (~10 MB)


def prompt_text(body: dict) -> str:
    """The text a request's opening is read from: a completion's prompt, or a chat's messages
    as role and content pairs (JSON for anything that is not a plain string)."""
    if "messages" in body:
        parts = []
        for message in body.get("messages") or ():
            if isinstance(message, dict):
                content = message.get("content")
                content = content if isinstance(content, str) else json.dumps(content)
                parts.append(f"{message.get('role')}\x00{content}\x01")
        return "".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def prefix_keys(body: dict) -> tuple[int, ...]:
    """The chained keys of the whole BLOCK_CHARS blocks of the request's opening."""
    text = prompt_text(body)
    keys, chain = [], b""
    for start in range(0, min(len(text), BLOCK_CHARS * MAX_BLOCKS) - BLOCK_CHARS + 1,
                       BLOCK_CHARS):
        block = text[start:start + BLOCK_CHARS].encode("utf-8", "surrogatepass")
        chain = hashlib.blake2b(chain + block, digest_size=8).digest()
        keys.append(int.from_bytes(chain, "little"))
    return tuple(keys)


class PrefixTable:
    """key -> the replica that last served a request with that key, for the `capacity` keys
    used most recently.

    Example: record((1, 2, 3), "r1"); lookup((1, 2, 9)) -> ("r1", 2): two blocks in common."""

    def __init__(self, capacity: int = TABLE_ENTRIES) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def lookup(self, keys: tuple[int, ...]) -> tuple[str | None, int]:
        """-> (the replica that saw the longest run of these keys, how many blocks), or
        (None, 0)."""
        for depth in range(len(keys), 0, -1):
            owner = self._owner.get(keys[depth - 1])
            if owner is not None:
                return owner, depth
        return None, 0

    def record(self, keys: tuple[int, ...], replica: str) -> None:
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica that died took its caches with it: its keys go to whoever serves next."""
        for key in [key for key, owner in self._owner.items() if owner == replica]:
            del self._owner[key]


@dataclass(frozen=True, slots=True)
class Forwarded:
    """One HTTP request as the gateway hands it to a replica. prefix: its opening's keys
    (affinity.prefix_keys); replica: the replica it must go to (None: the router's choice)."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prefix: tuple[int, ...] = ()
    replica: str | None = None
