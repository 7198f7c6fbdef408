"""RedisLookupBuffer: the seed's insert / drop_select, on fakeredis and on a real Redis."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from conftest import namespace_keys
from kv_entries import assert_entry, identical, kv_entry, random_tensor

from kvredis import EntryTooLargeError, KVRedisConnectionError, KVRedisError
from kvredis.config import KVRedisConfig
from kvredis.store import codec, memory
from kvredis.store.keys import context_digest, new_entry_id
from kvredis.v0 import buffer as buffer_module
from kvredis.v0.buffer import RedisLookupBuffer

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8]


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096], ids=["inline", "chunked"])
def test_round_trip_is_bit_identical(make_buffer, chunk_bytes):
    buffer = make_buffer(chunk_bytes=chunk_bytes)
    tokens, key, value, hidden = kv_entry(37)
    buffer.insert(tokens, None, key, value, hidden)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_kv_dtype_round_trips(make_buffer, dtype):
    buffer = make_buffer(chunk_bytes=4096)
    tokens, key, value, hidden = kv_entry(19, dtype=dtype)
    buffer.insert(tokens, None, key, value, hidden)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)


def test_hidden_may_be_none(make_buffer):
    buffer = make_buffer()
    tokens, key, value, _ = kv_entry(5)
    buffer.insert(tokens, None, key, value, None)
    result = buffer.drop_select(tokens, None)
    assert_entry(result, tokens, key, value, None)


def test_entries_are_taken_in_any_order(make_buffer):
    buffer = make_buffer()
    entries = {name: kv_entry(10 + i, seed=i) for i, name in enumerate("ABC")}
    for tokens, key, value, hidden in entries.values():
        buffer.insert(tokens, None, key, value, hidden)
    for name in "CAB":
        tokens, key, value, hidden = entries[name]
        assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)


def test_roi_is_part_of_the_key(make_buffer):
    buffer = make_buffer(pop_timeout_s=0.2)
    tokens, key, value, hidden = kv_entry(8)
    roi = torch.ones(8, dtype=torch.bool)
    roi[-1] = False
    buffer.insert(tokens, roi, key, value, hidden)
    assert buffer.drop_select(tokens, None) == [None] * 5
    result = buffer.drop_select(tokens, roi)
    assert torch.equal(result[1], roi)
    assert identical(result[2], key)


def test_roi_none_means_every_token(make_buffer):
    buffer = make_buffer()
    tokens, key, value, hidden = kv_entry(6)
    buffer.insert(tokens, torch.ones(6, dtype=torch.bool), key, value, hidden)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)


def test_same_prompt_twice_is_two_entries_each_taken_once(make_buffer):
    buffer = make_buffer(pop_timeout_s=0.2)
    tokens, key, value, hidden = kv_entry(12)
    other_key = key.clone()
    other_key.view(torch.uint8)[0, 0, 0, 0] ^= 1
    buffer.insert(tokens, None, key, value, hidden)
    buffer.insert(tokens, None, other_key, value, hidden)
    first, second = buffer.drop_select(tokens, None), buffer.drop_select(tokens, None)
    assert identical(first[2], key) and identical(second[2], other_key)
    assert buffer.drop_select(tokens, None) == [None] * 5


def test_miss_returns_five_nones_within_the_timeout(make_buffer):
    buffer = make_buffer(pop_timeout_s=0.3)
    tokens, *_ = kv_entry(4)
    started = time.monotonic()
    assert buffer.drop_select(tokens, None) == [None] * 5
    elapsed = time.monotonic() - started
    assert 0.25 <= elapsed < 0.3 + 0.5
    assert buffer.metrics["misses"] == 1 and buffer.metrics["miss_absent"] == 1


def test_a_reader_that_comes_first_waits_for_the_writer(make_buffer):
    reader, writer = make_buffer(pop_timeout_s=5.0), make_buffer()
    tokens, key, value, hidden = kv_entry(300, layers=4)
    results: list = []
    thread = threading.Thread(target=lambda: results.append(reader.drop_select(tokens, None)))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive(), "the reader returned before anything was written"
    writer.insert(tokens, None, key, value, hidden)
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert_entry(results[0], tokens, key, value, hidden)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096], ids=["inline", "chunked"])
def test_every_key_has_the_ttl_and_none_is_left_after_select(make_buffer, chunk_bytes):
    buffer = make_buffer(ttl_s=60, chunk_bytes=chunk_bytes)
    tokens, key, value, hidden = kv_entry(64)
    buffer.insert(tokens, None, key, value, hidden)
    keys = namespace_keys(buffer)
    assert keys and (len(keys) > 1) == (chunk_bytes == 4096)
    for name in keys:
        assert 0 < buffer.store.redis.pttl(name) <= 60_000
    buffer.drop_select(tokens, None)
    assert namespace_keys(buffer) == []


def test_an_entry_missing_a_piece_is_a_miss_and_is_cleaned_up(make_buffer):
    buffer = make_buffer(chunk_bytes=4096, pop_timeout_s=0.2)
    tokens, key, value, hidden = kv_entry(64)
    buffer.insert(tokens, None, key, value, hidden)
    pieces = sorted(name for name in namespace_keys(buffer) if not name.endswith(":q"))
    buffer.store.redis.delete(pieces[len(pieces) // 2])  # as if evicted
    assert buffer.drop_select(tokens, None) == [None] * 5
    assert buffer.metrics["dropped_partial"] == 1 and buffer.metrics["miss_partial"] == 1
    assert namespace_keys(buffer) == []


def test_a_corrupt_record_is_rejected_and_the_next_entry_returned(make_buffer):
    buffer = make_buffer()
    tokens, key, value, hidden = kv_entry(9)
    queue = buffer.keyspace.entry(tokens).queue
    buffer.store.redis.rpush(queue, b"\x80\x04not ours at all")
    buffer.insert(tokens, None, key, value, hidden)
    assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
    assert buffer.metrics["dropped_foreign"] == 1 and buffer.metrics["misses"] == 0


def test_an_unusable_record_ends_the_wait(make_buffer):
    # The prompt's one entry came and was unusable: the reader reports a miss at once, not after the bound.
    buffer = make_buffer(pop_timeout_s=5.0)
    tokens, _, _, _ = kv_entry(9)
    buffer.store.redis.rpush(buffer.keyspace.entry(tokens).queue, b"KVR corrupt")
    began = time.monotonic()
    assert buffer.drop_select(tokens, None) == [None] * 5
    assert time.monotonic() - began < 1.0
    assert buffer.metrics["miss_corrupt"] + buffer.metrics["miss_foreign"] == 1


def test_take_says_why_nothing_came(make_buffer):
    buffer = make_buffer(pop_timeout_s=0.2)
    tokens, key, value, hidden = kv_entry(9)
    assert buffer.take(tokens, None) == (None, "absent")
    buffer.store.redis.rpush(buffer.keyspace.entry(tokens).queue, b"\x80\x04not ours at all")
    assert buffer.take(tokens, None) == (None, "foreign")
    buffer.insert(tokens, None, key, value, hidden)
    entry, cause = buffer.take(tokens, None)
    assert cause == "hit"
    assert_entry(entry, tokens, key, value, hidden)


def test_a_record_for_other_tokens_under_the_key_is_rejected(make_buffer):
    buffer = make_buffer(pop_timeout_s=0.2)
    tokens, key, value, hidden = kv_entry(9)
    other = tokens.clone()
    other[0] += 1
    buffer.insert(other, None, key, value, hidden)
    record = buffer.store.redis.lpop(buffer.keyspace.entry(other).queue)
    buffer.store.redis.rpush(buffer.keyspace.entry(tokens).queue, record)  # planted under another key
    assert buffer.drop_select(tokens, None) == [None] * 5
    assert buffer.metrics["dropped_foreign"] == 1 and buffer.metrics["miss_foreign"] == 1


def plant(buffer, tokens, stored_tokens, mask, key) -> None:
    """Push a record of ``stored_tokens`` and ``mask`` under ``tokens``'s key (from this key space)."""
    record = codec.encode([stored_tokens, mask, key, None, None],
                          {"id": new_entry_id(), "space": buffer.keyspace.prefix}).to_bytes()
    buffer.store.redis.rpush(buffer.keyspace.entry(tokens).queue, record)


