#!/usr/bin/env python
"""A CPU engine given several cores, in its two process layouts: is one process per engine (what
``kvredis up`` starts) as fast as vLLM's CPU default, and do its OpenMP threads all compute?

vLLM's CPU build gives an engine without tensor parallelism a worker process beside its engine core unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and applies ``VLLM_CPU_OMP_THREADS_BIND`` only to that worker process
(its source says OpenMP needs it); in one process the stack binds the OpenMP threads itself
(``kvredis.stack.up.one_process_engine_env``). This starts one ``vllm serve`` of a Llama written here (the
shape ``bench_hit.py`` uses), no connector, bound to ``--bind`` (default: every core of this machine; a
core list, or ``nobind``), in each layout in turn
for ``--rounds`` rounds, and sends ``--requests`` prompts of ``--tokens`` random tokens one after the other
(4 tokens generated each, temperature 0, prefix caching off). Printed for each start: the time of each
request and their median, the threads of the engine's processes that used at least 0.1 s of CPU in a
request (their names, the cores they may run on, CPU seconds), and whether both layouts answered alike.

    python scripts/bench_engine_layout.py                  # every core, 2 rounds
    python scripts/bench_engine_layout.py --bind 0-3 --tokens 4000

Needs vLLM's CPU build (scripts/install_vllm_cpu.sh).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the kvredis of this checkout, whatever the environment has installed

from kvredis.stack.supervisor import http_ok  # noqa: E402
from kvredis.stack.tinymodel import VOCAB, write_tiny_llama  # noqa: E402
from kvredis.stack.up import free_ports, one_process_engine_env  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
LAYOUTS = {"one process": "0", "worker process": "1"}


def thread_cpu(group: int) -> dict[tuple[int, int, str], int]:
    """CPU ticks of every thread of the processes in process group ``group``, keyed by process, thread,
    name and the cores it may run on."""
    ticks: dict[tuple[int, int, str], int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getpgid(pid) != group:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                    name = comm.read().strip()
                cores = ",".join(map(str, sorted(os.sched_getaffinity(int(tid)))))
                ticks[(pid, int(tid), f"{name} on {cores}")] = int(fields[11]) + int(fields[12])
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue  # a process or thread that ended meanwhile
    return ticks


def run(model: Path, layout: str, args: argparse.Namespace,
        folder: Path) -> tuple[list[float], list[Any], list[str]]:
    """Start the engine in ``layout``; each measured request's time, its busy threads, every answer."""
    port = free_ports(1)[0]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=args.bind, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    if layout == "one process":  # as kvredis up starts it, OpenMP's placement included
        env.update(one_process_engine_env(args.bind) or {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    log = folder / f"engine-{LAYOUTS[layout]}.log"
    with open(log, "wb") as out:
        engine = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(port),
             "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len",
             str(args.tokens + 64), "--block-size", "32", "--seed", "0", "--no-enable-prefix-caching"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not http_ok(f"{url}/health"):
            if engine.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        rng = random.Random(1)
        times: list[float] = []
        busy: list[Any] = []
        answers: list[str] = []
        for number in range(args.requests + 1):  # the first warms up
            prompt = [rng.randrange(10, VOCAB) for _ in range(args.tokens)]
            before = thread_cpu(engine.pid)
            started = time.perf_counter()
            reply = requests.post(f"{url}/v1/completions", timeout=600, json={
                "model": str(model), "prompt": prompt, "max_tokens": 4, "temperature": 0}).json()
            took = time.perf_counter() - started
            after = thread_cpu(engine.pid)
            answers.append(reply["choices"][0]["text"])
            if number:
                times.append(took)
                used = [(name, (ticks - before.get((pid, tid, name), 0)) / TICKS)
                        for (pid, tid, name), ticks in after.items()]
                busy.append(sorted((u for u in used if u[1] >= 0.1), key=lambda u: -u[1]))
        return times, busy, answers
    finally:
        os.killpg(engine.pid, signal.SIGTERM)
        engine.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = os.cpu_count() or 1
    parser.add_argument("--bind", default=f"0-{cores - 1}" if cores > 1 else "0",
                        help="VLLM_CPU_OMP_THREADS_BIND of the engine (default: every core)")
    parser.add_argument("--tokens", type=int, default=2400)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"# {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}, {os.cpu_count()} CPUs, "
          f"VLLM_CPU_OMP_THREADS_BIND={args.bind}, prompts of {args.tokens} tokens")
    seen: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="kvredis-layout-") as work:
        folder = Path(work)
        model = write_tiny_llama(folder / "llama", layers=8, hidden=512, heads=8, kv_heads=4, head_dim=64,
                                 intermediate=1536, max_positions=args.tokens + 64)
        for round_number in range(args.rounds):
            order = list(LAYOUTS) if round_number % 2 == 0 else list(reversed(LAYOUTS))
            for layout in order:
                times, busy, answers = run(model, layout, args, folder)
                seen.setdefault(layout, answers)
                print(f"{layout}: requests {', '.join(f'{t:.2f}' for t in times)} s, "
                      f"median {statistics.median(times):.2f} s")
                print("  threads that computed, last request: "
                      + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in busy[-1]))
    same = len({tuple(answers) for answers in seen.values()}) == 1
    print(f"answers alike in both layouts: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
