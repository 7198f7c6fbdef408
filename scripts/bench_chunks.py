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
    python scripts/bench_chunks.py --peer              # kvredis against LMCache's native client, same run

``--peer`` measures the read path an engine uses and the best peer's client on the same Redis and bytes, in
the same run: 128 MiB of those pages written by ``Transfers.save`` and read by ``Transfers.take`` straight
into a preallocated pages tensor (as into an engine's KV blocks; every check of every chunk included), against
LMCache's C++ RESP client (``lmcache.lmcache_redis``, run by ``scripts/lmcache_peer.py`` in the environment
``scripts/install_lmcache_peer.sh`` makes: not a dependency of kvredis) at each of its value sizes and worker
counts, SET all then GET all into preallocated buffers; and ``redis-benchmark``'s single-connection GET of
1 MiB and 4 MiB values. kvredis is also measured without checksums (the peer checks nothing: the difference
is what kvredis's checks cost) and at the chunk lengths ``--other-chunk-tokens`` names (default 32 tokens,
4 MiB values at this shape), each variant going first in turn. The sweep's ratios: kvredis
(``--chunk-tokens``, the default) over the peer's best read and best round trip, and kvredis at its best
chunk length over the same. The verdict comes after it: ``--rounds`` rounds of kvredis's default (in reuse
and in transfer mode) and the peer's best read and best round trip configurations of the sweep, ``--repeat``
round trips each, in turn; the median of the rounds' ratios (the best of nine medians picked after the fact
flatters the peer, and this machine's speed drifts between the sweep's two halves).
It also prints what Redis holds for the chunks (``MEMORY USAGE``: its allocator rounds each value up to a
size class) and the server allocator's ``dirty_decay_ms``; ``--server-malloc-conf dirty_decay_ms:-1`` starts
the script's server with that setting (docs/deployment.md says why: a freed value of 7 MiB or more otherwise
goes back to the kernel at once, and the next one page-faults in every page).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402
import torch  # noqa: E402
from bench_lookup import own_redis  # noqa: E402  (this folder is on sys.path: the script's own)

from kvredis.config import KVRedisConfig  # noqa: E402
from kvredis.store.chunk_keys import ChunkPlan  # noqa: E402
from kvredis.store.chunk_store import PageFormat  # noqa: E402
from kvredis.store.keys import new_entry_id  # noqa: E402
from kvredis.store.transfer import Transfers  # noqa: E402
from kvredis.v0.buffer import RedisLookupBuffer  # noqa: E402

BLOCK = 16
PEER_PYTHON = Path.home() / ".cache" / "kvredis" / "lmcache-venv" / "bin" / "python"


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
    parser.add_argument("--other-chunk-tokens", type=lambda text: [int(n) for n in text.split(",") if n],
                        default=[32], help="with --peer, kvredis at these chunk lengths too (comma list)")
    parser.add_argument("--only", choices=("entry", "chunks"),
                        help="measure one path alone (the paths interact within one process)")
    parser.add_argument("--sizes", default=",".join(sizes()),
                        help="comma-separated, of: " + ", ".join(sizes()))
    parser.add_argument("--peer", action="store_true",
                        help="kvredis's engine read path against LMCache's native client (see above)")
    parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON,
                        help="the Python of the environment holding lmcache")
    parser.add_argument("--peer-sizes", default="4MiB,8MiB,32MiB")
    parser.add_argument("--peer-workers", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=6,
                        help="after the sweep, rounds of kvredis and the peer's best configurations in turn, "
                             "--repeat round trips each (the verdict; 0: the sweep's alone)")
    parser.add_argument("--server-malloc-conf", metavar="CONF",
                        help="start the script's redis-server with this jemalloc configuration (e.g. "
                             "dirty_decay_ms:-1, see docs/deployment.md)")
    args = parser.parse_args()
    if args.url is not None and args.server_malloc_conf is not None:
        parser.error("--server-malloc-conf configures the script's own redis-server: not with --url")
    with own_redis(args.url, args.server_malloc_conf) as url:
        return against_peer(url, args) if args.peer else measure(url, args)


class Variant(NamedTuple):
    """One way kvredis is measured: chunk length, checksums, and reuse (the stack's mode: a take leaves the
    chunks, as the peer's GETs do) or transfer (a take deletes what it read, within its time)."""

    tokens: int
    checked: bool = True
    reuse: bool = True

    def __str__(self) -> str:
        return (f"{self.tokens}-token chunks, {'reuse' if self.reuse else 'transfer'} mode"
                f"{'' if self.checked else ', no checksums (KVREDIS_CHECKSUM=0)'}")


