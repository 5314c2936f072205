"""DumbDiLoCo wire format: safetensors with a strictly validated header, never pickle."""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco.dumb_diloco.wire import tensor_format as tf
from diloco.dumb_diloco.wire.global_state import is_delta_tensor, pseudo_gradient
from diloco.dumb_diloco.wire.repo_paths import delta_path, parse_delta_path, validate_node_id
from diloco.dumb_diloco.wire.tensor_format import DeltaMeta, InvalidTensorFile, decode, encode, parse_header

pytestmark = pytest.mark.usefixtures("no_network")
CAP = 1 << 20


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(5, 3, generator=g),
        "norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
        "rope.freqs": torch.randn(2, 2, generator=g, dtype=torch.complex64),
        "steps": torch.arange(4, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
    }


def _craft(header: dict, payload: bytes) -> bytes:
    """A file with a hand-written header (for headers that lie)."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


def _meta_for(payload: bytes) -> dict:
    return {"format_version": "1", "payload_sha256": hashlib.sha256(payload).hexdigest()}


# ------------------------------------------------------------------ round trip


def test_round_trip_keeps_tensors_and_metadata():
    state = _state()
    blob = encode(state, {"node_id": "w1"})
    tensors, meta = decode(blob, max_bytes=CAP)
    assert set(tensors) == set(state)
    for k, v in state.items():
        assert tensors[k].dtype == v.dtype and torch.equal(tensors[k], v), k
    assert meta["node_id"] == "w1" and meta["format_version"] == tf.FORMAT_VERSION
    header = parse_header(blob, file_size=len(blob))
    assert meta["payload_sha256"] == hashlib.sha256(blob[header.payload_offset :]).hexdigest()
    assert header.file_size == len(blob)
    assert header.tensors["embed.weight"].shape == (5, 3) and header.tensors["embed.weight"].dtype == "F32"


def test_encode_accepts_tied_and_non_contiguous_tensors():
    w = torch.randn(4, 6)
    blob = encode({"embed": w, "lm_head": w, "t": w.t()}, {})
    tensors, _ = decode(blob, max_bytes=CAP)
    assert torch.equal(tensors["lm_head"], w) and torch.equal(tensors["t"], w.t())


def test_expected_keys_shapes_dtypes_accepted():
    state = _state()
    blob = encode(state, {})
    expected = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    decode(blob, max_bytes=CAP, expected=expected)


# ------------------------------------------------------------------ rejections


def test_sha_mismatch_rejected():
    blob = bytearray(encode({"w": torch.ones(8)}, {}))
    blob[-1] ^= 0x01  # flip one payload bit
    with pytest.raises(InvalidTensorFile, match="SHA-256 mismatch"):
        decode(bytes(blob), max_bytes=CAP)
    decode(bytes(blob), max_bytes=CAP, verify_sha=False)  # structurally fine


@pytest.mark.parametrize(
    "entries, match",
    [
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            "overlaps",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
            },
            "hole",
        ),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "needs 12 bytes"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "payload"),  # past end of file
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "begin <= end"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "non-negative"),
        ({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, "exactly"),
        ({"__metadata__": {"k": 1}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, "strings"),
    ],
)
def test_header_that_lies_is_rejected(entries, match):
    payload = bytes(8)
    blob = _craft({**entries, "__metadata__": entries.get("__metadata__", _meta_for(payload))}, payload)
    with pytest.raises(InvalidTensorFile, match=match):
        decode(blob, max_bytes=CAP)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"[1, 2]", "JSON object"),
        (b"{not json}", "not valid JSON"),
        (b'{"a": 1, "a": 2}', "duplicate key"),
        (b'{"\xff": 1}', "UTF-8"),
    ],
)
def test_malformed_json_header_rejected(raw, match):
    blob = struct.pack("<Q", len(raw)) + raw
    with pytest.raises(InvalidTensorFile, match=match):
        parse_header(blob, file_size=len(blob))


def test_truncated_files_rejected():
    blob = encode({"w": torch.ones(16)}, {})
    with pytest.raises(InvalidTensorFile, match="truncated|payload"):
        decode(blob[:-4], max_bytes=CAP)
    n = struct.unpack("<Q", blob[:8])[0]
    with pytest.raises(InvalidTensorFile, match="truncated header|past the end"):
        decode(blob[: 8 + n // 2], max_bytes=CAP)
    with pytest.raises(InvalidTensorFile, match="too short"):
        decode(blob[:5], max_bytes=CAP)


def test_size_caps():
    blob = encode({"w": torch.ones(64)}, {})
    with pytest.raises(InvalidTensorFile, match="over the cap"):
        decode(blob, max_bytes=len(blob) - 1)
    huge = struct.pack("<Q", 1 << 60) + b"{}"
    with pytest.raises(InvalidTensorFile, match="exceeds the cap"):
        parse_header(huge)
    with pytest.raises(InvalidTensorFile, match="exceeds the cap"):
        parse_header(blob, max_header_bytes=16)


class _Trap:
    """Unpickling this object calls `_spring`."""

    def __reduce__(self):
        return (_spring, ())


SPRUNG: list[int] = []


def _spring():
    SPRUNG.append(1)
    return "sprung"


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy-pickle"])
def test_torch_save_file_renamed_is_rejected_without_unpickling(zipfile, monkeypatch):
    buf = io.BytesIO()
    torch.save({"w": torch.ones(3), "trap": _Trap()}, buf, _use_new_zipfile_serialization=zipfile)
    blob = buf.getvalue()

    def no_torch_load(*a, **k):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_torch_load)
    with pytest.raises(InvalidTensorFile, match="torch.save"):
        decode(blob, max_bytes=CAP)
    with pytest.raises(InvalidTensorFile, match="torch.save"):
        parse_header(blob)
    assert SPRUNG == []


def test_missing_and_extra_keys_rejected():
    blob = encode({"a": torch.ones(2), "extra": torch.ones(1)}, {})
    expected = {"a": ((2,), torch.float32), "b": ((2,), torch.float32)}
    with pytest.raises(InvalidTensorFile, match=r"missing 1 key\(s\).*'b'.*unexpected 1 key\(s\).*'extra'"):
        decode(blob, max_bytes=CAP, expected=expected)


def test_wrong_shape_and_dtype_rejected():
    blob = encode({"a": torch.ones(2, 3)}, {})
    with pytest.raises(InvalidTensorFile, match=r"shape \[2, 3\], expected \[3, 2\]"):
        decode(blob, max_bytes=CAP, expected={"a": ((3, 2), torch.float32)})
    with pytest.raises(InvalidTensorFile, match="dtype F32, expected BF16"):
        decode(blob, max_bytes=CAP, expected={"a": ((2, 3), torch.bfloat16)})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rejected(bad):
    t = torch.ones(4)
    t[2] = bad
    blob = encode({"a": t}, {})
    with pytest.raises(InvalidTensorFile, match="NaN or Inf"):
        decode(blob, max_bytes=CAP)
    tensors, _ = decode(blob, max_bytes=CAP, require_finite=False)
    assert not torch.isfinite(tensors["a"]).all()


def test_complex_nan_rejected():
    blob = encode({"z": torch.tensor([1 + 1j, complex(float("nan"), 0)], dtype=torch.complex64)}, {})
    with pytest.raises(InvalidTensorFile, match="NaN or Inf"):
        decode(blob, max_bytes=CAP)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
)
def test_finite_check_is_exact_where_a_sum_would_mislead(dtype):
    """decode's finite check sums first: Inf and -Inf together, a lone NaN deep in a large tensor and
    finite values whose sum overflows must all get the exact answer."""
    big = torch.finfo(
        torch.float32 if dtype.is_complex else dtype
    ).max  # overflows a float32 sum but float16's
    for values, finite in (
        ([float("inf"), float("-inf")], False),
        ([big, big, big], True),  # finite; the float32 sum overflows
        ([-big, big, float("nan")], False),
    ):
        t = torch.zeros(100_003, dtype=dtype)
        t[-len(values) :] = torch.tensor(values, dtype=torch.float64).to(dtype)
        blob = encode({"a": t}, {})
        if finite:
            assert torch.equal(decode(blob, max_bytes=2**24)[0]["a"], t)
        else:
            with pytest.raises(InvalidTensorFile, match="NaN or Inf"):
                decode(blob, max_bytes=2**24)


def test_encoded_bytes_are_one_safetensors_file_with_the_payload_digest():
    """encode writes safetensors' own payload under a canonical header (sorted keys, no spaces, padded
    to 8 bytes) that holds the payload's digest; safetensors reads it back."""
    tensors = {"b": torch.arange(10, dtype=torch.int64), "a": torch.randn(64, 3)}
    blob = encode(tensors, {"k": "v", "a-key": "w"})
    header = parse_header(blob, file_size=len(blob))
    reference = st_save(tensors)
    (ref_len,) = struct.unpack("<Q", reference[:8])
    assert blob[header.payload_offset :] == reference[8 + ref_len :]
    digest = hashlib.sha256(blob[header.payload_offset :]).hexdigest()
    assert header.metadata == {"k": "v", "a-key": "w", "format_version": "1", "payload_sha256": digest}
    (n,) = struct.unpack("<Q", blob[:8])
    assert n % 8 == 0 and header.payload_offset == 8 + n
    text = blob[8 : 8 + n].rstrip(b" ")
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":")).encode()
    loaded = st_load(blob)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items()) and set(loaded) == set(tensors)


