"""A learned value model (critic) for the scripts that train one (ppo.py, vapo.py): a causal LM's decoder with a
scalar head, its optimizer and scheduler prepared by accelerate like the policy, its values of a rollout, its
backward and gradient norm where accelerate's own calls only know the policy, and its checkpoint.

Nothing here is specific to one algorithm: GAE, the value loss and every paper choice stay in the scripts.

    check_critic_args(args, len(tokenizer), world)          # before the run directory is written
    critic, optimizer, scheduler = load_critic(args, accelerator)  # after the policy is prepared
    values = compute_values(critic, batch, plan)           # [N, C], V(s_t) before each completion token
    critic_backward(accelerator, critic, loss, sync)       # in the micro-batch loop
    norm = critic_grad_norm(accelerator, critic, max_norm)  # once per optimizer step
    save_checkpoint(..., critic=critic)                    # common/run.py: checkpoints/step_k/critic, `save_critic`

A checkpoint's `critic/` is a Hugging Face model: the family's sequence classifier with one label (its decoder, and
the value head as `score`; LoRA adapters merged), which `--critic-model-name-or-path` loads back and
`AutoModelForSequenceClassification.from_pretrained` reads (values: `score` on the decoder's hidden states); for a
family transformers has no such class for, the decoder (`AutoModel`) and `value_head.safetensors`. Resuming uses
accelerate's state, which holds the critic next to the policy. No function here reads a tensor value on the host.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from common.args import SharedArgs
from common.kernels import packs


@dataclass
class CriticArgs(SharedArgs):
    """The shared flags and the critic's (ppo.py, vapo.py inherit it). The critic's defaults are Open-Reasoner-Zero's
    (arXiv 2503.24290 §3.1 and its code), ppo.py's; each script overrides those its paper changes."""

    # The critic (common/critic.py)
    critic_model_name_or_path: str | None = None
    """the critic's checkpoint, a causal LM whose decoder gets a scalar head (None: the policy's)"""
    critic_learning_rate: float = 5e-6
    """the critic's AdamW learning rate"""
    critic_warmup_steps: int = 50
    """the critic's linear learning-rate warm-up, in its optimizer steps; constant afterwards"""
    critic_weight_decay: float = 0.0
    """the critic's AdamW weight decay"""
    critic_max_grad_norm: float = 1.0
    """the critic's gradient clipping"""
    critic_num_mini_batches: int = 12
    """the critic's optimizer steps per rollout and epoch"""


class TokenValues(nn.Module):
    """A causal LM's decoder and a bias-free linear head to one scalar: the value of the state before each
    completion token, V(s_t) for the token chosen at s_t, read from the hidden state of the position before it, the
    alignment of the log-probs (`TokenLogProbs`) and of verl's critic (values[:, -response_length - 1 : -1]).

    The head starts at zero (`V = 0` everywhere): deterministic on every rank, and no random value bias that GAE
    would accumulate (VC-PPO's "value initialisation bias"); its gradient is the hidden state, so it moves at the first
    step and the decoder follows (OpenRLHF and Open-Reasoner-Zero draw it from N(0, 1 / (H + 1)) instead, verl from
    the model's initializer_range). The head is computed in the head's dtype with autocast off, so that values keep
    fp32 precision under bf16 autocast. Wrapped as a module (like TokenLogProbs) so DDP, FSDP2 and ZeRO-3 hooks
    see every parameter it uses."""

    def __init__(self, decoder: nn.Module, hidden_size: int, padding_free: bool = False):
        super().__init__()
        self.backbone = decoder
        self.padding_free = padding_free
        dtype = next(decoder.parameters()).dtype
        self.value_head = nn.Linear(hidden_size, 1, bias=False, dtype=dtype)
        nn.init.zeros_(self.value_head.weight)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, completion_start: int) -> Tensor:
        """input_ids / attention_mask: [B, L], prompts left-padded to `completion_start` columns, then right-padded
        completions. Returns [B, L - completion_start] values (fp32, fp64 for an fp64 model): entry t is the value of
        the state that token `completion_start + t` was sampled in. padding_free: the rows packed into one sequence
        as `TokenLogProbs(padding_free=True)` does (on CUDA only with a varlen attention, common.kernels.packs); the
        same values on completion tokens, 0 on padding."""
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if self.padding_free and packs(self.backbone, input_ids.device):
            keep = attention_mask.bool()
            hidden = self.backbone(
                input_ids=input_ids[keep][None], position_ids=position_ids[keep][None], use_cache=False
            ).last_hidden_state[0]
            place = keep.flatten().cumsum(0).view(keep.shape) - 1  # each kept token's index in the packed sequence
            scored = keep[:, completion_start:]  # completion tokens, each valued from the kept token before it
            values = self.head(hidden[place[:, completion_start - 1 : -1][scored]])
            return torch.zeros(scored.shape, dtype=values.dtype, device=values.device).masked_scatter(scored, values)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.head(hidden[:, completion_start - 1 : -1])

    def head(self, hidden: Tensor) -> Tensor:
        """The scalar head on hidden states [..., H], in the head's dtype with autocast off: values [...]."""
        with torch.autocast(hidden.device.type, enabled=False):
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        return values.to(torch.promote_types(values.dtype, torch.float32))


