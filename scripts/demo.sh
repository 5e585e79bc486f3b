#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs lockstep-demo on loopback
# (a master and peers that join in waves, leave and rejoin).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target lockstep-demo lockstep-testpeer lockstep-master
exec ./build/bin/lockstep-demo --log build/lockstep-demo.log "$@"
