#!/usr/bin/env bash
# The trainer's GPU checks in one call of about 6 minutes on one H100 or H200: bench_trainer.py at both big shapes,
# then the GPU tests of the trainer's fast paths (pytest -m gpu). Results go to $OUT (else benchmarks/results/).
#
# The borrowed GPU machines hold torch, transformers and accelerate but not TRL, Liger, tyro or datasets, and reach no
# registry: bring them as wheels. Before the call, in the repository's root, on a machine that reaches PyPI:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       trl==1.16.0 liger-kernel==0.8.5 datasets==5.2.0 tyro==1.0.17 dill multiprocess docstring-parser typeguard shtab
# Then run `bash benchmarks/gpu_trainer.sh` there with .whl carried, timeout 470 s. An H200 is the safer kind: the
# trl side's full logits peaked at 75.9 GiB at the 1.5B shape in an earlier profile, the edge of an H100's 80 GB
# (a side that runs out of memory is reported as an error row, and the others still run).
set -u
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-benchmarks/results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_machine.txt"
python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|trl|liger|flash|triton) " | tee -a "$out/gpu_machine.txt"

# 1.5B first: the targets are there (>= 1.5x TRL's tokens/s, <= 0.75x its peak memory, MFU >= 25%)
timeout 250 python3 benchmarks/bench_trainer.py --shape qwen2.5-1.5b --repeats 2 --timeout 100 --out "$out" \
    --sides ours trl trl-fused ours-liger trl-fused-liger ours-padding-free
timeout 80 python3 benchmarks/bench_trainer.py --shape qwen3-0.6b --repeats 2 --timeout 40 --out "$out" \
    --sides ours trl
set -o pipefail
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fast_paths.py tests/test_loss.py \
    tests/test_triton_logprobs.py 2>&1 | tee "$out/pytest_gpu.log" | tail -n 25
