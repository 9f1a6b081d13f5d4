#!/usr/bin/env bash
# Builds llama.cpp's llama-server and llama-perplexity from the sources vendored in the
# llama-cpp-python sdist (pinned below), for benchmarks/llamacpp_compare.py (issue 39).
# Not part of CI or `make test`: it takes ~5-10 min on 2 cores.
#
#   benchmarks/build_llamacpp.sh BUILD_DIR [JOBS]
#
# BUILD_DIR gets the unpacked sdist (src/) and the cmake build (build/); the binaries end up
# in BUILD_DIR/build/bin/. Run from the repository root (it uses .venv/bin/pip to download).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36   # the sdist whose vendor/llama.cpp is built

build_dir=${1:?usage: benchmarks/build_llamacpp.sh BUILD_DIR [JOBS]}
jobs=${2:-2}
pip=${PIP:-.venv/bin/pip}
mkdir -p "$build_dir"
build_dir=$(cd "$build_dir" && pwd)

sdist="$build_dir/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    "$pip" download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
        -d "$build_dir"
fi
src="$build_dir/src"
if [ ! -d "$src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION" ]; then
    mkdir -p "$src"
    tar xzf "$sdist" -C "$src"
fi
llama_src="$src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"

cmake -S "$llama_src" -B "$build_dir/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
nice -n 19 cmake --build "$build_dir/build" --config Release -j"$jobs" \
    --target llama-server llama-perplexity
ls -l "$build_dir/build/bin/llama-server" "$build_dir/build/bin/llama-perplexity"
