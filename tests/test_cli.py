"""The command line: the proxy command, what it says without its extra or without vLLM, the stack options."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from processes import BOUND_S, REPO_ROOT, kvredis, wait_until

from kvredis.stack.supervisor import http_ok
from kvredis.stack.up import free_ports, vllm_installed


def test_kvredis_proxy_serves_and_stops_on_sigterm(reaper: list[subprocess.Popen[str]]) -> None:
    pytest.importorskip("aiohttp")
    (port,) = free_ports(1)
    proxy = kvredis("proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                    "--port", str(port), "--policy", "least_outstanding", "--prefill-timeout", "7")
    reaper.append(proxy)
    wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health") or proxy.poll() is not None)
    assert proxy.poll() is None
    proxy.send_signal(signal.SIGTERM)
    _, err = proxy.communicate(timeout=BOUND_S)
    assert proxy.returncode == 0, err
    assert f"listening on http://127.0.0.1:{port} (policy least_outstanding" in err


def test_kvredis_proxy_rejects_bad_settings() -> None:
    proxy = kvredis("proxy", "--prefill", "localhost:1", "--decode", "http://127.0.0.1:2")
    _, err = proxy.communicate(timeout=BOUND_S)
    assert proxy.returncode == 1
    assert "is not an http:// or https:// base URL" in err


# Makes `import aiohttp` fail, as in an install without the proxy extra.
NO_AIOHTTP = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "aiohttp" or name.startswith("aiohttp."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Block())
    from kvredis.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_without_aiohttp_version_works_and_proxy_says_what_to_install() -> None:
    version = subprocess.run([sys.executable, "-c", NO_AIOHTTP, "--version"], capture_output=True, text=True,
                             cwd=REPO_ROOT, timeout=BOUND_S)
    assert version.returncode == 0 and version.stdout.startswith("kvredis "), version.stderr
    proxy = subprocess.run([sys.executable, "-c", NO_AIOHTTP, "proxy", "--prefill", "http://a:1", "--decode",
                            "http://b:2"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=BOUND_S)
    assert proxy.returncode == 2
    assert "pip install 'kvredis[proxy]'" in proxy.stderr


def test_demo_without_vllm_says_how_to_install_it() -> None:
    if vllm_installed():
        pytest.skip("vLLM is installed here")
    demo = kvredis("demo")
    _, err = demo.communicate(timeout=BOUND_S)
    assert demo.returncode == 1
    assert "vLLM is not installed" in err
    assert "scripts/install_vllm_cpu.sh" in err and "scripts/demo.sh" in err


def test_up_and_demo_take_instance_counts_and_policy() -> None:
    from kvredis.cli import _stack_options, build_parser

    for command in ("up", "demo"):
        args = build_parser().parse_args(
            [command, "--prefill-instances", "2", "--decode-instances", "3", "--policy", "least_outstanding"])
        options = _stack_options(args, args.port)
        assert (options.prefill_instances, options.decode_instances, options.policy) == (
            2, 3, "least_outstanding")
        defaults = _stack_options(build_parser().parse_args([command]), 0)
        assert (defaults.prefill_instances, defaults.decode_instances, defaults.policy) == (
            1, 1, "round_robin")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--prefill-instances", "0"])


def test_demo_without_the_openai_client_says_so_before_starting_anything(tmp_path: Path) -> None:
    blocked = NO_AIOHTTP.replace('"aiohttp"', '"openai"').replace('"aiohttp."', '"openai."')
    demo = subprocess.run(
        [sys.executable, "-c", blocked, "demo", "--engine-command", "no-such-engine", "--log-dir",
         str(tmp_path / "logs")], capture_output=True, text=True, cwd=REPO_ROOT, timeout=BOUND_S)
    assert demo.returncode == 1
    assert "kvredis demo needs the openai client" in demo.stderr and "kvredis[demo]" in demo.stderr
    assert not (tmp_path / "logs").exists()


def test_kvredis_stats_counts_chunks_records_and_holders_with_their_ttls(real_redis_url: str) -> None:
    """``kvredis stats`` on a namespace holding one transfer in flight: its chunks (bytes, TTL spread), its
    record and its chunks' holders' sets, as JSON an operator's script can read."""
    import json
    import uuid

    import torch

    from kvredis.config import KVRedisConfig
    from kvredis.store.chunk_store import PageFormat
    from kvredis.store.client import RedisStore
    from kvredis.store.keys import new_entry_id
    from kvredis.store.transfer import Transfers

    namespace = "t-stats-" + uuid.uuid4().hex[:8]
    config = KVRedisConfig.from_env({}, {"url": real_redis_url, "namespace": namespace})
    store = RedisStore(config)
    try:
        transfers = Transfers(store, f"{namespace}:abc", chunk_tokens=16, block_size=16, ttl_ms=600_000,
                              pop_timeout_s=1, max_chunk_bytes=1 << 20)
        plan = transfers.plan(list(range(40)))  # three chunks, the last short
        pages = torch.zeros(PageFormat(torch.float32, 2, (2, 16, 8)).shape(3))
        transfers.save(plan, pages, transfer_id=new_entry_id())
        shown = kvredis("stats", "--json",
                        env={"KVREDIS_URL": real_redis_url, "KVREDIS_NAMESPACE": namespace})
        out, err = shown.communicate(timeout=BOUND_S)
        assert shown.returncode == 0, err
        stats = json.loads(out)
        assert (stats["keys"], stats["chunks"], stats["holders"], stats["transfers"]) == (7, 3, 3, 1)
        assert [stats[name] for name in ("prompts", "entries", "pieces", "keys_without_ttl")] == [0] * 4
        assert stats["chunk_bytes"] >= pages.numel() * 4
        spread = [stats[f"chunk_ttl_{name}_s"] for name in ("min", "median", "max")]
        assert 400 < spread[0] <= spread[1] <= spread[2] <= 600, spread
        assert (stats["lookup_tokens"], stats["found_tokens"], stats["hit_rate"]) == (0, 0, None)
    finally:
        store.delete(list(store.scan(f"{namespace}:*")))
        store.close()


