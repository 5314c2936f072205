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
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from diloco import scaling_law

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference.yaml"
RECORD_REFERENCE = "reference.yaml"  # beside a record's runs: the yardstick it was judged with


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


def seed_roots(root: Path) -> list[Path]:
    """The folders of one family's runs, one per seed: `root` itself when it holds run directories or a
    record, else its subfolders that do (runs/tiny/s1337, runs/tiny/s1; a record's s1337/, s1/)."""
    root = Path(root)

    def holds_runs(d: Path) -> bool:
        return (d / RECORD).exists() or any(d.glob("*/summary.json"))

    if not root.is_dir() or holds_runs(root):
        return [root]
    return sorted(d for d in root.iterdir() if d.is_dir() and holds_runs(d)) or [root]


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
    verdict: str  # PASS | FAIL | PENDING | UNCERTAIN (seeds on both sides) | REPORTED | NOT TESTED

    def row(self) -> list[str]:
        return [self.id, self.claim, self.expected, self.measured, self.delta, self.verdict]


@dataclass
class Measure:
    """One seed's figure for a check: what it measured, the number it is judged on, and the judgement."""

    expected: str
    measured: str
    value: float | None
    ok: bool
    unit: str = ""  # "%": value is a fraction; "pp": percentage points; "": as it is


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _value(x: float | None, unit: str, sign: bool = True) -> str:
    if x is None:
        return "-"
    if unit == "%":
        return f"{x:+.2%}" if sign else f"{x:.2%}"
    if unit == "pp":
        return f"{100 * x:+.1f} pp" if sign else f"{100 * x:.1f} pp"
    return f"{x:+.2f}" if sign and unit == "ppl" else _fmt(x, 3 if unit == "x" else 2)


def judge(check_id: str, what: str, seeds: list[Measure], reported: bool = False) -> Verdict:
    """One verdict from each seed's measure. One seed: its judgement. Several: the mean and sample
    standard deviation of the judged number, PASS if every seed passes, FAIL if none does, UNCERTAIN
    otherwise. `reported`: the figure is printed and not judged (verdict REPORTED)."""
    first = seeds[0]
    values = [m.value for m in seeds if m.value is not None]
    delta = _value(first.value, first.unit)
    if len(seeds) > 1:
        delta = "-"
        if values:
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            sd_text = _value(sd, first.unit, sign=False)
            delta = f"{_value(statistics.fmean(values), first.unit)} ± {sd_text} (sd, {len(seeds)} seeds)"
    passed = sum(m.ok for m in seeds)
    verdict = "PASS" if passed == len(seeds) else "FAIL" if passed == 0 else "UNCERTAIN"
    measured = "; ".join(m.measured for m in seeds)
    return Verdict(check_id, what, first.expected, measured, delta, "REPORTED" if reported else verdict)


def check_absolute(seeds: list[dict[str, Run]], reference: dict) -> list[Verdict]:
    out = []
    window = reference.get("train_window", 0.02)
    for key, ref in (reference.get("runs") or {}).items():
        expected = f"{ref['perplexity']:.2f} +- {ref['tolerance']}"
        if any(runs.get(key) is None or not runs[key].finished for runs in seeds):
            out.append(Verdict(key, ref["source"], expected, "-", "-", "PENDING"))
            continue
        measures = []
        for runs in seeds:
            train_ppl = runs[key].train_perplexity(window)
            delta = train_ppl - ref["perplexity"] if train_ppl is not None else None
            ok = delta is not None and abs(delta) <= ref["tolerance"]
            measured = f"train {_fmt(train_ppl)} / eval {_fmt(runs[key].eval_perplexity())}"
            measures.append(Measure(expected, measured, delta, ok))
        out.append(judge(key, ref["source"], measures))
    return out


def _factor(spec, run: Run) -> float:
    """`factor: H` / `2H` refer to run a's inner_steps."""
    if isinstance(spec, int | float):
        return float(spec)
    h = run.config.get("distributed", {}).get("inner_steps", 1)
    return float(spec[:-1] or 1) * h if spec.endswith("H") else float(spec)


def eval_loss(run: Run) -> float | None:
    """Held-out loss at the report step (the log of its perplexity)."""
    ppl = run.eval_perplexity()
    return math.log(ppl) if ppl is not None else None


