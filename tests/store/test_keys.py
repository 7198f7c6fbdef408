"""Deterministic keys: prompt digests, cache identities, hash tags, cluster slots, namespace patterns."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from fnmatch import fnmatchcase

import numpy as np
import pytest
import torch
from redis.crc import key_slot

from kvredis.store.keys import (
    FORMAT_VERSION,
    CacheIdentity,
    EntryKeys,
    KeySpace,
    Prompt,
    canonical_roi,
    canonical_tokens,
    check_entry_id,
    context_digest,
    new_entry_id,
    prompt_digest,
)

TOKENS = [101, 7592, 2088, 0, 65535, 2**31 - 1, 3]
IDENTITY = CacheIdentity(
    model="meta-llama/Llama-3.1-8B", kv_dtype="bfloat16", layout="NHD", block_size=16, tp_rank=1, tp_size=2
)


def hex_digest(value: str, length: int) -> bool:
    return len(value) == length and all(c in "0123456789abcdef" for c in value)


# --- prompt digest: same tokens in any container ------------------------------------------------------


def test_prompt_digest_is_128_bit_hex() -> None:
    assert hex_digest(prompt_digest(TOKENS), 32)


@pytest.mark.parametrize(
    "tokens",
    [
        torch.tensor(TOKENS, dtype=torch.int64),
        torch.tensor(TOKENS, dtype=torch.int32),
        np.array(TOKENS, dtype=np.int64),
        np.array(TOKENS, dtype=np.int32),
        np.array(TOKENS, dtype=">i8"),
        np.array(TOKENS, dtype=np.uint32),
        tuple(TOKENS),
    ],
    ids=["int64", "int32", "np-int64", "np-int32", "np-big-endian", "np-uint32", "tuple"],
)
def test_same_tokens_in_any_container_give_same_digest(tokens) -> None:
    assert prompt_digest(tokens) == prompt_digest(TOKENS)


def test_small_int_dtypes_give_same_digest() -> None:
    small = [1, 2, 3, 100]
    expected = prompt_digest(small)
    for dtype in (torch.int8, torch.uint8, torch.int16):
        assert prompt_digest(torch.tensor(small, dtype=dtype)) == expected


def test_non_contiguous_tensor_view_gives_same_digest() -> None:
    base = torch.zeros(len(TOKENS), 2, dtype=torch.int64)
    base[:, 0] = torch.tensor(TOKENS)
    view = base[:, 0]
    assert not view.is_contiguous()
    assert prompt_digest(view) == prompt_digest(TOKENS)


def test_strided_numpy_view_gives_same_digest() -> None:
    arr = np.repeat(np.array(TOKENS, dtype=np.int32), 3)[::3]
    assert not arr.flags["C_CONTIGUOUS"]
    assert prompt_digest(arr) == prompt_digest(TOKENS)


def test_tensor_with_batch_dim_is_flattened() -> None:
    assert prompt_digest(torch.tensor([TOKENS])) == prompt_digest(TOKENS)


def test_sliced_tensor_hashes_only_its_own_elements() -> None:
    big = torch.tensor([9, *TOKENS, 9])
    assert prompt_digest(big[1:-1]) == prompt_digest(TOKENS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_gives_same_digest() -> None:
    assert prompt_digest(torch.tensor(TOKENS, device="cuda")) == prompt_digest(TOKENS)


def reference_digest(tokens, roi=None) -> str:
    """The documented canonical hash, through the general (numpy) path only."""
    flat = canonical_tokens(tokens)
    hasher = hashlib.blake2b(digest_size=16, person=b"kvredis-prompt")
    hasher.update(len(flat).to_bytes(8, "little"))
    hasher.update(flat.tobytes())
    hasher.update(canonical_roi(roi, len(flat)).tobytes())
    return hasher.hexdigest()


@pytest.mark.parametrize(
    "tokens",
    [
        TOKENS, tuple(TOKENS), [], [0], [-(2**63), 2**63 - 1, -1], [np.int64(5), np.int32(-7), 3],
        [True, 1, 2], [2**63], [2**64 + 5], torch.tensor(TOKENS), torch.tensor([TOKENS, TOKENS]),
        torch.tensor(42), torch.tensor(TOKENS)[1:], torch.tensor(TOKENS)[::2],
        torch.tensor([], dtype=torch.int64), torch.tensor([-5, 300], dtype=torch.int16), torch.tensor([True]),
        torch.tensor([1.0]), torch.tensor([]), torch.tensor([1, 2], dtype=torch.uint32),
    ],
    ids=["list", "tuple", "empty", "one", "int64-range", "numpy-scalars", "bool-then-ints", "past-int64",
         "past-uint64", "tensor", "tensor-2d", "tensor-0d", "tensor-offset", "tensor-strided",
         "tensor-empty", "tensor-int16", "tensor-bool", "tensor-float", "tensor-float-empty",
         "tensor-uint32"],
)
def test_the_fast_paths_give_the_canonical_bytes_and_digest(tokens) -> None:
    # Lists, tuples and CPU int64 tensors skip numpy; the result must be what the general path gives (or the
    # same error).
    try:
        expected = canonical_tokens(tokens)
    except (TypeError, ValueError, OverflowError) as exc:
        with pytest.raises(type(exc)):
            Prompt.of(tokens)
        return
    prompt = Prompt.of(tokens)
    assert prompt.tokens.format == "q" and prompt.tokens.ndim == 1
    assert prompt.tokens.tobytes() == expected.tobytes()
    assert prompt.mask.format == "?" and prompt.mask.tobytes() == b"\x01" * len(expected)
    assert prompt.digest == reference_digest(tokens)


def test_a_roi_mask_gives_the_canonical_digest() -> None:
    roi = [1, 0, 1, 1, 0, 1, 1]
    prompt = Prompt.of(torch.tensor(TOKENS), torch.tensor(roi))
    assert prompt.mask.tobytes() == bytes(roi)
    assert prompt.digest == reference_digest(TOKENS, roi)


def test_a_prompt_keeps_the_tokens_it_was_made_of() -> None:
    tokens = torch.tensor(TOKENS)
    prompt = Prompt.of(tokens)
    tokens[0] = 1
    assert prompt.tokens.tolist() == TOKENS


def test_digest_does_not_mutate_input() -> None:
    tokens = torch.tensor(TOKENS, dtype=torch.int32)
    roi = torch.tensor([1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    prompt_digest(tokens, roi)
    assert tokens.tolist() == TOKENS
    assert tokens.dtype == torch.int32
    assert roi.tolist() == [True, False, True, True, True, True, True]


def test_known_digest_value_is_stable() -> None:
    # Pinned so that a change to the canonical form (which would orphan stored entries) is noticed.
    import hashlib

    hasher = hashlib.blake2b(digest_size=16, person=b"kvredis-prompt")
    hasher.update((3).to_bytes(8, "little"))
    hasher.update(b"".join(t.to_bytes(8, "little", signed=True) for t in (1, -2, 3)))
    hasher.update(bytes([1, 0, 1]))
    assert prompt_digest([1, -2, 3], [1, 0, 1]) == hasher.hexdigest()


# --- prompt digest: what must change it ---------------------------------------------------------------


def test_different_tokens_give_different_digest() -> None:
    other = list(TOKENS)
    other[3] += 1
    assert prompt_digest(other) != prompt_digest(TOKENS)


def test_token_order_matters() -> None:
    assert prompt_digest([1, 2, 3]) != prompt_digest([3, 2, 1])
    assert prompt_digest([1, 2]) != prompt_digest([2, 1])


@pytest.mark.parametrize(("shorter", "longer"), [([1, 2], [1, 2, 0]), ([], [0]), ([5], [5, 5])])
def test_length_extension_gives_different_digest(shorter, longer) -> None:
    assert prompt_digest(shorter) != prompt_digest(longer)


def test_high_bits_of_token_matter() -> None:
    assert prompt_digest([1]) != prompt_digest([1 + 2**32])
    assert prompt_digest([-1]) != prompt_digest([2**32 - 1])


def test_roi_none_equals_all_ones() -> None:
    n = len(TOKENS)
    expected = prompt_digest(TOKENS)
    assert prompt_digest(TOKENS, None) == expected
    assert prompt_digest(TOKENS, [1] * n) == expected
    assert prompt_digest(TOKENS, torch.ones(n, dtype=torch.bool)) == expected
    assert prompt_digest(TOKENS, np.full(n, 7)) == expected


def test_roi_all_but_one_differs_from_all_ones() -> None:
    roi = [1] * len(TOKENS)
    roi[-1] = 0
    assert prompt_digest(TOKENS, roi) != prompt_digest(TOKENS)


def test_different_roi_masks_give_different_digests() -> None:
    n = len(TOKENS)
    digests = {prompt_digest(TOKENS, [int(i == j) for i in range(n)]) for j in range(n)}
    digests.add(prompt_digest(TOKENS, [0] * n))
    assert len(digests) == n + 1


def test_roi_bool_and_int_masks_agree() -> None:
    mask = [True, False, True, False, True, True, False]
    assert prompt_digest(TOKENS, mask) == prompt_digest(TOKENS, torch.tensor([1, 0, 2, 0, 9, 1, 0]))


# --- prompt digest: invalid input ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool])
def test_non_integer_token_tensor_raises_type_error(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="integer"):
        prompt_digest(torch.ones(3, dtype=dtype))


@pytest.mark.parametrize("tokens", [[1.0, 2.0], np.array([1.5]), ["a", "b"], [True, False]])
def test_non_integer_token_sequence_raises_type_error(tokens) -> None:
    with pytest.raises(TypeError):
        prompt_digest(tokens)


@pytest.mark.parametrize("length", [0, 6, 8])
def test_roi_of_wrong_length_raises_value_error(length: int) -> None:
    with pytest.raises(ValueError, match=f"roi has {length} elements but there are {len(TOKENS)} tokens"):
        prompt_digest(TOKENS, [1] * length)


def test_roi_tensor_of_wrong_length_raises_value_error() -> None:
    with pytest.raises(ValueError):
        prompt_digest(torch.tensor(TOKENS), torch.ones(len(TOKENS) + 1))


# --- canonical forms ----------------------------------------------------------------------------------


def test_canonical_tokens_is_contiguous_little_endian_int64() -> None:
    out = canonical_tokens(torch.tensor([[1, 2], [3, 4]], dtype=torch.int16))
    assert out.dtype == np.dtype("<i8")
    assert out.flags["C_CONTIGUOUS"]
    assert out.tolist() == [1, 2, 3, 4]


def test_canonical_tokens_of_empty_list() -> None:
    out = canonical_tokens([])
    assert out.shape == (0,)
    assert out.dtype == np.dtype("<i8")


def test_canonical_roi_is_zero_one_uint8() -> None:
    out = canonical_roi([0, 5, -1, 0], 4)
    assert out.dtype == np.uint8
    assert out.tolist() == [0, 1, 1, 0]
    assert canonical_roi(None, 3).tolist() == [1, 1, 1]


# --- separate process ---------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from kvredis.store.keys import CacheIdentity, KeySpace, prompt_digest
    tokens, roi, ident = json.loads(sys.argv[1])
    identity = CacheIdentity(**ident)
    print(json.dumps({
        "plain": prompt_digest(tokens),
        "roi": prompt_digest(torch.tensor(tokens, dtype=torch.int32), roi),
        "identity": identity.digest(),
        "queue": KeySpace("ns", identity).entry(tokens, roi).queue,
    }))
    """
)


