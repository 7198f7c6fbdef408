"""The chunk store on fakeredis and real Redis: presence, write-if-absent, checked reads, hold and release."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from kvredis.store import chunk_store as chunk_store_module
from kvredis.store import codec
from kvredis.store.chunk_keys import ChunkPlan
from kvredis.store.chunk_store import ChunkRead, ChunkStore, PageFormat
from kvredis.store.keys import context_digest
from kvredis.v0.buffer import RedisLookupBuffer

BLOCK = 16
CHUNK = 32  # two blocks a chunk
FORMAT = PageFormat(torch.float16, layers=3, page_shape=(2, BLOCK, 32))  # 12 KiB a block
PIECE = 4096  # KVREDIS_CHUNK_BYTES's least: a chunk's 24 KiB of pages are read in 7 pieces


@pytest.fixture(params=["whole", "pieces"])
def chunk_store(make_buffer: Callable[..., RedisLookupBuffer], request: pytest.FixtureRequest
                ) -> Iterator[ChunkStore]:
    """A chunk store whose chunks are read whole (one GET each) or in pieces (pipelined GETRANGEs)."""
    pieces = request.param == "pieces"
    buffer = make_buffer(ttl_s=60, chunk_bytes=PIECE if pieces else 1 << 20,
                         inflight_bytes=2 * PIECE if pieces else 4 << 20)
    yield ChunkStore(buffer.store, buffer.keyspace.prefix, ttl_ms=60_000, block_size=BLOCK,
                     max_chunk_bytes=1 << 20)


def pages_of(plan: ChunkPlan, index: int, seed: int = 0) -> torch.Tensor:
    """Distinct pages for chunk ``index`` (a short chunk has fewer blocks)."""
    start, stop = plan.span(index)
    blocks = -(-(stop - start) // BLOCK)
    generator = torch.Generator().manual_seed(seed * 1000 + index)
    return torch.randn(FORMAT.shape(blocks), generator=generator).to(FORMAT.dtype)


def write_all(store: ChunkStore, plan: ChunkPlan, holder: str | None = None) -> list[bool]:
    """Which chunks were written."""
    written = store.write(plan, [(i, pages_of(plan, i)) for i in range(plan.num_chunks)], holder=holder)
    return [nbytes > 0 for nbytes in written]


def test_chunks_read_back_bit_for_bit_with_a_short_last_one(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(75)), CHUNK)  # chunks of 32, 32, 11 positions
    assert write_all(chunk_store, plan) == [True, True, True]
    reads = chunk_store.read(plan, [0, 1, 2], FORMAT)
    assert [r.cause for r in reads] == ["hit"] * 3
    for read in reads:
        assert read.pages is not None
        assert torch.equal(read.pages, pages_of(plan, read.index))
    assert reads[2].pages is not None and reads[2].pages.shape[1] == 1  # 11 positions: one block


def test_only_missing_chunks_are_written(chunk_store: ChunkStore) -> None:
    first = ChunkPlan.of(list(range(64)), CHUNK)
    assert write_all(chunk_store, first) == [True, True]
    turn_two = ChunkPlan.of(list(range(64)) + list(range(500, 540)), CHUNK)
    assert chunk_store.present(turn_two.digests) == [True, True, False, False]
    written = chunk_store.write(turn_two, [(i, pages_of(turn_two, i, seed=1)) for i in range(4)])
    assert [nbytes > 0 for nbytes in written] == [False, False, True, True]
    blob = chunk_store.store.redis.get(chunk_store.keys.chunk(turn_two.digests[2]))
    assert written[2] == len(blob)  # what was sent is what is stored
    # What was there stays as it was: the second writer's pages for chunks 0 and 1 were not stored.
    read = chunk_store.read(turn_two, [0], FORMAT)[0]
    assert read.pages is not None and torch.equal(read.pages, pages_of(first, 0))


def test_a_stored_prefix_ends_at_its_first_missing_chunk(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(128)), CHUNK)
    write_all(chunk_store, plan)
    assert chunk_store.stored_prefix(plan.digests) == 4
    chunk_store.store.delete([chunk_store.keys.chunk(plan.digests[1])])  # evicted
    assert chunk_store.stored_prefix(plan.digests) == 1
    assert chunk_store.present(plan.digests) == [True, False, True, True]


def test_every_key_has_the_ttl(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(40)), CHUNK)
    write_all(chunk_store, plan, holder="a" * 16)
    keys = list(chunk_store.store.scan(chunk_store.keys.pattern))
    assert len(keys) == 4  # two chunks and their holders' sets
    for key in keys:
        assert 0 < int(chunk_store.store.redis.pttl(key)) <= 60_000


def test_the_last_holder_deletes_a_chunk_and_only_the_last(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(64)), CHUNK)
    first, second = "1" * 16, "2" * 16
    write_all(chunk_store, plan, holder=first)
    # A second prompt with the same prefix finds both chunks and holds them.
    assert chunk_store.present(plan.digests, holder=second) == [True, True]
    assert chunk_store.release(plan.digests, first) == 0
    assert chunk_store.stored_prefix(plan.digests) == 2
    assert chunk_store.release(plan.digests, "3" * 16) == 0  # not a holder: nothing happens
    assert chunk_store.stored_prefix(plan.digests) == 2
    assert chunk_store.release(plan.digests, second) == 2
    assert list(chunk_store.store.scan(chunk_store.keys.pattern)) == []


def test_holding_an_absent_chunk_holds_nothing(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(32)), CHUNK)
    assert chunk_store.present(plan.digests, holder="1" * 16) == [False]
    assert list(chunk_store.store.scan(chunk_store.keys.pattern)) == []


def test_without_a_holder_nothing_is_held(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(32)), CHUNK)
    write_all(chunk_store, plan)
    assert list(chunk_store.store.scan(chunk_store.keys.pattern)) == [chunk_store.keys.chunk(plan.digests[0])]


def test_a_hit_can_restart_its_ttl(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(32)), CHUNK)
    write_all(chunk_store, plan)
    key = chunk_store.keys.chunk(plan.digests[0])
    chunk_store.store.redis.pexpire(key, 5_000)
    chunk_store.read(plan, [0], FORMAT)
    assert int(chunk_store.store.redis.pttl(key)) <= 5_000
    chunk_store.read(plan, [0], FORMAT, refresh_ttl=True)
    assert int(chunk_store.store.redis.pttl(key)) > 5_000


def test_contexts_share_nothing(chunk_store: ChunkStore) -> None:
    tokens = list(range(64))
    a = ChunkPlan.of(tokens, CHUNK, context_digest([("salt", "a")]))
    b = ChunkPlan.of(tokens, CHUNK, context_digest([("salt", "b")]))
    write_all(chunk_store, a)
    assert chunk_store.present(b.digests) == [False, False]


def _replace(store: ChunkStore, key: str, value: bytes) -> None:
    store.store.redis.set(key, value, px=60_000)


@pytest.mark.parametrize("damage", ["flipped payload byte", "truncated", "foreign bytes", "empty"])
def test_a_damaged_chunk_is_a_miss_and_is_deleted(chunk_store: ChunkStore, damage: str) -> None:
    plan = ChunkPlan.of(list(range(64)), CHUNK)
    write_all(chunk_store, plan)
    key = chunk_store.keys.chunk(plan.digests[1])
    blob = bytearray(chunk_store.store.redis.get(key))
    value = {"flipped payload byte": lambda: bytes(blob[:-7]) + bytes([blob[-7] ^ 1]) + bytes(blob[-6:]),
             "truncated": lambda: bytes(blob[:-100]),
             "foreign bytes": lambda: b"\x89PNG" + bytes(200),
             "empty": lambda: b""}[damage]()
    _replace(chunk_store, key, value)
    reads = chunk_store.read(plan, [0, 1], FORMAT)
    assert reads[0].cause == "hit"
    assert reads[1].pages is None and reads[1].cause in ("corrupt", "foreign")
    assert chunk_store.present(plan.digests) == [True, False]


@pytest.mark.parametrize("checksum", [True, False])
def test_a_flipped_token_byte_is_a_miss(chunk_store: ChunkStore, checksum: bool) -> None:
    """The tokens are checked as bytes, not as a tensor: their checksum says corrupt, and without checksums
    their comparison with the prompt's says foreign."""
    chunk_store.checksum = checksum
    plan = ChunkPlan.of(list(range(64)), CHUNK)
    write_all(chunk_store, plan)
    key = chunk_store.keys.chunk(plan.digests[1])
    blob = bytearray(chunk_store.store.redis.get(key))
    blob[codec.read_header(blob, max_payload_bytes=1 << 30).payload_offset + 9] ^= 1
    _replace(chunk_store, key, bytes(blob))
    reads = chunk_store.read(plan, [0, 1], FORMAT)
    assert [r.cause for r in reads] == ["hit", "corrupt" if checksum else "foreign"]
    assert chunk_store.present(plan.digests) == [True, False]


