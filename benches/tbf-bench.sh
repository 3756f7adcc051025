#!/usr/bin/env bash
# Delta delivery at 1 Gbit/s without added delay: hub -> relay over a veth pair shaped with
# `tc tbf` (both directions), relay -> actors over an unshaped veth (the region's LAN). The
# user-space emulator (starling-netem) cannot keep up at 1 Gbit/s, and the kernel here has no
# netem (see shared/notes/wan-emulation.md), so this link has a rate and no delay.
#
#   namespaces  <prefix>-hub ── wan0 ═ tbf ═ wan0 ── <prefix>-relay ── lan0 ─── lan0 ── <prefix>-actors
#   addresses   10.77.0.1 (hub)        10.77.0.2 (relay WAN)  10.77.0.5 (relay LAN)   10.77.0.6 (actors)
#
# Cases (each repeated --reps times; medians are printed):
#   ct1   cut-through, 1 stream per version   (hub --stripes 1, relay --stripes 1)
#   ct4   cut-through, 4 streams              (hub --stripes 4, relay --stripes 4)
#   saf4  store-and-forward, 4 streams        (hub --store-and-forward --stripes 4)
#
# Every wait and every time is read from the processes' status endpoints and metrics, never
# from their log text: each process serves `--http` on 127.0.0.1 in its namespace, and a
# watcher beside it polls the relays' and actors' `/v1/status` every 0.5 s through bash's
# /dev/tcp (no curl), writing a stamped `key value` line whenever a value changes
# (WORK/run-PID/CASE-REP/NAME.watch). The events timed here carry the stamp the process
# recorded itself (`cached_at_ms`, `newest_staged_at_ms`, `active_at_ms`), so the slow poll
# blurs no figure and takes almost no CPU from the processes measured.
# Each run publishes --warmup versions untimed (default 1: generator steps 1..W, each waited
# for until every actor has it active), then measures version W+1: the way every version of a
# training run arrives (staged into the vectors the previous version's undo log left, diffed
# against the hub's newest snapshot), not only the first after a start (--warmup 0).
# Per run: the measured delta's bytes (hub store deltas/vNNNNNNNN.sdc), the codec set the hub
# chose (`/v1/status` `codecs.chosen`) and, from the start (the version's `first_segment_at_ms`
# in the hub's `/v1/status` when it has one, else the moment `publish` is started), the times
# to the relay's `cached_version`, to the last actor's `newest_staged_version` and to the last
# actor's `active_version` (which includes persisting the full checkpoint). Goodput = delta
# bytes / (relay cached - start), as % of the tbf rate.
# Ideal = bytes*8/rate + RTT, with the RTT the relay is told (`--wan-rtt-ms 1`: an upper
# bound on the idle veth's ~0.1 ms); the relay's mean QUIC control RTT to the hub
# (`starling_relay_control_rtt_seconds`, which includes both processes' scheduling delay on a
# busy machine) is reported beside it. Also: on-wire bytes of the hub's veth per delta byte, the
# peak 0.5 s wire rate, and CPU seconds / peak CPU% of hub and relay during the run.
# The hub encodes the delta while it sends it (cut-through), so that goodput is bounded by
# the encoder when the encoder is slower than the link. Each run therefore ends with a
# catch-up: a second relay fetches the finished version from the hub's store over the same,
# now idle, link: the transport's own goodput at this rate, used for the full-checkpoint time
# (checkpoint bytes * 8 / catch-up goodput). Before each publish the script waits (up to
# --quiet-wait s) for the machine to be >= 75% idle, and reports the CPU other processes used
# during each run ("other load"): 2 shared cores make results noisy.
#
# Usage (as root, from anywhere; needs ip and tc (iproute2, installed from Debian's packages
# when missing); at the 1.5b preset ~12 GB RAM and, in --work, 3.5 GB per checkpoint step
# (steps 0..W+1 for --warmup W, kept), per handover copy (W+1 per run) and per store snapshot
# (the hub's and each actor's, removed after each run unless --keep): ~30 GB with --warmup 1):
#   benches/tbf-bench.sh [--reps 3] [--cases "ct1 ct4 saf4"] [--model 1.5b] [--lr 2e-5]
#                        [--rate-mbit 1000] [--burst 500kb] [--limit 1250000] [--actors 2]
#                        [--codecs auto|small|fast] [--handover yes|no] [--warmup 1]
#                        [--hub-args "EXTRA SERVE ARGS"] (e.g. "--tensor-hashes", for A/B runs)
#                        [--work /var/tmp/starling-tbf-bench]
#                        [--quiet-wait 180] [--keep] [--no-build]
# (1.5b at lr 1e-5 gives an 86 MB delta; 0.5b ~32 MB.) A full default run takes ~15-20 min;
# `.ci/run` runs it once at the tiny preset (`--model tiny --reps 1 --cases ct4 --quiet-wait 0`)
# so that a change that breaks it fails CI.
# Binaries are built first (`cargo build --release --bins`: nothing to do when they are fresh)
# in cargo's target directory as cargo resolves it, so a run never measures a stale build, and
# copied into the work directory, so a concurrent rebuild cannot change them mid-run
# (`--no-build` runs no cargo and takes the binaries in CARGO_TARGET_DIR, else target/, as
# they are: for a pinned A/B build). Checkpoints are generated once
# (`starling-hub bench gen`) and reused.
# Per-run logs (stdout/stderr of every process with $EPOCHREALTIME stamps, wire/CPU samples,
# a `top` snapshot mid-transfer) stay in WORK/run-PID/ (stores are deleted unless --keep).
# Namespaces are named stb-PID-*; stale stb-* namespaces (and the processes in them) are
# removed first, and everything is torn down on exit.
set -euo pipefail