def loss_gap_law(claim: dict, a: Run, b: Run, reference: dict) -> Measure:
    """a's gap to b in held-out loss (a/b - 1), judged against the gap the DiLoCo scaling law predicts
    for a's size and worker count (diloco.scaling_law): PASS inside its 95% prediction interval."""
    params = a.summary.get("parameters", {}).get(claim.get("params", "total"))
    workers = int(a.summary.get("num_workers") or a.config.get("distributed", {}).get("num_workers", 0))
    la, lb = eval_loss(a), eval_loss(b)
    if not params or not workers or la is None or lb is None:
        return Measure("the scaling law's gap", "no eval records or no size", None, False, "%")
    try:
        predicted = scaling_law.from_reference(reference, workers).predict(params)
    except ValueError as err:
        return Measure("the scaling law's gap", str(err), None, False, "%")
    gap = la / lb - 1
    ppl_gap = math.exp(la - lb) - 1
    tokens = a.summary.get("tokens_seen") or 0
    measured = (
        f"loss {la:.3f} vs {lb:.3f}: {gap:+.1%} (perplexity {ppl_gap:+.1%}), "
        f"{tokens / params:.1f} tokens/param"
    )
    ok = predicted.low <= gap <= predicted.high
    if not ok:  # which side: a gap below the interval is DiLoCo doing better than the law predicts
        measured += ", below the law's interval" if gap < predicted.low else ", above the law's interval"
    return Measure(f"loss gap {predicted.describe()}", measured, gap, ok, "%")


# The parameter count a law claim reads N as, unless the claim names one (`params:`). The study's
# text at hand does not say which count its N is; non-embedding is the scaling-law convention (Kaplan
# et al. 2020), and it keeps the vocabulary's embeddings (38-84% of this project's small models, a few %
# of the study's) from standing in for model size. Both counts are printed in every law claim.
LAW_COUNT = "non_embedding"
COUNT_NAMES = {"non_embedding": "non-embedding", "total": "total"}


@dataclass
class LawReading:
    """One seed's loss gap of a to b, with the law's prediction at a's size in both parameter counts."""

    la: float
    lb: float
    tokens: float
    params: dict  # count -> N
    predictions: dict  # count -> scaling_law.Prediction
    decades: dict  # count -> log10(the study's smallest N / N): how far below its data

    @property
    def gap(self) -> float:
        return self.la / self.lb - 1

    def losses(self) -> str:
        return f"loss {self.la:.3f} vs {self.lb:.3f}: {self.gap:+.1%} (perplexity {math.exp(self.la - self.lb) - 1:+.1%})"

    def law(self, count: str) -> str:
        return f"{self.predictions[count].describe()} in {COUNT_NAMES[count]} N"


def law_reading(a: Run, b: Run, reference: dict) -> LawReading | str:
    """The law's reading of a against b, or why there is none (one line)."""
    counts = a.summary.get("parameters", {})
    workers = int(a.summary.get("num_workers") or a.config.get("distributed", {}).get("num_workers", 0))
    la, lb = eval_loss(a), eval_loss(b)
    if any(not counts.get(c) for c in COUNT_NAMES) or not workers or la is None or lb is None:
        return "no eval records, or no total and non-embedding parameter counts"
    try:
        law = scaling_law.from_reference(reference, workers)
    except ValueError as err:
        return str(err)
    params = {c: float(counts[c]) for c in COUNT_NAMES}
    predictions = {c: law.predict(n) for c, n in params.items()}
    decades = {c: math.log10(law.sizes[0] / n) for c, n in params.items()}
    return LawReading(la, lb, float(a.summary.get("tokens_seen") or 0), params, predictions, decades)


