#!/usr/bin/env bash
# The flake census: the integration and e2e tiers run ROUNDS times in a row on a fresh clone of HEAD,
# each round's outcomes kept as JUnit XML, then one table of every test that failed at least once.
#
#   bash bench/flake_census.sh [ROUNDS]        # default 3; from the repository root
#
# The clone gets its own `make setup` (a fresh .venv, as CI's), so nothing of this checkout's environment
# or untracked files leaks in. Rounds run one after another, never side by side: a test's timing is part
# of what is counted. Output: bench/out/flake-census/<UTC time>/round-N.xml and .log, and census.txt.
# Exit 0 when every round passed, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-3}"
case "$ROUNDS" in '' | *[!0-9]*) echo "flake_census.sh: ROUNDS must be a whole number, got '$ROUNDS'" >&2; exit 2 ;; esac

OUT="$PWD/bench/out/flake-census/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"
CLONE="$(mktemp -d /tmp/servetune-flake-census-XXXXXX)"
trap 'rm -rf "$CLONE"' EXIT
git clone --quiet . "$CLONE"
echo "fresh clone of $(git rev-parse --short HEAD) in $CLONE; results in $OUT"
make -C "$CLONE" setup >"$OUT/setup.log" 2>&1 || { echo "make setup failed: $OUT/setup.log" >&2; exit 2; }

failed_rounds=0
for round in $(seq 1 "$ROUNDS"); do
    started=$(date +%s)
    set +e
    (cd "$CLONE" && .venv/bin/python -X faulthandler -m pytest tests/integration tests/e2e -q -p no:cacheprovider \
        --junitxml "$OUT/round-$round.xml") >"$OUT/round-$round.log" 2>&1
    status=$?
    set -e
    [ "$status" -eq 0 ] || failed_rounds=$((failed_rounds + 1))
    echo "round $round: exit $status in $(($(date +%s) - started)) s ($(tail -n 1 "$OUT/round-$round.log"))"
done

"$CLONE/.venv/bin/python" - "$OUT" "$ROUNDS" <<'EOF' | tee "$OUT/census.txt"
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

out, rounds = Path(sys.argv[1]), int(sys.argv[2])
failures: dict[str, list[tuple[int, str]]] = defaultdict(list)
for n in range(1, rounds + 1):
    path = out / f"round-{n}.xml"
    if not path.exists():
        print(f"round {n}: no JUnit XML (pytest did not finish)")
        continue
    for case in ET.parse(path).iter("testcase"):
        for bad in [*case.iter("failure"), *case.iter("error")]:
            name = f"{case.get('classname')}::{case.get('name')}"
            failures[name].append((n, (bad.get("message") or "").splitlines()[0][:160] if bad.get("message") else bad.tag))
if not failures:
    print(f"no test failed in {rounds} round(s)")
for name, seen in sorted(failures.items()):
    print(f"{name}: failed in {len(seen)} of {rounds} round(s)")
    for n, message in seen:
        print(f"    round {n}: {message}")
EOF
exit $((failed_rounds > 0))
