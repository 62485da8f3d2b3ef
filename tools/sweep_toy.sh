#!/usr/bin/env bash
# All the scripts on the offline toy task, same flags, then one plot (the README's figure, or $PLOT):
#   bash tools/sweep_toy.sh [out_dir [flag ...]]
# Flags after out_dir go to every script and win over the ones below, e.g. another seed:
#   PLOT=/tmp/toy_s2.png bash tools/sweep_toy.sh /tmp/learn/s2 --seed 2
set -euo pipefail
out=${1:-runs/toy_sweep}
shift $(( $# > 0 ? 1 : 0 ))
[ -d /tmp/toy/model ] || python -m tests.toy /tmp/toy
common="--model-name-or-path /tmp/toy/model --dataset-name /tmp/toy/train.jsonl --prompt-column question
  --answer-column answer --prompt-template none --group-size 8 --prompts-per-step 16 --max-new-tokens 2
  --max-prompt-tokens 32 --learning-rate 3e-3 --micro-batch-size 128 --total-steps 150 --sampler hf
  --save-every 0 --log-samples-every 0 --warmup-steps 0 --output-dir $out"
python grpo.py $common --beta 0 "$@"
python dapo.py $common --max-gen-batches 3 --num-mini-batches 1 "$@"
python dr_grpo.py $common --num-mini-batches 1 --truncated-reward keep "$@"
python lite_ppo.py $common "$@"
python gspo.py $common "$@"
python cispo.py $common --max-gen-batches 1 --num-mini-batches 4 "$@"
python daro.py $common "$@"
python sapo.py $common --num-mini-batches 2 "$@"
python gmpo.py $common --num-mini-batches 2 "$@"
python dppo.py $common --num-mini-batches 1 "$@"
python clip_cov.py $common --num-mini-batches 2 "$@"
python m2po.py $common "$@"
python reinforce_pp.py $common "$@"
python rloo.py $common "$@"
python ppo.py $common --truncated-reward keep --critic-learning-rate 3e-3 --critic-warmup-steps 0 \
  --critic-num-mini-batches 1 "$@"
python vapo.py $common --critic-learning-rate 3e-3 --critic-num-mini-batches 1 --value-warmup-steps 1 \
  --num-mini-batches 1 "$@"
python kimi_k15.py $common --length-penalty-weight 0 "$@"  # 2-token answers: the length reward would favour EOS first
python long_cot.py $common --exceed-margin -1 --critic-learning-rate 3e-3 --critic-num-mini-batches 1 \
  --num-mini-batches 1 --ppo-epochs 1 "$@"
python l1.py $common --beta 0 "$@"
python cppo.py $common --beta 0 "$@"
python tools/plot.py "$out"/* --smooth 10 --title "toy a+b task, 150 steps, CPU" --out "${PLOT:-docs/toy_sweep.png}"
