"""What the connector's scheduler side tells its workers each step, and what both sides agree on about a
prompt: which positions and blocks are stored (:func:`stored_plan`, :func:`stored_blocks`), where a reader
can resume (:func:`resume_end`) and its token IDs as plain ints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvredis.store.chunk_keys import ChunkPlan
from kvredis.store.transfer import Transfers
from kvredis.vllm.cache_groups import STATE, Series


@dataclass
class TransferSpec:
    """One request's KV to move this step: the pages holding positions ``start..stop-1`` of ``token_ids``.

    ``context`` is the request's context digest (part of its chunks' keys); ``entry_id`` names the announced
    transfer to write or to take (``None``: the prompt's chunks are taken as found).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[list[int]]  # one list per KV cache group
    start: int
    stop: int
    context: str = ""
    entry_id: str | None = None
    computed: int = 0  # a save: positions computed before its last prefill step (a window's earlier blocks
    # may be freed by then)
    parts: int = 0  # a load: the number of KV head ranges the chunks were written in (0: this engine's)
    known: int = 0  # a save (reuse): the prompt's first chunks Redis held at its lookup, not copied out


@dataclass
class KVRedisConnectorMetadata(KVConnectorMetadata):
    """What the scheduler asks the workers to load and save in one step."""

    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)
    idle: bool = False
    """No request computes in this step: a worker may wait a little for its loads instead of returning."""


def stored_plan(transfers: Transfers, tokens: list[int], context: str) -> ChunkPlan:
    """The chunks a prompt is stored as: every position but the last, whose KV no reader uses (vLLM computes
    a prompt's last token itself), so a prompt of k chunks and one token stores k whole chunks."""
    return transfers.plan(tokens[:-1], context)


def resume_end(prompt: int, step: int) -> int:
    """The last position a reader of a prompt of ``prompt`` tokens can resume at: all but its last token (vLLM
    computes that one itself), down to a multiple of ``step`` (a Mamba state's block boundary)."""
    return (prompt - 1) // step * step


def stored_blocks(series: Series, tokens: int, computed: int, chunk_tokens: int, block_size: int,
                  step: int, known: int = 0) -> range:
    """The blocks (indexes into the request's block table) a save keeps of ``series``' layers, for a prompt
    of ``tokens`` tokens saved at the step that computed it from position ``computed`` on.

    Full attention keeps every position but the last, less the first ``known`` chunks (Redis holds them:
    their pages are not copied out of the engine again). A window keeps what a reader resuming at the last
    resume position, or at the last chunk boundary (where a longer prompt's lookup finds the last full
    chunk: a conversation's next turn), attends to, but nothing before what the prefill still holds: vLLM
    frees a request's blocks as the window passes them (``remove_skipped_blocks``, from ``computed`` on), and
    a freed block may hold another request's KV by now. A state keeps the block ending at the last resume
    position, when the step started there (vLLM's prefill stops at that boundary, and the state there
    outlives the step); otherwise nothing.
    """
    end = resume_end(tokens, step)
    last = -(-end // block_size)
    if series.kind == STATE:
        if end == 0 or computed != end:
            return range(0)
        return range(last - 1, last)
    if series.whole:
        return range(min(known * chunk_tokens // block_size, -(-(tokens - 1) // block_size)),
                     -(-(tokens - 1) // block_size))
    boundary = (tokens - 1) // chunk_tokens * chunk_tokens
    first = max(series.needed(boundary), series.needed(computed))
    return range(min(first // block_size, last), last)


def series_plan(series: Series, transfers: Transfers, tokens: list[int], context: str, blocks: range,
                end: int) -> ChunkPlan:
    """The plan a series' ``blocks`` are stored under (a window's or state's: a block a chunk, from the
    first of them) for a reader resuming at ``end``."""
    if series.whole:
        return stored_plan(transfers, tokens, context)
    return transfers.plan(tokens[:end], context).tail(blocks.start)


def token_list(tokens: Any) -> list[int]:
    """Prompt token IDs as a list of ints (vLLM 0.34 hands a ``TokenBuffer`` array)."""
    return [] if tokens is None else [int(t) for t in tokens]
