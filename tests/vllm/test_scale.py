"""Two prefill and two decode vLLM engines behind the proxy (CPU build, tiny model), all answering correctly.

Runs in the vLLM environment (``scripts/test.sh`` builds it), like ``test_demo.py``: the stack starts its own
``redis-server`` (or uses ``KVREDIS_URL``) and refuses fakeredis. Completions of several prompt lengths go
through the proxy, several at once; each answer must equal the answer of a prefill engine computing alone
(a fresh ``cache_salt``, straight to the engine), each decode must have taken all but the last prompt token
from Redis, and every one of the four engines must have served requests (each engine's own ``/metrics``).
The stack's engines share a prefix cache (its default): after the requests only chunks are left in Redis.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

# "vllm.version", not "vllm": see test_demo.py.
pytest.importorskip("vllm.version")

from engine_servers import TEST_TIMEOUT_ENV

from kvredis.stack.demo import (
    demo_requests,
    fetch_metrics,
    kvredis_metrics,
    parse_samples,
    post_completion,
    purge_namespace,
    stream_completion,
)
from kvredis.stack.supervisor import group_alive
from kvredis.stack.tinymodel import prompt_text
from kvredis.stack.up import RunningStack, StackOptions, open_stack
from kvredis.store.chunk_keys import key_kind

# Four engines start in about two minutes on two cores (each takes 30-40 s alone); the bound leaves room for a
# loaded machine without letting a hang run forever.
STARTUP_BOUND_S = 420.0
REQUESTS = 8
CONCURRENCY = 4
MAX_TOKENS = 8



@pytest.fixture(scope="module")
def scaled_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """The stack with two prefill and two decode engines, in a namespace of its own."""
    if shutil.which("redis-server") is None and not os.environ.get("KVREDIS_URL"):
        pytest.skip("neither redis-server on the PATH nor KVREDIS_URL: the stack would run on fakeredis")
    options = StackOptions(
        redis_url=os.environ.get("KVREDIS_URL") or None,
        namespace=f"kvredis-scale-{uuid.uuid4().hex[:8]}",
        proxy_port=0,
        startup_timeout_s=STARTUP_BOUND_S,
        log_dir=tmp_path_factory.mktemp("scale-logs"),
        prefill_instances=2,
        decode_instances=2,
        policy="round_robin",
    )
    with pytest.MonkeyPatch.context() as patch:
        # The engines inherit the environment (the stack passes only url and namespace to the connector).
        for name, value in TEST_TIMEOUT_ENV.items():
            patch.setenv(name, value)
        with open_stack(options, command="demo", out=sys.stderr) as running:
            yield running
            pids = [child.pid for child in running.supervisor.children]
    # Stopped: every engine's process group (API server, engine core, workers) is gone.
    assert not [pid for pid in pids if group_alive(pid)]


def _vllm_processes(group: int) -> list[tuple[str, int]]:
    """The processes of process group ``group`` that vLLM gave a title (``VLLM::EngineCore``,
    ``VLLM::Worker`` ...): (title, pid), by title."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pgid = os.getpgid(int(entry.name))
            title = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue  # gone since the listing
        if pgid == group and title.startswith("VLLM::"):
            found.append((title, int(entry.name)))
    return sorted(found)


def _busiest_thread_cores(pid: int) -> set[int]:
    """The cores the thread of process ``pid`` that used the most CPU may run on (in an engine core that
    computes, the model's: OpenMP's first thread)."""
    used = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a thread that ended since the listing
        used[int(task.name)] = int(fields[11]) + int(fields[12])
    return set(os.sched_getaffinity(max(used, key=used.__getitem__)))


def _snapshot(running: RunningStack) -> dict[str, dict[str, float]]:
    """Per engine URL: kvredis's samples of the namespace plus vLLM's finished-request count and the
    connector's count of prompt tokens loaded."""
    snapshot = {}
    for url in [*running.prefill_urls, *running.decode_urls]:
        samples = kvredis_metrics(url, running.namespace)
        text = fetch_metrics(url)
        samples["vllm_success"] = sum(parse_samples(text, "vllm:request_success_total", {}).values())
        samples["loaded_tokens"] = sum(parse_samples(text, "vllm:kvredis_loaded_tokens_total", {}).values())
        snapshot[url] = samples
    return snapshot


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _keys(running: RunningStack) -> list[str]:
    from kvredis.config import KVRedisConfig
    from kvredis.store.client import RedisStore
    from kvredis.store.tally import tally_key

    config = KVRedisConfig.from_env(overrides={"url": running.redis_url, "namespace": running.namespace})
    store = RedisStore(config)
    try:
        return [key for key in store.scan(f"{config.namespace}:*") if key != tally_key(config.namespace)]
    finally:
        store.close()


