#!/usr/bin/env bash
# One call on the GPU machine (run from the repo root): Triton kernel tests, `deepinfer bench gpu`,
# then the model-level CUDA tests, each under its own time cap, logs and figures under $OUT.
#   STAGES=kernels,bench,model  BENCH_ARGS="..."  MODEL_K="pytest -k expression"  KERNEL_TESTS="files"  bash tests/bench/gpu_device_run.sh
# STAGES=bench_fp8: the same bench with FP8 weights (--quantization fp8), figures in bench_fp8.json
# (FP8_ARGS, default "--parts slice --skip-engine"; FP8_CAP seconds, default 240).
# STAGES=spec: `deepinfer bench spec` (DSpark on the trained tiny V4.1) on the GPU, SPEC_ARGS
# (default "--repeats 3 --bounded"), SPEC_CAP seconds (default 300), figures in spec.json.
# Wheels for a device call: `bash tests/bench/device_wheels.sh` here, then carry `.whl`.
# STAGES=eplb_steps: `deepinfer bench eplb --traces steps` on the machine's CPUs (a 2-rank gloo group,
# step times around re-placements; the quiet cores of a lent machine, EPLB_CAP seconds, default 300);
# the per-step records of both ranks go to $OUT/eplb_records.json (this script's OUT).
# The bench stage profiles the batch-64 prefill too (--profile-prefill: profile_prefill_b64.txt).
# The device tool brings back only a few files of a call: write to an OUT outside the tool's
# folder and set PACK (e.g. PACK=$OUT/all.tgz with OUT=/tmp/w) to get everything as one archive.
# Carry .whl (transformers 5.23, README of the device tool) when the image's transformers is older.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  # installed once per machine: two invocations in parallel (say eplb_steps on some cores and a GPU
  # stage on the others) must not both install into one target; run `STAGES=none` first for that
  SITE=${SITE:-/tmp/site}
  if [[ ! -f "$SITE/.wheels-installed" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      && touch "$SITE/.wheels-installed" || exit 1
  fi
  export PYTHONPATH=$SITE
fi
# the repository root is the package `deepinfer`: import it through a link named so
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/deepinfer && export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} > "$OUT/env.txt" 2>&1
STAGES=${STAGES:-kernels,bench,model}
status=0
if [[ ",$STAGES," == *",kernels,"* ]]; then
  KERNEL_TESTS=${KERNEL_TESTS:-tests/kernels/test_gpu_norm.py tests/kernels/test_gpu_mhc.py tests/kernels/test_gpu_attention.py \
    tests/kernels/test_gpu_indexer.py tests/kernels/test_gpu_moe.py tests/kernels/test_gpu_routing.py tests/kernels/test_gpu_sampling.py \
    tests/kernels/test_gpu_fp8.py tests/kernels/test_gpu_moe_fp8.py tests/kernels/test_gpu_compressor.py}
  # shellcheck disable=SC2086  # a list of files
  timeout "${KERNEL_CAP:-150}" python3 -m pytest -q --maxfail=8 $KERNEL_TESTS 2>&1 | tee "$OUT/kernel_tests.log" | tail -25 || status=1
fi
if [[ ",$STAGES," == *",bench,"* ]]; then
  timeout "${BENCH_CAP:-270}" python3 tests/bench/package_loader.py gpu --kernels --json "$OUT/bench.json" \
    --profile-dir "$OUT" --profile-prefill ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60 || status=1
fi
if [[ ",$STAGES," == *",bench_fp8,"* ]]; then
  # shellcheck disable=SC2086  # arguments
  timeout "${FP8_CAP:-240}" python3 tests/bench/package_loader.py gpu --quantization fp8 --json "$OUT/bench_fp8.json" \
    ${FP8_ARGS:---parts slice --skip-engine} 2>&1 | tee "$OUT/bench_fp8.log" | tail -40 || status=1
fi
if [[ ",$STAGES," == *",model,"* ]]; then
  # warnings logged live: a forward that could not be captured as a CUDA graph says so here
  timeout "${MODEL_CAP:-200}" python3 -m pytest -q --maxfail=8 -m gpu -o log_cli=true --log-cli-level=WARNING \
    ${MODEL_K:+-k "$MODEL_K"} tests/kernels/test_gpu_model.py tests/engine/test_v4_device.py \
    tests/engine/test_v4_cuda_parity.py tests/engine/test_cuda_graphs.py tests/engine/v41/test_v41_compact_context.py \
    tests/engine/v41/test_v41_dspark_graphs.py tests/engine/test_fp8_serving.py 2>&1 | tee "$OUT/model_tests.log" | tail -25 || status=1
fi
if [[ ",$STAGES," == *",spec,"* ]]; then
  # shellcheck disable=SC2086  # arguments
  timeout "${SPEC_CAP:-300}" python3 tests/bench/package_loader.py spec ${SPEC_ARGS:---repeats 3 --bounded} \
    --json "$OUT/spec.json" 2>&1 | tee "$OUT/spec.log" | tail -40 || status=1
fi
if [[ ",$STAGES," == *",eplb_steps,"* ]]; then
  timeout "${EPLB_CAP:-300}" python3 tests/bench/package_loader.py eplb --traces steps --steps-records "$OUT/eplb_records.json" \
    ${EPLB_ARGS:-} --json "$OUT/eplb_steps.json" \
    2>&1 | tee "$OUT/eplb_steps.log" | tail -30 || status=1
fi
if [[ -n "${PACK:-}" ]]; then
  tar czf "$PACK" -C "$OUT" . || status=1
fi
exit $status
