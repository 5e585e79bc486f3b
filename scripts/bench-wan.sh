#!/usr/bin/env bash
# The quantization figure on the WAN test bed (needs root): two hosts with a
# 200 Mbit/s cap each way, a master and one peer on host 0 and one peer on host 1,
# 64 MiB f32 sum all-reduces, unquantized and with 8-bit min-max quantization.
# Prints one JSON line per mode: median time, bytes on the wire per peer, and the
# link use (wire bits per second over the cap).
# Usage: scripts/bench-wan.sh [BUILD_DIR] [ROUNDS]
set -euo pipefail
build="$(cd "${1:-build}" && pwd)"
rounds="${2:-5}"
bin="$build/bin"
prefix="lsbw$$"
bed="$bin/lockstep-testbed --prefix $prefix"
work="$(mktemp -d)"
cleanup() {
  exec 3>&- 4>&- 2>/dev/null || true
  $bed down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
cap_mbit=200
count=$((16 * 1024 * 1024))  # f32 elements: 64 MiB
$bed up 2 >/dev/null
$bed cap 0 1 ${cap_mbit}mbit --both
a0="$($bed addr 0)"
$bed exec 0 "$bin/lockstep-master" --listen "$a0:7000" >"$work/master.out" 2>"$work/master.err" &
for _ in $(seq 100); do grep -q listening "$work/master.out" 2>/dev/null && break; sleep 0.05; done
mkfifo "$work/in0" "$work/in1"
$bed exec 0 "$bin/lockstep-testpeer" --master "$a0:7000" --base-port 0 --name w0 <"$work/in0" >"$work/out0" 2>/dev/null &
$bed exec 1 "$bin/lockstep-testpeer" --master "$a0:7000" --base-port 0 --name w1 <"$work/in1" >"$work/out1" 2>/dev/null &
exec 3>"$work/in0" 4>"$work/in1"
replies() {
  local n
  n="$(grep -c . "$1" 2>/dev/null)" || true
  echo "${n:-0}"
}
wait_for() {  # wait_for FILE LINES
  for _ in $(seq 600); do [ "$(replies "$1")" -ge "$2" ] && return 0; sleep 0.05; done
  echo "bench-wan: no reply from a peer" >&2
  exit 1
}
echo connect >&3; wait_for "$work/out0" 1
echo connect >&4
echo pending >&3; wait_for "$work/out0" 2
echo update >&3; wait_for "$work/out0" 3; wait_for "$work/out1" 1
n=3
for quant in none minmax; do
  for _ in $(seq "$rounds"); do
    echo "allreduce $count 1 1 inplace $quant" >&3
    echo "allreduce $count 1 2 inplace $quant" >&4
    n=$((n + 1))
    wait_for "$work/out0" $n
    wait_for "$work/out1" $((n - 2))
  done
done
echo exit >&3; echo exit >&4
/usr/bin/python3 - "$work/out0" "$work/out1" "$rounds" "$cap_mbit" "$count" <<'PY'
import json, statistics, sys
rows = [[json.loads(l) for l in open(f) if '"allreduce"' in l] for f in sys.argv[1:3]]
rounds, cap, count = int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
for k, quant in enumerate(["none", "minmax"]):
    part = [rows[0][k * rounds + i] for i in range(rounds)], [rows[1][k * rounds + i] for i in range(rounds)]
    assert all(r["code"] == 0 for p in part for r in p), part
    ms = statistics.median(max(a["ms"], b["ms"]) for a, b in zip(*part))
    wire = part[0][0]["bytes_sent"]
    print(json.dumps({"bench": "wan_allreduce", "peers": 2, "cap_mbit": cap, "bytes": count * 4, "quant": quant,
                      "p50_ms": round(ms, 1), "gbytes_s": round(count * 4 / ms / 1e6, 4),
                      "wire_bytes_per_peer": wire, "link_use": round(wire * 8 / (ms / 1e3) / (cap * 1e6), 3)}))
PY
