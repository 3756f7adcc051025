#!/usr/bin/env bash
# Run the Python SDK's tests (sdk/python/tests) against the real Starling binaries.
#
#   sdk/python/run_tests.sh [pytest args...]
#   sdk/python/run_tests.sh --print-python     # only make the venv, and print its python
#
# Creates (or reuses) a virtualenv /var/tmp/starling-sdk-venv-<hash>, where <hash> covers
# pyproject.toml, requirements-test.txt and torch-excludes.txt; installs requirements-test.txt
# (pytest, setuptools, uv) and a CPU-usable torch, and runs pytest with the SDK imported from
# this checkout's src/ (nothing is installed into the checkout, so it stays clean). Exits
# non-zero when a test fails. Prints one "SKIPPED" line per skipped test, and a summary.
#
# torch: PyPI has only the CUDA build for Linux x86_64 (download.pytorch.org's CPU wheels are
# not reachable from CI). `uv pip install --excludes torch-excludes.txt torch` installs it and
# the CUDA libraries its import needs, without triton and the rest it does not: 2.3 GB of
# wheels in ~25 s here, against 2.8 GB in ~80 s for `pip install torch` (sdk/python/README.md
# has the measurements). If `import torch` then fails, torch is installed again without the
# exclusions; if uv is unavailable, pip installs it.
#
# Environment:
#   STARLING_BIN_DIR               the Rust binaries (default /var/tmp/starling-ci-target/release)
#   STARLING_SDK_PYTHON            use this interpreter as is instead of a venv (needs pytest)
#   STARLING_SDK_VENV_ROOT         where venvs are created (default /var/tmp); other
#                                  starling-sdk-venv-* there that no run is using are deleted
#                                  (they are several GB each)
#   STARLING_SDK_TORCH_INDEX_URL   install torch from this index instead of PyPI, e.g.
#                                  https://download.pytorch.org/whl/cpu where it is reachable
#   STARLING_SDK_REQUIRE_TORCH=1   fail if torch cannot be installed or imported (scripts/test.sh
#                                  sets it; default: warn and run the tests that do not need it)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export STARLING_BIN_DIR="${STARLING_BIN_DIR:-/var/tmp/starling-ci-target/release}"
require_torch="${STARLING_SDK_REQUIRE_TORCH:-0}"

say() { echo "run_tests.sh: $*"; }
die() { echo "run_tests.sh: $*" >&2; exit "${2:-1}"; }