VALUE_HEAD_FILE = "value_head.safetensors"  # the head of a critic saved without a sequence-classifier class


def build_critic(path: str, args: CriticArgs) -> TokenValues:
    """The critic of the checkpoint at `path`, fp32 like the policy: a causal LM's decoder (its output layer dropped)
    with a zero head, or a critic this module saved (`save_critic`: a sequence classifier with one label, or a decoder
    and VALUE_HEAD_FILE) with its head. With --lora-rank the decoder gets adapters of its own
    (common.models.add_lora: same rank, alpha, targets) and only those and the head train: LoRA is there to save
    memory, which a fully trained critic would spend again. --gradient-checkpointing applies to it too, and so do
    --padding-free, --liger-kernel and --torch-compile (common.models.speed_paths, as for the policy)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    from common.models import add_lora, speed_paths

    head = None
    try:
        arch = (AutoConfig.from_pretrained(path).architectures or [""])[0]
        if arch.endswith("ForSequenceClassification"):  # a saved critic (or a reward model) with its head
            classifier = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
            if classifier.config.num_labels != 1 or getattr(classifier.score, "bias", None) is not None:
                raise SystemExit(f"--critic-model-name-or-path: {path!r} is not a one-label classifier without bias")
            lm, head = classifier, classifier.score.weight.detach()
        elif os.path.exists(os.path.join(path, VALUE_HEAD_FILE)):
            from safetensors.torch import load_file

            lm = AutoModel.from_pretrained(path, dtype=torch.float32)
            head = load_file(os.path.join(path, VALUE_HEAD_FILE))["weight"]
        else:
            lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001
        first = (str(e).splitlines() or [""])[0]
        raise SystemExit(f"--critic-model-name-or-path: cannot load {path!r}: {type(e).__name__}: {first}") from None
    lm.config.use_cache = False
    if args.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    speed_paths(args, lm)
    if args.lora_rank > 0:
        lm = add_lora(lm, args)
    config = getattr(lm.config, "text_config", None) or lm.config
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm
    critic = TokenValues(decoder, config.hidden_size, padding_free=args.padding_free)
    if head is not None:
        with torch.no_grad():
            critic.value_head.weight.copy_(head)
    return critic


def save_critic(accelerator, critic, path: str) -> None:
    """Writes the prepared `critic` to `path` as a Hugging Face model (the module docstring says which). Every rank
    calls it (gathering sharded weights is collective); the main process writes."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, MODEL_MAPPING

    from common.sampling import iter_weight_buckets

    weights = accelerator.get_state_dict(critic)  # full weights on the main process under FSDP / ZeRO-3
    if not accelerator.is_main_process:
        return
    values = accelerator.unwrap_model(critic)
    decoder = {k.removeprefix("backbone."): v for k, v in weights.items() if k.startswith("backbone.")}
    if any(".lora_" in k for k in decoder):  # LoRA (one process or DDP): the decoder with its adapters merged
        decoder = {name: t for bucket in iter_weight_buckets(values.backbone) for name, t in bucket}
    config = copy.deepcopy(values.backbone.config)
    config.use_cache = True
    classifier = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING.get(type(config), None)
    # the files written directly, no model built: under ZeRO-3 building or saving one is a collective call that the
    # other ranks, already returned, would never join
    if classifier is None:
        config.architectures = [MODEL_MAPPING[type(config)].__name__]
        state = decoder
    else:
        config.num_labels, config.id2label, config.label2id = 1, {0: "value"}, {"value": 0}
        config.architectures = [classifier.__name__]
        state = {f"{classifier.base_model_prefix}.{k}": v for k, v in decoder.items()}
        state["score.weight"] = weights["value_head.weight"]
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    save_torch_state_dict({k: v.contiguous() for k, v in state.items()}, path)
    if classifier is None:
        save_file({"weight": weights["value_head.weight"].contiguous()}, os.path.join(path, VALUE_HEAD_FILE))


