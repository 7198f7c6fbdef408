"""The blob codec: round trips, zero-copy decode, alignment, and refusal of corrupt or hostile blobs."""

from __future__ import annotations

import ctypes
import pickle
import struct
import tracemalloc
import warnings
import zlib
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvredis.errors import KVRedisError
from kvredis.store import codec
from kvredis.store.codec import (
    ALIGN,
    DTYPES,
    FORMAT_VERSION,
    MAGIC,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    CodecError,
)

LIMIT = 64 << 20
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPE_NAMES = list(DTYPES)


# --- helpers ------------------------------------------------------------------------------------------


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of random bytes (NaNs and all) of ``dtype`` and ``shape``."""
    numel = 1
    for dim in shape:
        numel *= dim
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def identical(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def all_identical(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> bool:
    return len(got) == len(want) and all(identical(g, w) for g, w in zip(got, want, strict=True))


def round_trip(tensors: list[torch.Tensor | None], **kwargs: Any) -> list[torch.Tensor | None]:
    blob = codec.encode(tensors, **kwargs).to_bytes()
    decoded, _ = codec.decode(blob, max_payload_bytes=LIMIT)
    return decoded


def header_checksum(packed: bytes, version: int = FORMAT_VERSION) -> int:
    """The documented header checksum: CRC32 in format 1, XXH3-64's low 32 bits in format 2."""
    return zlib.crc32(packed) if version == 1 else xxhash.xxh3_64_intdigest(packed) & 0xFFFFFFFF


def handmade_blob(header: dict[str, Any], payload: bytes = b"", version: int = FORMAT_VERSION) -> bytes:
    """A blob built by hand from the documented layout, with a correct header checksum."""
    packed = msgpack.packb(header)
    head = struct.pack("<3sBII", MAGIC, version, len(packed), header_checksum(packed, version)) + packed
    head += bytes(-len(head) % ALIGN)
    return head + payload


def buffer_address(buf: bytearray | bytes) -> int:
    if isinstance(buf, bytearray):
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def sample() -> list[torch.Tensor | None]:
    return [make(torch.bfloat16, (2, 3, 5), 1), None, make(torch.int64, (7,), 2), make(torch.bool, (3,), 3)]


# --- errors -------------------------------------------------------------------------------------------


def test_codec_error_is_kvredis_error_and_value_error() -> None:
    assert issubclass(CodecError, KVRedisError)
    assert issubclass(CodecError, ValueError)


# --- round trips --------------------------------------------------------------------------------------

SHAPES = [
    (), (0,), (1,), (3, 0, 2), (5,), (2, 3), (4, 1, 3, 2), (2,) * MAX_DIMS, (1, 2, 1, 3, 1, 2, 1, 2), (33,),
]


