#!/usr/bin/env bash
# Peak memory of `starling-hub delta diff` on a generated multi-GB checkpoint pair, next to
# the size of one checkpoint. Usage: benches/memory.sh [preset (default 1.5b)] [workdir]
# Needs ~11 GB of free disk for the 1.5b preset (two 3.55 GB checkpoints + page cache), and
# GNU time (installed from Debian's packages when root). Binaries from CARGO_TARGET_DIR, else target/.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-1.5b}
work=${2:-/var/tmp/starling-memory-bench}
cargo build --release -q --workspace --bins  # as the tests and scripts/bench-smoke.sh build it: nothing to rebuild after them
hub=${CARGO_TARGET_DIR:-target}/release/starling-hub
# Peak RSS comes from GNU time (Debian's `time`), installed here when root and missing.
if [[ ! -x /usr/bin/time && $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq time >/dev/null
fi
[[ -x /usr/bin/time ]] || { echo "needs GNU time (/usr/bin/time, Debian package time)" >&2; exit 1; }
mkdir -p "$work"
if [[ ! -f "$work/$preset/step-0001.safetensors" ]]; then
    "$hub" bench gen --model "$preset" --steps 1 --lr 3e-6 -o "$work/$preset"
fi
ckpt_bytes=$(stat -c %s "$work/$preset/step-0000.safetensors")
for mode in "" "--no-tensor-hashes"; do
    rm -f "$work/d.sdc"
    /usr/bin/time -v "$hub" delta diff "$work/$preset/step-0000.safetensors" "$work/$preset/step-0001.safetensors" \
        -o "$work/d.sdc" --model-id "$preset" $mode 2> "$work/time.log" | sed 's/^/  /'
    rss_kb=$(awk -F': ' '/Maximum resident/ {print $2}' "$work/time.log")
    wall=$(awk -F': ' '/Elapsed/ {print $2}' "$work/time.log")
    user=$(awk -F': ' '/User time/ {print $2}' "$work/time.log")
    sys=$(awk -F': ' '/System time/ {print $2}' "$work/time.log")
    awk -v p="$preset" -v m="diff $mode" -v c="$ckpt_bytes" -v r="$rss_kb" -v w="$wall" -v u="$user" -v s="$sys" \
        'BEGIN { printf "| %s | %s | %.1f MB | %.1f MB | %.2f%% | %s | %s + %s s |\n", p, m, c / 1e6, r / 1e3, 100 * r * 1e3 / c, w, u, s }'
done
