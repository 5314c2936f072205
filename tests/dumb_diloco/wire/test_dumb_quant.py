"""DumbDiLoCo deltas as int8/int4 with error feedback on the node (issue 13; dumb_diloco/wire/delta_codec.py).

Each test proves an equality, not that something ran: the master decodes a quantized file to exactly
`quant.dequantize(quant.quantize(v))`; over boundaries, failed uploads and restarts, what the master
decoded plus the node's residual equals the sum of the node's raw deltas (to float32 round-off, where
leaving out error feedback misses by the quantization error); hostile files are rejected with a reason
in the ledger while a good delta is still applied. No test waits on a clock or a thread interleaving:
an upload in flight is held by the Spy transport's events.
"""

from __future__ import annotations

import json
import math
import re
import threading

import pytest
import torch
from dumb_helpers import LR, MU, W0, Tiny, g, make_loop, publish, put_delta, settings, worker

from diloco.config import ConfigError, validate
from diloco.dumb_diloco.master.intake import Intake
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import Settings
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.delta_codec import DeltaCodec, wire_layout
from diloco.dumb_diloco.wire.global_state import delta_layout
from diloco.dumb_diloco.wire.repo_paths import GLOBAL_LEDGER_PATH, delta_path
from diloco.dumb_diloco.wire.tensor_format import DeltaMeta, encode, parse_header
from diloco.quant import dequantize, payload_bytes, quantize

pytestmark = pytest.mark.usefixtures("no_network")


class Mlp(torch.nn.Module):
    """328,576 parameters (two linear layers), for the file sizes."""

    def __init__(self, d_in: int = 256, hidden: int = 640):
        super().__init__()
        self.a = torch.nn.Linear(d_in, hidden)
        self.b = torch.nn.Linear(hidden, d_in)


def small() -> Mlp:
    torch.manual_seed(0)
    return Mlp(30, 20)  # 1,250 parameters: several blocks of 16 per tensor, one partial


def random_delta(model: torch.nn.Module, seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(t.shape, generator=gen) * scale for k, t in model.state_dict().items()}


def train_step(model: torch.nn.Module, step: int) -> None:
    """A stand-in for an optimizer step: a different random move of every parameter at every step."""
    with torch.no_grad():
        for k, t in model.state_dict().items():
            t.add_(random_delta(model, step)[k])


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in model.state_dict().items()}


def decoded_by_master(repo, model) -> dict[int, dict[str, torch.Tensor]]:
    """Every delta file in the repository as the master's intake decodes it (local step -> float32)."""
    intake, rev, out = Intake(repo, delta_layout(model.state_dict()), 2**26, None), repo.revision(), {}
    for f in intake.list(rev):
        c = intake.candidate(f, rev)
        tensors = intake.download(c, rev)
        assert isinstance(tensors, dict), tensors
        out[c.local_step] = {k: t.clone() for k, t in tensors.items()}
    return out


def total(deltas) -> dict[str, torch.Tensor]:
    deltas = list(deltas)
    return {k: sum((d[k] for d in deltas[1:]), deltas[0][k].clone()) for k in deltas[0]}


def assert_nothing_lost(raw, decoded, residual, *, loose_without_residual: bool = True) -> None:
    """sum(decoded) + residual == sum(raw) to float32 round-off; without the residual it is off by far
    more than that tolerance (the test would catch a residual dropped or added twice)."""
    want, got = total(raw), total(decoded)
    for k in want:
        torch.testing.assert_close(got[k] + residual[k], want[k], rtol=1e-5, atol=1e-6)
    if loose_without_residual:
        off = max(float((got[k] - want[k]).abs().max()) for k in want)
        assert off > 1e-4, off