def test_kvredis_stats_shows_the_hit_rate_of_every_engine_of_the_namespace(real_redis_url: str,
                                                                           capsys: pytest.CaptureFixture[str]
                                                                           ) -> None:
    """Two engines' tallies (what their schedulers looked up and found) add up in Redis; ``kvredis stats``
    shows them and their ratio, and does not count the tally among the stored keys."""
    import json
    import uuid

    from kvredis.cli import main
    from kvredis.config import KVRedisConfig
    from kvredis.store.client import RedisStore
    from kvredis.store.generation import reset_namespace
    from kvredis.store.tally import Tally

    namespace = "t-stats-" + uuid.uuid4().hex[:8]
    store = RedisStore(KVRedisConfig.from_env({}, {"url": real_redis_url, "namespace": namespace}))
    try:
        first, second = Tally(store, namespace), Tally(store, namespace)
        first.add(lookup_tokens=300, found_tokens=0)
        first.add(lookup_tokens=500, found_tokens=448)
        second.add(lookup_tokens=200, found_tokens=152)
        first.flush()
        second.flush()
        shown = kvredis("stats", "--json",
                        env={"KVREDIS_URL": real_redis_url, "KVREDIS_NAMESPACE": namespace})
        out, err = shown.communicate(timeout=BOUND_S)
        assert shown.returncode == 0, err
        stats = json.loads(out)
        assert (stats["lookup_tokens"], stats["found_tokens"], stats["hit_rate"]) == (1000, 600, 0.6)
        assert (stats["keys"], stats["pieces"], stats["keys_without_ttl"]) == (0, 0, 0)
        assert stats["cache_generation"] == 0
        reset_namespace(store, namespace)  # the generation's key is not counted among the stored keys
        assert main(["stats", "--json", "--url", real_redis_url, "--namespace", namespace]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert (stats["keys"], stats["keys_without_ttl"], stats["cache_generation"]) == (0, 0, 1)
    finally:
        store.delete(list(store.scan(f"{namespace}:*")))
        store.close()
