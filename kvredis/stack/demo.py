"""``kvredis demo``: the stack, a few completions through its proxy, each checked, a table, stop.

The demo sends completions through the proxy and checks every answer against the prefill engine's own answer
for the same request (computed there alone, without disaggregation), and that every decode took its prompt's
KV cache from Redis. The KV bytes and transfer times it shows are kvredis's own Prometheus counters, read
from each engine's ``/metrics`` (see :mod:`kvredis.stack.up` for why the engines run with
``PROMETHEUS_MULTIPROC_DIR``).
"""

from __future__ import annotations

import contextlib
import random
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvredis.errors import KVRedisError, StackError
from kvredis.stack.supervisor import StopRequested, stop_signals
from kvredis.stack.up import RunningStack, StackOptions, open_stack, vllm_installed


@dataclass(frozen=True)
class DemoRequest:
    """One demo prompt: token IDs (the tiny tokenizer maps ``t<N>`` to N) and how many tokens to generate."""

    token_ids: tuple[int, ...]
    max_tokens: int


@dataclass
class DemoResult:
    """What one request through the proxy did and how its answer compared."""

    prompt_tokens: int
    loaded_tokens: float  # prompt tokens the decode's connector loaded from Redis
    kv_bytes: float
    store_s: float | None
    load_s: float | None
    loaded: float
    misses: float
    ttft_s: float
    answer: str
    reference: str = ""
    reference_cached: int | None = None

    @property
    def matched(self) -> bool:
        """The disaggregated answer equals the one the prefill engine computed alone."""
        return bool(self.answer) and self.answer == self.reference

    @property
    def reference_alone(self) -> bool:
        """The reference answer was computed from scratch (no cached prompt token)."""
        return self.reference_cached == 0

    @property
    def from_redis(self) -> bool:
        """The decode took exactly one transfer from Redis, missed none, and loaded all but the last token."""
        return self.loaded == 1 and self.misses == 0 and self.loaded_tokens == self.prompt_tokens - 1


DEMO_LENGTHS = (12, 31, 32, 75, 200, 480)
"""Prompt lengths: inside one block, one short of a block, exactly one, several, many (block size 32)."""


