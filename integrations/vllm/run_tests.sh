#!/usr/bin/env bash
# Run integrations/vllm's tests against a real vLLM CPU server.
#
#   integrations/vllm/run_tests.sh [pytest args...]
#
# Installs (or reuses) the vLLM venv with install.sh (/var/tmp/starling-vllm-venv-<hash>: ~1-5
# min and ~6 GB cold, nothing when cached), then runs pytest on tests/ with starling_vllm
# imported from this checkout's src/ (nothing is installed into the checkout). The tests make
# 21 checkpoints with the repo's workload generator ($STARLING_BIN_DIR/starling-hub, else
# transformers), start `python -m vllm.entrypoints.openai.api_server` with the extension, apply
# 20 versions in place and compare every tensor read back bit for bit (tests/test_server.py).
#
# Exit status: pytest's; 0 with a "SKIPPED: <reason>" line when this platform cannot run vLLM's
# CPU build (install.sh exits 3), unless STARLING_VLLM_REQUIRE=1 (then 3).
#
# Environment:
#   STARLING_BIN_DIR          the Rust binaries (default /var/tmp/starling-ci-target/release):
#                             starling-hub (checkpoints, digest cross-check), engine-logits
#   STARLING_VLLM_VENV_ROOT   where the venv is created (default /var/tmp)
#   STARLING_VLLM_PYTHON      use this interpreter (with vllm, pytest, requests) as is
#   STARLING_VLLM_RESULTS     also write the measured figures (JSON) to this file
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export STARLING_BIN_DIR="${STARLING_BIN_DIR:-/var/tmp/starling-ci-target/release}"
say() { echo "run_tests.sh (vllm): $*"; }

t0=$SECONDS
set +e
py="$("$here/install.sh" | tail -n 1)"
rc=${PIPESTATUS[0]}
set -e
if [[ $rc -eq 3 ]]; then
    say "SKIPPED: this platform cannot run vLLM's CPU build (reason above)"
    [[ "${STARLING_VLLM_REQUIRE:-0}" == 1 ]] && exit 3
    exit 0
fi
[[ $rc -eq 0 && -x "$py" ]] || { say "installing the vLLM venv failed (exit $rc)" >&2; exit 1; }
say "venv ready in $((SECONDS - t0)) s: $py"

# Hold the venv's lock shared while testing, so no other run deletes it meanwhile.
if [[ -z "${STARLING_VLLM_PYTHON:-}" ]]; then
    exec 9>"$(dirname "$(dirname "$py")").lock"
    flock -s 9
fi

results="${STARLING_VLLM_RESULTS:-$(mktemp)}"
export STARLING_VLLM_RESULTS="$results"
set +e
(cd "$here" && PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$here/src:$here/tests" \
    "$py" -m pytest -p no:cacheprovider -rs -v --durations=12 "$@" tests)
rc=$?
set -e
if [[ -s "$results" ]]; then
    say "measured figures ($results):"
    cat "$results"
fi
if [[ $rc -ne 0 ]]; then
    echo "run_tests.sh (vllm): the vLLM integration tests FAILED (pytest exit $rc)" >&2
else
    say "the vLLM integration tests passed in $((SECONDS - t0)) s"
fi
exit "$rc"