@pytest.mark.parametrize("checksum", [True, False], ids=["crc", "nocrc"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_round_trip_every_dtype_and_shape(name: str, shape: tuple[int, ...], checksum: bool) -> None:
    tensor = make(DTYPES[name], shape, seed=len(shape))
    (out,) = round_trip([tensor], checksum=checksum)
    assert out is not None
    assert out.dtype == DTYPES[name]
    assert tuple(out.shape) == shape
    assert identical(out, tensor)


def test_round_trip_all_dtypes_in_one_blob_with_none_gaps() -> None:
    each = [make(DTYPES[name], (i + 1, 3), seed=i) for i, name in enumerate(DTYPE_NAMES)]
    tensors: list[torch.Tensor | None] = [None, *each[:5], None, *each[5:], None]
    assert len(tensors) <= MAX_TENSORS
    assert all_identical(round_trip(tensors), tensors)


@pytest.mark.parametrize("tensors", [[], [None], [None, None, None]], ids=["empty", "one-none", "nones"])
def test_round_trip_without_any_tensor(tensors: list[None]) -> None:
    enc = codec.encode(tensors, {"k": 1})
    assert enc.payload_nbytes == 0
    out, meta = codec.decode(enc.to_bytes(), max_payload_bytes=0)
    assert out == tensors
    assert meta == {"k": 1}


def test_round_trip_max_tensors() -> None:
    tensors = [make(torch.int8, (i,), seed=i) for i in range(MAX_TENSORS)]
    assert all_identical(round_trip(tensors), tensors)


def test_float8_nan_and_negative_zero_are_bit_identical() -> None:
    raw = torch.tensor([0x7F, 0xFF, 0x80, 0x00, 0x01], dtype=torch.uint8)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        (out,) = round_trip([raw.view(dtype)])
        assert out is not None
        assert out.view(torch.uint8).tolist() == raw.tolist()


def test_float_nan_payloads_are_bit_identical() -> None:
    words = np.array([0x7FC00001, 0xFFC00000, 0x80000000, 0x7F800001], dtype=np.uint32)
    bits = torch.from_numpy(words.view(np.int32))
    (out,) = round_trip([bits.view(torch.float32)])
    assert out is not None
    assert out.view(torch.int32).tolist() == bits.tolist()


@pytest.mark.parametrize(
    "build",
    [
        lambda: make(torch.float16, (4, 6), 5).t(),
        lambda: make(torch.bfloat16, (4, 8), 6)[:, ::2],
        lambda: make(torch.int32, (10,), 7)[3:8],
        lambda: make(torch.float32, (1, 5), 8).expand(4, 5),
        lambda: make(torch.float32, (2, 3, 4, 5), 9).to(memory_format=torch.channels_last),
        lambda: make(torch.float8_e4m3fn, (6, 4), 10)[::3, 1:],
    ],
    ids=["transpose", "step-slice", "offset-slice", "expand-stride0", "channels-last", "float8-slice"],
)
def test_non_contiguous_input_round_trips(build) -> None:
    tensor = build()
    (out,) = round_trip([tensor])
    assert out is not None
    assert out.is_contiguous()
    assert identical(out, tensor)


def test_requires_grad_input_round_trips() -> None:
    tensor = torch.randn(3, 4, requires_grad=True)
    (out,) = round_trip([tensor])
    assert out is not None
    assert torch.equal(out, tensor.detach())


def test_metadata_round_trips() -> None:
    meta = {
        "model": "llama",
        "n": 7,
        "neg": -3,
        "ratio": 0.5,
        "flag": True,
        "none": None,
        "blob": b"\x00\x01\xff",
        "list": [1, "two", 3.0],
        "nested": {"a": {"b": [1, 2]}},
    }
    enc = codec.encode([make(torch.uint8, (3,))], meta)
    _, got = codec.decode(enc.to_bytes(), max_payload_bytes=LIMIT)
    assert got == meta


def test_metadata_defaults_to_empty_map() -> None:
    _, meta = codec.decode(codec.encode([None]).to_bytes(), max_payload_bytes=LIMIT)
    assert meta == {}


@pytest.mark.parametrize(
    "meta",
    [{"ids": list(range(100))}, {"text": "x" * 5000}, {f"k{i}": i for i in range(70)}],
    ids=["long-list", "long-str", "many-keys"],
)
def test_metadata_that_encodes_also_decodes(meta: dict[str, Any]) -> None:
    try:
        enc = codec.encode([None], meta)
    except CodecError:
        return  # refusing at encode time is fine too
    _, got = codec.decode(enc.to_bytes(), max_payload_bytes=LIMIT)
    assert got == meta


def test_unencodable_metadata_raises_codec_error() -> None:
    with pytest.raises(CodecError, match="metadata"):
        codec.encode([None], {"obj": object()})


# --- encode details -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensors",
    [[], [None], [torch.zeros(())], [torch.zeros(3, dtype=torch.int8)], sample(),
     [torch.zeros(0, 5), None, torch.ones(65, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)]],
    ids=["empty", "none", "scalar", "int8x3", "sample", "mixed"],
)
def test_payload_size_matches_encoded_payload(tensors: list[torch.Tensor | None]) -> None:
    enc = codec.encode(tensors)
    assert codec.payload_size(tensors) == enc.payload_nbytes
    assert enc.payload_nbytes % ALIGN == 0
    assert enc.nbytes == len(enc.to_bytes())


def test_payload_size_counts_padding() -> None:
    tensors = [torch.zeros(1, dtype=torch.uint8), None, torch.zeros(65, dtype=torch.uint8)]
    assert codec.payload_size(tensors) == 64 + 128


def test_header_buffer_is_64_aligned() -> None:
    enc = codec.encode(sample(), {"pad": "x" * 37})
    assert len(enc.header) % ALIGN == 0
    assert enc.header[:3] == MAGIC
    assert enc.header[3] == FORMAT_VERSION


def test_encode_does_not_copy_contiguous_payload() -> None:
    tensor = torch.zeros(16, dtype=torch.uint8)
    enc = codec.encode([tensor])
    tensor[5] = 99
    assert enc.payload[0][5] == 99


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.int16, torch.uint16])
def test_encoding_unsupported_dtype_raises_codec_error(dtype: torch.dtype) -> None:
    with pytest.raises(CodecError, match=str(dtype).removeprefix("torch.")):
        codec.encode([torch.zeros(2, dtype=dtype)])


def test_encoding_too_many_dims_raises_codec_error() -> None:
    with pytest.raises(CodecError, match="dimensions"):
        codec.encode([torch.zeros((1,) * (MAX_DIMS + 1))])


def test_encoding_too_many_tensors_raises_codec_error() -> None:
    with pytest.raises(CodecError, match=str(MAX_TENSORS)):
        codec.encode([torch.zeros(1)] * (MAX_TENSORS + 1))


@pytest.mark.parametrize(
    "item", [np.zeros(3, dtype=np.float32), [1.0, 2.0], b"raw"], ids=["ndarray", "list", "bytes"]
)
def test_encoding_non_tensor_raises_codec_error(item: Any) -> None:
    with pytest.raises(CodecError, match=r"not a torch\.Tensor"):
        codec.encode([item])