# ------------------------------------------------------------------ the wire format


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_quantized_file_decodes_on_the_master_to_exactly_dequantize_quantize(tmp_path, dtype):
    model, bits = Mlp(), {"int8": 8, "int4": 4}[dtype]
    delta = random_delta(model, 1)
    codec = DeltaCodec(dtype, 256)
    blob, residual = codec.encode(delta, DeltaMeta("w1", 3, 0))
    repo = DirectoryTransport(tmp_path / "repo")
    repo.write({delta_path("w1", 3): blob})
    got = decoded_by_master(repo, model)[3]
    for k, d in delta.items():
        want = dequantize(quantize(d.reshape(-1), bits, 256), d.numel(), bits, 256).view(d.shape)
        assert torch.equal(got[k], want), k  # bit for bit
        assert torch.equal(residual[k], d - want), k  # v - Q(v), with no residual before
    # the file: payload_bytes per tensor, a small header, and the metadata naming the format
    header = parse_header(blob)
    n_payload = sum(payload_bytes(t.numel(), bits, 256) for t in delta.values())
    assert len(blob) == 8 + header.header_len + n_payload and header.header_len < 2048
    assert header.metadata["dtype"] == dtype and header.metadata["quant_block_size"] == "256"
    assert {i.dtype for i in header.tensors.values()} == {"U8"}
    float32 = DeltaCodec("float32").encode(delta, DeltaMeta("w1", 3, 0))[0]
    ratio = len(float32) / len(blob)
    assert ratio >= (7.5 if dtype == "int4" else 3.9), ratio
    assert 0 < codec.rel_error < (0.2 if dtype == "int4" else 0.01)


def test_float32_files_are_unchanged_byte_for_byte():
    delta, meta = random_delta(Tiny(), 2), DeltaMeta("w1", 3, 0, created_at="2026-01-01T00:00:00+00:00")
    blob, residual = DeltaCodec("float32").encode(delta, meta)
    assert blob == encode(delta, meta.to_header()) and residual is None
    assert "quant_block_size" not in parse_header(blob).metadata  # the header of before


def test_int4_with_a_block_of_two_and_an_odd_number_of_blocks(tmp_path):
    """quant.dequantize read the bfloat16 scales in place: an odd code length (int4, block 2, odd blocks)
    or a payload at an odd offset in the file failed to view them as bfloat16."""
    model = Tiny(complex_param=True)  # w: 4, b: 2 (one block), z: complex [2] -> float32 [2, 2]
    delta = {k: torch.randn(s) for k, (s, _) in delta_layout(model.state_dict()).items()}
    blob, _ = DeltaCodec("int4", 2).encode(delta, DeltaMeta("w1", 3, 0))
    repo = DirectoryTransport(tmp_path / "repo")
    repo.write({delta_path("w1", 3): blob})
    got = decoded_by_master(repo, model)[3]
    for k, d in delta.items():
        want = dequantize(quantize(d.reshape(-1), 4, 2), d.numel(), 4, 2).view(d.shape)
        assert torch.equal(got[k], want), k


# ------------------------------------------------------------------ error feedback on the node


def run_boundaries(coord, model, steps, raw: list) -> None:
    """Train `steps` (1-based local steps), recording the raw delta of every boundary (float32 baseline
    minus weights, chained from boundary to boundary)."""
    for step in steps:
        train_step(model, step)
        if step % coord.s.inner_steps == 0:
            now = weights(model)
            raw.append({k: run_boundaries.base[k] - now[k] for k in now})
            run_boundaries.base = now
        coord.on_step(step)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_error_feedback_loses_nothing_over_boundaries(tmp_path, dtype):
    model = small()
    coord, spy, _ = worker(tmp_path, model=model, pseudo_grad_dtype=dtype, quant_block_size=16)
    run_boundaries.base, raw = weights(model), []
    run_boundaries(coord, model, range(1, 16), raw)  # 5 boundaries
    decoded = decoded_by_master(spy.inner, model)
    assert sorted(decoded) == [3, 6, 9, 12, 15] and coord.counters.uploads == 5
    assert_nothing_lost(raw, decoded.values(), coord.codec.residual)
    assert coord.metrics()["comm/cast_rel_error"] == coord.codec.rel_error > 0


