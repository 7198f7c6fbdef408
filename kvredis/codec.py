"""Tensors to and from kvredis blobs: a small msgpack header, then the raw payload.

Layout of a blob::

    b"KVR" | version (1 byte) | header length (u32 LE) | header checksum (u32 LE) | msgpack header
    | zero padding to a 64-byte boundary | payload

The header lists each tensor (dtype, shape, byte length, checksum of its bytes, or nil for an absent
tensor) and a small metadata map. The version says which checksum: version 2 (written) uses xxHash's
XXH3-64 (the low 32 bits of it for the header), which runs at memory speed on every platform's wheel;
version 1 (read, for entries written by earlier kvredis) used zlib's CRC32. Other versions are refused.

Each tensor's payload starts on a 64-byte boundary, so decoding is a ``torch.frombuffer`` view at an
offset: the payload is never copied when the buffer is writable. Writers get the header and payload
as separate buffers and never join them. Nothing is unpickled; the header is decoded with msgpack
limits, and sizes are checked before anything is allocated.
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import xxhash

from kvredis.errors import CodecError

MAGIC = b"KVR"
ALIGN = 64
MAX_HEADER_BYTES = 64 << 10
MAX_DIMS = 8
MAX_TENSORS = 16
_PREFIX = struct.Struct("<3sBII")
_ZEROS = memoryview(bytes(ALIGN))

Checksum = Callable[[Any], int]
"""A payload checksum: bytes-like in, unsigned integer out."""

FORMAT_VERSION = 2
"""The blob format written: XXH3-64 checksums."""

_STEP = 1 << 20


def xxh3_64(data: Any) -> int:
    """XXH3-64 of ``data``, 1 MiB at a time for large buffers, letting other threads run in between.

    xxhash holds the GIL while it hashes; one 16 MiB call would keep every other thread (their sockets
    ready) waiting for it. Same value as ``xxhash.xxh3_64_intdigest(data)``.
    """
    view = memoryview(data).cast("B")
    if view.nbytes <= 4 * _STEP:
        return xxhash.xxh3_64_intdigest(view)
    hasher = xxhash.xxh3_64()
    for start in range(0, view.nbytes, _STEP):
        hasher.update(view[start:start + _STEP])
        time.sleep(0)  # gives the GIL up: a thread whose reply has arrived runs now, not in 5 ms
    return hasher.intdigest()


CHECKSUMS: dict[int, Checksum] = {
    1: zlib.crc32,  # kvredis before format 2; still read, never written (zlib gives the GIL up itself)
    2: xxh3_64,
}
"""The payload checksum of each readable format version."""


def header_checksum(version: int, packed: bytes | memoryview) -> int:
    """The 32-bit checksum of a packed header in format ``version``."""
    return CHECKSUMS[version](packed) & 0xFFFFFFFF


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    # Not KV dtypes, but every entry carries its token IDs and roi mask.
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_WRITE_CHECKSUM = CHECKSUMS[FORMAT_VERSION]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    """What the header says of one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    crc: int | None  # the checksum of its bytes, in the header's format version


@dataclass(frozen=True)
class Header:
    """A decoded header: the tensors' specs, the metadata map and where the payload starts."""

    specs: tuple[TensorSpec | None, ...]
    meta: dict[str, Any]
    payload_offset: int
    version: int = FORMAT_VERSION

    @property
    def checksum(self) -> Checksum:
        """The function that computed the specs' checksums (the format version's)."""
        return CHECKSUMS[self.version]

    @property
    def payload_nbytes(self) -> int:
        """Length of the payload that follows the header, padding included."""
        return _payload_span(self.specs)

    def offsets(self) -> list[int]:
        """Where each tensor's bytes start within the payload (absent tensors take none)."""
        result, position = [], 0
        for spec in self.specs:
            result.append(position)
            if spec is not None:
                position += _aligned(spec.nbytes)
        return result


def _payload_span(specs: Sequence[TensorSpec | None]) -> int:
    return sum(_aligned(spec.nbytes) for spec in specs if spec is not None)


@dataclass
class Encoded:
    """An encoded blob as separate buffers: ``header`` then ``payload`` frames (padding included)."""

    header: bytes
    payload: list[memoryview] = field(default_factory=list)

    @property
    def payload_nbytes(self) -> int:
        """Total payload length."""
        return sum(frame.nbytes for frame in self.payload)

    @property
    def nbytes(self) -> int:
        """Total blob length."""
        return len(self.header) + self.payload_nbytes

    def to_bytes(self) -> bytes:
        """The whole blob in one buffer (a copy: meant for small blobs)."""
        return b"".join([self.header, *self.payload])


