"""Judging runs against the paper: read run directories, compute the figures the paper reports, and
check them against `results/reference.yaml` (absolute numbers and the paper's claims in relative form).

Used by `scripts/check.py` (`make check`) and `scripts/report.py` (`make report`). Both read either a
folder of run directories (`runs/`) or a committed record (`results/<family>/`, its `summaries.json`):
a record keeps, per run, the summary and the metric records the verdicts are computed from
(`judged_records`), so judging it again gives the verdicts it was made with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference.yaml"


@dataclass
class Run:
    """One run directory: its summary, its metric records, and what they say."""

    path: Path
    summary: dict
    records: list[dict] = field(repr=False)

    @property
    def config(self) -> dict:
        return self.summary.get("config", {})

    @property
    def reference(self) -> str | None:
        return self.config.get("launch", {}).get("reference")

    @property
    def family(self) -> str | None:
        return self.config.get("launch", {}).get("family")

    @property
    def finished(self) -> bool:
        return self.summary.get("status") == "completed"

    @property
    def report_step(self) -> int:
        return self.config.get("launch", {}).get("report_step") or self.summary.get("step", 0)

    def evals(self) -> list[tuple[int, float]]:
        return [(r["step"], r["eval/perplexity"]) for r in self.records if "eval/perplexity" in r]

    def eval_perplexity(self, step: int | None = None) -> float | None:
        """Held-out perplexity at the report step (or the latest eval at or before `step`)."""
        step = self.report_step if step is None else step
        before = [p for s, p in self.evals() if s <= step]
        return before[-1] if before else None

    def train_perplexity(self, window: float) -> float | None:
        """exp(mean training loss) over the last `window` of the run up to the report step (the paper's metric)."""
        end = self.report_step
        start = end * (1 - window)
        losses = [r["Loss"] for r in self.records if "Loss" in r and start <= r["step"] <= end]
        return math.exp(sum(losses) / len(losses)) if losses else None

    def bytes_per_inner_step(self) -> float | None:
        total, steps = self.summary.get("comm/total_bytes"), self.summary.get("step")
        return total / steps if total is not None and steps else None


RECORD = "summaries.json"  # a report's record of its runs (scripts/report.py)
PLOTTED = ("comm/cast_rel_error", "outer/compute_utilization")  # series the report plots per round


def judged_records(run: Run, window: float) -> list[dict]:
    """The metric records that judging and plotting `run` read: every evaluation and plotted series,
    the training losses of the window the paper's number is compared with, and the bytes communicated
    by each evaluation."""
    end = run.report_step
    start = end * (1 - window)
    keep = [r for r in run.records if "eval/perplexity" in r or any(k in r for k in PLOTTED)]
    keep += [
        {"step": r["step"], "Loss": r["Loss"]}
        for r in run.records
        if "Loss" in r and start <= r["step"] <= end
    ]
    comm = [r for r in run.records if "comm/total_bytes" in r]
    for step, _ in run.evals():
        before = [r for r in comm if r["step"] <= step]
        if before:
            keep.append({"step": before[-1]["step"], "comm/total_bytes": before[-1]["comm/total_bytes"]})
    unique = {json.dumps(r, sort_keys=True): r for r in keep}
    return sorted(unique.values(), key=lambda r: r["step"])


def load_record(root: Path) -> list[Run]:
    """The runs of a committed record. A record written before records were kept holds only each run's
    final evaluation (its summary's final_eval_perplexity at its last step)."""
    runs = []
    for label, entry in json.loads((Path(root) / RECORD).read_text()).items():
        summary = {k: v for k, v in entry.items() if k != "records"}
        records = entry.get("records")
        if records is None:
            records = []
            if summary.get("final_eval_perplexity") is not None:
                records.append(
                    {"step": summary.get("step", 0), "eval/perplexity": summary["final_eval_perplexity"]}
                )
        runs.append(Run(Path(root) / label, summary, records))
    return runs


def load_runs(root: Path) -> list[Run]:
    """The run directories under `root`, or the runs of the record `root` holds."""
    if (Path(root) / RECORD).exists():
        return load_record(root)
    runs = []
    for summary_path in sorted(Path(root).glob("*/summary.json")):
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError:
            continue
        metrics = summary_path.parent / "metrics.jsonl"
        records = []
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        runs.append(Run(summary_path.parent, summary, records))
    return runs


def by_reference(runs: list[Run]) -> dict[str, Run]:
    """One run per reference key; of a DumbDiLoCo run's node directories, the master's (it owns the global model)."""
    out: dict[str, Run] = {}
    for r in runs:
        if not r.reference:
            continue
        role = r.config.get("distributed", {}).get("role")
        if r.reference not in out or role == "master":
            out[r.reference] = r
    return out


@dataclass
class Verdict:
    id: str
    claim: str
    expected: str
    measured: str
    delta: str
    verdict: str  # PASS | FAIL | PENDING

    def row(self) -> list[str]:
        return [self.id, self.claim, self.expected, self.measured, self.delta, self.verdict]


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def check_absolute(runs: dict[str, Run], reference: dict) -> list[Verdict]:
    out = []
    window = reference.get("train_window", 0.02)
    for key, ref in (reference.get("runs") or {}).items():
        run = runs.get(key)
        expected = f"{ref['perplexity']:.2f} +- {ref['tolerance']}"
        if run is None or not run.finished:
            out.append(Verdict(key, ref["source"], expected, "-", "-", "PENDING"))
            continue
        train_ppl = run.train_perplexity(window)
        delta = train_ppl - ref["perplexity"] if train_ppl is not None else None
        ok = delta is not None and abs(delta) <= ref["tolerance"]
        measured = f"train {_fmt(train_ppl)} / eval {_fmt(run.eval_perplexity())}"
        out.append(Verdict(key, ref["source"], expected, measured, _fmt(delta), "PASS" if ok else "FAIL"))
    return out


def _factor(spec, run: Run) -> float:
    """`factor: H` / `2H` refer to run a's inner_steps."""
    if isinstance(spec, int | float):
        return float(spec)
    h = run.config.get("distributed", {}).get("inner_steps", 1)
    return float(spec[:-1] or 1) * h if spec.endswith("H") else float(spec)


def check_claim(claim: dict, runs: dict[str, Run]) -> Verdict:
    a, b = runs.get(claim["a"]), runs.get(claim["b"])
    kind, tol = claim["kind"], claim.get("tolerance", 0.0)
    if a is None or b is None or not (a.finished and b.finished):
        missing = [k for k, r in ((claim["a"], a), (claim["b"], b)) if r is None or not r.finished]
        return Verdict(claim["id"], claim["claim"], kind, f"waiting for {', '.join(missing)}", "-", "PENDING")
    if kind == "bytes_ratio":
        factor = _factor(claim["factor"], a)
        ba, bb = a.bytes_per_inner_step(), b.bytes_per_inner_step()
        ratio = bb / ba if ba else None
        ok = ratio is not None and abs(ratio / factor - 1) <= tol
        return Verdict(
            claim["id"],
            claim["claim"],
            f"{factor:.0f}x",
            f"{_fmt(ratio, 1)}x",
            _fmt(None if ratio is None else ratio / factor - 1, 3),
            "PASS" if ok else "FAIL",
        )
    if kind == "gap_closes":
        end = min(a.report_step, b.report_step)
        early = int(end * claim.get("early", 0.1))
        pa_e, pb_e = _eval_at_or_after(a, early), _eval_at_or_after(b, early)
        pa, pb = a.eval_perplexity(end), b.eval_perplexity(end)
        if None in (pa_e, pb_e, pa, pb):
            return Verdict(claim["id"], claim["claim"], kind, "no eval records", "-", "FAIL")
        gap_early, gap_end = pa_e - pb_e, pa - pb
        ok = gap_early > 0 and gap_end < gap_early
        return Verdict(
            claim["id"],
            claim["claim"],
            "gap early > 0, gap end < gap early",
            f"gap {gap_early:+.2f} at step {early} -> {gap_end:+.2f} at {end}",
            _fmt(gap_end - gap_early),
            "PASS" if ok else "FAIL",
        )
    pa, pb = a.eval_perplexity(), b.eval_perplexity()
    if pa is None or pb is None:
        return Verdict(claim["id"], claim["claim"], kind, "no eval records", "-", "FAIL")
    if kind == "ratio_within":
        rel = pa / pb - 1
        return Verdict(
            claim["id"],
            claim["claim"],
            f"abs(a/b-1) <= {tol:.0%}",
            f"{pa:.2f} vs {pb:.2f}",
            f"{rel:+.2%}",
            "PASS" if abs(rel) <= tol else "FAIL",
        )
    if kind == "less_than":
        rel = pa / pb - 1
        return Verdict(
            claim["id"],
            claim["claim"],
            f"a/b-1 < {tol:+.0%}",
            f"{pa:.2f} vs {pb:.2f}",
            f"{rel:+.2%}",
            "PASS" if rel < tol else "FAIL",
        )
    if kind == "abs_within":
        d = pa - pb
        return Verdict(
            claim["id"],
            claim["claim"],
            f"abs(a-b) <= {tol}",
            f"{pa:.2f} vs {pb:.2f}",
            f"{d:+.2f}",
            "PASS" if abs(d) <= tol else "FAIL",
        )
    raise ValueError(f"unknown claim kind {kind!r} in {claim['id']}")


def _eval_at_or_after(run: Run, step: int) -> float | None:
    after = [p for s, p in run.evals() if s >= step]
    return after[0] if after else None


def check(root: Path, families: list[str] | None = None, reference_path: Path = REFERENCE) -> list[Verdict]:
    reference = yaml.safe_load(Path(reference_path).read_text())
    runs = by_reference(load_runs(root))
    wanted = families or sorted({k.split("/")[0] for k in runs} | set())
    verdicts = [v for v in check_absolute(runs, reference) if v.id.split("/")[0] in wanted]
    for family in wanted:
        verdicts += [check_claim(c, runs) for c in (reference.get("claims") or {}).get(family, [])]
    return verdicts


def markdown_table(verdicts: list[Verdict]) -> str:
    head = ["check", "what", "expected", "measured", "delta", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(v.row()) + " |" for v in verdicts]
    return "\n".join(lines)
