"""Prefix keys, the prefix table, and replica-labelled metrics pages (no Ray needed)."""

from __future__ import annotations

from verispec.server.affinity import BLOCK_CHARS, MAX_BLOCKS, PrefixTable, prefix_keys
from verispec.server.metrics import merge, with_labels


def test_prompts_share_the_keys_of_the_whole_blocks_they_share():
    shared = "x" * (2 * BLOCK_CHARS)
    one = prefix_keys({"prompt": shared + "a" * BLOCK_CHARS})
    other = prefix_keys({"prompt": shared + "b" * BLOCK_CHARS})
    assert len(one) == len(other) == 3
    assert one[:2] == other[:2] and one[2] != other[2]
    # a block's key depends on every block before it, not on the block alone
    assert prefix_keys({"prompt": "y" * BLOCK_CHARS + "z" * BLOCK_CHARS})[1] != \
        prefix_keys({"prompt": "w" * BLOCK_CHARS + "z" * BLOCK_CHARS})[1]
    assert prefix_keys({"prompt": "short"}) == ()
    assert prefix_keys({"prompt": shared + "tail"}) == one[:2]  # a partial block is cut
    assert len(prefix_keys({"prompt": "q" * BLOCK_CHARS * (MAX_BLOCKS + 5)})) == MAX_BLOCKS


def test_chat_keys_read_roles_and_contents():
    system = {"role": "system", "content": "You are terse. " * 20}
    first = prefix_keys({"messages": [system, {"role": "user", "content": "hi"}]})
    second = prefix_keys({"messages": [system, {"role": "user", "content": "bye"}]})
    assert first and first[:-1] == second[:-1]
    as_user = prefix_keys({"messages": [{**system, "role": "user"}]})
    assert as_user[0] != first[0]
    parts = prefix_keys({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "p" * 300}]}]})
    assert len(parts) == 2
    assert prefix_keys({"prompt": [1, 2, 3] * 100})  # token ids count too


def test_the_table_finds_the_longest_run_seen_and_forgets_what_it_must():
    table = PrefixTable(capacity=4)
    table.record((1, 2, 3), "r1")
    table.record((1, 7), "r2")
    assert table.lookup((1, 2, 3, 4)) == ("r1", 3)
    assert table.lookup((1, 7, 8)) == ("r2", 2)
    assert table.lookup((1, 9)) == ("r2", 1)  # key 1 went to r2 last
    assert table.lookup((5,)) == (None, 0)
    table.record((6,), "r1")  # five keys: the least recently used one (2) is dropped
    assert len(table) == 4 and table.lookup((1, 2)) == ("r2", 1)
    table.forget("r2")
    assert table.lookup((1, 7)) == (None, 0) and table.lookup((1, 2, 3)) == ("r1", 3)


def test_metrics_pages_carry_their_replica_and_merge_into_one():
    page = ('# HELP x_total requests\n# TYPE x_total counter\nx_total{path="/a"} 2.0\n'
            '# HELP up in flight\n# TYPE up gauge\nup 1.0\n')
    first, second = with_labels(page, {"replica": "r1"}), with_labels(page, {"replica": "r2"})
    assert 'x_total{replica="r1",path="/a"} 2.0' in first.splitlines()
    assert 'up{replica="r2"} 1.0' in second.splitlines()
    merged = merge([first, second]).splitlines()
    assert merged.count("# TYPE x_total counter") == 1
    # each family's samples together, right after its HELP and TYPE
    assert merged[:4] == ["# HELP x_total requests", "# TYPE x_total counter",
                          'x_total{replica="r1",path="/a"} 2.0',
                          'x_total{replica="r2",path="/a"} 2.0']
    assert merged[-2:] == ['up{replica="r1"} 1.0', 'up{replica="r2"} 1.0']
