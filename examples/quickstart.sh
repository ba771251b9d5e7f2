#!/usr/bin/env bash
# Start a CPN server on SQLite, register a provider's site + cluster + link, heartbeat, list.
set -euo pipefail
export CPN_DATA_DIR=${CPN_DATA_DIR:-$(mktemp -d)}
export CPN_CONFIG=$CPN_DATA_DIR/cpnctl.yaml
PORT=${CPN_PORT:-8080}
cpn serve --port "$PORT" > "$CPN_DATA_DIR/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 50); do curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break; sleep 0.2; done
TOKEN=$(cpn token create provider-a --role provider)
cpnctl config set-context local --server "http://127.0.0.1:$PORT" --token "$TOKEN"
cpnctl apply -f "$(dirname "$0")/world.yaml"
curl -fsS -X POST "http://127.0.0.1:$PORT/api/v1/clusters/fra-1-h100/heartbeat" \
  -H "Authorization: Bearer $TOKEN" -d '{"allocatableGpus": 14, "conditions": [{"type": "Ready", "status": "True"}]}' >/dev/null
cpnctl get sites
cpnctl get clusters -o wide
cpnctl get links