_ENCODE_IN_A_FRESH_PROCESS = """
import hashlib, sys, torch
from diloco.dumb_diloco.wire.tensor_format import encode
g = torch.Generator().manual_seed(0)
tensors = {f"layer{i}.weight": torch.randn(7, 5, generator=g) for i in range(12)}
tensors["step"] = torch.arange(3)
meta = {f"key{i:02d}": f"value{i}" for i in range(16)}
sys.stdout.write(hashlib.sha256(encode(tensors, meta)).hexdigest())
"""


def test_same_tensors_and_metadata_give_the_same_bytes_in_every_process():
    """safetensors writes its metadata from a hash map (a new order in every process): the canonical
    header makes the bytes, and so the Hub blob, a function of the content alone."""
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    digests = {
        subprocess.run(
            [sys.executable, "-c", _ENCODE_IN_A_FRESH_PROCESS],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for _ in range(2)
    }
    assert len(digests) == 1


def test_format_version_required():
    payload = bytes(8)
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    blob = st_save({"a": torch.zeros(2)})  # a valid safetensors file written by someone else
    with pytest.raises(InvalidTensorFile, match="no format_version"):
        decode(blob, max_bytes=CAP)
    meta = {**_meta_for(payload), "format_version": "99"}
    with pytest.raises(InvalidTensorFile, match="unsupported format_version"):
        decode(_craft({**header, "__metadata__": meta}, payload), max_bytes=CAP)


def test_parse_header_reads_only_the_prefix():
    blob = encode({"w": torch.ones(1000)}, {"k": "v"})
    n = struct.unpack("<Q", blob[:8])[0]
    header = parse_header(blob[: 8 + n], file_size=len(blob))
    assert header.payload_size == 4000 and header.metadata["k"] == "v"


# ------------------------------------------------------------------ deltas


def test_pseudo_gradient_is_float32_baseline_minus_current():
    base = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "n": torch.tensor([3], dtype=torch.int64)}
    cur = {"w": torch.tensor([0.5, 3.0], dtype=torch.bfloat16), "n": torch.tensor([5], dtype=torch.int64)}
    delta = pseudo_gradient(base, cur)
    assert set(delta) == {"w"}  # non-floating buffers excluded
    assert delta["w"].dtype == torch.float32
    assert torch.equal(delta["w"], torch.tensor([0.5, -1.0]))