# `import torch` works and can do what the SDK and the example do on the CPU.
torch_works() {
    (cd / && "$py" -W ignore -c '
import torch
x = torch.ones(3, requires_grad=True)
(x * 2).sum().backward()
assert x.grad.tolist() == [2.0, 2.0, 2.0]
assert torch.tensor([1.00390625]).to(torch.bfloat16).view(torch.int16).item() == 0x3F80
') >/dev/null 2>&1
}

install_torch() {
    local index=() uv="$venv/bin/uv" t0=$SECONDS
    if [[ -n "${STARLING_SDK_TORCH_INDEX_URL:-}" ]]; then
        index=(--index-url "$STARLING_SDK_TORCH_INDEX_URL")
    fi
    if [[ -x "$uv" ]]; then
        say "installing torch into $venv with uv, without $(grep -v '^#' "$here/torch-excludes.txt" | xargs | sed 's/ /, /g')"
        if "$uv" pip install --quiet --python "$py" --excludes "$here/torch-excludes.txt" "${index[@]}" torch \
                && torch_works; then
            say "torch installed in $((SECONDS - t0)) s"
            return 0
        fi
        say "import torch fails without the excluded packages; installing torch with all its dependencies"
        if "$uv" pip install --quiet --python "$py" "${index[@]}" torch && torch_works; then
            say "torch installed in $((SECONDS - t0)) s"
            return 0
        fi
    fi
    say "installing torch with pip (several GB, slower than uv)"
    "$py" -m pip install --quiet --retries 2 "${index[@]}" torch && torch_works
}

# Deletes the other starling-sdk-venv-* under $1 that no run holds a lock on.
prune_other_venvs() {
    local root="$1" other
    for other in "$root"/starling-sdk-venv-*; do
        [[ -d "$other" && "$other" != "$venv" ]] || continue
        (
            exec 8>"$other.lock"
            if flock -n -x 8; then
                say "deleting the unused $other ($(du -sh "$other" 2>/dev/null | cut -f1))"
                rm -rf "$other"
            fi
        )
    done
}

if [[ -n "${STARLING_SDK_PYTHON:-}" ]]; then
    py="$STARLING_SDK_PYTHON"
    if [[ "$require_torch" == 1 ]] && ! torch_works; then
        die "torch is not usable by $py and STARLING_SDK_REQUIRE_TORCH=1"
    fi
else
    base="$(command -v python3 || true)"
    [[ -n "$base" ]] || die "python3 not found" 2
    "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "the SDK needs Python >= 3.10; $base is $("$base" --version 2>&1)" 2
    root="${STARLING_SDK_VENV_ROOT:-/var/tmp}"
    hash="$(cat "$here/pyproject.toml" "$here/requirements-test.txt" "$here/torch-excludes.txt" | sha256sum | cut -c1-12)"
    venv="$root/starling-sdk-venv-$hash"
    py="$venv/bin/python"
    mkdir -p "$root"
    # The venv's lock: exclusive while installing, shared while tests use it (so that another
    # run may use it too, and no run deletes it under a test).
    exec 9>"$venv.lock"
    flock -s 9
    if [[ ! -f "$venv/.starling-ready" || ! -f "$venv/.starling-bytecode" ]] || ! torch_works; then
        flock -x 9  # not atomic: another run may have finished the job meanwhile
        if [[ ! -f "$venv/.starling-ready" ]]; then
            say "creating $venv"
            rm -rf "$venv"
            "$base" -m venv "$venv"
            "$py" -m pip install --quiet --retries 2 -r "$here/requirements-test.txt"
            touch "$venv/.starling-ready"
        fi
        # torch is retried on every run until it is there: a failed download is not
        # remembered, so an offline run does not leave a venv that never gets torch.
        if ! torch_works && ! install_torch; then
            [[ "$require_torch" == 1 ]] && die "installing torch failed and STARLING_SDK_REQUIRE_TORCH=1"
            echo "run_tests.sh: WARNING: installing torch failed; the tests that need it will be SKIPPED" >&2
        fi
        # Byte-compiled once (scripts/byte-compile-venv.sh says why), after torch so that its
        # files are compiled too: a venv without a working torch gets no marker, and is
        # compiled on the run that installs torch.
        if [[ ! -f "$venv/.starling-bytecode" ]] && torch_works; then
            "$here/../../scripts/byte-compile-venv.sh" "$venv"
        fi
        flock -s 9
    fi
    prune_other_venvs "$root"
fi

# `run_tests.sh --print-python`: make the venv ready and print its interpreter (scripts/
# real-run.sh runs the GRPO trainer with it where vLLM's venv cannot be made).
if [[ "${1:-}" == --print-python ]]; then
    echo "$py"
    exit 0
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
set +e
(cd "$here" && PYTHONDONTWRITEBYTECODE=1 STARLING_SDK_REQUIRE_TORCH="$require_torch" \
    "$py" -m pytest -p no:cacheprovider -rs "$@" tests) 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e

skipped="$(grep -c '^SKIPPED ' "$log" || true)"
if [[ "$skipped" != 0 ]]; then
    say "SKIPPED $skipped test group(s) of the Python SDK:"
    grep '^SKIPPED ' "$log" | sed 's/^/  /'
fi
if [[ $rc -ne 0 ]]; then
    echo "run_tests.sh: the Python SDK's tests FAILED (pytest exit $rc)" >&2
else
    say "the Python SDK's tests passed"
fi
exit "$rc"
