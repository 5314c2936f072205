"""Benchmark 3 (issue #7): the DumbDiLoCo wire format against a plain file write/read of the same bytes.

A node delta of a model's shape (float32 and float16) goes through the project's own code:
`aggregation.pseudo_gradient`, `tensor_format.encode` (safetensors + payload SHA-256),
`DirectoryTransport.write` (staged, fsynced, committed), `DirectoryTransport.read`,
`tensor_format.decode` (header checks, SHA-256, load, finite check). The floors are a plain
`write()`/`read()` of a bytes object of the same size to/from a file in the same directory, and
`hashlib.sha256` over the payload (the integrity check the format asks for).

Header-only reads (`read_header`) must not touch the payload: for the directory transport the
bytes read by this process are counted from /proc/self/io (rchar); for the Hub transport (the real
huggingface_hub client against the loopback Hub of src/diloco/testing/hub_server.py) from the server's own
count of response bytes.

    python scripts/bench_wire.py                 # 150M delta (860 MB float32), ~2 minutes
    python scripts/bench_wire.py --tiny          # micro model, one repeat
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from diloco.bench import common as bc
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire import tensor_format as tf
from diloco.dumb_diloco.wire.global_state import pseudo_gradient
from diloco.dumb_diloco.wire.repo_paths import delta_path


def model_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of configs/model/<name>.yaml, built on the meta device (no memory)."""
    from omegaconf import OmegaConf
    from transformers import LlamaForCausalLM

    from diloco.model import llama_config

    cfg = OmegaConf.load(bc.ROOT / "configs" / "model" / f"{name}.yaml")
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(cfg))
    return {n: tuple(p.shape) for n, p in model.state_dict().items() if p.is_floating_point()}


