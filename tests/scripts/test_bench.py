"""Every benchmark (diloco.bench, run as scripts/bench_*.py) runs once at its tiny size and writes its JSON record.

No timing is asserted here: benchmarks measure, `make bench` reports. These tests only prove the
scripts still run against the current code and write what the report reads.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest


def load(name: str):
    """The benchmark module behind scripts/<name>.py."""
    return importlib.import_module(f"diloco.bench.{name.removeprefix('bench_')}")


def run_tiny(name: str, out: Path, *extra: str) -> dict:
    code = load(name).main(["--tiny", "--out", str(out), *extra])
    assert code == 0
    record = json.loads((out / f"{name.removeprefix('bench_')}.json").read_text())
    for key in ("machine", "commit", "command", "rows", "columns"):
        assert key in record, key
    assert record["machine"]["cpu"] and record["machine"]["torch"]
    return record


def test_quant(tmp_path):
    record = run_tiny("bench_quant", tmp_path)
    pairs = {(r["dtype"], r["payload bytes"]) for r in record["rows"]}
    # 262,144 values: int8/int4 codes + a bfloat16 scale per 256; topk2 64 chunks x 116 bytes (64 of 4,096)
    assert pairs == {("int8", 264192), ("int4", 133120), ("topk2", 64 * 116)}


def test_wire(tmp_path):
    record = run_tiny("bench_wire", tmp_path)
    assert {r["dtype"] for r in record["rows"]} == {"float32", "float16"}
    # the header-only reads never fetched the payload (a property, not a timing)
    for d in record["details"]:
        assert d["header_read_bytes_directory"] - d["header_bytes"] < d["payload_bytes"]
    hub = record["hub_header"]
    assert hub["read_header_response_bytes"] <= hub["header_len"] < hub["file_bytes"]


@pytest.mark.parametrize("value", [0.0, 1.5, 1234.5678, 1e-7, float("nan"), None, "x"])
def test_table_formatting(value):
    common = load("bench_common")
    text = common.table([{"a": value, "b": 1}], ["a", "b"])
    assert text.count("\n") == 2 and text.startswith("| a | b |")


@pytest.mark.slow  # runs the real trainer end to end
def test_trainer(tmp_path):
    record = run_tiny("bench_trainer", tmp_path)
    (row,) = record["rows"]
    assert row["trainer tok/s"] > 0 and row["plain loop tok/s"] > 0


@pytest.mark.slow  # runs the real trainer end to end
def test_comm_volume(tmp_path):
    record = run_tiny("bench_comm_volume", tmp_path)
    rows = {(r["mode"], r["pseudo-grad dtype"]): r for r in record["rows"]}
    # bytes are counted, not timed: the trainer's own counters agree with the analytic payload
    assert rows[("diloco", "float16")]["measured/analytic"] == 1.0
    assert 1.0 <= rows[("dumb_diloco upload", "float32")]["measured/analytic"] < 1.01  # header bytes
    paper = record["tables"]["Paper runs: bytes each worker sends over the whole run"]["rows"]
    assert paper[0]["params"] == 214_983_680  # 150M: 215.0M parameters in total


@pytest.mark.slow  # runs the real trainer end to end, twice, over 2 gloo processes
def test_fsdp(tmp_path):
    record = run_tiny("bench_fsdp", tmp_path)
    ddp, fsdp = record["rows"]
    assert (ddp["worker_parallel"], fsdp["worker_parallel"]) == ("ddp", "fsdp")
    # bytes are counted, not timed: a rank of a 2-rank FSDP worker holds half the global copy and momentum
    # (dim-0 shards of odd-sized tensors round up: within 1%)
    assert fsdp["state_vs_ddp"] == pytest.approx(0.5, rel=0.01)
    assert ddp["outer_rounds"] == fsdp["outer_rounds"] == 2
    off, on = record["tables"]["activation checkpointing"]["rows"]
    assert not off["activation_checkpointing"] and on["activation_checkpointing"]
    assert on["estimate_float32_mib"] < off["estimate_float32_mib"]


def test_outer_step(tmp_path):
    record = run_tiny("bench_outer_step", tmp_path)
    assert {r["impl"] for r in record["rows"]} == {"naive", "project"}
    assert all(r["floor_s"] > 0 for r in record["rows"])


def test_outer_step_implementations_agree():
    """The naive per-parameter baseline computes what the project's DiLoCo.outer_step does."""
    import threading

    import torch

    bench = load("bench_outer_step")
    from diloco import comm

    shapes = bench.model_shapes("micro")
    finals = {}
    for impl in ("project", "naive"):
        group = comm.InProcessGroup(2, timeout_seconds=60)
        workers = [bench.IMPLS[impl](shapes, group.member(r), "float32") for r in range(2)]
        start = threading.Barrier(2)
        for _ in range(3):
            bench.run_round(workers, start)
        finals[impl] = [p.detach().clone() for p in workers[0].params]
    for a, b in zip(finals["project"], finals["naive"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_gpu_script_skips_cleanly_without_cuda(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load("bench_gpu").main(["--out", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_gpu_script_runs_on_cpu_at_tiny_size(tmp_path):
    record = load("bench_gpu").main(["--tiny", "--allow-cpu", "--out", str(tmp_path)])
    assert record == 0
    out = json.loads(next(tmp_path.glob("gpu*.json")).read_text())
    assert out["rows"][0]["tokens/s"] > 0 and out["flops"]["total"] > out["flops"]["dense"]
    assert {o["global copy on"] for o in out["outer"]} == {"device", "cpu"}


def test_boundary(tmp_path):
    record = run_tiny("bench_boundary", tmp_path)
    modes = {r["mode"] for r in record["rows"]}
    assert modes == {"v2 (async upload)", "v2 before (delta + copy)", "v1 (sync upload)"}
    for d in record["details"]:  # every measured boundary uploaded its delta through the throttled link
        assert d["uploads"] >= 1 and d["bytes_uploaded"] >= d["delta_bytes"] > 0


def test_throttled_transport_takes_size_over_bandwidth(tmp_path):
    import time

    from diloco.dumb_diloco.store.throttled import ThrottledTransport
    from diloco.dumb_diloco.store.transport import DirectoryTransport

    t = ThrottledTransport(DirectoryTransport(tmp_path / "repo"), bytes_per_s=1e6)
    start = time.perf_counter()
    t.write({"a/b.bin": b"x" * 100_000})
    assert time.perf_counter() - start >= 0.1  # a lower bound only: 100 kB at 1 MB/s
    assert t.read("a/b.bin") == b"x" * 100_000 and t.bytes_up == t.bytes_down == 100_000


@pytest.mark.slow  # runs the real trainer end to end
def test_utilization(tmp_path):
    record = run_tiny("bench_utilization", tmp_path)
    modes = {"DiLoCo FP32", "DiLoCo int4 P=4 overlap", "DiLoCo topk2 P=4 eager", "DumbDiLoCo v2"}
    assert {r["mode"] for r in record["rows"]} == modes
    for r in record["rows"]:
        assert 0 < r["utilization"] <= 1


def test_report_collects_every_record(tmp_path):
    run_tiny("bench_wire", tmp_path)
    (tmp_path / "FINDINGS.md").write_text("## Findings\n\nhand-written")
    assert load("bench_report").main(["--out", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "3. Wire format" in readme and "hand-written" in readme and "7. GPU**: not measured" in readme


@pytest.mark.parametrize("name", ["bench_aggregation", "bench_node_memory"])
def test_labelled_runs_are_kept_side_by_side(tmp_path, name):
    """The before/after benchmarks keep each run under its label: a second label leaves the first. The
    benchmark runs once (its "before"); the "after" is a second checkout's record written as main()
    writes its own (bench.common.write_labelled), so the merge is tested without measuring twice."""
    from diloco.bench import common as bc

    module, key = load(name), name.removeprefix("bench_")
    assert module.main(["--tiny", "--out", str(tmp_path), "--label", "before"]) == 0
    before = json.loads((tmp_path / f"{key}.json").read_text())["runs"]["before"]
    bc.write_labelled(tmp_path, key, "after", {**before, "code_commit": "0" * 40}, module.report)
    record = json.loads((tmp_path / f"{key}.json").read_text())
    assert record["runs"]["before"] == before and record["runs"]["after"]["code_commit"] == "0" * 40
    assert record["name"] == key and set(record["runs"]) == {"before", "after"}
    for run in record["runs"].values():
        assert run["machine"]["cpu"] and run["bench_commit"] and run["command"]
    assert "before" in (tmp_path / f"{key}.md").read_text()


def test_a_record_is_dirty_only_for_tracked_changes_outside_the_excluded_folders(tmp_path, monkeypatch):
    """`common.commit`'s rule, through metrics.git_commit: a benchmark rewriting results/ as it goes
    stays clean; any other tracked change is -dirty; a copy without git names DILOCO_GIT_COMMIT."""
    import subprocess

    from diloco.metrics import git_commit

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c", "--allow-empty")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "files")
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    (tmp_path / "results" / "r.json").write_text('{"a": 1}')
    (tmp_path / "untracked.txt").write_text("not counted")
    assert git_commit(tmp_path, exclude=("results",)) == sha
    assert git_commit(tmp_path) == f"{sha}-dirty"
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path, exclude=("results",)) == f"{sha}-dirty"
    monkeypatch.setenv("DILOCO_GIT_COMMIT", "abc123")
    assert git_commit(tmp_path / "no-such-folder") == "abc123"
