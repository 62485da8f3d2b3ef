"""The models a script trains and compares against: the policy as loaded (`load_model`: tokenizer, fp32 weights, the
optional speed paths and LoRA adapters), the policy prepared for training with its optimizer and schedule
(`prepare_training`; a script may pass its own), and GRPO's frozen reference for a KL term (`load_reference`).
"""

from __future__ import annotations

import torch

from common.args import SharedArgs
from common.kernels import compile_decoder_layers, padding_free_attention, use_liger_kernels
from common.logprobs import TokenLogProbs
from common.setup import max_model_len


def load_model(args: SharedArgs):
    """The tokenizer (left padding, for generation; pad = EOS when it has no pad token) and the policy in fp32 (mixed
    precision comes from accelerate; with --lora-rank, wrapped in LoRA adapters: `add_lora`), or one line naming
    --model-name-or-path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        first = (str(e).splitlines() or [""])[0]
        raise SystemExit(
            f"--model-name-or-path: cannot load {args.model_name_or_path!r}: {type(e).__name__}: {first}"
        ) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    speed_paths(args, model)
    max_model_len(args, model)  # refused now, before the run directory is written
    if args.lora_rank > 0:
        model = add_lora(model, args)
    return tokenizer, model


def speed_paths(args: SharedArgs, model) -> None:
    """--padding-free's varlen attention, --liger-kernel, --torch-compile (common/kernels.py), before LoRA and
    accelerate wrap the model: how it computes, not what."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.padding_free:
        padding_free_attention(model, device)
    if args.liger_kernel:
        use_liger_kernels(model, device)
    if args.torch_compile:
        compile_decoder_layers(model)


def add_lora(model, args: SharedArgs):
    """The model with LoRA adapters (peft) of rank --lora-rank on --lora-target-modules (all-linear: every linear
    layer but the output layer, as "LoRA Without Regret" and TRL's recipe), scaled by --lora-alpha / r, with
    --lora-dropout. Only the adapters train; A is random (seeded by --seed), B = 0, so training starts at the base
    model."""
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
    )
    torch.manual_seed(args.seed)  # the adapters' initialisation
    try:
        model = get_peft_model(model, config)
    except ValueError as e:
        first = (str(e).splitlines() or [""])[0]
        raise SystemExit(f"--lora-target-modules {' '.join(targets)}: {first}") from None
    return model


def adamw(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, torch's betas and eps; on CUDA one fused kernel per step, as transformers' default (adamw_torch_fused)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=torch.cuda.is_available())


def warmup_then_constant(optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate rises linearly over `warmup_steps` optimizer steps (from 1 / (warmup_steps + 1) of its value),
    then stays constant."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup_steps + 1)))


def prepare_training(args: SharedArgs, model, accelerator, make_optimizer=None, make_scheduler=None):
    """The policy (`TokenLogProbs` around the model), its optimizer and learning-rate schedule, all prepared by
    accelerate (DDP, FSDP or DeepSpeed as launched; DeepSpeed's engine clips and steps with our values, not its
    config's). By default AdamW at --learning-rate with --weight-decay (`adamw`) and a linear warm-up of
    --warmup-steps optimizer steps, then constant (`warmup_then_constant`); a script whose paper has its own passes
    `make_optimizer(trainable parameters, args)` and / or `make_scheduler(optimizer, args)`."""
    from accelerate.utils import DistributedType

    policy = TokenLogProbs(
        model, chunk_size=args.logprob_chunk_size, kernel=args.logprob_kernel, padding_free=args.padding_free
    )
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
    if make_optimizer is None:
        optimizer = adamw(trainable, args.learning_rate, args.weight_decay)
    else:
        optimizer = make_optimizer(trainable, args)
    if make_scheduler is None:
        scheduler = warmup_then_constant(optimizer, args.warmup_steps)
    else:
        scheduler = make_scheduler(optimizer, args)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.state.deepspeed_plugin.deepspeed_config.update(
            train_micro_batch_size_per_gpu=args.micro_batch_size,
            train_batch_size=args.micro_batch_size * accelerator.num_processes,
            gradient_accumulation_steps=1,
            gradient_clipping=args.max_grad_norm,
        )
    return accelerator.prepare(policy, optimizer, scheduler)


class WithoutAdapters(torch.nn.Module):
    """The policy with its LoRA adapters switched off, i.e. the base model it started from: a KL term's reference
    without a second copy of the model (TRL's `disable_adapter()`)."""

    def __init__(self, policy: TokenLogProbs):
        super().__init__()
        self.policy = policy

    def forward(self, *inputs, **kwargs):
        with self.policy.lm.disable_adapter():
            return self.policy(*inputs, **kwargs)


def load_reference(args: SharedArgs, accelerator, policy):
    """The KL term's reference: with --lora-rank the policy without its adapters (`WithoutAdapters`), else a frozen
    copy of the policy's checkpoint as a TokenLogProbs, on the accelerator's device, or under DeepSpeed ZeRO-3 sharded
    like the policy (it was loaded partitioned) in an engine without an optimizer."""
    from accelerate.utils import DistributedType
    from transformers import AutoModelForCausalLM

    if args.lora_rank > 0:
        return WithoutAdapters(accelerator.unwrap_model(policy))

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    model = model.eval().requires_grad_(False)
    speed_paths(args, model)
    kw = dict(chunk_size=args.logprob_chunk_size, kernel=args.logprob_kernel, padding_free=args.padding_free)
    ref = TokenLogProbs(model, **kw).to(accelerator.device)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        ref = deepspeed.initialize(model=ref, config=accelerator.state.deepspeed_plugin.deepspeed_config)[0]
    return ref
