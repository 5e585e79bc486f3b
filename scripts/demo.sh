#!/usr/bin/env bash
# The main job: installs dependencies, builds the library and the Python package, and
# runs the showcase: a master and four peers training async DiLoCo on the digits over
# loopback, one killed and one joining mid-run, then the master killed and replaced on
# its address (the peers run with failover on), printing per step the loss, the world
# size and every peer's shared-state hash, and at the end the test accuracy.
# Arguments go to examples/python/showcase.py (e.g. --steps 80, --example ddp).
# The membership demo of the core (waves of peers across two groups): build/bin/lockstep-demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOCKSTEP_WERROR=OFF >/dev/null
cmake --build build -j"$(nproc)" --target lockstep_python lockstep-demo lockstep-testpeer lockstep-master
PYTHONPATH="$PWD/build/python" exec /usr/bin/python3 examples/python/showcase.py "$@"