@pytest.mark.parametrize(
    ("view", "dtype"),
    [(memoryview(struct.pack("<3q", 5, -1, 2**40)).cast("q"), torch.int64),
     (memoryview(b"\x01\x00\x01").cast("?"), torch.bool),
     (memoryview(bytes(range(6))), torch.uint8),
     (memoryview(struct.pack("<2i", 7, -7)).cast("i"), torch.int32)],
    ids=["int64", "bool", "uint8", "int32"],
)
def test_a_flat_memoryview_encodes_as_a_tensor_of_its_format(view: memoryview, dtype: torch.dtype) -> None:
    # kvredis.store.keys hands the prompt's tokens and mask over as such views: no tensor is made of them.
    (out,) = round_trip([view])
    assert out is not None and out.dtype == dtype and tuple(out.shape) == (len(view),)
    assert out.tolist() == view.tolist()
    assert codec.payload_size([view]) == codec.encode([view]).payload_nbytes == ALIGN


@pytest.mark.parametrize(
    "view",
    [memoryview(struct.pack("<2d", 1.0, 2.0)).cast("d"), memoryview(bytes(range(8)))[::2]],
    ids=["float64-format", "strided"],
)
def test_other_memoryviews_raise_codec_error(view: memoryview) -> None:
    with pytest.raises(CodecError, match="memoryview"):
        codec.encode([view])


def test_a_flat_metadata_map_is_not_decoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # The writer refuses what the reader's msgpack limits would: for a flat map of short strings and scalars
    # that is certain without decoding the packed header; anything else is still decoded to make sure.
    calls: list[int] = []
    unpack = codec._unpack_header

    def counted(packed: Any) -> Any:
        calls.append(1)
        return unpack(packed)

    monkeypatch.setattr(codec, "_unpack_header", counted)
    codec.encode(sample(), {"id": "0123456789abcdef", "space": "ns:" + "é" * 1000, "chunk": 4096, "x": None})
    assert calls == []
    codec.encode(sample(), {"ids": [1, 2, 3]})
    assert calls == [1]
    with pytest.raises(CodecError):
        codec.encode(sample(), {"text": "x" * 5000})
    assert calls == [1, 1]


_FLAT_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                         st.floats(allow_nan=False),
                         st.text(max_size=1100), st.binary(max_size=5000))


@settings(max_examples=200, deadline=None)
@given(meta=st.dictionaries(st.text(max_size=1100), _FLAT_VALUES, max_size=70))
def test_property_what_the_writer_passes_unchecked_the_reader_accepts(meta: dict[str, Any]) -> None:
    if not codec._fits_reader_limits(meta):
        return
    packed = msgpack.packb({"v": FORMAT_VERSION, "t": [None] * MAX_TENSORS, "m": meta})
    assert codec._unpack_header(packed)["m"] == meta


def test_encode_respects_max_payload_bytes() -> None:
    tensors = [torch.zeros(100, dtype=torch.uint8)]
    assert codec.encode(tensors, max_payload_bytes=128).payload_nbytes == 128
    with pytest.raises(CodecError, match="exceeds"):
        codec.encode(tensors, max_payload_bytes=127)


def test_checksum_false_writes_no_crc() -> None:
    enc = codec.encode([torch.ones(4)], checksum=False)
    header = codec.read_header(enc.header, max_payload_bytes=LIMIT)
    assert header.specs[0] is not None
    assert header.specs[0].crc is None


# --- zero-copy and alignment --------------------------------------------------------------------------


def test_decode_of_bytearray_is_zero_copy() -> None:
    tensors = sample()
    blob = bytearray(codec.encode(tensors).to_bytes())
    out, _ = codec.decode(blob, max_payload_bytes=LIMIT)
    header = codec.read_header(blob, max_payload_bytes=LIMIT)
    base = buffer_address(blob)
    for index, tensor in enumerate(out):
        if tensor is not None:
            assert tensor.data_ptr() == base + header.payload_offset + header.offsets()[index]


def test_mutating_bytearray_changes_decoded_tensor() -> None:
    blob = bytearray(codec.encode([torch.zeros(8, dtype=torch.uint8)]).to_bytes())
    (tensor,), _ = codec.decode(blob, max_payload_bytes=LIMIT)
    assert tensor is not None
    offset = codec.read_header(blob, max_payload_bytes=LIMIT).payload_offset
    blob[offset + 3] = 42
    assert tensor[3].item() == 42


def test_decode_of_writable_memoryview_is_zero_copy() -> None:
    blob = bytearray(codec.encode([torch.zeros(8, dtype=torch.uint8)]).to_bytes())
    (tensor,), _ = codec.decode(memoryview(blob), max_payload_bytes=LIMIT)
    assert tensor is not None
    tensor[0] = 7
    offset = codec.read_header(blob, max_payload_bytes=LIMIT).payload_offset
    assert blob[offset] == 7


