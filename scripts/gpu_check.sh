#!/usr/bin/env bash
# The GPU device check in one command: `longattn bench gpu` from this checkout's src/, into $OUT/gpu (docs/performance.md).
cd "$(dirname "$0")/.." && PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} exec "${PYTHON:-$(command -v python || command -v python3)}" -m longattn.cli bench gpu --out "${OUT:-runs}/gpu" --overwrite "$@"
