#!/usr/bin/env bash
# How the hub's diff scales with threads: `starling-hub delta diff` of one generated step pair
# (the same `bench gen` presets as tbf-bench), run on 1..N rayon threads, optionally beside a
# second hub binary (the same pair, alternated run by run, so the two see the same machine).
#
# Every run must produce the same delta: the script checks that each run's size, segment
# count, change count and post digest equal the first run's (a thread count or a binary that
# changes how the delta is laid out fails the bench; the bytes themselves differ between runs
# only because a delta's id includes its creation time). It prints one line per run and, per binary and thread
# count, the median of the diff's own time (the CLI's "seconds": reading, diffing, encoding
# and writing the .sdc, its fsync included) and its speed-up over one thread.
#
# Usage: benches/diff-scaling.sh [--model 1.5b] [--lr 2e-5] [--threads "8 4 2 1"] [--reps 2]
#          [--hub PATH] [--baseline-hub PATH] [--work DIR]
# --hub defaults to this checkout's release build (built here); the pair is generated once
# into --work (default /var/tmp/starling-diff-scaling) and reused.
set -euo pipefail
cd "$(dirname "$0")/.."

model=1.5b lr=2e-5 threads=$(printf '%s\n' "$(nproc)" 2 1 | sort -nru | tr '\n' ' ') reps=2 hub="" baseline="" work=/var/tmp/starling-diff-scaling
while (($#)); do
    case $1 in
    --model) model=$2; shift 2 ;;
    --lr) lr=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --hub) hub=$2; shift 2 ;;
    --baseline-hub) baseline=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
if [[ -z $hub ]]; then
    target_dir=$(cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
    cargo build --release -q -p starling-hub
    hub=$target_dir/release/starling-hub
fi
mkdir -p "$work"
pair=$work/$model-lr$lr
if [[ ! -f $pair/step-0001.safetensors ]]; then
    rm -rf "$pair.tmp"
    "$hub" bench gen --model "$model" --steps 1 --lr "$lr" -o "$pair.tmp" >"$work/gen.log" 2>&1 ||
        { tail -n 20 "$work/gen.log" >&2; exit 1; }
    mv "$pair.tmp" "$pair"
fi
# Both checkpoints in the page cache, so that no run reads them from disk.
cat "$pair"/step-000[01].safetensors >/dev/null

hubs=(new)
declare -A bin=([new]=$hub)
if [[ -n $baseline ]]; then
    hubs=(baseline new)
    bin[baseline]=$baseline
fi
results=$work/runs.txt
: >"$results"
ref=""
echo "rep threads hub diff_s digest_prefix delta_bytes"
for rep in $(seq "$reps"); do
    for t in $threads; do
        for h in "${hubs[@]}"; do
            out=$(RAYON_NUM_THREADS=$t "${bin[$h]}" delta diff --no-tensor-hashes --json \
                --out "$work/delta.sdc" "$pair/step-0000.safetensors" "$pair/step-0001.safetensors")
            read -r secs digest bytes layout < <(python3 -c '
import json, sys
d = json.loads(sys.argv[1])
print(d["seconds"], d["post_digest"], d["delta_bytes"], "%s/%s" % (d["segments"], d["changes"]))' "$out")
            rm -f "$work/delta.sdc"
            if [[ -z $ref ]]; then
                ref="$digest $bytes $layout"
            elif [[ "$digest $bytes $layout" != "$ref" ]]; then
                echo "run $rep, $t threads, $h: delta $digest $bytes $layout differs from $ref" >&2
                exit 1
            fi
            echo "$rep $t $h $secs ${digest:0:16} $bytes" | tee -a "$results"
        done
    done
done
echo
echo "hub threads median_diff_s speedup_vs_1_thread"
python3 - "$results" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    rep, t, h, secs, _, _ = line.split()
    runs.setdefault((h, int(t)), []).append(float(secs))
for h in sorted({h for h, _ in runs}):
    one = statistics.median(runs[(h, 1)]) if (h, 1) in runs else None
    for t in sorted({t for hh, t in runs if hh == h}, reverse=True):
        m = statistics.median(runs[(h, t)])
        up = f"{one / m:.2f}x" if one else "-"
        print(f"{h} {t} {m:.3f} {up}")
EOF