def make_delta(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    baseline = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    current = {n: b + 1e-3 * torch.randn(b.shape, generator=gen) for n, b in baseline.items()}
    return pseudo_gradient(baseline, current)  # the project's own delta: float32(base) - float32(cur)


def rchar() -> int | None:
    """Bytes this process has read through read() syscalls so far (Linux)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def plain_write(path: Path, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def bench_dtype(dtype: torch.dtype, delta32: dict, tmp: Path, args) -> tuple[list[dict], dict]:
    delta = {n: t.to(dtype) for n, t in delta32.items()}
    name = str(dtype).removeprefix("torch.")
    meta = tf.DeltaMeta(node_id="bench", local_step=500, base_outer_step=1, dtype=name).to_header()
    expected = {n: (tuple(t.shape), dtype) for n, t in delta.items()}
    payload = sum(t.numel() * t.element_size() for t in delta.values())
    r, w = args.repeats, args.warmup

    blob = tf.encode(delta, meta)
    size = len(blob)
    plain = tmp / f"plain-{name}.bin"
    transport = DirectoryTransport(tmp / f"repo-{name}", keep_old_versions_s=0.0)
    path = delta_path("bench", 500)
    m = {}
    m["encode"] = bc.measure(lambda: tf.encode(delta, meta), r, w)
    m["sha256"] = bc.measure(lambda: hashlib.sha256(memoryview(blob)[size - payload :]).hexdigest(), r, w)
    m["plain_write"] = bc.measure(lambda: plain_write(plain, blob, fsync=False), r, w)
    m["plain_write_fsync"] = bc.measure(lambda: plain_write(plain, blob, fsync=True), r, w)
    m["transport_write"] = bc.measure(lambda: transport.write({path: blob}), r, w)
    m["plain_read"] = bc.measure(lambda: plain.read_bytes(), r, w)
    m["transport_read"] = bc.measure(lambda: transport.read(path), r, w)
    m["decode"] = bc.measure(lambda: tf.decode(blob, max_bytes=size, expected=expected), r, w)
    m["read_header"] = bc.measure(lambda: transport.read_header(path), r, w)

    before = rchar()
    header = transport.read_header(path)
    header_bytes_read = None if before is None else rchar() - before
    assert header.payload_size == payload
    med = {k: v["median"] for k, v in m.items()}

    def row(phase, seconds, floor_name, floor_seconds):
        return {
            "dtype": name,
            "phase": phase,
            "seconds": seconds,
            "GB/s": payload / seconds / bc.GB,
            "floor": floor_name,
            "floor_s": floor_seconds,
            "x_floor": seconds / floor_seconds,
        }

    rows = [
        row("encode (safetensors + sha256)", med["encode"], "sha256 of payload", med["sha256"]),
        row("encode + plain write", med["encode"] + med["plain_write"], "plain write", med["plain_write"]),
        row(
            "encode + transport write (fsync, commit)",
            med["encode"] + med["transport_write"],
            "plain write + fsync",
            med["plain_write_fsync"],
        ),
        row("transport read", med["transport_read"], "plain read", med["plain_read"]),
        row("decode (checks, sha256, load)", med["decode"], "sha256 of payload", med["sha256"]),
        row(
            "transport read + decode",
            med["transport_read"] + med["decode"],
            "plain read",
            med["plain_read"],
        ),
        {
            "dtype": name,
            "phase": "read_header (directory)",
            "seconds": med["read_header"],
            "GB/s": None,
            "floor": f"bytes read: {header_bytes_read} of {size}",
            "floor_s": None,
            "x_floor": None,
        },
    ]
    detail = {
        "dtype": name,
        "file_bytes": size,
        "payload_bytes": payload,
        "header_bytes": header.payload_offset,
        "tensors": len(delta),
        "header_read_bytes_directory": header_bytes_read,
        "timings": m,
    }
    return rows, detail


def hub_header_check(delta32: dict, tmp: Path) -> dict:
    """read_header through the real huggingface_hub client against the loopback Hub: response bytes."""
    from diloco.dumb_diloco.store.transport import HubTransport
    from diloco.testing.hub_server import HubServer

    meta = tf.DeltaMeta(node_id="bench", local_step=500, base_outer_step=1).to_header()
    blob = tf.encode(delta32, meta)
    path = delta_path("bench", 500)
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_HOME")}
    os.environ.pop("HF_HUB_OFFLINE", None)  # offline mode refuses even loopback requests
    os.environ["HF_HOME"] = str(tmp / "hf_home")  # no real token or cache is used
    import huggingface_hub.constants as hf_constants

    offline = hf_constants.HF_HUB_OFFLINE  # read at import; HF_HUB_OFFLINE=1 would refuse loopback too
    hf_constants.HF_HUB_OFFLINE = False
    try:
        return _hub_header_check(HubServer, HubTransport, blob, path, delta32)
    finally:
        hf_constants.HF_HUB_OFFLINE = offline
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _hub_header_check(HubServer, HubTransport, blob: bytes, path: str, delta32: dict) -> dict:
    with HubServer() as server:
        hub = HubTransport("bench/wire", endpoint=server.url)
        rev = hub.write({path: blob}, message="bench")
        server.reset_counters()
        t0 = time.perf_counter()
        header = hub.read_header(path, revision=rev)
        seconds = time.perf_counter() - t0
        header_bytes = sum(v for k, v in server.bytes_out.items() if k.startswith("resolve"))
        server.reset_counters()
        t0 = time.perf_counter()
        hub.read(path, revision=rev)
        read_seconds = time.perf_counter() - t0
        full_bytes = sum(v for k, v in server.bytes_out.items() if k.startswith("resolve"))
    assert header.payload_size == sum(t.numel() * 4 for t in delta32.values())
    return {
        "file_bytes": len(blob),
        "header_len": header.payload_offset,
        "read_header_response_bytes": header_bytes,
        "read_header_seconds": seconds,
        "read_response_bytes": full_bytes,
        "read_seconds": read_seconds,
    }


def main(argv=None) -> int:
    p = bc.parser(__doc__.splitlines()[0], repeats=3, warmup=0)
    p.add_argument("--model", default="150m", help="configs/model/<name>.yaml whose delta is written")
    p.add_argument("--hub-model", default="14m", help="model whose delta goes through the loopback Hub")
    args = bc.finish_args(p.parse_args(argv))
    if args.tiny:
        args.model = args.hub_model = "micro"
    torch.manual_seed(0)
    delta32 = make_delta(model_shapes(args.model))
    rows, details = [], []
    with tempfile.TemporaryDirectory(prefix="bench_wire_", dir=os.environ.get("BENCH_TMP")) as tmp:
        for dtype in (torch.float32, torch.float16):
            r, d = bench_dtype(dtype, delta32, Path(tmp), args)
            rows += r
            details.append(d)
        del delta32
        hub = hub_header_check(make_delta(model_shapes(args.hub_model)), Path(tmp))

    verdicts = []
    for d in details:
        read = d["header_read_bytes_directory"]
        # besides the header, the transport reads its HEAD hint and one small JSON log record
        ok = read is not None and read - d["header_bytes"] < min(d["payload_bytes"], 64 * 1024)
        verdicts.append(
            f"{d['dtype']}: directory read_header read {read} bytes of a {d['file_bytes']}-byte file "
            f"(header {d['header_bytes']} bytes + the transport's HEAD and log record): "
            f"{'payload not read' if ok else 'PAYLOAD READ'}"
        )
    ok = hub["read_header_response_bytes"] <= hub["header_len"]
    verdicts.append(
        f"Hub (loopback, real client, {args.hub_model} delta): read_header received "
        f"{hub['read_header_response_bytes']} bytes of a {hub['file_bytes']}-byte file "
        f"(header {hub['header_len']} bytes; a full read received {hub['read_response_bytes']}): "
        f"{'payload not read' if ok else 'PAYLOAD READ'}"
    )
    notes = [
        f"Delta of the {args.model} shape ({details[0]['tensors']} tensors; float32 payload "
        f"{bc.human_bytes(details[0]['payload_bytes'])}); GB/s are payload bytes per second.",
        "Files live in the page cache (plain write without fsync); the transport write fsyncs every staged "
        "file and the directory, so its floor is a plain write + fsync.",
        "x_floor = seconds / floor seconds. The sha256 floor is the integrity check every encode and decode "
        "must do once over the payload (single-threaded in hashlib).",
    ]
    bc.write(
        "wire",
        "Wire format: delta write/read vs plain file I/O",
        args,
        rows,
        ["dtype", "phase", "seconds", "GB/s", "floor", "floor_s", "x_floor"],
        notes=notes,
        verdicts=verdicts,
        extra={"details": details, "hub_header": hub},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
