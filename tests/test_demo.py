"""The demo's parts that need no engine: its requests, the metrics it reads, its table and verdicts."""

from __future__ import annotations

import textwrap

from kvredis.demo import DemoResult, demo_requests, format_table, parse_samples


def test_parse_samples_keeps_one_namespace_and_sums_duplicates() -> None:
    text = textwrap.dedent("""
        # HELP kvredis_bytes_total Payload bytes moved
        kvredis_bytes_total{direction="loaded",namespace="demo"} 65728.0
        kvredis_bytes_total{direction="stored",namespace="demo"} 10.0
        kvredis_bytes_total{direction="loaded",namespace="other"} 5.0
        kvredis_entries_loaded_total{namespace="demo"} 1.0
        kvredis_entries_loaded_total{namespace="demo"} 2.0
        kvredis_load_seconds_sum{namespace="demo"} 0.25
        vllm:num_requests_running{model_name="m"} 0.0
    """)
    assert parse_samples(text, "kvredis_", {"namespace": "demo"}) == {
        'kvredis_bytes_total{direction="loaded"}': 65728.0,
        'kvredis_bytes_total{direction="stored"}': 10.0,
        "kvredis_entries_loaded_total": 3.0,
        "kvredis_load_seconds_sum": 0.25,
    }


def test_demo_requests_have_the_planned_lengths_and_differ() -> None:
    requests = demo_requests(8, 16)
    assert [len(r.token_ids) for r in requests] == [12, 31, 32, 75, 200, 480, 19, 38]
    assert all(4 <= token < 1024 for r in requests for token in r.token_ids)
    assert len({r.token_ids[:12] for r in requests}) == 8
    assert demo_requests(8, 16) == requests


def test_table_and_verdicts() -> None:
    good = DemoResult(prompt_tokens=12, cached_tokens=11, kv_bytes=65728, store_s=0.003, load_s=0.004,
                      loaded=1, misses=0, ttft_s=0.1, answer="t5 t6 t7 t8 t9", reference="t5 t6 t7 t8 t9",
                      reference_cached=0)
    recomputed = DemoResult(prompt_tokens=12, cached_tokens=0, kv_bytes=0, store_s=0.003, load_s=5.0,
                            loaded=0, misses=1, ttft_s=5.2, answer="t5", reference="t6", reference_cached=0)
    assert good.matched and good.from_redis and good.reference_alone
    assert not recomputed.matched and not recomputed.from_redis
    table = format_table([good, recomputed])
    first, second = table.splitlines()[1:3]
    assert first.split() == ["1", "12", "11", "65,728", "3.0", "4.0", "100.0", "yes", "yes", "t5", "t6", "t7",
                             "t8", "..."]
    assert second.split()[7:9] == ["NO", "NO"]
