#!/usr/bin/env bash
# The README's main job timed twice on this machine: as it is, then beside two busy loops (a laptop running a
# browser and an IDE); the issue's bar is the busy time within 2.5x the quiet one. Extra arguments go to both runs.
# Each run's first line states its thread choice; the times are printed last, one line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-$(command -v python || command -v python3)}"
out="${OUT:-runs}/compare-busy"
times=()
timed() {
    local name="$1" started
    shift
    started=$(date +%s)
    "$python" -c "import sys; from longattn.cli import main; sys.exit(main())" \
        compare --out "$out/$name" --overwrite "$@"
    times+=("$name: $(( $(date +%s) - started )) s wall")
}
timed quiet "$@"
busy=()
for _ in 1 2; do (while :; do :; done) & busy+=($!); done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
timed busy "$@"
printf '%s\n' "${times[@]}"
