"""Disaggregated-prefill proxy: one OpenAI-compatible endpoint in front of prefill and decode vLLM instances.

Every completion request is first sent to a prefill instance as a one-token, non-streaming request marked
``do_remote_decode``; the ``kv_transfer_params`` in its answer tell the decode instance where the prompt's KV
cache was put. The original request then goes to a decode instance with those parameters, and the decode
answer is relayed to the client, streamed chunk by chunk when the client asked for a stream.

No request is ever retried: once an upstream may have received it, sending it again elsewhere could run it
twice, so a failure is reported to the client (502 for a refused or broken connection, 504 for a timeout,
the upstream's own status for an error answer) and the request ends there.

With a Redis to reach (``redis_config``), a request whose decode never took the entry its prefill announced
(the decode refused the connection, answered an error, or gave no first bytes in time) has that entry
deleted at once; without one, such an entry stays until its TTL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import hdrs, web

from kvredis.config import KVRedisConfig
from kvredis.errors import ConfigError
from kvredis.store.announcement import MalformedAnnouncement, read_announcement
from kvredis.store.client import RedisStore
from kvredis.store.transfer import discard_transfer

logger = logging.getLogger("kvredis.proxy")
_UPSTREAM_KEEPALIVE_S = 2.0
"""How long the proxy keeps an idle upstream connection: well under vLLM's own keep-alive (5 s)."""

POLICIES: tuple[str, ...] = ("round_robin", "least_outstanding")

# aiohttp's default request limit of 1 MiB would reject long prompts and inline images with a 413.
_MAX_REQUEST_BYTES = 64 * 1024 * 1024
# How long a shutdown waits for in-flight streams before cutting them; aiohttp's 60 s makes Ctrl-C feel hung.
_SHUTDOWN_GRACE_S = 10.0


