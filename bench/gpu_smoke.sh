#!/usr/bin/env bash
# GPU smoke: the paths that have only ever run on CPU, run once on one GPU (H100/H200), in <= 8 min.
#
#   bash bench/gpu_smoke.sh            # on a GPU machine (uv sync --locked --extra vllm first)
#   bash bench/gpu_smoke.sh --dry-run  # anywhere: resolve every config, build the 0.6B config on
#                                      # the meta device, print the plan; runs nothing
#
# Parts (bench/gpu_smoke.py has one subcommand each; each prints one summary line):
#   quickstart  rl @ configs/quickstart.toml, 20 RL steps, bfloat16, trainer and hf server on cuda
#   vllm_rl     6 RL steps with inference.backend = "vllm" on the GPU, weights loaded every step
#   trainer     1-GPU FSDP2 step of a Qwen3-0.6B-sized model (Qwen3Config, random weights) on 8,192
#               packed tokens: tokens/s of forward + backward + AdamW, peak memory
#   infer_hf    tokens/s of the embedded hf server (Qwen3-0.6B decoder, 64 requests x 128 tokens)
#   infer_vllm  the same burst served by vLLM
# A part that fails prints the tail of its log and `failed`; the next part runs anyway. The last
# line is `gpu_smoke: quickstart_s=... vllm_rl_s=... trainer_tok_s=... hf_tok_s=... vllm_tok_s=...`;
# the exit code is non-zero if any part failed. Without a CUDA device it says so in one line and
# exits 0.
#
# Environment:
#   GPU_SMOKE_BUDGET_S  seconds for all parts together, setup not counted (480); each part also has
#                       its own limit, cut to what is left
#   GPU_SMOKE_ONLY      comma-separated parts to run (e.g. infer_vllm), the others show `skipped`
#   GPU_SMOKE_OUT       where each part's log and summary.txt go (outputs/gpu_smoke)
#   GPU_SMOKE_RUNS      where the parts' run directories go (outputs/gpu_smoke/runs)
#   GPU_SMOKE_PYTHON    an interpreter that already has the dependencies (no uv, no sync: a machine
#                       without network); src/ is put on its PYTHONPATH
#   GPU_SMOKE_NO_SYNC=1 do not run uv sync
#   GPU_SMOKE_FORCE=1   run the parts even without a GPU (to test this script)
#   GPU_SMOKE_NVIDIA_SMI  the nvidia-smi to look for (nvidia-smi; the tests name a missing one)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

DRY_RUN=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_smoke: unknown argument '$arg'; use --dry-run or --help" >&2; exit 2 ;;
  esac
done

# name | own time limit (s) | metric on the last line | subcommand of bench/gpu_smoke.py
PARTS=(
  "quickstart|150|quickstart_s|quickstart"
  "vllm_rl|150|vllm_rl_s|vllm-rl"
  "trainer|80|trainer_tok_s|train"
  "infer_hf|90|hf_tok_s|serve --backend hf"
  "infer_vllm|180|vllm_tok_s|serve --backend vllm"
)
OUT_DIR=${GPU_SMOKE_OUT:-outputs/gpu_smoke}
RUNS=${GPU_SMOKE_RUNS:-outputs/gpu_smoke/runs}
BUDGET=${GPU_SMOKE_BUDGET_S:-480}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error

skip() {
  echo "gpu_smoke: skipped: no CUDA device here ($1); nothing to do"
  exit 0
}

# ------------------------------------------------------------------ is there a GPU at all?
if [[ $DRY_RUN == 0 && ${GPU_SMOKE_FORCE:-0} != 1 ]]; then
  SMI=${GPU_SMOKE_NVIDIA_SMI:-nvidia-smi}
  if [[ ${CUDA_VISIBLE_DEVICES+set} == set && ( -z $CUDA_VISIBLE_DEVICES || $CUDA_VISIBLE_DEVICES == -1 ) ]]; then
    skip "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides every GPU"
  fi
  command -v "$SMI" >/dev/null 2>&1 || skip "$SMI not found"
  "$SMI" -L 2>/dev/null | grep -q '^GPU' || skip "$SMI lists no GPU"
fi

# ------------------------------------------------------------------ the interpreter, synced
SETUP_BEGAN=$SECONDS
SYNC_NOTE=""
if [[ -n ${GPU_SMOKE_PYTHON:-} ]]; then
  PY=$GPU_SMOKE_PYTHON
  export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
  SYNC_NOTE="GPU_SMOKE_PYTHON=$PY (no sync)"
elif command -v uv >/dev/null 2>&1; then
  if [[ $DRY_RUN == 0 && ${GPU_SMOKE_NO_SYNC:-0} != 1 ]]; then
    mkdir -p "$OUT_DIR"
    if uv sync --locked --extra vllm >"$OUT_DIR/setup.log" 2>&1; then
      SYNC_NOTE="uv sync --locked --extra vllm: ok"
    else
      tail -n 15 "$OUT_DIR/setup.log" | sed 's/^/  | /'
      echo "setup: uv sync --locked --extra vllm failed (above); trying without the vllm extra"
      if uv sync --locked >>"$OUT_DIR/setup.log" 2>&1; then
        SYNC_NOTE="uv sync --locked: ok, without vllm (its parts will fail)"
      else
        tail -n 15 "$OUT_DIR/setup.log" | sed 's/^/  | /'
        echo "setup: uv sync --locked failed (above; log $OUT_DIR/setup.log)"
        echo "gpu_smoke: quickstart_s=failed vllm_rl_s=failed trainer_tok_s=failed hf_tok_s=failed vllm_tok_s=failed"
        exit 1
      fi
    fi
  else
    SYNC_NOTE="no sync"
  fi
  # The environment's own interpreter: a time limit's SIGTERM then reaches the part itself.
  PY=$(uv run --no-sync python -c 'import sys; print(sys.executable)') || {
    echo "gpu_smoke: the project environment is missing; run uv sync --locked"
    exit 1
  }
