#!/usr/bin/env bash
# The CPU benchmark in one go: the in-process ceiling, then the served sweep, side by side, same weights.
# Usage: scripts/bench_cpu.sh [OUT_DIR]   (default results/); about 20 minutes on 2 cores.
# BENCH_IMAGE_SIZE (WxH, default 640x480) and BENCH_DURATION (seconds per point, default 15) tune it;
# BENCH_COMPILE=1 measures torch.compile (--compile) in both the ceiling and the server, BENCH_TORCHSCRIPT=1
# the frozen TorchScript graph (--torchscript); BENCH_ROUNDS
# (default 5) alternates the ceiling (batch 1, 8, 16, 32, and JPEG decode+preprocess) with served uint8 (c=1,
# c=16) and JPEG (c=16) that many times, so the headline figures are medians of pairs measured seconds
# apart rather than one pair (this VM's speed drifts 10-40% over minutes), then scripts/benchmarks/latency_pairs.py
# interleaves c=1 and in-process batch 1 second by second, and scripts/benchmarks/throughput_pairs.py c=16 and the
# in-process forward pass at the rounds' best batch size; scripts/perf_analyzer.py runs Triton's
# perf_analyzer at c=1 and c=16 beside `resnet-client bench --input fp32`, and scripts/benchmarks/perf_analyzer_pairs.py
# interleaves it with the in-process forward pass.
# BENCH_DEVICE (default cpu) and BENCH_TORCH_THREADS (default 0: every core) set the replica layout of
# both sides, e.g. BENCH_DEVICE=cpu,cpu BENCH_TORCH_THREADS=1 for two single-thread replicas;
# BENCH_PRECISION (default fp32) the precision of both (bf16: AMX on recent Xeons, AVX-512 BF16 on AMD Zen 4).
# BENCH_SERVER_FLAGS adds server flags to every server it starts (the batching-off one's --max-batch-size 1
# still wins), e.g. BENCH_SERVER_FLAGS="--max-batch-size 16 --wait-for-callers-ms 30".
# Talks only to a server it starts on 127.0.0.1 and stops it (by PID) when done.
set -euo pipefail
# -h/--help: the comment above; any other option is a usage error (exit 2), never a folder of that name.
case ${1:-} in
  -h|--help) sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
  -*) echo "$(basename "$0"): unknown option $1 (--help says how to run it)" >&2; exit 2 ;;
esac
# The tools come from the project's install: the active environment's, else the checkout's .venv.
venv_bin="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin"
if ! command -v resnet-server >/dev/null && [ -x "$venv_bin/resnet-server" ]; then PATH="$venv_bin:$PATH"; fi
command -v resnet-server >/dev/null || {
  echo "resnet-server is not on PATH: install the project first (pip install -e '.[server,test]')" >&2; exit 1; }
out=${1:-results}
mkdir -p "$out"
echo "${BENCH_SERVER_FLAGS:-}" > "$out/server_flags.txt"  # for the table's header
duration=${BENCH_DURATION:-15}
port=${BENCH_PORT:-50151}
metrics=${BENCH_METRICS_PORT:-8151}
size=${BENCH_IMAGE_SIZE:-640x480}
rounds=${BENCH_ROUNDS:-5}
device=${BENCH_DEVICE:-cpu}
threads=${BENCH_TORCH_THREADS:-0}
precision=${BENCH_PRECISION:-fp32}
graph=()  # how the model runs, on both sides
[ "${BENCH_COMPILE:-0}" = 1 ] && graph=(--compile)
[ "${BENCH_TORCHSCRIPT:-0}" = 1 ] && graph=(--torchscript)

ceiling() {  # ceiling BATCH_SIZES INPUT
  resnet-server bench-model --weights random --batch-sizes "$1" --input "$2" --image-size $size --duration 8 \
    --device $device --torch-threads $threads --precision $precision --json "${graph[@]}"
}
ceiling 1,4,8,16,32 uint8 > "$out/ceiling_uint8.json"
# The JPEG ceiling is the best forward pass in series with decode+preprocess: the same batch sizes as uint8.
ceiling 1,4,8,16,32 jpeg > "$out/ceiling_jpeg.json"

