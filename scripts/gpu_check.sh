#!/usr/bin/env bash
# Every GPU check, for a machine with CUDA, in six parts, most wanted first:
#   first     what fits one short call on a lent machine (under 8 minutes on an H100): the CUDA-marked tests, the
#             default runner's fp16 ceiling, and its server at c=256 as unary calls, stream messages, sixteen
#             images a call, and perf_analyzer both ways (where carried); then, budget permitting, the CUDA test
#             compiled with max-autotune (marked autotune: its compiling takes minutes)
#   runner    what chooses the default GPU runner: the fp16 ceiling of today's (CUDA graphs over the eager model)
#             against inductor's (compiled, replayed as CUDA graphs), and compile_start (run after first in one call)
#   checks    the CUDA-marked tests (max-autotune's too), reduced-precision agreement, GPU JPEG decode agreement
#             (they gate code changed since the last lent GPU, and take a minute or two)
#   served    the served sweeps (one engine process, --frontends auto unless named): uint8 fp32 and fp16, sixteen
#             images a call, the fp16 ceilings (eager and --cuda-graphs) and fp16 --cuda-graphs served (unary calls,
#             stream messages, perf_analyzer both ways), the fp32 ceiling, twelve front-ends (eager and
#             --cuda-graphs), TorchScript, batching off; JPEG decoded on the
#             GPU vs the CPU; the front-end's own cost with a free model against bare grpc.aio, one engine's own
#             ceiling; one front-end
#   compile_start  time to SERVING with --compile (fp16, inductor's CUDA graphs) and --compile-cache, the cache
#             empty and then filled by the first start (compile_start.json; the ready lines in the servers' logs)
#   ceilings  the in-process forward ceiling: first the three the served targets are set against (fp32, fp16, fp16
#             as CUDA graphs), then bf16, fp16 with batch norms unfolded, fp16 compiled (plain, replayed as
#             inductor's CUDA graphs, and max-autotune), fp32 as inductor's CUDA graphs, fp32 and fp16 TorchScript
# Writes OUT_DIR (default results/gpu), ending with gpu_table.md (scripts/gpu_table.py, from whatever OUT_DIR
# holds, so parts run in separate calls can be tabled together): the README's GPU table and the device
# issue's targets. A step whose output is already in OUT_DIR is skipped, so a run cut short resumes where it
# stopped. GPU_CHECK_BUDGET_S=N starts no step after N seconds (then tables what it has): a lent machine's one
# call can then end on time, and the next call on the same machine resumes.
# Usage: scripts/gpu_check.sh [OUT_DIR [PART...]]   (by default first, checks, served, compile_start and ceilings,
#        which hold runner's steps too; about 20 minutes on one H200)
set -uo pipefail
# -h/--help: the comment above; any other option is a usage error (exit 2), never a folder of that name.
case ${1:-} in
  -h|--help) sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
  -*) echo "$(basename "$0"): unknown option $1 (--help says how to run it)" >&2; exit 2 ;;
esac
out=${1:-results/gpu}
parts=("${@:2}")
[ ${#parts[@]} -eq 0 ] && parts=(first checks served compile_start ceilings)  # runner: in these
for part in "${parts[@]}"; do
  case $part in first|runner|checks|ceilings|served|compile_start) ;;
    *) echo "unknown part $part (first, runner, checks, ceilings, served or compile_start)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
