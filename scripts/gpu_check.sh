#!/usr/bin/env bash
# Every GPU check in one go, for a machine with CUDA: the CUDA-marked tests, reduced-precision agreement,
# the in-process ceiling and the served sweep (uint8, batching on and off). Writes results/gpu/.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (about 8 minutes on one H100)
set -uo pipefail
out=${1:-results/gpu}
mkdir -p "$out"
port=50161 metrics=8161
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true

python -m pytest -q -m cuda -p no:cacheprovider 2>&1 | tee "$out/cuda_tests.txt"
python scripts/precision_check.py --device cuda:0 --json "$out/precision.json" | tee "$out/precision.txt"
for precision in fp32 fp16 bf16; do
  resnet-server bench-model --device cuda:0 --precision $precision --batch-sizes 1,8,32,64,128 \
    --input uint8 --image-size 224x224 --duration 5 --json > "$out/ceiling_$precision.json"
done

serve() {
  resnet-server --host 127.0.0.1 --port $port --metrics-port $metrics --device cuda:0 --weights random \
    --log-level WARNING "$@" & server_pid=$!
  for _ in $(seq 240); do
    resnet-client health --server 127.0.0.1:$port --timeout 1 >/dev/null 2>&1 && return 0; sleep 0.5
  done; return 1
}
stop() { kill -TERM "$server_pid"; wait "$server_pid"; }
trap 'kill -TERM "${server_pid:-}" 2>/dev/null || true' EXIT
bench() {
  resnet-client bench --server 127.0.0.1:$port --metrics http://127.0.0.1:$metrics/metrics --input uint8 \
    --image-size 224x224 --duration 15 --warmup 3 --processes 8 --quiet --json "${@:2}" > "$out/$1.json"
}
serve --max-batch-size 64 && bench served_batched --sweep 1,16,64,256 && stop
serve --max-batch-size 1 && bench served_nobatch --concurrency 256 && stop
echo "results in $out"