@pytest.fixture(scope="module")
def child_digests() -> dict[str, str]:
    roi = [1, 0, 1, 1, 0, 1, 1]
    arg = json.dumps([TOKENS, roi, dataclasses.asdict(IDENTITY)])
    # A hash seed other than ours, so anything built on Python's hash() would differ.
    ours = os.environ.get("PYTHONHASHSEED", "")
    seed = str(int(ours) + 1) if ours.isdigit() else "12345"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, arg],
        env=dict(os.environ, PYTHONHASHSEED=seed),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_prompt_digest_is_same_in_another_process(child_digests: dict[str, str]) -> None:
    assert child_digests["plain"] == prompt_digest(TOKENS)


def test_prompt_digest_with_roi_is_same_in_another_process(child_digests: dict[str, str]) -> None:
    assert child_digests["roi"] == prompt_digest(np.array(TOKENS), [1, 0, 1, 1, 0, 1, 1])


def test_identity_digest_is_same_in_another_process(child_digests: dict[str, str]) -> None:
    assert child_digests["identity"] == IDENTITY.digest()


def test_queue_key_is_same_in_another_process(child_digests: dict[str, str]) -> None:
    assert child_digests["queue"] == KeySpace("ns", IDENTITY).entry(TOKENS, [1, 0, 1, 1, 0, 1, 1]).queue