def against_peer(url: str, args: argparse.Namespace) -> int:
    """kvredis's save and in-place take of 128 MiB against LMCache's client and redis-benchmark, one run."""
    if not args.peer_python.exists():
        print(f"no {args.peer_python}: run scripts/install_lmcache_peer.sh first", file=sys.stderr)
        return 2
    tokens, page_format = sizes()["128 MiB"]
    config = KVRedisConfig.from_env(None, {"url": url, "namespace": "bench-chunks", "pop_timeout_s": 30})
    buffer = RedisLookupBuffer(config)
    lengths = [max(n // BLOCK, 1) * BLOCK for n in (args.chunk_tokens, *args.other_chunk_tokens)]
    # The product in both modes (the first chunk length, checksums on); without checksums (the peer has
    # none: the difference is what kvredis's checks cost); the other chunk lengths.
    default, transfer = Variant(lengths[0]), Variant(lengths[0], reuse=False)
    variants = [default, transfer, Variant(lengths[0], checked=False), *(Variant(n) for n in lengths[1:])]
    pages = torch.randn(page_format.shape(tokens // BLOCK), generator=torch.Generator().manual_seed(0)
                        ).to(page_format.dtype)
    out = torch.empty_like(pages)
    page_bytes = out[0, 0].numel() * out.element_size()
    layers = [out[layer].view(torch.uint8).reshape(-1).numpy().data for layer in range(page_format.layers)]
    total = pages.numel() * pages.element_size()
    halves: dict[Variant, list[tuple[float, float]]] = {variant: [] for variant in variants}
    held = 0
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"# {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}, load average "
              f"{load}, {os.cpu_count()} CPUs; {total >> 20} MiB of pages ({page_format.layers} layers, "
              f"pages {page_format.page_shape} {page_format.dtype}), median of {args.repeat}; the "
              f"server's jemalloc: {allocator_decay(buffer.store.redis)}")
        paths = {variant: (Transfers(buffer.store, buffer.keyspace.prefix, chunk_tokens=variant.tokens,
                                     block_size=BLOCK, ttl_ms=600_000, pop_timeout_s=30,
                                     max_chunk_bytes=1 << 31, checksum=variant.checked, reuse=variant.reuse),
                           IntoPages(layers, variant.tokens // BLOCK * page_bytes))
                 for variant in variants}

        def round_trip(variant: Variant) -> tuple[float, float]:
            """One save and in-place take of the pages, checked; (write, read) seconds. The chunks are new
            each time (a context of their own); in reuse mode they are deleted afterwards, outside the time,
            as the peer deletes its values."""
            transfers, into = paths[variant]
            out.zero_()
            plan = transfers.plan(list(range(tokens)), uuid.uuid4().hex)
            transfer = new_entry_id()
            started = time.perf_counter()
            transfers.save(plan, pages, transfer_id=transfer)
            written = time.perf_counter()
            nonlocal held
            if not held and variant == default:
                held = held_bytes(transfers, plan)
            taken = transfers.take(plan, 0, tokens, page_format, transfer_id=transfer, into=into)
            took = (written - started, time.perf_counter() - written)
            assert taken.cause == "hit" and all(chunk is None for chunk in taken.chunks), taken.cause
            assert torch.equal(out.view(torch.int16), pages.view(torch.int16)), "other bytes read"
            if variant.reuse:
                transfers.chunks.delete_keys([transfers.chunks.keys.chunk(digest) for digest in plan.digests])
            return took

        for repeat in range(args.repeat + 1):  # the first round trip warms up
            turn = repeat % len(variants)  # each variant goes first in turn
            for variant in variants[turn:] + variants[:turn]:
                halves[variant].append(round_trip(variant))
        medians = {variant: median_halves(runs[1:]) for variant, runs in halves.items()}
        peer = run_peer(args, url, total, args.peer_sizes, args.peer_workers)
        report_sweep(url, medians, peer, variants, tokens, total, held)
        if args.rounds:
            alternate(args, url, total, peer, (default, transfer),
                      lambda variant: median_halves([round_trip(variant) for _ in range(args.repeat)]))
    finally:
        buffer.close()
    return 0


def median_halves(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The median write and the median read of round trips."""
    write, read = (statistics.median(half) for half in zip(*runs, strict=True))
    return write, read


def run_peer(args: argparse.Namespace, url: str, total: int, sizes: str, workers: str) -> dict[str, Any]:
    """``scripts/lmcache_peer.py``'s results for each value size and worker count, in its environment."""
    return dict(json.loads(subprocess.run(
        [str(args.peer_python), str(REPO / "scripts" / "lmcache_peer.py"), "--url", url, "--total",
         str(total), "--sizes", sizes, "--workers", workers, "--repeat", str(args.repeat)],
        capture_output=True, text=True, check=True, timeout=900).stdout.strip().splitlines()[-1]))


def report_sweep(url: str, medians: dict[Variant, tuple[float, float]], peer: dict[str, Any],
                 variants: list[Variant], tokens: int, total: int, held: int) -> None:
    """Every kvredis variant and peer configuration of the sweep, and the ratios the sweep gives."""
    rates = {}
    for variant, (write, read) in medians.items():
        rates[variant] = {"read": total / read / 1e9, "round trip": total / (write + read) / 1e9}
        print(f"  kvredis, {variant} ({total * variant.tokens // tokens >> 20} MiB values), read into place: "
              f"write {1000 * write:.1f} ms, read {1000 * read:.1f} ms = {rates[variant]['read']:.2f} GB/s, "
              f"round trip {rates[variant]['round trip']:.2f} GB/s")
    default, transfer, bare = variants[:3]
    for what, costly, cheap in (("the checksums", default, bare),
                                ("transfer mode's release (the chunks deleted)", transfer, default)):
        print(f"  {what} cost {1000 * (medians[costly][0] - medians[cheap][0]):+.1f} ms writing, "
              f"{1000 * (medians[costly][1] - medians[cheap][1]):+.1f} ms reading")
    print(f"  Redis holds {held / total:.3f} bytes a byte of pages ({default.tokens}-token chunks: MEMORY "
          f"USAGE of their keys, {held >> 20} MiB for {total >> 20} MiB)")
    for result in peer["results"]:
        print(f"  LMCache native, {result['size'] >> 20} MiB values, {result['workers']} workers: write "
              f"{1000 * result['write_s']:.1f} ms, read {1000 * result['read_s']:.1f} ms = "
              f"{result['read_gbps']:.2f} GB/s, round trip {result['round_trip_gbps']:.2f} GB/s")
    best = {"read": max(r["read_gbps"] for r in peer["results"]),
            "round trip": max(r["round_trip_gbps"] for r in peer["results"])}
    gets = {size: redis_benchmark_get(url, size) for size in (1 << 20, 4 << 20)}
    ours = rates[default]
    for what in ("read", "round trip"):
        ours_best = max(rates[variant][what] for variant in variants if variant.checked)
        print(f"  {what}: kvredis {ours[what]:.2f} GB/s ({default}), the peer's best {best[what]:.2f} "
              f"GB/s: {ours[what] / best[what]:.2f}x in the sweep; kvredis's best variant "
              f"{ours_best / best[what]:.2f}x")
    for size, rate in gets.items():
        print(f"  redis-benchmark -t set,get -d {size} -c 1, GET: {rate:.2f} GB/s; kvredis's read "
              f"{ours['read'] / rate:.2f}x, the peer's best {best['read'] / rate:.2f}x")


def alternate(args: argparse.Namespace, url: str, total: int, sweep: dict[str, Any],
              ours: tuple[Variant, ...], measure: Callable[[Variant], tuple[float, float]]) -> None:
    """kvredis in both modes against the peer's best read and best round trip configurations of the sweep,
    measured in turn (each going first in turn): the best of nine noisy medians picked after the fact
    flatters the peer, and this machine's speed drifts between a sweep's halves. The verdict is the median
    of the rounds' ratios."""
    picks = {what: max(sweep["results"], key=lambda r: r[key])
             for what, key in (("read", "read_gbps"), ("round trip", "round_trip_gbps"))}
    configs = sorted({(r["size"], r["workers"]) for r in picks.values()})
    names = ", ".join(f"{what} {r['size'] >> 20} MiB values with {r['workers']} workers"
                      for what, r in picks.items())
    print(f"  alternating, {args.rounds} rounds of {args.repeat} round trips each: kvredis against the "
          f"peer's best in the sweep ({names})")
    keys = {"read": "read_gbps", "round trip": "round_trip_gbps"}
    ratios: dict[tuple[Variant, str], list[float]] = {(variant, what): []
                                                      for variant in ours for what in keys}
    steps: list[Variant | None] = [*ours, None]  # None: the peer
    for round_ in range(args.rounds):
        turn = round_ % len(steps)
        theirs: dict[tuple[int, int], dict[str, Any]] = {}
        mine: dict[Variant, dict[str, float]] = {}
        for step in steps[turn:] + steps[:turn]:
            if step is None:
                for size, workers in configs:
                    theirs[size, workers] = run_peer(args, url, total, str(size), str(workers))["results"][0]
                continue
            write, read = measure(step)
            mine[step] = {"read": total / read / 1e9, "round trip": total / (write + read) / 1e9}
        for variant, rate in mine.items():
            line = []
            for what, key in keys.items():
                other = theirs[picks[what]["size"], picks[what]["workers"]][key]
                ratios[variant, what].append(rate[what] / other)
                line.append(f"{what} {rate[what]:.2f} against {other:.2f} GB/s ({rate[what] / other:.2f}x)")
            print(f"    round {round_ + 1}, {variant}: " + "; ".join(line))
    for (variant, what), values in ratios.items():
        print(f"  {what}, alternating, {variant}: kvredis {statistics.median(values):.2f}x the peer's best "
              f"(median of {len(values)} rounds, {min(values):.2f}-{max(values):.2f}x; target >= 1)")


def allocator_decay(client: Any) -> str:
    """The server's jemalloc ``dirty_decay_ms`` as ``MEMORY MALLOC-STATS`` reports it (so a setting that did
    not take shows), or why it is not known."""
    try:
        stats = client.execute_command("MEMORY", "MALLOC-STATS")
    except redis.RedisError as exc:
        return f"not known ({exc})"
    text = stats.decode(errors="replace") if isinstance(stats, bytes) else str(stats)
    found = re.search(r"opt\.dirty_decay_ms: (-?\d+)", text)
    return "not jemalloc" if found is None else f"dirty_decay_ms {found.group(1)}"


def held_bytes(transfers: Transfers, plan: ChunkPlan) -> int:
    """What Redis holds for the plan's chunks (``MEMORY USAGE`` of each chunk's key, allocator rounding
    included)."""
    client = transfers.store.redis
    return sum(int(client.memory_usage(transfers.chunks.keys.chunk(digest), samples=0) or 0)
               for digest in plan.digests)


class IntoPages:
    """Where a chunk's pages land, as the connector lands them in an engine's blocks: a range of memory for
    each run of pages side by side (here a layer's ``chunk_bytes`` of the chunk)."""

    in_place = True

    def __init__(self, layers: list[memoryview], chunk_bytes: int) -> None:
        self.layers = layers
        self.chunk_bytes = chunk_bytes

    def __call__(self, index: int) -> list[memoryview]:
        first = index * self.chunk_bytes
        return [layer[first:first + self.chunk_bytes] for layer in self.layers]


def redis_benchmark_get(url: str, size: int, requests: int = 200) -> float:
    """``redis-benchmark -t set,get -d size -c 1``'s GET throughput on ``url``, GB/s (its SETs write the
    value its GETs read: ``-t get`` alone reads a missing key)."""
    where = urlparse(url)
    host, port = where.hostname or "127.0.0.1", str(where.port or 6379)
    run = subprocess.run(["redis-benchmark", "-h", host, "-p", port, "-t", "set,get", "-d", str(size),
                          "-c", "1", "-n", str(requests), "-q"],
                         capture_output=True, text=True, timeout=300, check=True)
    found = re.search(r"GET: ([\d.]+) requests per second", run.stdout.replace("\r", "\n"))
    if found is None:
        raise RuntimeError(f"redis-benchmark said: {run.stdout[-300:]}")
    return float(found.group(1)) * size / 1e9


def measure(url: str, args: argparse.Namespace) -> int:
    config = KVRedisConfig.from_env({}, {"url": url, "namespace": "bench-chunks", "pop_timeout_s": 30})
    buffer = RedisLookupBuffer(config)
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"# {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}, load average "
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
    write, read = median_halves(times)
    return f"({1000 * write:.2f} + {1000 * read:.2f})"


if __name__ == "__main__":
    sys.exit(main())
