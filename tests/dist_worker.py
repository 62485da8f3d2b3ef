"""Worker for tests/test_distributed.py: one gradient of a script's `update_policy` on a fixed rollout per job, under
DDP or, launched with `accelerate launch --use_deepspeed`, DeepSpeed ZeRO-3 (built as the scripts build it).

    python tests/dist_worker.py OUT_DIR MODEL_DIR [fsdp2=1] JOB [JOB ...]
    torchrun --nproc_per_node 2 tests/dist_worker.py ...

JOB is `SCRIPT,MICRO_BATCH[,key=value ...]` (Args fields, and `stale=1`); the jobs of one launch share its
processes (one interpreter and process group start instead of one per job), each on a freshly loaded model. Every
rank builds the same fixed rollout (ids, masks, rewards), keeps its own contiguous share of whole groups, computes its
advantages on that share as main() does (LitePPO's batch std and REINFORCE++'s token mean and std reduce over ranks;
REINFORCE++'s, per token, are saved with their inputs from every rank) and runs the script's update with
SGD(lr=1) and no clipping, so params_before - params_after is exactly the gradient DDP produced. Rank 0 saves it
with the world size (`job_file` names the file). `fsdp2=1` (not a flag) prepares the policy with FSDP2
(`fully_shard` per decoder layer and on the policy, as configs/fsdp2.yaml) on CPU processes, setting the state that
accelerate's launcher sets on GPUs, and also samples with HF generate on the sharded policy (every rank its own
prompts). `stale=1` makes the rollout off-policy: old log-probs = the model's + noise and sampler log-probs = those +
noise (NaN on two rows, as injected ones), so that ratio clips, masks and per-mini-batch token selections act.
A script with a critic (`update_critic`: ppo.py, vapo.py) also gets one, a second copy of the model with a random
head, prepared after the policy: its values of the whole rollout come first, the advantages from them (GAE,
whitened over both ranks), then both updates; the critic's gradient is saved too, its keys prefixed "critic.".
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fixed_rollout(
    share: slice = slice(None), n: int = 16, p_len: int = 3, c_len: int = 6
) -> tuple[dict, torch.Tensor, torch.Generator]:
    """Rows `share` of the fixed rollout every rank builds: the batch for `update_policy` (without advantages),
    the rewards of those rows, and the generator, to draw more of the same rollout."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (n, p_len + c_len), generator=g)
    lengths = torch.randint(1, c_len + 1, (n,), generator=g)
    mask = (torch.arange(c_len)[None] < lengths[:, None]).long()
    attn = torch.cat([torch.ones(n, p_len, dtype=torch.long), mask], 1)
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    batch = {
        "ids": ids[share],
        "attn": attn[share],
        "mask": mask[share],
        "p_len": p_len,
        "lens": [(p_len, int(k)) for k in lengths[share]],
    }
    return batch, rewards[share], g


def job_file(script: str, world: int, micro: int, overrides: dict, zero3: bool = False, fsdp2: bool = False) -> str:
    """The file a job's gradient is saved to (in OUT_DIR)."""
    tag = ("_zero3" if zero3 else "") + ("_fsdp2" if fsdp2 else "")
    tag += "".join(f"_{k}{v}" for k, v in overrides.items())
    return f"grad_{script}_{world}_{micro}{tag}.pt"