def demo_requests(count: int, max_tokens: int, seed: int = 0) -> list[DemoRequest]:
    """``count`` prompts of seeded random tokens, of the :data:`DEMO_LENGTHS` (cycled)."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        length = DEMO_LENGTHS[index % len(DEMO_LENGTHS)] + 7 * (index // len(DEMO_LENGTHS))
        # Tokens 4.. are the tiny vocabulary's words (0-3 are special).
        requests.append(DemoRequest(tuple(rng.randrange(4, 1024) for _ in range(length)), max_tokens))
    return requests


def demo(options: StackOptions, count: int = 6, max_tokens: int = 16, out: TextIO | None = None) -> int:
    """Start the stack, run ``count`` completions through the proxy, check and tabulate them, stop."""
    from kvredis.stack.tinymodel import prompt_text

    out = out if out is not None else sys.stderr
    begun = time.monotonic()
    if options.model:
        raise StackError("kvredis demo runs on the tiny local model only (its prompts are the tiny "
                         "tokenizer's words); use kvredis up for another model")
    # Found missing now, not after the engines' long start. vLLM installs both; without vLLM, open_stack says
    # how to install it.
    if options.engine_command or vllm_installed():
        _openai()
        parse_samples("", "kvredis_", {})
    requests = demo_requests(count, max_tokens)
    results: list[DemoResult] = []
    log_dir: Path | None = None
    try:
        with stop_signals(out), open_stack(options, command="demo", out=out) as running:
            log_dir = running.log_dir
            print(running.describe(example=False), file=out, flush=True)
            print(f"stack up after {time.monotonic() - begun:.1f} s; sending {count} requests through the "
                  f"proxy at {running.proxy_url}", file=out, flush=True)
            for request in _progress(requests, "disaggregated", out):
                running.supervisor.check()
                results.append(_run_disaggregated(running, request, prompt_text(list(request.token_ids))))
            for request, result in zip(_progress(requests, "reference", out), results, strict=True):
                running.supervisor.check()
                result.reference, result.reference_cached = _run_reference(
                    running, request, prompt_text(list(request.token_ids)))
            purge_namespace(running)
    except StopRequested as stop:
        print(f"{stop}: demo interrupted, stack stopped", file=out, flush=True)
        return 128 + stop.signum
    print(format_table(results))
    print()
    print(format_summary(results))
    print(f"demo took {time.monotonic() - begun:.1f} s")
    ok = all(result.matched and result.from_redis and result.reference_alone for result in results)
    if not ok:
        print(f"FAILED; the logs are in {log_dir}", file=out)
    return 0 if ok else 1


def _progress(items: Sequence[DemoRequest], what: str, out: TextIO) -> Iterator[DemoRequest]:
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional (kvredis[bench]); vLLM installs it
        for index, item in enumerate(items, 1):
            print(f"{what} {index}/{len(items)}", file=out, flush=True)
            yield item
        return
    yield from tqdm(items, desc=what, unit="req", file=out, leave=True)


def _run_disaggregated(running: RunningStack, request: DemoRequest, prompt: str) -> DemoResult:
    decode_before = _all_kvredis_metrics(running.decode_urls, running.namespace)
    loaded_before = _loaded_tokens(running.decode_urls)
    prefill_before = _all_kvredis_metrics(running.prefill_urls, running.namespace)
    body = {
        "model": running.model, "prompt": prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    answer, usage, ttft_s = stream_completion(running.proxy_url, body)
    decode = _delta(_all_kvredis_metrics(running.decode_urls, running.namespace), decode_before)
    prompt_tokens = int(usage.get("prompt_tokens", -1))
    # The prefill writes to Redis on a background thread and counts when the write ends, which can be
    # after the decode took the transfer; vLLM publishes the decode's connector counts after its step. Wait
    # (bounded) for both. (The decode's usage reports the prefill's prefix-cache hit, as vLLM does for a
    # remote prefill: the connector's count says what came from Redis.)
    deadline = time.monotonic() + 5.0
    while True:
        prefill = _delta(_all_kvredis_metrics(running.prefill_urls, running.namespace), prefill_before)
        loaded = _loaded_tokens(running.decode_urls) - loaded_before
        if ((prefill.get("kvredis_entries_stored_total", 0) >= 1 and loaded >= prompt_tokens - 1)
                or time.monotonic() > deadline):
            break
        time.sleep(0.05)
    return DemoResult(
        prompt_tokens=prompt_tokens,
        loaded_tokens=loaded,
        kv_bytes=decode.get('kvredis_bytes_total{direction="loaded"}', 0.0),
        store_s=prefill.get("kvredis_store_seconds_sum"),
        load_s=decode.get("kvredis_load_seconds_sum"),
        loaded=decode.get("kvredis_entries_loaded_total", 0.0),
        misses=sum(value for name, value in decode.items() if name.startswith("kvredis_misses_total")),
        ttft_s=ttft_s,
        answer=answer,
    )


def _run_reference(running: RunningStack, request: DemoRequest, prompt: str) -> tuple[str, int | None]:
    """The prefill engine's answer computed there alone: no proxy, no transfer, no prefix-cache reuse."""
    body = {
        "model": running.model, "prompt": prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
        "ignore_eos": True,
        # A fresh salt keeps vLLM's prefix cache from reusing the blocks of the disaggregated run: the
        # reference computes every token itself. (The producer still writes the prompt to Redis; the demo
        # purges its namespace at the end.)
        "cache_salt": uuid.uuid4().hex,
    }
    answer = post_completion(running.prefill_url, body)
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return str(answer["choices"][0]["text"]), details.get("cached_tokens")


def purge_namespace(running: RunningStack) -> None:
    """Delete what the demo left in its namespace (the reference requests' entries)."""
    from kvredis.config import KVRedisConfig
    from kvredis.store.client import RedisStore

    config = KVRedisConfig.from_env(overrides={"url": running.redis_url, "namespace": running.namespace})
    store = RedisStore(config)
    try:
        keys = list(store.scan(f"{config.namespace}:*"))
        store.delete(keys)
    except KVRedisError as exc:
        print(f"warning: could not purge namespace {config.namespace!r}: {exc}", file=sys.stderr)
    finally:
        store.close()