@pytest.mark.parametrize(
    ("stored", "mask", "taken"),
    [
        (lambda t: t, lambda n: torch.ones(n, dtype=torch.bool), True),
        (lambda t: t.to(torch.int32), lambda n: torch.ones(n, dtype=torch.bool), True),  # equal values
        (lambda t: t.to(torch.int32) + 1, lambda n: torch.ones(n, dtype=torch.bool), False),
        (lambda t: t[:-1], lambda n: torch.ones(n - 1, dtype=torch.bool), False),
        (lambda t: torch.cat([t, t[:1]]), lambda n: torch.ones(n + 1, dtype=torch.bool), False),
        (lambda t: t.reshape(1, -1), lambda n: torch.ones(n, dtype=torch.bool), False),
        (lambda t: t, lambda n: torch.arange(n) % 2 == 0, False),
        (lambda t: t, lambda n: torch.ones(n, dtype=torch.uint8), True),  # equal values
        (lambda t: t, lambda n: torch.ones(n, dtype=torch.uint8) * 2, False),
    ],
    ids=["same", "int32-same-values", "int32-other-values", "shorter", "longer", "2d", "other-mask",
         "uint8-mask", "mask-of-twos"],
)
def test_an_entry_is_taken_only_if_its_tokens_and_mask_equal_the_request(make_buffer, stored, mask, taken):
    # kvredis writes int64 tokens and a bool mask, compared as bytes; another dtype is compared by value.
    buffer = make_buffer(pop_timeout_s=0.2)
    tokens, key, _, _ = kv_entry(9)
    plant(buffer, tokens, stored(tokens), mask(len(tokens)), key)
    entry, cause = buffer.take(tokens, None)
    assert cause == ("hit" if taken else "foreign")
    assert (entry is not None) == taken
    if taken:
        assert entry is not None and identical(entry[2], key)
    assert buffer.metrics["dropped_foreign"] == (0 if taken else 1)


