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
import sys
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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

_xxh3_64_intdigest = xxhash.xxh3_64_intdigest


def xxh3_64(data: Any) -> int:
    """XXH3-64 of ``data``, in one call: xxhash (3.0 and later, which kvredis requires) gives the GIL up
    while it hashes, so other threads run meanwhile.

    It used to be stepped 1 MiB at a time with a ``time.sleep(0)`` between steps, on the belief that xxhash
    held the GIL; each of those sleeps cost 50-70 µs on the test VM, about 9 ms per 128 MiB hashed.
    """
    return _xxh3_64_intdigest(data)


CHECKSUMS: dict[int, Checksum] = {
    1: zlib.crc32,  # kvredis before format 2; still read, never written (zlib gives the GIL up itself)
    2: xxh3_64,
}
"""The payload checksum of each readable format version."""


def _parts_checksum(parts: Sequence[memoryview]) -> int:
    """:func:`xxh3_64` of the parts' bytes joined (without joining them)."""
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


def parts_checksum(version: int, parts: Sequence[memoryview]) -> int:
    """The payload checksum of format ``version`` of the parts' bytes joined (without joining them): a
    chunk received into an engine's blocks is checked where it lies."""
    if len(parts) == 1:
        return CHECKSUMS[version](parts[0])
    if version == 1:
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return crc
    return _parts_checksum(parts)


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
# A dtype's attribute costs a torch call; these lookups do not.
_ITEMSIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
_ITEMSIZE_OF = {dtype: dtype.itemsize for dtype in DTYPES.values()}
_WRITE_CHECKSUM = CHECKSUMS[FORMAT_VERSION]
# Flat memoryviews (an entry's token IDs and roi mask, which kvredis.store.keys keeps as such) are written as
# the tensor dtype of their format; native formats are little-endian only on little-endian hosts.
_VIEW_DTYPES = {"q": "int64", "i": "int32", "b": "int8", "B": "uint8", "?": "bool"}
if sys.byteorder != "little":
    _VIEW_DTYPES = {}
