#!/usr/bin/env bash
# `make soak-resume`: the kill-at-many-points resume test (tests/scripts/test_multinode.py::
# test_kills_at_many_points_resume_exactly) N times in a row, stopping at the first failure; each
# run's kill points and checkpoints, and the tally, go to results/soak/kill-resume.txt with the commit,
# machine and date. A resume that depended on when a kill landed failed here 1 run in 2.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-20}"
PY="${PY:-.venv/bin/python}"
OUT=results/soak/kill-resume.txt
mkdir -p "$(dirname "$OUT")"
commit="$(git rev-parse HEAD)$(git diff --quiet HEAD -- src tests scripts || echo ' (dirty)')"
{
  echo "command: make soak-resume N=$N"
  echo "commit: $commit"
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(uname -sr)"
  echo "date: $(date -u +%FT%TZ)"
} > "$OUT"
for i in $(seq 1 "$N"); do
  start=$SECONDS
  if "$PY" -m pytest -q -s -p no:cacheprovider tests/scripts/test_multinode.py -k many_points > "$OUT.run" 2>&1; then
    echo "run $i/$N: passed in $((SECONDS - start)) s" >> "$OUT"
    grep '^\[multinode\]' "$OUT.run" | sed 's/^/    /' >> "$OUT"
  else
    echo "run $i/$N: FAILED after $((SECONDS - start)) s" >> "$OUT"
    tail -40 "$OUT.run" | sed 's/^/    /' >> "$OUT"
    rm -f "$OUT.run"
    echo "soak: run $i of $N failed (see $OUT)"
    exit 1
  fi
done
rm -f "$OUT.run"
echo "all $N runs passed in a row" >> "$OUT"
echo "soak: $N of $N passed (see $OUT)"