_REQUEST_TIMEOUT_S = 120.0
_NOTES_WIDTH = 110  # the table's notes, wrapped as README.md shows them
_METRICS_TIMEOUT_S = 10.0
# Fields of the OpenAI completions API; anything else in a request body is vLLM's own (ignore_eos,
# cache_salt) and travels in extra_body.
_OPENAI_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "stream", "stream_options"})


def _openai() -> Any:
    """The ``openai`` module, or :class:`StackError` saying how to get it."""
    try:
        import openai
    except ImportError as exc:
        raise StackError("kvredis demo needs the openai client, which vLLM installs; elsewhere: "
                         "pip install 'kvredis[demo]'") from exc
    return openai


def _client(base_url: str, timeout_s: float = _REQUEST_TIMEOUT_S) -> Any:
    """An OpenAI client of the server at ``base_url`` (no retries, no proxy from the environment)."""
    openai = _openai()
    return openai.OpenAI(
        base_url=base_url.rstrip("/") + "/v1", api_key="EMPTY", timeout=timeout_s,
        # Nothing in kvredis retries: a retried completion would hide a failure the demo exists to show.
        max_retries=0, http_client=openai.DefaultHttpxClient(trust_env=False),
    )


@contextlib.contextmanager
def _failing_as(what: str) -> Iterator[None]:
    """Turn the openai client's errors into :class:`StackError` naming ``what`` was asked."""
    openai = _openai()
    try:
        yield
    except openai.APIStatusError as exc:
        raise StackError(f"{what} answered {exc.status_code}: {exc.response.text}") from exc
    except openai.OpenAIError as exc:
        raise StackError(f"{what} failed: {exc}") from exc


def _split(body: Mapping[str, Any]) -> dict[str, Any]:
    fields = {key: value for key, value in body.items() if key in _OPENAI_FIELDS}
    extra = {key: value for key, value in body.items() if key not in _OPENAI_FIELDS}
    return {**fields, "extra_body": extra} if extra else fields


