#!/usr/bin/env bash
# The learner's GPU check (packed rows, varlen attention, liger-kernel), as one device call.
# Prepare here, from the project root (once per machine; .whl/ is git-ignored):
#   bash ../shared/gpu/wheelhouse.sh
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl liger-kernel==0.8.5
# Then one call on the GPU machine, carrying .whl:
#   source .whl/install.sh && bash tools/gpu_learner_check.sh
# It runs the GPU tier's packing and liger tests (tests/gpu/test_learner_gpu.py), then
# bench.learner_gpu on Qwen2-1.5B's shape (packed+liger, packed, padded under ZeRO 2; ZeRO 3;
# checkpointing), and leaves the logs and the bench's section under $OUT (default /tmp/out).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, liger_kernel; print('torch', torch.__version__, 'liger ok')" 2>&1 | tee -a "$out/gpu.txt"
SPOPP_GPU_TIER=1 timeout 240 python3 -m pytest -q -p no:xdist -p no:cacheprovider -rs \
    tests/gpu/test_learner_gpu.py -k "packed or liger or fp32_update" 2>&1 | tee "$out/tier.log"
timeout 300 python3 -m bench.learner_gpu --models Qwen2-1.5B --budget-s 280 --out "$out/BENCHMARKS.md" \
    2>&1 | tee "$out/bench.log"