cmdline="$0 $*"
reps=3
cases="ct1 ct4 saf4"
model=1.5b
lr=2e-5
rate_mbit=1000
burst=500kb
limit=1250000
actors=2
work=/var/tmp/starling-tbf-bench
keep=0
quiet_wait=180
codecs=auto
handover=yes
warmup=1
hub_args=""
build=1
while (($#)); do
    case $1 in
    --reps) reps=$2; shift 2 ;;
    --cases) cases=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --lr) lr=$2; shift 2 ;;
    --rate-mbit) rate_mbit=$2; shift 2 ;;
    --burst) burst=$2; shift 2 ;;
    --limit) limit=$2; shift 2 ;;
    --actors) actors=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --no-build) build=0; shift ;;
    --quiet-wait) quiet_wait=$2; shift 2 ;;
    --codecs) codecs=$2; shift 2 ;;
    --handover) handover=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --hub-args) hub_args=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
((EUID == 0)) || { echo "run as root (network namespaces, tc)" >&2; exit 1; }
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    command -v apt-get >/dev/null || { echo "missing ip/tc (iproute2) and no apt-get to install them" >&2; exit 1; }
    echo "installing iproute2 from Debian's packages"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$work"
exec 9>"$work/.lock"
flock -n 9 || { echo "another tbf-bench holds $work/.lock" >&2; exit 1; }