def load_critic(args: CriticArgs, accelerator):
    """The critic (`build_critic` of --critic-model-name-or-path, else the policy's checkpoint), AdamW at
    --critic-learning-rate with --critic-weight-decay over its trainable parameters and a linear warm-up of
    --critic-warmup-steps optimizer steps then constant (the policy's defaults, common/models.py), all prepared by
    accelerate after the policy: DDP, FSDP2 or DeepSpeed as launched. DeepSpeed clips each engine with its config's
    gradient_clipping, read when the engine is built: --critic-max-grad-norm is set for the critic's."""
    from accelerate.utils import DistributedType

    from common.models import adamw, warmup_then_constant

    critic = build_critic(args.critic_model_name_or_path or args.model_name_or_path, args)
    trainable = [p for p in critic.parameters() if p.requires_grad]
    optimizer = adamw(trainable, args.critic_learning_rate, args.critic_weight_decay)
    scheduler = warmup_then_constant(optimizer, args.critic_warmup_steps)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.state.deepspeed_plugin.deepspeed_config.update(gradient_clipping=args.critic_max_grad_norm)
    return accelerator.prepare(critic, optimizer, scheduler)


def check_critic_args(args: CriticArgs, vocab: int, world: int) -> None:
    """Refuses bad critic flags before anything is written: --critic-num-mini-batches outside [1, rows per rank], a
    critic checkpoint that is not there or cannot read the policy's `vocab` token ids."""
    per_rank = args.prompts_per_step // world * args.group_size
    if not 1 <= args.critic_num_mini_batches <= per_rank:
        raise SystemExit(f"--critic-num-mini-batches must be in [1, {per_rank}] (rows per rank)")
    if args.critic_learning_rate < 0 or args.critic_warmup_steps < 0 or args.critic_max_grad_norm <= 0:
        raise SystemExit("--critic-learning-rate and --critic-warmup-steps must be >= 0, --critic-max-grad-norm > 0")
    if args.critic_model_name_or_path:
        check_critic_path(args.critic_model_name_or_path, vocab)


