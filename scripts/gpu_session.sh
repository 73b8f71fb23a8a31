#!/usr/bin/env bash
# A GPU session's checks and measurements, for the device tool (few, full calls): each argument is a part, run in
# order, its log and JSON written under $OUT. The GPU image has no websockets: a wheel carried in .whl/ is
# installed into a temporary folder first.
#   bash scripts/gpu_session.sh tests                      # the GPU tests of kernels, engine, pipeline, storage
#   bash scripts/gpu_session.sh bench:step,e2e,backlog matmul  # bench sections (one engine), skinny vs cuBLAS
#   bash scripts/gpu_session.sh bench:maxrate bench:accuracy
set -uo pipefail
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import websockets" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --target /tmp/wheels .whl/*.whl && export PYTHONPATH=/tmp/wheels${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv >> "$OUT/gpu.txt"
bench() {  # bench.py sections into one JSON, merged run after run
  python3 -m scripts.bench --json "$OUT/bench.json" --merge --log-dir "$OUT" "$@" 2>&1 | tail -40
}
for part in "$@"; do
  echo "== $part $(date +%T)"
  case $part in
    tests)
      python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernels.py tests/test_outer_product_update.py \
        tests/test_mlstm_step.py tests/test_retention_step.py tests/test_slstm_step.py tests/test_slstm_output.py \
        tests/test_causal_conv_update_ragged.py tests/test_rglru_ragged.py tests/test_mamba2_ragged.py \
        tests/test_slstm_input_ragged.py tests/test_mlstm_input_ragged.py tests/test_skinny_matmul.py \
        tests/test_fast_engine.py tests/test_pipeline.py tests/test_state_storage.py tests/test_state_table.py \
        tests/test_add_rms_norm.py tests/test_precision.py tests/test_cuda_streams.py 2>&1 | tee "$OUT/tests.log" | tail -30 ;;
    bench:*) bench --sections "${part#bench:}" ;;
    matmul) python3 -m scripts.bench_matmul --json "$OUT/matmul.json" 2>&1 | tail -40 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
