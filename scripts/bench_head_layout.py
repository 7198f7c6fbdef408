#!/usr/bin/env python
"""What reading a slice of a writer's KV heads would cost and save, to decide the chunk layout: a decode
rank wider than its prefill (TP 1 -> 2) reads the prefill's part whole, twice its share, because a chunk
stores the engine's pages ``[layers, pages, heads, block, C]`` and a slice of the heads is ``layers x pages``
ranges. Storing chunks head-major would make a slice one range, at the price of one permuting copy of every
chunk on every writer. This measures, in one run against the same Redis:

- the memcpy of a prompt's pages (the limit of any copy), and the head-major copy of them (what a writer
  would add to every save; one strided copy a head, which runs at memcpy speed where torch's generic
  ``permute().contiguous()`` does not);
- a kvredis save of the prompt (transfer mode), and a take of it whole (what a reader does today).

It prints the permute as a fraction of the save (what every writer would pay) and the half of the take a
TP 1 -> 2 reader would save at best.

    python scripts/bench_head_layout.py                 # Llama-3-8B's KV shape, 1,024 tokens, bf16
    python scripts/bench_head_layout.py --tokens 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvredis.config import KVRedisConfig  # noqa: E402
from kvredis.store.chunk_store import PageFormat  # noqa: E402
from kvredis.store.client import RedisStore  # noqa: E402
from kvredis.store.keys import new_entry_id  # noqa: E402
from kvredis.store.transfer import Transfers  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
BLOCK, CHUNK = 16, 256  # vLLM's GPU block size, kvredis's chunk length


def timed(run, repeats: int) -> float:
    """The median of ``repeats`` runs, in seconds."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    pages = -(-args.tokens // BLOCK)
    page_shape = (KV_HEADS, BLOCK, 2 * HEAD_DIM)
    kv = torch.randn(LAYERS, pages, *page_shape).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    target = torch.empty_like(kv)
    memcpy = timed(lambda: target.copy_(kv), args.repeats)
    head_major = torch.empty(KV_HEADS, LAYERS, pages, BLOCK, 2 * HEAD_DIM, dtype=kv.dtype)

    def per_head() -> None:
        for head in range(KV_HEADS):
            head_major[head].copy_(kv[:, :, head])

    permute = timed(per_head, args.repeats)
    generic = timed(lambda: kv.permute(2, 0, 1, 3, 4).contiguous(), args.repeats)

    config = KVRedisConfig(url=args.url, namespace="bench-heads-" + uuid.uuid4().hex[:8])
    store = RedisStore(config)
    transfers = Transfers(store, f"{config.namespace}:0123456789abcdef", chunk_tokens=CHUNK, block_size=BLOCK,
                          ttl_ms=60_000, pop_timeout_s=10.0, max_chunk_bytes=1 << 31)
    tokens = list(range(args.tokens + 1))
    plan = transfers.plan(tokens[:-1])
    page_format = PageFormat(torch.bfloat16, LAYERS, page_shape)
    saves, takes = [], []
    try:
        for _ in range(args.repeats):
            transfer = new_entry_id()
            started = time.perf_counter()
            transfers.save(plan, kv, transfer_id=transfer)
            saves.append(time.perf_counter() - started)
            started = time.perf_counter()
            taken = transfers.take(plan, 0, args.tokens, page_format, transfer_id=transfer)
            takes.append(time.perf_counter() - started)
            if taken.cause != "hit" or not torch.equal(torch.cat(taken.chunks, dim=1), kv):
                print(f"FAIL: the take got {taken.cause}, not the pages saved")
                return 1
    finally:
        store.close()
    save, take = statistics.median(saves), statistics.median(takes)
    gib = nbytes / (1 << 30)
    print(f"prompt of {args.tokens} tokens: {nbytes / (1 << 20):.0f} MiB of pages "
          f"({LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} x bf16), median of {args.repeats}")
    print(f"  memcpy                {memcpy * 1e3:8.1f} ms  {gib / memcpy:6.2f} GiB/s")
    print(f"  head-major copy       {permute * 1e3:8.1f} ms  {gib / permute:6.2f} GiB/s  "
          f"{permute / memcpy:.2f}x the memcpy (permute().contiguous(): {generic * 1e3:.1f} ms)")
    print(f"  kvredis save          {save * 1e3:8.1f} ms  {gib / save:6.2f} GiB/s")
    print(f"  kvredis take (whole)  {take * 1e3:8.1f} ms  {gib / take:6.2f} GiB/s")
    print(f"every writer would pay the head-major copy: +{permute / save:.0%} on each save; "
          f"a TP 1 -> 2 reader would save at most half its take: -{take / 2 * 1e3:.1f} ms "
          f"({take / 2 / (save + take):.0%} of a save and a take)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
