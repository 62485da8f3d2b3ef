"""common/models.py's prepare_training: the shared optimizer and schedule by default, a script's own when it passes
them (what a paper with its own optimizer or schedule needs), prepared by accelerate either way."""

from __future__ import annotations

import pytest
import torch

import grpo
from common.models import prepare_training


def prepared(toy_assets, **kw):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    args = grpo.Args(model_name_or_path=toy_assets["model"], learning_rate=0.1, warmup_steps=3, weight_decay=0.01)
    model = AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float32)
    accelerator = Accelerator(cpu=True)
    try:
        policy, optimizer, scheduler = prepare_training(args, model, accelerator, **kw)
        lrs = []
        for _ in range(5):
            lrs.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return policy, optimizer.optimizer, lrs
    finally:
        accelerator.end_training()


def test_the_default_is_adamw_with_a_linear_warm_up_then_constant(toy_assets):
    policy, optimizer, lrs = prepared(toy_assets)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["weight_decay"] == 0.01
    assert lrs == pytest.approx([0.1 / 4, 0.2 / 4, 0.3 / 4, 0.1, 0.1])  # (s + 1) / (warmup + 1), then 1
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in policy.parameters()}


def test_a_script_passes_its_own_optimizer_and_schedule(toy_assets):
    def sgd(params, args):
        return torch.optim.SGD(params, lr=args.learning_rate, momentum=0.9)

    def halving(optimizer, args):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)

    _, optimizer, lrs = prepared(toy_assets, make_optimizer=sgd, make_scheduler=halving)
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["momentum"] == 0.9
    assert lrs == pytest.approx([0.1, 0.05, 0.025, 0.0125, 0.00625])