def law_claim(claim: dict, a: Run, b: Run, reference: dict) -> Measure:
    """The one-sided claims about DiLoCo's loss gap to M x DDP (kinds loss_gap_sign, loss_gap_bound,
    loss_gap_centre); see results/reference.yaml."""
    kind, count = claim["kind"], claim.get("params", LAW_COUNT)
    reading = law_reading(a, b, reference)
    if isinstance(reading, str):
        return Measure(kind, reading, None, False, "%")
    gap, pred = reading.gap, reading.predictions[count]
    if kind == "loss_gap_sign":
        return Measure("gap > 0 on every seed", reading.losses(), gap, gap > 0, "%")
    other = "total" if count == "non_embedding" else "non_embedding"
    if kind == "loss_gap_bound":
        expected = (
            f"gap <= {pred.high:+.1%}, the law's upper 95% bound ({reading.law(count)}; {reading.law(other)}): "
            f"holds only if the power law does {reading.decades[count]:.1f} decades below the study's 35M"
        )
        per_param = reading.tokens / reading.params[count]
        measured = f"{reading.losses()}, {per_param:.1f} tokens per {COUNT_NAMES[count]} parameter"
        return Measure(expected, measured, gap, gap <= pred.high, "%")
    if kind == "loss_gap_centre":
        ratio, other_ratio = gap / pred.gap, gap / reading.predictions[other].gap
        expected = f"the law's centre: {reading.law(count)}; {reading.law(other)}"
        measured = (
            f"{gap:+.1%} = {ratio:.2f}x the centre in {COUNT_NAMES[count]} N "
            f"({other_ratio:.2f}x in {COUNT_NAMES[other]} N)"
        )
        return Measure(expected, measured, ratio, True, "x")
    raise ValueError(f"unknown claim kind {kind!r} in {claim['id']}")


def measure(claim: dict, a: Run, b: Run, reference: dict | None = None) -> Measure:
    """One seed's figure for a claim in relative form (results/reference.yaml, `claims`)."""
    kind, tol = claim["kind"], claim.get("tolerance", 0.0)
    if kind == "loss_gap_law":
        return loss_gap_law(claim, a, b, reference or {})
    if kind in ("loss_gap_sign", "loss_gap_bound", "loss_gap_centre"):
        return law_claim(claim, a, b, reference or {})
    if kind == "bytes_ratio":
        factor = _factor(claim["factor"], a)
        ba, bb = a.bytes_per_inner_step(), b.bytes_per_inner_step()
        ratio = bb / ba if ba else None
        rel = None if ratio is None else ratio / factor - 1
        ok = rel is not None and abs(rel) <= tol
        return Measure(f"{factor:.0f}x", f"{_fmt(ratio, 1)}x", rel, ok, "x")
    if kind == "gap_closes":  # relative gaps a/b - 1, at the first eval at or after the early fraction
        end = min(a.report_step, b.report_step)
        early = _first_eval_step(a, b, int(end * claim.get("early", 0.1)))
        expected = "gap early > 0, gap end < gap early"
        if early is None:
            return Measure(expected, "no eval records", None, False, "pp")
        pa_e, pb_e, pa, pb = (
            a.eval_perplexity(early),
            b.eval_perplexity(early),
            a.eval_perplexity(end),
            b.eval_perplexity(end),
        )
        if None in (pa_e, pb_e, pa, pb):
            return Measure(expected, "no eval records", None, False, "pp")
        gap_early, gap_end = pa_e / pb_e - 1, pa / pb - 1
        measured = f"gap {gap_early:+.1%} at step {early} -> {gap_end:+.1%} at {end}"
        return Measure(expected, measured, gap_end - gap_early, gap_early > 0 and gap_end < gap_early, "pp")
    pa, pb = a.eval_perplexity(), b.eval_perplexity()
    bars = {
        "ratio_within": f"abs(a/b-1) <= {tol:.0%}",
        "less_than": f"a/b-1 < {tol:+.0%}",
        "abs_within": f"abs(a-b) <= {tol}",
    }
    if kind not in bars:
        raise ValueError(f"unknown claim kind {kind!r} in {claim['id']}")
    if pa is None or pb is None:
        return Measure(kind, "no eval records", None, False)
    measured = f"{pa:.2f} vs {pb:.2f}"
    if kind == "abs_within":
        return Measure(bars[kind], measured, pa - pb, abs(pa - pb) <= tol, "ppl")
    rel = pa / pb - 1
    return Measure(bars[kind], measured, rel, abs(rel) <= tol if kind == "ratio_within" else rel < tol, "%")


