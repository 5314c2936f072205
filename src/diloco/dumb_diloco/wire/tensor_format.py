"""DumbDiLoCo's wire format: safetensors files whose header is validated before anything is loaded.

Invariants: nothing here unpickles (headers are parsed by hand, payloads by `safetensors.torch.load`,
or viewed in place from the validated header with `decode(views=True)`);
`encode` writes one canonical header (sorted keys, `format_version`, `payload_sha256`), so the same
tensors and metadata give the same bytes in every process; `decode` refuses a file before loading it
unless its size, header, payload SHA-256, keys, shapes, dtypes and values all check out.
Layout, metadata fields and reader checks: docs/dumb_diloco.md#tensor-format-and-metadata.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from .repo_paths import validate_node_id

FORMAT_VERSION = "1"
META_FORMAT_VERSION = "format_version"
META_PAYLOAD_SHA256 = "payload_sha256"

# A header of a few hundred tensors is tens of KiB; a cap stops a hostile length prefix from
# making a reader allocate gigabytes.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024 * 1024

# Every safetensors dtype and its size in bits.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "I16": 16,
    "U16": 16,
    "I32": 32,
    "U32": 32,
    "I64": 64,
    "U64": 64,
    "F16": 16,
    "BF16": 16,
    "F32": 32,
    "F64": 64,
    "C64": 64,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
# The torch dtype of each safetensors dtype that safetensors.torch can load (not F8_E8M0, F4, F6_*).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

_INT_FIELDS = ("local_step", "base_outer_step", "tokens_since_baseline", "samples_since_baseline")
_DELTA_DTYPES = ("float32", "bfloat16", "float16", "float64", "int8", "int4", "topk2")
QUANT_DTYPES = ("int8", "int4")  # diloco.quant's blockwise codes: one uint8 payload per tensor
TOPK_DTYPE = "topk2"  # diloco.sparse's top-k 2-bit values and indices: one uint8 payload per tensor
MAX_TOPK_CHUNK = 4096  # in-chunk indices are 12 bits (diloco.sparse.MAX_CHUNK)


class InvalidTensorFile(ValueError):
    """A tensor file failed validation; `reason` is one line saying why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name, e.g. "F32"
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]  # [begin, end) relative to the payload start


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    header_len: int  # N, the JSON length; the payload starts at 8 + N
    payload_size: int  # sum of all tensor sizes (= file size - 8 - N for a valid file)

    @property
    def payload_offset(self) -> int:
        return 8 + self.header_len

    @property
    def file_size(self) -> int:
        return self.payload_offset + self.payload_size


def _parse_nonneg_int(meta: dict[str, str], key: str) -> int:
    raw = meta.get(key)
    if raw is None:
        raise InvalidTensorFile(f"metadata field {key!r} is missing")
    if not isinstance(raw, str) or not re.fullmatch(r"0|[1-9][0-9]{0,18}", raw):
        raise InvalidTensorFile(f"metadata field {key!r} is not a non-negative integer: {raw!r}")
    return int(raw)