def test_a_value_of_another_type_at_a_chunk_key_is_foreign(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(32)), CHUNK)
    key = chunk_store.keys.chunk(plan.digests[0])
    chunk_store.store.redis.rpush(key, b"x")
    assert chunk_store.read(plan, [0], FORMAT)[0].cause == "foreign"
    assert chunk_store.present(plan.digests) == [False]


def test_a_chunk_planted_under_another_prompts_key_is_foreign(chunk_store: ChunkStore) -> None:
    # The same bytes under the key of a prompt whose tokens differ: its digest, parent and tokens say so.
    real = ChunkPlan.of(list(range(32)), CHUNK)
    other = ChunkPlan.of(list(range(1, 33)), CHUNK)
    write_all(chunk_store, real)
    blob = chunk_store.store.redis.get(chunk_store.keys.chunk(real.digests[0]))
    _replace(chunk_store, chunk_store.keys.chunk(other.digests[0]), blob)
    assert chunk_store.read(other, [0], FORMAT)[0].cause == "foreign"


def test_a_chunk_whose_tokens_differ_from_its_key_is_foreign(chunk_store: ChunkStore) -> None:
    # Metadata copied right, tokens not: what a planted or colliding value would look like.
    plan = ChunkPlan.of(list(range(32)), CHUNK)
    wrong_tokens = memoryview(torch.arange(1, 33).numpy().data).cast("B").cast("q")
    meta = {"kind": "chunk", "space": chunk_store.prefix, "start": 0, "digest": plan.digests[0],
            "parent": plan.parent(0)}
    blob = codec.encode([wrong_tokens, pages_of(plan, 0)], meta).to_bytes()
    _replace(chunk_store, chunk_store.keys.chunk(plan.digests[0]), blob)
    assert chunk_store.read(plan, [0], FORMAT)[0].cause == "foreign"


