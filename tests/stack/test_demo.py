"""The demo's parts that need no engine: its requests, its client and the metrics it reads, its table."""

from __future__ import annotations

import http.server
import json
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvredis.errors import StackError
from kvredis.stack.demo import (
    DemoResult,
    demo_requests,
    format_summary,
    format_table,
    kvredis_metrics,
    parse_samples,
    post_completion,
    stream_completion,
)


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
    good = DemoResult(prompt_tokens=12, loaded_tokens=11, kv_bytes=65728, store_s=0.003, load_s=0.004,
                      loaded=1, misses=0, ttft_s=0.1, answer="t5 t6 t7 t8 t9", reference="t5 t6 t7 t8 t9",
                      reference_cached=0)
    recomputed = DemoResult(prompt_tokens=12, loaded_tokens=0, kv_bytes=0, store_s=0.003, load_s=5.0,
                            loaded=0, misses=1, ttft_s=5.2, answer="t5", reference="t6", reference_cached=0)
    assert good.matched and good.from_redis and good.reference_alone
    assert not recomputed.matched and not recomputed.from_redis
    table = format_table([good, recomputed])
    first, second = table.splitlines()[1:3]
    assert first.split() == ["1", "12", "11", "65,728", "3.0", "4.0", "100.0", "yes", "yes", "t5", "t6", "t7",
                             "t8", "..."]
    assert second.split()[7:9] == ["NO", "NO"]


# -- the demo's client, against a stand-in OpenAI server ------------------------------------------

METRICS = textwrap.dedent("""
    # HELP kvredis_entries_loaded_total Entries loaded
    # TYPE kvredis_entries_loaded_total counter
    kvredis_entries_loaded_total{namespace="demo"} 2.0
    # HELP kvredis_load_seconds Load time
    # TYPE kvredis_load_seconds histogram
    kvredis_load_seconds_bucket{le="+Inf",namespace="demo"} 2.0
    kvredis_load_seconds_count{namespace="demo"} 2.0
    kvredis_load_seconds_sum{namespace="demo"} 0.5
""")


class StandIn(http.server.BaseHTTPRequestHandler):
    """Answers completions the way vLLM's OpenAI server does (streamed or not), and ``/metrics``."""

    bodies: ClassVar[list[dict[str, Any]]] = []
    fail = False

    def do_GET(self) -> None:
        self._send(200, "text/plain; version=0.0.4", METRICS.encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if self.fail:
            self._send(500, "application/json", b'{"error": {"message": "engine died"}}')
            return
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                 "prompt_tokens_details": {"cached_tokens": 2}}
        base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": body["model"]}
        if not body.get("stream"):
            answer = {**base, "usage": usage, "kv_transfer_params": {"remote": 1},
                      "choices": [{"index": 0, "text": "t5 t6", "finish_reason": "length", "logprobs": None}]}
            self._send(200, "application/json", json.dumps(answer).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = [{**base, "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}]}
                  for text in ("t5", " t6")]
        events.append({**base, "choices": [], "usage": usage})
        for event in events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, status: int, kind: str, raw: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[str]:
    pytest.importorskip("openai")
    pytest.importorskip("prometheus_client")
    StandIn.bodies = []
    StandIn.fail = False
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_stream_completion_reads_text_usage_and_time_to_first_text(stand_in: str) -> None:
    body = {"model": "m", "prompt": "t4 t5 t6", "max_tokens": 2, "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    text, usage, ttft_s = stream_completion(stand_in, body)
    assert text == "t5 t6"
    assert usage["prompt_tokens"] == 3 and usage["prompt_tokens_details"]["cached_tokens"] == 2
    assert 0 < ttft_s < 10
    # vLLM's own fields (ignore_eos) reach the server at the top level of the request, like OpenAI's.
    (sent,) = StandIn.bodies
    assert sent["stream"] is True and sent["ignore_eos"] is True and sent["max_tokens"] == 2
    assert sent["stream_options"] == {"include_usage": True}


def test_post_completion_returns_the_answer_with_vllms_extra_fields(stand_in: str) -> None:
    answer = post_completion(stand_in, {"model": "m", "prompt": "t4", "max_tokens": 2, "cache_salt": "s"})
    assert answer["choices"][0]["text"] == "t5 t6"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert answer["kv_transfer_params"] == {"remote": 1}
    assert StandIn.bodies[0]["cache_salt"] == "s"


def test_a_failing_server_is_a_stack_error_naming_it_and_nothing_is_retried(stand_in: str) -> None:
    StandIn.fail = True
    answered = r"POST http://127.0.0.1:\d+/v1/completions answered 500.*engine died"
    with pytest.raises(StackError, match=answered):
        post_completion(stand_in, {"model": "m", "prompt": "t4", "max_tokens": 2})
    assert len(StandIn.bodies) == 1


def test_kvredis_metrics_reads_an_engines_metrics(stand_in: str) -> None:
    assert kvredis_metrics(stand_in, "demo") == {
        "kvredis_entries_loaded_total": 2.0,
        'kvredis_load_seconds_bucket{le="+Inf"}': 2.0,
        "kvredis_load_seconds_count": 2.0,
        "kvredis_load_seconds_sum": 0.5,
    }


def test_readme_shows_the_demo_output_as_format_table_and_format_summary_print_it() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("#  prompt tokens", 1)[1].split("```", 1)[0]
    shown = ("#  prompt tokens" + block).rstrip("\n")
    results = []
    for line in shown.splitlines()[1:]:
        if not line:
            break
        cells = line.split()
        prompt, loaded, kv_bytes, store_ms, load_ms, ttft_ms, from_redis, matched = cells[1:9]
        answer = " ".join(cells[9:]).removesuffix(" ...") + (" t1" if cells[-1] == "..." else "")
        results.append(DemoResult(
            prompt_tokens=int(prompt), loaded_tokens=int(loaded), kv_bytes=float(kv_bytes.replace(",", "")),
            store_s=float(store_ms) / 1000, load_s=float(load_ms) / 1000,
            loaded=1.0 if from_redis == "yes" else 0.0, misses=0.0, ttft_s=float(ttft_ms) / 1000,
            answer=answer, reference=answer if matched == "yes" else "", reference_cached=0,
        ))
    assert len(results) == 6
    assert shown == format_table(results) + "\n\n" + format_summary(results)