def test_pseudo_gradient_complex_goes_through_view_as_real():
    base = {"z": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)}
    cur = {"z": torch.tensor([0 + 1j, 1 + 1j], dtype=torch.complex64)}
    delta = pseudo_gradient(base, cur)
    assert delta["z"].dtype == torch.float32 and delta["z"].shape == (2, 2)
    assert torch.equal(delta["z"], torch.tensor([[1.0, 1.0], [2.0, -2.0]]))
    blob = encode(delta, {})
    decoded, _ = decode(blob, max_bytes=CAP, expected={"z": ((2, 2), torch.float32)})
    assert torch.equal(decoded["z"], delta["z"])


def test_pseudo_gradient_key_mismatch():
    with pytest.raises(ValueError, match="different keys"):
        pseudo_gradient({"a": torch.ones(1)}, {"b": torch.ones(1)})
    with pytest.raises(ValueError, match="differ"):
        pseudo_gradient({"a": torch.ones(2)}, {"a": torch.ones(3)})


def test_is_delta_tensor():
    assert is_delta_tensor(torch.ones(1)) and is_delta_tensor(torch.ones(1, dtype=torch.bfloat16))
    assert is_delta_tensor(torch.ones(1, dtype=torch.complex64))
    assert not is_delta_tensor(torch.ones(1, dtype=torch.int64))
    assert not is_delta_tensor(torch.ones(1, dtype=torch.bool))


