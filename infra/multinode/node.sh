#!/usr/bin/env bash
# This node's `rl` in infra/multinode/slurm.sbatch (run by srun once per node; SLURM_NODEID says
# which node this is). Needs CONFIG, OUTPUT_DIR, NODES (host names, trainer nodes first),
# NUM_TRAIN_NODES, NUM_INFER_NODES, RANKS_PER_NODE, RDZV_PORT, INFERENCE_PORT.
set -euo pipefail
read -r -a hosts <<< "$NODES"
node="${SLURM_NODEID:?run under srun}"
if [ "$((NUM_TRAIN_NODES + NUM_INFER_NODES))" -ne "${#hosts[@]}" ]; then
  echo "node.sh: NUM_TRAIN_NODES + NUM_INFER_NODES = $((NUM_TRAIN_NODES + NUM_INFER_NODES)) but the allocation has ${#hosts[@]} nodes" >&2
  exit 2
fi
head="$(getent ahostsv4 "${hosts[0]}" | awk 'NR == 1 { print $1 }')"
args=(@ "$CONFIG" --output-dir "$OUTPUT_DIR" --launch.progress false)
if [ "$NUM_INFER_NODES" -gt 0 ]; then
  urls=""
  for host in "${hosts[@]:$NUM_TRAIN_NODES}"; do
    urls="$urls\"http://$(getent ahostsv4 "$host" | awk 'NR == 1 { print $1 }'):$INFERENCE_PORT/v1\","
  done
  args+=(--inference.secret-env INFERENCE_SECRET)
fi
if [ "$node" -lt "$NUM_TRAIN_NODES" ]; then
  args+=(--launch.nodes "$NUM_TRAIN_NODES" --launch.node-rank "$node"
         --trainer.num-ranks "$((RANKS_PER_NODE * NUM_TRAIN_NODES))")
  if [ "$NUM_TRAIN_NODES" -gt 1 ]; then
    args+=(--launch.rdzv-endpoint "$head:$RDZV_PORT" --launch.private-network true)
  fi
  if [ "$NUM_INFER_NODES" -gt 0 ]; then
    # plain HTTP to the inference nodes: the cluster network is private (as for the rendezvous)
    args+=(--launch.remote-inference true --orchestrator.base-url "[${urls%,}]"
           --orchestrator.inference-private-network true)
  fi
else  # an inference node: one server for the orchestrator on trainer node 0
  args+=(--launch.processes '["inference"]' --inference.host 0.0.0.0 --inference.port "$INFERENCE_PORT"
         --inference.private-network true)
fi
exec uv run rl "${args[@]}" "$@"
