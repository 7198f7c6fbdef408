"""The CUDA data path's logic (kvredis.vllm.staging), on the CPU with a fake device (tests/fake_device.py),
and ``RedisLookupBuffer.take`` receiving into memory the caller allocates (pinned memory on a GPU)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

pytest.importorskip("vllm.version", reason="needs vLLM's CPU build (run with the vLLM environment's python)")

import torch
from fake_device import GARBAGE, FakeDevice
from kv_entries import identical, kv_entry

from kvredis.errors import ConfigError
from kvredis.vllm.staging import CudaDevice, DeviceStaging, copy_pages_in, copy_pages_out, device_for

BLOCKS, HEADS, BLOCK, WIDTH = 10, 2, 4, 6
WAIT_S = 30.0  # generous: the machine may stall; a passing test never waits for it


def cache(order: str = "HND", seed: int = 0) -> torch.Tensor:
    """A ``[B, H, N, C]`` layer over memory laid out as vLLM's backends do, filled with distinct values."""
    if order == "NHD":
        layer = torch.empty(BLOCKS, BLOCK, HEADS, WIDTH).permute(0, 2, 1, 3)
    elif order == "layer-interleaved":
        layer = torch.empty(BLOCKS, 2, HEADS, BLOCK, WIDTH)[:, 1]
    else:
        layer = torch.empty(BLOCKS, HEADS, BLOCK, WIDTH)
    layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(seed)))
    return layer


def garbage(tensor: torch.Tensor) -> bool:
    return bool((tensor.contiguous().view(torch.uint8) == GARBAGE).all())