# The reader's msgpack limits (_unpack_header) and what a flat metadata map may hold to stay within them
# for sure; other maps are checked by decoding the packed header.
_MAX_STR_BYTES = 4096
_MAX_MAP_LEN = 64
_SCALARS = (int, float, bool, type(None))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class TensorSpec(NamedTuple):
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
    # Derived from specs (each read uses them several times; read_header has them already): where each
    # tensor starts within the payload, and the payload's length, padding included.
    starts: tuple[int, ...] = field(default=(), repr=False, compare=False)
    payload_nbytes: int = field(default=-1, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.payload_nbytes < 0:
            starts, position = _layout(self.specs)
            object.__setattr__(self, "starts", starts)
            object.__setattr__(self, "payload_nbytes", position)

    @property
    def checksum(self) -> Checksum:
        """The function that computed the specs' checksums (the format version's)."""
        return CHECKSUMS[self.version]

    def offsets(self) -> list[int]:
        """Where each tensor's bytes start within the payload (absent tensors take none)."""
        return list(self.starts)


def _layout(specs: Sequence[TensorSpec | None]) -> tuple[tuple[int, ...], int]:
    """Where each tensor starts within the payload, and the payload's length (padding included)."""
    starts, position = [], 0
    for spec in specs:
        starts.append(position)
        if spec is not None:
            position += (spec.nbytes + ALIGN - 1) & -ALIGN
    return tuple(starts), position


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


def payload_size(tensors: Sequence[torch.Tensor | memoryview[Any] | None]) -> int:
    """The payload length :func:`encode` would produce for ``tensors``, padding included."""
    return sum(_aligned(t.nbytes if isinstance(t, memoryview) else t.numel() * t.element_size())
               for t in tensors if t is not None)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (made contiguous first if it is not)."""
    # The common case in two torch calls (each costs microseconds, which small entries feel); whatever
    # that refuses (not contiguous, needing grad, 0-d, on another device) is handled below.
    try:
        return memoryview(tensor.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        pass
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.to("cpu")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    elif tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


# A tensor whose bytes are contiguous only in runs (pages sliced along dimension 1 of [layers, pages, ...])
# goes out as those runs, without a copy, when each run is at least this long and there are at most
# _MAX_PARTS of them; otherwise it is copied once into contiguous memory (a copy costs less than many iovecs).
_MIN_PART_BYTES = 16 << 10
_MAX_PARTS = 4096


def tensor_parts(tensor: torch.Tensor) -> list[memoryview]:
    """A CPU tensor's bytes in row-major order as contiguous byte views: one view of a contiguous tensor;
    for a tensor whose trailing dimensions are contiguous but whose leading ones are strided (a chunk's
    slice of a prompt's pages), one view per run, none of them a copy. Anything else is copied once, as
    :func:`tensor_bytes` does."""
    try:
        return [memoryview(tensor.view(torch.uint8).numpy()).cast("B")]  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        pass
    runs = _strided_runs(tensor)
    if runs is None:
        return [tensor_bytes(tensor)]
    span, starts, run_nbytes = runs
    # One view over every byte the tensor spans (gaps included), then a slice per run.
    whole = tensor_bytes(torch.as_strided(tensor, (span,), (1,)))
    return [whole[start:start + run_nbytes] for start in starts]


def _strided_runs(tensor: torch.Tensor) -> tuple[int, list[int], int] | None:
    """For a CPU tensor made of contiguous runs: the elements it spans from its first, each run's byte
    offset within them, and a run's bytes; ``None`` when it is not such a tensor or the runs are too short
    or too many for :func:`tensor_parts`."""
    if not tensor.is_cpu or tensor.requires_grad or tensor.dim() < 2 or tensor.numel() == 0:
        return None
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    # The trailing dimensions that are laid out contiguously: the run.
    run, split = 1, tensor.dim()
    while split > 0 and (shape[split - 1] == 1 or strides[split - 1] == run):
        run *= shape[split - 1]
        split -= 1
    itemsize = tensor.element_size()
    count = 1
    for size in shape[:split]:
        count *= size
    if split == 0 or count > _MAX_PARTS or run * itemsize < _MIN_PART_BYTES:
        return None
    if any(stride < 0 for stride in strides):
        return None
    starts = [0]
    for size, stride in zip(shape[:split], strides[:split], strict=True):  # row-major: the first slowest
        starts = [start + i * stride for start in starts for i in range(size)]
    span = max(starts) + run
    return span, [start * itemsize for start in starts], run * itemsize


@dataclass
class Frames:
    """Tensors as byte views, checked and ready for :meth:`encode` (sized before anything is hashed)."""

    descriptors: list[list[Any] | None]  # [dtype name, shape, byte length] of each tensor, None if absent
    views: list[list[memoryview]]  # each present tensor's bytes, in order, as contiguous parts (usually one)
    nbytes: int  # payload length, padding included

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor | memoryview[Any] | None]) -> Frames:
        """Check ``tensors`` (CPU or other device; ``None`` for an absent one) and view their bytes."""
        if len(tensors) > MAX_TENSORS:
            raise CodecError(f"at most {MAX_TENSORS} tensors per blob, got {len(tensors)}")
        descriptors: list[list[Any] | None] = []
        views: list[list[memoryview]] = []
        total = 0
        for index, tensor in enumerate(tensors):
            if tensor is None:
                descriptors.append(None)
                continue
            if isinstance(tensor, memoryview):
                name = _VIEW_DTYPES.get(tensor.format)
                if name is None or not tensor.c_contiguous:
                    raise CodecError(f"tensor {index} is a memoryview of format {tensor.format!r}, not a "
                                     f"torch.Tensor or a contiguous view of {', '.join(_VIEW_DTYPES)}")
                shape = list(tensor.shape or ())
                parts = [tensor.cast("B")]
            else:
                if not isinstance(tensor, torch.Tensor):
                    raise CodecError(f"tensor {index} is a {type(tensor).__name__}, not a torch.Tensor")
                name = _DTYPE_NAMES.get(tensor.dtype)
                if name is None:
                    raise CodecError(
                        f"tensor {index} has dtype {tensor.dtype}, not one of {', '.join(DTYPES)}")
                shape = list(tensor.shape)
                parts = tensor_parts(tensor)
            if len(shape) > MAX_DIMS:
                raise CodecError(f"tensor {index} has {len(shape)} dimensions, at most {MAX_DIMS} allowed")
            nbytes = sum(part.nbytes for part in parts)
            descriptors.append([name, shape, nbytes])
            views.append(parts)
            total += _aligned(nbytes)
        return cls(descriptors, views, total)

    def payload(self) -> list[memoryview]:
        """The payload as buffers: each view, then its zero padding to the next 64-byte boundary."""
        payload: list[memoryview] = []
        for parts in self.views:
            payload += parts
            nbytes = sum(part.nbytes for part in parts)
            padding = _aligned(nbytes) - nbytes
            if padding:
                payload.append(_ZEROS[:padding])
        return payload

    def checksums(self) -> list[int]:
        """Each view's checksum, as :meth:`encode` writes it (format :data:`FORMAT_VERSION`)."""
        return [_WRITE_CHECKSUM(parts[0]) if len(parts) == 1 else _parts_checksum(parts)
                for parts in self.views]

    def encode(
        self, meta: Mapping[str, Any] | None = None, *, checksum: bool = True,
        crcs: Sequence[int] | None = None,
    ) -> Encoded:
        """The blob of these frames and ``meta``: the header, then the views with their padding.

        ``crcs`` are the views' :meth:`checksums` when they were computed already (elsewhere, meanwhile).
        """
        if crcs is None:
            crcs = self.checksums() if checksum else [None] * len(self.views)  # type: ignore[list-item]
        elif len(crcs) != len(self.views):
            raise ValueError(f"{len(crcs)} checksums for {len(self.views)} tensors")
        each = iter(crcs)
        descriptors = [None if d is None else [*d, next(each)] for d in self.descriptors]
        meta = dict(meta or {})
        try:
            packed = msgpack.packb({"v": FORMAT_VERSION, "t": descriptors, "m": meta})
        except (TypeError, ValueError, OverflowError) as exc:
            raise CodecError(f"metadata cannot be encoded: {exc}") from None
        if len(packed) > MAX_HEADER_BYTES:
            raise CodecError(f"header of {len(packed)} bytes exceeds {MAX_HEADER_BYTES}")
        # Refuse here what the reader's limits would refuse, so that nothing written is unreadable. The
        # tensor list is within them by construction (Frames.of); a flat map of short strings and scalars
        # is too, which a look at it proves without decoding the header.
        if not _fits_reader_limits(meta):
            _unpack_header(packed)
        crc = header_checksum(FORMAT_VERSION, packed)
        head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(packed), crc) + packed
        head += bytes(_aligned(len(head)) - len(head))
        return Encoded(head, self.payload())


class ChecksumsAhead:
    """The :meth:`Frames.checksums` of several frames, computed in order on a thread of their own, so that a
    writer sends one blob while the next is hashed (xxhash and socket writes both give the GIL up)."""

    def __init__(self, frames: Sequence[Frames]) -> None:
        self._frames = list(frames)
        self._results: list[list[int] | None] = [None] * len(self._frames)
        self._ready = [threading.Event() for _ in self._frames]
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvredis-checksum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for index, frames in enumerate(self._frames):
            try:
                if not self._stopped and self._error is None:
                    self._results[index] = frames.checksums()
            except BaseException as exc:  # handed to get(): the thread never dies silently
                self._error = exc
            finally:
                self._ready[index].set()

    def get(self, index: int) -> list[int]:
        """Frames ``index``'s checksums, once computed; the hashing's exception, raised here, if it failed."""
        self._ready[index].wait()
        if self._error is not None:
            raise self._error
        result = self._results[index]
        if result is None:
            raise RuntimeError("checksums asked for after close()")
        return result

    def close(self) -> None:
        """Stop hashing and wait for the thread: it never outlives the call whose tensors it reads."""
        self._stopped = True
        self._thread.join()


def _fits_reader_limits(meta: dict[str, Any]) -> bool:
    """Whether ``meta`` certainly packs within :func:`_unpack_header`'s limits (``False``: maybe not)."""
    if len(meta) > _MAX_MAP_LEN:
        return False
    for key, value in meta.items():
        # UTF-8 takes at most 4 bytes a character.
        if type(key) is not str or len(key) * 4 > _MAX_STR_BYTES:
            return False
        if type(value) is str:
            if len(value) * 4 > _MAX_STR_BYTES:
                return False
        elif type(value) not in _SCALARS:
            return False
    return True


def encode(
    tensors: Sequence[torch.Tensor | memoryview[Any] | None],
    meta: Mapping[str, Any] | None = None,
    *,
    checksum: bool = True,
    max_payload_bytes: int | None = None,
) -> Encoded:
    """Encode CPU tensors (``None`` for an absent one) and a metadata map, without copying payloads.

    A flat C-contiguous memoryview of a native integer or bool format may stand for a tensor of that dtype.
    """
    frames = Frames.of(tensors)
    if max_payload_bytes is not None and frames.nbytes > max_payload_bytes:
        raise CodecError(f"payload of {frames.nbytes} bytes exceeds the limit of {max_payload_bytes}")
    return frames.encode(meta, checksum=checksum)


def read_header(blob: bytes | bytearray | memoryview, *, max_payload_bytes: int) -> Header:
    """Parse and validate the header at the start of ``blob`` (the payload may be elsewhere)."""
    view = memoryview(blob).cast("B")
    if view.nbytes < _PREFIX.size:
        raise CodecError(f"truncated blob: {view.nbytes} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, length, crc = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"foreign blob: starts with {bytes(view[:3])!r}, not {MAGIC!r}")
    checksum = CHECKSUMS.get(version)
    if checksum is None:
        readable = " and ".join(str(v) for v in CHECKSUMS)
        raise CodecError(f"blob has format version {version}; this kvredis reads versions {readable}")
    if length > MAX_HEADER_BYTES:
        raise CodecError(f"header claims {length} bytes, more than the {MAX_HEADER_BYTES} allowed")
    end = _PREFIX.size + length
    if view.nbytes < end:
        raise CodecError(f"truncated blob: header needs {end} bytes, blob has {view.nbytes}")
    packed = view[_PREFIX.size:end]
    if checksum(packed) & 0xFFFFFFFF != crc:
        raise CodecError("corrupt blob: header checksum mismatch")
    raw = _unpack_header(packed)
    specs, starts, span = _parse_specs(raw, version)
    meta = raw.get("m", {})
    if not isinstance(meta, dict):
        raise CodecError("corrupt blob: metadata is not a map")
    if span > max_payload_bytes:
        raise CodecError(f"oversized blob: payload of {span} bytes exceeds the limit of {max_payload_bytes}")
    return Header(specs, meta, (end + ALIGN - 1) & -ALIGN, version, starts, span)


def _unpack_header(packed: bytes | memoryview) -> Any:
    """msgpack-decode a header with size limits, so a hostile one cannot make it allocate much."""
    try:
        return msgpack.unpackb(
            packed, raw=False, strict_map_key=True, max_str_len=4096, max_bin_len=4096,
            max_array_len=MAX_TENSORS * 4 + MAX_DIMS, max_map_len=64, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many unrelated types for malformed input.
        raise CodecError(f"corrupt blob: header is not valid msgpack ({type(exc).__name__})") from None


def _parse_specs(raw: Any, version: int) -> tuple[tuple[TensorSpec | None, ...], tuple[int, ...], int]:
    """The header's tensor specs, where each starts within the payload, and the payload's length."""
    if not isinstance(raw, dict) or raw.get("v") != version or not isinstance(raw.get("t"), list):
        raise CodecError("corrupt blob: header lacks version and tensor list")
    items = raw["t"]
    if len(items) > MAX_TENSORS:
        raise CodecError(f"corrupt blob: {len(items)} tensors, at most {MAX_TENSORS} allowed")
    specs: list[TensorSpec | None] = []
    starts: list[int] = []
    position = 0
    for index, item in enumerate(items):
        starts.append(position)
        if item is None:
            specs.append(None)
            continue
        if not (type(item) is list and len(item) == 4):
            raise CodecError(f"corrupt blob: tensor {index} descriptor is malformed")
        name, shape, nbytes, crc = item
        expected = _ITEMSIZES.get(name) if type(name) is str else None
        if expected is None:
            raise CodecError(f"unsupported dtype {name!r} for tensor {index}")
        if not (type(shape) is list and len(shape) <= MAX_DIMS):
            raise CodecError(f"corrupt blob: tensor {index} has an invalid shape {shape!r}")
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise CodecError(f"corrupt blob: tensor {index} has an invalid shape {shape!r}")
            expected *= dim
        if type(nbytes) is not int or nbytes < 0 or not (crc is None or type(crc) is int):
            raise CodecError(f"corrupt blob: tensor {index} has an invalid length or checksum")
        if expected != nbytes:
            raise CodecError(
                f"shape {shape} of {name} needs {expected} bytes but tensor {index} claims {nbytes}"
            )
        specs.append(TensorSpec(DTYPES[name], tuple(shape), nbytes, crc))
        position += (nbytes + ALIGN - 1) & -ALIGN
    return tuple(specs), tuple(starts), position


def decode_payload(
    header: Header, payload: bytes | bytearray | memoryview | torch.Tensor, *, verify: bool = True
) -> list[torch.Tensor | None]:
    """The tensors of ``header`` over ``payload``: views when it is writable, else one copy of it."""
    span = header.payload_nbytes
    storage: torch.Tensor | None = None
    if isinstance(payload, torch.Tensor):
        storage = payload.reshape(-1).view(torch.uint8)
        view = tensor_bytes(storage) if verify else None
    else:
        view = memoryview(payload).cast("B")
        if view.nbytes != span:
            problem = "truncated" if view.nbytes < span else "oversized"
            raise CodecError(f"{problem} blob: payload is {view.nbytes} bytes, header says {span}")
        if view.readonly:
            # A tensor over immutable bytes would let a caller write into a Python bytes object.
            storage = torch.empty(view.nbytes, dtype=torch.uint8)
            if view.nbytes:
                storage.numpy().data.cast("B")[:] = view
    if storage is not None and storage.numel() != span:
        raise CodecError(f"payload is {storage.numel()} bytes, header says {span}")
    checksum = header.checksum
    tensors: list[torch.Tensor | None] = []
    for index, (spec, offset) in enumerate(zip(header.specs, header.starts, strict=True)):
        if spec is None:
            tensors.append(None)
            continue
        # Over the bytes as they arrived (a memoryview slice: no tensor made to check them).
        if (verify and spec.crc is not None and view is not None
                and checksum(view[offset:offset + spec.nbytes]) != spec.crc):
            raise CodecError(f"corrupt blob: checksum mismatch in tensor {index}")
        if storage is not None:
            tensors.append(storage[offset:offset + spec.nbytes].view(spec.dtype).reshape(spec.shape))
        elif spec.nbytes:
            # Straight over the writable buffer: one or two torch calls a tensor instead of three.
            tensor = torch.frombuffer(view, dtype=spec.dtype, count=spec.nbytes // _ITEMSIZE_OF[spec.dtype],
                                      offset=offset)
            tensors.append(tensor if len(spec.shape) == 1 else tensor.view(spec.shape))
        else:
            tensors.append(torch.empty(spec.shape, dtype=spec.dtype))  # frombuffer refuses no bytes
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
