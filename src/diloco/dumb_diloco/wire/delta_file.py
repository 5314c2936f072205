"""A float32 delta laid out as its own file (issue 12, "Bounded memory"): the node's upload lane
subtracts straight into the payload of the bytes it uploads, so a boundary holds no second copy of
the delta (tensor_format.encode joins the tensors into new bytes). A float32 model's snapshots are
DeltaFiles too, so that a snapshot no longer needed after its boundary (the specification's install
replaces the baseline with the global) becomes its delta in place. The bytes are exactly
`tensor_format.encode(tensors, metadata)` (tested); `file` returns a view of them, valid until the
buffer is written again (transports copy or send what they are given before `write` returns).
"""

from __future__ import annotations

import hashlib
import math

import torch

from .tensor_format import (
    FORMAT_VERSION,
    META_FORMAT_VERSION,
    META_PAYLOAD_SHA256,
    canonical_header,
    encode,
    safetensors_layout,
)

METADATA_ROOM = 4096  # bytes kept in front of the tensor entries' header for the metadata


class DeltaFile:
    """One buffer: room for the header, then the float32 payload in safetensors' order; `tensors`
    are writable views of the payload in the given shapes."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        # safetensors' payload order (dtype, then name) from its own header for one-element stand-ins
        order = safetensors_layout({k: torch.float32 for k in shapes})
        self.entries, offset = {}, 0
        for name in sorted(order, key=lambda k: order[k]["data_offsets"]):
            n = 4 * math.prod(shapes[name])
            self.entries[name] = {
                "dtype": "F32",
                "shape": list(shapes[name]),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        entries_bytes = len(canonical_header(self.entries))
        self.room = entries_bytes + METADATA_ROOM + (-(entries_bytes + METADATA_ROOM) % 8)
        self.buffer = torch.empty(self.room + offset, dtype=torch.uint8)
        payload = self.buffer[self.room :].view(torch.float32)
        self.tensors = {
            name: payload[e["data_offsets"][0] // 4 : e["data_offsets"][1] // 4].view(shapes[name])
            for name, e in self.entries.items()
        }

    def file(self, metadata: dict[str, str]) -> memoryview | bytes:
        """The file of `tensors` as they are now with `metadata`, the bytes of `encode(tensors,
        metadata)`: a view of this buffer (a copy only if the metadata outgrows the room left for it)."""
        payload = self.buffer[self.room :].numpy()
        header = dict(self.entries)
        header["__metadata__"] = {
            **metadata,
            META_FORMAT_VERSION: FORMAT_VERSION,
            META_PAYLOAD_SHA256: hashlib.sha256(payload).hexdigest(),
        }
        head = canonical_header(header)
        if len(head) > self.room:
            return encode(self.tensors, metadata)
        start = self.room - len(head)
        self.buffer[start : self.room] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        return memoryview(self.buffer[start:].numpy()).cast("B")
