"""The ``kvredis`` command line: settings, namespace statistics and purging, the proxy and the stack."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvredis import __version__
from kvredis.config import SETTINGS, KVRedisConfig
from kvredis.errors import KVRedisError

if TYPE_CHECKING:
    from kvredis.stack.up import StackOptions

# kvredis.stack.proxy.POLICIES, spelled out: importing the proxy needs aiohttp, which the other commands
# do not.
_POLICIES = ("round_robin", "least_outstanding")


def _config(args: argparse.Namespace) -> KVRedisConfig:
    overrides: dict[str, Any] = {}
    if getattr(args, "url", None):
        overrides["url"] = args.url
    if getattr(args, "namespace", None):
        overrides["namespace"] = args.namespace
    return KVRedisConfig.from_env(overrides=overrides)


def cmd_config(args: argparse.Namespace) -> int:
    """Print the effective settings (secrets masked)."""
    config = _config(args)
    shown = config.describe()
    if args.json:
        print(json.dumps(shown, indent=2))
        return 0
    width = max(len(name) for name in shown)
    for setting in SETTINGS:
        print(f"{setting.env:<{width}}  {shown[setting.env]}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    """Print what a namespace holds, and the hit rate of its engines' lookups."""
    from kvredis.store.client import RedisStore
    from kvredis.store.generation import generation_key, read_generation
    from kvredis.store.tally import read_tally, tally_key

    config = _config(args)
    store = RedisStore(config)
    try:
        found = store.summary(f"{config.namespace}:*",
                              besides=(tally_key(config.namespace), generation_key(config.namespace)))
        stats = {"namespace": config.namespace, "url": config.masked_url, **found,
                 **read_tally(store, config.namespace),
                 "cache_generation": read_generation(store, config.namespace)}
    finally:
        store.close()
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        for name, value in stats.items():
            print(f"{name:<24}{'-' if value is None else value}")
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    """Delete every key of a namespace, asking first unless --yes.

    It first starts a new cache generation (as vLLM's ``reset_prefix_cache?reset_external=true`` does,
    :func:`kvredis.store.generation.reset_namespace`): a chunk a writer still in flight stores after the
    deletion is under the old generation, which no engine looks up again. The generation's key is kept."""
    from kvredis.store.client import RedisStore
    from kvredis.store.generation import purge_keys, reset_namespace

    config = _config(args)
    store = RedisStore(config)
    try:
        keys = list(purge_keys(store, config.namespace))
        if not keys:
            print(f"namespace {config.namespace!r} at {config.masked_url} holds no keys")
            return 0
        if not args.yes:
            if not sys.stdin.isatty():
                print("refusing to purge without --yes (standard input is not a terminal)", file=sys.stderr)
                return 2
            answer = input(f"delete {len(keys)} keys of namespace {config.namespace!r} "
                           f"at {config.masked_url}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing deleted")
                return 1
        generation = reset_namespace(store, config.namespace)
        deleted = sum(store.delete(keys[i:i + 500]) for i in range(0, len(keys), 500))
    finally:
        store.close()
    print(f"deleted {deleted} keys of namespace {config.namespace!r} (cache generation now {generation})")
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    """Run the disaggregation proxy until SIGINT or SIGTERM."""
    # Imported here: `kvredis --version` and the other commands must work without aiohttp (the proxy extra).
    try:
        from kvredis.stack.proxy import ProxyConfig, run_proxy
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "aiohttp":
            raise
        print("kvredis proxy needs aiohttp: pip install 'kvredis[proxy]'", file=sys.stderr)
        return 2
    redis_url = args.redis_url or os.environ.get("KVREDIS_URL")
    config = ProxyConfig(
        prefill_urls=args.prefill,
        decode_urls=args.decode,
        policy=args.policy,
        connect_timeout_s=args.connect_timeout,
        prefill_timeout_s=args.prefill_timeout,
        decode_ttfb_timeout_s=args.decode_timeout,
        redis_config=KVRedisConfig.from_env(overrides={"url": redis_url}) if redis_url else None,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_proxy(config, args.host, args.port)
    except OSError as exc:
        print(f"kvredis proxy: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


def _stack_options(args: argparse.Namespace, proxy_port: int) -> StackOptions:
    """The stack's options from the ``up``/``demo`` arguments and the ``KVREDIS_*`` environment."""
    from kvredis.stack.up import StackOptions

    namespace = args.namespace or os.environ.get("KVREDIS_NAMESPACE") or "kvredis"
    return StackOptions(
        redis_url=args.url or os.environ.get("KVREDIS_URL") or None,
        namespace=namespace,
        host=args.host,
        proxy_port=proxy_port,
        model=getattr(args, "model", None),
        engine_command=shlex.split(args.engine_command) if args.engine_command else None,
        engine_args=tuple(args.engine_arg or ()),
        startup_timeout_s=args.startup_timeout,
        stop_grace_s=args.stop_grace,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        policy=args.policy,
        reuse=_reuse(args.reuse),
        redis_maxmemory=args.redis_maxmemory,
    )


def _reuse(flag: bool | None) -> bool:
    """``--reuse``/``--no-reuse``, else ``KVREDIS_REUSE``, else on (the stack is a shared prefix cache)."""
    if flag is not None:
        return flag
    from kvredis.config import KVRedisConfig

    return KVRedisConfig.from_env().reuse if "KVREDIS_REUSE" in os.environ else True


def cmd_up(args: argparse.Namespace) -> int:
    """Run the one-machine stack (Redis, prefill and decode vLLM, proxy) until Ctrl-C or SIGTERM."""
    from kvredis.stack.up import up

    return up(_stack_options(args, args.port))


def cmd_demo(args: argparse.Namespace) -> int:
    """Start the stack, send completions through it, check them against the prefill engine alone, stop."""
    from kvredis.stack.demo import demo

    # A demo namespace of its own: entries of other runs sharing KVREDIS_URL's Redis cannot mix in.
    if not args.namespace:
        args.namespace = f"kvredis-demo-{uuid.uuid4().hex[:8]}"
    return demo(_stack_options(args, args.port), count=args.requests, max_tokens=args.max_tokens)


def _positive(kind: type[float] | type[int]) -> Callable[[str], float]:
    """An argparse type: ``kind`` parsed from the text, refused unless positive."""

    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def _stack_arguments() -> argparse.ArgumentParser:
    """The options ``up`` and ``demo`` share (their ``--port`` defaults differ), as an argparse parent."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--url", help="use this Redis (default: KVREDIS_URL; unset: start one)")
    parent.add_argument("--namespace", help="namespace (default: KVREDIS_NAMESPACE)")
    parent.add_argument("--host", default="127.0.0.1",
                        help="address every part listens on (default: %(default)s)")
    parent.add_argument("--engine-command", metavar="CMD",
                        help="command running a vLLM OpenAI server (default: `vllm serve` of this Python)")
    parent.add_argument("--engine-arg", action="append", metavar="ARG",
                        help="extra argument for both vLLM servers (repeat; use --engine-arg=--flag)")
    parent.add_argument("--startup-timeout", type=_positive(float), default=300.0, metavar="S",
                        help="seconds each vLLM server may take to become healthy (default: %(default)s)")
    parent.add_argument("--stop-grace", type=_positive(float), default=20.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping (default: %(default)s)")
    parent.add_argument("--log-dir", metavar="DIR",
                        help="where the logs go (default: a new temporary folder)")
    parent.add_argument("--prefill-instances", type=_positive(int), default=1, metavar="N",
                        help="prefill vLLM servers behind the proxy (default: %(default)s)")
    parent.add_argument("--decode-instances", type=_positive(int), default=1, metavar="M",
                        help="decode vLLM servers behind the proxy (default: %(default)s)")
    parent.add_argument("--policy", choices=_POLICIES, default="round_robin",
                        help="how the proxy picks among several instances of a role (default: %(default)s)")
    parent.add_argument("--reuse", action=argparse.BooleanOptionalAction, default=None,
                        help="engines share a prefix cache in Redis; --no-reuse: each prompt's KV is taken "
                             "once by its decode (default: KVREDIS_REUSE, else on)")
    parent.add_argument("--redis-maxmemory", default="2gb", metavar="SIZE",
                        help="maxmemory of the redis-server the stack starts (default: %(default)s)")
    return parent


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="kvredis", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvredis {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_target(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sub.add_argument("--url", help="Redis URL (default: KVREDIS_URL)")
        sub.add_argument("--namespace", help="namespace (default: KVREDIS_NAMESPACE)")
        return sub

    config = with_target(commands.add_parser("config", help="print the effective settings"))
    config.add_argument("--json", action="store_true")
    config.set_defaults(handler=cmd_config)
    stats = with_target(commands.add_parser("stats", help="chunks, bytes, TTLs and hit rate of a namespace"))
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(handler=cmd_stats)
    purge = with_target(commands.add_parser("purge", help="delete a namespace's entries"))
    purge.add_argument("--yes", "-y", action="store_true", help="do not ask first")
    purge.set_defaults(handler=cmd_purge)

    proxy = commands.add_parser("proxy", help="the disaggregation proxy (prefill, then decode)")
    proxy.add_argument("--prefill", action="append", required=True, metavar="URL",
                       help="base URL of a prefill vLLM server (repeat for several)")
    proxy.add_argument("--decode", action="append", required=True, metavar="URL",
                       help="base URL of a decode vLLM server (repeat for several)")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    proxy.add_argument("--port", type=int, default=9000, help="port to listen on (default: %(default)s)")
    proxy.add_argument("--policy", choices=_POLICIES, default="round_robin",
                       help="how an instance is chosen (default: %(default)s)")
    proxy.add_argument("--connect-timeout", type=_positive(float), default=5.0, metavar="S",
                       help="seconds to connect to an upstream (default: %(default)s)")
    proxy.add_argument("--prefill-timeout", type=_positive(float), default=300.0, metavar="S",
                       help="seconds for a prefill answer (default: %(default)s)")
    proxy.add_argument("--decode-timeout", type=_positive(float), default=300.0, metavar="S",
                       help="seconds to a decode's first bytes, and between streamed chunks "
                            "(default: %(default)s)")
    proxy.add_argument("--redis-url", metavar="URL",
                       help="the Redis the engines write to, to delete entries whose decode failed (default: "
                            "KVREDIS_URL; the other KVREDIS_* settings apply); unset: they expire")
    proxy.set_defaults(handler=cmd_proxy)

    stack = _stack_arguments()
    up = commands.add_parser("up", parents=[stack],
                             help="run Redis, prefill and decode vLLM and the proxy here")
    up.add_argument("--port", type=int, default=9000,
                    help="proxy port (default: %(default)s; 0: any free port)")
    up.add_argument("--model", help="model for both engines (default: a tiny Llama written locally)")
    up.set_defaults(handler=cmd_up)
    demo = commands.add_parser("demo", parents=[stack], help="the stack, a few checked completions, stop")
    demo.add_argument("--port", type=int, default=0, help="proxy port (default: any free port)")
    demo.add_argument("--requests", type=_positive(int), default=6, help="how many (default: %(default)s)")
    demo.add_argument("--max-tokens", type=_positive(int), default=16,
                      help="tokens generated per request (default: %(default)s)")
    demo.set_defaults(handler=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvredis`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except KVRedisError as exc:
        print(f"kvredis: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
