#!/usr/bin/env python
"""A whole prompt's KV through Redis as chunks (the vLLM connector's path) against the lookup buffer's one
entry (the previous path, still the V0 layer's), in the same run, on the same Redis.

For each size: ``Transfers.save`` then ``Transfers.take`` of every position (announced, so the take waits for
the record and releases the chunks), and ``RedisLookupBuffer.insert`` then ``take`` of the same pages, one
after the other in each repeat; the median round trip of ``--repeat``, its write and read halves, and the
ratio chunks / entry. The first line says when it ran and the machine's load average (other work shares the
test VM). Pages have a Llama-3-8B shape (32 layers, 8 KV heads of 128, bf16: 128 KiB a token, 2 MiB a
16-token block): 64 KiB is one token's half in 16 layers, 128 MiB is 1,024 tokens.

    python scripts/bench_chunks.py                      # a redis-server of its own on a free port
    python scripts/bench_chunks.py --url redis://127.0.0.1:6379/0 --chunk-tokens 64
    python scripts/bench_chunks.py --only chunks --sizes "128 MiB"   # one path alone (alternate processes)
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from bench_lookup import own_redis  # noqa: E402  (this folder is on sys.path: the script's own)

from kvredis.buffer import RedisLookupBuffer  # noqa: E402
from kvredis.chunk_store import PageFormat  # noqa: E402
from kvredis.config import KVRedisConfig  # noqa: E402
from kvredis.keys import new_entry_id  # noqa: E402
from kvredis.transfer import Transfers  # noqa: E402

BLOCK = 16


def sizes() -> dict[str, tuple[int, PageFormat]]:
    """Name -> (prompt tokens, page format) of each measured size."""
    return {
        "64 KiB": (1, PageFormat(torch.bfloat16, 16, (2 * 8, 1, 128))),  # one position, its own "block"
        "128 MiB": (1024, PageFormat(torch.bfloat16, 32, (2 * 8, BLOCK, 128))),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a Redis of yours (default: start one on a free port)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--chunk-tokens", type=int, default=KVRedisConfig().chunk_tokens)
    parser.add_argument("--only", choices=("entry", "chunks"),
                        help="measure one path alone (the paths interact within one process)")
    parser.add_argument("--sizes", default=",".join(sizes()),
                        help="comma-separated, of: " + ", ".join(sizes()))
    args = parser.parse_args()
    with own_redis(args.url) as url:
        return measure(url, args)


def measure(url: str, args: argparse.Namespace) -> int:
    config = KVRedisConfig.from_env({}, {"url": url, "namespace": "bench-chunks", "pop_timeout_s": 30})
    buffer = RedisLookupBuffer(config)
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"# {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, load average "
              f"{load}, {os.cpu_count()} CPUs")
        print(f"whole-prompt round trip (write, then read), median of {args.repeat}; chunks of "
              f"{args.chunk_tokens} tokens")
        if args.only is None:
            print(f"  {'size':>8} {'entry ms':>9} {'(w + r)':>17} {'chunks ms':>10} {'(w + r)':>17} "
                  f"{'chunks/entry':>13}")
        for name, (tokens, page_format) in sizes().items():
            if name not in args.sizes.split(","):
                continue
            block = page_format.page_shape[1]
            chunk_tokens = max(args.chunk_tokens // block, 1) * block
            transfers = Transfers(buffer.store, buffer.keyspace.prefix, chunk_tokens=chunk_tokens,
                                  block_size=block, ttl_ms=600_000, pop_timeout_s=30,
                                  max_chunk_bytes=1 << 31)
            prompt = list(range(tokens))
            pages = torch.randn(page_format.shape(-(-tokens // block))).to(page_format.dtype)
            entry: list[tuple[float, float]] = []
            chunked: list[tuple[float, float]] = []
            for _ in range(args.repeat):
                if args.only != "chunks":
                    started = time.perf_counter()
                    buffer.insert(torch.tensor(prompt), None, pages, None, None)
                    written = time.perf_counter()
                    got, cause = buffer.take(torch.tensor(prompt), None)
                    entry.append((written - started, time.perf_counter() - written))
                    assert got is not None and torch.equal(got[2], pages), cause
                if args.only == "entry":
                    continue
                started = time.perf_counter()
                plan = transfers.plan(prompt)
                transfer = new_entry_id()
                transfers.save(plan, pages, transfer_id=transfer)
                written = time.perf_counter()
                taken = transfers.take(plan, 0, tokens, page_format, transfer_id=transfer)
                chunked.append((written - started, time.perf_counter() - written))
                assert taken.cause == "hit" and torch.equal(torch.cat(taken.chunks, dim=1), pages)
            if args.only is not None:
                times = entry or chunked
                alone = statistics.median(w + r for w, r in times)
                print(f"  {name:>8} {args.only:>6} alone {1000 * alone:>9.2f} {_halves(times):>17}")
                continue
            e, c = statistics.median(w + r for w, r in entry), statistics.median(w + r for w, r in chunked)
            print(f"  {name:>8} {1000 * e:>9.2f} {_halves(entry):>17} {1000 * c:>10.2f} "
                  f"{_halves(chunked):>17} {c / e:>13.2f}")
        left = list(buffer.store.scan("bench-chunks:*"))
        assert not left, f"keys left: {left[:5]}"
    finally:
        buffer.close()
    return 0


def _halves(times: list[tuple[float, float]]) -> str:
    """The median write and the median read, in ms."""
    write, read = (statistics.median(half) for half in zip(*times, strict=True))
    return f"({1000 * write:.2f} + {1000 * read:.2f})"


if __name__ == "__main__":
    sys.exit(main())