def test_entry_larger_than_the_limit_is_refused_before_writing(make_buffer):
    buffer = make_buffer(max_entry_bytes=4096)
    tokens, key, value, hidden = kv_entry(64)
    with pytest.raises(EntryTooLargeError, match="KVREDIS_MAX_ENTRY_BYTES"):
        buffer.insert(tokens, None, key, value, hidden)
    assert namespace_keys(buffer) == []


def test_drop_select_needs_tokens(make_buffer):
    with pytest.raises(ValueError, match="input_tokens"):
        make_buffer().drop_select(None, None)


def test_closed_buffer_refuses_calls(make_buffer):
    buffer = make_buffer()
    buffer.close()
    tokens, key, value, hidden = kv_entry(3)
    with pytest.raises(KVRedisError, match="closed"):
        buffer.insert(tokens, None, key, value, hidden)


def test_concurrent_writers_and_readers_get_every_entry_once(make_buffer, backend):
    count = 200 if backend == "real" else 60
    buffer = make_buffer(chunk_bytes=8192, pop_timeout_s=10.0)
    generator = torch.Generator().manual_seed(7)
    entries = []
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        tokens = torch.arange(i * 1000, i * 1000 + 1 + (i % 50))
        shape = (1 + i % 3, tokens.numel(), 1 + i % 4, 8)
        hidden = random_tensor((tokens.numel(), 16), torch.float16, generator) if i % 2 else None
        key, value = random_tensor(shape, dtype, generator), random_tensor(shape, dtype, generator)
        entries.append((tokens, key, value, hidden))
    write_order, read_order = list(range(count)), list(range(count))
    random.Random(1).shuffle(write_order)
    random.Random(2).shuffle(read_order)
    failures: list[str] = []

    def write(part: list[int]) -> None:
        for i in part:
            tokens, key, value, hidden = entries[i]
            buffer.insert(tokens, None, key, value, hidden)

    def read(part: list[int]) -> None:
        for i in part:
            tokens, key, value, hidden = entries[i]
            result = buffer.drop_select(tokens, None)
            same = identical(result[2], key) and identical(result[3], value) and identical(result[4], hidden)
            if not same:
                failures.append(f"entry {i} came back wrong or missing")

    threads = [threading.Thread(target=write, args=(write_order[k::4],)) for k in range(4)]
    threads += [threading.Thread(target=read, args=(read_order[k::4],)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    assert buffer.metrics["loaded"] == count
    assert namespace_keys(buffer) == []


def test_a_64_mib_entry_in_pieces_comes_back_identical(real_redis_url, namespace):
    config = KVRedisConfig.from_env({}, {"url": real_redis_url, "namespace": namespace})
    with RedisLookupBuffer(config) as buffer:
        generator = torch.Generator().manual_seed(3)
        tokens = torch.arange(1024)
        key = random_tensor((16, 1024, 8, 128), torch.bfloat16, generator)  # 32 MiB
        value = random_tensor((16, 1024, 8, 128), torch.bfloat16, generator)  # 32 MiB
        hidden = random_tensor((1024, 256), torch.float32, generator)
        buffer.insert(tokens, None, key, value, hidden)
        assert len(namespace_keys(buffer)) > 64
        assert_entry(buffer.drop_select(tokens, None), tokens, key, value, hidden)
        assert namespace_keys(buffer) == []


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 256 << 10, 4096])
def test_pieces_fill_redis_size_classes_and_read_back(real_redis_url, namespace, chunk_bytes):
    # A value of exactly a size class's bytes takes the next class in Redis (1 MiB -> 1.25 MiB): pieces are
    # cut to fit. At the smallest setting there is no room to cut (the reader's floor): they stay whole.
    config = KVRedisConfig.from_env({}, {"url": real_redis_url, "namespace": namespace,
                                         "chunk_bytes": chunk_bytes})
    with RedisLookupBuffer(config) as buffer:
        generator = torch.Generator().manual_seed(5)
        tokens = torch.arange(64)
        key = random_tensor((4, 64, 8, 128), torch.bfloat16, generator)  # 512 KiB
        value = random_tensor((4, 64, 8, 128), torch.bfloat16, generator)
        buffer.insert(tokens, None, key, value, None)
        pieces = [name for name in namespace_keys(buffer) if not name.endswith(":q")]
        lengths = [buffer.store.redis.strlen(name) for name in pieces]
        held = [buffer.store.redis.memory_usage(name, samples=0) for name in pieces]
        assert max(lengths) == (chunk_bytes if chunk_bytes == 4096 else chunk_bytes - 16)
        if chunk_bytes > 4096:
            # The key, its object and its entry: a few hundred bytes (a class over would be 64 KiB or more).
            assert all(usage - length < 1024 for usage, length in zip(held, lengths, strict=True)), held
        assert_entry(buffer.drop_select(tokens, None), tokens, key, value, None)
        assert namespace_keys(buffer) == []


