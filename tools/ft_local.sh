#!/bin/bash
# Replica groups on one machine (parallel.fault_tolerance, torchft): a lighthouse, then REPLICA_GROUPS torchrun jobs of
# NPROC ranks each, every one a replica group holding the whole model (FSDP inside it). Kill one group (or one of
# its ranks) and the others train on; the group comes back by itself (torchrun --max-restarts) and heals from a
# live peer instead of a checkpoint.
#
#     tools/ft_local.sh CONFIG [train.py options...]
#     REPLICA_GROUPS=2 NPROC=2 tools/ft_local.sh configs/tiny.py --set data.total_steps=200
#
# Each group writes its own run folder, RUN_DIR/group{G} (metrics.jsonl: ft/participants, ft/quorum_time, ...).
# `{group}` in any train.py option is replaced by the group's index, so that each group can be given its own value:
# groups that save checkpoints need their own ckpt.save_ckpt_folder (one live writer per folder), e.g.
#     tools/ft_local.sh configs/tiny.py --set ckpt.enable_save_ckpt=True 'ckpt.save_ckpt_folder=RUN/ckpt/group{group}'
# GPUs: on a machine with GPUs each group gets its own NPROC of them (CUDA_VISIBLE_DEVICES: group G the G-th slice of
# the visible ones; NCCL refuses two ranks of one communicator on one GPU); more ranks than GPUs is an error.
# The script owns what it starts: SIGTERM, SIGINT or SIGHUP to it stop every group (SIGTERM to each torchrun agent,
# which stops its workers; SIGKILL after STOP_TIMEOUT s) and then the lighthouse; it ends when all of them have.
# A group that ends is reported with its exit status and its log's last line.
# Environment: REPLICA_GROUPS (2), NPROC (ranks per group, 2), MIN_REPLICAS (1), LIGHTHOUSE_PORT (29510), MAX_RESTARTS
# (3: restarts of a group by its torchrun agent), RUN_DIR (RUN/ft-<time>), LIGHTHOUSE_ARGS (extra lighthouse flags),
# STOP_TIMEOUT (45).

set -euo pipefail

CONFIG=${1:?usage: tools/ft_local.sh CONFIG [train.py options...]}
shift

cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")
REPLICA_GROUPS=${REPLICA_GROUPS:-2}
NPROC=${NPROC:-2}
MIN_REPLICAS=${MIN_REPLICAS:-1}
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RUN_DIR=${RUN_DIR:-RUN/ft-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$RUN_DIR"

STOP_TIMEOUT=${STOP_TIMEOUT:-45}
# the CUDA allocator grows and shrinks its segments in place (MoE's varying expert rows fragment fixed blocks)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# GPU slices: the visible GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi's list; none: a CPU run, nothing to slice)
GPUS=()
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a GPUS <<< "$CUDA_VISIBLE_DEVICES"
elif command -v nvidia-smi > /dev/null 2>&1; then
    mapfile -t GPUS < <(nvidia-smi --query-gpu=index --format=csv,noheader 2> /dev/null || true)
fi
if [ "${#GPUS[@]}" -gt 0 ] && [ $((REPLICA_GROUPS * NPROC)) -gt "${#GPUS[@]}" ]; then
    echo "tools/ft_local.sh: REPLICA_GROUPS=$REPLICA_GROUPS x NPROC=$NPROC ranks need as many GPUs, ${#GPUS[@]} are visible (${GPUS[*]})" >&2
    exit 2
fi

LIGHTHOUSE_PID=
PIDS=()
stop_all() {
    # every group's torchrun agent gets SIGTERM (it stops its workers: SIGTERM, then SIGKILL); whatever is left after
    # STOP_TIMEOUT s is SIGKILLed (a worker dies with its agent); then the lighthouse
    trap - TERM INT HUP
    local pid deadline=$((SECONDS + STOP_TIMEOUT))
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2> /dev/null || true; done
    for pid in "${PIDS[@]}"; do
        while kill -0 "$pid" 2> /dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
        kill -KILL "$pid" 2> /dev/null || true
        wait "$pid" 2> /dev/null || true
    done
    # the lighthouse gets SIGTERM until it is gone (SIGKILL after STOP_TIMEOUT s): one started an instant ago may
    # still be bash's fork, which drops a trapped signal that arrives before its exec (seen: the lighthouse left
    # running and the script waiting on it)
    if [ -n "$LIGHTHOUSE_PID" ]; then
        deadline=$((SECONDS + STOP_TIMEOUT))
        while kill -0 "$LIGHTHOUSE_PID" 2> /dev/null && [ "$SECONDS" -lt "$deadline" ]; do
            kill -TERM "$LIGHTHOUSE_PID" 2> /dev/null || true
            sleep 0.2
        done
        kill -KILL "$LIGHTHOUSE_PID" 2> /dev/null || true
        wait "$LIGHTHOUSE_PID" 2> /dev/null || true
    fi
    PIDS=()
    LIGHTHOUSE_PID=
}
trap 'echo "tools/ft_local.sh: SIGTERM: stopping every group and the lighthouse" >&2; stop_all; exit 143' TERM
trap 'echo "tools/ft_local.sh: SIGINT: stopping every group and the lighthouse" >&2; stop_all; exit 130' INT
trap 'stop_all; exit 129' HUP
trap stop_all EXIT

# The lighthouse: the one process every group asks for the quorum of each step. A group whose heartbeat is missing
# for heartbeat_timeout_ms is out of the quorum; a quorum waits join_timeout_ms for a heartbeating group that has not
# asked yet (one that is starting, or slow).
"$BIN/torchft_lighthouse" --min_replicas "$MIN_REPLICAS" --bind "[::]:${LIGHTHOUSE_PORT}" \
    --heartbeat_timeout_ms 5000 --join_timeout_ms 10000 ${LIGHTHOUSE_ARGS:-} > "$RUN_DIR/lighthouse.log" 2>&1 &
LIGHTHOUSE_PID=$!
export TORCHFT_LIGHTHOUSE=http://localhost:${LIGHTHOUSE_PORT}
echo "lighthouse $TORCHFT_LIGHTHOUSE (pid $LIGHTHOUSE_PID); $REPLICA_GROUPS groups of $NPROC ranks; run folders $RUN_DIR/group*"

declare -A GROUP_OF
for ((G = 0; G < REPLICA_GROUPS; G++)); do
    ARGS=()
    for ARG in "$@"; do ARGS+=("${ARG//\{group\}/$G}"); done
    GPU_ENV=()
    if [ "${#GPUS[@]}" -gt 0 ]; then
        SLICE=("${GPUS[@]:$((G * NPROC)):$NPROC}")
        GPU_ENV=("CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${SLICE[*]}")")
    fi
    # each group is its own torchrun job: its own rendezvous and store (--standalone), its own process group
    env "${GPU_ENV[@]}" "$BIN/torchrun" --standalone --nproc_per_node "$NPROC" --max-restarts "$MAX_RESTARTS" \
        train.py --config "$CONFIG" --run-dir "$RUN_DIR/group$G" "${ARGS[@]}" --set \
        parallel.fault_tolerance.enable=True "parallel.fault_tolerance.replica_id=$G" \
        "parallel.fault_tolerance.group_size=$REPLICA_GROUPS" "parallel.fault_tolerance.min_replicas=$MIN_REPLICAS" \
        > "$RUN_DIR/group$G.log" 2>&1 &
    PIDS+=($!)
    GROUP_OF[$!]=$G
    echo "group $G: torchrun pid ${PIDS[-1]}${GPU_ENV:+, ${GPU_ENV[0]}}, log $RUN_DIR/group$G.log"
done

# each group as it ends: its status, and its log's last line when it failed
STATUS=0
LEFT=("${PIDS[@]}")
while [ "${#LEFT[@]}" -gt 0 ]; do
    CODE=0
    wait -n -p DONE "${LEFT[@]}" || CODE=$?
    G=${GROUP_OF[$DONE]}
    if [ "$CODE" -eq 0 ]; then
        echo "group $G: ended (status 0)"
    else
        STATUS=$CODE
        echo "group $G: FAILED (status $CODE): $(grep -v '^\s*$' "$RUN_DIR/group$G.log" | tail -n 1)" >&2
    fi
    REST=()
    for PID in "${LEFT[@]}"; do [ "$PID" = "$DONE" ] || REST+=("$PID"); done
    LEFT=("${REST[@]}")
done
PIDS=()
exit "$STATUS"