# ------------------------------------------------------------------ metadata and node ids


@pytest.mark.parametrize("node_id", ["master-1", "worker_2", "a", "A.b-c_d", "9", "x" * 64, "node.v2"])
def test_valid_node_ids(node_id):
    assert validate_node_id(node_id) == node_id


@pytest.mark.parametrize(
    "node_id, match",
    [
        ("", "non-empty"),
        ("a/b", "not path-safe"),
        ("../etc", r"'\.\.'"),
        ("a..b", r"'\.\.'"),
        ("..", r"'\.\.'"),
        (".hidden", "not path-safe"),
        ("-flag", "not path-safe"),
        ("a b", "not path-safe"),
        ("a\tb", "not path-safe"),
        ("a\nb", "not path-safe"),
        ("a\x00b", "not path-safe"),
        ("a\\b", "not path-safe"),
        ("wörker", "not path-safe"),
        ("x" * 65, "at most 64"),
        (None, "non-empty"),
    ],
)
def test_invalid_node_ids(node_id, match):
    with pytest.raises(ValueError, match=match) as info:
        validate_node_id(node_id)
    assert "\n" not in str(info.value).replace("\\n", "")


def test_delta_meta_round_trip_through_a_file():
    meta = DeltaMeta(
        node_id="w-1", local_step=500, base_outer_step=3, tokens_since_baseline=1024, samples_since_baseline=8
    )
    blob = encode(pseudo_gradient({"w": torch.ones(2)}, {"w": torch.zeros(2)}), meta.to_header())
    _, header_meta = decode(blob, max_bytes=CAP)
    back = DeltaMeta.from_header(header_meta)
    assert back.payload_sha256 == header_meta["payload_sha256"]
    assert back == DeltaMeta(**{**meta.__dict__, "payload_sha256": back.payload_sha256})
    assert all(isinstance(v, str) for v in meta.to_header().values())


@pytest.mark.parametrize(
    "change, match",
    [
        ({"local_step": "-1"}, "non-negative integer"),
        ({"local_step": "1e3"}, "non-negative integer"),
        ({"base_outer_step": None}, "missing"),
        ({"node_id": "../x"}, "bad delta metadata"),
        ({"dtype": "int3"}, "bad delta metadata"),
        ({"dtype": "int8"}, "'quant_block_size' is missing"),  # int8 is a delta dtype since issue 13
        ({"created_at": "yesterday"}, "bad delta metadata"),
        ({"format_version": "2"}, "bad delta metadata"),
        ({"step_micros": "-3"}, "non-negative integer"),  # optional (dynamic local steps), checked if there
        ({"step_micros": "fast"}, "non-negative integer"),
    ],
)
def test_delta_meta_from_bad_header(change, match):
    header = DeltaMeta(node_id="w", local_step=1, base_outer_step=0).to_header()
    for k, v in change.items():
        if v is None:
            header.pop(k)
        else:
            header[k] = v
    with pytest.raises(InvalidTensorFile, match=match):
        DeltaMeta.from_header(header)


def test_a_nodes_time_per_step_travels_only_when_it_is_known():
    """`step_micros` (dynamic local steps): written when set, absent (the header as before) when 0; read back;
    a step_count.json map keeps only int values (a hostile entry is dropped, not fatal)."""
    from diloco.dumb_diloco.node.joiner import _int_map

    plain = DeltaMeta(node_id="w", local_step=1, base_outer_step=0)
    assert "step_micros" not in plain.to_header()
    assert DeltaMeta.from_header(plain.to_header()).step_micros == 0
    timed = DeltaMeta(node_id="w", local_step=1, base_outer_step=0, step_micros=31_250)
    assert timed.to_header()["step_micros"] == "31250"
    assert DeltaMeta.from_header(timed.to_header()) == timed
    assert {k: v for k, v in timed.to_header().items() if k != "step_micros"} == plain.to_header() | {
        "created_at": timed.created_at
    }
    hostile = {"a": 1200, "b": "1200", "c": True, "d": None, 5: 7}
    assert _int_map(hostile) == {"a": 1200, "5": 7} and _int_map([1, 2]) == {} and _int_map(None) == {}