def test_ttl_really_expires_every_key(real_redis_url, namespace):
    config = KVRedisConfig.from_env(
        {}, {"url": real_redis_url, "namespace": namespace, "ttl_s": 0.3, "chunk_bytes": 4096,
             "pop_timeout_s": 0.2})
    with RedisLookupBuffer(config) as buffer:
        tokens, key, value, hidden = kv_entry(64)
        buffer.insert(tokens, None, key, value, hidden)
        assert namespace_keys(buffer)
        time.sleep(0.6)
        assert namespace_keys(buffer) == []
        assert buffer.drop_select(tokens, None) == [None] * 5


def test_unreachable_redis_fails_clearly_within_the_connect_timeout(namespace):
    from redis_servers import free_port

    config = KVRedisConfig.from_env({}, {"url": f"redis://127.0.0.1:{free_port()}/0", "namespace": namespace,
                                         "connect_timeout_s": 0.5})
    with RedisLookupBuffer(config) as buffer:
        tokens, key, value, hidden = kv_entry(3)
        started = time.monotonic()
        with pytest.raises(KVRedisConnectionError, match=r"127\.0\.0\.1"):
            buffer.insert(tokens, None, key, value, hidden)
        with pytest.raises(KVRedisConnectionError):
            buffer.drop_select(tokens, None)
        assert time.monotonic() - started < 2.0


def redis_backed_tests() -> dict[str, object]:
    """This module's tests that get their Redis from ``make_buffer`` or ``real_redis_url``, by name.

    Another test module runs them against another Redis (a cluster, Sentinel) by adding them to its
    globals and overriding those fixtures.
    """
    import inspect

    wanted = {"make_buffer", "real_redis_url"}
    return {
        name: test for name, test in globals().items()
        if name.startswith("test_") and inspect.isfunction(test)
        and wanted & set(inspect.signature(test).parameters)
    }


