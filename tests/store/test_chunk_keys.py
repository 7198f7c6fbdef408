"""Chained chunk digests: a key names exactly one prefix, its position and its length."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from kvredis.store.chunk_keys import ChunkKeys, ChunkPlan, chunk_seed
from kvredis.store.keys import context_digest

SALT = context_digest([("salt", "tenant-a")])


def test_chunks_of_a_prompt_and_their_spans() -> None:
    plan = ChunkPlan.of(list(range(100)), 32)
    assert plan.num_chunks == 4
    assert [plan.span(i) for i in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert [plan.is_full(i) for i in range(4)] == [True, True, True, False]
    assert plan.chunk_tokens_of(3).tolist() == [96, 97, 98, 99]
    with pytest.raises(IndexError):
        plan.span(4)


@pytest.mark.parametrize(("start", "stop", "chunks"), [
    (0, 99, [0, 1, 2, 3]),     # a decode loads all but the last token: the short chunk is still needed
    (32, 99, [1, 2, 3]),       # a local hit of one chunk
    (48, 99, [1, 2, 3]),       # a local hit ending inside chunk 1: read whole
    (64, 96, [2]),
    (64, 97, [2, 3]),
    (50, 50, []),
])
def test_the_chunks_covering_positions(start: int, stop: int, chunks: list[int]) -> None:
    assert list(ChunkPlan.of(list(range(100)), 32).covering(start, stop)) == chunks


def test_positions_outside_the_prompt_are_refused() -> None:
    plan = ChunkPlan.of(list(range(10)), 4)
    with pytest.raises(ValueError, match="outside"):
        plan.covering(0, 11)
    with pytest.raises(ValueError, match="positive"):
        ChunkPlan.of([1, 2], 0)


def test_prompts_sharing_a_prefix_share_its_full_chunks_and_nothing_after() -> None:
    base = list(range(1000, 1100))
    a = ChunkPlan.of([*base, 1, 2, 3], 32)
    b = ChunkPlan.of([*base, 4, 5, 6], 32)
    assert a.digests[:3] == b.digests[:3]
    assert a.digests[3] != b.digests[3]


def test_a_short_last_chunk_is_never_a_full_one() -> None:
    short = ChunkPlan.of(list(range(40)), 32)       # chunk 1 holds 8 positions
    longer = ChunkPlan.of(list(range(64)), 32)      # chunk 1 holds 32, the first 8 the same
    assert short.digests[0] == longer.digests[0]
    assert short.digests[1] != longer.digests[1]


def test_a_change_anywhere_before_a_chunk_changes_its_key() -> None:
    tokens = list(range(96))
    reference = ChunkPlan.of(tokens, 32).digests
    changed = tokens.copy()
    changed[5] += 1
    assert all(x != y for x, y in zip(reference, ChunkPlan.of(changed, 32).digests, strict=True))


def test_the_chunk_length_is_part_of_the_key() -> None:
    # Chunk 0 of a 64-token chunking ends where chunk 1 of a 32-token one does: other pages, other key.
    assert ChunkPlan.of(list(range(64)), 64).digests[0] not in ChunkPlan.of(list(range(64)), 32).digests


def test_the_context_is_part_of_every_key() -> None:
    tokens = list(range(70))
    plain, salted = ChunkPlan.of(tokens, 32), ChunkPlan.of(tokens, 32, SALT)
    assert not set(plain.digests) & set(salted.digests)
    other = ChunkPlan.of(tokens, 32, context_digest([("salt", "tenant-b")]))
    assert not set(other.digests) & set(salted.digests)
    with pytest.raises(ValueError, match="digest"):
        chunk_seed("not-a-digest")


def test_digests_do_not_depend_on_how_tokens_arrive() -> None:
    tokens = list(range(50))
    reference = ChunkPlan.of(tokens, 16).digests
    assert ChunkPlan.of(tuple(tokens), 16).digests == reference
    assert ChunkPlan.of(torch.tensor(tokens, dtype=torch.int32), 16).digests == reference
    assert ChunkPlan.of(torch.tensor(tokens), 16).digests == reference


def test_digests_follow_the_documented_chain() -> None:
    # Computed here from the module's description, not its code: a changed chain would silently orphan
    # every chunk a deployment stored (and engines of two releases would stop sharing).
    def blake(person: bytes, *parts: bytes) -> str:
        hasher = hashlib.blake2b(digest_size=16, person=person)
        for part in parts:
            hasher.update(part)
        return hasher.hexdigest()

    tokens = [7, 8, 9, 10, 11]
    seed = blake(b"kvredis-chseed", SALT.encode())
    first = blake(b"kvredis-chunk", bytes.fromhex(seed), (0).to_bytes(8, "little"), (4).to_bytes(8, "little"),
                  struct.pack("<4q", *tokens[:4]))
    second = blake(b"kvredis-chunk", bytes.fromhex(first), (4).to_bytes(8, "little"),
                   (1).to_bytes(8, "little"), struct.pack("<q", tokens[4]))
    assert ChunkPlan.of(tokens, 4, SALT).digests == (first, second)
    assert chunk_seed() == blake(b"kvredis-chseed")


def test_keys_carry_the_digest_as_their_slot() -> None:
    keys = ChunkKeys("ns:abc")
    digest = "0" * 32
    assert keys.chunk(digest) == "ns:abc:c:{" + digest + "}"
    assert keys.holders(digest).startswith(keys.chunk(digest))
    assert keys.pattern == "ns:abc:c:*"