serve() {  # serve [extra flags...]: start a server in the background, wait for SERVING
  resnet-server --host 127.0.0.1 --port $port --metrics-port $metrics --device $device \
    --torch-threads $threads --precision $precision --weights random --log-level WARNING "${graph[@]}" \
    ${BENCH_SERVER_FLAGS:-} "$@" &
  server_pid=$!
  for _ in $(seq 400); do  # --compile compiles every batch size before SERVING
    resnet-client health --server 127.0.0.1:$port --timeout 1 >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server did not become healthy" >&2; return 1
}
stop() { kill -TERM "$server_pid"; wait "$server_pid" || true; }
trap 'kill -TERM "${server_pid:-}" 2>/dev/null || true' EXIT

bench() {  # bench NAME ARGS...
  resnet-client bench --server 127.0.0.1:$port --metrics http://127.0.0.1:$metrics/metrics \
    --duration "$duration" --warmup 3 --image-size $size --quiet --json "${@:2}" > "$out/$1.json"
}

serve
bench served_uint8 --input uint8 --sweep 1,16
bench served_jpeg --input jpeg --sweep 1,16
: > "$out/rounds_ceiling.json"; : > "$out/rounds_served.json"; : > "$out/rounds_served_jpeg.json"
for round in $(seq "$rounds"); do  # the server idles while the ceiling runs
  # Forward passes and JPEG decode+preprocess. Batch 32 too: where it is the best batch, the rounds' ceiling
  # is the same as the first sweep's, not a smaller one that reads the served ratio high.
  ceiling 1,8,16,32 jpeg >> "$out/rounds_ceiling.json"
  bench "round_$round" --input uint8 --sweep 1,16 && cat "$out/round_$round.json" >> "$out/rounds_served.json"
  bench "round_$round" --input jpeg --concurrency 16 && cat "$out/round_$round.json" >> "$out/rounds_served_jpeg.json"
  rm "$out/round_$round.json"
done
# c=1 against the in-process batch-1 latency of one replica (at c=1 the others idle), interleaved window by
# window (immune to the drift above).
python3 scripts/benchmarks/latency_pairs.py --server 127.0.0.1:$port --image-size $size --device "${device%%,*}" \
  --torch-threads $threads --precision $precision "${graph[@]}" > "$out/latency_pairs.json"
# c=16 against the in-process forward pass at the rounds' best batch size (the highest median of their five
# ceilings: the first ceiling alone picked 16 or 32 on the AMD EPYC VM where every round put 8 ahead),
# interleaved the same way.
best=$(python3 scripts/bench_table.py --rounds-best-batch "$out")
python3 scripts/benchmarks/throughput_pairs.py --server 127.0.0.1:$port --image-size $size --device $device \
  --torch-threads $threads --precision $precision --batch-size "$best" "${graph[@]}" > "$out/throughput_pairs.json"
# Triton's own load generator (C++) beside ours, both sending what ModelMetadata declares: FP32.
# Then perf_analyzer interleaved with the in-process forward pass, as the pairs above.
if python3 scripts/perf_analyzer.py --server 127.0.0.1:$port --concurrency 1,16 > "$out/perf_analyzer.json"; then
  bench served_fp32 --input fp32 --sweep 1,16
  python3 scripts/benchmarks/perf_analyzer_pairs.py --server 127.0.0.1:$port --device "${device%%,*}" --torch-threads $threads \
    --precision $precision --batch-size "$best" "${graph[@]}" > "$out/perf_analyzer_pairs.json"
else
  rm -f "$out/perf_analyzer.json"; echo "perf_analyzer did not run (see scripts/perf_analyzer.py); skipped" >&2
fi
# Where the two cores go at c=16: the server's forward team, its other threads, the client (this machine's tax).
python3 scripts/benchmarks/cpu_split.py --server 127.0.0.1:$port --server-pid "$server_pid" --image-size $size \
  > "$out/cpu_split.json"
stop
serve --max-batch-size 1
bench served_uint8_nobatch --input uint8 --concurrency 16
stop

python3 scripts/bench_table.py "$out" "$size" | tee "$out/bench_cpu.md"