# -- contexts and announced entries ------------------------------------------------------------------


def test_the_context_keeps_same_token_entries_apart(make_buffer):
    """Same tokens under two LoRA adapters (or salts): each reader gets only its own entry."""
    buffer = make_buffer()
    tokens, key, value, hidden = kv_entry(21)
    other_key = key.clone().fill_(1)
    lora_a, lora_b = context_digest([("lora", "a", "1")]), context_digest([("lora", "b", "2")])
    buffer.insert(tokens, None, key, value, hidden, context=lora_a)
    buffer.insert(tokens, None, other_key, value, hidden, context=lora_b)
    assert not buffer.contains(tokens, None)
    assert buffer.contains(tokens, None, context=lora_b)
    assert buffer.take(tokens, None)[1] == "absent"  # no context: nothing of either
    assert_entry(buffer.take(tokens, None, context=lora_b)[0], tokens, other_key, value, hidden)
    assert_entry(buffer.take(tokens, None, context=lora_a)[0], tokens, key, value, hidden)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096], ids=["inline", "chunked"])
def test_an_announced_entry_is_taken_only_by_its_id(make_buffer, chunk_bytes):
    """An older entry of the same prompt is neither taken in its place nor delays it."""
    buffer = make_buffer(chunk_bytes=chunk_bytes)
    tokens, key, value, hidden = kv_entry(40, seed=3)
    stale = key.clone().fill_(9)
    old_id, new_id = new_entry_id(), new_entry_id()
    buffer.insert(tokens, None, stale, value, hidden, entry_id=old_id)  # its client went away
    buffer.insert(tokens, None, stale, value, hidden)  # unannounced, for any reader
    buffer.insert(tokens, None, key, value, hidden, entry_id=new_id)
    started = time.monotonic()
    entry, cause = buffer.take(tokens, None, entry_id=new_id)
    assert cause == "hit" and time.monotonic() - started < 1.0
    assert_entry(entry, tokens, key, value, hidden)
    assert buffer.take(tokens, None, entry_id=new_id)[1] == "absent"  # taken once
    assert_entry(buffer.drop_select(tokens, None), tokens, stale, value, hidden)  # the unannounced one
    assert buffer.take(tokens, None)[1] == "absent"  # announced entries are not for anyone
    assert buffer.discard(tokens, None, entry_id=old_id)
    assert namespace_keys(buffer) == []


def test_a_record_moved_to_another_entrys_list_is_refused(make_buffer):
    buffer = make_buffer(chunk_bytes=4096)
    tokens, key, value, hidden = kv_entry(40, seed=4)
    first, second = new_entry_id(), new_entry_id()
    buffer.insert(tokens, None, key, value, hidden, entry_id=first)
    keys = buffer.keyspace.entry(tokens)
    raw = buffer.store.redis
    raw.rename(keys.entry_queue(first), keys.entry_queue(second))
    assert buffer.take(tokens, None, entry_id=second) == (None, "foreign")
    buffer.store.delete([keys.chunk(first, i) for i in range(8)])
    assert namespace_keys(buffer) == []


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096], ids=["inline", "chunked"])
def test_discard_deletes_an_announced_entry_and_its_pieces(make_buffer, chunk_bytes):
    buffer = make_buffer(chunk_bytes=chunk_bytes)
    tokens, key, value, hidden = kv_entry(60, seed=5)
    salt = context_digest([("salt", "tenant")])
    entry_id = new_entry_id()
    assert not buffer.discard(tokens, None, context=salt, entry_id=entry_id)  # nothing there yet
    buffer.insert(tokens, None, key, value, hidden, context=salt, entry_id=entry_id)
    assert namespace_keys(buffer) != []
    assert buffer.discard(tokens, None, context=salt, entry_id=entry_id)
    assert namespace_keys(buffer) == []


def test_discard_waits_for_an_entry_still_being_written(make_buffer):
    buffer = make_buffer(chunk_bytes=4096)
    tokens, key, value, hidden = kv_entry(60, seed=6)
    entry_id = new_entry_id()
    writer = threading.Timer(0.3, buffer.insert, (tokens, None, key, value, hidden), {"entry_id": entry_id})
    writer.start()
    try:
        assert buffer.discard(tokens, None, entry_id=entry_id, wait_s=30.0)
    finally:
        writer.join()
    assert namespace_keys(buffer) == []


