"""What the connector's scheduler side tells its workers each step, and what both sides agree on about a
prompt: which positions are stored (:func:`stored_plan`) and its token IDs as plain ints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvredis.chunk_keys import ChunkPlan
from kvredis.transfer import Transfers


@dataclass
class TransferSpec:
    """One request's KV to move this step: the pages holding positions ``start..stop-1`` of ``token_ids``.

    ``context`` is the request's context digest (part of its chunks' keys); ``entry_id`` names the announced
    transfer to write or to take (``None``: the prompt's chunks are taken as found).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    stop: int
    context: str = ""
    entry_id: str | None = None


@dataclass
class KVRedisConnectorMetadata(KVConnectorMetadata):
    """What the scheduler asks the workers to load and save in one step."""

    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)


def stored_plan(transfers: Transfers, tokens: list[int], context: str) -> ChunkPlan:
    """The chunks a prompt is stored as: every position but the last, whose KV no reader uses (vLLM computes
    a prompt's last token itself), so a prompt of k chunks and one token stores k whole chunks."""
    return transfers.plan(tokens[:-1], context)


def token_list(tokens: Any) -> list[int]:
    """Prompt token IDs as a list of ints (vLLM 0.34 hands a ``TokenBuffer`` array)."""
    return [] if tokens is None else [int(t) for t in tokens]