def pages(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


# -- choosing the path -----------------------------------------------------------------------------


def test_cpu_caches_move_pages_directly() -> None:
    assert device_for({"a": cache(), "b": cache()}) is None
    assert device_for({}) is None


def test_caches_on_several_devices_are_refused() -> None:
    with pytest.raises(ConfigError, match="several devices"):
        device_for({"a": cache(), "b": torch.empty(BLOCKS, HEADS, BLOCK, WIDTH, device="meta")})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_a_cuda_device_without_cuda_is_refused_clearly() -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        CudaDevice(torch.device("cuda", 0))


@pytest.mark.parametrize("order", ["HND", "NHD", "layer-interleaved"])
def test_page_copies_out_and_in_on_every_layout(order: str) -> None:
    """The tensor work CudaDevice queues on its streams, run here on CPU tensors."""
    source, target = cache(order, seed=1), cache(order, seed=2)
    before = target.clone()
    out = torch.empty(3, HEADS, BLOCK, WIDTH)
    copy_pages_out(source, pages(7, 2, 5), out)
    assert torch.equal(out, source[pages(7, 2, 5)])
    copy_pages_in(target, pages(0, 9, 4), out)
    assert torch.equal(target[pages(0, 9, 4)], source[pages(7, 2, 5)])
    others = [b for b in range(BLOCKS) if b not in (0, 9, 4)]
    assert torch.equal(target[others], before[others])
    with pytest.raises(ValueError, match="cannot copy"):
        copy_pages_out(source, pages(1, 2), out)
    with pytest.raises(ValueError, match="cannot write"):
        copy_pages_in(target, pages(1, 2), out)
    with pytest.raises(ValueError, match="cannot copy"):
        copy_pages_out(source, pages(1, 2, 3), out.to(torch.float16))


# -- saves -----------------------------------------------------------------------------------------


def test_saves_queue_after_the_forward_into_pinned_memory_with_one_event_a_step() -> None:
    fake = FakeDevice()
    staging = DeviceStaging(fake)
    save_stream = fake.streams[0]
    layers = [cache(seed=i) for i in range(3)]
    first, second = pages(3, 1), pages(8)
    out_a = staging.host_empty((3, 2, HEADS, BLOCK, WIDTH), torch.float32)
    out_b = staging.host_empty((3, 1, HEADS, BLOCK, WIDTH), torch.float32)
    for index, layer in enumerate(layers):
        staging.save_layer(layer, [(first, out_a[index]), (second, out_b[index])])
    # Per layer: the save stream waits for an event just recorded on the forward's stream, then gathers.
    ops = [(op, stream) for op, stream, _ in fake.log if op != "pinned"]
    after_forward = [("record", "compute"), ("wait", "side0")]
    gather = ("gather", "side0")
    # Each request's page index goes to the device once per step, not once per layer.
    assert ops == [*after_forward, ("upload", "side0"), gather, ("upload", "side0"), gather,
                   *after_forward, gather, gather, *after_forward, gather, gather]
    waits = fake.ops("wait", save_stream)
    assert [detail for _, _, detail in waits] == fake.events_on(fake.compute)
    assert fake.events_on(save_stream) == [] and not fake.syncs and not fake.violations
    assert garbage(out_a) and garbage(out_b)  # nothing landed yet

    transfer = staging.finish_saves()
    assert transfer is not None and fake.events_on(save_stream) == [transfer.event]
    assert ("wait", "compute", transfer.event) in fake.log  # later kernels wait for the copies
    assert not transfer.event.query() and garbage(out_a)
    fake.complete(transfer.event)
    for index, layer in enumerate(layers):
        assert torch.equal(out_a[index], layer[first]) and torch.equal(out_b[index], layer[second])
    assert not fake.syncs  # the engine's thread never waited
    assert staging.finish_saves() is None  # nothing queued since: no event
    assert len(fake.events_on(save_stream)) == 1


def test_a_page_shape_that_differs_queues_nothing() -> None:
    fake = FakeDevice()
    staging = DeviceStaging(fake)
    wrong = staging.host_empty((2, HEADS, BLOCK, WIDTH + 1), torch.float32)
    with pytest.raises(ValueError, match="cannot copy"):
        staging.save_layer(cache(), [(pages(1, 2), wrong)])
    assert not [entry for entry in fake.log if entry[0] != "pinned"]
    assert staging.finish_saves() is None


def test_a_writer_waits_for_the_steps_event_and_sleep_waits_for_every_save() -> None:
    fake = FakeDevice()
    staging = DeviceStaging(fake)
    layer = cache()
    outs = [staging.host_empty((1, HEADS, BLOCK, WIDTH), torch.float32) for _ in range(2)]
    staging.save_layer(layer, [(pages(2), outs[0])])
    first = staging.finish_saves()
    staging.save_layer(layer, [(pages(4), outs[1])])
    second = staging.finish_saves()
    assert first is not None and second is not None
    written: list[bool] = []

    def write() -> None:
        first.wait()
        written.append(torch.equal(outs[0][0], layer[2]))

    writer = threading.Thread(target=write)
    writer.start()
    writer.join(0.2)
    assert writer.is_alive() and not written  # its event has not completed: no bytes read yet
    fake.complete(first.event)
    writer.join(WAIT_S)
    assert written == [True]
    asleep = threading.Thread(target=staging.wait_saves)
    asleep.start()
    asleep.join(0.2)
    assert asleep.is_alive()  # the second step's copies still read the caches
    fake.complete(second.event)
    asleep.join(WAIT_S)
    assert not asleep.is_alive() and torch.equal(outs[1][0], layer[4])


def test_sleep_waits_for_every_save_even_after_a_failed_copy() -> None:
    fake = FakeDevice(auto=True)
    staging = DeviceStaging(fake)
    layer = cache()
    outs = [staging.host_empty((1, HEADS, BLOCK, WIDTH), torch.float32) for _ in range(2)]
    error = RuntimeError("CUDA error: unspecified launch failure")
    fake.fail_events = error
    staging.save_layer(layer, [(pages(2), outs[0])])
    first = staging.finish_saves()
    staging.save_layer(layer, [(pages(4), outs[1])])
    second = staging.finish_saves()
    assert first is not None and second is not None
    with pytest.raises(RuntimeError) as raised:
        staging.wait_saves()
    assert raised.value is error
    assert second.event.query() and torch.equal(outs[1][0], layer[4])


# -- loads -----------------------------------------------------------------------------------------


def _load_in_thread(staging: DeviceStaging, writes: list, targets: torch.Tensor, after: object,
                    outcome: list) -> threading.Thread:
    def run() -> None:
        try:
            with staging.bound():
                staging.load([(layer, pages, targets) for layer, pages in writes], after)  # type: ignore[arg-type]
        except BaseException as exc:  # handed to the test
            outcome.append(exc)
        else:
            outcome.append("done")

    thread = threading.Thread(target=run, name="load")
    thread.start()
    return thread


def test_a_load_runs_after_the_steps_mark_and_returns_once_its_copy_ran() -> None:
    fake = FakeDevice()
    staging = DeviceStaging(fake)
    load_stream = fake.streams[1]
    layers = [cache(seed=10 + i) for i in range(2)]
    before = [layer.clone() for layer in layers]
    stored = staging.host_bytes(2 * 2 * HEADS * BLOCK * WIDTH * 4).view(torch.float32)
    stored = stored.view(2, 2, HEADS, BLOCK, WIDTH)
    stored.copy_(torch.randn(stored.shape, generator=torch.Generator().manual_seed(3)))
    after = staging.mark_compute()
    outcome: list = []
    thread = _load_in_thread(staging, [(layers[i], stored[i]) for i in range(2)], pages(6, 0), after, outcome)
    (event,) = fake.wait_for_events(load_stream, 1, WAIT_S)
    loads = [(op, detail) for op, stream, detail in fake.log if stream == load_stream.name]
    assert loads[0] == ("wait", after)  # behind the forward's stream as the step started the load
    assert [op for op, _ in loads[1:]] == ["upload", "scatter", "scatter", "record"]
    thread.join(0.2)
    assert thread.is_alive() and not outcome  # not reported before the copy ran
    assert all(torch.equal(layer, old) for layer, old in zip(layers, before, strict=True))
    fake.complete(event)
    thread.join(WAIT_S)
    assert outcome == ["done"]
    for i, layer in enumerate(layers):
        assert torch.equal(layer[pages(6, 0)], stored[i])
        assert torch.equal(layer[1:6], before[i][1:6])
    assert fake.syncs == {"load": 1} and not fake.violations


@pytest.mark.parametrize("when", ["queued", "ran"])
def test_a_failed_copy_fails_the_load(when: str) -> None:
    fake = FakeDevice(auto=True)
    staging = DeviceStaging(fake)
    layer = cache()
    stored = staging.host_empty((1, HEADS, BLOCK, WIDTH), torch.float32)
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    if when == "queued":
        fake.fail_copies = error
    else:
        fake.fail_events = error
    outcome: list = []
    _load_in_thread(staging, [(layer, stored)], pages(3), None, outcome).join(WAIT_S)
    assert outcome == [error]


# -- the buffer receiving into memory the caller allocates ------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096], ids=["inline", "chunked"])
def test_take_receives_into_the_memory_it_is_given(make_buffer, chunk_bytes: int) -> None:
    buffer = make_buffer(chunk_bytes=chunk_bytes)
    tokens, key, value, hidden = kv_entry(37)
    buffer.insert(tokens, None, key, value, hidden)
    fake = FakeDevice()
    given: list[torch.Tensor] = []

    def allocate(nbytes: int) -> torch.Tensor:
        given.append(DeviceStaging(fake).host_bytes(nbytes))
        return given[-1]

    entry, cause = buffer.take(tokens, None, allocate=allocate)
    assert cause == "hit" and entry is not None and len(given) == 1
    assert identical(entry[2], key) and identical(entry[3], value) and identical(entry[4], hidden)
    for tensor in entry[2:]:
        assert tensor is not None and fake.is_pinned(tensor)  # views over the given memory, no copy after


def test_take_refuses_memory_it_cannot_receive_into(make_buffer) -> None:
    buffer = make_buffer()
    tokens, key, value, hidden = kv_entry(5)
    buffer.insert(tokens, None, key, value, hidden)
    with pytest.raises(TypeError, match="contiguous CPU uint8 tensor"):
        buffer.take(tokens, None, allocate=lambda nbytes: torch.empty(nbytes, dtype=torch.float32))


# -- pinned memory loads receive into --------------------------------------------------------------


def test_a_pinned_slot_is_never_leased_to_two_loads_at_once() -> None:
    fake = FakeDevice()
    staging = DeviceStaging(fake, pinned_bytes=4 << 10, slots=4)
    leases = [staging.lease(1000) for _ in range(4)]
    assert all(lease.pooled for lease in leases)
    spans = sorted((lease.buffer.data_ptr(), lease.buffer.data_ptr() + 1000) for lease in leases)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # disjoint
    extra = staging.lease(1000)  # every slot taken: memory of its own, pinned all the same
    assert not extra.pooled and fake.is_pinned(extra.buffer)
    assert not any(start <= extra.buffer.data_ptr() < end for start, end in spans)
    leases[1].release()
    leases[1].release()  # idempotent: the slot is not freed twice
    again = staging.lease(1000)
    assert again.pooled and again.buffer.data_ptr() == leases[1].buffer.data_ptr()
    assert not staging.lease(2000).pooled  # larger than a slot
    assert [shape for op, _, shape in fake.log if op == "pinned"].count((4 << 10,)) == 1  # the pool, once


def test_concurrent_loads_each_hold_a_slot_of_their_own() -> None:
    staging = DeviceStaging(FakeDevice(), pinned_bytes=2 << 10, slots=2)
    held: set[int] = set()
    lock = threading.Lock()
    overlaps: list[int] = []

    def load(rounds: int) -> None:
        for _ in range(rounds):
            lease = staging.lease(512)
            if lease.pooled:
                with lock:
                    if lease.buffer.data_ptr() in held:
                        overlaps.append(lease.buffer.data_ptr())
                    held.add(lease.buffer.data_ptr())
                time.sleep(0.001)
                with lock:
                    held.discard(lease.buffer.data_ptr())
            lease.release()

    threads = [threading.Thread(target=load, args=(50,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not overlaps and not held
    assert sorted(staging._free_slots) == [0, 1]  # every slot back