def _advised_huge(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding ``tensor``'s first byte carries MADV_HUGEPAGE ("hg" in smaps' VmFlags)."""
    address = tensor.data_ptr()
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()
    return False


@pytest.mark.skipif(memory._MADV_HUGEPAGE is None, reason="madvise(MADV_HUGEPAGE) is Linux's")
@pytest.mark.parametrize(("nbytes", "huge"), [(4 << 20, False), (32 << 20, True), (128 << 20, True),
                                              ((128 << 20) + 4096, False)])
def test_large_outputs_are_advised_to_use_huge_pages(nbytes, huge, monkeypatch):
    mapped: list[int] = []
    real_mmap = memory.mmap.mmap

    def mmap(fileno, length, *args, **kwargs):
        mapped.append(length)
        return real_mmap(fileno, length, *args, **kwargs)

    monkeypatch.setattr(memory.mmap, "mmap", mmap)
    out = memory.fresh_output(nbytes)
    assert out.dtype == torch.uint8 and out.numel() == nbytes
    assert mapped == ([nbytes] if huge else [])
    # Outside the range the allocator's memory is all there is to check that kvredis advised nothing: it may
    # reuse heap memory another library advised (NumPy does so for its own arrays of 4 MiB and more).
    if huge:
        assert _advised_huge(out)
    out[::4096] = 7  # writable everywhere, and still there once nothing but the tensor holds the mapping
    del nbytes
    import gc
    gc.collect()
    assert int(out[::4096].sum()) == 7 * out[::4096].numel()


def test_an_output_without_huge_pages_is_still_an_output(monkeypatch):
    monkeypatch.setattr(memory, "_MADV_HUGEPAGE", -1)  # madvise refuses it: plain pages
    out = memory.fresh_output(64 << 20)
    assert out.numel() == 64 << 20
    out.fill_(3)
    assert int(out[-1]) == 3


def _big_entry() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and a key just over the size whose checksums are computed alongside the pieces' writes."""
    tokens = torch.arange(8)
    key = torch.zeros(buffer_module._HASH_ALONGSIDE_BYTES // 2, dtype=torch.bfloat16)
    key[::4097] = 1.5
    return tokens, key


def _checksum_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvredis-checksum"]


def test_a_large_entry_hashed_alongside_its_pieces_reads_back_verified(make_buffer):
    buffer = make_buffer()
    tokens, key = _big_entry()
    buffer.insert(tokens, None, key, None, None)
    entry = buffer.drop_select(tokens, None)  # the reader checks every checksum
    assert entry[2] is not None and torch.equal(entry[2], key)
    assert _checksum_threads() == []


def test_a_failed_piece_write_waits_for_the_checksums_and_raises_the_store_error(make_buffer, monkeypatch):
    buffer = make_buffer()
    tokens, key = _big_entry()
    finished: list[bool] = []
    checksums = codec.Frames.checksums

    def slow_checksums(self):
        time.sleep(0.2)  # still hashing when the write fails
        result = checksums(self)
        finished.append(True)
        return result

    def refuse(*args, **kwargs):
        raise KVRedisConnectionError("connection lost")

    monkeypatch.setattr(codec.Frames, "checksums", slow_checksums)
    monkeypatch.setattr(buffer.store, "put_pieces", refuse)
    with pytest.raises(KVRedisConnectionError, match="connection lost"):
        buffer.insert(tokens, None, key, None, None)
    assert finished == [True] and _checksum_threads() == []  # joined, not left running
    assert buffer.metrics["store_failed_error"] == 1
    assert buffer.drop_select(tokens, None) == [None] * 5


def test_a_failed_checksum_computation_is_raised_and_no_record_written(make_buffer, monkeypatch):
    buffer = make_buffer(pop_timeout_s=0.2)
    tokens, key = _big_entry()

    def broken(self):
        raise RuntimeError("hashing failed")

    monkeypatch.setattr(codec.Frames, "checksums", broken)
    with pytest.raises(RuntimeError, match="hashing failed"):
        buffer.insert(tokens, None, key, None, None)
    assert _checksum_threads() == []
    assert namespace_keys(buffer) == []  # no record, and the pieces written meanwhile deleted
