"""The flags every script has, in one typed dataclass: each script's `Args` inherits `SharedArgs` and adds only its
algorithm's flags and the defaults its paper overrides. tyro shows them all flat (`python grpo.py --help`), with the
docstrings below as the help; docs/flags.md lists them (tools/flags_doc.py). The defaults are GRPO's setting
(DeepSeekMath §4.2, grpo.py); each script overrides, with its source, those its paper changes.

The "auto" modes (--sampler, --reward-format, --rollout-correction, --mixed-precision) are decided by
`common.setup.start`, which returns a resolved copy; `requested` keeps what the command line asked for, and args.json
records both.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any, Literal

# a type a script repeats when it overrides the default (dapo.py: prompt_template: PromptTemplate = "dapo")
PromptTemplate = Literal["none", "qwen-boxed", "r1", "dapo", "torl"]


@dataclass
class SharedArgs:
    # Experiment
    exp_name: str
    """the experiment's name (run directory: <output-dir>/<exp-name>__<seed>__<unix time>)"""
    seed: int = 1
    """seed of the experiment (each rank samples with seed + rank * 100003)"""
    output_dir: str = "runs"
    """where run directories are created"""
    resume: str | None = None
    """a run directory to continue from its latest checkpoint (with --total-steps 0: to evaluate)"""
    save_every: int = 100
    """save a checkpoint every this many steps (0: only at the end)"""
    keep_checkpoints: int = 2
    """how many of the latest checkpoints to keep"""
    log_samples_every: int = 10
    """write a few prompts, completions and rewards to samples.jsonl every this many steps"""
    track: bool = False
    """track the run with Weights & Biases (TensorBoard synced, the flags as config)"""
    wandb_project_name: str = "rl-for-llm"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the wandb entity (team or user; None: your default)"""

    # Model and data
    model_name_or_path: str = "Qwen/Qwen2.5-Math-1.5B"
    """Hugging Face hub id or local directory of the policy (and of a KL term's frozen reference)"""
    dataset_name: str = "DigitalLearningGmbH/MATH-lighteval"
    """hub id, a local .jsonl / .json / .parquet file, or reasoning-gym:<task>[:option=value,...]
    (a procedural task, generated offline: docs/tasks.md)"""
    dataset_config: str | None = None
    """dataset configuration name on the hub (e.g. 'en'), if it has several"""
    dataset_split: str = "train"
    """dataset split"""
    prompt_column: str = "problem"
    """column holding the question"""
    answer_column: str = "solution"
    """the reference answer (bare, or a solution whose last \\boxed{} is the answer)"""
    prompt_template: PromptTemplate = "qwen-boxed"
    """none: the question as is; qwen-boxed: Qwen2.5-Math's \\boxed{} chat prompt; r1: R1-Zero's
    <think>/<answer>; dapo: DAPO's 'Answer:' chat prompt; torl: ToRL's, with --tool python (docs/flags.md)"""
    reward_format: Literal["auto", "any", "boxed", "answer-line", "answer-line-strict", "answer-tag"] = "auto"
    """where the verifier reads the final answer (none there: 0, a format error); auto: from
    --prompt-template (docs/algorithms.md "Answer formats")"""
    max_prompt_tokens: int = 1024
    """prompts longer than this are dropped at load time (and counted)"""
    max_bad_answer_frac: float = 0.1
    """refuse a dataset with more than this fraction of unparseable answers (fewer: dropped)"""
    partial_credit: bool = False
    """reasoning-gym tasks: the reward is the task's score in [0, 1], partial credit included (default: 1
    for a score of 1, else 0); accuracy, dynamic sampling and the data strategies still count a score of 1"""

    # Sampling
    sampler: Literal["auto", "vllm", "hf"] = "auto"
    """auto: vLLM with CUDA and vllm installed, else Hugging Face generate (vllm runs on CPU too)"""
    group_size: int = 64
    """G, completions sampled per prompt"""
    prompts_per_step: int = 16
    """prompts per training step, over all ranks (so group_size * prompts_per_step completions)"""
    max_new_tokens: int = 1024
    """generation budget per completion"""
    temperature: float = 1.0
    """sampling temperature (the trainer's log-probs use it too, so they match the sampler's)"""
    top_p: float = 1.0
    """nucleus sampling"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory the vLLM engine may take (CPU: of the memory, for its KV cache)"""
    vllm_tensor_parallel_size: int = 1
    """tensor parallel size of each vLLM engine; only 1 (each rank samples its own prompts)"""
    vllm_enable_sleep_mode: bool = False
    """offload vLLM's weights and KV cache while training (CUDA only)"""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """colocate: an engine in every training process; server: tools/vllm_server.py elsewhere"""
    vllm_server_host: str = "127.0.0.1"
    """--vllm-mode server: the server's address (docs/gpu.md "A vLLM server")"""
    vllm_server_port: int = 8000
    """--vllm-mode server: the server's port"""
    vllm_server_timeout: float = 600.0
    """seconds any call to the server may take (a rollout, a weight push) before the run stops"""
    off_policy_steps: int = 0
    """K: a step trains on rollouts generated K steps before, while the sampler works ahead"""

    # Data strategies (docs/data_strategies.md): all off by default
    prompt_sampling: Literal["uniform", "curriculum", "medium", "prioritized", "hard-after-warmup"] = "uniform"
    """uniform: shuffled epochs; medium: prompts whose groups likely have a signal; curriculum:
    those, easy to hard; prioritized: by 1 - pass rate; hard-after-warmup: uniform, then only hard
    prompts (Kimi k1.5; docs/data_strategies.md)"""
    difficulty_file: str | None = None
    """tools/profile_data.py output: its per-prompt pass rates seed the tracker (the prior)"""
    gt_injection: bool = False
    """an all-wrong group's last completion is replaced by a verified demonstration"""
    solution_column: str | None = None
    """dataset column of worked solutions for --gt-injection (default: the bare reference answer)"""
    replay: bool = False
    """a group without signal is replaced by a buffered high-value group and its stored log-probs"""
    replay_buffer_size: int = 64
    """high-value groups each rank keeps for --replay (oldest dropped first)"""
    replay_max_age: int = 10
    """--replay: buffered groups generated more than this many steps ago are dropped"""
    gt_injection_max_frac: float = 1.0
    """--gt-injection: at most this share of a rank's groups per step get a demonstration"""
    tracker_half_life: float = 10.0
    """steps after which a pass-rate observation weighs half (0: never forget)"""
    uniform_floor: float = 0.5
    """curriculum/medium/prioritized/hard-after-warmup: the share of the draw probability spread
    uniformly over all prompts (ours: a solved prompt can come back)"""
    curriculum_min_target: float = 0.2
    """curriculum: the target pass rate at the end of the run (it starts at 1)"""
    hard_warmup_steps: int = 24
    """hard-after-warmup: steps drawing from the whole set first (Kimi k1.5 Fig. 9: 24 iterations)"""
    hard_pass_rate: float = 0.5
    """hard-after-warmup: a prompt is hard when its estimated pass rate is below this"""

    # Optimisation
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in optimizer steps; constant afterwards"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    total_steps: int = 500
    """training steps (one rollout each; 0: only evaluate)"""
    num_mini_batches: int = 1
    """optimizer steps per rollout and epoch (1: fully on-policy, one update per rollout)"""
    ppo_epochs: int = 1
    """passes over each rollout"""
    micro_batch_size: int = 256
    """at most this many sequences per forward/backward on each rank"""
    micro_batch_tokens: int = 8192
    """padded tokens per forward/backward on each rank, longest sequences first; the gradient is the
    same (0: --micro-batch-size rows; docs/benchmarks.md)"""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto: bf16 on CUDA, none on CPU"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    logprob_chunk_size: int = 1024
    """tokens per chunk when turning hidden states into log-probs (bounds a tokens x vocab array)"""
    logprob_kernel: Literal["auto", "torch", "triton", "triton-fused"] = "auto"
    """torch: chunked matmul + log-softmax; triton: the same matmuls with Triton's softmax and d logits (GPU);
    triton-fused: the output layer fused into a Triton forward (GPU, slower); auto: triton on CUDA when triton is
    installed and the output layer has no logit scale or soft cap, else torch"""
    padding_free: bool = False
    """pack each micro-batch's rows into one sequence without padding (flash-attn, else flex attention,
    on CUDA); --micro-batch-tokens then counts real tokens (docs/gpu.md)"""
    liger_kernel: bool = False
    """Liger-Kernel's fused RMSNorm, SwiGLU and RoPE in the model (CUDA; pip install liger-kernel)"""
    torch_compile: bool = False
    """torch.compile each decoder layer (dynamic shapes)"""
    max_bad_steps: int = 5
    """stop after this many consecutive updates skipped for a non-finite loss or gradient norm"""
    rollout_correction: Literal[
        "auto", "none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"
    ] = "auto"
    """weight exp(old_logps - sampler_logps) on the policy term, for the sampler/trainer mismatch;
    auto: token-truncate with vLLM, none with HF generate (docs/algorithms.md)"""
    rollout_correction_cap: float = 2.0
    """cap of the rollout-correction weight: truncated to it, or tokens/sequences above it masked (2
    with token-truncate is verl's and oat's TIS; TRL 1.16's default is sequence-mask with 3)"""
    reward_workers: int = -1
    """math-verify worker processes (-1: this process's cores / local ranks; 0: none)"""

    # LoRA (peft; docs/lora.md): 0 is full fine-tuning
    lora_rank: int = 0
    """rank r of the LoRA adapters that train instead of the weights (0: full fine-tuning)"""
    lora_alpha: float = 32.0
    """LoRA's alpha: an adapted layer computes W x + (alpha / r) B A x"""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """the layers given adapters: module names or suffixes (all-linear: all but the output layer)"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input"""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """what vLLM gets: merged weights W + (alpha / r) B A, or the adapter (vLLM's LoRA path)"""

    # A Python tool during rollouts (docs/tools.md): off by default
    tool: Literal["none", "python"] = "none"
    """python: the model may run Python in fenced ```python blocks while it generates, and sees the
    output (docs/tools.md); none: no tool"""
    max_tool_calls: int = 1
    """programs run per completion (ToRL's setting); later blocks are text"""
    tool_sandbox: Literal["bwrap", "none"] = "bwrap"
    """bwrap: each program in bubblewrap (apt-get install bubblewrap); none: NO isolation: a program
    runs as the trainer's user, can read and write its files (tokens, checkpoints), use the network,
    outlive a timeout by leaving its process group, and as root has no process limit"""
    tool_timeout: float = 10.0
    """wall-clock seconds per program"""
    tool_memory_mb: int = 1024
    """address space per process of a program, in MiB"""
    tool_output_chars: int = 256
    """characters of a program's output the model is shown (ToRL: 256)"""
    tool_workers: int = 4
    """programs run at once, beside generation"""

    # Environments during rollouts (docs/environments.md): off by default
    env: str = "none"
    """<package>:<id>: multi-turn episodes with an environment, whose tasks are the prompts and whose rewards are
    the reward (builtin:guess, gem:<GEM id> e.g. gem:game:GuessTheNumber-v0-easy, <module>:<class>); none: no
    environment"""
    env_max_turns: int = 32
    """turns an environment answers before its episode ends (a cap for one that never ends; GEM's games end
    themselves, GuessTheNumber-v0-easy after 4 turns)"""
    env_tasks: int = 1024
    """--env: training tasks (seeds 0 .. N-1)"""
    env_eval_tasks: int = 64
    """--env: held-out tasks evaluated with --eval-every (seeds from 1,000,000 on)"""

    # Evaluation
    eval_every: int = 0
    """evaluate every this many steps and at the end (0 disables evaluation)"""
    eval_datasets: list[str] = field(default_factory=lambda: ["HuggingFaceH4/MATH-500"])
    """hub ids (split 'test'), local files, champ (docs/evaluation.md) or
    reasoning-gym:<task>[:option=value,...] (its held-out split) to evaluate on"""
    eval_prompt_column: str = "problem"
    """question column of the evaluation datasets"""
    eval_answer_column: str = "answer"
    """answer column of the evaluation datasets"""
    eval_samples: int = 1
    """k completions per evaluation question (avg@k, pass@k, maj@k)"""
    eval_pass_k: list[int] = field(default_factory=list)
    """which k of pass@k to log, each from 1 to --eval-samples (empty: --eval-samples alone)"""
    eval_temperature: float = 0.0
    """evaluation sampling temperature (0: greedy)"""
    eval_top_p: float = 1.0
    """evaluation nucleus sampling"""
    eval_max_new_tokens: int = 1024
    """evaluation generation budget"""
    eval_limit: int = 0
    """evaluate on at most this many questions per dataset (0: all)"""

    # Not a flag: start() records here what the command line asked for where it resolved an "auto"
    requested: dict[str, Any] = field(default_factory=dict, init=False, repr=False)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass or of its bases, whitespace folded: what tyro shows as the
    field's help (a subclass's own docstring wins over its base's)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs
