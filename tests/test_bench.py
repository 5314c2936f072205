"""Every benchmark (scripts/bench_*.py) runs once at its tiny size and writes its JSON record.

No timing is asserted here: benchmarks measure, `make bench` reports. These tests only prove the
scripts still run against the current code and write what the report reads.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tiny(name: str, out: Path, *extra: str) -> dict:
    code = load(name).main(["--tiny", "--out", str(out), *extra])
    assert code == 0
    record = json.loads((out / f"{name.removeprefix('bench_')}.json").read_text())
    for key in ("machine", "commit", "command", "rows", "columns"):
        assert key in record, key
    assert record["machine"]["cpu"] and record["machine"]["torch"]
    return record


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
