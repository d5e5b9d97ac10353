"""One node digest across API processes (gossip/prefix_board.py): every process's served prefixes reach
the digest process 0 gossips."""

from __future__ import annotations

import multiprocessing

from zerolayer.prefix import PrefixDigest, ServedPrefixes, block_hashes, merged_status, prompt_bytes
from zerolayer.runtime.gossip.prefix_board import PeerRecord, PrefixBoard, publish


def chat(text: str) -> list[int]:
    return block_hashes(prompt_bytes([("user", text)]))


LONG_A = "a system prompt of process zero " * 40
LONG_B = "another system prompt served by process one " * 40


def test_process_0_gossips_the_prefixes_another_process_served() -> None:
    board = PrefixBoard.create(2)
    own, theirs = ServedPrefixes(), ServedPrefixes()
    own.observe(chat(LONG_A))
    theirs.observe(chat(LONG_B))
    peer = PeerRecord(board, 1)
    before = PrefixDigest.decode(merged_status([own, peer])["digest"])
    assert before is not None and before.matched(chat(LONG_B)) == 0  # not yet published: only its own
    publish(board, 1, [theirs])
    status = merged_status([own, peer])
    digest = PrefixDigest.decode(status["digest"])
    assert digest is not None
    assert digest.matched(chat(LONG_A)) == len(chat(LONG_A))
    assert digest.matched(chat(LONG_B)) == len(chat(LONG_B))
    assert status["blocks"] == len(own) + len(theirs)


def test_counters_and_hit_rate_add_up() -> None:
    board = PrefixBoard.create(3)
    records = [ServedPrefixes() for _ in range(2)]
    for record in records:
        record.observe(chat(LONG_B))
        record.observe(chat(LONG_B))  # all hits the second time
    publish(board, 2, records)
    peer = PeerRecord(board, 2)
    peer.digest()
    assert (len(peer), peer.blocks_hit, peer.blocks_seen) == (
        sum(len(r) for r in records), sum(r.blocks_hit for r in records), sum(r.blocks_seen for r in records))
    assert PeerRecord(board, 1).status()["blocks"] == 0  # a process that never wrote adds nothing


def _publish_in_child(board: PrefixBoard) -> None:
    record = ServedPrefixes()
    record.observe(chat(LONG_B))
    publish(board, 1, [record])


def test_a_spawned_process_s_digest_is_read_by_process_0() -> None:
    ctx = multiprocessing.get_context("spawn")
    board = PrefixBoard.create(2, context=ctx)
    child = ctx.Process(target=_publish_in_child, args=(board,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    digest = PeerRecord(board, 1).digest()
    assert digest.matched(chat(LONG_B)) == len(chat(LONG_B))
