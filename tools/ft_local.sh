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
# Give each group its own ckpt.save_ckpt_folder if they save checkpoints (one live writer per folder).
# Environment: REPLICA_GROUPS (2), NPROC (ranks per group, 2), MIN_REPLICAS (1), LIGHTHOUSE_PORT (29510), MAX_RESTARTS
# (3: restarts of a group by its torchrun agent), RUN_DIR (RUN/ft-<time>), LIGHTHOUSE_ARGS (extra lighthouse flags).

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

# The lighthouse: the one process every group asks for the quorum of each step. A group whose heartbeat is missing
# for heartbeat_timeout_ms is out of the quorum; a quorum waits join_timeout_ms for a heartbeating group that has not
# asked yet (one that is starting, or slow).
"$BIN/torchft_lighthouse" --min_replicas "$MIN_REPLICAS" --bind "[::]:${LIGHTHOUSE_PORT}" \
    --heartbeat_timeout_ms 5000 --join_timeout_ms 10000 ${LIGHTHOUSE_ARGS:-} > "$RUN_DIR/lighthouse.log" 2>&1 &
LIGHTHOUSE_PID=$!
trap 'kill $LIGHTHOUSE_PID 2>/dev/null || true' EXIT
export TORCHFT_LIGHTHOUSE=http://localhost:${LIGHTHOUSE_PORT}
echo "lighthouse $TORCHFT_LIGHTHOUSE (pid $LIGHTHOUSE_PID); $REPLICA_GROUPS groups of $NPROC ranks; run folders $RUN_DIR/group*"

PIDS=()
for ((G = 0; G < REPLICA_GROUPS; G++)); do
    # each group is its own torchrun job: its own rendezvous and store (--standalone), its own process group
    "$BIN/torchrun" --standalone --nproc_per_node "$NPROC" --max-restarts "$MAX_RESTARTS" \
        train.py --config "$CONFIG" --run-dir "$RUN_DIR/group$G" "$@" --set \
        parallel.fault_tolerance.enable=True "parallel.fault_tolerance.replica_id=$G" \
        "parallel.fault_tolerance.group_size=$REPLICA_GROUPS" "parallel.fault_tolerance.min_replicas=$MIN_REPLICAS" \
        > "$RUN_DIR/group$G.log" 2>&1 &
    PIDS+=($!)
    echo "group $G: torchrun pid ${PIDS[-1]}, log $RUN_DIR/group$G.log"
done

STATUS=0
for PID in "${PIDS[@]}"; do
    wait "$PID" || STATUS=$?
done
exit "$STATUS"
