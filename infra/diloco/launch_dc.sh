#!/usr/bin/env bash
# Launch one DC of a multi-DC DiLoCo run: a whole `rl` job (inference + orchestrator + trainer)
# whose trainer syncs with the other DCs through its shardcast origin.
#
# Environment (set per machine):
#   DILOCO_SECRET   the run's shared secret, the same in every DC (required; never in a config)
#   DC_ID           this DC's cluster id, e.g. dc-eu
#   DC_BIND         address the origin binds (default 0.0.0.0: reachable by the peers)
#   DC_PORT         origin port (default 7701; open it in the firewall for the peers only)
#   DC_PEERS        the other DCs: "id=url[,url...][@fingerprint];id=...", e.g.
#                   "dc-us=https://198.51.100.20:7701@sha256:3f...;dc-ap=https://203.0.113.7:7701@sha256:9a..."
#                   (each peer's fingerprint is what `python -m prime_composer.wire.tls` printed there)
#   DC_TLS_DIR      folder with this DC's cert.pem and key.pem (`python -m prime_composer.wire.tls
#                   --out DIR`): the origin serves HTTPS; required between machines unless
#   DILOCO_PRIVATE_NETWORK=1  the links are already private (VPN): plain http:// peers allowed
#   CONFIG          the run's shared TOML (default configs/diloco-quickstart.toml)
#   OUTPUT_DIR      where this DC writes (default outputs/<DC_ID>)
# Extra arguments are passed on to `rl` (e.g. --resume, --dry-run).
set -euo pipefail
cd "$(dirname "$0")/../.."

: "${DILOCO_SECRET:?export DILOCO_SECRET=<the run's shared secret> (e.g. openssl rand -hex 32)}"
: "${DC_ID:?export DC_ID=<this DC's cluster id>}"
: "${DC_PEERS:?export DC_PEERS='id=https://host:port@sha256:...;...' (the other DCs)}"
DC_BIND="${DC_BIND:-0.0.0.0}"
DC_PORT="${DC_PORT:-7701}"
CONFIG="${CONFIG:-configs/diloco-quickstart.toml}"
OUTPUT_DIR="${OUTPUT_DIR:-outputs/${DC_ID}}"

# "a=u1,u2@fp;b=u3" -> [{cluster_id = "a", urls = ["u1", "u2"], fingerprint = "fp"}, {cluster_id = "b", urls = ["u3"]}]
peers_toml() {
  local out="" entry id urls list fp
  IFS=';' read -ra entries <<<"$1"
  for entry in "${entries[@]}"; do
    [ -z "$entry" ] && continue
    id="${entry%%=*}"; urls="${entry#*=}"; list=""; fp=""
    if [[ "$urls" == *@* ]]; then fp="${urls##*@}"; urls="${urls%@*}"; fi
    IFS=',' read -ra parts <<<"$urls"
    for u in "${parts[@]}"; do list+="${list:+, }\"$u\""; done
    out+="${out:+, }{cluster_id = \"$id\", urls = [$list]${fp:+, fingerprint = \"$fp\"}}"
  done
  echo "[$out]"
}

wire=()
if [ -n "${DC_TLS_DIR:-}" ]; then
  wire+=(--diloco.tls-cert "$DC_TLS_DIR/cert.pem" --diloco.tls-key "$DC_TLS_DIR/key.pem")
fi
if [ "${DILOCO_PRIVATE_NETWORK:-0}" = 1 ]; then
  wire+=(--diloco.private-network)
fi

exec uv run rl @ "$CONFIG" \
  --output-dir "$OUTPUT_DIR" \
  --diloco.enabled \
  --diloco.cluster-id "$DC_ID" \
  --diloco.host "$DC_BIND" \
  --diloco.port "$DC_PORT" \
  --diloco.peers "$(peers_toml "$DC_PEERS")" \
  --diloco.secret-env DILOCO_SECRET \
  "${wire[@]}" \
  "$@"