@dataclass(frozen=True)
class ProxyConfig:
    """Upstream instances, selection policy and timeouts (seconds) of a disaggregation proxy."""

    prefill_urls: Sequence[str]
    decode_urls: Sequence[str]
    policy: str = "round_robin"
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    decode_ttfb_timeout_s: float = 300.0
    redis_config: KVRedisConfig | None = None
    """Where the prefills write their entries: the proxy deletes those their decode never took."""

    def __post_init__(self) -> None:
        """Normalise the URL lists to tuples without trailing slashes and reject unusable settings."""
        for role in ("prefill", "decode"):
            field = f"{role}_urls"
            raw = getattr(self, field)
            if isinstance(raw, str):
                raise ConfigError(f"{field} must be a list of URLs, not the string {raw!r}")
            urls = tuple(url.rstrip("/") for url in raw)
            if not urls:
                raise ConfigError(f"{field} is empty; the proxy needs at least one {role} instance")
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ConfigError(f"{field} entry {url!r} is not an http:// or https:// base URL")
            if len(set(urls)) != len(urls):
                raise ConfigError(f"{field} lists an instance more than once: {list(urls)}")
            object.__setattr__(self, field, urls)
        if self.policy not in POLICIES:
            raise ConfigError(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        for field in ("connect_timeout_s", "prefill_timeout_s", "decode_ttfb_timeout_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ConfigError(f"{field} must be a positive number of seconds, got {value!r}")


class _UpstreamFailure(Exception):
    """An upstream gave no answer that can be relayed; carries the error response the client gets instead."""

    def __init__(self, status: int, role: str, url: str, reason: str) -> None:
        super().__init__(f"{role} upstream {url} failed: {reason}")
        self.status = status
        self.url = url

    def as_error(self) -> dict[str, Any]:
        """The OpenAI-style error object describing this failure."""
        return {"error": {"message": str(self), "type": "upstream_error", "upstream": self.url}}


class _UpstreamPool:
    """The instances serving one role, with the in-flight counts the selection policy reads."""

    def __init__(self, urls: Sequence[str], policy: str) -> None:
        self.urls = tuple(urls)
        self._least_outstanding = policy == "least_outstanding"
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._cursor = 0

    @contextmanager
    def acquire(self) -> Iterator[str]:
        """Choose an instance and count one request in flight on it until the block exits."""
        # Candidates in round-robin order starting at the cursor: min() keeps the first of equal counts,
        # which makes ties under least_outstanding fall back to round robin.
        count = len(self.urls)
        candidates = [(self._cursor + offset) % count for offset in range(count)]
        if self._least_outstanding:
            chosen = min(candidates, key=lambda index: self._in_flight[self.urls[index]])
        else:
            chosen = candidates[0]
        self._cursor = (chosen + 1) % count
        url = self.urls[chosen]
        self._in_flight[url] += 1
        try:
            yield url
        finally:
            self._in_flight[url] -= 1

    def describe(self) -> list[dict[str, Any]]:
        """Each instance with its current in-flight count, for the health endpoint."""
        return [{"url": url, "in_flight": self._in_flight[url]} for url in self.urls]


def _prefill_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request a prefill instance gets: one token, no stream, told that a decoder will pick up its KV."""
    prefill = dict(body)
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    # vLLM rejects min_tokens > max_tokens, so a client's min_tokens would fail the one-token prefill.
    prefill.pop("min_tokens", None)
    prefill["stream"] = False
    prefill.pop("stream_options", None)
    client_params = body.get("kv_transfer_params")
    prefill["kv_transfer_params"] = {
        **(client_params if isinstance(client_params, dict) else {}),
        "do_remote_decode": True,
        "do_remote_prefill": False,
    }
    return prefill


def _upstream_headers(request: web.Request, request_id: str) -> dict[str, str]:
    """Headers sent upstream: the shared request id and the client's credentials; the rest is per hop."""
    # The same X-Request-Id on both legs lets vLLM's logs of the prefill and decode halves be joined.
    headers = {"X-Request-Id": request_id}
    authorization = request.headers.get(hdrs.AUTHORIZATION)
    if authorization is not None:
        headers[hdrs.AUTHORIZATION] = authorization
    return headers


def _describe(exc: BaseException) -> str:
    """A failure reason for a message; many aiohttp errors have an empty str()."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextmanager
def _upstream_errors(role: str, url: str, answer_timeout_s: float) -> Iterator[None]:
    """Turn transport failures while talking to ``url`` into the 502 or 504 the client is given."""
    try:
        yield
    # Timeout errors before ClientError/OSError, which aiohttp's timeout errors also derive from. A
    # ServerTimeoutError says which socket step timed out (connect or read); a bare one is our bound.
    except aiohttp.ServerTimeoutError as exc:
        raise _UpstreamFailure(504, role, url, f"timed out: {exc}") from exc
    except TimeoutError as exc:
        raise _UpstreamFailure(504, role, url, f"no answer within {answer_timeout_s:g}s") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise _UpstreamFailure(502, role, url, _describe(exc)) from exc


class _UnusedEntries:
    """Releases announced transfers whose decode never got the request, on threads of its own."""

    def __init__(self, config: KVRedisConfig | None) -> None:
        self._config = config
        self._store: RedisStore | None = None
        self._pool: ThreadPoolExecutor | None = None

    def open(self) -> None:
        """Connect to the Redis, if the proxy was given one."""
        if self._config is None:
            logger.info("no Redis given (--redis-url or KVREDIS_URL): an entry whose decode fails is left "
                        "to its TTL")
            return
        self._store = RedisStore(self._config)
        # Threads of their own: a delete waits up to the pop bound for an entry still being written, and
        # must not hold up the event loop's default executor, where aiohttp resolves upstream names.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvredis-proxy-discard")

    def close(self) -> None:
        """Drop deletions not yet started and close the connections (what is left expires with its TTL)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            self._store.close()

    def release(self, kv_transfer_params: Any, request_id: str) -> None:
        """Release, in the background, the transfer ``kv_transfer_params`` announce (every rank's shard)."""
        if self._store is None or self._pool is None:
            return
        try:
            announced = read_announcement(kv_transfer_params)
        except MalformedAnnouncement:
            return
        if announced is None or announced.entry_id is None:
            return
        for shard in announced.shards or ():
            for transfer_id in announced.transfer_ids():
                self._pool.submit(self._discard, self._store, request_id, transfer_id, shard)

    def _discard(self, store: RedisStore, request_id: str, entry_id: str, shard: str) -> None:
        assert self._config is not None
        try:
            # The prefill announces its transfer before its writer is done: wait for it as a decode would.
            deleted = discard_transfer(store, shard, entry_id, wait_s=self._config.pop_timeout_s)
        except Exception as exc:  # a background thread: say so, or it vanishes in its future
            logger.warning("request %s: could not delete entry %s, which its decode never took (%s); it "
                           "expires with its TTL", request_id, entry_id, exc)
            return
        if deleted:
            logger.info("request %s: deleted entry %s (%s), which its decode never took", request_id,
                        entry_id, shard)


class _Proxy:
    """Request handlers and the shared upstream client session of one proxy application."""

    def __init__(self, config: ProxyConfig) -> None:
        self._config = config
        self._prefill = _UpstreamPool(config.prefill_urls, config.policy)
        self._decode = _UpstreamPool(config.decode_urls, config.policy)
        self._unused = _UnusedEntries(config.redis_config)
        self._session: aiohttp.ClientSession | None = None
        self._prefill_timeout = aiohttp.ClientTimeout(
            total=config.prefill_timeout_s, sock_connect=config.connect_timeout_s
        )
        # sock_read also bounds the silence between streamed chunks, so a decode that stalls without
        # closing its connection ends the client's stream instead of hanging it.
        self._decode_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.decode_ttfb_timeout_s
        )

    async def client_session(self, app: web.Application) -> AsyncIterator[None]:
        """Cleanup context owning the upstream session, so it is closed with the application."""
        # limit=0: the connector's default cap of 100 connections would queue the 101st concurrent stream,
        # and the queueing time would count against that request's upstream timeouts. An idle connection
        # is dropped before vLLM's server drops it (uvicorn, VLLM_HTTP_TIMEOUT_KEEP_ALIVE: 5 s): aiohttp's
        # default 15 s let a request go out on a connection the engine was closing at that moment, and fail
        # with "Server disconnected" (seen in scripts/bench_hit.py, requests seconds apart).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_UPSTREAM_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector)
        self._unused.open()
        try:
            yield
        finally:
            await self._session.close()
            self._session = None
            self._unused.close()

    @property
    def _http(self) -> aiohttp.ClientSession:
        """The upstream session; only exists between application startup and cleanup."""
        if self._session is None:
            raise RuntimeError("the proxy's client session exists only while its application is running")
        return self._session

    async def handle_health(self, request: web.Request) -> web.Response:
        """Report the upstream instances and their in-flight counts."""
        return web.json_response(
            {
                "status": "ok",
                "policy": self._config.policy,
                "prefill": self._prefill.describe(),
                "decode": self._decode.describe(),
            }
        )

    async def handle_models(self, request: web.Request) -> web.Response:
        """Forward the model listing to a decode instance, which serves the same model as the prefillers."""
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        timeout = aiohttp.ClientTimeout(
            total=self._config.decode_ttfb_timeout_s, sock_connect=self._config.connect_timeout_s
        )
        with self._decode.acquire() as url:
            try:
                with _upstream_errors("decode", url, self._config.decode_ttfb_timeout_s):
                    async with self._http.get(
                        url + "/v1/models",
                        headers=_upstream_headers(request, request_id),
                        timeout=timeout,
                        allow_redirects=False,
                    ) as upstream:
                        body = await upstream.read()
                        return web.Response(
                            status=upstream.status,
                            body=body,
                            headers={
                                hdrs.CONTENT_TYPE: upstream.headers.get(hdrs.CONTENT_TYPE, "application/json")
                            },
                        )
            except _UpstreamFailure as failure:
                logger.warning("request %s: %s", request_id, failure)
                return web.json_response(failure.as_error(), status=failure.status)

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        """Run one completion or chat completion through prefill, then decode, and relay the decode answer."""
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            logger.warning("request %s rejected: the body is not a JSON object", request_id)
            error = {"message": "the request body must be a JSON object", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        headers = _upstream_headers(request, request_id)
        try:
            kv_transfer_params = await self._run_prefill(request.path, body, headers)
            decode_body = dict(body)
            if kv_transfer_params is not None:
                decode_body["kv_transfer_params"] = kv_transfer_params
            return await self._run_decode(request, decode_body, headers, request_id)
        except _UpstreamFailure as failure:
            logger.warning("request %s: %s", request_id, failure)
            return web.json_response(failure.as_error(), status=failure.status)

    async def _run_prefill(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> dict[str, Any] | None:
        """Have a prefill instance compute the prompt's KV and return the parameters locating it, if any."""
        timeout_s = self._config.prefill_timeout_s
        with self._prefill.acquire() as url:
            with _upstream_errors("prefill", url, timeout_s):
                async with self._http.post(
                    url + path,
                    json=_prefill_request(body),
                    headers=headers,
                    timeout=self._prefill_timeout,
                    allow_redirects=False,
                ) as upstream:
                    raw = await upstream.read()
                    status = upstream.status
            if not 200 <= status < 300:
                reason = f"answered {status}: {raw.decode('utf-8', errors='replace')}"
                raise _UpstreamFailure(status, "prefill", url, reason)
            try:
                answer = json.loads(raw)
            except ValueError as exc:
                raise _UpstreamFailure(502, "prefill", url, "answered with a body that is not JSON") from exc
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None

    async def _run_decode(
        self, request: web.Request, body: Mapping[str, Any], headers: Mapping[str, str], request_id: str
    ) -> web.StreamResponse:
        """Send the request to a decode instance and relay its answer, streamed if the client asked so."""
        ttfb_s = self._config.decode_ttfb_timeout_s
        with self._decode.acquire() as url:
            try:
                with _upstream_errors("decode", url, ttfb_s):
                    upstream, first = await asyncio.wait_for(
                        self._open_decode(url + request.path, body, headers), timeout=ttfb_s
                    )
            except _UpstreamFailure:
                self._unused.release(body.get("kv_transfer_params"), request_id)
                raise
            try:
                if not 200 <= upstream.status < 300:
                    logger.warning(
                        "request %s: decode upstream %s answered %d", request_id, url, upstream.status
                    )
                    # vLLM answers an error before the request reaches its scheduler: nobody takes the entry.
                    self._unused.release(body.get("kv_transfer_params"), request_id)
                content_type = upstream.headers.get(hdrs.CONTENT_TYPE, "application/octet-stream")
                if body.get("stream") is not True:
                    with _upstream_errors("decode", url, ttfb_s):
                        rest = await upstream.content.read()
                    return web.Response(
                        status=upstream.status, body=first + rest, headers={hdrs.CONTENT_TYPE: content_type}
                    )
                relay = web.StreamResponse(status=upstream.status, headers={hdrs.CONTENT_TYPE: content_type})
                await self._relay_stream(request, relay, upstream, first, url, request_id)
                return relay
            finally:
                # Closing (not releasing) drops a connection still mid-body, which makes vLLM abort the
                # request instead of generating for a client that is gone; after a full read it is a no-op.
                upstream.close()

    async def _open_decode(
        self, url: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """Send the decode request and wait for its first body bytes."""
        # Waiting for body bytes, not just headers, before answering the client keeps a decode that sends
        # headers and then stalls a clean 504 rather than a stream that has already promised 200.
        upstream = await self._http.post(
            url, json=body, headers=headers, timeout=self._decode_timeout, allow_redirects=False
        )
        try:
            return upstream, await upstream.content.readany()
        except BaseException:
            upstream.close()
            raise

    async def _relay_stream(
        self,
        request: web.Request,
        relay: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        first: bytes,
        url: str,
        request_id: str,
    ) -> None:
        """Copy decode chunks to the client as they arrive; end with an SSE error event if decode breaks."""
        chunk = first
        try:
            await relay.prepare(request)
            while chunk:
                await relay.write(chunk)
                try:
                    with _upstream_errors("decode", url, self._config.decode_ttfb_timeout_s):
                        chunk = await upstream.content.readany()
                except _UpstreamFailure as failure:
                    logger.warning("request %s: mid-stream: %s", request_id, failure)
                    await relay.write(b"data: " + json.dumps(failure.as_error()).encode() + b"\n\n")
                    break
            await relay.write_eof()
        except ConnectionResetError:
            logger.info(
                "request %s: client went away mid-stream; dropping decode upstream %s", request_id, url
            )


def build_app(config: ProxyConfig) -> web.Application:
    """Build the proxy application; its upstream client session opens at startup and closes at cleanup."""
    proxy = _Proxy(config)
    app = web.Application(client_max_size=_MAX_REQUEST_BYTES)
    app.cleanup_ctx.append(proxy.client_session)
    app.router.add_post("/v1/completions", proxy.handle_completion)
    app.router.add_post("/v1/chat/completions", proxy.handle_completion)
    app.router.add_get("/v1/models", proxy.handle_models)
    app.router.add_get("/health", proxy.handle_health)
    return app


async def start_proxy(
    config: ProxyConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Start serving in the running loop; return the runner (``await runner.cleanup()`` stops it) and port."""
    # access_log=None: aiohttp's access log would write an INFO line for every successful request.
    runner = web.AppRunner(build_app(config), access_log=None, shutdown_timeout=_SHUTDOWN_GRACE_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])


def run_proxy(config: ProxyConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until SIGINT or SIGTERM, then give in-flight requests a grace period and close the sessions."""
    asyncio.run(_serve_until_signalled(config, host, port))


async def _serve_until_signalled(config: ProxyConfig, host: str, port: int) -> None:
    """Body of :func:`run_proxy`: start the proxy, wait for a stop signal, shut down."""
    runner, bound_port = await start_proxy(config, host, port)
    logger.info(
        "disaggregation proxy listening on http://%s:%d (policy %s, prefill %s, decode %s)",
        host,
        bound_port,
        config.policy,
        ", ".join(config.prefill_urls),
        ", ".join(config.decode_urls),
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
        logger.info("disaggregation proxy stopping")
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
        await runner.cleanup()