def test_without_error_feedback_the_quantization_error_is_dropped(tmp_path):
    model = small()
    coord, spy, _ = worker(tmp_path, model=model, pseudo_grad_dtype="int4", error_feedback=False)
    run_boundaries.base, raw = weights(model), []
    run_boundaries(coord, model, range(1, 7), raw)
    assert coord.codec.residual == {}
    decoded = decoded_by_master(spy.inner, model)
    for step, d in zip((3, 6), raw):  # each file is Q(delta) alone
        for k, t in d.items():
            q = dequantize(quantize(t.reshape(-1), 4, 256), t.numel(), 4, 256).view(t.shape)
            assert torch.equal(decoded[step][k], q)


def test_a_failed_upload_loses_nothing_and_counts_nothing_twice(tmp_path):
    model = small()
    coord, spy, _ = worker(tmp_path, model=model, pseudo_grad_dtype="int4", quant_block_size=16)
    run_boundaries.base, raw = weights(model), []
    run_boundaries(coord, model, range(1, 4), raw)
    before = {k: t.clone() for k, t in coord.codec.residual.items()}
    spy.fail_writes = 1  # the upload at step 6 fails once
    run_boundaries(coord, model, range(4, 7), raw)
    assert coord.counters.upload_failures == 1 and coord.uploader.carry is not None
    for k, t in before.items():  # the residual moves only when an upload succeeds
        assert torch.equal(coord.codec.residual[k], t)
    run_boundaries(coord, model, range(7, 13), raw)  # step 9 carries step 6's delta
    decoded = decoded_by_master(spy.inner, model)
    assert sorted(decoded) == [3, 9, 12] and coord.counters.uploads == 3
    assert_nothing_lost(raw, decoded.values(), coord.codec.residual)


def test_the_residual_survives_a_restart_from_the_nodes_checkpoint(tmp_path):
    """A node restarted from its checkpoint sends the same next payload as the uninterrupted one; a node
    that lost its residual would not."""
    model = small()
    kw = dict(pseudo_grad_dtype="int4", quant_block_size=16)
    coord, spy, _ = worker(tmp_path / "a", model=model, initial=small().state_dict(), **kw)
    run_boundaries.base, raw = weights(model), []
    run_boundaries(coord, model, range(1, 7), raw)
    state, at_checkpoint = coord.state_dict(), weights(model)
    assert set(state["codec"]["residual"]) == set(coord.codec.residual)

    def restarted(name: str, checkpoint: dict | None):
        repo = DirectoryTransport(tmp_path / name / "repo")
        publish(repo, small().state_dict(), 0)
        again = Mlp(30, 20)
        again.load_state_dict(at_checkpoint)
        node = DumbDiLoCo(again, settings(tmp_path / name / "repo", **kw), repo)
        if checkpoint is not None:
            node.load_state_dict(checkpoint)
        node.start()
        return node, repo, again

    twin, twin_repo, twin_model = restarted("b", state)
    amnesiac, amnesiac_repo, amnesiac_model = restarted("c", {k: v for k, v in state.items() if k != "codec"})
    for node, m in ((coord, model), (twin, twin_model), (amnesiac, amnesiac_model)):
        for step in (7, 8, 9):
            train_step(m, step)
            node.on_step(step)
    sha = {n: n.uploader.last_uploaded for n in (coord, twin, amnesiac)}
    assert sha[twin] == sha[coord] and sha[coord][0] == 9  # the same payload SHA-256 at step 9
    assert sha[amnesiac] != sha[coord]
    payload = [r.read(delta_path("w1", 9)) for r in (spy.inner, twin_repo)]
    offsets = [8 + parse_header(b).header_len for b in payload]
    assert payload[0][offsets[0] :] == payload[1][offsets[1] :]