def test_a_chunk_of_another_key_space_is_foreign(make_buffer: Callable[..., RedisLookupBuffer],
                                                chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(32)), CHUNK)
    other = ChunkStore(chunk_store.store, chunk_store.prefix + "x", ttl_ms=60_000, block_size=BLOCK,
                       max_chunk_bytes=1 << 20)
    write_all(other, plan)
    blob = chunk_store.store.redis.get(other.keys.chunk(plan.digests[0]))
    _replace(chunk_store, chunk_store.keys.chunk(plan.digests[0]), blob)
    assert chunk_store.read(plan, [0], FORMAT)[0].cause == "foreign"
    chunk_store.store.delete([other.keys.chunk(plan.digests[0])])


@pytest.mark.parametrize("page_format", [
    PageFormat(torch.bfloat16, layers=3, page_shape=(2, BLOCK, 32)),
    PageFormat(torch.float16, layers=4, page_shape=(2, BLOCK, 32)),
    PageFormat(torch.float16, layers=3, page_shape=(1, BLOCK, 64)),
    PageFormat(torch.float16, layers=2, page_shape=(2, BLOCK, 32)),
], ids=["dtype", "layers", "page shape", "fewer layers"])
def test_pages_another_engine_needs_are_a_mismatch(chunk_store: ChunkStore, page_format: PageFormat) -> None:
    plan = ChunkPlan.of(list(range(32)), CHUNK)
    write_all(chunk_store, plan)
    read = chunk_store.read(plan, [0], page_format)[0]
    assert read.pages is None and read.cause == "mismatch"


def test_an_absent_chunk_reads_as_absent(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(64)), CHUNK)
    chunk_store.write(plan, [(0, pages_of(plan, 0))])
    assert [r.cause for r in chunk_store.read(plan, [0, 1], FORMAT)] == ["hit", "absent"]


def test_a_chunk_over_the_size_limit_is_refused_before_anything_is_written(chunk_store: ChunkStore) -> None:
    small = ChunkStore(chunk_store.store, chunk_store.prefix, ttl_ms=60_000, block_size=BLOCK,
                       max_chunk_bytes=1024)
    plan = ChunkPlan.of(list(range(64)), CHUNK)
    with pytest.raises(Exception, match="exceeds"):
        write_all(small, plan)
    assert chunk_store.present(plan.digests) == [False, False]


