"""The ``kvredis`` command line: settings, namespace statistics and purging, the proxy and the stack."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvredis import __version__
from kvredis.config import SETTINGS, KVRedisConfig
from kvredis.errors import KVRedisError


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
    """Print what a namespace holds."""
    from kvredis.client import RedisStore

    config = _config(args)
    store = RedisStore(config)
    try:
        found = store.summary(f"{config.namespace}:*")
        stats = {"namespace": config.namespace, "url": config.masked_url, **found}
    finally:
        store.close()
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        for name, value in stats.items():
            print(f"{name:<24}{'-' if value is None else value}")
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    """Delete every key of a namespace, asking first unless --yes."""
    from kvredis.client import RedisStore

    config = _config(args)
    store = RedisStore(config)
    try:
        keys = list(store.scan(f"{config.namespace}:*"))
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
        deleted = sum(store.delete(keys[i:i + 500]) for i in range(0, len(keys), 500))
    finally:
        store.close()
    print(f"deleted {deleted} keys of namespace {config.namespace!r}")
    return 0


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
    stats = with_target(commands.add_parser("stats", help="entries, bytes and TTLs in a namespace"))
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(handler=cmd_stats)
    purge = with_target(commands.add_parser("purge", help="delete a namespace's entries"))
    purge.add_argument("--yes", "-y", action="store_true", help="do not ask first")
    purge.set_defaults(handler=cmd_purge)
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