port=50161 metrics=8161
fp32_batch=64 fp16_batch=128  # the served batch caps; gpu_table.py compares each with the in-process forward at it
# GPU_CHECK_DEVICE=cpu GPU_CHECK_DURATION=2 runs the served part's steps on the CPU, to try the script itself.
device=${GPU_CHECK_DEVICE:-cuda:0} duration=${GPU_CHECK_DURATION:-15}
[ "$device" = cpu ] || python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
# The GPU box may lack this project and some of its dependencies (the generated code needs grpcio >= 1.85.1
# and protobuf >= 7.35.1; health checking and reflection are not there at all): wheels carried to it in
# .whl/gpu (python scripts/gpu_carry.py fills it) go into a folder of their own, ahead of its own packages; the
# project runs from the checkout.
if [ -d .whl/gpu ]; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/gpu/*.whl 2>&1 | tail -3
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"  # py-spy's, if carried
fi
# Triton's perf_analyzer, if carried: the binary in .whl/gpu/bin, the libraries it links in .whl/gpu/lib.
[ -x .whl/gpu/bin/perf_analyzer ] && export PATH="$PWD/.whl/gpu/bin:$PATH"
# The checkout's server/ and client/ hold the packages resnet_server and resnet_client: on the path, they run as
# installed, with no pip install of the project on the lent machine.
trap 'kill -TERM "${server_pid:-}" 2>/dev/null' EXIT
export PYTHONPATH="$PWD/server:$PWD/client:$PWD${PYTHONPATH:+:$PYTHONPATH}"
frontends=$(python -c 'from resnet_server.common.config import ServerConfig; from resnet_server.supervisor.launcher import frontend_count
print(frontend_count(ServerConfig(), 1))') || exit 1  # what --frontends auto starts here, one device
# The server as a command, not a function: started in the background it is then the process stop signals.
server=(resnet-server); type -P resnet-server >/dev/null || server=(python -m resnet_server)
command -v resnet-client >/dev/null || resnet-client() { python -c 'import sys; from resnet_client.cli import main; sys.exit(main())' "$@"; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
lscpu > "$out/lscpu.txt" 2>&1 || true  # threads a core: whether the 16 "cores" are 8 with two threads each

serve() {  # serve NAME FRONTENDS [FLAGS...]: a server on $device, its log in OUT_DIR/NAME.server.log; false if it
  # did not serve within $serve_wait_s seconds (5 minutes unless the caller sets it), and then it is stopped
  local log="$out/$1.server.log" count=$2 wait_s=${serve_wait_s:-300}
  port=$((port + 20)) metrics=$((metrics + 20))  # fresh ports (children take metrics+1...): a stray server blocks none
  "${server[@]}" --host 127.0.0.1 --port $port --metrics-port $metrics --device "$device" --weights random \
    --frontends "$count" "${@:3}" 2> "$log" & server_pid=$!
  for _ in $(seq $((2 * wait_s))); do  # every front-end SERVING (one health call reaches only one of them)
    local serving; serving=$(grep -c 'serving resnet18' "$log" 2>/dev/null)
    [ "${serving:-0}" -ge "$count" ] && return 0
    kill -0 "$server_pid" 2>/dev/null || { tail -3 "$log"; return 1; }
    sleep 0.5
  done; echo "$1: not serving after $wait_s s" >&2; stop; return 1
}
stop() { kill -TERM "$server_pid"; wait "$server_pid"; }

owed() {  # owed NAME...: true when a step named is still to run (its NAME.json missing or empty), so a rerun
  # resumes; false once GPU_CHECK_BUDGET_S has passed. GPU_CHECK_SKIP="NAME ..." leaves those steps for later.
  [ "$SECONDS" -lt "${GPU_CHECK_BUDGET_S:-86400}" ] || return 1
  for name; do [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]] && continue; [ -s "$out/$name.json" ] || return 0; done
  return 1
}
profile_engine() {  # profile_engine NAME SECONDS: with py-spy at hand, which engine threads hold the GIL for 5 s,
  # SECONDS from now (the engine is the server's one serial part: the bound once the front-ends are many enough)
  command -v py-spy >/dev/null || return 0
  local engine; engine=$(grep -oP 'started resnet-engine-\S+ \(pid \K\d+' "$out/$1.server.log" | tail -1)
  (sleep "$2"; py-spy record --gil --nonblocking -d 5 -r 200 -f raw -p "$engine" -o "$out/$1.engine_gil.txt") \
    >/dev/null 2>&1 &
  # Beside it, every thread's stack whether it runs or waits: where the batcher thread's time goes (a wait for
  # the GIL shows as the call that gave it up).
  (sleep "$2"; py-spy record --idle --threads --nonblocking -d 5 -r 100 -f raw -p "$engine" \
    -o "$out/$1.engine_wall.txt") >/dev/null 2>&1 &
  # And where one front-end's CPU goes, native frames (gRPC's C core, protobuf) included: about 0.6 ms a call on
  # the H100, seven of them ~78% busy at c=256. --native stops the process at each sample, so 50 a second only.
  local frontend; frontend=$(grep -oP 'started resnet-frontend-0 \(pid \K\d+' "$out/$1.server.log" | tail -1)
  (sleep "$2"; py-spy record --native -d 5 -r 50 -f raw -p "$frontend" -o "$out/$1.frontend_native.txt") \
    >/dev/null 2>&1 &
}
bench() {  # bench NAME [ARGS...]; uint8 224x224 unless ARGS say otherwise; skipped when its JSON is there
  owed "$1" || return 0
  resnet-client bench --server 127.0.0.1:$port --metrics "http://127.0.0.1:$metrics/metrics" --input uint8 \
    --image-size 224x224 --duration "$duration" --warmup 3 --processes 8 --quiet --json "${@:2}" > "$out/$1.json"
}
cuda_tests() {  # cuda_tests [NAME MARKERS]: the CUDA tests but max-autotune's (its compiling takes minutes), or
  # those MARKERS select, as step NAME
  local name=${1:-cuda_tests} markers=${2:-"cuda and not autotune"}
  owed "$name" || return 0
  # Only the modules with CUDA tests: the others import test-only packages the GPU box may not have.
  python -m pytest -q -m "$markers" -p no:cacheprovider tests/test_cuda.py tests/test_raw_batch.py \
    tests/test_device_decode.py tests/test_slab.py tests/test_replicas.py 2>&1 \
    | tee "$out/$name.txt"
  echo '{}' > "$out/$name.json"  # done: a rerun skips them
}
autotune_tests() { cuda_tests cuda_autotune_tests "cuda and autotune"; }
checks() {
  cuda_tests
  autotune_tests
  [ "$device" = cpu ] && return 0
  owed precision && python scripts/benchmarks/precision_check.py --device cuda:0 --json "$out/precision.json" \
    | tee "$out/precision.txt"
  owed decode && python scripts/benchmarks/decode_check.py --device cuda:0 --json "$out/decode.json" \
    | tee "$out/decode.txt"
}
perf_analyzer_both_ways() {  # Triton's C++ client, where carried: ModelInfer calls and ModelStreamInfer messages
  command -v perf_analyzer >/dev/null || return 0
  local mode
  for mode in "" _streaming; do
    owed served_fp16_cuda_graphs_perf_analyzer$mode || continue
    LD_LIBRARY_PATH="$PWD/.whl/gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" python scripts/perf_analyzer.py \
      --server 127.0.0.1:$port --concurrency 256 --input uint8 --window-ms 3000 ${mode:+--streaming} \
      > "$out/served_fp16_cuda_graphs_perf_analyzer$mode.json"
  done
}
first() {
  cuda_tests
  [ "$device" != cpu ] && model_bench ceiling_fp16_cuda_graphs 1,8,32,64,128 --precision fp16 --cuda-graphs
  local steps=(served_fp16_cuda_graphs served_fp16_cuda_graphs_stream served_fp16_cuda_graphs_16_per_request
               served_fp16_cuda_graphs_perf_analyzer served_fp16_cuda_graphs_perf_analyzer_streaming)
  if owed "${steps[@]}" && serve graphs $frontends --max-batch-size $fp16_batch --precision fp16 --cuda-graphs; then
    bench served_fp16_cuda_graphs --sweep 16,64,256 --connections 4
    bench served_fp16_cuda_graphs_stream --concurrency 256 --connections 4 --stream
    bench served_fp16_cuda_graphs_16_per_request --concurrency 16 --images-per-request 16 --connections 4
    perf_analyzer_both_ways
    stop
  fi
  autotune_tests  # last: what the budget leaves (GPU_CHECK_BUDGET_S), else the next call's checks
}
runner() {  # the two ceilings and the start-up that choose the default GPU runner (each also in another part)
  if [ "$device" != cpu ]; then
    model_bench ceiling_fp16_cuda_graphs 1,8,32,64,128 --precision fp16 --cuda-graphs
    model_bench ceiling_fp16_compiled_reduce-overhead 1,8,64,128 --precision fp16 --compile \
      --compile-mode reduce-overhead
  fi
  compile_start
}
compile_start() {  # seconds from the server's start to SERVING, compiling cold and then from the cache it filled
  owed compile_start || return 0
  # Compiling eight batch sizes cold, each recorded as a CUDA graph, may take longer than serve's usual wait.
  local cache="$out/compile-cache" times=() sizes=$fp16_batch serve_wait_s=900
  [ "$device" = cpu ] && sizes=2  # the CPU try: two graphs, not sixteen
  rm -rf "$cache"
  for run in cold warm; do
    local started; started=$(date +%s.%N)
    serve "compile_$run" 1 --max-batch-size $sizes --precision fp16 --compile --compile-mode reduce-overhead \
      --compile-cache "$cache" || return 0
    times+=("$(python -c "import time; print(round(time.time() - $started, 1))")")
    stop
  done
  printf '{"cold_s": %s, "warm_s": %s, "max_batch_size": %s}\n' "${times[0]}" "${times[1]}" $sizes \
    > "$out/compile_start.json"
}
model_bench() {  # model_bench NAME BATCH_SIZES [bench-model FLAGS...]: the forward ceiling, unless already measured
  owed "$1" || return 0
  "${server[@]}" bench-model --device cuda:0 --batch-sizes "$2" --input uint8 --image-size 224x224 --duration 5 \
    --json "${@:3}" > "$out/$1.json"
}
ceilings() {
  # The three the served targets are measured against, at the served batch caps (and batch 1), first.
  model_bench ceiling_fp32 1,8,32,64,128 --precision fp32
  model_bench ceiling_fp16 1,8,32,64,128 --precision fp16
  model_bench ceiling_fp16_cuda_graphs 1,8,32,64,128 --precision fp16 --cuda-graphs
  model_bench ceiling_bf16 1,8,32,64,128 --precision bf16
  # What folding batch norms into the convolutions saves: the same eager fp16 model with them left in.
  model_bench ceiling_fp16_unfolded 1,8,32,128 --precision fp16 --fold-batch-norms false
  for mode in default reduce-overhead max-autotune; do  # compiled: kernel by kernel, or replayed as CUDA graphs
    model_bench ceiling_fp16_compiled_$mode 1,8,64,128 --precision fp16 --compile --compile-mode $mode
  done
  model_bench ceiling_fp32_compiled_reduce-overhead 1,8,64,128 --precision fp32 --compile --compile-mode reduce-overhead
  for precision in fp32 fp16; do  # the whole forward pass in C++: one GIL round trip a batch
    model_bench "ceiling_${precision}_torchscript" 1,8,64,128 --precision $precision --torchscript
  done
}
served() {
  # Each server is stopped whatever its benches did (a bench with errors exits non-zero but keeps its JSON).
  # The steps not named *_cuda_graphs run eager (--cuda-graphs false), as their in-process ceilings and the rows
  # measured before CUDA graphs became the default did; the *_cuda_graphs steps run the default.
  if owed served_batched served_16_per_request && serve batched $frontends --max-batch-size $fp32_batch \
      --cuda-graphs false; then
    bench served_batched --sweep 1,16,64,256 --connections 4
    bench served_16_per_request --concurrency 16 --images-per-request 16  # 256 images: the queue's default cap
    stop
  fi
  if owed served_fp16 served_fp16_connections16 &&
      serve fp16 $frontends --max-batch-size $fp16_batch --precision fp16 --cuda-graphs false; then
    bench served_fp16 --sweep 16,64,256 --connections 4
    # Front-ends get connections by SO_REUSEPORT's hash: 32 connections may load one front-end well above the
    # mean. Four times as many even it out; each process's counts go to fp16.metrics.txt (label worker).
    if owed served_fp16_connections16; then  # a resumed run that has it neither profiles nor scrapes again
      profile_engine fp16 5  # 5 s from now: past the client's start and warm-up, inside its measured window
      bench served_fp16_connections16 --concurrency 256 --connections 16
      python -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
        "http://127.0.0.1:$metrics/metrics" > "$out/fp16.metrics.txt" 2>&1
    fi
    stop
  fi
  # The ceilings the targets are set against, in this run (the ceilings part may not fit a call).
  if [ "$device" != cpu ]; then
    model_bench ceiling_fp16 1,8,32,64,128 --precision fp16
    model_bench ceiling_fp16_cuda_graphs 1,8,32,64,128 --precision fp16 --cuda-graphs
  fi
  # A batch as one CUDA graph replay: a few calls from Python where eager makes about 64, each a GIL round trip
  # that the engine's batcher thread waited a third of its time to win back (H100, 2026-11-27).
  local graphs_steps=(served_fp16_cuda_graphs served_fp16_cuda_graphs_stream served_fp16_cuda_graphs_perf_analyzer
                      served_fp16_cuda_graphs_perf_analyzer_streaming served_fp16_cuda_graphs_connections16)
  if owed "${graphs_steps[@]}" && serve graphs $frontends --max-batch-size $fp16_batch --precision fp16 \
      --cuda-graphs; then
    bench served_fp16_cuda_graphs --sweep 16,64,256 --connections 4
    # The same load as messages on ClassifyStream calls: half the CPU a request of unary calls on the VM, for
    # the front-ends as for the client, which share this box's cores.
    bench served_fp16_cuda_graphs_stream --concurrency 256 --connections 4 --stream
    # Triton's C++ client sending the same 150 KB uint8 images (model resnet18_uint8).
    perf_analyzer_both_ways
    if owed served_fp16_cuda_graphs_connections16; then  # profiled, as served_fp16_connections16 is
      profile_engine graphs 5
      bench served_fp16_cuda_graphs_connections16 --concurrency 256 --connections 16
    fi
    stop
  fi
  [ "$device" != cpu ] && model_bench ceiling_fp32 1,8,32,64,128 --precision fp32
  # Seven front-ends (auto, half the cores after the engine: the client shares the box) ran about 78% busy each
  # at 9k calls/s on the H100 (0.6 ms of CPU a call): twelve say whether less queueing in them serves more.
  if owed served_fp16_frontends12 && serve fp16_frontends12 12 --max-batch-size $fp16_batch --precision fp16 \
      --cuda-graphs false; then
    bench served_fp16_frontends12 --concurrency 256 --connections 16; stop
  fi
  # Both: with the engine's thread relieved, whether the front-ends' queueing is what is left.
  if owed served_fp16_cuda_graphs_frontends12 && serve graphs_frontends12 12 --max-batch-size $fp16_batch \
      --precision fp16 --cuda-graphs; then
    bench served_fp16_cuda_graphs_frontends12 --concurrency 256 --connections 16; stop
  fi
  # The network and softmax as one TorchScript call: one GIL round trip where eager takes about 50, which the
  # engine's batcher thread waits a third of its time to win back (H100, 2026-11-27).
  if owed served_fp16_torchscript && serve torchscript $frontends --max-batch-size $fp16_batch --precision fp16 \
      --torchscript; then
    bench served_fp16_torchscript --concurrency 256 --connections 4; stop
  fi
  if owed served_nobatch && serve nobatch $frontends --max-batch-size 1 --cuda-graphs false; then
    bench served_nobatch --concurrency 256 --connections 4; stop
  fi
  for where in true false; do
    if owed served_jpeg_decode_on_device_$where && serve jpeg_$where $frontends --max-batch-size $fp32_batch \
        --decode-on-device $where; then
      bench served_jpeg_decode_on_device_$where --input jpeg --image-size 640x480 --concurrency 256 --connections 4; stop
    fi
  done
  if owed frontend_cost; then python scripts/benchmarks/frontend_cost.py --processes 8 --duration 6 --json > "$out/frontend_cost.json"; fi
  if owed engine_ceiling; then  # what one engine process passes on, whatever the device computes
    python scripts/benchmarks/engine_ceiling.py --feeders 4 --in-flight 96 --compute-ms 5 --duration 6 --json \
      > "$out/engine_ceiling.json"
  fi
  if owed served_one_frontend && serve one_frontend 1 --max-batch-size $fp32_batch --cuda-graphs false; then
    bench served_one_frontend --concurrency 256; stop
  fi
}
for part in "${parts[@]}"; do $part; done
python scripts/gpu_table.py "$out" $fp32_batch $fp16_batch | tee "$out/gpu_table.md"  # the README's GPU table and targets
echo "results in $out"
