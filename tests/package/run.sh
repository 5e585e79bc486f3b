#!/usr/bin/env bash
# Installs the build into a temporary prefix, builds the README's quick start as a
# separate CMake project with find_package(lockstep), and runs two copies of it
# against the installed lockstep-master; builds it once more with the installed
# lockstep.pc (pkg-config --cflags --libs lockstep).
set -euo pipefail
build_dir="$1"
source_dir="$2"
consumer_flags="${3:-}"   # the sanitizer flags of the build under test, if any
work="$(mktemp -d)"
master_pid=""
cleanup() {
  [ -n "$master_pid" ] && kill "$master_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
cmake -S "$source_dir/tests/package" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DQUICKSTART_SOURCE="$source_dir/examples/quickstart.c" -DCMAKE_C_FLAGS="$consumer_flags" \
  -DCMAKE_EXE_LINKER_FLAGS="$consumer_flags" >/dev/null
cmake --build "$work/consumer" >/dev/null
# The library's directory under the prefix: lib, or lib/<multiarch> for prefix /usr.
libdir="$(dirname "$(find "$work/prefix" -name liblockstep.so.1 | head -n 1)")"
[ -f "$libdir/pkgconfig/lockstep.pc" ] || { echo "no lockstep.pc in $libdir/pkgconfig"; exit 1; }
grep -qx "prefix=$work/prefix" "$libdir/pkgconfig/lockstep.pc" || {
  echo "lockstep.pc does not name the prefix installed to"; cat "$libdir/pkgconfig/lockstep.pc"; exit 1; }
# shellcheck disable=SC2046,SC2086  # pkg-config's output and the sanitizer flags are lists
cc -std=c99 -Wall -Wextra -Werror $consumer_flags -o "$work/quickstart-pc" "$source_dir/examples/quickstart.c" \
  $(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs lockstep)
"$work/prefix/bin/lockstep-master" --listen 127.0.0.1:0 >"$work/master.out" 2>"$work/master.err" &
master_pid=$!
for _ in $(seq 100); do grep -q listening "$work/master.out" && break; sleep 0.05; done
port="$(sed -n 's/.*:\([0-9]*\)$/\1/p' "$work/master.out")"
[ -n "$port" ] || { echo "master did not start"; cat "$work/master.err"; exit 1; }
export LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}"
"$work/consumer/quickstart" 127.0.0.1 "$port" 20 >"$work/a.out" &
a=$!
"$work/quickstart-pc" 127.0.0.1 "$port" 20 >"$work/b.out"
wait "$a"
# Both ran every step; once both were in, they saw a world of 2.
[ "$(grep -c '^step' "$work/a.out")" = 20 ] && [ "$(grep -c '^step' "$work/b.out")" = 20 ] || {
  echo "quickstart did not run 20 steps"; cat "$work/a.out" "$work/b.out"; exit 1; }
grep -q 'of 2$' "$work/a.out" && grep -q 'of 2$' "$work/b.out" || {
  echo "the two peers never saw each other"; cat "$work/a.out" "$work/b.out"; exit 1; }
kill -TERM "$master_pid"
wait "$master_pid"
master_pid=""
echo "package test passed: find_package(lockstep) and pkg-config builds of the quick start, 2 peers, clean master exit"