def run_job(accelerator, out_dir: str, model_dir: str, script: str, micro: int, overrides: dict, fsdp2: bool):
    """One job: load the model, build the rollout, run the script's update, and save the gradient on rank 0."""
    from accelerate.utils import DistributedType
    from transformers import AutoModelForCausalLM

    from common.logprobs import TokenLogProbs
    from tests.checks import declared_token_fields, script_advantages

    mod = importlib.import_module(script)
    stale = overrides.get("stale", "0") == "1"
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    rank, world = accelerator.process_index, accelerator.num_processes
    args = mod.Args(
        group_size=4, micro_batch_size=micro, max_grad_norm=1e9, num_mini_batches=1, ppo_epochs=1, max_new_tokens=6
    )
    for k, v in overrides.items():
        if k != "stale":
            setattr(args, k, type(getattr(args, k))(v))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    policy = TokenLogProbs(model)
    n = 16
    if stale:  # the whole rollout's log-probs, before any rank trains
        from common.batching import micro_batches
        from common.logprobs import compute_logps

        full = fixed_rollout(slice(None), n)[0]
        with torch.no_grad():
            logps = compute_logps(policy, full, 1.0, micro_batches(list(range(n)), full["lens"], args)).double()
        noise = torch.randn((2, *logps.shape), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        old_logps = logps + 0.5 * noise[0]
        sampler_logps = old_logps + 0.3 * noise[1]
        sampler_logps[[2, 9]] = float("nan")
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if deepspeed:  # as the scripts set it
        accelerator.state.deepspeed_plugin.deepspeed_config.update(
            train_micro_batch_size_per_gpu=micro,
            train_batch_size=micro * world,
            gradient_accumulation_steps=1,
            gradient_clipping=args.max_grad_norm,
            zero_allow_untested_optimizer=True,
        )
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    critic = None
    if hasattr(mod, "update_critic"):  # a value model, prepared after the policy as the scripts do
        critic, values, critic_opt, critic_sched = critic_job(accelerator, model_dir, args, n)
    names = [k for k, _ in accelerator.unwrap_model(policy).lm.named_parameters()]
    before = {
        k: v.clone() for k, v in (accelerator.get_state_dict(policy) or {}).items()
    }  # full, on rank 0 (ZeRO-3: gathered)
    if critic is not None:
        before.update({"critic." + k: v.clone() for k, v in (accelerator.get_state_dict(critic) or {}).items()})
    if deepspeed or fsdp2:  # the vLLM weight push when sharded: every rank gets the full tensors, checkpoint names
        from common.sampling import iter_weight_buckets
        from tests.test_sampling import _assert_matches_checkpoint, _checkpoint, _flatten

        ckpt = _checkpoint(model_dir)  # fp32; FSDP2 keeps the fp64 the worker loads (exact copies), DeepSpeed fp32
        ckpt = {k: v.double() for k, v in ckpt.items()} if fsdp2 else ckpt
        _assert_matches_checkpoint(_flatten(iter_weight_buckets(accelerator.unwrap_model(policy).lm, 20_000)), ckpt)
    if fsdp2:  # HF generate on the sharded policy: ranks of different prompt counts and lengths finish together
        from transformers import AutoTokenizer

        from common.setup import load_sampler

        assert accelerator.is_fsdp2 and type(policy).__name__ == "FSDPTokenLogProbs"
        sampler = load_sampler(mod.Args(sampler="hf"), model, AutoTokenizer.from_pretrained(model_dir), accelerator)
        prompts = [[5, 6, 7], [8, 9]][: rank + 1]
        sampled = sampler.generate(prompts, 2, 1.0, 1.0, 3 + 2 * rank)
        assert len(sampled) == 2 * len(prompts) and all(0 < len(c.token_ids) <= 3 + 2 * rank for c in sampled)
    share = slice(rank * n // world, (rank + 1) * n // world)  # whole groups, as in the scripts' rollouts
    batch, rewards, g = fixed_rollout(share, n)
    batch["token_fields"] = declared_token_fields(mod)
    if stale:
        batch["old_logps"], batch["sampler_logps"] = old_logps[share], sampler_logps[share]
    if getattr(args, "beta", 0) > 0:  # a fixed reference for the KL term
        batch["ref_logps"] = (-torch.rand(n, batch["mask"].shape[1], generator=g, dtype=torch.float64) * 6)[share]
    old, ref = batch.get("old_logps"), batch.get("ref_logps")
    if critic is None:
        batch["advantages"] = script_advantages(mod, rewards, batch["mask"], args, old, ref)  # this rank's share
    else:  # GAE on this rank's share of the critic's values; the whitening spans both ranks
        batch["old_values"] = values[share]
        batch["advantages"], batch["returns"] = mod.compute_advantages(rewards, values[share], batch["mask"], args)
        batch["positive"] = (rewards > 0).double()  # vapo.py's LM loss
    per_token = None
    if critic is None and batch["advantages"].dim() == 2:  # reinforce_pp.py normalises over all ranks: every rank's
        inputs = {"advantages": batch["advantages"], "rewards": rewards, "mask": batch["mask"], "old": old, "ref": ref}
        per_token = {k: accelerator.gather(v) for k, v in inputs.items() if v is not None}
    stats = mod.update_policy(policy, optimizer, scheduler, accelerator, batch, args, 0)
    if critic is not None:
        mod.update_critic(critic, critic_opt, critic_sched, accelerator, batch, args, 0)
    if fsdp2:  # the update's stats as step_metrics gathers them (FSDP2's clip_grad_norm_ returns a DTensor)
        from common.metrics import gather

        norms = gather(accelerator, stats["grad_norm"])
        assert len(norms) == world and torch.isfinite(norms).all(), norms
    after = accelerator.get_state_dict(policy)  # gathered on rank 0 under ZeRO-3
    if critic is not None:
        critic_after = accelerator.get_state_dict(critic)
    if accelerator.is_main_process:
        grad = {k: before["lm." + k] - after["lm." + k] for k in names}
        if critic is not None:
            grad.update({"critic." + k: before["critic." + k] - v for k, v in critic_after.items()})
        torch.save(
            {"world_size": world, "grad": grad, "type": str(accelerator.distributed_type), "per_token": per_token},
            os.path.join(out_dir, job_file(script, world, micro, overrides, deepspeed, fsdp2)),
        )
    accelerator.free_memory()  # the next job prepares its own model, optimizer and scheduler


def critic_job(accelerator, model_dir: str, args, n: int):
    """The critic of a job: the model's decoder with a head drawn at random (its zero start would leave the decoder
    without a gradient), SGD(lr=1) and a constant schedule, prepared; then its values of the whole rollout (every rank
    all of it, before any update: under ZeRO-3 the model is partitioned from the start, so through its engine).
    Returns (critic, values [n, C], optimizer, scheduler)."""
    from transformers import AutoModelForCausalLM

    from common.batching import micro_batches
    from common.critic import TokenValues, compute_values

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    critic = TokenValues(lm.get_decoder(), lm.config.hidden_size)
    head = torch.randn(critic.value_head.weight.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():  # drawn in fp64 whatever the head's dtype (fp32 when ZeRO-3 loads the decoder)
        critic.value_head.weight.copy_(0.3 * head)
    args.critic_num_mini_batches, args.critic_max_grad_norm = 1, 1e9
    optimizer = torch.optim.SGD(critic.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    critic, optimizer, scheduler = accelerator.prepare(critic, optimizer, scheduler)
    full = fixed_rollout(slice(None), n)[0]
    with torch.no_grad():
        values = compute_values(critic, full, micro_batches(list(range(n)), full["lens"], args)).double()
    return critic, values, optimizer, scheduler


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    from common.run import close_run

    out_dir, model_dir, jobs = sys.argv[1], sys.argv[2], sys.argv[3:]
    fsdp2 = jobs[0] == "fsdp2=1"
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"  # built as the scripts build it
    accelerator = Accelerator(
        cpu=not deepspeed, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if deepspeed else None
    )
    if fsdp2:  # accelerate turns FSDP on for accelerator processes only (common/setup.py refuses a CPU launch)
        from accelerate import FullyShardedDataParallelPlugin, PartialState

        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Qwen2DecoderLayer"],
            state_dict_type="FULL_STATE_DICT",
            reshard_after_forward=True,
        )
        # AcceleratorState copies PartialState's fields whenever it is built again (accelerate does, inside prepare)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
    for job in jobs[fsdp2:]:
        script, micro, *pairs = job.split(",")
        run_job(accelerator, out_dir, model_dir, script, int(micro), dict(p.split("=", 1) for p in pairs), fsdp2)
    close_run(accelerator, None)


if __name__ == "__main__":
    main()
