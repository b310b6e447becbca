#!/usr/bin/env bash
# Tessera launcher: sets up the project's virtual environment when needed, then starts training with the
# launcher the chosen strategy needs (python for one process, torchrun, or deepspeed).
# SIGTERM or Ctrl-C (to this script's pid: it becomes the launcher) stops every rank after the same step with a
# checkpoint, and the launch exits 0; the ranks never outlive the launcher, even when it is SIGKILLed.
#
#   ./launch.sh                               # train the embedded default (tiny model, embedded data, ddp)
#   ./launch.sh test [pytest args]            # run the test suite (what .ci/run calls)
#   ./launch.sh strategy=single train.max_steps=50
#   ./launch.sh model=hf model.name_or_path=/models/my-llama data=text data.path=/data/corpus.txt
#   sbatch -N 2 launch.sh strategy=fsdp       # SLURM: one task per node, each starts its node's ranks
#
# Environment: NPROC_PER_NODE (default: the local GPUs, or 2 processes on a CPU-only machine), NNODES (1; MIN:MAX
# for an elastic job, see docs/fault-tolerance.md), NODE_RANK (0), MASTER_ADDR, MASTER_PORT, RDZV_ID (elastic),
# HOSTFILE (deepspeed), TESSERA_NO_SLURM (inside a SLURM job: this node alone), TESSERA_ROOT (the checkout, when
# SLURM runs a copy of this script), TESSERA_VENV (default ./.venv),
# TESSERA_PYTHON (the interpreter that creates the venv, default python3), TESSERA_TORCH (the torch
# requirement installed first, default torch==2.13.0).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -f "$ROOT/pyproject.toml" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  # sbatch runs a copy of this script from slurmd's spool: the repository is the folder of the submitted script
  # (the job's Command), else the submission directory; TESSERA_ROOT overrides both.
  ROOT="${TESSERA_ROOT:-}"
  if [ -z "$ROOT" ]; then
    script="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'Command=[^ ]*' | head -1 | cut -d= -f2-)" || true
    case "$script" in /*) ;; ?*) script="${SLURM_SUBMIT_DIR:-.}/$script" ;; esac
    ROOT="$(cd "$(dirname "${script:-/nonexistent/x}")" 2>/dev/null && pwd)" || ROOT=""
    [ -f "$ROOT/pyproject.toml" ] || ROOT="${SLURM_SUBMIT_DIR:-}"
  fi
  if [ ! -f "$ROOT/pyproject.toml" ] || [ ! -f "$ROOT/launch.sh" ]; then
    echo "launch.sh: error: cannot find the Tessera repository of SLURM job $SLURM_JOB_ID (looked in '${ROOT}'):" \
      "submit the checkout's launch.sh (sbatch -N 2 /path/to/tessera/launch.sh ...) or set TESSERA_ROOT" >&2
    exit 2
  fi
fi
VENV="${TESSERA_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.tessera-installed"

ensure_env() {
  local want
  want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
  if [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    return
  fi
  echo "launch.sh: setting up the environment in $VENV ..." >&2
  if [ ! -x "$PY" ]; then
    "${TESSERA_PYTHON:-python3}" -m venv "$VENV"
  fi
  # torch first, from an exact requirement: the project's torch range then installs nothing more, where a
  # bare `torch` would pull a multi-GB CUDA build on a CPU machine.
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "${TESSERA_TORCH:-torch==2.13.0}"
  fi
  "$PY" -m pip install -q -e "$ROOT[dev]"
  # DeepSpeed's C++ ops that a ZeRO run on this machine loads (on a CPU machine its shared-memory comm op:
  # minutes of compilation), built now with progress rather than silently at the first ZeRO run.
  (cd "$ROOT" && "$PY" -m trainer.ds_ops build) ||
    echo "launch.sh: warning: DeepSpeed's ops did not build now; a ZeRO run builds them at first use" >&2
  echo "$want" >"$STAMP"
}

ensure_env

if [ "${1:-}" = "test" ]; then
  shift
  cd "$ROOT"
  # Most tests wait on launches (process start-up, rendezvous, timeouts), so two pytest workers fill two cores;
  # each test file stays on one worker (its module fixtures run once). -n 0 (or TESSERA_TEST_WORKERS=0) runs serially.
  workers=(-n "${TESSERA_TEST_WORKERS:-2}" --dist loadfile)
  for arg in "$@"; do
    case "$arg" in -n|-n*|--numprocesses*) workers=() ;; esac
  done
  # The project's bytecode, written once: every launch of the suite imports these modules, and where Python writes
  # none itself (PYTHONDONTWRITEBYTECODE) each process would compile them again (0.4 s of CPU per rank).
  "$PY" -m compileall -q trainer models tessera tests >/dev/null || true
  exec "$PY" -m pytest "${workers[@]}" "$@"
fi

cd "$ROOT"
export PATH="$VENV/bin:$PATH"
# One launch time for every process this launch starts (on every node of a SLURM job): they all agree on the run
# directory.
export TESSERA_LAUNCH_TIME="${TESSERA_LAUNCH_TIME:-$(date +%s.%N)}"

# A checkpoint.resume=auto override unless the command line has its own checkpoint.resume.
resume_auto() {
  for arg in "$@"; do [[ "$arg" == checkpoint.resume=* ]] && return; done
  echo "checkpoint.resume=auto"
}

# Inside a SLURM allocation (docs/running.md): the batch script (or an salloc shell) starts launch.sh once per node
# with srun; each node's task takes the node count, its node rank, the master's address and an agreed port from
# SLURM (trainer/launch/slurm.py). TESSERA_NO_SLURM=1 runs on this node alone. A requeued job continues its run.
if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${TESSERA_NO_SLURM:-}" ] && [ "${1:-}" != plan ]; then
  if [ -z "${SLURM_STEP_ID:-}" ]; then
    srun_cmd="$("$PY" -m trainer.launch.slurm step)" || exit 2
    read -r -a srun_cmd <<<"$srun_cmd"
    exec "${srun_cmd[@]}" "$ROOT/launch.sh" "$@"
  fi
  node="$("$PY" -m trainer.launch.slurm node)" || exit 2
  eval "export $node"
  if [ "${SLURM_RESTART_COUNT:-0}" != 0 ]; then
    set -- "$@" $(resume_auto "$@")
  fi
fi

if [ -z "${NPROC_PER_NODE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NPROC_PER_NODE="$(nvidia-smi -L | wc -l)"
  else
    NPROC_PER_NODE=2
  fi
fi
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"

if [ "${1:-}" = "plan" ]; then  # preflight: memory and checks for NPROC_PER_NODE x NNODES ranks
  shift
  NPROC_PER_NODE="$NPROC_PER_NODE" NNODES="$NNODES" exec "$PY" -m trainer.plan "$@"
fi

# The launcher the strategy needs and train.max_restarts: a launch that fails on a fault (a rank killed or lost, a
# stalled rank) is started again that many times and continues from the newest complete checkpoint.
read -r launcher restarts <<<"$("$PY" -m trainer.launch.choose "$@")"
export TESSERA_MAX_RESTARTS="$restarts"
case "$launcher" in
  python)
    if [ "$restarts" = 0 ]; then
      exec "$PY" trainer/main.py "$@"
    fi
    # One process with restarts: a small supervisor starts it again after a fault (trainer/launch/single.py).
    exec "$PY" -m trainer.launch.single trainer/main.py "$@"
    ;;
  torchrun)
    if [ "$NNODES" = 1 ] && [ -z "${MASTER_PORT:-}" ]; then
      exec "$PY" -m trainer.torchrun --standalone --nproc_per_node "$NPROC_PER_NODE" trainer/main.py "$@"
    fi
    if [[ "$NNODES" == *:* ]]; then
      # Elastic membership (NNODES=MIN:MAX): torchrun's agents re-form the job when a node leaves or joins, so
      # its own restarts do the work; every node runs this same line (MASTER_ADDR:MASTER_PORT is the rendezvous).
      # A node that joins later continues the job's run: checkpoint.resume=auto unless the command line says.
      export TESSERA_MAX_RESTARTS=0
      exec "$PY" -m trainer.torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
        --max-restarts "$restarts" --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}" \
        --rdzv-id "${RDZV_ID:-tessera}" trainer/main.py "$@" $(resume_auto "$@")
    fi
    exec "$PY" -m trainer.torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
      --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" trainer/main.py "$@"
    ;;
  torchft)
    # Fault-tolerant replica groups on this machine: a torchft lighthouse and one torchrun job per group, each
    # with its own restarts (a failed group recovers from a live one while the others train on).
    exec "$PY" -m trainer.launch.torchft --nproc_per_node "$NPROC_PER_NODE" trainer/main.py "$@"
    ;;
  deepspeed)
    args=(--num_gpus "$NPROC_PER_NODE" --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}")
    if [ -n "${HOSTFILE:-}" ]; then
      args=(--hostfile "$HOSTFILE" --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}")
    elif [ "$NNODES" != 1 ]; then
      args+=(--num_nodes "$NNODES" --node_rank "$NODE_RANK" --no_ssh)
    fi
    # DeepSpeed's runner through Tessera's wrapper: SIGTERM/Ctrl-C reach the ranks (which save and stop), a stale
    # build lock is an error instead of a silent hang, a first-use op build says so.
    exec "$PY" -m trainer.launch.deepspeed "${args[@]}" trainer/main.py "$@"
    ;;
  *)
    echo "launch.sh: unknown launcher '$launcher'" >&2
    exit 2
    ;;
esac
