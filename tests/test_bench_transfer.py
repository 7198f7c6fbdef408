"""scripts/bench_transfer.py's scheduler-lookup measurement: its summary, its PASS/FAIL lines, and one real
run against Redis (a fresh process asking ``contains`` for prompts that have an entry waiting)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_transfer.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_transfer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_transfer"] = module  # the worker process finds its target by this name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_transfer", None)


def records(*seconds: float, verified: bool = True) -> list[dict[str, Any]]:
    return [{"seconds": s, "verified": verified} for s in seconds]


def test_the_summary_is_median_p90_and_best_of_each_length(bench: Any) -> None:
    summary = bench.summarize_lookups({
        1: records(*(i * 1e-5 for i in range(1, 11))),  # 0.01 .. 0.10 ms
        1000: records(3e-4, 1e-4, 2e-4),
    })
    assert summary[1]["runs"] == 10
    assert summary[1]["median_s"] == pytest.approx(5.5e-5)
    assert summary[1]["p90_s"] == pytest.approx(1e-4)  # the 10th of 10 sorted
    assert summary[1]["best_s"] == pytest.approx(1e-5)
    assert summary[1000]["median_s"] == pytest.approx(2e-4) and summary[1000]["best_s"] == pytest.approx(1e-4)
    assert summary[1]["verified"] and summary[1000]["verified"]


@pytest.mark.parametrize(
    ("seconds", "verified", "passed"),
    [((1e-4, 1.5e-4, 1.9e-4), True, True),
     ((1e-4, 2e-4, 3e-4), True, False),  # a median of exactly the target is not under it
     ((1e-4, 1e-4, 1e-4), False, False)],  # fast, but a wrong answer
    ids=["under", "at-target", "wrong-answer"],
)
def test_each_length_passes_only_under_the_target_and_right(bench: Any, seconds, verified, passed) -> None:
    lines: list[str] = []
    summary = bench.summarize_lookups({1: records(1e-5, 1e-5, 1e-5),
                                       1000: records(*seconds, verified=verified)})
    assert bench.check_lookups(summary, lines.append) is passed
    verdicts = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 2
    assert verdicts[0].startswith("PASS  lookup of a 1-token prompt")
    assert verdicts[1].startswith(("PASS" if passed else "FAIL") + "  lookup of a 1000-token prompt")
    assert ("WRONG ANSWER" in verdicts[1]) is not verified


def test_a_real_run_measures_every_lookup_and_leaves_no_key(bench: Any, real_redis_url: str) -> None:
    prefix = f"kvbench-test-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("fork")  # the script's forkserver needs its own preloads; fork is enough here
    ticks: list[int] = []
    try:
        summary = bench.run_lookups(ctx, real_redis_url, prefix, 5, lengths=(1, 300),
                                    tick=lambda: ticks.append(1))
    finally:
        removed = bench.cleanup(real_redis_url, prefix)
    assert len(ticks) == 5
    assert set(summary) == {1, 300}
    for result in summary.values():
        assert result["runs"] == 5 and result["verified"]
        assert 0 < result["best_s"] <= result["median_s"] <= result["p90_s"] < 5.0
    assert removed == 2  # the entry inserted for each prompt, still waiting: contains never takes one
    client = redis.Redis.from_url(real_redis_url)
    assert list(client.scan_iter(match=f"{prefix}*")) == []
    client.close()


def test_priming_redis_leaves_no_key_and_skips_small_sizes(bench: Any, real_redis_url: str) -> None:
    client = redis.Redis.from_url(real_redis_url)
    tag = f"kvbench-test-{uuid.uuid4().hex[:8]}-prime"
    seen: list[int] = []
    original = bench.MiniResp.command

    def counting(self: Any, *args: bytes) -> bytes:
        if args and args[0] == b"DEL":
            seen.append(len(args) - 1)
        return original(self, *args)

    try:
        bench.MiniResp.command = counting
        bench.prime_redis(real_redis_url, (3 << 20) + 5, tag)  # rounded up to 4 values of 1 MiB
        bench.prime_redis(real_redis_url, 64 << 10, tag)  # below a piece: nothing to prime
    finally:
        bench.MiniResp.command = original
    assert seen == [4]
    assert list(client.scan_iter(match=f"{tag}*")) == []
    client.close()