@pytest.mark.vllm
@pytest.mark.timeout(STARTUP_BOUND_S + 240)
def test_two_prefill_two_decode_engines_answer_correctly(scaled_stack: RunningStack) -> None:
    running = scaled_stack
    assert len(running.prefill_urls) == 2 and len(running.decode_urls) == 2
    assert [child.spec.role for child in running.supervisor.children if child.spec.role != "redis"] == [
        "prefill-1", "prefill-2", "decode-1", "decode-2", "proxy",
    ]
    requests = demo_requests(REQUESTS, MAX_TOKENS, seed=7)
    prompts = [prompt_text(list(request.token_ids)) for request in requests]
    lengths = [len(request.token_ids) for request in requests]
    assert len(set(lengths)) == REQUESTS

    before = _snapshot(running)
    began = time.monotonic()

    def through_proxy(prompt: str) -> tuple[str, dict[str, Any]]:
        body = {
            "model": running.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }
        answer, usage, _ = stream_completion(running.proxy_url, body)
        return answer, usage

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(through_proxy, prompts))
    took = time.monotonic() - began
    running.supervisor.check()

    # The stack runs each engine's one worker inside its engine-core process (vLLM's CPU build would
    # otherwise start a worker process, the two polling each other while a request waits for its KV), and
    # there computes on the engine's own cores (vLLM binds OpenMP only in a worker process it starts).
    for child in running.supervisor.children:
        if child.spec.role.startswith(("prefill", "decode")):
            processes = _vllm_processes(child.pid)
            titles = [title for title, _ in processes]
            assert titles and not [title for title in titles if "Worker" in title], (child.spec.role, titles)
            bind = child.spec.env.get("VLLM_CPU_OMP_THREADS_BIND")
            if bind is not None:  # None: one CPU, nothing to keep apart
                cores = {int(core) for core in bind.split(",")}
                engine_core = dict(processes)["VLLM::EngineCore"]
                assert _busiest_thread_cores(engine_core) == cores, (child.spec.role, bind)

    # The prefills count a stored entry when the background write ends, possibly after the decode took it.
    lacked = sum(length - 1 for length in lengths)
    deadline = time.monotonic() + 10.0
    while True:
        after = _snapshot(running)
        stored = sum(_delta(after[url], before[url], "kvredis_entries_stored_total")
                     for url in running.prefill_urls)
        loaded = sum(_delta(after[url], before[url], "loaded_tokens") for url in running.decode_urls)
        if (stored >= REQUESTS and loaded >= lacked) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    report = f"logs in {running.log_dir}\n{before=}\n{after=}"
    for (answer, usage), length in zip(results, lengths, strict=True):
        assert usage.get("prompt_tokens") == length, (usage, report)
        assert answer, (usage, report)
    assert stored == REQUESTS, report
    # The decodes computed only each prompt's last token; the rest came from Redis. (Their usage reports
    # the prefills' prefix-cache hits, as vLLM does for a remote prefill.)
    assert loaded == lacked, report
    # Round robin over two instances of each role: every engine served half of the requests.
    for url in [*running.prefill_urls, *running.decode_urls]:
        assert _delta(after[url], before[url], "vllm_success") == REQUESTS // 2, (url, report)
    for url in running.prefill_urls:
        assert _delta(after[url], before[url], "kvredis_entries_stored_total") == REQUESTS // 2, (url, report)
    for url in running.decode_urls:
        assert _delta(after[url], before[url], "kvredis_entries_loaded_total") == REQUESTS // 2, (url, report)
        misses = sum(_delta(after[url], before[url], name) for name in after[url]
                     if name.startswith("kvredis_misses_total"))
        assert misses == 0, (url, report)
        assert _delta(after[url], before[url], 'kvredis_bytes_total{direction="loaded"}') > 0, (url, report)
    # Every transfer's record was taken by a decode; the chunks stay, held by nobody, for any later request
    # (the stack's engines share a prefix cache in Redis).
    left = _keys(running)
    assert left and {key_kind(key) for key in left} == {"chunks"}, left[:5]

    # References: each prompt computed by a prefill engine alone (a fresh salt: no prefix-cache reuse), the
    # prompts alternating between the two prefill engines.
    for index, (prompt, (answer, _)) in enumerate(zip(prompts, results, strict=True)):
        body = {
            "model": running.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "cache_salt": uuid.uuid4().hex,
        }
        reference = post_completion(running.prefill_urls[index % 2], body)
        details = (reference.get("usage") or {}).get("prompt_tokens_details") or {}
        assert details.get("cached_tokens") == 0, reference
        assert answer == reference["choices"][0]["text"], (index, lengths[index], answer, reference)

    # The references' producers wrote their prompts to Redis too; nothing of the namespace is left after the
    # purge.
    purge_namespace(running)
    assert _keys(running) == []
    print(f"{REQUESTS} requests, {CONCURRENCY} at a time, through 2 prefill + 2 decode engines: {took:.1f} s")