@dataclass(frozen=True)
class DeltaMeta:
    """Metadata of one node delta; every field travels as a string in the safetensors header."""

    node_id: str
    local_step: int
    base_outer_step: int
    tokens_since_baseline: int = 0
    samples_since_baseline: int = 0
    dtype: str = "float32"
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    payload_sha256: str = ""  # filled in by `encode`; read back by `from_header`
    format_version: str = FORMAT_VERSION
    quant_block_size: int = 0  # int8/int4: elements per bfloat16 scale (even, >= 2); 0 (unwritten) else
    topk_chunk: int = 0  # topk2: values per chunk (1..4096); 0 (unwritten) else
    topk_k: int = 0  # topk2: values kept per chunk (1..topk_chunk); 0 (unwritten) else
    step_micros: int = 0  # the node's busy microseconds per step (dynamic local steps); 0: unknown, unwritten

    def __post_init__(self) -> None:
        validate_node_id(self.node_id)
        counts = {
            "local_step": self.local_step,
            "base_outer_step": self.base_outer_step,
            "tokens_since_baseline": self.tokens_since_baseline,
            "samples_since_baseline": self.samples_since_baseline,
            "step_micros": self.step_micros,
        }
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.dtype not in _DELTA_DTYPES:
            raise ValueError(f"dtype must be one of {_DELTA_DTYPES}, got {self.dtype!r}")
        q = self.dtype in QUANT_DTYPES
        if type(b := self.quant_block_size) is not int or (b < 2 or b % 2 if q else b != 0):
            raise ValueError(f"quant_block_size must be {'even, >= 2' if q else 0} for {self.dtype}: {b!r}")
        self._check_topk()
        try:
            datetime.fromisoformat(self.created_at.replace("Z", "+00:00"))
        except (TypeError, ValueError):
            raise ValueError(f"created_at is not an ISO-8601 time: {self.created_at!r}") from None
        if self.payload_sha256 and not re.fullmatch(r"[0-9a-f]{64}", self.payload_sha256):
            raise ValueError("payload_sha256 must be 64 lowercase hex digits")
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"unsupported format_version {self.format_version!r}")

    def _check_topk(self) -> None:
        """topk2: a chunk of 1..4096 values with 1..chunk of them kept; every other dtype: both 0."""
        chunk, k = self.topk_chunk, self.topk_k
        if type(chunk) is not int or type(k) is not int:
            raise ValueError(f"topk_chunk and topk_k must be ints, got {chunk!r} and {k!r}")
        if self.dtype != TOPK_DTYPE:
            if chunk or k:
                raise ValueError(f"topk_chunk and topk_k must be 0 for {self.dtype}")
        elif not (1 <= chunk <= MAX_TOPK_CHUNK and 1 <= k <= chunk):
            raise ValueError(f"topk2 needs 1 <= topk_k <= topk_chunk <= {MAX_TOPK_CHUNK}, got {k} of {chunk}")

    def to_header(self) -> dict[str, str]:
        """Every field as a string under its own name (`__metadata__`); payload_sha256 once it is set."""
        topk = self.dtype == TOPK_DTYPE
        drop = {
            "quant_block_size": self.dtype not in QUANT_DTYPES,
            "topk_chunk": not topk,
            "topk_k": not topk,
            "step_micros": not self.step_micros,
        }
        return {name: str(v) for name, v in asdict(self).items() if not drop.get(name) and v != ""}

    @classmethod
    def from_header(cls, meta: dict[str, str]) -> DeltaMeta:
        """Parse and validate; raises InvalidTensorFile with a one-line reason."""
        for key in ("format_version", "node_id", "dtype", "created_at"):
            if not isinstance(meta.get(key), str):
                raise InvalidTensorFile(f"metadata field {key!r} is missing")
        ints = _INT_FIELDS + (("quant_block_size",) if meta["dtype"] in QUANT_DTYPES else ())
        ints += ("topk_chunk", "topk_k") if meta["dtype"] == TOPK_DTYPE else ()
        ints += ("step_micros",) if "step_micros" in meta else ()
        skip = (*ints, "quant_block_size", "topk_chunk", "topk_k")  # meaningless for another dtype
        strings = {f.name: meta[f.name] for f in fields(cls) if f.name in meta and f.name not in skip}
        try:
            return cls(**strings, **{name: _parse_nonneg_int(meta, name) for name in ints})
        except ValueError as err:
            if isinstance(err, InvalidTensorFile):
                raise
            raise InvalidTensorFile(f"bad delta metadata: {err}") from None


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidTensorFile(f"header has duplicate key {key!r}")
        out[key] = value
    return out


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _looks_like_pickle(prefix: bytes) -> str | None:
    if prefix[:4] == b"PK\x03\x04":
        return "file is a zip archive (torch.save output?), not safetensors; refusing to load it"
    if len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5:
        return "file is a pickle (torch.save output?), not safetensors; refusing to unpickle it"
    return None


