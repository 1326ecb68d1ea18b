#!/usr/bin/env bash
# Every GPU check, for a machine with CUDA, in three parts that each fit in a 10-minute slot:
#   checks    the CUDA-marked tests, reduced-precision agreement, GPU JPEG decode agreement
#   ceilings  the in-process forward ceiling: eager per precision (fp16 also with batch norms unfolded);
#             fp16 compiled, plain and as CUDA graphs; fp32 and fp16 as TorchScript
#   served    the served sweeps (one engine process, --frontends auto unless named): uint8 fp32 and fp16, batching
#             off, one front-end, sixteen images a call, the forward pass as CUDA graphs; JPEG decoded on the GPU
#             vs the CPU; and the front-end's own cost with a free model against bare grpc.aio
# Writes OUT_DIR (default results/gpu), ending with gpu_table.md (scripts/gpu_table.py, from whatever OUT_DIR
# holds, so parts run in separate calls can be tabled together): the README's GPU table and the device
# issue's targets. A step whose JSON is already in OUT_DIR is skipped, so a run cut short resumes where it stopped.
# Usage: scripts/gpu_check.sh [OUT_DIR [PART...]]   (all three parts by default; about 12 minutes on one H100)
set -uo pipefail
out=${1:-results/gpu}
parts=("${@:2}")
[ ${#parts[@]} -eq 0 ] && parts=(checks ceilings served)
for part in "${parts[@]}"; do
  case $part in checks|ceilings|served) ;; *) echo "unknown part $part (checks, ceilings or served)" >&2; exit 2 ;; esac