def test_chunks_over_7_mib_are_written_and_the_first_one_says_what_they_cost(
        chunk_store: ChunkStore, caplog: pytest.LogCaptureFixture) -> None:
    # 7 MiB of pages a chunk: with the header, a value in jemalloc's 8 MiB size class.
    large = PageFormat(torch.float16, layers=1, page_shape=(2, BLOCK, 57344))
    store = ChunkStore(chunk_store.store, chunk_store.prefix, ttl_ms=60_000, block_size=BLOCK,
                       max_chunk_bytes=16 << 20)
    plan = ChunkPlan.of(list(range(96)), CHUNK)
    pages = [torch.full(large.shape(2), float(index), dtype=large.dtype) for index in range(3)]
    with caplog.at_level("WARNING", logger="kvredis.chunks"):
        write_all(chunk_store, ChunkPlan.of(list(range(1000, 1064)), CHUNK))  # 24 KiB chunks: nothing said
        assert caplog.records == []
        assert store.write(plan, [(0, pages[0])]) != [0]
        assert store.write(plan, [(1, pages[1]), (2, pages[2])]) != [0, 0]
    assert [record.getMessage()[:22] for record in caplog.records] == ["chunks of 7.0 MiB: Red"]
    assert "KVREDIS_CHUNK_TOKENS" in caplog.records[0].getMessage()
    reads = store.read(plan, [0, 1, 2], large)
    assert [read.cause for read in reads] == ["hit"] * 3
    assert all(read.pages is not None and torch.equal(read.pages, pages[read.index]) for read in reads)


def test_pages_that_do_not_fit_the_chunk_are_refused(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(64)), CHUNK)
    with pytest.raises(Exception, match="blocks"):
        chunk_store.write(plan, [(0, torch.zeros(3, 3, 2, BLOCK, 32, dtype=torch.float16))])


def test_scripts_flushed_from_the_server_are_loaded_again(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(64)), CHUNK)
    write_all(chunk_store, plan, holder="1" * 16)
    chunk_store.store.redis.script_flush()
    assert chunk_store.release(plan.digests, "1" * 16) == 2


