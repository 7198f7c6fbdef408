"""Transfers over the chunk store: a prefill saves what Redis lacks, a decode takes what it lacks, and nothing
is left once every transfer was taken or discarded."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvredis.errors import CodecError, KVRedisConnectionError
from kvredis.store import codec
from kvredis.store import transfer as transfer_module
from kvredis.store.chunk_store import PageFormat
from kvredis.store.client import RedisStore
from kvredis.store.keys import new_entry_id, reader_id
from kvredis.store.transfer import Taken, Transfers
from kvredis.v0.buffer import RedisLookupBuffer

BLOCK = 16
CHUNK = 32
FORMAT = PageFormat(torch.float32, layers=2, page_shape=(2, BLOCK, 4))


@pytest.fixture(params=["writes all", "asks first"])
def make_transfers(make_buffer: Callable[..., RedisLookupBuffer], request: pytest.FixtureRequest,
                   monkeypatch: pytest.MonkeyPatch) -> Callable[..., Transfers]:
    """Transfers whose saves write every chunk with write-if-absent (small saves, as these tests' all are)
    or ask Redis first which chunks it holds (saves of more than 256 KiB of pages)."""
    if request.param == "asks first":
        monkeypatch.setattr(transfer_module, "_PROBE_ABOVE_BYTES", -1)

    def make(pop_timeout_s: float = 2.0, prefix: str | None = None) -> Transfers:
        buffer = make_buffer(pop_timeout_s=pop_timeout_s)
        return Transfers(buffer.store, prefix or buffer.keyspace.prefix, chunk_tokens=CHUNK, block_size=BLOCK,
                         ttl_ms=60_000, pop_timeout_s=pop_timeout_s, max_chunk_bytes=1 << 20)
    return make


def prompt_pages(num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Pages for every block of a prompt whose values name their block (so a misplaced chunk shows)."""
    blocks = -(-num_tokens // BLOCK)
    pages = torch.arange(blocks, dtype=torch.float32).reshape(1, blocks, 1, 1, 1) + 1000 * seed
    return pages.expand(FORMAT.layers, blocks, *FORMAT.page_shape).contiguous()


def keys_left(transfers: Transfers) -> list[str]:
    return list(transfers.store.scan(f"{transfers.prefix}:*"))


def test_a_decode_takes_the_chunks_it_lacks_and_nothing_is_left(make_transfers) -> None:
    transfers = make_transfers()
    tokens = list(range(100))
    plan = transfers.plan(tokens)
    transfer = new_entry_id()
    saved = transfers.save(plan, prompt_pages(100), transfer_id=transfer)
    assert (saved.written, saved.present) == (4, 0)
    # The decode's prefix cache holds 48 positions: chunks 1-3 are read, chunk 1 whole.
    taken = transfers.take(plan, 48, 99, FORMAT, transfer_id=transfer)
    assert (taken.cause, taken.first, len(taken.chunks)) == ("hit", 1, 3)
    assert taken.stop(plan) == 100
    got = torch.cat(taken.chunks, dim=1)
    assert torch.equal(got, prompt_pages(100)[:, 2:])
    chunk_bytes = 2 * FORMAT.layers * 2 * BLOCK * 4 * 4
    lacked_bytes = (99 - 48) / BLOCK * chunk_bytes / 2
    assert sum(c.numel() * 4 for c in taken.chunks) <= lacked_bytes + chunk_bytes
    assert keys_left(transfers) == []


def test_the_next_turn_writes_only_its_new_chunks(make_transfers) -> None:
    transfers = make_transfers()
    first = transfers.plan(list(range(64)))
    transfers.save(first, prompt_pages(64), transfer_id=(one := new_entry_id()))
    second = transfers.plan([*range(64), *range(900, 950)])
    saved = transfers.save(second, prompt_pages(114, seed=1), transfer_id=(two := new_entry_id()))
    assert (saved.written, saved.present) == (2, 2)
    # Both transfers are in flight: the first decode's take must not delete what the second needs.
    assert transfers.take(first, 0, 63, FORMAT, transfer_id=one).cause == "hit"
    taken = transfers.take(second, 0, 113, FORMAT, transfer_id=two)
    assert taken.cause == "hit" and len(taken.chunks) == 4
    assert torch.equal(taken.chunks[0], prompt_pages(64)[:, :2])  # the first prefill's copy
    assert keys_left(transfers) == []


def test_a_decode_that_arrives_first_waits_for_the_record(make_transfers) -> None:
    transfers = make_transfers(pop_timeout_s=30.0)
    plan = transfers.plan(list(range(40)))
    transfer = new_entry_id()
    writer = threading.Timer(0.3, lambda: transfers.save(plan, prompt_pages(40), transfer_id=transfer))
    writer.start()
    try:
        started = time.monotonic()
        taken = transfers.take(plan, 0, 39, FORMAT, transfer_id=transfer)
    finally:
        writer.join(timeout=30)
    assert taken.cause == "hit" and time.monotonic() - started < 30
    assert keys_left(transfers) == []


def test_a_chunk_gone_before_the_decode_ends_what_it_takes(make_transfers) -> None:
    transfers = make_transfers()
    plan = transfers.plan(list(range(128)))
    transfer = new_entry_id()
    transfers.save(plan, prompt_pages(128), transfer_id=transfer)
    transfers.store.delete([transfers.chunks.keys.chunk(plan.digests[2])])  # evicted
    taken = transfers.take(plan, 0, 127, FORMAT, transfer_id=transfer)
    assert (taken.cause, len(taken.chunks), taken.stop(plan)) == ("absent", 2, 64)
    assert keys_left(transfers) == []  # the chunk after the hole was released too


def test_no_record_within_the_bound_is_late(make_transfers) -> None:
    transfers = make_transfers(pop_timeout_s=0.2)
    plan = transfers.plan(list(range(40)))
    taken = transfers.take(plan, 0, 39, FORMAT, transfer_id=new_entry_id())
    assert (taken.cause, taken.chunks) == ("late", [])


def test_a_lost_first_chunk_is_absent_not_late(make_transfers) -> None:
    """The record came and the first chunk did not: nothing read, but the transfer was taken, so a reader
    must not wait for its record again (it tells the two apart by the cause)."""
    transfers = make_transfers()
    plan = transfers.plan(list(range(128)))
    transfer = new_entry_id()
    transfers.save(plan, prompt_pages(128), transfer_id=transfer)
    transfers.store.delete([transfers.chunks.keys.chunk(plan.digests[0])])
    taken = transfers.take(plan, 0, 127, FORMAT, transfer_id=transfer)
    assert (taken.cause, taken.chunks, taken.stop(plan)) == ("absent", [], 0)
    assert keys_left(transfers) == []


def test_a_record_of_another_prompt_is_foreign_and_released(make_transfers) -> None:
    transfers = make_transfers()
    transfer = new_entry_id()
    transfers.save(transfers.plan(list(range(64))), prompt_pages(64), transfer_id=transfer)
    taken = transfers.take(transfers.plan(list(range(1, 65))), 0, 63, FORMAT, transfer_id=transfer)
    assert taken.cause == "foreign"
    assert keys_left(transfers) == []


def test_a_corrupt_record_is_dropped(make_transfers) -> None:
    transfers = make_transfers()
    transfer = new_entry_id()
    transfers.store.push_record(transfers.record_key(transfer), b"KVR\x02garbage", 60_000)
    taken = transfers.take(transfers.plan(list(range(40))), 0, 39, FORMAT, transfer_id=transfer)
    assert taken.cause == "corrupt"


@pytest.mark.parametrize("damage", ["a flipped bit", "cut short", "another space", "another id"])
def test_a_damaged_record_is_corrupt(make_transfers, damage: str) -> None:
    """A record that fails its checks names nothing: it releases nothing (a chunk's holds are dropped only
    by the record naming them, so a damaged one cannot release another prompt's chunk)."""
    transfers = make_transfers()
    plan = transfers.plan(list(range(40)))
    transfer = new_entry_id()
    record = transfer_module.encode_record(transfers.prefix, transfer, plan.digests, 40, CHUNK)
    if damage == "a flipped bit":
        record = record[:-10] + bytes([record[-10] ^ 1]) + record[-9:]  # in a digest
    elif damage == "cut short":
        record = record[:-9] + record[-8:]
    elif damage == "another space":
        record = transfer_module.encode_record(transfers.prefix + "x", transfer, plan.digests, 40, CHUNK)
    else:
        record = transfer_module.encode_record(transfers.prefix, new_entry_id(), plan.digests, 40, CHUNK)
    with pytest.raises(CodecError):
        transfer_module.record_digests(record, transfer, transfers.prefix)
    transfers.store.push_record(transfers.record_key(transfer), record, 60_000)
    assert transfers.take(plan, 0, 39, FORMAT, transfer_id=transfer).cause == "corrupt"


def test_a_record_names_the_digests_it_was_written_with() -> None:
    digests = (bytes(range(16)).hex(), bytes(range(16, 32)).hex())
    record = transfer_module.encode_record("ns:abc", "a" * 16, digests, 70, 64)
    assert record.startswith(transfer_module.RECORD_MAGIC)
    assert transfer_module.record_digests(record, "a" * 16, "ns:abc") == digests
    assert transfer_module.record_digests(bytearray(record), "a" * 16, "ns:abc") == digests


def test_a_record_in_the_codec_format_of_before_is_still_read(make_transfers) -> None:
    """A prefill not yet upgraded pushes its record as a codec blob: the decode takes it (as another record:
    decoded and checked) and a discard releases what it names."""
    transfers = make_transfers()
    plan = transfers.plan(list(range(70)))

    def old_record(transfer: str) -> bytes:
        meta = {"kind": "transfer", "space": transfers.prefix, "id": transfer, "tokens": 70,
                "chunk_tokens": CHUNK}
        return codec.encode([memoryview(bytes.fromhex("".join(plan.digests)))], meta).to_bytes()

    for ending in ("take", "discard"):
        transfer = new_entry_id()
        transfers.save(plan, prompt_pages(70), transfer_id=transfer)
        key = transfers.record_key(transfer)
        assert transfers.store.pop_record(key, 1.0) is not None
        transfers.store.push_record(key, old_record(transfer), 60_000)
        if ending == "take":
            taken = transfers.take(plan, 0, 69, FORMAT, transfer_id=transfer)
            assert taken.cause == "hit" and len(taken.chunks) == 3
        else:
            assert transfers.discard(transfer)
        assert keys_left(transfers) == []


def test_a_discarded_transfer_leaves_nothing(make_transfers) -> None:
    transfers = make_transfers()
    plan = transfers.plan(list(range(70)))
    transfer = new_entry_id()
    transfers.save(plan, prompt_pages(70), transfer_id=transfer)
    assert transfers.discard(transfer)
    assert keys_left(transfers) == []
    assert not transfers.discard(transfer)


def test_a_discard_waits_for_a_save_still_under_way(make_transfers) -> None:
    transfers = make_transfers()
    plan = transfers.plan(list(range(70)))
    transfer = new_entry_id()
    writer = threading.Timer(0.3, lambda: transfers.save(plan, prompt_pages(70), transfer_id=transfer))
    writer.start()
    try:
        assert transfers.discard(transfer, wait_s=30)
    finally:
        writer.join(timeout=30)
    assert keys_left(transfers) == []


def test_another_ranks_transfer_is_discarded_by_its_prefix(make_transfers) -> None:
    rank0 = make_transfers()
    rank1 = make_transfers(prefix=rank0.prefix[:-1] + ("0" if rank0.prefix[-1] != "0" else "1"))
    plan = rank1.plan(list(range(40)))
    transfer = new_entry_id()
    rank1.save(plan, prompt_pages(40), transfer_id=transfer)
    assert rank0.discard(transfer, prefix=rank1.prefix)
    assert keys_left(rank1) == []


def test_an_unannounced_take_deletes_the_chunks_before_the_ones_it_read(make_transfers) -> None:
    # The decode's prefix cache held chunk 0: it reads chunk 1 only, and the prompt goes whole, as an entry.
    transfers = make_transfers()
    plan = transfers.plan(list(range(64)))
    transfers.save(plan, prompt_pages(64))
    taken = transfers.take(plan, 40, 63, FORMAT)
    assert (taken.cause, taken.first, len(taken.chunks)) == ("hit", 1, 1)
    assert keys_left(transfers) == []


def test_an_unannounced_save_is_taken_by_any_decode_and_deleted(make_transfers) -> None:
    transfers = make_transfers()
    plan = transfers.plan(list(range(64)))
    transfers.save(plan, prompt_pages(64))
    assert transfers.chunks.stored_prefix(plan.digests) == 2
    taken = transfers.take(plan, 0, 63, FORMAT)
    assert taken.cause == "hit" and len(taken.chunks) == 2
    assert keys_left(transfers) == []


def test_pages_that_do_not_cover_the_prompt_are_refused(make_transfers) -> None:
    transfers = make_transfers()
    with pytest.raises(Exception, match="pages"):
        transfers.save(transfers.plan(list(range(64))), prompt_pages(40), transfer_id=new_entry_id())
    assert keys_left(transfers) == []


def test_a_chunk_length_that_is_not_whole_blocks_is_refused(make_buffer) -> None:
    buffer = make_buffer()
    with pytest.raises(ValueError, match="multiple of the block size"):
        Transfers(buffer.store, buffer.keyspace.prefix, chunk_tokens=40, block_size=BLOCK, ttl_ms=1000,
                  pop_timeout_s=1, max_chunk_bytes=1 << 20)


def test_a_save_that_fails_after_its_record_went_out_leaves_nothing(make_transfers,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    transfers = make_transfers(pop_timeout_s=0.2)
    write = transfers.chunks.write

    def lost_reply(*args, **kwargs):  # everything reached Redis, the answer did not
        write(*args, **kwargs)
        raise KVRedisConnectionError("connection lost")

    monkeypatch.setattr(transfers.chunks, "write", lost_reply)
    plan = transfers.plan(list(range(70)))
    transfer = new_entry_id()
    with pytest.raises(KVRedisConnectionError):
        transfers.save(plan, prompt_pages(70), transfer_id=transfer)
    assert keys_left(transfers) == []  # no record to be taken, no chunk held
    assert transfers.take(plan, 0, 69, FORMAT, transfer_id=transfer).cause == "late"


@pytest.mark.parametrize("backend", ["real"])
def test_a_small_save_and_a_take_are_one_round_trip_each(make_transfers,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    transfers = make_transfers()
    warm = transfers.plan(list(range(100, 200)))  # the server loads the scripts once (a round trip more)
    transfers.save(warm, prompt_pages(100), transfer_id=(transfer := new_entry_id()))
    assert transfers.take(warm, 0, 99, FORMAT, transfer_id=transfer).cause == "hit"
    calls: list[str] = []
    for name in ("call", "pipeline"):
        method = getattr(RedisStore, name)
        monkeypatch.setattr(RedisStore, name, lambda self, *a, _m=method, _n=name, **k: (
            calls.append(_n), _m(self, *a, **k))[1])
    plan = transfers.plan(list(range(100)))
    transfer = new_entry_id()
    saved = transfers.save(plan, prompt_pages(100), transfer_id=transfer)
    assert calls == (["call"] if transfer_module._PROBE_ABOVE_BYTES >= 0 else ["call", "call"])
    assert (saved.written, saved.present) == (4, 0)
    calls.clear()
    taken = transfers.take(plan, 0, 99, FORMAT, transfer_id=transfer)
    assert calls == ["pipeline"]  # the record popped, the chunks read and released
    assert taken.cause == "hit" and torch.equal(torch.cat(taken.chunks, dim=1), prompt_pages(100))
    assert keys_left(transfers) == []


def test_a_record_that_came_late_is_discarded_and_nothing_is_left(make_transfers) -> None:
    # The decode gave up (its take released what the transfer held so far), then the save landed.
    transfers = make_transfers(pop_timeout_s=0.2)
    plan = transfers.plan(list(range(70)))
    transfer = new_entry_id()
    assert transfers.take(plan, 0, 69, FORMAT, transfer_id=transfer).cause == "late"
    transfers.save(plan, prompt_pages(70), transfer_id=transfer)
    assert transfers.discard(transfer, wait_s=1.0)
    assert keys_left(transfers) == []


# -- small transfers: one chunk inside the record ------------------------------------------------------


def test_a_small_transfer_travels_inside_its_record(make_transfers) -> None:
    transfers = make_transfers()
    plan = transfers.plan(list(range(20)))  # one chunk (2 KiB of pages): inside the record
    transfer = new_entry_id()
    saved = transfers.save(plan, prompt_pages(20), transfer_id=transfer)
    assert (saved.written, saved.present) == (1, 0) and saved.nbytes > prompt_pages(20).numel() * 4
    assert keys_left(transfers) == [transfers.record_key(transfer)]  # no chunk key, no holders' set
    taken = transfers.take(plan, 3, 19, FORMAT, transfer_id=transfer)
    assert (taken.cause, taken.first, taken.stop(plan)) == ("hit", 0, 20)
    assert torch.equal(taken.chunks[0], prompt_pages(20)) and taken.nbytes == saved.nbytes
    assert keys_left(transfers) == []


@pytest.mark.parametrize("backend", ["real"])
def test_a_small_transfer_is_one_command_to_take(make_transfers, monkeypatch: pytest.MonkeyPatch) -> None:
    transfers = make_transfers()
    plan = transfers.plan(list(range(20)))
    transfer = new_entry_id()
    transfers.save(plan, prompt_pages(20), transfer_id=transfer)
    sent: list[tuple] = []
    call = RedisStore.call
    monkeypatch.setattr(RedisStore, "call", lambda self, client, *commands: (
        sent.extend(commands), call(self, client, *commands))[1])
    assert transfers.take(plan, 0, 19, FORMAT, transfer_id=transfer).cause == "hit"
    assert [command[0] for command in sent] == ["BLPOP"]


def test_a_transfer_past_the_bound_or_of_several_chunks_is_stored_in_chunks(make_transfers) -> None:
    transfers = make_transfers()
    transfers.inline_max_bytes = prompt_pages(20).numel() * 4 - 1
    for plan, pages in ((transfers.plan(list(range(20))), prompt_pages(20)),
                        (transfers.plan(list(range(40))), prompt_pages(40))):
        transfer = new_entry_id()
        transfers.save(plan, pages, transfer_id=transfer)
        assert len(keys_left(transfers)) == 1 + 2 * plan.num_chunks  # the record, each chunk and its holders
        taken = transfers.take(plan, 0, plan.num_tokens - 1, FORMAT, transfer_id=transfer)
        assert taken.cause == "hit" and torch.equal(torch.cat(taken.chunks, dim=1), pages)
        assert keys_left(transfers) == []


@pytest.mark.parametrize("inline_on", ["prefill", "decode"])
def test_sides_that_judge_a_transfer_differently_still_move_it(make_transfers, inline_on: str) -> None:
    """A prefill and a decode of different releases (or bounds) may disagree on whether a transfer is small:
    the take handles whichever record comes."""
    prefill, decode = make_transfers(), make_transfers()
    (decode if inline_on == "prefill" else prefill).inline_max_bytes = 0
    plan = prefill.plan(list(range(20)))
    transfer = new_entry_id()
    prefill.save(plan, prompt_pages(20), transfer_id=transfer)
    taken = decode.take(plan, 0, 19, FORMAT, transfer_id=transfer)
    assert taken.cause == "hit" and torch.equal(taken.chunks[0], prompt_pages(20))
    assert keys_left(decode) == []


def test_a_decode_that_lacks_nothing_still_takes_the_record(make_transfers) -> None:
    transfers = make_transfers()
    plan = transfers.plan(list(range(20)))
    transfer = new_entry_id()
    transfers.save(plan, prompt_pages(20), transfer_id=transfer)
    taken = transfers.take(plan, 20, 20, FORMAT, transfer_id=transfer)
    assert (taken.cause, taken.chunks) == ("hit", [])
    assert keys_left(transfers) == []


def _small_record(transfers: Transfers, plan, transfer: str, pages: torch.Tensor) -> bytes:
    blob = transfers.chunks.encode(plan, 0, pages)
    return transfer_module.encode_record(transfers.prefix, transfer, plan.digests, plan.num_tokens, CHUNK,
                                         inline=True) + blob.to_bytes()


@pytest.mark.parametrize("damage", ["a flipped bit in the pages", "a flipped bit in the record", "cut short",
                                    "padding not zero", "no chunk", "another prompt's chunk"])
def test_a_damaged_small_transfer_is_refused_and_leaves_nothing(make_transfers, damage: str) -> None:
    transfers = make_transfers()
    plan = transfers.plan(list(range(20)))
    transfer = new_entry_id()
    record = bytearray(_small_record(transfers, plan, transfer, prompt_pages(20)))
    head = len(transfer_module.encode_record(transfers.prefix, transfer, plan.digests, 20, CHUNK))
    cause = "corrupt"
    if damage == "a flipped bit in the pages":
        record[-100] ^= 1
    elif damage == "a flipped bit in the record":
        record[head - 12] ^= 1
    elif damage == "cut short":
        del record[-100:]
    elif damage == "padding not zero":
        record[head] = 1
    elif damage == "no chunk":
        del record[transfer_module._inline_offset(head):]
    else:  # a well-formed record of this prompt carrying another prompt's chunk (its digest differs)
        other = transfers.plan(list(range(1, 21)))
        blob = transfers.chunks.encode(other, 0, prompt_pages(20)).to_bytes()
        record[transfer_module._inline_offset(head):] = blob
        cause = "foreign"
    transfers.store.push_record(transfers.record_key(transfer), bytes(record), 60_000)
    taken = transfers.take(plan, 0, 19, FORMAT, transfer_id=transfer)
    assert (taken.cause, taken.chunks) == (cause, [])
    assert keys_left(transfers) == []


def test_a_small_transfer_for_other_pages_is_a_mismatch(make_transfers) -> None:
    transfers = make_transfers()
    plan = transfers.plan(list(range(20)))
    transfer = new_entry_id()
    transfers.save(plan, prompt_pages(20), transfer_id=transfer)
    other = PageFormat(torch.int32, FORMAT.layers, FORMAT.page_shape)  # the same bytes, another dtype
    assert transfers.take(plan, 0, 19, other, transfer_id=transfer).cause == "mismatch"
    assert keys_left(transfers) == []


def test_a_small_transfer_of_another_prompt_is_foreign(make_transfers) -> None:
    transfers = make_transfers()
    transfer = new_entry_id()
    transfers.save(transfers.plan(list(range(20))), prompt_pages(20), transfer_id=transfer)
    assert transfers.take(transfers.plan(list(range(1, 21))), 0, 19, FORMAT,
                          transfer_id=transfer).cause == "foreign"
    assert keys_left(transfers) == []


def test_a_small_transfer_is_discarded_and_leaves_nothing(make_transfers) -> None:
    transfers = make_transfers()
    plan = transfers.plan(list(range(20)))
    transfer = new_entry_id()
    transfers.save(plan, prompt_pages(20), transfer_id=transfer)
    record = transfers.store.pop_record(transfers.record_key(transfer), 1.0)
    assert record is not None and transfer_module.parse_record(record, transfer, transfers.prefix).held == ()
    transfers.save(plan, prompt_pages(20), transfer_id=transfer)
    assert transfers.discard(transfer)
    assert keys_left(transfers) == []


def test_a_small_save_that_fails_leaves_nothing(make_transfers, monkeypatch: pytest.MonkeyPatch) -> None:
    transfers = make_transfers(pop_timeout_s=0.2)
    push = transfers.store.push_record

    def lost_reply(*args, **kwargs):  # the record reached Redis, the answer did not
        push(*args, **kwargs)
        raise KVRedisConnectionError("connection lost")

    monkeypatch.setattr(transfers.store, "push_record", lost_reply)
    plan = transfers.plan(list(range(20)))
    transfer = new_entry_id()
    with pytest.raises(KVRedisConnectionError):
        transfers.save(plan, prompt_pages(20), transfer_id=transfer)
    assert keys_left(transfers) == []
    assert transfers.take(plan, 0, 19, FORMAT, transfer_id=transfer).cause == "late"


# -- reuse: chunks stay for any later reader ---------------------------------------------------------------


@pytest.fixture
def make_shared(make_buffer: Callable[..., RedisLookupBuffer]) -> Callable[..., Transfers]:
    """Transfers in reuse mode (a shared prefix cache), or in transfer mode over the same key space."""
    buffers: dict[str, RedisLookupBuffer] = {}

    def make(reuse: bool = True, pop_timeout_s: float = 2.0, ttl_ms: int = 60_000) -> Transfers:
        buffer = buffers.setdefault("one", make_buffer(pop_timeout_s=pop_timeout_s))
        return Transfers(buffer.store, buffer.keyspace.prefix, chunk_tokens=CHUNK, block_size=BLOCK,
                         ttl_ms=ttl_ms, pop_timeout_s=pop_timeout_s, max_chunk_bytes=1 << 20, reuse=reuse)
    return make


def chunk_keys_of(transfers: Transfers, plan) -> list[str]:
    return [transfers.chunks.keys.chunk(digest) for digest in plan.digests]


def test_in_reuse_mode_a_taken_transfer_leaves_its_chunks_and_nothing_held(make_shared) -> None:
    transfers = make_shared()
    plan = transfers.plan(list(range(100)))
    transfer = new_entry_id()
    assert transfers.save(plan, prompt_pages(100), transfer_id=transfer).written == 4
    taken = transfers.take(plan, 48, 99, FORMAT, transfer_id=transfer)
    assert taken.cause == "hit" and torch.equal(torch.cat(taken.chunks, dim=1), prompt_pages(100)[:, 2:])
    assert sorted(keys_left(transfers)) == sorted(chunk_keys_of(transfers, plan))  # no record, no holders
    # Any later reader, with no announcement, loads the stored prefix; it stays.
    again = transfers.take(plan, 0, 99, FORMAT)
    assert again.cause == "hit" and len(again.chunks) == 4
    assert transfers.chunks.stored_prefix(plan.digests) == 4


def test_in_reuse_mode_the_next_turn_writes_only_its_new_chunks(make_shared) -> None:
    transfers = make_shared()
    first = transfers.plan(list(range(64)))
    transfers.save(first, prompt_pages(64), transfer_id=new_entry_id())
    second = transfers.plan([*range(64), *range(900, 950)])
    saved = transfers.save(second, prompt_pages(114, seed=1), transfer_id=new_entry_id())
    assert (saved.written, saved.present) == (2, 2)
    saved = transfers.save(second, prompt_pages(114, seed=1))  # the same prompt again: nothing written
    assert (saved.written, saved.present, saved.nbytes) == (0, 4, 0)


def test_in_reuse_mode_a_use_restarts_the_ttl_of_the_chunks_read_and_those_before(make_shared) -> None:
    transfers = make_shared()
    plan = transfers.plan(list(range(100)))
    transfers.save(plan, prompt_pages(100))
    client = transfers.store.redis
    keys = chunk_keys_of(transfers, plan)
    for key in keys:
        client.pexpire(key, 5_000)
    transfers.take(plan, 70, 99, FORMAT)  # reads chunks 2 and 3; 0 and 1 are its prefix
    assert all(client.pttl(key) > 50_000 for key in keys)
    for key in keys:
        client.pexpire(key, 5_000)
    transfers.save(plan, prompt_pages(100))  # sent again: present, so kept longer
    assert all(client.pttl(key) > 50_000 for key in keys)


def test_a_prompts_later_chunks_expire_before_its_earlier_ones(make_shared) -> None:
    """What an evicting Redis (``volatile-ttl``) takes first: a prefix is worth more than its suffix."""
    transfers = make_shared(ttl_ms=3_600_000)
    plan = transfers.plan(list(range(100)))
    transfers.save(plan, prompt_pages(100))
    ttls = [transfers.store.redis.pttl(key) for key in chunk_keys_of(transfers, plan)]
    assert ttls == sorted(ttls, reverse=True) and len(set(ttls)) == 4, ttls
    assert min(ttls) >= 0.75 * 3_600_000 - 1_000
    assert transfers.chunks.ttl_at(5_000) == transfers.chunks.ttl_at(1_024) >= 0.75 * 3_600_000


def test_a_stored_prefix_ends_at_an_evicted_chunk(make_shared) -> None:
    transfers = make_shared()
    plan = transfers.plan(list(range(100)))
    transfers.save(plan, prompt_pages(100))
    transfers.store.delete([chunk_keys_of(transfers, plan)[1]])  # evicted
    assert transfers.chunks.stored_prefix(plan.digests) == 1
    taken = transfers.take(plan, 0, 99, FORMAT)
    assert (taken.cause, len(taken.chunks), taken.stop(plan)) == ("absent", 1, 32)


def test_in_reuse_mode_a_discarded_transfer_leaves_its_chunks(make_shared) -> None:
    transfers = make_shared()
    plan = transfers.plan(list(range(40)))
    transfer = new_entry_id()
    transfers.save(plan, prompt_pages(40), transfer_id=transfer)
    assert transfers.discard(transfer)
    assert sorted(keys_left(transfers)) == sorted(chunk_keys_of(transfers, plan))


def test_a_reader_in_transfer_mode_never_deletes_shared_chunks(make_shared) -> None:
    """A decode still in transfer mode behind a prefill in reuse mode releases holds the chunks do not have:
    they stay for other readers."""
    shared, transfer_mode = make_shared(), make_shared(reuse=False)
    plan = shared.plan(list(range(100)))
    transfer = new_entry_id()
    shared.save(plan, prompt_pages(100), transfer_id=transfer)
    taken = transfer_mode.take(plan, 0, 99, FORMAT, transfer_id=transfer)
    assert taken.cause == "hit" and len(taken.chunks) == 4
    assert sorted(keys_left(shared)) == sorted(chunk_keys_of(shared, plan))


def test_a_reader_in_reuse_mode_releases_what_a_transfer_mode_prefill_held(make_shared) -> None:
    transfer_mode, shared = make_shared(reuse=False), make_shared()
    plan = shared.plan(list(range(100)))
    transfer = new_entry_id()
    transfer_mode.save(plan, prompt_pages(100), transfer_id=transfer)
    taken = shared.take(plan, 0, 99, FORMAT, transfer_id=transfer)
    assert taken.cause == "hit" and len(taken.chunks) == 4
    assert keys_left(shared) == []  # the prefill's transfer held them; its release was the last


def test_in_reuse_mode_a_decode_that_lacks_nothing_takes_the_record_only(make_shared) -> None:
    transfers = make_shared()
    plan = transfers.plan(list(range(40)))
    transfer = new_entry_id()
    transfers.save(plan, prompt_pages(40), transfer_id=transfer)
    assert (transfers.take(plan, 40, 40, FORMAT, transfer_id=transfer).cause) == "hit"
    assert sorted(keys_left(transfers)) == sorted(chunk_keys_of(transfers, plan))


@pytest.mark.parametrize("tokens", [100, 20], ids=["in chunks", "inside its record"])
def test_a_transfer_handed_on_is_taken_by_every_reader_and_nothing_is_left(make_transfers,
                                                                           tokens: int) -> None:
    """Ranks of a decode that read the same KV heads (TP 1 -> 2, MLA): the first takes the announced record
    and hands the transfer on (holds and a record each); each reader gets every chunk, whatever the order
    they come in, and the last release deletes them."""
    transfers = make_transfers()
    plan = transfers.plan(list(range(tokens)))
    transfer = new_entry_id()
    others = (reader_id(transfer, 1), reader_id(transfer, 2))
    transfers.save(plan, prompt_pages(tokens), transfer_id=transfer)
    waiting: list[Taken] = []
    second = threading.Thread(target=lambda: waiting.append(
        transfers.take(plan, 0, tokens - 1, FORMAT, transfer_id=others[1])))
    second.start()  # waits for its record: the first reader has not handed it on yet
    first = transfers.take(plan, 0, tokens - 1, FORMAT, transfer_id=transfer, hand_on=others)
    third = transfers.take(plan, 0, tokens - 1, FORMAT, transfer_id=others[0])
    second.join(timeout=10)
    for taken in (first, third, *waiting):
        assert taken.cause == "hit" and torch.equal(torch.cat(taken.chunks, dim=1), prompt_pages(tokens))
    assert len(waiting) == 1
    assert keys_left(transfers) == []


def test_a_record_not_there_is_handed_on_to_nobody(make_transfers) -> None:
    """The first reader finds no record in time: it hands nothing on, and the others find none either."""
    transfers = make_transfers(pop_timeout_s=0.2)
    plan = transfers.plan(list(range(100)))
    transfer = new_entry_id()
    taken = transfers.take(plan, 0, 99, FORMAT, transfer_id=transfer, hand_on=(reader_id(transfer, 1),))
    assert taken.cause == "late"
    assert transfers.take(plan, 0, 99, FORMAT, transfer_id=reader_id(transfer, 1)).cause == "late"
    assert keys_left(transfers) == []


def test_an_unannounced_take_shared_with_other_readers_deletes_nothing(make_transfers) -> None:
    """Without a transfer id, ranks reading the same chunks keep them for each other (``keep``)."""
    transfers = make_transfers()
    plan = transfers.plan(list(range(100)))
    transfers.save(plan, prompt_pages(100))
    for _ in range(2):
        taken = transfers.take(plan, 0, 99, FORMAT, keep=True)
        assert taken.cause == "hit" and len(taken.chunks) == 4
    assert len(keys_left(transfers)) == 4
    transfers.chunks.delete_keys(keys_left(transfers))
