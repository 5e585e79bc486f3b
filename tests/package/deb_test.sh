#!/usr/bin/env bash
# The Debian packages (docs/packaging.md) in a clean root filesystem: CPack makes the
# four packages of the build; make_root.py makes a minimal Debian root out of this
# machine's own installed packages (offline: no mirror, no debootstrap) with the
# packages' dependencies and a compiler; inside it, in a mount namespace of its own
# (the root's /proc and /dev go away with it), the root's dpkg installs the packages,
# systemd-analyze verifies the unit, a C program built with `pkg-config --cflags --libs
# lockstep` and a Python program run a 2-peer all-reduce each against the installed
# lockstep-master, and dpkg --purge must leave no file of ours behind. The unit's
# ExecStart must be the command line the README documents. The root is removed at the
# end. Exits 77 (a skip, with the reason) where the machine cannot make a root.
# Usage: deb_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build_dir="$(cd "$1" && pwd)"
source_dir="$(cd "$2" && pwd)"
skip() { echo "SKIPPED: $*"; exit 77; }
start=$SECONDS

prefix="$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$build_dir/CMakeCache.txt")"
[ "$prefix" = /usr ] || skip "the packages need a build configured with -DCMAKE_INSTALL_PREFIX=/usr (this one: $prefix)"
[ "$(id -u)" = 0 ] || skip "making the root needs root (chroot, mounts, and reading every file of the system's packages)"
for tool in dpkg dpkg-deb dpkg-query cpack unshare chroot tar gcc pkg-config; do
  command -v "$tool" >/dev/null || skip "$tool is not installed"
done
[ -f /usr/share/base-passwd/passwd.master ] || skip "not a Debian system (no base-passwd)"
unshare --mount --pid --fork true 2>/dev/null || skip "unshare cannot make a mount and PID namespace here"

work="$(mktemp -d)"
# The mounts live in the namespace only (they end with it); --one-file-system keeps rm
# off anything mounted all the same.
trap 'rm -rf --one-file-system "$work"' EXIT
root="$work/root"

cpack --config "$build_dir/CPackConfig.cmake" -B "$work/packages" >"$work/cpack.log" 2>&1 || {
  cat "$work/cpack.log"; echo "cpack failed"; exit 1; }
# python3-lockstep-torch (built where libtorch-dev is) is checked for its files and
# Depends only: installing it would copy PyTorch and its dependencies into the root.
torch_deb="$(find "$work/packages" -maxdepth 1 -name 'python3-lockstep-torch_*.deb')"
if [ -n "$torch_deb" ]; then
  torch_files="$(dpkg-deb --contents "$torch_deb")"
  grep -q '/lockstep/_torch\..*\.so$' <<<"$torch_files" || { echo "no lockstep/_torch module in $torch_deb"; exit 1; }
  grep -q '/lockstep/torch\.py$' <<<"$torch_files" || { echo "no lockstep/torch.py in $torch_deb"; exit 1; }
  grep -q 'python3-lockstep (= ' <<<"$(dpkg-deb --field "$torch_deb" Depends)" || {
    echo "python3-lockstep-torch does not depend on python3-lockstep"; exit 1; }
  if grep -q '/lockstep/_\?torch' <<<"$(dpkg-deb --contents "$work/packages"/python3-lockstep_*.deb)"; then
    echo "python3-lockstep carries the torch backend's files"; exit 1
  fi
  rm "$torch_deb"
fi
mapfile -t debs < <(find "$work/packages" -maxdepth 1 -name '*.deb' | sort)
[ "${#debs[@]}" = 4 ] || { echo "expected 4 packages, got: ${debs[*]}"; exit 1; }
echo "packages ($((SECONDS - start)) s): $(for d in "${debs[@]}"; do basename "$d"; done | tr '\n' ' ')"

# The unit's ExecStart is the command line the README documents.
unit="$(dpkg-deb --fsys-tarfile "$work/packages"/lockstep-master_*.deb | tar -xOf - ./usr/lib/systemd/system/lockstep-master.service)"
exec_start="$(sed -n 's/^ExecStart=//p' <<<"$unit")"
if [ -z "$exec_start" ] || ! grep -qF -- "$exec_start" "$source_dir/README.md"; then
  echo "the unit's ExecStart ($exec_start) is not the command line README.md documents"; exit 1