@pytest.mark.parametrize("wrap", [bytes, lambda b: memoryview(bytes(b))], ids=["bytes", "readonly-view"])
def test_decode_of_read_only_buffer_copies(wrap) -> None:
    tensors = sample()
    blob = wrap(codec.encode(tensors).to_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a non-writable buffer
        out, _ = codec.decode(blob, max_payload_bytes=LIMIT)
    base = buffer_address(bytes(blob) if isinstance(blob, memoryview) else blob)
    first = out[0]
    assert first is not None
    if isinstance(blob, bytes):
        assert not base <= first.data_ptr() < base + len(blob)
    first.zero_()  # the copy is writable, and writing it leaves the blob alone
    assert all_identical(codec.decode(bytes(blob), max_payload_bytes=LIMIT)[0], tensors)


def test_payload_offsets_are_64_aligned() -> None:
    tensors = [make(torch.uint8, (n,), n) for n in (1, 63, 64, 65, 0, 130)]
    blob = bytearray(codec.encode(tensors).to_bytes())
    header = codec.read_header(blob, max_payload_bytes=LIMIT)
    assert header.payload_offset % ALIGN == 0
    assert all(offset % ALIGN == 0 for offset in header.offsets())
    assert header.offsets() == [0, 64, 128, 192, 320, 320]
    out, _ = codec.decode(blob, max_payload_bytes=LIMIT)
    base = buffer_address(blob)
    for tensor in out:
        assert tensor is not None
        if tensor.numel():  # an empty tensor has no address
            assert (tensor.data_ptr() - base) % ALIGN == 0


def test_split_header_and_payload_decode() -> None:
    tensors = sample()
    enc = codec.encode(tensors, {"m": 1})
    header = codec.read_header(enc.header, max_payload_bytes=LIMIT)
    assert header.payload_offset == len(enc.header)
    assert header.meta == {"m": 1}
    payload = bytearray(b"".join(enc.payload))
    assert all_identical(codec.decode_payload(header, payload), tensors)


def test_decode_payload_accepts_a_uint8_tensor() -> None:
    tensors = sample()
    enc = codec.encode(tensors)
    header = codec.read_header(enc.header, max_payload_bytes=LIMIT)
    storage = torch.frombuffer(bytearray(b"".join(enc.payload)), dtype=torch.uint8)
    out = codec.decode_payload(header, storage)
    assert all_identical(out, tensors)
    assert out[0] is not None
    assert out[0].data_ptr() == storage.data_ptr()


@pytest.mark.parametrize("delta", [-1, 1, -64, 64])
def test_decode_payload_of_wrong_length_raises(delta: int) -> None:
    enc = codec.encode(sample())
    header = codec.read_header(enc.header, max_payload_bytes=LIMIT)
    payload = b"".join(enc.payload)
    payload = payload[:delta] if delta < 0 else payload + bytes(delta)
    with pytest.raises(CodecError, match="truncated" if delta < 0 else "oversized"):
        codec.decode_payload(header, payload)
    with pytest.raises(CodecError):
        codec.decode_payload(header, torch.zeros(len(payload), dtype=torch.uint8))


def test_verify_false_skips_payload_checksum() -> None:
    blob = bytearray(codec.encode([torch.zeros(4, dtype=torch.uint8)]).to_bytes())
    blob[codec.read_header(blob, max_payload_bytes=LIMIT).payload_offset] = 1
    with pytest.raises(CodecError, match="checksum mismatch in tensor 0"):
        codec.decode(blob, max_payload_bytes=LIMIT)
    (tensor,), _ = codec.decode(blob, max_payload_bytes=LIMIT, verify=False)
    assert tensor is not None
    assert tensor.tolist() == [1, 0, 0, 0]


def test_payload_checksum_names_the_corrupt_tensor() -> None:
    blob = bytearray(codec.encode(sample()).to_bytes())
    header = codec.read_header(blob, max_payload_bytes=LIMIT)
    blob[header.payload_offset + header.offsets()[2]] ^= 0x10
    with pytest.raises(CodecError, match="tensor 2"):
        codec.decode(blob, max_payload_bytes=LIMIT)


# --- refusing foreign, corrupt and hostile blobs ------------------------------------------------------


def _refuse_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the codec must never unpickle")

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    monkeypatch.setattr(torch, "load", boom)


def test_pickled_tensor_is_refused_as_foreign_without_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = pickle.dumps(torch.arange(10))
    _refuse_pickle(monkeypatch)
    with pytest.raises(CodecError, match="foreign"):
        codec.decode(blob, max_payload_bytes=LIMIT)


def test_torch_save_blob_is_refused_as_foreign(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    path = tmp_path / "t.pt"
    torch.save(torch.arange(10), path)
    blob = path.read_bytes()
    _refuse_pickle(monkeypatch)
    with pytest.raises(CodecError, match="foreign"):
        codec.decode(blob, max_payload_bytes=LIMIT)


@pytest.mark.parametrize("magic", [b"KVX", b"kvr", b"\x00\x00\x00"])
def test_wrong_magic_is_refused_as_foreign(magic: bytes) -> None:
    blob = bytearray(codec.encode(sample()).to_bytes())
    blob[:3] = magic
    with pytest.raises(CodecError, match="foreign"):
        codec.decode(blob, max_payload_bytes=LIMIT)


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, 255])
def test_other_format_version_is_refused(version: int) -> None:
    blob = bytearray(codec.encode(sample()).to_bytes())
    blob[3] = version
    with pytest.raises(CodecError, match=f"version {version}"):
        codec.decode(blob, max_payload_bytes=LIMIT)