# By hand, not with safetensors: its parser needs the whole file; this one reads a remote header alone.
def parse_header(
    blob_prefix: bytes,
    *,
    file_size: int | None = None,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> SafetensorsHeader:
    """Parse and validate the header at the start of a safetensors file.

    `blob_prefix` must hold at least the 8-byte length and the JSON header. When `file_size` is
    known, the payload described by the header must end exactly at the end of the file.
    Raises InvalidTensorFile(reason).
    """
    header_len, obj = _header_json(blob_prefix, file_size, max_header_bytes)
    metadata: dict[str, str] = {}
    raw_meta = obj.pop("__metadata__", None)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw_meta.items()
        ):
            raise InvalidTensorFile("__metadata__ must map strings to strings")
        metadata = dict(raw_meta)
    tensors = {name: _tensor_info(name, info) for name, info in obj.items()}
    # The payload must be tiled exactly: sorted by offset, each tensor starts where the last ended.
    end = 0
    for name, info in sorted(tensors.items(), key=lambda kv: kv[1].data_offsets):
        if info.data_offsets[0] != end:
            kind = "overlaps the previous tensor" if info.data_offsets[0] < end else "leaves a hole before it"
            raise InvalidTensorFile(f"tensor {name!r}: data_offsets {list(info.data_offsets)} {kind}")
        end = info.data_offsets[1]
    if file_size is not None and 8 + header_len + end != file_size:
        raise InvalidTensorFile(
            f"header describes a {end}-byte payload but the file holds {file_size - 8 - header_len} "
            "payload bytes (truncated or padded file)"
        )
    return SafetensorsHeader(tensors=tensors, metadata=metadata, header_len=header_len, payload_size=end)