@pytest.mark.parametrize("backend", ["real"])
def test_two_writers_of_one_chunk_at_once_leave_one_good_copy(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(32 * 8)), CHUNK)
    results: list[list[bool]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def write(seed: int) -> None:
        try:
            start.wait(timeout=30)
            chunks = [(i, pages_of(plan, i, seed)) for i in range(plan.num_chunks)]
            results.append([n > 0 for n in chunk_store.write(plan, chunks, holder=f"{seed:016x}")])
        except BaseException as exc:  # reported below, never lost with the thread
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    # Each chunk was written once, by one of them, and reads back whole as that writer's pages.
    assert [sum(column) for column in zip(*results, strict=True)] == [1] * plan.num_chunks
    for read in chunk_store.read(plan, range(plan.num_chunks), FORMAT):  # type: ignore[arg-type]
        assert read.pages is not None
        assert any(torch.equal(read.pages, pages_of(plan, read.index, seed)) for seed in range(4))
    # All four hold every chunk: three releases keep them, the fourth deletes them.
    for seed in range(3):
        assert chunk_store.release(plan.digests, f"{seed:016x}") == 0
    assert chunk_store.release(plan.digests, f"{3:016x}") == plan.num_chunks


# --- reads in pieces: one snapshot of one value, never two values' bytes ------------------------------------


def reads_while_rewritten(make_buffer: Callable[..., RedisLookupBuffer], checksum: bool,
                          reads: int = 300) -> tuple[list[ChunkRead], list[torch.Tensor]]:
    """``reads`` reads of one chunk (in 4 KiB pieces, one requested at a time) while another connection
    writes two versions of it in turn; the reads, and the two versions' pages."""
    buffer = make_buffer(ttl_s=60, chunk_bytes=PIECE, checksum=checksum, inflight_bytes=1)
    store = ChunkStore(buffer.store, buffer.keyspace.prefix, ttl_ms=60_000, block_size=BLOCK,
                       max_chunk_bytes=1 << 20, checksum=checksum)
    plan = ChunkPlan.of(list(range(32)), CHUNK)
    key = store.keys.chunk(plan.digests[0])
    versions = [pages_of(plan, 0, seed) for seed in range(2)]
    blobs = [store.encode(plan, 0, pages).to_bytes() for pages in versions]
    writer = buffer.store.redis  # another connection of the pool: its SETs land between the reader's commands
    writer.set(key, blobs[0])
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            for blob in blobs:
                writer.set(key, blob, px=60_000)

    thread = threading.Thread(target=rewrite)
    thread.start()
    try:
        return [store.read(plan, [0], FORMAT)[0] for _ in range(reads)], versions
    finally:
        stop.set()
        thread.join()


def version_of(read: ChunkRead, versions: list[torch.Tensor]) -> int:
    """Which version a read's pages are, asserting they are exactly one of them."""
    matches = [i for i, pages in enumerate(versions) if torch.equal(read.pages, pages)]
    assert len(matches) == 1, "a read returned two values' bytes"
    return matches[0]


@pytest.mark.parametrize("backend", ["real"])
def test_a_chunk_rewritten_while_it_is_read_in_pieces_reads_as_one_value(
        make_buffer: Callable[..., RedisLookupBuffer]) -> None:
    # Without checksums, only the read's atomicity stands between a reader and a mix of two values. With
    # nothing requested ahead, pieces read in round trips of their own would mix (273 reads of 300 did in a
    # trial with plain GETRANGEs): the pieces of one value are one transaction.
    reads, versions = reads_while_rewritten(make_buffer, checksum=False)
    assert all(read.pages is not None for read in reads), {read.cause for read in reads}
    assert {version_of(read, versions) for read in reads} == {0, 1}  # the value did change between reads


@pytest.mark.parametrize("backend", ["real"])
def test_a_chunk_rewritten_between_its_pieces_is_a_miss_never_mixed_bytes(
        make_buffer: Callable[..., RedisLookupBuffer]) -> None:
    # With checksums the pieces are plain pipelined GETRANGEs (no transaction: Redis would build its whole
    # reply first). Two values' pieces fail the pages' checksum: a read is one value whole, or a miss.
    reads, versions = reads_while_rewritten(make_buffer, checksum=True)
    misses = [read.cause for read in reads if read.pages is None]
    assert set(misses) <= {"corrupt", "absent"}  # mixed (dropped), or read just after that drop
    seen = {version_of(read, versions) for read in reads if read.pages is not None}
    assert seen  # reads did succeed between rewrites
    assert "corrupt" in misses or seen == {0, 1}  # the writer did change the value under the reader


@pytest.mark.parametrize("backend", ["real"])
@pytest.mark.parametrize("value", ["header only", "one byte short", "one byte long", "doubled", "empty"])
def test_a_value_whose_length_does_not_fit_is_read_whole_and_dropped(chunk_store: ChunkStore,
                                                                     value: str) -> None:
    plan = ChunkPlan.of(list(range(64)), CHUNK)
    write_all(chunk_store, plan)
    key = chunk_store.keys.chunk(plan.digests[1])
    blob = bytes(chunk_store.store.redis.get(key))
    header = codec.read_header(blob, max_payload_bytes=1 << 20).payload_offset
    _replace(chunk_store, key, {"header only": blob[:header], "one byte short": blob[:-1],
                                "one byte long": blob + b"x", "doubled": blob + blob, "empty": b""}[value])
    reads = chunk_store.read(plan, [0, 1], FORMAT)
    assert reads[0].cause == "hit" and reads[0].pages is not None
    assert torch.equal(reads[0].pages, pages_of(plan, 0))
    assert reads[1].pages is None and reads[1].cause == "corrupt"
    assert chunk_store.present(plan.digests) == [True, False]


@pytest.mark.parametrize("backend", ["real"])
def test_a_chunk_deleted_before_its_pieces_are_read_is_absent_and_the_others_whole(
        chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(96)), CHUNK)
    write_all(chunk_store, plan)
    chunk_store.store.delete([chunk_store.keys.chunk(plan.digests[1])])
    reads = chunk_store.read(plan, [0, 1, 2], FORMAT)
    assert [read.cause for read in reads] == ["hit", "absent", "hit"]
    for read in (reads[0], reads[2]):
        assert read.pages is not None and torch.equal(read.pages, pages_of(plan, read.index))


