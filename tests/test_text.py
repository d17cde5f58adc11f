"""TextStream: pieces streamed round by round add up to decoding all the ids at once."""

from __future__ import annotations

import random

import pytest

from verispec.text import TextStream


def _byte_chars() -> dict[int, str]:
    """GPT-2's ByteLevel table: each byte stands for a printable character (the printable
    Latin-1 bytes for themselves, the others for 256, 257, ... in order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _byte_ids(tokenizer, data: bytes) -> list[int]:
    """The byte tokenizer's ids for raw bytes, valid UTF-8 or not (one id per byte)."""
    char_of = _byte_chars()
    return tokenizer.convert_tokens_to_ids([char_of[b] for b in data])


def test_byte_ids_decode_back(tokenizer):
    text = "plain, é € 漢 🙂"
    assert tokenizer.decode(_byte_ids(tokenizer, text.encode())) == text


def _stream(tokenizer, ids: list[int], sizes: list[int], stop: tuple[str, ...] = ()):
    stream, pieces, at = TextStream(tokenizer, stop), [], 0
    for size in sizes:
        if at >= len(ids) or stream.stopped:
            break
        pieces.append(stream.add(ids[at:at + size]))
        at += size
    if not stream.stopped:
        pieces.append(stream.flush())
    return stream, pieces


@pytest.mark.parametrize("seed", range(6))
def test_pieces_add_up_to_the_whole_decode_across_split_characters(tokenizer, seed):
    """Multi-byte characters split across rounds, invalid bytes, rounds of 1-4 ids: the text
    streamed so far is always a prefix of the final text, and all of it is decode(ids)."""
    rng = random.Random(seed)
    chars = ["a", " ", "\n", "é", "€", "漢", "🙂", "ß"]
    data = b"".join(rng.choice(chars).encode() for _ in range(120))
    data = bytearray(data)
    for _ in range(4):  # a few invalid bytes: lone continuation or truncated lead bytes
        data.insert(rng.randrange(len(data)), rng.choice([0x80, 0xE2, 0xF0]))
    ids = _byte_ids(tokenizer, bytes(data))
    sizes = [rng.randint(1, 4) for _ in ids]
    stream, pieces = _stream(tokenizer, ids, sizes)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == whole == stream.text
    released = ""
    for piece in pieces:
        released += piece
        assert whole.startswith(released)


def test_a_stop_string_of_multibyte_characters_cuts_where_decoding_all_would(tokenizer):
    text = "price: 12€ then 13€€ and more"
    ids = _byte_ids(tokenizer, text.encode())
    for size in (1, 2, 3, 5):
        stream, pieces = _stream(tokenizer, ids, [size] * len(ids), stop=("€€",))
        assert stream.stopped and stream.text == "price: 12€ then 13" == "".join(pieces)
        assert tokenizer.decode(ids[:stream.num_tokens]).endswith("€€")
        assert "€€" not in tokenizer.decode(ids[:stream.num_tokens - 1])


def test_a_stop_string_after_a_held_back_character_cuts_the_ids_at_it(tokenizer):
    """A round whose text ends inside a character is held back until a later round completes
    it; a stop string in the held-back round still cuts the ids right after it, however the
    ids were split into rounds (the output's ids must not depend on the rounds' sizes)."""
    euro = "€".encode()  # three bytes: a round ending after one or two of them is held back
    ids = _byte_ids(tokenizer, b"ab" + euro[:2] + b"o" + euro[2:] + b"cd")  # "o": the stop
    cuts = set()
    for first in range(1, len(ids)):
        for second in range(first + 1, len(ids)):
            stream = TextStream(tokenizer, ("o",))
            for part in (ids[:first], ids[first:second], ids[second:]):
                stream.add(part)
                if stream.stopped:
                    break
            assert stream.stopped
            cuts.add(stream.num_tokens)
    assert cuts == {5}  # a, b, two bytes of the euro sign, o