# --- cache identity -----------------------------------------------------------------------------------


def test_identity_digest_is_64_bit_hex() -> None:
    assert hex_digest(IDENTITY.digest(), 16)


def test_default_identity_uses_current_format_version() -> None:
    assert CacheIdentity().format_version == FORMAT_VERSION
    assert CacheIdentity().tp_size == 1


def test_equal_identities_have_equal_digests() -> None:
    twin = CacheIdentity(**dataclasses.asdict(IDENTITY))
    assert twin.digest() == IDENTITY.digest()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "meta-llama/Llama-3.1-70B"),
        ("kv_dtype", "float8_e4m3fn"),
        ("layout", "HND"),
        ("block_size", 32),
        ("tp_rank", 0),
        ("tp_size", 4),
        ("kv_heads", "0-2/4"),
        ("format_version", FORMAT_VERSION + 1),
    ],
)
def test_identity_digest_changes_with_each_field(field: str, value: object) -> None:
    changed = dataclasses.replace(IDENTITY, **{field: value})
    assert changed.digest() != IDENTITY.digest()


def test_identity_fields_do_not_bleed_into_each_other() -> None:
    # Naive concatenation would make these two equal.
    a = CacheIdentity(model="ab", kv_dtype="c")
    b = CacheIdentity(model="a", kv_dtype="bc")
    assert a.digest() != b.digest()