def check_critic_path(path: str, vocab: int) -> None:
    """Refuses a critic checkpoint that is not there or cannot read the policy's tokens, before anything is
    written: its embedding must have a row for each of the tokenizer's `vocab` ids."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        first = (str(e).splitlines() or [""])[0]
        raise SystemExit(f"--critic-model-name-or-path: cannot load {path!r}: {type(e).__name__}: {first}") from None
    size = getattr(getattr(config, "text_config", None) or config, "vocab_size", None)
    if size is not None and size < vocab:
        raise SystemExit(
            f"--critic-model-name-or-path: {path!r} has {size} token embeddings, the policy's tokenizer {vocab} "
            "ids: the critic must read the policy's tokens"
        )


def compute_values(critic, batch: dict, plan: list[tuple[list[int], int, int]]) -> Tensor:
    """V(s_t) [N, C] of a whole rollout `batch` under `critic`, without gradient, one micro-batch of `plan`
    (common.batching.micro_batches) at a time (zeros past each micro-batch's width): once per rollout, like the old
    log-probs, so every update of the step clips against the same values."""
    from common.batching import micro_batch

    values = torch.zeros(batch["mask"].shape, device=batch["ids"].device)
    for rows, p_w, c_w in plan:
        mb = micro_batch(batch, rows, p_w, c_w)
        values[mb["rows"], :c_w] = critic(mb["ids"], mb["attn"], p_w).to(values.dtype)
    return values


def _deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return getattr(accelerator, "distributed_type", None) == DistributedType.DEEPSPEED


def critic_backward(accelerator, critic, loss: Tensor, sync: bool) -> None:
    """`accelerator.backward(loss)` for the critic. Under DeepSpeed accelerate sends every backward to the first
    engine it prepared (the policy's), so the critic's engine runs its own: backward with the accumulation boundary
    at `sync` (the mini-batch's last micro-batch), then its step (clip, optimizer, zero_grad), as accelerate's
    DeepSpeedEngineWrapper does for the policy."""
    if _deepspeed(accelerator):
        critic.set_gradient_accumulation_boundary(is_boundary=sync)
        critic.backward(loss)
        if sync:
            critic.step()
    else:
        accelerator.backward(loss)


def critic_grad_norm(accelerator, critic, max_norm: float) -> Tensor | float | None:
    """The critic's gradient norm before clipping, and clipped to `max_norm` (accelerate's clip_grad_norm_ finds
    the critic's FSDP2 module by its parameters); under DeepSpeed the critic engine's own norm, clipped by its step."""
    if _deepspeed(accelerator):
        return critic.get_global_grad_norm()
    return accelerator.clip_grad_norm_(critic.parameters(), max_norm)


# token-position buckets of the advantage statistics: [0, 16), [16, 64), [64, 256), [256, 1024), [1024, 4096), 4096+
POSITION_BUCKETS = (0, 16, 64, 256, 1024, 4096)


def value_metrics(values: Tensor, returns: Tensor, advantages: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """What a researcher watches in a critic, over every rank's completion tokens (one all-reduce): the explained
    variance 1 - Var(R - V) / (Var(R) + 1e-5) of the rollout's values V against their targets R (1: V predicts R,
    0: no better than their mean, < 0: worse), the token means of V and R, and the mean and std of the advantages
    the policy trains on, per bucket of token positions (POSITION_BUCKETS; NaN where no rank has a token there).
    [N, C] inputs; 0-d tensors out, equal on every rank (step_metrics logs them as train/<key>)."""
    from common.batching import global_sum

    m = mask.to(torch.float64)
    v, r, a = values.double() * m, returns.double() * m, advantages.double() * m
    pos = torch.arange(mask.shape[1], device=mask.device)
    edges = [*POSITION_BUCKETS, float("inf")]
    buckets = [((pos >= lo) & (pos < hi)).to(m.dtype) for lo, hi in zip(edges, edges[1:])]
    sums = [m.sum(), v.sum(), r.sum(), (r * r).sum(), (r - v).sum(), ((r - v) ** 2).sum()]
    for b in buckets:
        sums += [(m * b).sum(), (a * b).sum(), (a * a * b).sum()]
    s = global_sum(torch.stack(sums))
    n = s[0].clamp(min=1)
    var_r = s[3] / n - (s[2] / n) ** 2
    var_err = s[5] / n - (s[4] / n) ** 2
    out = {
        "explained_variance": 1 - var_err / (var_r + 1e-5),  # verl's metric_utils, its 1e-5 included
        "value_mean": s[1] / n,
        "return_mean": s[2] / n,
    }
    for i, lo in enumerate(POSITION_BUCKETS):
        count, total, squares = s[6 + 3 * i], s[7 + 3 * i], s[8 + 3 * i]
        mean = total / count
        out[f"adv_mean_pos{lo}"] = mean
        out[f"adv_std_pos{lo}"] = (squares / count - mean**2).clamp(min=0).sqrt()
    return {k: v.float() for k, v in out.items()}