def test_a_checkpoint_with_an_upload_in_flight_counts_that_upload_as_done(tmp_path):
    """As for the delta (in no carry), the checkpoint's residual is the one after the upload in flight."""
    model = small()
    coord, spy, _ = worker(
        tmp_path, model=model, pseudo_grad_dtype="int8", quant_block_size=16, async_delta_upload=True
    )
    spy.block_writes = threading.Event()
    for step in (1, 2, 3):
        train_step(model, step)
        coord.on_step(step)
    assert spy.writes_started.wait(60) and coord.uploader.uploading
    state = coord.state_dict()
    assert coord.codec.residual == {}  # not committed while the upload is in flight
    spy.block_writes.set()
    coord.close()  # waits for the upload
    assert coord.counters.uploads == 1 and coord.codec.residual
    for k, t in coord.codec.residual.items():
        assert torch.equal(state["codec"]["residual"][k], t)


def test_a_translated_install_leaves_the_residual_alone(tmp_path):
    """install: translate shifts the weights, the baseline and the pending snapshots by G - S; the residual
    (quantization error of deltas already sent, a difference of deltas) is not shifted: across installs,
    what the master decoded plus the residual is still the sum of the deltas the node encoded."""
    model = small()
    coord, spy, _ = worker(  # its globals never include its deltas: every snapshot stays pending, uncapped
        tmp_path,
        model=model,
        pseudo_grad_dtype="int4",
        quant_block_size=16,
        install="translate",
        max_pending_snapshots=0,
    )
    inputs, encode_ = [], coord.codec.encode
    coord.codec.encode = lambda delta, meta: (inputs.append(delta), encode_(delta, meta))[1]
    for step in range(1, 13):
        train_step(model, step)
        coord.on_step(step)
        if step in (3, 7):  # installed at the boundaries 6 and 9
            newer = {k: t + 0.25 * step for k, t in small().state_dict().items()}
            publish(spy.inner, newer, coord.installer.outer_step + 1)
    assert (
        coord.counters.installs == 3 and coord.installer.outer_step == 2
    )  # the first global, then 2 translated
    assert coord.codec.residual and len(inputs) == 4
    assert_nothing_lost(inputs, decoded_by_master(spy.inner, model).values(), coord.codec.residual)


# ------------------------------------------------------------------ hostile quantized files on the master


def make_master(tmp_path):
    return make_loop(tmp_path, max_file_bytes=8192)


def int8_tiny(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: quantize(t.reshape(-1), 8, 256) for k, t in g(value).items()}


def put_raw(repo, tensors, step: int = 3, **meta) -> None:
    header = DeltaMeta("evil", step, 0).to_header() | {"dtype": "int8", "quant_block_size": "256"} | meta
    repo.write(
        {delta_path("evil", step): encode(tensors, {k: v for k, v in header.items() if v is not None})}
    )


def nan_scale(value: float) -> dict[str, torch.Tensor]:
    t = int8_tiny()
    t["w"][-2:] = torch.tensor([value], dtype=torch.bfloat16).view(torch.uint8)  # the one scale of w
    return t


