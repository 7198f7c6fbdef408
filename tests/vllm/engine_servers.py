"""Real vLLM engines as separate processes (``vllm.entrypoints.openai.api_server``), for the engine tests.

Each engine runs in its own session, so stopping it reaches its engine core and worker processes, and
imports the kvredis of this checkout. Requests ask for greedy decoding and the generated token IDs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from conftest import BLOCK_SIZE
from redis_servers import RedisServer, free_port, wait_until

from kvredis.stack.tinymodel import prompt_text
from kvredis.stack.up import engine_cpu_binds, one_process_engine_env
from kvredis.store.announcement import TRANSFER_PARAM
from kvredis.store.tally import tally_key
from kvredis.store.transfer import record_digests

REPO = Path(__file__).resolve().parents[2]
REQUEST_TIMEOUT_S = 300.0
DECODE_TOKENS = 8
# The connector's Redis bounds for engines under test. This VM has been seen to stop for 1-46 s at a time,
# mostly while engines first touch their KV memory (no process ran, no CPU time was counted, Redis answered
# nothing); any socket or pop bound running then expires, and a decode recomputes what it should have
# loaded. The defaults (pop 5 s, socket 10 s) are right for a deployment; tests that check every load
# succeeds need bounds longer than such a freeze. A missing or unusable entry still ends a load at once,
# so passing tests never wait for these bounds.
TEST_TIMEOUTS = {"pop_timeout_s": 120.0, "socket_timeout_s": 120.0}
TEST_TIMEOUT_ENV = {"KVREDIS_POP_TIMEOUT_S": "120", "KVREDIS_SOCKET_TIMEOUT_S": "120"}

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
"""Turns join with a space: the word-level tokenizer reads each turn's words, so a second turn's prompt
starts with the first turn's tokens (what lets prefix caching and Redis help a multi-turn chat)."""