def test_identity_changes_key_prefix_not_prompt_digest() -> None:
    a = KeySpace("ns", IDENTITY).entry(TOKENS)
    b = KeySpace("ns", dataclasses.replace(IDENTITY, tp_rank=0)).entry(TOKENS)
    assert a.digest == b.digest
    assert a.queue != b.queue


# --- entry keys ---------------------------------------------------------------------------------------


@pytest.fixture
def entry() -> EntryKeys:
    return KeySpace("tenant-a", IDENTITY).entry(TOKENS)


def _all_keys(entry: EntryKeys) -> list[str]:
    return [entry.queue, entry.chunk("e1", 0), entry.chunk("e1", 1), entry.chunk("0123abcd", 999)]


def test_every_key_has_the_hash_tag_exactly_once(entry: EntryKeys) -> None:
    tag = "{" + entry.digest + "}"
    for key in _all_keys(entry):
        assert key.count(tag) == 1, key
        assert key.count("{") == 1
        assert key.count("}") == 1


def test_every_key_starts_with_namespace_and_identity(entry: EntryKeys) -> None:
    prefix = f"tenant-a:{IDENTITY.digest()}:"
    for key in _all_keys(entry):
        assert key.startswith(prefix), key


def test_keyspace_prefix() -> None:
    assert KeySpace("ns", IDENTITY).prefix == f"ns:{IDENTITY.digest()}"


def test_queue_and_chunk_keys_are_distinct(entry: EntryKeys) -> None:
    keys = _all_keys(entry)
    assert len(set(keys)) == len(keys)
    assert entry.chunk("e1", 0) != entry.chunk("e2", 0)
    assert entry.chunk("e1", 1) != entry.chunk("e1", 10)


def test_queue_and_chunk_keys_share_a_cluster_slot(entry: EntryKeys) -> None:
    slots = {key_slot(key.encode()) for key in _all_keys(entry)}
    assert len(slots) == 1


def test_slot_is_decided_by_prompt_digest_only() -> None:
    a = KeySpace("one", IDENTITY).entry(TOKENS)
    b = KeySpace("two", CacheIdentity()).entry(TOKENS)
    assert key_slot(a.queue.encode()) == key_slot(b.queue.encode()) == key_slot(a.digest.encode())


def test_different_prompts_spread_over_slots() -> None:
    space = KeySpace("ns")
    slots = {key_slot(space.entry([i, i + 1]).queue.encode()) for i in range(64)}
    assert len(slots) > 32


def test_same_prompt_gives_same_keys() -> None:
    a = KeySpace("ns", IDENTITY).entry(torch.tensor(TOKENS), None)
    b = KeySpace("ns", IDENTITY).entry(np.array(TOKENS, dtype=np.int32), [1] * len(TOKENS))
    assert a == b
    assert a.chunk("x", 3) == b.chunk("x", 3)


def test_roi_changes_entry_keys() -> None:
    space = KeySpace("ns", IDENTITY)
    roi = [1] * len(TOKENS)
    roi[0] = 0
    assert space.entry(TOKENS, roi).queue != space.entry(TOKENS).queue