def payload_size(tensors: Sequence[torch.Tensor | None]) -> int:
    """The payload length :func:`encode` would produce for ``tensors``, padding included."""
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors if t is not None)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (made contiguous first if it is not)."""
    # As few torch calls as possible: each costs microseconds, which small entries feel.
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    elif tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def encode(
    tensors: Sequence[torch.Tensor | None],
    meta: Mapping[str, Any] | None = None,
    *,
    checksum: bool = True,
    max_payload_bytes: int | None = None,
) -> Encoded:
    """Encode CPU tensors (``None`` for an absent one) and a metadata map, without copying payloads."""
    if len(tensors) > MAX_TENSORS:
        raise CodecError(f"at most {MAX_TENSORS} tensors per blob, got {len(tensors)}")
    descriptors: list[list[Any] | None] = []
    payload: list[memoryview] = []
    for index, tensor in enumerate(tensors):
        if tensor is None:
            descriptors.append(None)
            continue
        if not isinstance(tensor, torch.Tensor):
            raise CodecError(f"tensor {index} is a {type(tensor).__name__}, not a torch.Tensor")
        name = _DTYPE_NAMES.get(tensor.dtype)
        if name is None:
            raise CodecError(f"tensor {index} has dtype {tensor.dtype}, not one of {', '.join(DTYPES)}")
        if tensor.dim() > MAX_DIMS:
            raise CodecError(f"tensor {index} has {tensor.dim()} dimensions, at most {MAX_DIMS} allowed")
        if not tensor.is_cpu:
            tensor = tensor.to("cpu")
        data = tensor_bytes(tensor)
        crc = _WRITE_CHECKSUM(data) if checksum else None
        descriptors.append([name, list(tensor.shape), data.nbytes, crc])
        payload.append(data)
        padding = _aligned(data.nbytes) - data.nbytes
        if padding:
            payload.append(_ZEROS[:padding])
    total = sum(frame.nbytes for frame in payload)
    if max_payload_bytes is not None and total > max_payload_bytes:
        raise CodecError(f"payload of {total} bytes exceeds the limit of {max_payload_bytes}")
    try:
        packed = msgpack.packb({"v": FORMAT_VERSION, "t": descriptors, "m": dict(meta or {})})
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"metadata cannot be encoded: {exc}") from None
    if len(packed) > MAX_HEADER_BYTES:
        raise CodecError(f"header of {len(packed)} bytes exceeds {MAX_HEADER_BYTES}")
    # Refuse here what the reader's limits would refuse, so that nothing written is unreadable.
    _unpack_header(packed)
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(packed), header_checksum(FORMAT_VERSION, packed)) + packed
    head += bytes(_aligned(len(head)) - len(head))
    return Encoded(head, payload)


def read_header(blob: bytes | bytearray | memoryview, *, max_payload_bytes: int) -> Header:
    """Parse and validate the header at the start of ``blob`` (the payload may be elsewhere)."""
    view = memoryview(blob).cast("B")
    if view.nbytes < _PREFIX.size:
        raise CodecError(f"truncated blob: {view.nbytes} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, length, crc = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"foreign blob: starts with {bytes(view[:3])!r}, not {MAGIC!r}")
    if version not in CHECKSUMS:
        readable = " and ".join(str(v) for v in CHECKSUMS)
        raise CodecError(f"blob has format version {version}; this kvredis reads versions {readable}")
    if length > MAX_HEADER_BYTES:
        raise CodecError(f"header claims {length} bytes, more than the {MAX_HEADER_BYTES} allowed")
    end = _PREFIX.size + length
    if view.nbytes < end:
        raise CodecError(f"truncated blob: header needs {end} bytes, blob has {view.nbytes}")
    packed = view[_PREFIX.size:end]
    if header_checksum(version, packed) != crc:
        raise CodecError("corrupt blob: header checksum mismatch")
    raw = _unpack_header(bytes(packed))
    specs = _parse_specs(raw, version)
    meta = raw.get("m", {})
    if not isinstance(meta, dict):
        raise CodecError("corrupt blob: metadata is not a map")
    span = _payload_span(specs)
    if span > max_payload_bytes:
        raise CodecError(f"oversized blob: payload of {span} bytes exceeds the limit of {max_payload_bytes}")
    return Header(specs, meta, _aligned(end), version)


def _unpack_header(packed: bytes) -> Any:
    """msgpack-decode a header with size limits, so a hostile one cannot make it allocate much."""
    try:
        return msgpack.unpackb(
            packed, raw=False, strict_map_key=True, max_str_len=4096, max_bin_len=4096,
            max_array_len=MAX_TENSORS * 4 + MAX_DIMS, max_map_len=64, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many unrelated types for malformed input.
        raise CodecError(f"corrupt blob: header is not valid msgpack ({type(exc).__name__})") from None


def _parse_specs(raw: Any, version: int) -> tuple[TensorSpec | None, ...]:
    if not isinstance(raw, dict) or raw.get("v") != version or not isinstance(raw.get("t"), list):
        raise CodecError("corrupt blob: header lacks version and tensor list")
    if len(raw["t"]) > MAX_TENSORS:
        raise CodecError(f"corrupt blob: {len(raw['t'])} tensors, at most {MAX_TENSORS} allowed")
    specs: list[TensorSpec | None] = []
    for index, item in enumerate(raw["t"]):
        if item is None:
            specs.append(None)
            continue
        if not (isinstance(item, list) and len(item) == 4):
            raise CodecError(f"corrupt blob: tensor {index} descriptor is malformed")
        name, shape, nbytes, crc = item
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise CodecError(f"unsupported dtype {name!r} for tensor {index}")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
                and all(type(d) is int and d >= 0 for d in shape)):
            raise CodecError(f"corrupt blob: tensor {index} has an invalid shape {shape!r}")
        if type(nbytes) is not int or nbytes < 0 or not (crc is None or isinstance(crc, int)):
            raise CodecError(f"corrupt blob: tensor {index} has an invalid length or checksum")
        numel = 1
        for dim in shape:
            numel *= dim
        expected = numel * dtype.itemsize
        if expected != nbytes:
            raise CodecError(
                f"shape {shape} of {name} needs {expected} bytes but tensor {index} claims {nbytes}"
            )
        specs.append(TensorSpec(dtype, tuple(shape), nbytes, crc))
    return tuple(specs)


def decode_payload(
    header: Header, payload: bytes | bytearray | memoryview | torch.Tensor, *, verify: bool = True
) -> list[torch.Tensor | None]:
    """The tensors of ``header`` over ``payload``: views when it is writable, else one copy of it."""
    if isinstance(payload, torch.Tensor):
        storage = payload.reshape(-1).view(torch.uint8)
        view = tensor_bytes(storage) if verify else None
    else:
        view = memoryview(payload).cast("B")
        if view.nbytes != header.payload_nbytes:
            problem = "truncated" if view.nbytes < header.payload_nbytes else "oversized"
            raise CodecError(
                f"{problem} blob: payload is {view.nbytes} bytes, header says {header.payload_nbytes}"
            )
        if view.readonly:
            # A tensor over immutable bytes would let a caller write into a Python bytes object.
            storage = torch.empty(view.nbytes, dtype=torch.uint8)
            if view.nbytes:
                storage.numpy().data.cast("B")[:] = view
        elif view.nbytes:
            storage = torch.frombuffer(view, dtype=torch.uint8)
        else:
            storage = torch.empty(0, dtype=torch.uint8)
    if storage.numel() != header.payload_nbytes:
        raise CodecError(f"payload is {storage.numel()} bytes, header says {header.payload_nbytes}")
    checksum = header.checksum
    tensors: list[torch.Tensor | None] = []
    for index, (spec, offset) in enumerate(zip(header.specs, header.offsets(), strict=True)):
        if spec is None:
            tensors.append(None)
            continue
        # Over the bytes as they arrived (a memoryview slice: no tensor made to check them).
        if (verify and spec.crc is not None and view is not None
                and checksum(view[offset:offset + spec.nbytes]) != spec.crc):
            raise CodecError(f"corrupt blob: checksum mismatch in tensor {index}")
        tensors.append(storage[offset:offset + spec.nbytes].view(spec.dtype).reshape(spec.shape))
    return tensors


def decode(
    blob: bytes | bytearray | memoryview, *, max_payload_bytes: int, verify: bool = True
) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    """Decode a whole blob into its tensors and metadata map."""
    header = read_header(blob, max_payload_bytes=max_payload_bytes)
    view = memoryview(blob).cast("B")
    if view.nbytes < header.payload_offset:
        raise CodecError(f"truncated blob: {view.nbytes} bytes ends inside the header padding")
    return decode_payload(header, view[header.payload_offset:], verify=verify), header.meta
