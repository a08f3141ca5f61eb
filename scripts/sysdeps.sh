#!/usr/bin/env bash
# Installs (as root) or reports the system packages KVFleet needs:
# libibverbs1 (Mooncake transfer engine), redis-server, chromium (browser tests), g++ and ninja-build
# (KVFleet's C++ extension: the fused decode step and the CPU quantized kernels, engine/model/extension.py),
# prometheus (the fleet metrics store and promtool: engine/fleet/prometheus.py, deploy/prometheus/).
set -euo pipefail
missing=()
# grep reads all of ldconfig's output: with -q it would stop at the first match and, under pipefail,
# ldconfig's broken pipe would count the library as missing.
ldconfig -p | grep 'libibverbs.so.1' >/dev/null || missing+=(libibverbs1)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v chromium >/dev/null || missing+=(chromium)
command -v g++ >/dev/null || missing+=(g++)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v prometheus >/dev/null || missing+=(prometheus)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "Installing system packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
else
  echo "KVFleet needs these Debian packages: ${missing[*]}"
  echo "Install them with: sudo apt-get install -y ${missing[*]}"
  exit 1
fi
