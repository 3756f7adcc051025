#!/usr/bin/env bash
# Byte-compile a Python venv's site-packages once, and mark it done.
#
#   scripts/byte-compile-venv.sh VENV
#
# Why: uv installs no .pyc files, and the tests run with PYTHONDONTWRITEBYTECODE=1 (to keep
# __pycache__ out of the checkout), so without this every Python process compiles vLLM, torch
# and transformers from source: importing vLLM's API server took 24-26 s on the development VM
# against 11 s compiled, and a vLLM start imports it in three processes (docs/testing.md).
# Used by integrations/vllm/install.sh and sdk/python/run_tests.sh, under their venv's lock.
#
# Writes VENV/.starling-bytecode when compileall ran through. compileall exits 1 when some file
# does not compile (a few packages ship templates as .py; those import from source, as before).
# Any other failure (killed, out of disk) leaves no marker, so the next run compiles again.
# Always exits 0: a venv that is not compiled still works, only slower.
set -uo pipefail

venv="$1"
say() { echo "byte-compile-venv.sh: $*" >&2; }
t0=$SECONDS
lib="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || {
    say "cannot find $venv's site-packages; not compiled"
    exit 0
}
rc=0
"$venv/bin/python" -m compileall -q -j 0 "$lib" >/dev/null 2>&1 || rc=$?
if [[ $rc -le 1 ]]; then
    touch "$venv/.starling-bytecode"
    say "byte-compiled $venv in $((SECONDS - t0)) s"
else
    say "byte-compiling $venv failed (exit $rc); its Python imports from source"
fi
exit 0
