#!/usr/bin/env bash
# Installs dependencies, builds, and runs every test:
#   1. the Release build (g++ at -O3, as users build): the reference docs (the docs
#      target, warnings as errors), unit, simulation, end-to-end, C API, packaging (pip
#      into a fresh venv; the .debs in a clean root) and test-bed tests;
#   2. the AddressSanitizer + UndefinedBehaviorSanitizer build: the same tests but the
#      test bed's (which measure rates), with timeouts scaled up so slow peers live;
#   3. the fuzz build (Clang, libFuzzer + ASan + UBSan): each fuzzer for 20 s;
#   4. the ThreadSanitizer build: the same tests again, but those of single-threaded
#      code (tests/CMakeLists.txt, SINGLE_THREADED).
# The sanitizer builds leave out the Python module (its tests run in the plain pass
# only: tests/CMakeLists.txt says why) and the benchmarks.
# After the first pass, the mutation suite's stage (scripts/mutants.sh --changed).
# Every build treats warnings as errors (-DLOCKSTEP_WERROR=ON; off by default for users).
# Options: --quick (skip the sanitizer and fuzz passes), --no-tsan (skip the ThreadSanitizer pass).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
quick=0
tsan=1
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --no-tsan) tsan=0 ;;
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done
./scripts/install-deps.sh
jobs="$(nproc)"
start=$SECONDS
stamp() { echo "=== $1 ($((SECONDS - start)) s)"; }

# The main build goes through ccache (shared with the mutation suite's scratch build,
# which compiles the same sources with the same flags in build-mutants/).
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
main_flags=(-DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_WERROR=ON)
stamp "build"
# Prefix /usr: Debian's layout, which the packages (and their test) need.
cmake -S . -B build "${main_flags[@]}" -DCMAKE_INSTALL_PREFIX=/usr -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DCMAKE_C_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build build -j"$jobs"
# The C API reference (Doxygen) and the Python reference (Sphinx), warnings as errors.
stamp "docs"
cmake --build build --target docs
# The packaging tests (label package) run with the others: pip_install_test builds the
# module from source through ccache, deb_package_test installs the .debs in a clean root.
stamp "tests"
ctest --test-dir build --output-on-failure -j"$jobs" -LE testbed
stamp "test-bed tests (one at a time: they measure rates)"
ctest --test-dir build --output-on-failure -L testbed
# The mutation suite (docs/testing.md): the mutants of the files changed since the last
# landing, then a rotating sample of the others; nothing runs past 150 s (so that CI stays
# under 45 minutes).
stamp "mutants"
./scripts/mutants.sh --changed --budget-s 150 "${main_flags[@]/#/--cmake-arg=}"

# Line tables only (-g1): sanitizer reports keep their file:line stacks, and the builds
# take less time than with full debug information (compiling one Asio-heavy file under
# ASan+UBSan: 17.5 s against 20.6 s, objects 15 % smaller, links faster).
# Clang: at -O0 under the sanitizers it compiles in about 60 % of GCC's time
# (src/peer/communicator.cpp under ASan+UBSan: 22.6 s against 38.6 s; under TSan 18.3
# against 26.0), and it gives the tests a second compiler's warnings (the main build is
# GCC's, as users build).
sanitizer_flags=(-DLOCKSTEP_BUILD_PYTHON=OFF -DLOCKSTEP_BUILD_BENCH=OFF -DCMAKE_C_FLAGS_DEBUG=-g1
  -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++)
if [ "$quick" = 0 ]; then
  stamp "ASan+UBSan build"
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DLOCKSTEP_WERROR=ON -DLOCKSTEP_SANITIZE_ADDRESS=ON \
    -DLOCKSTEP_SANITIZE_UNDEFINED=ON -DLOCKSTEP_BUILD_TESTBED=OFF -DLOCKSTEP_TEST_TIME_SCALE=4 "${sanitizer_flags[@]}" >/dev/null
  cmake --build build-asan -j"$jobs"
  stamp "ASan+UBSan tests"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j"$jobs"
fi
if [ "$quick" = 0 ]; then
  # The libFuzzer targets (docs/fuzzing.md), built with Clang + ASan + UBSan in a build
  # directory of their own; each runs LOCKSTEP_FUZZ_SECONDS (default 20) over its corpus.
  # They link lockstep_control only (the coordinator, framing, the ring's decoding), so
  # nothing of the event-loop shell is compiled here.
  stamp "fuzz build (Clang, libFuzzer + ASan + UBSan)"
  cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" -DLOCKSTEP_WERROR=ON -DLOCKSTEP_BUILD_FUZZERS=ON -DLOCKSTEP_SANITIZE_ADDRESS=ON \
    -DLOCKSTEP_SANITIZE_UNDEFINED=ON -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_BUILD_TOOLS=OFF \
    -DLOCKSTEP_BUILD_TESTBED=OFF -DLOCKSTEP_BUILD_BENCH=OFF >/dev/null
  cmake --build build-fuzz -j"$jobs" --target lockstep_fuzzers
  stamp "fuzz tests"
  ctest --test-dir build-fuzz --output-on-failure -j"$jobs" -L fuzz
fi
if [ "$quick" = 0 ] && [ "$tsan" = 1 ]; then
  stamp "TSan build"
  cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DLOCKSTEP_WERROR=ON -DLOCKSTEP_SANITIZE_THREAD=ON \
    -DLOCKSTEP_BUILD_TESTBED=OFF -DLOCKSTEP_TEST_TIME_SCALE=6 "${sanitizer_flags[@]}" >/dev/null
  cmake --build build-tsan -j"$jobs"
  stamp "TSan tests"
  TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build-tsan --output-on-failure -j"$jobs"
fi
stamp "all tests passed"
