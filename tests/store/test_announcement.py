"""The announcement a prefill hands its decode in ``kv_transfer_params``: written, read back, checked."""

from __future__ import annotations

from typing import Any

import pytest

from kvredis.store.announcement import (
    TRANSFER_PARAM,
    Announcement,
    MalformedAnnouncement,
    read_announcement,
)
from kvredis.store.keys import KeySpace, new_entry_id, prompt_digest

ENGINE = {"namespace": "kvredis", "model": "m", "kv_dtype": "bfloat16", "layout": "cuda:-:default:mha",
          "block_size": 16, "tp_size": 1, "format_version": 1}


def _announcement(**changes: Any) -> Announcement:
    fields: dict[str, Any] = {
        "entry_id": new_entry_id(), "digest": prompt_digest([1, 2, 3]), "context": "", "engine": ENGINE,
        "shards": (KeySpace("kvredis").prefix,), "prompt_tokens": 3,
    }
    return Announcement(**{**fields, **changes})


def test_what_is_written_reads_back_the_same() -> None:
    announced = _announcement()
    params = announced.to_params()
    # vLLM's own P/D fields: its decode counts a remote prefill and cleans up after a rejection by them.
    assert set(params) == {TRANSFER_PARAM, "do_remote_prefill", "do_remote_decode"}
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert read_announcement(params) == announced
    assert read_announcement({"do_remote_decode": True}) is None
    assert read_announcement(None) is None


@pytest.mark.parametrize("announced", ["entry", 7, ["entry"]])
def test_an_announcement_that_is_not_a_map_is_malformed(announced: Any) -> None:
    with pytest.raises(MalformedAnnouncement, match="malformed"):
        read_announcement({TRANSFER_PARAM: announced})


@pytest.mark.parametrize("entry", ["", "../../x", "A" * 16, 12, "0123456789abcdef0"])
def test_an_entry_id_that_could_name_another_key_is_refused(entry: Any) -> None:
    params = _announcement().to_params()
    params[TRANSFER_PARAM]["entry"] = entry
    with pytest.raises(MalformedAnnouncement, match="naming entry"):
        read_announcement(params)


@pytest.mark.parametrize(("field", "value"), [
    ("digest", "*"), ("digest", "0" * 31), ("digest", 5),
    ("shards", ["kvredis:*"]), ("shards", "kvredis:0123456789abcdef"), ("shards", []),
    ("shards", ["x" * 65 + ":0123456789abcdef"]), ("engine", "m"), ("context", 3), ("prompt_tokens", True),
])
def test_an_unusable_field_reads_as_not_given(field: str, value: Any) -> None:
    """A reader falls back on what it knows (its own shards, the tokens it has) instead of using it."""
    params = _announcement().to_params()
    params[TRANSFER_PARAM][field] = value
    announced = read_announcement(params)
    assert announced is not None
    assert getattr(announced, field) is None


def test_differences_name_each_field_that_differs() -> None:
    announced = _announcement(engine={**ENGINE, "block_size": 64, "kv_dtype": "float16"})
    assert announced.differences(ENGINE) == ["KV dtype 'float16' on prefill, 'bfloat16' here",
                                             "block size 64 on prefill, 16 here"]
    assert _announcement().differences(ENGINE) == []
    assert _announcement(engine=None).differences(ENGINE) == []


def test_a_transfer_has_one_record_a_shard() -> None:
    """Decode ranks reading one shard together hand the transfer on to each other
    (kvredis.store.keys.reader_id): the announcement names the one record a shard, and the ``readers`` an
    earlier kvredis sent are ignored."""
    entry = new_entry_id()
    read = read_announcement(Announcement(entry, shards=("ns:0123456789abcdef",)).to_params())
    assert read is not None and read.transfer_ids() == [entry]
    assert "readers" not in Announcement(entry).to_params()[TRANSFER_PARAM]
    earlier = read_announcement({TRANSFER_PARAM: {"entry": entry, "readers": 2}})
    assert earlier is not None and earlier.transfer_ids() == [entry]
    assert Announcement(None).transfer_ids() == []


def test_a_hybrid_models_series_prefixes_are_shards() -> None:
    """Each kind of layer of a hybrid model is a series under a prefix of its own: a sliding window's
    (``:w<window>``), a chunked local attention's (``:l<chunk>``), a state's (``:s``)."""
    base = KeySpace("kvredis").prefix
    shards = (base, f"{base}:w4096", f"{base}:l8192", f"{base}:s")
    read = read_announcement(_announcement(shards=shards).to_params())
    assert read is not None and read.shards == shards
    for odd in (f"{base}:x1", f"{base}:w", f"{base}:w1:s", f"{base}:*"):
        read = read_announcement(_announcement(shards=(odd,)).to_params())
        assert read is not None and read.shards is None, odd