def _header_json(blob_prefix: bytes, file_size: int | None, max_header_bytes: int) -> tuple[int, dict]:
    """The header's length N and its JSON object, checked: a plausible N, UTF-8, no duplicate keys."""
    prefix = bytes(blob_prefix[:8])
    if len(prefix) < 8:
        raise InvalidTensorFile(f"file too short for a safetensors header ({len(prefix)} bytes)")
    if (why := _looks_like_pickle(prefix)) is not None:
        raise InvalidTensorFile(why)
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len < 2:
        raise InvalidTensorFile(f"header length {header_len} is too small")
    if header_len > max_header_bytes:
        raise InvalidTensorFile(f"header length {header_len} exceeds the cap of {max_header_bytes} bytes")
    if file_size is not None and 8 + header_len > file_size:
        raise InvalidTensorFile(f"header length {header_len} runs past the end of a {file_size}-byte file")
    raw = bytes(blob_prefix[8 : 8 + header_len])
    if len(raw) < header_len:
        raise InvalidTensorFile(f"truncated header: expected {header_len} bytes, got {len(raw)}")
    if raw[:1] != b"{":
        raise InvalidTensorFile("header is not a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidTensorFile("header is not valid UTF-8") from None
    try:
        obj = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as err:
        raise InvalidTensorFile(f"header is not valid JSON ({err.msg} at char {err.pos})") from None
    if not isinstance(obj, dict):
        raise InvalidTensorFile("header is not a JSON object")
    return header_len, obj


def _tensor_info(name: str, info: object) -> TensorInfo:
    """One tensor entry of the header, checked: a known dtype, a shape, offsets spanning its size."""
    if not name:
        raise InvalidTensorFile("empty tensor name")
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise InvalidTensorFile(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise InvalidTensorFile(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(map(_is_count, shape)):
        raise InvalidTensorFile(f"tensor {name!r}: shape must be a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))) or (
        offsets[0] > offsets[1]
    ):
        raise InvalidTensorFile(f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        raise InvalidTensorFile(
            f"tensor {name!r}: {dtype}{shape} needs {bits / 8:g} bytes but data_offsets "
            f"span {offsets[1] - offsets[0]}"
        )
    return TensorInfo(dtype=dtype, shape=tuple(shape), data_offsets=(offsets[0], offsets[1]))


def read_header_ranges(
    path: str, read: Callable[[int, int], tuple[bytes, int | None]], max_header_bytes: int
) -> SafetensorsHeader:
    """The validated header of a file read through `read(start, length) -> (bytes, file size or None)`:
    the 8-byte length, then the JSON header only if the length is plausible. Never reads the payload."""
    prefix, size = read(0, 8)
    if len(prefix) < 8:
        raise InvalidTensorFile(f"{path}: file too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix)
    if 2 <= n <= max_header_bytes and (size is None or 8 + n <= size):
        prefix += read(8, n)[0]
    return parse_header(prefix, file_size=size, max_header_bytes=max_header_bytes)


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Serialise `tensors` (moved to CPU, made contiguous) with `metadata` plus format_version and
    payload_sha256 in the header: the bytes safetensors would lay out, under `canonical_header`, copied
    once (the payload is joined from the tensors' own memory, not serialised and then concatenated)."""
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str; {key!r} -> {type(value).__name__}")
    prepared: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr and ptr in seen_storages:
            t = t.clone()  # tied weights share storage; safetensors refuses shared tensors
        elif ptr:
            seen_storages.add(ptr)
        prepared[name] = t
    # safetensors lays the payload out by dtype, then name, whatever the sizes: its own header for
    # one-element stand-ins gives the order and dtype names (and its errors for a dtype it refuses)
    header = safetensors_layout({k: t.dtype for k, t in prepared.items()})
    pieces, offset = [], 0
    for name in sorted(header, key=lambda k: header[k]["data_offsets"]):
        t = prepared[name]
        pieces.append(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's bytes, not a copy
        header[name] |= {"shape": list(t.shape), "data_offsets": [offset, offset + len(pieces[-1])]}
        offset += len(pieces[-1])
    if sys.byteorder != "little":  # the payload is little-endian: let safetensors swap the bytes
        blob = _st_save(prepared)
        pieces = [memoryview(blob)[8 + struct.unpack("<Q", blob[:8])[0] :]]
    sha = hashlib.sha256()
    for piece in pieces:
        sha.update(piece)
    header["__metadata__"] = {
        **metadata,
        META_FORMAT_VERSION: FORMAT_VERSION,
        META_PAYLOAD_SHA256: sha.hexdigest(),
    }
    return b"".join([canonical_header(header), *pieces])


def safetensors_layout(dtypes: dict[str, torch.dtype]) -> dict[str, dict]:
    """The tensor entries of the header safetensors itself writes for one-element tensors of these
    dtypes: the payload order it uses (by `data_offsets`: dtype, then name) and its dtype names (and
    its error for a dtype it refuses)."""
    blob = _st_save({k: torch.zeros(1, dtype=dtype) for k, dtype in dtypes.items()})
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header.pop("__metadata__", None)
    return header


def canonical_header(header: dict) -> bytes:
    """The 8-byte length and the JSON header in one canonical form: keys sorted, no spaces, padded
    with spaces to a multiple of 8 as safetensors does. safetensors itself writes `__metadata__` from
    a hash map (a different key order on every call), so the same tensors and metadata would give
    different bytes, and a different Hub blob, in every process."""
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in t. Fast path: one float32 sum, which is finite only if every element is (NaN
    and Inf propagate; Inf + -Inf is NaN). A sum that is not finite (a bad element, or finite values
    whose sum overflows) is settled by the exact element-wise check."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if bool(torch.isfinite(torch.sum(t, dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def _torch_dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"dtype {dtype} has no safetensors equivalent")
    return name


def decode(
    blob: bytes,
    *,
    max_bytes: int,
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    require_finite: bool = True,
    verify_sha: bool = True,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    views: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Validate `blob` completely, then load it. Returns (tensors, metadata).

    `expected` maps each tensor name to (shape, torch dtype); missing or extra names, another
    shape or dtype are errors. Raises InvalidTensorFile(reason) before loading anything bad.
    `views`: the tensors are read-only views of `blob` (no copy; on a little-endian host), for a
    caller that only reads them while it holds `blob` (the master adding a delta into its sum).
    """
    if len(blob) > max_bytes:
        raise InvalidTensorFile(f"file is {len(blob)} bytes, over the cap of {max_bytes} bytes")
    header = parse_header(blob, file_size=len(blob), max_header_bytes=max_header_bytes)
    meta = header.metadata
    version = meta.get(META_FORMAT_VERSION)
    if version is None:
        raise InvalidTensorFile("metadata has no format_version (not written by this format's encoder)")
    if version != FORMAT_VERSION:
        raise InvalidTensorFile(
            f"unsupported format_version {version!r} (this reader knows {FORMAT_VERSION!r})"
        )
    if verify_sha:
        want = meta.get(META_PAYLOAD_SHA256)
        if want is None:
            raise InvalidTensorFile("metadata has no payload_sha256")
        got = hashlib.sha256(memoryview(blob)[header.payload_offset :]).hexdigest()
        if got != want:
            raise InvalidTensorFile(
                f"payload SHA-256 mismatch: header says {want[:12]}..., payload is {got[:12]}..."
            )
    for name, info in header.tensors.items():
        if info.dtype not in TORCH_DTYPES:
            raise InvalidTensorFile(f"tensor {name!r}: dtype {info.dtype} cannot be loaded into torch")
    if expected is not None:
        diff = {
            "missing": set(expected) - set(header.tensors),
            "unexpected": set(header.tensors) - set(expected),
        }
        if parts := [f"{what} {len(k)} key(s) e.g. {sorted(k)[:3]}" for what, k in diff.items() if k]:
            raise InvalidTensorFile("; ".join(parts))
        for name, (shape, dtype) in expected.items():
            info = header.tensors[name]
            if info.shape != tuple(shape):
                raise InvalidTensorFile(f"tensor {name!r}: shape {list(info.shape)}, expected {list(shape)}")
            if info.dtype != _torch_dtype_name(dtype):
                raise InvalidTensorFile(
                    f"tensor {name!r}: dtype {info.dtype}, expected {_torch_dtype_name(dtype)}"
                )
    # an all-float32 payload viewed in place (a delta): its tensors are views of one float32 tensor over
    # it, checked in one pass (tensor by tensor, to name the bad one, only if that finds NaN or Inf)
    f32 = views and sys.byteorder == "little" and header.payload_size > 0
    f32 = f32 and {i.dtype for i in header.tensors.values()} == {"F32"}
    whole = _frombuffer(blob, dtype=torch.float32, offset=header.payload_offset) if f32 else None
    try:
        tensors = (
            _views(blob, header, whole) if views and sys.byteorder == "little" else _st_load(bytes(blob))
        )
    except Exception as err:  # the Rust parser disagrees with ours: still a bad file
        raise InvalidTensorFile(f"safetensors refused the file: {str(err).splitlines()[0]}") from None
    if require_finite and not (whole is not None and _all_finite(whole)):
        for name, t in tensors.items():
            if (t.is_floating_point() or t.is_complex()) and not _all_finite(t):
                raise InvalidTensorFile(f"tensor {name!r} holds NaN or Inf")
    return tensors, meta


def _frombuffer(blob, **kwargs) -> torch.Tensor:
    """torch.frombuffer over the file's bytes without copying them. A downloaded file is immutable
    `bytes`, so torch warns that the buffer is not writable: the views are read-only by decode's contract
    (every reader copies or sums out of them; nothing writes into a file's bytes) and torch has no
    read-only tensor to say so, so that one warning is not shown."""
    if isinstance(blob, bytes | memoryview) and getattr(blob, "readonly", True):
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="The given buffer is not writable", category=UserWarning
            )
            return torch.frombuffer(blob, **kwargs)
    return torch.frombuffer(blob, **kwargs)


def _views(blob: bytes, header: SafetensorsHeader, whole: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The tensors `header` (validated: every offset inside the payload, tiled exactly) describes, as
    views of `blob` (of `whole`, an all-float32 payload as one tensor, if given): nothing is copied,
    where `safetensors.torch.load` copies the whole payload."""
    out = {}
    for name, info in header.tensors.items():
        dtype, (begin, end) = TORCH_DTYPES[info.dtype], info.data_offsets
        if whole is not None:
            out[name] = whole[begin // 4 : end // 4].view(info.shape)
            continue
        if begin == end:  # frombuffer refuses empty buffers
            out[name] = torch.empty(info.shape, dtype=dtype)
            continue
        offset, count = header.payload_offset + begin, (end - begin) // dtype.itemsize
        # torch warns once per process that bytes are read-only, as it does under safetensors.torch.load
        out[name] = _frombuffer(blob, dtype=dtype, count=count, offset=offset).view(info.shape)
    return out


class GlobalMismatch(InvalidTensorFile):
    """A well-formed global of another model (keys, shapes or dtypes): waiting will not fix it."""