HOSTILE = {
    "payload one byte short": (lambda r: put_raw(r, int8_tiny() | {"w": int8_tiny()["w"][:-1]}), "shape"),
    "int4 payload announced as int8": (
        lambda r: put_raw(r, {k: quantize(t.reshape(-1), 4, 256) for k, t in g(1.0).items()}),
        "shape",
    ),
    "unknown dtype": (lambda r: put_raw(r, int8_tiny(), dtype="int3"), "dtype must be one of"),
    "float16 (not decoded by the master)": (
        lambda r: put_raw(
            r, {k: t.half() for k, t in g(1.0).items()}, dtype="float16", quant_block_size=None
        ),
        "delta dtype is float16",
    ),
    "odd block size": (lambda r: put_raw(r, int8_tiny(), quant_block_size="255"), "quant_block_size must be"),
    "zero block size": (lambda r: put_raw(r, int8_tiny(), quant_block_size="0"), "quant_block_size must be"),
    "negative block size": (lambda r: put_raw(r, int8_tiny(), quant_block_size="-256"), "not a non-negative"),
    "missing block size": (lambda r: put_raw(r, int8_tiny(), quant_block_size=None), "is missing"),
    "NaN scale": (lambda r: put_raw(r, nan_scale(math.nan)), "NaN or Inf"),
    "inf scale": (lambda r: put_raw(r, nan_scale(math.inf)), "NaN or Inf"),
    "finite scale that overflows float32": (lambda r: put_raw(r, nan_scale(3e38)), "NaN or Inf"),
}


def assert_rejected_while_good_deltas_apply(tmp_path, caplog, plant, words: str, plant_good_at_6) -> None:
    """A file `plant` writes (evil's step 3) is rejected with `words` in one ledger line, published and
    logged, while a good delta of another node in the same round applies as if alone; a good delta of the
    same node afterwards (`plant_good_at_6`) applies."""
    loop, repo = make_master(tmp_path)
    plant(repo)
    put_delta(repo, "good", 3, g(2.0))
    result = loop.run_once()
    assert [e.node_id for e in result.applied] == ["good"]
    assert torch.allclose(loop.state.weights["w"], W0 - LR * (2.0 + MU * 2.0), atol=1e-6)  # as if alone
    (bad,) = [e for e in loop.state.ledger.entries() if e.status == "rejected"]
    assert (bad.node_id, bad.local_step) == ("evil", 3) and words in bad.reason, bad.reason
    assert "\n" not in bad.reason and words in caplog.text
    published = json.loads(repo.read(GLOBAL_LEDGER_PATH))["entries"]
    assert any(r["status"] == "rejected" and r["reason"] == bad.reason for r in published)
    plant_good_at_6(repo)
    r = loop.run_once()
    assert r.rejected == [] and [e.local_step for e in r.applied] == [6]


def put_good_int8(repo) -> None:
    blob, _ = DeltaCodec("int8").encode(g(1.0), DeltaMeta("evil", 6, 1))
    repo.write({delta_path("evil", 6): blob})


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_quantized_files_are_rejected_with_a_reason_and_good_deltas_still_apply(
    tmp_path, caplog, case
):
    plant, words = HOSTILE[case]
    assert_rejected_while_good_deltas_apply(tmp_path, caplog, plant, words, put_good_int8)


def test_the_master_computes_the_layout_the_announced_format_must_have():
    layout = delta_layout(Tiny().state_dict())
    assert wire_layout(layout, DeltaMeta("a", 1, 0)) is layout
    q = wire_layout(layout, DeltaMeta("a", 1, 0, dtype="int4", quant_block_size=4))
    assert q == {"w": ((4,), torch.uint8), "b": ((2 + 2,), torch.uint8)}  # codes 2 bytes + 1 scale; 1 + 1


# ------------------------------------------------------------------ configuration


def block(**kw) -> dict:
    return {"role": "worker", "node_id": "worker-1", "repo_id": "org/run", **kw}