done
mkdir -p "$out"
port=50161 metrics=8161
fp32_batch=64 fp16_batch=128  # the served batch caps; gpu_table.py compares each with the in-process forward at it
# GPU_CHECK_DEVICE=cpu GPU_CHECK_DURATION=2 runs the served part's steps on the CPU, to try the script itself.
device=${GPU_CHECK_DEVICE:-cuda:0} duration=${GPU_CHECK_DURATION:-15}
[ "$device" = cpu ] || python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
# The GPU box may lack this project and some of its dependencies (the generated code needs grpcio >= 1.85.1
# and protobuf >= 7.35.1; health checking and reflection are not there at all): wheels carried to it in
# .whl/gpu go into a folder of their own, ahead of its own packages; the project runs from the checkout.
if [ -d .whl/gpu ]; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/gpu/*.whl 2>&1 | tail -3
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
frontends=$(python -c 'from server.config import ServerConfig; from server.supervisor import frontend_count
print(frontend_count(ServerConfig(), 1))')  # what --frontends auto starts here, with one device
# The server as a command, not a function: started in the background it is then the process stop signals.
server=(resnet-server); type -P resnet-server >/dev/null || server=(python -m server)
command -v resnet-client >/dev/null || resnet-client() { python -c 'import sys; from client.cli import main; sys.exit(main())' "$@"; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true

serve() {  # serve NAME FRONTENDS [FLAGS...]: a server on $device, its log in OUT_DIR/NAME.server.log
  local log="$out/$1.server.log" count=$2
  port=$((port + 20)) metrics=$((metrics + 20))  # fresh ports (children take metrics+1...): a stray server blocks none
  "${server[@]}" --host 127.0.0.1 --port $port --metrics-port $metrics --device "$device" --weights random \
    --frontends "$count" "${@:3}" 2> "$log" & server_pid=$!
  for _ in $(seq 240); do  # every front-end SERVING (one health call reaches only one of them)
    local serving; serving=$(grep -c 'serving resnet18' "$log" 2>/dev/null)
    [ "${serving:-0}" -ge "$count" ] && return 0
    kill -0 "$server_pid" 2>/dev/null || { tail -3 "$log"; return 1; }
    sleep 0.5
  done; return 1
}
stop() { kill -TERM "$server_pid"; wait "$server_pid"; }

trap 'kill -TERM "${server_pid:-}" 2>/dev/null || true' EXIT
owed() {  # owed NAME...: true when a bench named is still to run (its JSON missing or empty), so a rerun resumes;
  # GPU_CHECK_SKIP="NAME ..." leaves those steps for a later call (a lease too short for every step)
  for name; do [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]] && continue; [ -s "$out/$name.json" ] || return 0; done
  return 1
}
bench() {  # bench NAME [ARGS...]; uint8 224x224 unless ARGS say otherwise; skipped when its JSON is there
  owed "$1" || return 0
  resnet-client bench --server 127.0.0.1:$port --metrics "http://127.0.0.1:$metrics/metrics" --input uint8 \
    --image-size 224x224 --duration "$duration" --warmup 3 --processes 8 --quiet --json "${@:2}" > "$out/$1.json"
}
checks() {
  # Only the modules with CUDA tests: the others import test-only packages the GPU box may not have.
  python -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py tests/test_raw_batch.py tests/test_device_decode.py \
    tests/test_replicas.py 2>&1 | tee "$out/cuda_tests.txt"
  python scripts/precision_check.py --device cuda:0 --json "$out/precision.json" | tee "$out/precision.txt"
  python scripts/decode_check.py --device cuda:0 --json "$out/decode.json" | tee "$out/decode.txt"
}
ceilings() {
  for precision in fp32 fp16 bf16; do
    "${server[@]}" bench-model --device cuda:0 --precision $precision --batch-sizes 1,8,32,64,128 \
      --input uint8 --image-size 224x224 --duration 5 --json > "$out/ceiling_$precision.json"
  done
  # What folding batch norms into the convolutions saves: the same eager fp16 model with them left in.
  "${server[@]}" bench-model --device cuda:0 --precision fp16 --fold-batch-norms false --batch-sizes 1,8,32,128 \
    --input uint8 --image-size 224x224 --duration 5 --json > "$out/ceiling_fp16_unfolded.json"
  for mode in default reduce-overhead; do  # the compiled graphs, launched kernel by kernel or replayed as CUDA graphs
    "${server[@]}" bench-model --device cuda:0 --precision fp16 --compile --compile-mode $mode --batch-sizes 1,8,64,128 \
      --input uint8 --image-size 224x224 --duration 5 --json > "$out/ceiling_fp16_compiled_$mode.json"
  done
  for precision in fp32 fp16; do  # the whole forward pass in C++: one GIL round trip a batch
    "${server[@]}" bench-model --device cuda:0 --precision $precision --torchscript --batch-sizes 1,8,64,128 \
      --input uint8 --image-size 224x224 --duration 5 --json > "$out/ceiling_${precision}_torchscript.json"
  done
}
served() {
  # Each server is stopped whatever its benches did (a bench with errors exits non-zero but keeps its JSON).
  if owed served_batched served_16_per_request && serve batched $frontends --max-batch-size $fp32_batch; then
    bench served_batched --sweep 1,16,64,256 --connections 4
    bench served_16_per_request --concurrency 16 --images-per-request 16  # 256 images: the queue's default cap
    stop
  fi
  if owed served_fp16 && serve fp16 $frontends --max-batch-size $fp16_batch --precision fp16; then
    bench served_fp16 --sweep 16,64,256 --connections 4; stop
  fi
  if owed served_fp16_cuda_graphs && serve graphs $frontends --max-batch-size $fp16_batch --precision fp16 --compile \
      --compile-mode reduce-overhead; then
    bench served_fp16_cuda_graphs --sweep 16,64,256 --connections 4; stop
  fi
  if owed served_one_frontend && serve one_frontend 1 --max-batch-size $fp32_batch; then
    bench served_one_frontend --concurrency 256; stop
  fi
  if owed served_nobatch && serve nobatch $frontends --max-batch-size 1; then
    bench served_nobatch --concurrency 256 --connections 4; stop
  fi
  for where in true false; do
    if owed served_jpeg_decode_on_device_$where && serve jpeg_$where $frontends --max-batch-size $fp32_batch \
        --decode-on-device $where; then
      bench served_jpeg_decode_on_device_$where --input jpeg --image-size 640x480 --concurrency 256 --connections 4; stop
    fi
  done
  if owed frontend_cost; then python scripts/frontend_cost.py --processes 8 --duration 6 --json > "$out/frontend_cost.json"; fi
}
for part in "${parts[@]}"; do $part; done
python scripts/gpu_table.py "$out" $fp32_batch $fp16_batch | tee "$out/gpu_table.md"  # the README's GPU table and targets
echo "results in $out"
