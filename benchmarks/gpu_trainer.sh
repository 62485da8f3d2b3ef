#!/usr/bin/env bash
# The trainer's GPU checks in one call of at most 9 minutes on one H100 or H200: bench_trainer.py at the 1.5B shape
# (ours-fast against TRL's own Liger paths, trl-liger and trl-liger-loss, and --padding-free, whose row says whether it
# ran packed), the GPU tests of the trainer's fast paths, the critic's and the micro-batch loop (pytest -m gpu), GAE
# at 20k tokens (bench_critic.py --gae-only: the loop against the scan), bench_trainer.py at the 0.6B shape. Results
# go to $OUT (else benchmarks/results/); the log to $OUT/gpu_trainer.log. Each stage has its own time limit, and
# bench_trainer.py rewrites its results after each side: a stage cut short keeps what it finished.
#
# The borrowed GPU machines hold torch, transformers and accelerate but not TRL, Liger, tyro or datasets, and reach no
# registry: bring them as wheels. Before the call, in the repository's root, on a machine that reaches PyPI:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       trl==1.16.0 liger-kernel==0.8.5 datasets==5.2.0 tyro==1.0.17 dill multiprocess docstring-parser typeguard \
#       shtab math-verify==0.9.0 latex2sympy2_extended antlr4-python3-runtime==4.13.2
# (.whl/ is ignored by git.) Then run `bash benchmarks/gpu_trainer.sh` there with .whl carried, timeout 540 s.
# SIDES_1_5B and SIDES_0_6B override the sides benchmarked at each shape; TESTS=0 skips the tests.
# An H200 is the safer kind: the trl side's full logits peaked at 75.9 GiB at the 1.5B shape in an earlier profile,
# the edge of an H100's 80 GB (a side that fails, or runs out of memory, is reported as an error row).
set -u
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-benchmarks/results}
mkdir -p "$out"
exec > >(tee -a "$out/gpu_trainer.log") 2>&1
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|trl|liger.kernel|flash.attn|triton|pytest) "

# 1.5B first: the targets are there (>= 1.5x TRL's tokens/s, <= 0.75x its peak memory, MFU >= 25%)
# (a side takes ~25 s: set-up, warm-up, 3 timed updates and the split's; trl-liger-loss compiles Liger's loss first)
timeout 280 python3 benchmarks/bench_trainer.py --shape qwen2.5-1.5b --repeats 3 --timeout 75 --out "$out" \
    --sides ${SIDES_1_5B:-ours trl ours-fast trl-liger trl-liger-loss ours-fast-padding-free}
if [ "${TESTS:-1}" = 1 ]; then  # the full log, failures' tracebacks included, in $out/pytest_gpu.log
    timeout 55 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_triton_logprobs.py \
        tests/test_fast_paths.py tests/test_loss.py tests/test_distributed.py >"$out/pytest_gpu.log" 2>&1
    tail -n 15 "$out/pytest_gpu.log"
fi
timeout 45 python3 benchmarks/bench_critic.py --gae-only --out "$out"
timeout 130 python3 benchmarks/bench_trainer.py --shape qwen3-0.6b --repeats 3 --timeout 35 --out "$out" \
    --sides ${SIDES_0_6B:-ours trl trl-liger ours-fast}
date -u
