#!/usr/bin/env bash
# One GPU lease, one report: the entry point of the kit `make gpu-kit` builds.
#
#   bash gpu-kit/gpu-check.sh [gpu_check options: --deadline-s 480, --only NAME[,NAME]]
#
# Installs the kit's wheels this machine lacks into gpu-kit/site (no index, no dependencies,
# the machine's own packages untouched), then runs baton_loadtest.gpu_check from gpu-kit/src
# under one total deadline. The JSON report and the logs go to $OUT when it is set (the device
# tool brings $OUT back), else to gpu-kit/out; the report is rewritten after every piece.
set -euo pipefail
kit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
out="${OUT:-$kit/out}"
mkdir -p "$out"
"$py" "$kit/src/scripts/gpu_kit_install.py" "$kit" --report "$out/kit-install.json"
export PYTHONPATH="$kit/site:$kit/src/services:$kit/src/kernels:$kit/src/loadtest:$kit/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$kit/src"
exec "$py" -m baton_loadtest.gpu_check --kit "$kit" --out "$out" "$@"