else
  echo "gpu_smoke: uv not found; install it, or set GPU_SMOKE_PYTHON to an interpreter with the project's dependencies"
  exit 2
fi

# ------------------------------------------------------------------ dry run: every plan, nothing run
if [[ $DRY_RUN == 1 ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  for spec in "${PARTS[@]}"; do  # side by side: each resolves configs in its own process
    IFS='|' read -r name _ _ command <<<"$spec"
    # shellcheck disable=SC2086  # the subcommand's words
    "$PY" bench/gpu_smoke.py $command --dry-run --runs "$RUNS" >"$tmp/$name.log" 2>&1 &
    echo $! >"$tmp/$name.pid"
  done
  failed=0
  for spec in "${PARTS[@]}"; do
    IFS='|' read -r name limit _ _ <<<"$spec"
    if wait "$(cat "$tmp/$name.pid")" && grep -q "^$name: plan " "$tmp/$name.log"; then
      echo "$(grep "^$name: plan " "$tmp/$name.log" | tail -n 1) [limit ${limit} s]"
    else
      tail -n 20 "$tmp/$name.log" | sed 's/^/  | /'
      echo "$name: failed (its dry run, above)"
      failed=1
    fi
  done
  echo "gpu_smoke: dry run ($SYNC_NOTE): ${#PARTS[@]} parts planned, nothing run; budget ${BUDGET} s"
  exit $failed
fi

# ------------------------------------------------------------------ torch must see the GPU
if [[ ${GPU_SMOKE_FORCE:-0} != 1 ]]; then
  info=$("$PY" -c '
import sys, torch
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"); sys.exit(3)
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}")
' 2>&1)
  rc=$?
  [[ $rc == 3 ]] && skip "$info"
  if [[ $rc != 0 ]]; then
    echo "$info" | tail -n 15 | sed 's/^/  | /'
    echo "gpu_smoke: torch does not import in $PY (above)"
    exit 1
  fi
else
  info="GPU_SMOKE_FORCE=1: no GPU check"
fi
echo "setup: $info; $SYNC_NOTE in $((SECONDS - SETUP_BEGAN)) s; logs in $OUT_DIR"

# ------------------------------------------------------------------ the parts, one after the other
mkdir -p "$OUT_DIR"
gpu_apps() { nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null | sort; }
command -v nvidia-smi >/dev/null 2>&1 || gpu_apps() { :; }
BASELINE_PIDS=$(gpu_apps | cut -d, -f1 | tr '\n' ' ')  # someone else's on a shared machine: not ours
new_gpu_apps() { gpu_apps | awk -F, -v old="$BASELINE_PIDS" 'BEGIN { n = split(old, a, " "); for (i = 1; i <= n; i++) seen[a[i]] = 1 } !($1 in seen)'; }
declare -A RESULT
FAILED=0
BEGAN=$SECONDS
only=",${GPU_SMOKE_ONLY:-},"
for spec in "${PARTS[@]}"; do
  IFS='|' read -r name limit key command <<<"$spec"
  if [[ $only != ",," && $only != *",$name,"* ]]; then
    RESULT[$key]=skipped
    continue
  fi
  left=$((BUDGET - (SECONDS - BEGAN)))
  ((limit > left)) && limit=$left
  if ((limit < 20)); then
    echo "$name: failed (not started: ${left} s of the ${BUDGET} s budget left)"
    RESULT[$key]=failed FAILED=1
    continue
  fi
  log="$OUT_DIR/$name.log"
  part_began=$SECONDS
  # shellcheck disable=SC2086  # the subcommand's words
  timeout --kill-after=45 "$limit" "$PY" bench/gpu_smoke.py $command --runs "$RUNS" >"$log" 2>&1
  rc=$?
  line=$(grep "^$name: ok " "$log" | tail -n 1)
  if [[ $rc == 0 && -n $line ]]; then
    echo "$line"
    RESULT[$key]=$(sed -n "s/.* $key=\([^ ]*\).*/\1/p" <<<"$line")
  else
    tail -n 25 "$log" | sed 's/^/  | /'
    case $rc in
      124 | 137) why="timed out after ${limit} s" ;;
      *) why="exit $rc after $((SECONDS - part_began)) s" ;;
    esac
    echo "$name: failed ($why; log $log)"
    RESULT[$key]=failed FAILED=1
  fi
  for _ in 1 2 3 4 5 6; do  # a part must not leave its processes on the GPU to the next one
    [[ -z $(new_gpu_apps) ]] && break
    sleep 5
  done
  apps=$(new_gpu_apps)
  [[ -n $apps ]] && echo "  warning: still on the GPU after $name (pid, name, memory): ${apps//$'\n'/; }"
done

summary="gpu_smoke:"
for spec in "${PARTS[@]}"; do
  IFS='|' read -r _ _ key _ <<<"$spec"
  summary+=" $key=${RESULT[$key]:-failed}"
done
echo "$summary" | tee "$OUT_DIR/summary.txt"
exit $FAILED
