"""scripts/bench_small.py against a real Redis: every path runs, the pre-encoded wire replies are counted
exactly (a miscount fails instead of skewing the figures), and nothing is left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import redis

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_small.py"


def test_every_path_runs_and_nothing_is_left(real_redis_url: str) -> None:
    client = redis.Redis.from_url(real_redis_url)
    before = set(client.keys("bench-small-*"))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--calls", "20", "--repeat", "2", "--size", str(16 << 10)],
        env={**os.environ, "KVREDIS_URL": real_redis_url}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("16384 bytes, median ms per round trip (2 x 20")
    for path in ("wire kvredis", "wire SET+GET", "redis-py", "kvredis"):
        assert re.search(rf"^  {re.escape(path)} +\d+\.\d{{3}} ms$", done.stdout, re.MULTILINE), done.stdout
    assert any("Python per round trip: kvredis" in line for line in lines)
    assert set(client.keys("bench-small-*")) == before
    client.close()