def test_handmade_blob_of_other_version_is_refused() -> None:
    blob = handmade_blob({"v": FORMAT_VERSION, "t": [], "m": {}}, version=FORMAT_VERSION + 1)
    with pytest.raises(CodecError, match="version"):
        codec.decode(blob, max_payload_bytes=LIMIT)


@pytest.mark.parametrize("length", [MAX_HEADER_BYTES + 1, 1 << 20, 0xFFFFFFFF])
def test_header_length_over_limit_is_refused(length: int) -> None:
    blob = bytearray(codec.encode(sample()).to_bytes())
    blob[4:8] = struct.pack("<I", length)
    with pytest.raises(CodecError, match="header claims"):
        codec.decode(blob, max_payload_bytes=LIMIT)


def test_handmade_blob_decodes() -> None:
    payload = bytes(range(6)) + bytes(ALIGN - 6)
    blob = handmade_blob({"v": FORMAT_VERSION, "t": [["uint8", [2, 3], 6, None]], "m": {"x": 1}}, payload)
    (tensor,), meta = codec.decode(blob, max_payload_bytes=LIMIT)
    assert tensor is not None
    assert tensor.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert meta == {"x": 1}


def test_header_crc_mismatch_is_refused() -> None:
    blob = bytearray(handmade_blob({"v": FORMAT_VERSION, "t": [], "m": {}}))
    blob[8] ^= 1
    with pytest.raises(CodecError, match="header checksum"):
        codec.decode(blob, max_payload_bytes=LIMIT)


def _huge_header(nbytes: int = 100 * 10**9) -> dict[str, Any]:
    return {"v": FORMAT_VERSION, "t": [["uint8", [nbytes], nbytes, None]], "m": {}}


def _forbid_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("allocated before refusing")

    for name in ("empty", "zeros", "frombuffer", "from_numpy"):
        monkeypatch.setattr(torch, name, boom)


