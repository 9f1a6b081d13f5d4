#!/usr/bin/env bash
# One GPU lease, one report: the entry point of the kit `make gpu-kit` builds.
#
#   bash gpu-kit/gpu-check.sh [gpu_check options: --deadline-s 480, --only NAME[,NAME]]
#
# Installs the kit's wheels this machine lacks (or has older) into a run folder beside the
# kit, .gpu-run/site (no index, no dependencies, torch & co. untouched), then runs
# benchmarks.gpu_check from gpu-kit/src under one total deadline. The run folder also
# keeps the stand-in model and Triton's compiled kernels for a second call on the same
# machine, and stays out of the kit so the kit stays small enough to carry. The JSON report
# and the logs go to $OUT when it is set (the device tool brings $OUT back), else to
# .gpu-run/out; the report is rewritten after every piece.
set -euo pipefail
kit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
run="${BATON_GPU_RUN:-$(dirname "$kit")/.gpu-run}"
py="${PYTHON:-python3}"
out="${OUT:-$run/out}"
mkdir -p "$out" "$run"
"$py" "$kit/src/scripts/gpu_kit_install.py" "$kit" --site "$run/site" \
    --report "$out/kit-install.json"
export PYTHONPATH="$run/site:$kit/src/services:$kit/src/kernels:$kit/src/loadtest:$kit/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$kit/src"
exec "$py" -m benchmarks.gpu_check --kit "$kit" --run-dir "$run" --out "$out" "$@"
