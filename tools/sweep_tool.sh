#!/usr/bin/env bash
# The Python tool on the toy's product task (a*b, 3-digit operands; tests/toy.py build_product_task), three arms of
# grpo.py with the same flags, then the learning rise of each run and one plot (docs/tools.md "Measured on the toy"):
#   tool_demos: --tool python --gt-injection (an all-wrong group's last completion becomes the worked solution, its
#               program run by the tool and its output block the tool's)
#   demos:      --gt-injection alone (the same worked solution, its output block written by the model)
#   tool:       --tool python alone
#   bash tools/sweep_tool.sh [out_dir [flag ...]]      e.g. bash tools/sweep_tool.sh /tmp/tool/s2 --seed 2
set -euo pipefail
out=${1:-runs/toy_tool}
shift $(( $# > 0 ? 1 : 0 ))
data=${PRODUCT_DIR:-/tmp/toy_product}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # a tiny model: one thread, not an OpenMP team fighting other work
[ -f "$data/train.jsonl" ] || python -m tests.toy "$data" --product
common="--model-name-or-path $data/model --dataset-name $data/train.jsonl --prompt-column question
  --answer-column answer --prompt-template none --group-size 8 --prompts-per-step 16
  --max-new-tokens 72 --max-prompt-tokens 32 --learning-rate 3e-3 --micro-batch-size 128 --total-steps 100
  --sampler hf --beta 0 --save-every 0 --log-samples-every 10 --warmup-steps 0 --output-dir $out"
demos="--gt-injection --solution-column solution"
python grpo.py $common --exp-name tool_demos --tool python $demos "$@"
python grpo.py $common --exp-name demos $demos "$@"
python grpo.py $common --exp-name tool --tool python "$@"
python tools/learning_rise.py "$out"/*__*
python tools/plot.py "$out"/*__* --keys train/accuracy tool/call_frac data/gt_injected --smooth 5 \
  --title "toy product task (a*b, 3 digits), grpo.py, 100 steps, CPU" --out "${PLOT:-$out/tool.png}"