def post_completion(base_url: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The answer of a (not streamed) completion ``body`` posted to ``base_url``, as a dict."""
    client = _client(base_url)
    try:
        with _failing_as(f"POST {base_url}/v1/completions"):
            answer = client.completions.create(**_split(body))
    finally:
        client.close()
    return dict(answer.model_dump())


def stream_completion(base_url: str, body: Mapping[str, Any]) -> tuple[str, dict[str, Any], float]:
    """Text, usage and time to the first generated text of a streamed completion."""
    client = _client(base_url)
    text: list[str] = []
    usage: dict[str, Any] = {}
    first: float | None = None
    started = time.perf_counter()
    try:
        with _failing_as(f"streaming from {base_url}"), \
                client.completions.create(**_split({**body, "stream": True})) as stream:
            for chunk in stream:
                for choice in chunk.choices or ():
                    if choice.text:
                        if first is None:
                            first = time.perf_counter() - started
                        text.append(choice.text)
                if chunk.usage is not None:
                    usage = dict(chunk.usage.model_dump())
    finally:
        client.close()
    return "".join(text), usage, first if first is not None else time.perf_counter() - started


def fetch_metrics(base_url: str) -> str:
    """The Prometheus text an engine serves on ``/metrics``."""
    client = _client(base_url, _METRICS_TIMEOUT_S)
    try:
        with _failing_as(f"GET {base_url}/metrics"):
            # An absolute URL: /metrics is outside the client's /v1 base.
            return str(client.get(base_url.rstrip("/") + "/metrics", cast_to=str))
    finally:
        client.close()


def kvredis_metrics(base_url: str, namespace: str) -> dict[str, float]:
    """kvredis's Prometheus samples of ``namespace`` on an engine's ``/metrics``, keyed by name and labels."""
    return parse_samples(fetch_metrics(base_url), "kvredis_", {"namespace": namespace})


def _loaded_tokens(base_urls: Sequence[str]) -> float:
    """The prompt tokens the engines' connectors loaded from Redis (``vllm:kvredis_loaded_tokens_total``)."""
    return sum(value for base_url in base_urls
               for value in parse_samples(fetch_metrics(base_url), "vllm:kvredis_loaded_tokens_total",
                                          {}).values())


def _all_kvredis_metrics(base_urls: Sequence[str], namespace: str) -> dict[str, float]:
    """:func:`kvredis_metrics` summed over several engines (the demo sends one request at a time)."""
    total: dict[str, float] = {}
    for base_url in base_urls:
        for name, value in kvredis_metrics(base_url, namespace).items():
            total[name] = total.get(name, 0.0) + value
    return total


def parse_samples(text: str, prefix: str, match: Mapping[str, str]) -> dict[str, float]:
    """Samples of Prometheus text whose name starts with ``prefix`` and whose labels include ``match``.

    Keys are the name plus the remaining labels, sorted: ``kvredis_bytes_total{direction="loaded"}``;
    samples with the same key (one per process of an engine) are summed.
    """
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as exc:
        raise StackError("reading the engines' metrics needs prometheus-client, which vLLM installs; "
                         "elsewhere: pip install 'kvredis[demo]'") from exc
    samples: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if not sample.name.startswith(prefix) or any(
                        labels.get(key) != wanted for key, wanted in match.items()):
                    continue
                rest = ",".join(f'{key}="{labels[key]}"' for key in sorted(labels) if key not in match)
                key = f"{sample.name}{{{rest}}}" if rest else sample.name
                samples[key] = samples.get(key, 0.0) + float(sample.value)
    except ValueError as exc:
        raise StackError(f"unreadable Prometheus text: {exc}") from exc
    return samples


def _delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _abridged(text: str, words: int = 4) -> str:
    shown = text.split()
    return " ".join(shown[:words]) + (" ..." if len(shown) > words else "")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def format_summary(results: Sequence[DemoResult]) -> str:
    """The demo's verdict lines under its table."""
    matched = sum(result.matched for result in results)
    from_redis = sum(result.from_redis for result in results)
    moved = sum(result.kv_bytes for result in results)
    alone = sum(result.reference_alone for result in results)
    return (
        f"{matched}/{len(results)} answers matched the prefill engine's own answer (computed there alone, no "
        f"disaggregation, temperature 0; {alone}/{len(results)} with no cached prompt token)\n"
        f"{from_redis}/{len(results)} decodes loaded their prompt's KV from Redis ({_size(moved)} in all)"
    )


def format_table(results: Sequence[DemoResult]) -> str:
    """The demo's per-request table."""
    header = ("#", "prompt tokens", "loaded", "KV bytes via Redis", "store ms", "load ms", "TTFT ms",
              "from Redis", "matched", "answer")
    rows = [header]
    for index, result in enumerate(results, 1):
        rows.append((
            str(index), str(result.prompt_tokens),
            f"{result.loaded_tokens:.0f}",
            f"{result.kv_bytes:,.0f}", _ms(result.store_s), _ms(result.load_s), _ms(result.ttft_s),
            "yes" if result.from_redis else "NO", "yes" if result.matched else "NO", _abridged(result.answer),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(row[:-1], widths, strict=False)) + "  " + row[-1]
        for row in rows
    ]
    notes = (
        "KV bytes: payload the decode took from Redis (kvredis_bytes_total); store ms: the prefill's write "
        "(kvredis_store_seconds); load ms: the decode's blocking pop and read, including any wait for the "
        "write (kvredis_load_seconds); TTFT: first generated text seen by the client through the proxy "
        "(prefill + transfer + first decode step); loaded: prompt tokens the decode's connector loaded "
        "from Redis (`vllm:kvredis_loaded_tokens_total`; its usage reports the prefill's prefix-cache hit as "
        "cached tokens, as vLLM does for every remote prefill)."
    )
    return "\n".join([*lines, "", textwrap.fill(notes, _NOTES_WIDTH)])