def bar_words(claim: dict) -> str:
    """A claim's bar in words before its runs exist (a judged row says it with the runs' numbers)."""
    tol, a, b = claim.get("tolerance", 0.0), claim.get("a", "a"), claim.get("b", "b")
    words = {
        "ratio_within": f"{a}'s perplexity within {tol:.0%} of {b}'s",
        "less_than": f"{a}'s perplexity / {b}'s - 1 below {tol:+.0%}",
        "abs_within": f"{a}'s perplexity within {tol} of {b}'s",
        "bytes_ratio": f"{b} sends {claim.get('factor')} times {a}'s bytes per inner step (within {tol:.0%})",
        "gap_closes": f"{a}'s perplexity gap to {b} positive early and smaller at the end",
        "loss_gap_law": f"{a}'s loss gap to {b} inside the scaling law's 95% band",
        "loss_gap_sign": f"{a}'s loss gap to {b} above 0 on every seed",
        "loss_gap_bound": f"{a}'s loss gap to {b} at most the scaling law's upper 95% bound",
        "loss_gap_centre": f"{a}'s loss gap to {b} beside the scaling law's centre (reported)",
    }
    return words.get(claim["kind"], claim["claim"])


def check_claim(claim: dict, seeds: list[dict[str, Run]], reference: dict | None = None) -> Verdict:
    """A claim judged on every seed's runs (one dict of runs by reference key per seed). Kind
    `not_tested` names a claim this family cannot test and why; `judged: false` (and every
    loss_gap_centre) prints the figure without a verdict (REPORTED)."""
    if claim["kind"] == "not_tested":
        return Verdict(claim["id"], claim["claim"], "-", claim["why"], "-", "NOT TESTED")
    refs = (claim["a"], claim["b"])
    missing = sorted({k for runs in seeds for k in refs if runs.get(k) is None or not runs[k].finished})
    if missing:
        waiting = f"waiting for {', '.join(missing)}"
        return Verdict(claim["id"], claim["claim"], bar_words(claim), waiting, "-", "PENDING")
    measures = [measure(claim, runs[claim["a"]], runs[claim["b"]], reference) for runs in seeds]
    reported = claim["kind"] == "loss_gap_centre" or not claim.get("judged", True)
    return judge(claim["id"], claim["claim"], measures, reported)


def _first_eval_step(a: Run, b: Run, step: int) -> int | None:
    """The first step at or after `step` at which both runs were evaluated."""
    both = sorted({s for s, _ in a.evals()} & {s for s, _ in b.evals()})
    after = [s for s in both if s >= step]
    return after[0] if after else None


def reference_for(roots: list[Path]) -> Path:
    """The yardstick `roots` are judged with: a committed record's own reference.yaml (the one it was
    made with, so judging it again gives its verdicts) when the roots hold one, else today's
    results/reference.yaml."""
    own = {(Path(r) / RECORD_REFERENCE) for r in roots if (Path(r) / RECORD_REFERENCE).exists()}
    if not own:
        return REFERENCE
    texts = {p.read_text() for p in own}
    if len(texts) > 1 or len(own) < len(roots):
        raise ValueError(
            f"the records under {', '.join(map(str, roots))} were judged with different references: "
            "name one with --reference"
        )
    return sorted(own)[0]


def check(
    roots: Path | list[Path], families: list[str] | None = None, reference_path: Path | None = None
) -> list[Verdict]:
    """Every check of `families` on the runs under each root (one root per seed: the same family run
    with another seed; a root of seed folders counts as its folders), judged per seed and together,
    against `reference_path` (default: reference_for(roots))."""
    roots = [roots] if isinstance(roots, str | Path) else roots
    reference = yaml.safe_load(Path(reference_path or reference_for(roots)).read_text())
    seeds = [by_reference(load_runs(seed)) for root in roots for seed in seed_roots(root)]
    wanted = families or sorted({k.split("/")[0] for runs in seeds for k in runs})
    verdicts = [v for v in check_absolute(seeds, reference) if v.id.split("/")[0] in wanted]
    for family in wanted:
        claims = (reference.get("claims") or {}).get(family, [])
        verdicts += [check_claim(c, seeds, reference) for c in claims]
    return verdicts


def markdown_table(verdicts: list[Verdict]) -> str:
    head = ["check", "what", "expected", "measured", "delta", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(v.row()) + " |" for v in verdicts]
    return "\n".join(lines)