def test_header_claiming_100gb_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = handmade_blob(_huge_header())
    _forbid_allocation(monkeypatch)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="oversized"):
            codec.decode(blob, max_payload_bytes=1 << 30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_header_claiming_100gb_is_refused_by_read_header(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = handmade_blob(_huge_header())
    _forbid_allocation(monkeypatch)
    with pytest.raises(CodecError, match="100000000000 bytes"):
        codec.read_header(blob, max_payload_bytes=1 << 30)


def test_huge_claim_within_limit_but_missing_payload_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = handmade_blob(_huge_header())
    _forbid_allocation(monkeypatch)
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(blob, max_payload_bytes=1 << 40)


def test_many_huge_tensors_sum_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    each = 1 << 20
    header = {"v": FORMAT_VERSION, "t": [["uint8", [each], each, None]] * MAX_TENSORS, "m": {}}
    _forbid_allocation(monkeypatch)
    with pytest.raises(CodecError, match="oversized"):
        codec.decode(handmade_blob(header), max_payload_bytes=MAX_TENSORS * each - 1)


@pytest.mark.parametrize("name", ["float64", "complex64", "object", "int16", "torch.float32", ""])
def test_unknown_dtype_in_header_is_refused_naming_it(name: str) -> None:
    blob = handmade_blob({"v": FORMAT_VERSION, "t": [[name, [2], 16, None]], "m": {}}, bytes(ALIGN))
    with pytest.raises(CodecError, match=f"unsupported dtype '{name}'"):
        codec.decode(blob, max_payload_bytes=LIMIT)


def test_non_string_dtype_in_header_is_refused() -> None:
    blob = handmade_blob({"v": FORMAT_VERSION, "t": [[7, [2], 2, None]], "m": {}}, bytes(ALIGN))
    with pytest.raises(CodecError, match="unsupported dtype"):
        codec.decode(blob, max_payload_bytes=LIMIT)


@pytest.mark.parametrize(
    ("name", "shape", "nbytes"),
    [
        ("float32", [2, 3], 20), ("float32", [2, 3], 25), ("bfloat16", [4], 4), ("int64", [], 4),
        ("uint8", [0], 1),
    ],
)
def test_shape_and_length_disagreement_is_refused(name: str, shape: list[int], nbytes: int) -> None:
    blob = handmade_blob({"v": FORMAT_VERSION, "t": [[name, shape, nbytes, None]], "m": {}}, bytes(ALIGN))
    with pytest.raises(CodecError, match=f"claims {nbytes}"):
        codec.decode(blob, max_payload_bytes=LIMIT)


@pytest.mark.parametrize(
    "header",
    [
        {"t": [], "m": {}},
        {"v": FORMAT_VERSION + 1, "t": [], "m": {}},
        {"v": FORMAT_VERSION, "t": {}, "m": {}},
        {"v": FORMAT_VERSION, "t": [], "m": [1]},
        {"v": FORMAT_VERSION, "t": [["uint8", [1], 1]], "m": {}},
        {"v": FORMAT_VERSION, "t": ["uint8"], "m": {}},
        {"v": FORMAT_VERSION, "t": [["uint8", [-1], 1, None]], "m": {}},
        {"v": FORMAT_VERSION, "t": [["uint8", "1", 1, None]], "m": {}},
        {"v": FORMAT_VERSION, "t": [["uint8", [1.0], 1, None]], "m": {}},
        {"v": FORMAT_VERSION, "t": [["uint8", [1] * (MAX_DIMS + 1), 1, None]], "m": {}},
        {"v": FORMAT_VERSION, "t": [["uint8", [1], -1, None]], "m": {}},
        {"v": FORMAT_VERSION, "t": [["uint8", [1], 1, "crc"]], "m": {}},
        [FORMAT_VERSION],
        "KVR",
    ],
    ids=["no-version", "inner-version", "t-not-list", "meta-not-map", "3-field", "bare-name", "neg-dim",
         "str-shape", "float-dim", "9-dims", "neg-nbytes", "str-crc", "list-header", "str-header"],
)
def test_malformed_header_fields_are_refused(header: Any) -> None:
    blob = handmade_blob(header, bytes(ALIGN))
    with pytest.raises(CodecError):
        codec.decode(blob, max_payload_bytes=LIMIT)


def test_header_that_is_not_msgpack_is_refused() -> None:
    packed = b"\xc1\xc1\xc1\xc1"  # 0xc1 is never used in msgpack
    blob = struct.pack("<3sBII", MAGIC, FORMAT_VERSION, len(packed), header_checksum(packed)) + packed
    with pytest.raises(CodecError, match="msgpack"):
        codec.decode(blob, max_payload_bytes=LIMIT)


def test_trailing_bytes_after_msgpack_header_are_refused() -> None:
    packed = msgpack.packb({"v": FORMAT_VERSION, "t": [], "m": {}}) + b"\x00"
    blob = struct.pack("<3sBII", MAGIC, FORMAT_VERSION, len(packed), header_checksum(packed)) + packed
    with pytest.raises(CodecError):
        codec.decode(blob, max_payload_bytes=LIMIT)


@pytest.mark.parametrize("blob", [b"", b"KV", b"KVR", b"KVR\x01\x00\x00\x00"], ids=repr)
def test_blob_shorter_than_prefix_is_refused(blob: bytes) -> None:
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(blob, max_payload_bytes=LIMIT)


def test_blob_cut_inside_header_padding_is_refused() -> None:
    blob = codec.encode([None], {"pad": "x"}).to_bytes()
    header = codec.read_header(blob, max_payload_bytes=LIMIT)
    packed_end = 12 + struct.unpack_from("<I", blob, 4)[0]
    assert packed_end < header.payload_offset
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(blob[:packed_end], max_payload_bytes=LIMIT)


# --- property tests -----------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 3), max_size=MAX_DIMS).map(tuple)
tensor_specs = st.one_of(st.none(), st.tuples(st.sampled_from(DTYPE_NAMES), shapes, st.integers(0, 2**31)))
tensor_lists = st.lists(tensor_specs, max_size=5)


def build(specs: list[tuple[str, tuple[int, ...], int] | None]) -> list[torch.Tensor | None]:
    return [None if spec is None else make(DTYPES[spec[0]], spec[1], spec[2]) for spec in specs]


def _decodes_identically_or_refuses(blob: bytes | bytearray, tensors: list[torch.Tensor | None]) -> bool:
    """True when the blob decodes to exactly ``tensors``; False when it raises CodecError."""
    try:
        out, _ = codec.decode(blob, max_payload_bytes=LIMIT)
    except CodecError:
        return False
    assert all_identical(out, tensors), "a damaged blob decoded to different tensors"
    return True


@FAST
@given(specs=tensor_lists, checksum=st.booleans(), writable=st.booleans())
def test_property_round_trip(specs, checksum: bool, writable: bool) -> None:
    tensors = build(specs)
    enc = codec.encode(tensors, {"n": len(specs)}, checksum=checksum)
    assert enc.payload_nbytes == codec.payload_size(tensors)
    blob = enc.to_bytes()
    out, meta = codec.decode(bytearray(blob) if writable else blob, max_payload_bytes=LIMIT)
    assert all_identical(out, tensors)
    assert meta == {"n": len(specs)}


@FAST
@given(specs=tensor_lists, data=st.data())
def test_property_truncation_is_refused(specs, data: st.DataObject) -> None:
    tensors = build(specs)
    blob = codec.encode(tensors).to_bytes()
    cut = data.draw(st.integers(0, len(blob)), label="cut")
    decoded = _decodes_identically_or_refuses(blob[:cut], tensors)
    assert decoded == (cut == len(blob))


@FAST
@given(specs=tensor_lists.filter(lambda s: any(x is not None for x in s)), data=st.data())
def test_property_bit_flips_are_refused_or_harmless(specs, data: st.DataObject) -> None:
    tensors = build(specs)
    blob = bytearray(codec.encode(tensors).to_bytes())
    positions = data.draw(st.lists(st.integers(0, len(blob) * 8 - 1), min_size=1, max_size=8, unique=True))
    for bit in positions:
        blob[bit // 8] ^= 1 << (bit % 8)
    _decodes_identically_or_refuses(bytes(blob), tensors)


@FAST
@given(specs=tensor_lists, data=st.data())
def test_property_single_bit_flip_in_header_is_refused(specs, data: st.DataObject) -> None:
    tensors = build(specs)
    enc = codec.encode(tensors)
    meaningful = 12 + struct.unpack_from("<I", enc.header, 4)[0]  # prefix + msgpack, not the padding
    blob = bytearray(enc.to_bytes())
    bit = data.draw(st.integers(0, meaningful * 8 - 1))
    blob[bit // 8] ^= 1 << (bit % 8)
    assert not _decodes_identically_or_refuses(blob, tensors)


@FAST
@given(specs=tensor_lists.filter(lambda s: any(x is not None and 0 not in x[1] for x in s)), data=st.data())
def test_property_single_bit_flip_in_checked_payload_is_refused(specs, data: st.DataObject) -> None:
    tensors = build(specs)
    blob = bytearray(codec.encode(tensors).to_bytes())
    header = codec.read_header(blob, max_payload_bytes=LIMIT)
    index = data.draw(st.sampled_from([i for i, t in enumerate(tensors) if t is not None and t.numel()]))
    spec = header.specs[index]
    assert spec is not None
    start = header.payload_offset + header.offsets()[index]
    bit = data.draw(st.integers(start * 8, (start + spec.nbytes) * 8 - 1))
    blob[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CodecError, match=f"tensor {index}"):
        codec.decode(blob, max_payload_bytes=LIMIT)


@FAST
@given(garbage=st.binary(max_size=512))
def test_property_garbage_raises_only_codec_error(garbage: bytes) -> None:
    with pytest.raises(CodecError):
        codec.decode(garbage, max_payload_bytes=LIMIT)


@FAST
@given(garbage=st.binary(min_size=1, max_size=256))
def test_property_garbage_after_magic_and_version_raises_only_codec_error(garbage: bytes) -> None:
    with pytest.raises(CodecError):
        codec.decode(MAGIC + bytes([FORMAT_VERSION]) + garbage, max_payload_bytes=LIMIT)


@FAST
@given(specs=tensor_lists, data=st.data())
def test_property_random_bytes_after_valid_prefix(specs, data: st.DataObject) -> None:
    tensors = build(specs)
    blob = codec.encode(tensors).to_bytes()
    cut = data.draw(st.integers(0, len(blob)), label="cut")
    tail = data.draw(st.binary(min_size=1, max_size=200), label="tail")
    damaged = blob[:cut] + tail
    decoded = _decodes_identically_or_refuses(damaged, tensors)
    if cut == len(blob):
        assert not decoded  # extra bytes after a whole blob are never ignored


def legacy_blob(tensors: list[torch.Tensor | None], meta: dict[str, Any] | None = None) -> bytes:
    """A blob as kvredis wrote it before format 2: CRC32 of the header and of each tensor's bytes."""
    descriptors: list[Any] = []
    payload = b""
    for tensor in tensors:
        if tensor is None:
            descriptors.append(None)
            continue
        data = as_bytes(tensor).numpy().tobytes()
        name = next(n for n, d in DTYPES.items() if d == tensor.dtype)
        descriptors.append([name, list(tensor.shape), len(data), zlib.crc32(data)])
        payload += data + bytes(-len(data) % ALIGN)
    return handmade_blob({"v": 1, "t": descriptors, "m": meta or {}}, payload, version=1)


def test_writes_format_2_with_xxh3_checksums() -> None:
    tensors = sample()
    blob = codec.encode(tensors).to_bytes()
    assert blob[3] == FORMAT_VERSION == 2
    header = codec.read_header(blob, max_payload_bytes=LIMIT)
    assert header.version == 2
    for spec, tensor in zip(header.specs, tensors, strict=True):
        if tensor is not None:
            assert spec is not None
            assert spec.crc == xxhash.xxh3_64_intdigest(as_bytes(tensor).numpy().tobytes())


def test_reads_format_1_entries_of_earlier_kvredis() -> None:
    tensors = sample()
    blob = legacy_blob(tensors, {"id": "x"})
    decoded, meta = codec.decode(blob, max_payload_bytes=LIMIT)
    assert all_identical(decoded, tensors)
    assert meta == {"id": "x"}
    assert codec.read_header(blob, max_payload_bytes=LIMIT).version == 1


def test_format_1_payload_corruption_is_caught_by_its_crc32() -> None:
    blob = bytearray(legacy_blob(sample()))
    header = codec.read_header(blob, max_payload_bytes=LIMIT)
    blob[header.payload_offset] ^= 0x01
    with pytest.raises(CodecError, match="checksum mismatch in tensor 0"):
        codec.decode(blob, max_payload_bytes=LIMIT)


def test_format_1_header_corruption_and_truncation_are_refused() -> None:
    blob = legacy_blob(sample())
    damaged = bytearray(blob)
    damaged[struct.calcsize("<3sBII") + 1] ^= 0x01
    with pytest.raises(CodecError, match="header checksum"):
        codec.decode(damaged, max_payload_bytes=LIMIT)
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(blob[:-1], max_payload_bytes=LIMIT)
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(blob[:20], max_payload_bytes=LIMIT)


def test_a_format_2_blob_relabelled_format_1_is_refused() -> None:
    blob = bytearray(codec.encode(sample()).to_bytes())
    blob[3] = 1  # its header checksum is XXH3's, not CRC32's
    with pytest.raises(CodecError, match="header checksum"):
        codec.decode(blob, max_payload_bytes=LIMIT)


def test_format_1_prefix_with_format_2_header_is_refused() -> None:
    blob = handmade_blob({"v": 2, "t": [], "m": {}}, version=1)
    with pytest.raises(CodecError, match="lacks version"):
        codec.decode(blob, max_payload_bytes=LIMIT)


def test_unknown_format_is_refused_naming_the_readable_ones() -> None:
    blob = handmade_blob({"v": 3, "t": [], "m": {}}, version=3)
    with pytest.raises(CodecError, match=r"format version 3; this kvredis reads versions 1 and 2"):
        codec.decode(blob, max_payload_bytes=LIMIT)


@pytest.mark.parametrize("size", [0, 5, 4 << 20, (4 << 20) + 1, (9 << 20) + 77])
def test_the_stepped_xxh3_equals_xxhashs_one_call(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert codec.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)
    assert codec.CHECKSUMS[2] is codec.xxh3_64


def test_checksums_computed_beforehand_give_the_same_blob() -> None:
    frames = codec.Frames.of(sample())
    meta = {"id": "0123456789abcdef"}
    crcs = frames.checksums()
    assert frames.encode(meta, crcs=crcs).to_bytes() == frames.encode(meta).to_bytes()
    assert len(crcs) == len(frames.views)
    with pytest.raises(ValueError, match="checksums for"):
        frames.encode(meta, crcs=crcs[:-1])


def test_a_slice_of_pages_goes_out_as_its_runs_without_a_copy() -> None:
    # A chunk's pages: a slice along dimension 1 of [layers, pages, ...]; each layer's run is contiguous.
    pages = torch.randn(4, 6, 2, 16, 256).to(torch.bfloat16)
    chunk = pages[:, 2:4]
    parts = codec.tensor_parts(chunk)
    assert len(parts) == 4 and all(part.nbytes == 2 * 2 * 16 * 256 * 2 for part in parts)
    assert b"".join(parts) == chunk.contiguous().view(torch.uint8).numpy().tobytes()
    pages[1, 2, 0, 0, 0] = 7.0  # the parts are the pages' own memory
    assert bytes(parts[1][:2]) == pages[1, 2, 0, 0, 0:1].view(torch.uint8).numpy().tobytes()
    frames = codec.Frames.of([chunk])
    whole = codec.Frames.of([chunk.contiguous()])
    assert frames.encode({"k": 1}).to_bytes() == whole.encode({"k": 1}).to_bytes()
    tensors, _ = codec.decode(frames.encode().to_bytes(), max_payload_bytes=LIMIT)
    assert torch.equal(tensors[0], chunk)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 5, 6, 4096)[:, ::2],  # two strided dimensions: a run per (i, j)
    lambda: torch.randn(4096, 8).t(),  # runs of one element: copied once instead
    lambda: torch.randn(1, 8192).expand(3, 8192),  # a stride of 0: the same run three times
    lambda: torch.randn(3, 5, 8)[:, 1:3],  # runs shorter than the threshold: copied
])
def test_any_strided_tensor_gives_its_bytes_in_row_major_order(make) -> None:
    tensor = make()
    assert b"".join(codec.tensor_parts(tensor)) == tensor.contiguous().numpy().tobytes()
    tensors, _ = codec.decode(codec.encode([tensor]).to_bytes(), max_payload_bytes=LIMIT)
    assert torch.equal(tensors[0], tensor)