def test_quantization_settings_validate():
    s = Settings.from_config(block(pseudo_grad_dtype="int4", error_feedback=True))
    assert (s.pseudo_grad_dtype, s.error_feedback, s.quant_block_size) == ("int4", True, 256)
    assert DeltaCodec.from_settings(s).error_feedback
    assert DeltaCodec.from_settings(Settings.from_config(block(pseudo_grad_dtype="int8"))).error_feedback
    s = Settings.from_config(block(pseudo_grad_dtype="int8", error_feedback=False, quant_block_size=2))
    assert not DeltaCodec.from_settings(s).error_feedback


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"error_feedback": True}, "error_feedback"),  # float32
        ({"pseudo_grad_dtype": "int8", "quant_block_size": 255}, "quant_block_size"),
        ({"pseudo_grad_dtype": "int4", "quant_block_size": 0}, "quant_block_size"),
        ({"pseudo_grad_dtype": "int3"}, "pseudo_grad_dtype"),
        ({"pseudo_grad_dtype": "bfloat16"}, "pseudo_grad_dtype"),  # the master does not decode it
    ],
)
def test_bad_quantization_settings_fail_with_one_line_naming_the_key(change, key):
    with pytest.raises(ConfigError) as err:
        Settings.from_config(block(**change))
    assert f"distributed.{key}" in str(err.value) and "\n" not in str(err.value)


def test_the_whole_config_is_refused_before_anything_is_built():
    from trainer_utils import compose_cfg

    cfg = compose_cfg(
        ["distributed=dumb_diloco", "distributed.node_id=w", "distributed.repo_id=/x"]
        + ["distributed.quant_block_size=3", "distributed.pseudo_grad_dtype=int4"]
    )
    with pytest.raises(ConfigError, match=r"distributed\.quant_block_size must be even"):
        validate(cfg)


def test_the_configuration_table_lists_the_quantization_keys_with_their_defaults():
    from pathlib import Path

    import yaml
    from omegaconf import OmegaConf
    from trainer_utils import compose_cfg

    d = OmegaConf.to_container(compose_cfg(["distributed=dumb_diloco"]).distributed, resolve=False)
    text = (Path(__file__).resolve().parents[3] / "docs" / "dumb_diloco.md").read_text()
    section = text[text.index("## Configuration") : text.index("## Repository layout")]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, flags=re.M))
    for key in ("pseudo_grad_dtype", "error_feedback", "quant_block_size"):
        assert key in rows and yaml.safe_load(rows[key]) == d[key], key


# ------------------------------------------------------------------ end to end, in process


def test_a_master_and_a_worker_with_int4_deltas_apply_every_delta(tmp_path):
    """Two nodes (the master trains too), int4 deltas, four boundaries each, then the end of the run: the
    worker waits until the master applied its final delta, the master drains until every node's final
    delta is applied. Every delta file is int4 and every one of the 8 is applied, none rejected."""
    kw = dict(pseudo_grad_dtype="int4", quant_block_size=16, poll_interval=0.02)
    kw |= dict(shutdown_timeout=60.0, drain_timeout=60.0, outer_momentum=0.0)
    m_model, w_model = small(), small()
    repo = DirectoryTransport(tmp_path / "repo")
    master = DumbDiLoCo(m_model, settings(tmp_path / "repo", role="master", node_id="m", **kw), repo)
    master.start()
    node = DumbDiLoCo(w_model, settings(tmp_path / "repo", node_id="w1", startup_timeout=60.0, **kw), repo)
    node.start()
    for step in range(1, 13):
        for n, m in ((master, m_model), (node, w_model)):
            train_step(m, step + (100 if n is node else 0))
            n.on_step(step)
    node.finish()
    master.finish()
    entries = master.outer.state.ledger.entries()
    assert sorted((e.node_id, e.local_step, e.status) for e in entries) == [
        (who, s, "applied") for who in ("m", "w1") for s in (3, 6, 9, 12)
    ]
    assert master.outer.deltas_accepted == 8 and master.outer.deltas_rejected == 0
    assert node.final_status.startswith("applied") and master.final_status.startswith("applied")
    files = [f for f in repo.list("nodes") if f.path.endswith(".safetensors")]
    assert len(files) == 8
    assert {parse_header(repo.read(f.path)).metadata["dtype"] for f in files} == {"int4"}
    assert node.counters.bytes_uploaded == sum(f.size for f in files if f.path.startswith("nodes/w1/"))
    node.close()  # finish() does not close (the trainer closes last)
    master.close()