@dataclass
class Server:
    """One ``vllm.entrypoints.openai.api_server`` process; its output goes to ``log``."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def warnings(self, lines: int = 20) -> str:
        """The engine's last warnings and errors (kvredis's say why a load did not happen), for a failure's
        message."""
        said = [line for line in self.log_text().splitlines() if " WARNING " in line or " ERROR " in line]
        return "\n".join(said[-lines:])

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} engine exited ({self.process.returncode}):\n{self.log_tail()}")
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def complete(self, prompt: list[int], max_tokens: int = DECODE_TOKENS,
                 params: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """A greedy completion; ``params`` are its ``kv_transfer_params``, ``fields`` more body fields."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt_text(prompt), "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **fields}
        if params is not None:
            body["kv_transfer_params"] = params
        reply = requests.post(f"{self.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        assert reply.status_code == 200, f"{self.name}: {reply.status_code} {reply.text[:500]}"
        answer = reply.json()
        assert answer["usage"]["prompt_tokens"] == len(prompt)
        return answer

    def counters(self) -> dict[str, float]:
        """The ``vllm:kvredis_*_total`` counters of ``/metrics``, summed over label sets."""
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        totals: dict[str, float] = {}
        for match in re.finditer(r"^vllm:kvredis_(\w+)_total\{[^}]*\} (\S+)$", text, re.MULTILINE):
            totals[match[1]] = totals.get(match[1], 0.0) + float(match[2])
        return totals

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # its own session: the engine core and worker too
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def checkout_env() -> dict[str, str]:
    """The environment of a process the tests start: this checkout first on ``PYTHONPATH``, so that it
    imports the kvredis under test whatever the environment has installed (an editable install of
    another checkout, say)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def start_server(name: str, model: Path, folder: Path, kv_config: dict[str, Any] | None,
                 worker_process: bool = False, tensor_parallel: int = 1, *, serve: bool = False,
                 block_size: int = BLOCK_SIZE, max_model_len: int = 2048,
                 extra_args: Sequence[str] = (), dtype: str = "float32",
                 env: dict[str, str] | None = None) -> Server:
    """Start an engine. It runs its one worker inside the engine core process, as ``kvredis up`` runs CPU
    engines (:func:`kvredis.stack.up.one_process_engine_env`: its OpenMP threads bound to its cores) and as
    vLLM runs a GPU engine without tensor parallelism; ``worker_process`` keeps vLLM's CPU default instead,
    a worker process beside the engine core (``--distributed-executor-backend uni`` does not give one
    process on a CPU: vLLM turns it into ``mp`` unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    ``tensor_parallel`` > 1 shards the model over that many worker processes. ``serve`` starts it as
    operators do, with ``vllm serve`` (run as ``python -m vllm.entrypoints.cli.main``, the same program as
    the ``vllm`` console script); ``extra_args`` go on its command line, ``env`` in its environment."""
    port = free_port()
    log = folder / f"{name}.log"
    env = {**checkout_env(), **(env or {})}
    if serve:
        args = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model)]
    else:
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    args += ["--port", str(port), "--host", "127.0.0.1", "--dtype", dtype, "--enforce-eager",
             "--max-model-len", str(max_model_len), "--block-size", str(block_size), "--seed", "0",
             "--enable-prompt-tokens-details", *extra_args]
    if kv_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_config)]
    if tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel)]
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(kv_config, tensor_parallel))
    if not worker_process and tensor_parallel == 1:
        env = {**one_process_engine_env(env["VLLM_CPU_OMP_THREADS_BIND"]), **env}
    with open(log, "wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env, cwd=REPO)
    return Server(name, process, port, log, str(model))


class NamespaceKeys:
    """The keys of a test's Redis namespace (for a dataclass with ``redis`` and ``namespace`` fields)."""

    redis: RedisServer
    namespace: str

    def stored_keys(self) -> list[bytes]:
        """Every key of the namespace but its tally (the schedulers' lookup counts, not KV)."""
        client = self.redis.client()
        try:
            return sorted(key for key in client.scan_iter(match=f"{self.namespace}:*", count=1000)
                          if key != tally_key(self.namespace).encode())
        finally:
            client.close()

    def assert_no_keys(self, timeout_s: float = 30.0) -> None:
        """No key is left (unused announced entries are deleted in the background: wait, briefly)."""
        deadline = time.monotonic() + timeout_s
        while self.stored_keys():
            assert time.monotonic() < deadline, f"keys left in Redis: {self.stored_keys()}"
            time.sleep(0.05)

    def delete_keys(self) -> None:
        """Delete every key of the namespace (a failed test's, so that it does not fail the next ones)."""
        if self.redis.process is None or self.redis.process.poll() is not None:
            return  # a test stopped the server; the next one starts it again, empty
        client = self.redis.client()
        try:
            leftover = [*self.stored_keys(), tally_key(self.namespace).encode()]
            if leftover:
                client.delete(*leftover)
        finally:
            client.close()


@dataclass
class Disaggregated(NamespaceKeys):
    """A prefill (kv_producer) and a decode (kv_consumer) engine sharing a Redis namespace."""

    prefill: Server
    decode: Server
    redis: RedisServer
    namespace: str

    def transfer_records(self, count: int = 1, timeout_s: float = 10.0) -> list[str]:
        """The lists holding a transfer's record, once there are ``count`` (the prefill writes after
        answering, and pushes the record last)."""
        return self._wait_for_keys(f"{self.namespace}:*:t:*", count, timeout_s, lambda c, k: bool(c.llen(k)))

    def transfer_chunks(self, record_key: str) -> list[str]:
        """The chunk keys a transfer's record names (the record is ``<prefix>:t:{<id>}``, a chunk
        ``<prefix>:c:{<digest>}``)."""
        prefix, braced = record_key.rsplit(":t:", 1)
        client = self.redis.client()
        try:
            record = client.lindex(record_key, 0)
        finally:
            client.close()
        digests = record_digests(record, braced.strip("{}"), prefix)  # checked: this space, this id
        return [f"{prefix}:c:{{{digest}}}" for digest in digests]

    def stored_chunks(self, count: int = 1, timeout_s: float = 10.0) -> list[str]:
        """The keys of stored chunks (not their holders' sets), once there are ``count``."""
        return self._wait_for_keys(f"{self.namespace}:*:c:*", count, timeout_s,
                                   lambda c, k: not k.endswith(b":h"))

    def _wait_for_keys(self, pattern: str, count: int, timeout_s: float, keep: Any) -> list[str]:
        client = self.redis.client()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                keys = sorted(key.decode() for key in client.scan_iter(match=pattern) if keep(client, key))
                if len(keys) >= count:
                    return keys
                assert time.monotonic() < deadline, f"the prefill engine stored {keys}, not {count}"
                time.sleep(0.01)
        finally:
            client.close()

    def prefill_params(self, prompt: list[int]) -> dict[str, Any]:
        """Prefill as the proxy does; the kv_transfer_params of the answer."""
        answer = self.prefill.complete(prompt, max_tokens=1,
                                       params={"do_remote_decode": True, "do_remote_prefill": False})
        params = answer.get("kv_transfer_params")
        assert isinstance(params, dict) and TRANSFER_PARAM in params, answer
        return params


@dataclass
class Proxy:
    """A ``kvredis proxy`` process in front of one prefill and one decode engine."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"kvredis proxy exited ({self.process.returncode}):\n{self.log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_proxy(folder: Path, name: str, prefill_url: str, decode_url: str, redis_url: str) -> Proxy:
    """``kvredis proxy`` as an operator starts it (the environment's console script), given the Redis so
    that it deletes the entries of decodes that fail."""
    port = free_port()
    log = folder / f"{name}.log"
    command = [str(Path(sys.executable).with_name("kvredis")), "proxy", "--prefill", prefill_url,
               "--decode", decode_url, "--port", str(port), "--redis-url", redis_url]
    with open(log, "wb") as out:
        # The engines' long bounds (this VM stalls): a delete waits as long for an entry being written.
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                   env={**checkout_env(), **TEST_TIMEOUT_ENV})
    proxy = Proxy(process, port, log)
    wait_until(proxy.ready, 60, "kvredis proxy listening")
    return proxy


def start_redis() -> RedisServer:
    """A ``redis-server`` of the test's own (so that a test can stop it); fails the test without one."""
    try:
        server = RedisServer()
    except RuntimeError as exc:
        pytest.fail(f"the engine tests need redis-server on the PATH: {exc}")
    return server.start()


def kv_transfer_config(role: str, redis_url: str, namespace: str, **extra: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a KVRedisConnector engine under test (``TEST_TIMEOUTS``); ``extra``
    are more of kvredis's settings (``store_all_prompts=True``)."""
    return {"kv_connector": "KVRedisConnector", "kv_connector_module_path": "kvredis.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": redis_url, "namespace": namespace, **TEST_TIMEOUTS, **extra}}


def cpu_bind(kv_config: dict[str, Any] | None, tensor_parallel: int = 1) -> str:
    """The engine's ``VLLM_CPU_OMP_THREADS_BIND``: a prefill's and a decode's cores apart, as ``kvredis up``
    places them (:func:`kvredis.stack.up.engine_cpu_binds`); ``nobind`` (no pinning) for an engine without the
    connector, and for tensor-parallel ranks, more than this machine's cores can keep apart.

    vLLM's default pins every engine's worker to the same core, where a decode waiting for its KV kept the
    prefill from ever writing it (the whole pop bound, each time it was tried)."""
    role = (kv_config or {}).get("kv_role")
    binds = engine_cpu_binds(1, 1)
    if tensor_parallel > 1 or binds is None or role not in ("kv_producer", "kv_consumer"):
        return "nobind"
    return binds[0] if role == "kv_producer" else binds[1]


def wait_ready(servers: list[Server], timeout_s: float) -> None:
    """Wait until every server answers its health check; raise with the laggards' logs after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        waiting = [server for server in waiting if not server.ready()]
        if waiting and time.monotonic() > deadline:
            raise RuntimeError("engines not ready in time:\n"
                               + "\n".join(f"{s.name}:\n{s.log_tail()}" for s in waiting))
        time.sleep(0.5)


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 1024, (length,), generator=generator).tolist()


def tokens_of(answer: dict[str, Any]) -> list[int]:
    """The generated token IDs (the text drops special tokens such as EOS)."""
    return list(answer["choices"][0]["token_ids"])


def openai_client(url: str) -> Any:
    """The ``openai`` client of the engine or proxy at ``url``, as an operator's application makes it."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def completion_tokens(client: Any, model: str, prompt: list[int], max_tokens: int = DECODE_TOKENS, *,
                      stream: bool = False, **extra: Any) -> list[int]:
    """A greedy completion's generated token IDs (``ignore_eos``), through the ``openai`` client."""
    created = client.completions.create(
        model=model, prompt=prompt_text(prompt), max_tokens=max_tokens, temperature=0.0, stream=stream,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    if stream:
        return [token for chunk in created for choice in chunk.choices
                for token in (choice.model_extra or {}).get("token_ids") or []]
    return list(created.choices[0].model_extra["token_ids"])


def cached_tokens(answer: dict[str, Any]) -> int:
    """The prompt tokens vLLM reports cached. A decode given a prefill's kv_transfer_params
    (``do_remote_prefill``) reports the prefill's own prefix-cache hit, not what it loaded: read
    :func:`loaded_tokens` for that."""
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {name: int(after.get(name, 0) - before.get(name, 0))
            for name in set(before) | set(after) if after.get(name, 0) != before.get(name, 0)}


def loaded_tokens(server: Server, before: dict[str, float], expected: int) -> int:
    """Prompt tokens ``server``'s connector loaded from Redis since ``before``, once ``expected`` of them
    show (or the stats bound passed)."""
    return wait_counters(server, before, {"loaded_tokens": expected}).get("loaded_tokens", 0)


def wait_counters(server: Server, before: dict[str, float], expected: dict[str, int],
                  timeout_s: float = 10.0, *, nudge: bool = False) -> dict[str, int]:
    """The counters' change once it reaches ``expected`` (vLLM publishes stats after each step), or
    whatever it is when ``timeout_s`` passed. ``nudge``: send a one-token request (nothing to look up or
    store) each time round; a save ends on a writer thread after the engine's last step and is reported at
    its next one, which an idle engine never takes."""
    deadline = time.monotonic() + timeout_s
    while True:
        delta = counter_delta(before, server.counters())
        if all(delta.get(name, 0) >= value for name, value in expected.items()):
            return delta
        if time.monotonic() > deadline:
            return delta
        if nudge:
            server.complete([7], max_tokens=1)
        time.sleep(0.05 if nudge else 0.1)


def write_lora_adapter(folder: Path, model: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT LoRA adapter for the tiny model whose weights change every layer's K and V projections
    (so an entry written under it holds other KV than the base model's or another adapter's)."""
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden, kv_width = config["hidden_size"], config["num_key_value_heads"] * config["head_dim"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.3
            tensors[f"{name}.lora_B.weight"] = torch.randn(kv_width, rank, generator=generator) * 0.3
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model), "r": rank,
        "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": ["k_proj", "v_proj"], "inference_mode": True,
    }))
    return folder