def test_delta_paths():
    assert delta_path("worker-1", 500) == "nodes/worker-1/delta_500.safetensors"
    assert parse_delta_path("nodes/worker-1/delta_500.safetensors") == ("worker-1", 500)
    for other in [
        "global/latest.safetensors",
        "nodes/w/delta_05.safetensors",
        "nodes/../delta_1.safetensors",
        "nodes/w/x/delta_1.safetensors",
    ]:
        assert parse_delta_path(other) is None
    with pytest.raises(ValueError):
        delta_path("a/b", 1)
    with pytest.raises(ValueError):
        delta_path("a", -1)


def _encode_through_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """`encode` before the one-copy version (commit b262b15), verbatim: safetensors serialises, then the
    canonical header is concatenated with its payload."""
    prepared: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr and ptr in seen_storages:
            t = t.clone()
        elif ptr:
            seen_storages.add(ptr)
        prepared[name] = t
    blob = st_save(prepared)
    (st_header_len,) = struct.unpack("<Q", blob[:8])
    payload = memoryview(blob)[8 + st_header_len :]
    header = json.loads(blob[8 : 8 + st_header_len])
    header.pop("__metadata__", None)
    header["__metadata__"] = {
        **metadata,
        "format_version": tf.FORMAT_VERSION,
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }
    return tf.canonical_header(header) + payload


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
_DTYPES += [torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn]
_SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (4, 1, 3), (33,)]


@pytest.mark.parametrize("seed", range(6))
def test_one_copy_encode_gives_the_bytes_of_serialising_through_safetensors(seed):
    """encode lays the tensors' bytes out itself (dtype, then name, as safetensors does) and joins them
    once: the same bytes as safetensors' serialisation plus a concatenation, for any mix of dtypes,
    shapes (scalars, empty tensors), names, tied and non-contiguous tensors, and metadata."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]  # noqa: E731
    tensors = {}
    for i in range(int(torch.randint(1, 14, (1,), generator=g))):
        dtype, shape = pick(_DTYPES), pick(_SHAPES)
        x = torch.randn(shape, generator=g) * 50
        name = pick(["w", "layers.1.w", "Z", "a.b", "é", "layers.10.w", "x" * 30]) + f".{i % 5}"
        tensors[name] = (x > 0) if dtype == torch.bool else x.to(dtype)
    w = torch.randn(6, 4, generator=g)
    tensors |= {"tied.a": w, "tied.b": w, "transposed": w.t(), "sliced": w[:, 1]}
    meta = {f"k{int(torch.randint(100, (1,), generator=g))}": f"v{i} é" for i in range(seed * 3)}
    blob = encode(tensors, meta)
    assert blob == _encode_through_safetensors(tensors, meta)
    assert type(blob) is bytes
    loaded, got_meta = decode(blob, max_bytes=CAP)
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items() if t.dtype != torch.float8_e4m3fn)
    assert {k: v for k, v in got_meta.items() if k in meta} == meta


def test_one_copy_encode_refuses_what_safetensors_refuses():
    with pytest.raises(TypeError, match="metadata must map str to str"):
        encode({"a": torch.ones(2)}, {"k": 1})  # type: ignore[dict-item]
    sparse = torch.eye(3).to_sparse()
    with pytest.raises((ValueError, RuntimeError)):
        encode({"a": sparse}, {})


def test_decoding_a_downloaded_file_warns_nothing():
    """A file read from the store is immutable bytes; viewing it in place made torch print its "buffer is
    not writable" warning at every worker start (issue 52). The views stay views (no copy)."""
    import warnings

    blob = bytes(encode({"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2)}, {"kind": "t"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensors, _ = decode(blob, max_bytes=len(blob))
    assert torch.equal(tensors["w"], torch.arange(6.0).view(2, 3))