# ---------------------------------------------------------------- binaries and checkpoints
# Once stale binaries of an old checkout ran here, against the sources' docs: build (or check)
# what the sources say, where cargo puts it (CARGO_TARGET_DIR, a config's target-dir, target/).
if ((build)); then
    release=$(cd "$repo" && cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/release
    (cd "$repo" && cargo build --release --bins -q)
else
    # No cargo at all (under sudo it may not be on PATH): CARGO_TARGET_DIR, else target/.
    release=${CARGO_TARGET_DIR:-$repo/target}/release
    [[ $release = /* ]] || release=$repo/$release
fi
for b in starling-hub starling-relay starling-actor; do
    [[ -x $release/$b ]] || { echo "no $release/$b (run without --no-build)" >&2; exit 1; }
done
run_root=$work/run-$$
mkdir -p "$run_root/bin"
for b in starling-hub starling-relay starling-actor; do
    cp "$release/$b" "$run_root/bin/$b"
done
HUB=$run_root/bin/starling-hub RELAY=$run_root/bin/starling-relay ACTOR=$run_root/bin/starling-actor
bin_stamp=$(stat -c '%y' "$release/starling-hub" | cut -d. -f1)
git_rev=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?')
git_dirty=$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null | wc -l)

# Below the hub's default anchor interval and retention (32 versions), so that the catch-up
# relay fetches deltas rather than restoring an anchor.
[[ $warmup =~ ^[0-9]+$ ]] && ((warmup <= 30)) || { echo "--warmup takes a count up to 30" >&2; exit 2; }
# The measured version: after --warmup untimed ones, so that it is staged the way every
# version of a run is (into the vectors the previous version's undo log left), not the way
# only the first after a start is.
measured=$((warmup + 1))
step_file() { printf '%s/step-%04d.safetensors' "$ckpt" "$1"; }
ckpt=$work/$model-lr$lr
if [[ ! -f $(step_file "$measured") ]]; then
    echo "generating $model checkpoints (lr $lr, $measured steps) in $ckpt ..."
    rm -rf "$ckpt.tmp" "$ckpt"
    "$HUB" bench gen --model "$model" --steps "$measured" --lr "$lr" -o "$ckpt.tmp"
    mv "$ckpt.tmp" "$ckpt"
fi
step0=$(step_file 0)
ckpt_bytes=$(stat -c %s "$step0")

# ---------------------------------------------------------------- namespaces
P=stb-$$
NS_HUB=$P-hub NS_RELAY=$P-relay NS_ACT=$P-actors
HUB_IP=10.77.0.1 RELAY_WAN_IP=10.77.0.2 RELAY_LAN_IP=10.77.0.5 ACT_IP=10.77.0.6

declare -A PIDS=()
kill_pids() { # pid... : TERM, then KILL whatever is left after 3 s; reap
    local p left
    (($#)) || return 0
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 30); do
        left=0
        for p in "$@"; do kill -0 "$p" 2>/dev/null && left=1; done
        ((left)) || break
        sleep 0.1
    done
    kill -KILL "$@" 2>/dev/null || true
    for p in "$@"; do wait "$p" 2>/dev/null || true; done
}
stop_all() {
    local pids=("${PIDS[@]}")
    PIDS=()
    kill_pids "${pids[@]}"
}
del_ns() { # namespace: stop what runs in it (by PID), then delete it
    local ns=$1 pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    if [[ -n $pids ]]; then
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null || true
        sleep 1
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns" 2>/dev/null || true
}
teardown() {
    stop_all
    for ns in "$NS_HUB" "$NS_RELAY" "$NS_ACT"; do del_ns "$ns"; done
    if ((keep == 0)); then rm -rf "$run_root"/*/a*-store "$run_root"/*/hub-store "$run_root/bin"; fi
    # Handover copies a run made and did not publish (it stopped early).
    rm -f "${ckpt:-/nonexistent}"/handover-*.safetensors
}
trap teardown EXIT
trap 'exit 130' INT TERM

for ns in $(ip netns list | awk '{print $1}' | grep '^stb-' || true); do
    echo "removing stale namespace $ns"
    del_ns "$ns"
done

ip netns add "$NS_HUB"
ip netns add "$NS_RELAY"
ip netns add "$NS_ACT"
for ns in "$NS_HUB" "$NS_RELAY" "$NS_ACT"; do ip -n "$ns" link set lo up; done
ip link add wan0 netns "$NS_HUB" type veth peer name wan0 netns "$NS_RELAY"
ip link add lan0 netns "$NS_RELAY" type veth peer name lan0 netns "$NS_ACT"
ip -n "$NS_HUB" addr add $HUB_IP/30 dev wan0
ip -n "$NS_RELAY" addr add $RELAY_WAN_IP/30 dev wan0
ip -n "$NS_RELAY" addr add $RELAY_LAN_IP/30 dev lan0
ip -n "$NS_ACT" addr add $ACT_IP/30 dev lan0
ip -n "$NS_HUB" link set wan0 up
ip -n "$NS_RELAY" link set wan0 up
ip -n "$NS_RELAY" link set lan0 up
ip -n "$NS_ACT" link set lan0 up
for ns in "$NS_HUB" "$NS_RELAY"; do
    tc -n "$ns" qdisc add dev wan0 root tbf rate "${rate_mbit}mbit" burst "$burst" limit "$limit"
done
# No route from the actors to the hub: actors reach only the relay (no fallback bypasses the WAN).

# ---------------------------------------------------------------- cluster credentials
cluster=$run_root/cluster
"$HUB" init --name tbf-bench --dir "$cluster" >/dev/null
for r in r1 r2; do "$HUB" issue --role relay --name $r --dir "$cluster" -o "$run_root/$r" >/dev/null; done
for i in $(seq "$actors"); do
    "$HUB" issue --role actor --name "a$i" --dir "$cluster" -o "$run_root/a$i" >/dev/null
done

# ---------------------------------------------------------------- helpers
stamp() { while IFS= read -r l; do printf '%s %s\n' "$EPOCHREALTIME" "$l"; done; }
start() { # name namespace command... (stdout/stderr stamped into $run/NAME.out/.err)
    local name=$1 ns=$2
    shift 2
    ip netns exec "$ns" "$@" > >(stamp >"$run/$name.out") 2> >(stamp >"$run/$name.err") &
    PIDS[$name]=$!
}
# Status endpoints and metrics, read without curl: HTTP/1.0 over bash's /dev/tcp.
http_get() { # host port path : the response body on stdout (status 200 only)
    local l head=1 ok=0
    exec 3<>"/dev/tcp/$1/$2" || return 1
    printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$3" "$1" >&3
    while IFS= read -r l <&3 || [[ -n $l ]]; do
        l=${l%$'\r'}
        if ((head)); then
            [[ $l == 'HTTP/'*' 200'* ]] && ok=1
            [[ -z $l ]] && head=0
        else
            printf '%s\n' "$l"
        fi
    done
    exec 3<&-
    ((ok))
}
watcher() { # port paths... : every 0.5 s, stamped `key value` lines for what changed
    # Keys: `up 1` once 127.0.0.1:PORT answers; every unlabelled `starling_*` sample of
    # /metrics; from an actor's /v1/status: staged_version, active_version, source_connected;
    # from a relay's: cached_version, hub_connected. A version's line carries the stamp the
    # process itself recorded (`newest_staged_at_ms`, `active_at_ms`, `cached_at_ms`; the hub link's
    # `since_ms`), so this loop can poll slowly, off the measured processes' cores, without
    # blurring any figure; other lines carry the time this loop saw them.
    local port=$1 l k v at body path
    shift
    local -A last=()
    local -a lines
    # `read -t` on a pipe nobody writes to waits without forking a `sleep`.
    local idle
    exec {idle}<> <(:)
    # emit KEY VALUE [MS]: a stamped line when VALUE changed (stamped MS when given).
    emit() {
        [[ ${last[$1]:-} == "$2" ]] && return 0
        last[$1]=$2
        if [[ -n ${3:-} ]]; then
            printf '%d.%03d %s %s\n' $(($3 / 1000)) $(($3 % 1000)) "$1" "$2"
        else
            printf '%s %s %s\n' "$EPOCHREALTIME" "$1" "$2"
        fi
    }
    while :; do
        for path in "$@"; do
            exec 3<>"/dev/tcp/127.0.0.1/$port" 2>/dev/null || continue
            printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$path" >&3
            mapfile -t lines <&3
            exec 3<&-
            [[ ${last[up]:-} ]] || { last[up]=1; printf '%s up 1\n' "$EPOCHREALTIME"; }
            if [[ $path == /metrics ]]; then
                for l in "${lines[@]}"; do
                    l=${l%$'\r'}
                    [[ $l =~ ^(starling_[a-z_]+)\ ([-+0-9.eE]+|NaN)$ ]] || continue
                    emit "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
                done
                continue
            fi
            body=${lines[*]: -1}
            if [[ $body =~ \"role\":\"relay\" ]]; then
                [[ $body =~ \"cached_at_ms\":([0-9]+) ]] && at=${BASH_REMATCH[1]} || at=
                [[ $body =~ \"cached_version\":([0-9]+) ]] && emit cached_version "${BASH_REMATCH[1]}" "$at"
                [[ $body =~ \"hub\":\{[^}]*\"connected\":(true|false)[^}]*\"since_ms\":([0-9]+) ]] &&
                    emit hub_connected "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
                continue
            fi
            # `newest_staged_*` stays once the version is active: a slow poll still sees it.
            for k in newest_staged:staged active:active; do
                [[ $body =~ \"${k%:*}_version\":([0-9]+|null) ]] || continue
                v=${BASH_REMATCH[1]}
                [[ $body =~ \"${k%:*}_at_ms\":([0-9]+) ]] && at=${BASH_REMATCH[1]} || at=
                emit "${k#*:}_version" "$v" "$at"
            done
            [[ $body =~ \"source\":\{[^}]*\"connected\":(true|false) ]] &&
                emit source_connected "${BASH_REMATCH[1]}"
        done
        read -r -t 0.5 -u "$idle" _ || true
    done
}
start_watch() { # name namespace port paths... : a watcher of NAME's endpoints into $run/NAME.watch
    local name=$1 ns=$2
    shift 2
    : >"$run/$name.watch"
    ip netns exec "$ns" bash -c "$(declare -f watcher); watcher $*" >"$run/$name.watch" 2>/dev/null &
    PIDS[$name-watch]=$!
}
last_value() { # key file : the newest value of KEY in a watch file, or nothing
    awk -v k="$1" '$2 == k { v = $3 } END { if (v != "") print v }' "$2" 2>/dev/null
}
first_ts() { # file extended-regex-after-stamp : stamp of the first matching line, or nothing
    grep -m1 -E "^[0-9.]+ $2" "$1" 2>/dev/null | cut -d' ' -f1 || true
}
wait_for() { # name file regex timeout_s : stamp of the first match; dies if NAME exits
    local name=$1 file=$2 re=$3 deadline=$((SECONDS + $4)) t
    while :; do
        t=$(first_ts "$file" "$re")
        [[ -n $t ]] && { echo "$t"; return 0; }
        if ! kill -0 "${PIDS[$name]}" 2>/dev/null; then
            echo "$name exited while waiting for '$re' in $file:" >&2
            tail -5 "$run/$name.err" >&2 || true
            return 1
        fi
        ((SECONDS < deadline)) || { echo "timeout waiting for '$re' in $file" >&2; return 1; }
        # The stamp is the watcher's, so how often this looks for it changes no figure: every
        # 0.25 s keeps the grep and cut it forks off the measured processes' cores.
        sleep 0.25
    done
}
cpu_ticks() { # pid : utime + stime in clock ticks
    local f
    read -r -a f <"/proc/$1/stat" 2>/dev/null || { echo 0; return; }
    echo $((f[13] + f[14]))
}
sampler() { # every 0.1 s: stamp, hub wan0 tx bytes, hub CPU ticks, relay CPU ticks
    # Builtins only (no command substitution, no `sleep`): nothing forked 10 times a second.
    local hub=$1 relay=$2 tx idle
    local -a h r
    exec {idle}<> <(:)
    while :; do
        read -r tx <"/sys/class/net/wan0/statistics/tx_bytes"
        read -r -a h <"/proc/$hub/stat" || h=()
        read -r -a r <"/proc/$relay/stat" || r=()
        printf '%s %s %s %s\n' "$EPOCHREALTIME" "$tx" $((${h[13]:-0} + ${h[14]:-0})) \
            $((${r[13]:-0} + ${r[14]:-0}))
        read -r -t 0.1 -u "$idle" _ || true
    done
}
f() { awk "BEGIN { printf \"%.${2:-2}f\", $1 }"; } # f EXPR [DECIMALS]: evaluate and format

cpu_busy() { # busy (non-idle, non-iowait) clock ticks of the whole machine
    local _ u n sy idle io irq sirq st
    read -r _ u n sy idle io irq sirq st _ </proc/stat
    echo $((u + n + sy + irq + sirq + st))
}
wait_quiet() { # up to $1 s for the machine to be >= 75% idle over 2 s (other jobs share it)
    local deadline=$((SECONDS + $1)) b0 b1 cores
    cores=$(nproc)
    while ((SECONDS < deadline)); do
        b0=$(cpu_busy); sleep 2; b1=$(cpu_busy)
        (((b1 - b0) * 4 <= 2 * 100 * cores)) && return 0
    done
    echo "  (machine still busy after $1 s: measuring anyway; see the 'other load' column)"
}

results=$run_root/results.tsv
printf 'case\trep\tbytes\tstart_ref\tend_ref\tt_first\tt_publish\tt_cached\tt_staged\tt_active\tgoodput_pct\tratio\twire_per_byte\tpeak_mbit\thub_cpu_s\trelay_cpu_s\thub_peak_pct\trelay_peak_pct\tt_tail\tcatchup_s\tcatchup_pct\tcatchup_hub_pct\tcatchup_relay_pct\tother_cores\trtt_ms\tcodecs\thandover\n' >"$results"

run_case() { # case rep
    local c=$1 rep=$2 stripes hub_extra=() relay_stripes
    case $c in
    ct1) stripes=1 ;;
    ct4) stripes=4 ;;
    saf4) stripes=4 hub_extra=(--store-and-forward) ;;
    *) echo "unknown case $c" >&2; return 1 ;;
    esac
    relay_stripes=$stripes
    run=$run_root/$c-$rep
    rm -rf "$run"
    mkdir -p "$run"
    # With --handover yes (the default) the trainer writes a fresh file per step and gives it
    # to the hub, which renames it into its store instead of copying it: a copy made here,
    # before the clock starts, stands for the file a trainer just wrote.
    # Version v is step v of the generator; with --handover yes, a copy of it.
    local -a sources=() pub_extra=()
    local v
    for v in $(seq "$measured"); do
        if [[ $handover == yes ]]; then
            sources[v]=$ckpt/handover-$c-$rep-$v.safetensors
            cp "$(step_file "$v")" "${sources[v]}"
        else
            sources[v]=$(step_file "$v")
        fi
    done
    [[ $handover == yes ]] && pub_extra=(--handover)
    local source=${sources[measured]}
    # shellcheck disable=SC2086 # --hub-args is split into words on purpose
    start hub "$NS_HUB" "$HUB" serve --listen $HUB_IP:7443 --model-id tiny --cluster "$cluster" \
        --store "$run/hub-store" --init "$step0" --stripes "$stripes" "${hub_extra[@]}" \
        --codecs "$codecs" --http 127.0.0.1:9100 --publish-dir "$ckpt" $hub_args
    start_watch hub "$NS_HUB" 9100 /metrics
    wait_for hub "$run/hub.watch" 'up 1$' 600 >/dev/null
    # Only the hub's `up` is read from its watch: polling its long /metrics in bash every
    # 0.5 s for the rest of the run would take CPU from the processes being measured.
    kill_pids "${PIDS[hub-watch]}"
    unset 'PIDS[hub-watch]'
    start relay "$NS_RELAY" "$RELAY" --model-id tiny --listen $RELAY_LAN_IP:7444 \
        --hub $HUB_IP:7443 --region r1 --credentials "$run_root/r1" \
        --wan-mbit "$rate_mbit" --wan-rtt-ms 1 --stripes "$relay_stripes" --http 127.0.0.1:9101
    start_watch relay "$NS_RELAY" 9101 /v1/status
    wait_for relay "$run/relay.watch" 'hub_connected true$' 60 >/dev/null
    for i in $(seq "$actors"); do
        start "a$i" "$NS_ACT" "$ACTOR" --model-id tiny --hub $HUB_IP:7443 \
            --credentials "$run_root/a$i" --init "$step0" --store "$run/a$i-store" \
            --region r1 --relay "r1@$RELAY_LAN_IP:7444" --http "127.0.0.1:$((9110 + i))"
        start_watch "a$i" "$NS_ACT" $((9110 + i)) /v1/status
    done
    for i in $(seq "$actors"); do
        wait_for "a$i" "$run/a$i.watch" 'active_version 0$' 600 >/dev/null
        wait_for "a$i" "$run/a$i.watch" 'source_connected true$' 60 >/dev/null
    done
    # The warm-up versions, untimed: published, cached by the relay, active at every actor.
    for v in $(seq "$warmup"); do
        ip netns exec "$NS_HUB" "$HUB" publish --model-id tiny --hub $HUB_IP:7443 \
            --cluster "$cluster" "${pub_extra[@]}" "${sources[v]}" > >(stamp >"$run/publish-$v.out") 2>&1
        [[ $handover == yes ]] && rm -f "${sources[v]}"
        wait_for relay "$run/relay.watch" "cached_version $v\$" 900 >/dev/null
        for i in $(seq "$actors"); do
            wait_for "a$i" "$run/a$i.watch" "active_version $v\$" 900 >/dev/null
        done
    done
    # The hub's newest snapshot, which it diffs the measured version against: the last
    # warm-up version in its store (handed over, or copied), else step 0 (its --init).
    local base_file=$step0
    ((warmup > 0)) && base_file=$(printf '%s/hub-store/snapshot/v%08d.safetensors' "$run" "$warmup")
    # The page cache at the start of the run: the two files the hub diffs (its newest
    # snapshot and the file it publishes) and nothing else. A trainer's fresh checkpoint is in its host's
    # page cache, and so is the hub's newest snapshot; what else this box cached (earlier runs'
    # copies, builds) would otherwise be reclaimed, or those two files read back from disk,
    # inside the measured window, because one 24 GB box holds a hub and two actors here
    # (3.5 GB of weights each at 1.5b). `sync` first, so that no writeback of the copy made
    # above runs during the run either.
    sync
    echo 1 2>/dev/null >/proc/sys/vm/drop_caches || echo "  (could not drop the page cache: measuring anyway)"
    cat "$base_file" "$source" >/dev/null
    wait_quiet "$quiet_wait"
    # The relay's mean control RTT to the hub so far (reported; the ideal uses the stated 1 ms).
    local rtt_sum rtt_n rtt_ms=nan
    ip netns exec "$NS_RELAY" bash -c "$(declare -f http_get); http_get 127.0.0.1 9101 /metrics" \
        2>/dev/null | sed 's/^/0 /' >"$run/relay-metrics.txt" || true
    rtt_sum=$(last_value starling_relay_control_rtt_seconds_sum "$run/relay-metrics.txt")
    rtt_n=$(last_value starling_relay_control_rtt_seconds_count "$run/relay-metrics.txt")
    [[ -n $rtt_n && $rtt_n != 0 ]] && rtt_ms=$(f "1000*$rtt_sum/$rtt_n" 3)

    local hub_pid=${PIDS[hub]} relay_pid=${PIDS[relay]} mine0=0 p
    ip netns exec "$NS_HUB" bash -c "$(declare -f sampler); sampler $hub_pid $relay_pid" \
        >"$run/samples" 2>/dev/null &
    PIDS[sampler]=$!
    for p in hub relay $(seq -f 'a%g' "$actors"); do mine0=$((mine0 + $(cpu_ticks "${PIDS[$p]}"))); done
    local busy0 t0
    busy0=$(cpu_busy)
    t0=$EPOCHREALTIME
    # A `top` snapshot 1.5 s into the run (the second iteration: CPU% over 1 s).
    (sleep 1.5 && top -b -n 2 -d 1 -p "$hub_pid,$relay_pid,${PIDS[a1]}" |
        awk '/^top -/ {n++} n == 2' >"$run/top.txt") &
    PIDS[top]=$!
    ip netns exec "$NS_HUB" "$HUB" publish --model-id tiny --hub $HUB_IP:7443 \
        --cluster "$cluster" "${pub_extra[@]}" "$source" > >(stamp >"$run/publish.out") 2>&1
    local t_pub=$EPOCHREALTIME
    local taken=off
    if [[ $handover == yes ]]; then
        if [[ -e $source ]]; then taken=copied; rm -f "$source"; else taken=taken; fi
    fi
    local t_cached
    t_cached=$(wait_for relay "$run/relay.watch" "cached_version $measured\$" 900)
    local i t_staged_max=0 t_active_max=0 end_ref=staged t
    for i in $(seq "$actors"); do
        t=$(wait_for "a$i" "$run/a$i.watch" "active_version $measured\$" 900)
        t_active_max=$(awk -v a="$t" -v b="$t_active_max" 'BEGIN { print (a > b ? a : b) }')
        t=$(first_ts "$run/a$i.watch" "staged_version $measured\$")
        [[ -n $t ]] || { t=$(first_ts "$run/a$i.watch" "active_version $measured\$"); end_ref=active; }
        t_staged_max=$(awk -v a="$t" -v b="$t_staged_max" 'BEGIN { print (a > b ? a : b) }')
    done
    local mine1=0 busy1 t1
    for p in hub relay $(seq -f 'a%g' "$actors"); do mine1=$((mine1 + $(cpu_ticks "${PIDS[$p]}"))); done
    busy1=$(cpu_busy)
    t1=$EPOCHREALTIME
    # The hub's status: when the measured version's first segment was encoded, and the codecs
    # it chose. Each entry of `versions` is an object whose first key is "actors" (an array;
    # a region's "actors" is a count) and whose last is "version" (serde_json sorts keys).
    local status t_first start_ref=first-segment chosen=? rest entry
    status=$(ip netns exec "$NS_HUB" bash -c "$(declare -f http_get); http_get 127.0.0.1 9100 /v1/status" 2>/dev/null || true)
    printf '%s\n' "$status" >"$run/hub-status.json"
    t_first=
    rest=${status#*\"versions\":\[}
    while [[ $rest == *'{"actors":['* ]]; do
        rest=${rest#*\{\"actors\":\[}
        entry=${rest%%\{\"actors\":\[*}
        if [[ $entry =~ \"version\":$measured\} && $entry =~ \"first_segment_at_ms\":([0-9]+) ]]; then
            t_first=$(f "${BASH_REMATCH[1]}/1000" 3)
        fi
    done
    [[ $status =~ \"chosen\":\"([a-z]+)\" ]] && chosen=${BASH_REMATCH[1]}
    [[ -n $t_first ]] || { t_first=$t0; start_ref=publish; }
    wait "${PIDS[top]}" 2>/dev/null || true
    unset 'PIDS[top]'

    # Catch-up: a second relay (same link, now idle) fetches the finished version from the
    # hub's store: the transport's goodput over the shaped link, without the encoder in front.
    local h0 h1 r1c c0 c1 t_r2 t_r2c
    start relay2 "$NS_RELAY" "$RELAY" --model-id tiny --listen $RELAY_LAN_IP:7445 \
        --hub $HUB_IP:7443 --region r2 --credentials "$run_root/r2" \
        --wan-mbit "$rate_mbit" --wan-rtt-ms 1 --stripes "$relay_stripes" --http 127.0.0.1:9102
    start_watch relay2 "$NS_RELAY" 9102 /v1/status
    h0=$(cpu_ticks "$hub_pid")
    c0=$EPOCHREALTIME
    # From the catch-up relay's connection to the hub (its own stamp) to its `cached`.
    t_r2=$(wait_for relay2 "$run/relay2.watch" 'hub_connected true$' 60)
    t_r2c=$(wait_for relay2 "$run/relay2.watch" "cached_version $measured\$" 300)
    h1=$(cpu_ticks "$hub_pid")
    r1c=$(cpu_ticks "${PIDS[relay2]}")
    c1=$EPOCHREALTIME

    # The measured delta's bytes; the catch-up relay fetches every version up to it.
    local bytes catchup_bytes=0
    bytes=$(stat -c %s "$(printf '%s/hub-store/deltas/v%08d.sdc' "$run" "$measured")")
    for v in $(seq "$measured"); do
        catchup_bytes=$((catchup_bytes + $(stat -c %s "$(printf '%s/hub-store/deltas/v%08d.sdc' "$run" "$v")")))
    done
    stop_all

    # Wire: bytes the hub's veth sent between t0 and the relay's `cached`; peak rate over 0.5 s.
    # CPU: hub and relay CPU seconds between t0 and the last `active`, peak % over 0.5 s.
    local wire
    wire=$(awk -v t0="$t0" -v tc="$t_cached" -v te="$t_active_max" '
        $1 >= t0 && $1 <= te && !s { s = 1; tx0 = $2; h0 = $3; r0 = $4 }
        s && $1 <= tc { txc = $2 }
        s && $1 <= te { h1 = $3; r1 = $4; t[n] = $1; tx[n] = $2; h[n] = $3; r[n] = $4; n++ }
        END {
            for (i = 0; i < n; i++) for (j = i + 1; j < n; j++) if (t[j] - t[i] >= 0.5) {
                d = t[j] - t[i]
                m = (tx[j] - tx[i]) * 8 / d / 1e6; if (m > pm) pm = m
                x = (h[j] - h[i]) / d; if (x > ph) ph = x
                y = (r[j] - r[i]) / d; if (y > pr) pr = y
                break
            }
            printf "%d %.0f %.2f %.2f %.0f %.0f", txc - tx0, pm, (h1 - h0) / 100, (r1 - r0) / 100, ph, pr
        }' "$run/samples")
    local wire_bytes peak_mbit hub_cpu relay_cpu hub_peak relay_peak
    read -r wire_bytes peak_mbit hub_cpu relay_cpu hub_peak relay_peak <<<"$wire"

    awk -v c="$c" -v rep="$rep" -v b="$bytes" -v sr="$start_ref" -v er="$end_ref" \
        -v t0="$t0" -v tf="$t_first" -v tp="$t_pub" -v tc="$t_cached" -v ts="$t_staged_max" \
        -v ta="$t_active_max" -v rate="$rate_mbit" -v rtt=1 -v mrtt="$rtt_ms" -v wb="$wire_bytes" \
        -v pm="$peak_mbit" -v hc="$hub_cpu" -v rc="$relay_cpu" -v hp="$hub_peak" -v rp="$relay_peak" \
        -v t2="$t_r2" -v t2c="$t_r2c" -v h0="$h0" -v h1="$h1" -v r1c="$r1c" -v c0="$c0" -v c1="$c1" \
        -v m0="$mine0" -v m1="$mine1" -v b0="$busy0" -v b1="$busy1" -v t1="$t1" -v ch="$chosen" -v ho="$taken" \
        -v cb="$catchup_bytes" '
        BEGIN {
            ideal = b * 8 / (rate * 1e6) + rtt / 1000
            printf "%s\t%d\t%d\t%s\t%s\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f\t%.1f\t%.2f\t%.3f\t%d\t%.2f\t%.2f\t%d\t%d",
                c, rep, b, sr, er, tf - t0, tp - t0, tc - tf, ts - tf, ta - tf,
                100 * b * 8 / (tc - tf) / (rate * 1e6), (ts - tf) / ideal, wb / b, pm, hc, rc, hp, rp
            printf "\t%.3f\t%.3f\t%.1f\t%.0f\t%.0f\t%.2f\t%s\t%s\t%s\n", tc - tp, t2c - t2,
                100 * cb * 8 / (t2c - t2) / (rate * 1e6), (h1 - h0) / (c1 - c0), r1c / (c1 - c0),
                ((b1 - b0) - (m1 - m0)) / 100 / (t1 - t0), mrtt, ch, ho
        }' >>"$results"
    tail -1 "$results" | awk -F'\t' '{ printf "  %s #%s: codecs %s, handover %s, delta %.1f MB, first segment +%.2f s, publish returned +%.2f s; from %s: relay cached %.2f s (%.1f%% of link), last %s %.2f s (%.2fx ideal), last active %.2f s; wire %.3f B/B, peak %d Mbit/s; CPU s hub %.1f relay %.1f, peak%% hub %d relay %d; catch-up %.2f s (%.1f%% of link, hub %d%% relay %d%% CPU); other load %.2f cores\n",
        $1, $2, $26, $27, $3 / 1e6, $6, $7, $4, $8, $11, $5, $9, $12, $10, $13, $14, $15, $16, $17, $18, $20, $21, $22, $23, $24 }'
    if ((keep == 0)); then rm -rf "$run"/a*-store "$run/hub-store"; fi
}

echo "tbf-bench: $model lr $lr, $(f "$ckpt_bytes/1e6" 1) MB checkpoint; tbf rate ${rate_mbit}mbit burst $burst limit $limit; hub --codecs $codecs; $actors actors; logs in $run_root"
for rep in $(seq "$reps"); do
    for c in $cases; do # interleaved, so slow drifts (page cache, other load) hit every case alike
        run_case "$c" "$rep"
    done
done

# ---------------------------------------------------------------- summary (medians)
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
col() { awk -F'\t' -v c="$1" -v k="$2" 'NR > 1 && $1 == c { print $k }' "$results" | median; }
refs() { awk -F'\t' -v c="$1" -v k="$2" 'NR > 1 && $1 == c { print $k }' "$results" | sort -u | paste -sd/; }
label() { case $1 in ct1) echo "cut-through, 1 stream" ;; ct4) echo "cut-through, 4 streams" ;; saf4) echo "store-and-forward, 4 streams" ;; esac; }

echo
echo "### Delta delivery over tbf ${rate_mbit} Mbit/s, no added delay (medians of $reps runs)"
echo
echo "Settings: tbf rate ${rate_mbit}mbit burst $burst limit $limit B on both directions of the hub-relay veth (ideal counts 1 ms of RTT, as the relay is told; the relay's mean QUIC control RTT to the hub, median of the runs: $(awk -F'\t' 'NR > 1 { print $25 }' "$results" | median) ms); hub --codecs $codecs; relay-actors veth unshaped; $actors actors; model preset $model, lr $lr; measured version $measured, after $warmup untimed warm-up version(s); checkpoint $(f "$ckpt_bytes/1e6" 1) MB (BF16); relay --wan-mbit $rate_mbit --wan-rtt-ms 1; binaries of $git_rev (+$git_dirty modified files, built $bin_stamp); $(nproc) cores."
echo
echo "| case | codecs chosen | delta MB | start → end ref | first segment after publish start (s) | publish returned (s) | relay cached (s) | goodput (% of link) | relay cached − publish returned (s) | last staged (s) | staged / ideal (bytes/rate + RTT) | last active (s) | wire B / delta B | peak wire Mbit/s | hub / relay CPU s | hub / relay peak CPU % | catch-up: s, % of link, hub / relay CPU % | full checkpoint at catch-up goodput (s) | full checkpoint ÷ last staged | other load (cores) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for c in $cases; do
    b=$(col "$c" 3) tc_=$(col "$c" 8) gp=$(col "$c" 11) cu=$(col "$c" 21) st=$(col "$c" 9)
    full=$(f "$ckpt_bytes*8/($cu/100*$rate_mbit*1e6)" 1)
    printf '| %s | %s | %s | %s → %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s / %s | %s / %s | %s s, %s%%, %s / %s | %s | %s | %s |\n' \
        "$(label "$c")" "$(refs "$c" 26)" "$(f "$b/1e6" 1)" "$(refs "$c" 4)" "$(refs "$c" 5)" "$(f "$(col "$c" 6)")" \
        "$(f "$(col "$c" 7)")" "$(f "$tc_")" "$(f "$gp" 1)" "$(f "$(col "$c" 19)")" "$(f "$st")" \
        "$(f "$(col "$c" 12)")" "$(f "$(col "$c" 10)")" "$(f "$(col "$c" 13)" 3)" "$(col "$c" 14)" \
        "$(f "$(col "$c" 15)" 1)" "$(f "$(col "$c" 16)" 1)" "$(col "$c" 17)" "$(col "$c" 18)" \
        "$(f "$(col "$c" 20)")" "$(f "$cu" 1)" "$(col "$c" 22)" "$(col "$c" 23)" \
        "$full" "$(f "$full/$st" 1)" "$(f "$(col "$c" 24)")"
done
echo
echo "Full BF16 checkpoint ($(f "$ckpt_bytes/1e6" 1) MB) at the line rate: $(f "$ckpt_bytes*8/($rate_mbit*1e6)" 1) s."
echo "Times are from the start reference (the measured version's \`first_segment_at_ms\` in the hub's \`/v1/status\`, or the start of \`publish\` when the hub does not report it) except the two columns \"after publish start\"/\"publish returned\" (from the start of \`publish\`; \`publish\` returns once the delta file is durable). \"cached\", \"staged\" and \"active\" are the moments the relay and the actors recorded themselves (\`/v1/status\` \`cached_at_ms\`, \`newest_staged_at_ms\`, \`active_at_ms\`); \`active\` includes persisting the full checkpoint. Goodput = delta bytes / relay-cached time (bounded by the encoder when it is slower than the link). Catch-up = a second relay fetching the finished version from the hub's store over the same, now idle, link (from its connection to the hub to its \`cached_version\` of the measured version, fetching every version up to it, both as it stamped them): the transport's goodput without the encoder. CPU % is of one core; CPU seconds span publish start → last active. Other load = CPU used by processes outside the benchmark (e.g. concurrent builds) during the run, in cores."
echo
echo "Command: \`$cmdline\`"
echo "Per-run results: $results"