fi

extra=(gcc pkg-config)
verify=1
if dpkg-query -W -f='${db:Status-Abbrev}' systemd 2>/dev/null | grep -q '^ii'; then
  extra+=(systemd)
else
  verify=0
  echo "NOTE: not running systemd-analyze verify on the unit: the systemd package is not installed on this machine"
fi
/usr/bin/python3 "$source_dir/tests/package/make_root.py" "$root" "${debs[@]}" --with "${extra[@]}"
echo "root made ($((SECONDS - start)) s)"
mkdir "$root/tmp/debs"
cp "${debs[@]}" "$root/tmp/debs/"
cp "$source_dir/tests/package/allreduce.c" "$source_dir/tests/package/allreduce.py" "$root/tmp/"

# Run with a clean environment (env -i): as root in a fresh system, Python writes
# __pycache__ into the installed package, which the package's prerm must remove.
cat >"$root/tmp/inside.sh" <<INSIDE
set -eu
ldconfig
dpkg -i /tmp/debs/*.deb >/tmp/dpkg.log 2>&1 || { cat /tmp/dpkg.log; echo "dpkg -i failed"; exit 1; }
dpkg-query -W liblockstep1 liblockstep-dev lockstep-master python3-lockstep
if [ $verify = 1 ]; then
  out="\$(systemd-analyze verify /usr/lib/systemd/system/lockstep-master.service 2>&1)" || true
  [ -z "\$out" ] || { echo "\$out"; echo "systemd-analyze verify: the unit has problems (above)"; exit 1; }
  echo "systemd-analyze verify lockstep-master.service: no findings"
fi
# shellcheck disable=SC2046
gcc -std=c99 -Wall -Wextra -Wpedantic -Werror -o /tmp/allreduce /tmp/allreduce.c \$(pkg-config --cflags --libs lockstep)
ldd /tmp/allreduce | grep -Eq ' => /(usr/)?lib/[^ ]*/liblockstep.so.1 ' || { ldd /tmp/allreduce; echo "not linked to the installed library"; exit 1; }
lockstep-master --listen 127.0.0.1:0 >/tmp/master.out 2>/tmp/master.err &
master=\$!
port=""
for _ in \$(seq 200); do
  port="\$(sed -n 's/.*listening on .*:\([0-9]*\)\$/\1/p' /tmp/master.out)"
  [ -n "\$port" ] && break
  sleep 0.05
done
[ -n "\$port" ] || { cat /tmp/master.out /tmp/master.err; echo "lockstep-master did not start"; exit 1; }
/tmp/allreduce 127.0.0.1 "\$port" &
peer=\$!
/tmp/allreduce 127.0.0.1 "\$port"
wait "\$peer"
python3 /tmp/allreduce.py --master "127.0.0.1:\$port" --expect-under /usr/lib/python3/dist-packages
[ -d /usr/lib/python3/dist-packages/lockstep/__pycache__ ] || { echo "python3 wrote no __pycache__"; exit 1; }
kill -TERM "\$master"
wait "\$master"
dpkg --purge python3-lockstep liblockstep-dev lockstep-master liblockstep1 >/tmp/dpkg.log 2>&1 || {
  cat /tmp/dpkg.log; echo "dpkg --purge failed"; exit 1; }
left="\$(find / -xdev \\( -path /tmp -o -path /proc -o -path /dev \\) -prune -o -name '*lockstep*' -print)"
[ -z "\$left" ] || { echo "\$left"; echo "files left after dpkg --purge (above)"; exit 1; }
echo "purged: no files left"
INSIDE

# A PID namespace too: whatever the test starts ends with it, on a timeout as well.
# shellcheck disable=SC2016  # $1 is the inner shell's
unshare --mount --pid --fork --kill-child --propagation private /bin/sh -c '
  set -e
  mount -t proc proc "$1/proc"
  mount --rbind /dev "$1/dev"
  exec chroot "$1" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C /bin/sh /tmp/inside.sh' sh "$root"
echo "deb test passed in $((SECONDS - start)) s"
