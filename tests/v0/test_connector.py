"""RedisConnector (the seed's V0 connector API) over paged KV caches, on fakeredis and a real Redis."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvredis.v0.connector import RedisConnector

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 16, 4, 2, 8
SENTINEL = -7.0


def paged_caches(fill: float | None = None, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    if fill is not None:
        return [torch.full(shape, fill, dtype=torch.float16) for _ in range(LAYERS)]
    return [torch.randn(shape, generator=generator).to(torch.float16) for _ in range(LAYERS)]


def batch(prompts: list[torch.Tensor], slots: torch.Tensor) -> SimpleNamespace:
    metadata = SimpleNamespace(seq_lens=[len(p) for p in prompts], slot_mapping=slots)
    return SimpleNamespace(input_tokens=torch.cat(prompts), attn_metadata=metadata)


def model(start_layer: int = 0) -> SimpleNamespace:
    return SimpleNamespace(model=SimpleNamespace(start_layer=start_layer, end_layer=start_layer + LAYERS))


def random_slots(count: int, seed: int) -> torch.Tensor:
    return torch.randperm(BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(seed))[:count]


def slot_view(cache: torch.Tensor, kv: int) -> torch.Tensor:
    return cache[kv].reshape(-1, HEADS, HEAD_DIM)


def make_connector(make_buffer) -> RedisConnector:
    buffer = make_buffer(chunk_bytes=4096, pop_timeout_s=0.3)
    return RedisConnector(buffer.config, buffer=buffer)


PROMPTS = [torch.arange(100, 107), torch.arange(200, 213), torch.arange(300, 303)]


def send(connector: RedisConnector, prompts: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor,
                                                                           torch.Tensor]:
    caches = paged_caches(seed=1)
    total = sum(len(p) for p in prompts)
    slots = random_slots(total, seed=2)
    hidden = torch.randn(total, 32)
    connector.send_kv_caches_and_hidden_states(model(), batch(prompts, slots), caches, hidden)
    return caches, slots, hidden


def test_every_value_lands_at_the_receivers_slot_and_nothing_else_changes(make_buffer):
    sender, receiver = make_connector(make_buffer), make_connector(make_buffer)
    sent_caches, sent_slots, hidden = send(sender, PROMPTS)
    total = len(sent_slots)
    recv_slots = random_slots(total, seed=3)
    recv_caches = paged_caches(fill=SENTINEL)
    received, bypass, model_input = receiver.recv_kv_caches_and_hidden_states(
        model(), batch(PROMPTS, recv_slots), recv_caches)
    assert bypass is True
    assert torch.equal(received, hidden)
    assert model_input.attn_metadata.slot_mapping is recv_slots
    for layer in range(LAYERS):
        for kv in (0, 1):
            got, want = slot_view(recv_caches[layer], kv), slot_view(sent_caches[layer], kv)
            assert torch.equal(got[recv_slots], want[sent_slots])
            untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
            untouched[recv_slots] = False
            assert bool((got[untouched] == SENTINEL).all())


def test_a_missing_request_disables_bypass_and_keeps_its_slots_untouched(make_buffer):
    sender, receiver = make_connector(make_buffer), make_connector(make_buffer)
    send(sender, PROMPTS[:2])  # the third prompt was never prefilled here
    total = sum(len(p) for p in PROMPTS)
    recv_slots = random_slots(total, seed=4)
    recv_caches = paged_caches(fill=SENTINEL)
    received, bypass, _ = receiver.recv_kv_caches_and_hidden_states(
        model(), batch(PROMPTS, recv_slots), recv_caches)
    assert bypass is False and received is None
    missing_slots = recv_slots[-len(PROMPTS[2]):]
    loaded_slots = recv_slots[:-len(PROMPTS[2])]
    for cache in recv_caches:
        assert bool((slot_view(cache, 0)[missing_slots] == SENTINEL).all())
        assert not bool((slot_view(cache, 0)[loaded_slots] == SENTINEL).any())


def test_pipeline_stage_uses_its_own_layers(make_buffer):
    sender, receiver = make_connector(make_buffer), make_connector(make_buffer)
    caches = paged_caches(seed=5)
    slots = random_slots(7, seed=6)
    prompt = [torch.arange(7)]
    sender.send_kv_caches_and_hidden_states(model(start_layer=8), batch(prompt, slots), caches,
                                            torch.zeros(7, 4))
    target = paged_caches(fill=SENTINEL)
    _, bypass, _ = receiver.recv_kv_caches_and_hidden_states(
        model(start_layer=8), batch(prompt, slots), target)
    assert bypass is True
    for got, sent in zip(target, caches, strict=True):
        assert torch.equal(slot_view(got, 1)[slots], slot_view(sent, 1)[slots])


def test_a_cache_of_another_dtype_is_not_written(make_buffer):
    sender, receiver = make_connector(make_buffer), make_connector(make_buffer)
    send(sender, PROMPTS)
    total = sum(len(p) for p in PROMPTS)
    target = [torch.full((2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), SENTINEL) for _ in range(LAYERS)]
    _, bypass, _ = receiver.recv_kv_caches_and_hidden_states(model(), batch(PROMPTS, random_slots(total, 8)),
                                                             target)
    assert bypass is False
    assert all(bool((t == SENTINEL).all()) for t in target)


def test_profiling_runs_move_nothing(make_buffer):
    connector = make_connector(make_buffer)
    empty = [torch.empty(0) for _ in range(LAYERS)]
    connector.send_kv_caches_and_hidden_states(model(), batch(PROMPTS, torch.arange(23)), empty, None)
    assert list(connector.buffer.store.scan(f"{connector.config.namespace}:*")) == []
    result = connector.recv_kv_caches_and_hidden_states(model(), batch(PROMPTS, torch.arange(23)), empty)
    assert result[1] is False
