#!/usr/bin/env bash
# Installs every Debian package the project needs (scripts/apt-packages.txt).
# Safe to run again: apt-get skips what is already there.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mapfile -t pkgs < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$here/apt-packages.txt")
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  # etcd-server is here for the tests' private etcd (on ports of their own); the system
  # etcd the package may have started on port 2379 is not wanted: stop and disable it.
  if [[ " ${missing[*]} " == *" etcd-server "* ]]; then
    "${sudo_cmd[@]}" systemctl disable --now etcd.service >/dev/null 2>&1 || true
    if [ -x /etc/init.d/etcd ]; then
      "${sudo_cmd[@]}" /etc/init.d/etcd stop >/dev/null 2>&1 || true
      "${sudo_cmd[@]}" update-rc.d etcd disable >/dev/null 2>&1 || true
    fi
  fi
fi
echo "install-deps: all ${#pkgs[@]} packages present"