# --- namespace pattern --------------------------------------------------------------------------------


def test_namespace_pattern_matches_every_key(entry: EntryKeys) -> None:
    pattern = KeySpace("tenant-a", IDENTITY).namespace_pattern
    assert pattern == "tenant-a:*"
    for key in _all_keys(entry):
        assert fnmatchcase(key, pattern), key


def test_namespace_pattern_covers_other_identities() -> None:
    pattern = KeySpace("tenant-a").namespace_pattern
    other = KeySpace("tenant-a", dataclasses.replace(IDENTITY, model="other")).entry([1])
    assert fnmatchcase(other.queue, pattern)


@pytest.mark.parametrize("other_namespace", ["tenant-ab", "tenant", "xtenant-a", "TENANT-A"])
def test_namespace_pattern_excludes_other_namespaces(other_namespace: str) -> None:
    pattern = KeySpace("tenant-a").namespace_pattern
    key = KeySpace(other_namespace, IDENTITY).entry(TOKENS).queue
    assert not fnmatchcase(key, pattern)


def test_the_context_is_part_of_the_prompt_digest() -> None:
    tokens = [5, 6, 7]
    lora_a = context_digest([("lora", "a", "content-a")])
    lora_b = context_digest([("lora", "b", "content-b")])
    salted = context_digest([("salt", "tenant-1")])
    digests = {prompt_digest(tokens), prompt_digest(tokens, None, lora_a),
               prompt_digest(tokens, None, lora_b), prompt_digest(tokens, None, salted)}
    assert len(digests) == 4
    assert prompt_digest(tokens, None, "") == prompt_digest(tokens)  # no context: the keys it always had
    assert prompt_digest(tokens, None, lora_a) == prompt_digest(np.array(tokens), None, lora_a)


def test_context_digest_is_stable_ordered_and_typed() -> None:
    image = [("mm", "hash-1", 3, 16), ("mm", "hash-2", 40, 16)]
    assert context_digest(image) == context_digest([list(part) for part in image])
    assert context_digest(image) != context_digest(image[::-1])  # the n-th image at the n-th placeholder
    assert context_digest([("mm", "hash-1", 3, 16)]) != context_digest([("mm", "hash-1", 4, 16)])
    assert context_digest([]) == ""
    assert len(context_digest([("salt", "x")])) == 32
    # A name that looks like a separator cannot make two different contexts collide.
    assert context_digest([("lora", "a,b")]) != context_digest([("lora", "a", "b")])
    with pytest.raises(TypeError):
        context_digest([("salt", 1.5)])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        context_digest([()])
    with pytest.raises(ValueError, match="context"):
        prompt_digest([1], None, "not a digest")


def test_entry_ids_are_checked_before_naming_a_key() -> None:
    keys = KeySpace("ns").entry([1, 2, 3])
    entry_id = new_entry_id()
    assert check_entry_id(entry_id) == entry_id
    assert keys.entry_queue(entry_id).endswith(f":{entry_id}:q") and keys.entry_queue(entry_id) != keys.queue
    for bad in ["", "x" * 16, "0123", "*", "0123456789abcdef:q", None, 7]:
        with pytest.raises(ValueError, match="entry id"):
            keys.entry_queue(bad)  # type: ignore[arg-type]


def test_entry_ids_are_unique_across_refills_and_threads() -> None:
    import threading

    got: list[list[str]] = [[] for _ in range(4)]

    def draw(out: list[str]) -> None:
        out.extend(new_entry_id() for _ in range(2000))

    workers = [threading.Thread(target=draw, args=(out,)) for out in got]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    ids = [entry_id for out in got for entry_id in out]
    assert len(ids) == 8000 and len(set(ids)) == 8000  # more than 256: the batch was refilled many times
    assert all(check_entry_id(entry_id) == entry_id for entry_id in ids)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_reuse_its_parents_entry_ids() -> None:
    new_entry_id()  # the parent now holds a batch of ids it has not handed out
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send its ids and leave at once
        try:
            os.write(write, "".join(new_entry_id() for _ in range(100)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read().decode()
    os.waitpid(pid, 0)
    child = {data[i:i + 16] for i in range(0, len(data), 16)}
    parent = {new_entry_id() for _ in range(100)}
    assert len(child) == 100 and not child & parent
