#!/usr/bin/env bash
# Launch one DC of a multi-DC DiLoCo run: a whole `rl` job (inference + orchestrator + trainer)
# whose trainer syncs with the other DCs through its shardcast origin.
#
# Environment (set per machine):
#   DILOCO_SECRET   the run's shared secret, the same in every DC (required; never in a config)
#   DC_ID           this DC's cluster id, e.g. dc-eu
#   DC_BIND         address the origin binds (default 0.0.0.0: reachable by the peers)
#   DC_PORT         origin port (default 7701; open it in the firewall for the peers only)
#   DC_PEERS        the other DCs: "id=url[,url...];id=url", e.g.
#                   "dc-us=http://198.51.100.20:7701;dc-ap=http://203.0.113.7:7701,http://relay:7701"
#   CONFIG          the run's shared TOML (default configs/diloco-quickstart.toml)
#   OUTPUT_DIR      where this DC writes (default outputs/<DC_ID>)
# Extra arguments are passed on to `rl` (e.g. --resume, --dry-run).
set -euo pipefail
cd "$(dirname "$0")/../.."

: "${DILOCO_SECRET:?export DILOCO_SECRET=<the run's shared secret> (e.g. openssl rand -hex 32)}"
: "${DC_ID:?export DC_ID=<this DC's cluster id>}"
: "${DC_PEERS:?export DC_PEERS='id=http://host:port;...' (the other DCs)}"
DC_BIND="${DC_BIND:-0.0.0.0}"
DC_PORT="${DC_PORT:-7701}"
CONFIG="${CONFIG:-configs/diloco-quickstart.toml}"
OUTPUT_DIR="${OUTPUT_DIR:-outputs/${DC_ID}}"

# "a=u1,u2;b=u3" -> [{cluster_id = "a", urls = ["u1", "u2"]}, {cluster_id = "b", urls = ["u3"]}]
peers_toml() {
  local out="" entry id urls list
  IFS=';' read -ra entries <<<"$1"
  for entry in "${entries[@]}"; do
    [ -z "$entry" ] && continue
    id="${entry%%=*}"; urls="${entry#*=}"; list=""
    IFS=',' read -ra parts <<<"$urls"
    for u in "${parts[@]}"; do list+="${list:+, }\"$u\""; done
    out+="${out:+, }{cluster_id = \"$id\", urls = [$list]}"
  done
  echo "[$out]"
}

exec uv run rl @ "$CONFIG" \
  --output-dir "$OUTPUT_DIR" \
  --diloco.enabled \
  --diloco.cluster-id "$DC_ID" \
  --diloco.host "$DC_BIND" \
  --diloco.port "$DC_PORT" \
  --diloco.peers "$(peers_toml "$DC_PEERS")" \
  --diloco.secret-env DILOCO_SECRET \
  "$@"