def test_the_pages_read_are_views_of_one_buffer_and_writable(chunk_store: ChunkStore) -> None:
    plan = ChunkPlan.of(list(range(75)), CHUNK)
    write_all(chunk_store, plan)
    reads = chunk_store.read(plan, [0, 1, 2], FORMAT)
    for read in reads:
        assert read.pages is not None and torch.equal(read.pages, pages_of(plan, read.index))
        read.pages.add_(1)  # the reader owns them: no read-only bytes behind a tensor


@pytest.mark.parametrize("holder", [None, "a" * 16])
def test_a_large_write_hashes_ahead_and_sends_a_chunk_at_a_time(chunk_store: ChunkStore, holder: str | None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``_HASH_AHEAD_BYTES`` (lowered here) each chunk is hashed on a thread while the one before it
    goes out: the same values, each with its checksums, sent a transaction at a time."""
    monkeypatch.setattr(chunk_store_module, "_HASH_AHEAD_BYTES", 0)
    groups: list[int] = []
    call_in_groups = chunk_store.store.call_in_groups

    def counted(client, made):
        return call_in_groups(client, (groups.append(len(group)) or group for group in made))

    monkeypatch.setattr(chunk_store.store, "call_in_groups", counted)
    plan = ChunkPlan.of(list(range(75)), CHUNK)
    written = chunk_store.write(plan, [(i, pages_of(plan, i)) for i in range(3)], holder=holder,
                                record=("ahead-record", b"r"))
    framed = not chunk_store.store.cluster and chunk_store.store.call(chunk_store.store.redis, ("PING",))
    if framed:  # kvredis frames its commands on this client (not fakeredis's, not a cluster's)
        assert groups == ([1, 1, 1, 4] if holder is None else [6, 6, 8])
    assert all(written)
    for read in chunk_store.read(plan, [0, 1, 2], FORMAT):
        assert read.cause == "hit" and read.pages is not None and torch.equal(read.pages,
                                                                              pages_of(plan, read.index))
    chunk_store.store.delete(["ahead-record"])


def test_checksums_ahead_are_the_frames_own_and_errors_reach_the_caller() -> None:
    frames = [codec.Frames.of([torch.randn(1000 + i)]) for i in range(4)]
    ahead = codec.ChecksumsAhead(frames)
    assert [ahead.get(i) for i in range(4)] == [f.checksums() for f in frames]
    ahead.close()

    class Broken(codec.Frames):
        def checksums(self) -> list[int]:
            raise MemoryError("no memory for the hash")

    broken = codec.ChecksumsAhead([Broken(f.descriptors, f.views, f.nbytes) for f in frames[:2]])
    with pytest.raises(MemoryError):
        broken.get(1)
    broken.close()


def test_each_chunk_is_checked_as_it_arrives_while_the_next_is_on_its_way(
        chunk_store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read checks chunk ``i`` (its checksum included) as soon as its last reply is in, before the replies
    of the chunks after it are read: the checks overlap the transfer instead of following it."""
    from kvredis.store import resp

    replies_read = [0]
    read_reply = resp.BulkReader.read_reply

    def counted(self, *args, **kwargs):
        replies_read[0] += 1
        return read_reply(self, *args, **kwargs)

    checked_at: list[tuple[int, int]] = []
    verified = ChunkStore._verified

    def noted(self, plan, index, value, page_format):
        checked_at.append((index, replies_read[0]))
        return verified(self, plan, index, value, page_format)

    monkeypatch.setattr(resp.BulkReader, "read_reply", counted)
    monkeypatch.setattr(ChunkStore, "_verified", noted)
    plan = ChunkPlan.of(list(range(96)), CHUNK)
    write_all(chunk_store, plan)
    replies_read[0] = 0
    reads = chunk_store.read(plan, [0, 1, 2], FORMAT)
    assert all(read.cause == "hit" and read.pages is not None and torch.equal(read.pages,
                                                                               pages_of(plan, read.index))
               for read in reads)
    if chunk_store.store.cluster or not chunk_store.store.call(chunk_store.store.redis, ("PING",)):
        return  # redis-py reads every reply before kvredis sees one (fakeredis, a cluster)
    assert [index for index, _ in checked_at] == [0, 1, 2]  # each once, in order
    total = replies_read[0] - 1  # the PING's
    assert checked_at[0][1] < checked_at[1][1] < checked_at[2][1] <= total
    assert checked_at[1][1] < total  # chunk 1 checked before chunk 2's replies were all read
