#!/usr/bin/env bash
# The flake census: the integration and e2e tiers run ROUNDS times in a row on a fresh clone of HEAD,
# each round's outcomes kept as JUnit XML (one file per tier), then one table of every test that failed at least once.
# The tiers run as `make test` runs them: integration in three pytest processes, e2e in one (TEST_PROCESSES and
# E2E_PROCESSES as in the Makefile).
#
#   bash bench/flake_census.sh [ROUNDS]        # default 3; from the repository root
#
# The clone gets its own `make setup` (a fresh .venv, as CI's), so nothing of this checkout's environment
# or untracked files leaks in. Rounds run one after another, never side by side: a test's timing is part
# of what is counted. Output: bench/out/flake-census/<UTC time>/round-N-{integration,e2e}.xml, round-N.log, and census.txt.
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
# Byte-code first, as `make test` does (a host with PYTHONDONTWRITEBYTECODE otherwise compiles servetune's source
# again in every process that imports it).
"$CLONE/.venv/bin/python" -m compileall -q "$CLONE/src"

failed_rounds=0
for round in $(seq 1 "$ROUNDS"); do
    started=$(date +%s)
    set +e
    # As `make test` runs them: integration in TEST_PROCESSES pytest processes (default 3, a file at a time each),
    # then e2e in E2E_PROCESSES (default 0: one); both run whatever the first's outcome, so a round counts them all.
    (cd "$CLONE" && .venv/bin/python -X faulthandler -m pytest tests/integration -q -p no:cacheprovider \
        -n "${TEST_PROCESSES:-3}" --dist loadfile --no-loadscope-reorder --junitxml "$OUT/round-$round-integration.xml"
    ) >"$OUT/round-$round.log" 2>&1
    status=$?
    (cd "$CLONE" && .venv/bin/python -X faulthandler -m pytest tests/e2e -q -p no:cacheprovider \
        -n "${E2E_PROCESSES:-0}" --dist loadfile --no-loadscope-reorder --junitxml "$OUT/round-$round-e2e.xml"
    ) >>"$OUT/round-$round.log" 2>&1 || status=$?
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
    paths = [out / f"round-{n}-{tier}.xml" for tier in ("integration", "e2e")]
    for path in paths:
        if not path.exists():
            print(f"round {n}: no JUnit XML for {path.stem.rsplit('-', 1)[1]} (pytest did not finish)")
    for case in (case for path in paths if path.exists() for case in ET.parse(path).iter("testcase")):
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
