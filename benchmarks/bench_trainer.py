"""One policy update of one rollout, ours against TRL's, on a model of a real shape with random weights.

    pip install -r benchmarks/requirements.txt          # TRL 1.16.0 (+ liger-kernel, flash-attn on a GPU: optional)
    python benchmarks/bench_trainer.py --shape tiny     # CPU, < 1 min: benchmarks/results/trainer_<device>_<shape>.*
    python benchmarks/bench_trainer.py --shape qwen2.5-1.5b --sides ours trl trl-fused   # one GPU

The rollout: 16 sequences, prompts of 256 tokens, completions of lo + (hi - lo) (i / 15)^1.35 tokens, i = 0..15, from
253 to 1891 (19,429 real tokens; `tiny`: 16-token prompts, completions 16-118), random token ids, random advantages.
The model: the shape's config (dimensions written below, no hub), random weights, fp32 master weights, AdamW (fused
on CUDA, as the scripts and transformers' default optimizer); on CUDA every forward under bf16 autocast, as the
scripts train; on a CPU fp32 (the scripts' default there).

Sides (each in a fresh process, same seed, same model and batch; one warm-up update, then --repeats timed ones):
  ours              grpo.py's update_policy: common.logprobs.TokenLogProbs (chunked log-probs, torch's softmax:
                    --logprob-kernel torch), GRPO's compute_policy_loss, token-budget micro-batches
                    (--micro-batch-tokens 8192), weights_cast_once
  ours-liger        ours with Liger's RMSNorm / SwiGLU / RoPE (common.kernels.use_liger_kernels; CUDA)
  ours-padding-free ours with padding-free micro-batches (on CUDA flash-attn's varlen attention; without
                    flash-attn the scripts run them padded, and so does this side: its row says "ran padded")
  ours-compile      ours with torch.compile of the decoder layers (the timed updates follow a compiling warm-up)
  ours-triton       ours with --logprob-kernel triton: Triton's softmax and d logits (common/triton_logprobs.py;
                    CUDA), what the scripts' default --logprob-kernel auto picks there
  ours-fast         ours with Liger's kernels and --logprob-kernel triton (CUDA)
  ours-fast-padding-free   ours-fast with padding-free micro-batches (CUDA)
  trl               the path the issue measured: full logits of the completion, trl.trainer.utils
                    selective_log_softmax and entropy_from_logits (TRL 1.16.0), 4 rows per micro-batch padded to the
                    rollout's longest, TRL's GRPO loss (loss_type="grpo", gradient accumulation over the 4)
  trl-fused         TRL 1.16.0's own GRPOTrainer path: trl.trainer.utils.add_fused_lm_head, then
                    model(..., labels, fused_lm_head=True) for log-probs and entropy; same loss and micro-batches
  trl-liger         TRL 1.16.0's GRPOTrainer with GRPOConfig(use_liger_kernel=True), like with ours-fast: trl-fused
                    with Liger's RMSNorm / SwiGLU / RoPE in the model (TRL 1.16.0 has no Liger GRPO loss any more:
                    grpo_trainer.py applies Liger's layer kernels only, fused_linear_cross_entropy off, and keeps its
                    fused LM head; CUDA)
  trl-liger-loss    trl-liger's kernels with Liger's fused linear GRPO loss (liger_kernel.chunked_loss
                    LigerFusedLinearGRPOLoss, loss_type="grpo", beta 0) on the decoder's last hidden state, as the
                    TRL releases that had it called it (GRPOConfig(use_liger_loss=True), later use_liger_kernel=True;
                    GRPOTrainer.compute_liger_loss); same micro-batches (CUDA)
One update: all micro-batches, forward and backward, gradient clipping at 1.0, AdamW step, zero_grad; the advantages
are fixed and old log-probs = the log-probs (one update per rollout), so every side computes the same loss, and
the same gradient up to rounding (the report gives each side's loss and gradient norm).

Reported per side: update time (median), tokens/s on the real tokens, MFU = 6 x params x real tokens / time / the
device's peak dense bf16 FLOP/s (PEAK_BF16; n/a on a CPU), peak memory (CUDA: max_memory_allocated; CPU: the
process's peak resident set), and the time split: decoder forward, log-prob forward (output layer, log-probs and
loss), log-prob backward, decoder backward, optimizer (clip, step, zero_grad), from hooks on the decoder and its
output's gradient (synchronising CUDA at each boundary, so in one more update of its own: the timed updates read
nothing on the host before their end, as the scripts' micro-batch loop). Also the seconds to set up (imports, model)
and to warm up. The results files are rewritten after each side, so a side that stops the run loses only itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Configs from the models' config.json on the hub, written out: nothing is downloaded
SHAPES = {
    "tiny": dict(
        family="Qwen2Config", prompt=16, completions=(16, 118),
        config=dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    ),
    "qwen3-0.6b": dict(  # Qwen/Qwen3-0.6B
        family="Qwen3Config", prompt=256, completions=(253, 1891),
        config=dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    rope_theta=1000000.0, rms_norm_eps=1e-6),
    ),
    "qwen2.5-1.5b": dict(  # Qwen/Qwen2.5-1.5B
        family="Qwen2Config", prompt=256, completions=(253, 1891),
        config=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
                    rope_theta=1000000.0, rms_norm_eps=1e-6),
    ),
}  # fmt: skip
# Peak dense bf16 tensor FLOP/s (NVIDIA datasheets, without sparsity), matched against torch's device name in order
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12)]
# Our sides and the speed paths each turns on, as the scripts' --liger-kernel, --padding-free, --torch-compile and
# --logprob-kernel triton do
OURS = {
    "ours": set(), "ours-liger": {"liger"}, "ours-padding-free": {"padding-free"}, "ours-compile": {"compile"},
    "ours-triton": {"triton"}, "ours-fast": {"liger", "triton"}, "ours-fast-padding-free": {"liger", "triton",
    "padding-free"},
}  # fmt: skip
SIDES = [*OURS, "trl", "trl-fused", "trl-liger", "trl-liger-loss"]
ROWS, TRL_ROWS, TEMPERATURE = 16, 4, 1.0


def completion_lengths(lo: int, hi: int) -> list[int]:
    return [round(lo + (hi - lo) * (i / (ROWS - 1)) ** 1.35) for i in range(ROWS)]


def peak_flops(device) -> tuple[str, float | None]:
    import torch

    if device.type != "cuda":
        with contextlib.suppress(OSError):  # Linux: the CPU's model name
            with open("/proc/cpuinfo") as f:
                return "CPU " + next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None
        return f"CPU {platform.machine()}", None
    name = torch.cuda.get_device_name(device)
    return name, next((flops for key, flops in PEAK_BF16 if key in name), None)


def build(shape: str, device):
    import torch
    import transformers

    spec = SHAPES[shape]
    config = getattr(transformers, spec["family"])(**spec["config"], tie_word_embeddings=True)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def rollout(shape: str, vocab: int, device) -> dict:
    """The batch as common.batching.make_batch lays it out: prompts (all one length here) then right-padded
    completions; `lens` host-side."""
    import torch

    spec = SHAPES[shape]
    p, lens = spec["prompt"], completion_lengths(*spec["completions"])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (ROWS, p + max(lens)), generator=g)
    attn = torch.zeros_like(ids)
    for row, c in enumerate(lens):
        attn[row, : p + c] = 1
    ids = ids * attn
    advantages = torch.randn(ROWS, generator=g)
    batch = dict(ids=ids, attn=attn, mask=attn[:, p:], advantages=advantages)
    batch = {k: v.to(device) for k, v in batch.items()}
    return {**batch, "p_len": p, "lens": [(p, c) for c in lens]}


class Split:
    """Times the phases of an update from hooks: the decoder's forward, the gradient reaching its output. Each mark
    synchronises CUDA, so it times only while `active` (one update of its own); the timed updates run without it."""

    def __init__(self, model, device):
        import torch

        self.active = False
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.times = dict.fromkeys(["decoder_fwd", "logprob_fwd", "logprob_bwd", "decoder_bwd", "optimizer"], 0.0)
        decoder = model.get_decoder()
        decoder.register_forward_pre_hook(lambda *_: self.mark("decoder_start"))
        decoder.register_forward_hook(self.decoder_done)

    def mark(self, name: str) -> None:
        if self.active:
            self.sync()
            setattr(self, name, time.perf_counter())

    def decoder_done(self, module, args, output) -> None:
        if not self.active:
            return
        self.mark("decoder_end")
        self.times["decoder_fwd"] += self.decoder_end - self.decoder_start
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: self.mark("head_grad"))

    def backward(self, loss) -> None:
        """loss.backward(), split at the decoder output's gradient; the forward's log-prob part is what the decoder's
        forward did not take since `forward_start`."""
        if not self.active:
            loss.backward()
            return
        self.mark("backward_start")
        self.times["logprob_fwd"] += self.backward_start - self.forward_start - (self.decoder_end - self.decoder_start)
        loss.backward()
        self.mark("backward_end")
        self.times["logprob_bwd"] += self.head_grad - self.backward_start
        self.times["decoder_bwd"] += self.backward_end - self.head_grad


def ours_update(policy, optimizer, batch, grpo, args, split: Split, autocast) -> tuple[float, float]:
    """grpo.py's update_policy on one mini-batch (the whole rollout), one epoch. Returns (loss, grad norm)."""

    from common.batching import grad_normalizers, micro_batch, micro_batches
    from common.logprobs import weights_cast_once

    plan = micro_batches(list(range(ROWS)), batch["lens"], args)
    chunks = [micro_batch(batch, rows, p_w, c_w) for rows, p_w, c_w in plan]
    num_tokens, num_seqs = grad_normalizers([m["mask"] for m in chunks])
    total = 0.0
    with weights_cast_once():
        for m, (_, p_w, _) in zip(chunks, plan):
            split.mark("forward_start")
            with autocast():
                logps, _entropy = policy(m["ids"], m["attn"], p_w, TEMPERATURE)
            loss, _ = grpo.compute_policy_loss(
                logps, logps.detach(), m["advantages"], m["mask"], args, num_tokens, num_seqs
            )
            split.backward(loss)
            total += loss.detach()
    return total, step(policy, optimizer, split)


def trl_update(model, optimizer, batch, split: Split, autocast, fused: bool, liger_loss=None) -> tuple[float, float]:
    """The TRL path: TRL_ROWS rows per micro-batch at the rollout's full width, log-probs of the completion from full
    logits (trl) or TRL's fused head (trl-fused, trl-liger), TRL's GRPO loss scaled by 1 / gradient-accumulation
    steps; or Liger's fused linear GRPO loss on the last hidden state (`liger_loss`, trl-liger-loss)."""
    import torch
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    p, accumulation = batch["p_len"], ROWS // TRL_ROWS
    total = 0.0
    for start in range(0, ROWS, TRL_ROWS):
        ids, attn = batch["ids"][start : start + TRL_ROWS], batch["attn"][start : start + TRL_ROWS]
        mask, advantages = (
            batch["mask"][start : start + TRL_ROWS].float(),
            batch["advantages"][start : start + TRL_ROWS],
        )
        completion = ids[:, p:]
        keep = completion.shape[1]
        split.mark("forward_start")
        with autocast():
            if liger_loss is not None:  # GRPOTrainer.compute_liger_loss: the hidden states before each completion token
                hidden = model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1][:, -keep:]
                loss = liger_loss(hidden, model.lm_head.weight, completion, mask, advantages)[0] / accumulation
                split.backward(loss)
                total += loss.detach()
                continue
            if fused:  # GRPOTrainer._get_per_token_logps_and_entropies
                labels = ids.masked_fill(attn == 0, -100)
                labels[:, :-keep] = -100
                out = model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
                logps, _entropy = out.log_probs[:, -keep:], out.entropy[:, -keep:]
            else:  # full logits, as TRL computed them before its fused head
                logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep + 1).logits
                logits = logits[:, :-1] / TEMPERATURE
                logps = selective_log_softmax(logits, completion)
                with torch.no_grad():
                    _entropy = entropy_from_logits(logits)
        # GRPOTrainer._compute_loss, loss_type="grpo", beta 0, one iteration (old = current, detached)
        ratio = torch.exp(logps - logps.detach())
        clipped = torch.clamp(ratio, 1 - 0.2, 1 + 0.2)
        per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        split.backward(loss)
        total += loss.detach()
    return total, step(model, optimizer, split)


def step(model, optimizer, split: Split) -> float:
    import torch

    split.mark("optimizer_start")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # read after the update: no sync inside it
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    split.mark("optimizer_end")
    if split.active:
        split.times["optimizer"] += split.optimizer_end - split.optimizer_start
    return norm


def worker(side: str, shape: str, repeats: int, threads: int | None, profile: str | None = None) -> dict:
    started = time.perf_counter()
    import torch

    if threads:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(shape, device)
    params = sum(p.numel() for p in model.parameters())
    paths = OURS.get(side, {"liger"} if side.startswith("trl-liger") else set())
    if "liger" in paths:
        from common.kernels import use_liger_kernels

        use_liger_kernels(model, device)
    packed = None
    if "padding-free" in paths:
        from common.kernels import packs, padding_free_attention

        padding_free_attention(model, device)
        packed = packs(model, device)  # on CUDA without flash-attn the scripts (and this side) run padded
    if "compile" in paths:
        from common.kernels import compile_decoder_layers

        compile_decoder_layers(model)
    if side in ("trl-fused", "trl-liger"):
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    batch = rollout(shape, model.config.vocab_size, device)
    split = Split(model, device)
    cuda = device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    if side.startswith("ours"):
        import grpo
        from common.logprobs import TokenLogProbs

        kernel, padding_free = "triton" if "triton" in paths else "torch", "padding-free" in paths
        policy = TokenLogProbs(model, chunk_size=1024, kernel=kernel, padding_free=padding_free)
        args = grpo.Args(
            beta=0.0, rollout_correction="none", micro_batch_size=256, micro_batch_tokens=8192,
            padding_free=padding_free, logprob_kernel=kernel,
        )  # fmt: skip
        update = lambda: ours_update(policy, optimizer, batch, grpo, args, split, autocast)  # noqa: E731
    else:
        fused, liger_loss = side in ("trl-fused", "trl-liger"), None
        if side == "trl-liger-loss":  # GRPOTrainer.__init__'s, for loss_type="grpo", beta 0, no reference model
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            liger_loss = LigerFusedLinearGRPOLoss(
                beta=0.0, use_ref_model=False, epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo",
                temperature=TEMPERATURE,
            )  # fmt: skip
        update = lambda: trl_update(model, optimizer, batch, split, autocast, fused, liger_loss)  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)  # the scripts' and transformers' on CUDA
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the model, before any update
    setup_s = time.perf_counter() - started
    loss, norm = update()  # warm-up: AdamW's state, allocator, compilation
    split.sync()
    warmup_s = time.perf_counter() - started - setup_s
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, norms = [], []
    for _ in range(repeats):
        split.sync()
        start = time.perf_counter()
        loss, norm = update()
        split.sync()
        times.append(time.perf_counter() - start)
        norms.append(float(norm))
    split.active = True  # one more update, timed phase by phase
    split.sync()
    start = time.perf_counter()
    update()
    split.sync()
    split_update_s = time.perf_counter() - start
    split.active = False
    if profile:  # one more update under torch's profiler: its kernels by total device time
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=activities) as prof:
            update()
            split.sync()
        sort = "cuda_time_total" if cuda else "cpu_time_total"
        with open(profile, "w") as f:
            f.write(f"## {side}, {shape}: one update under torch.profiler\n")
            f.write(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70) + "\n")
    tokens = sum(p + c for p, c in batch["lens"])
    name, peak = peak_flops(device)
    median = statistics.median(times)
    return {
        "side": side,
        "shape": shape,
        "device": name,
        "params": params,
        "real_tokens": tokens,
        "computed_tokens": computed_tokens(side, batch, packed),
        "attention": model.config._attn_implementation,
        "packed": packed,  # padding-free sides: whether they ran packed (None: not a padding-free side)
        "update_s": median,
        "update_s_all": times,
        "tokens_per_s": tokens / median,
        "mfu": 6 * params * tokens / median / peak if peak else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_update_mib": rss_before,
        "split_s": split.times,
        "split_update_s": split_update_s,  # the wall time of the update the split comes from
        "setup_s": setup_s,
        "warmup_s": warmup_s,
        "loss": float(loss),
        "grad_norm": norms[-1],
    }


def computed_tokens(side: str, batch, packed: bool | None) -> int:
    """Tokens the decoder runs on, padding included: ours cuts each micro-batch to its own widths (or packs it)."""
    from common.batching import micro_batches

    lens = batch["lens"]
    if side.startswith("trl"):
        return ROWS * (batch["p_len"] + max(c for _, c in lens))
    if packed:
        return sum(p + c for p, c in lens)
    args = SimpleNamespace(micro_batch_size=256, micro_batch_tokens=8192, padding_free=packed is not None)
    return sum(len(rows) * (p_w + c_w) for rows, p_w, c_w in micro_batches(list(range(ROWS)), lens, args))


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "accelerate", "trl", "liger-kernel", "flash-attn", "triton"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def default_sides(cuda: bool, have: dict) -> list[str]:
    sides = ["ours", "trl", "trl-fused"]
    if cuda and have["liger-kernel"]:
        sides += ["ours-liger", "ours-fast", "trl-liger", "trl-liger-loss"]
    if cuda:
        sides += ["ours-padding-free"]
    return sides


def run_side(side: str, shape: str, repeats: int, timeout: float, threads: int | None, profile: str | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--shape", shape, "--repeats", str(repeats)]
    cmd += ["--threads", str(threads)] if threads else []
    cmd += ["--profile", profile] if profile else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"side": side, "shape": shape, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"side": side, "shape": shape, "error": tail}
    return json.loads(lines[-1])


def fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(results: list[dict], meta: dict) -> str:
    ok = [r for r in results if "error" not in r]
    base = next((r for r in ok if r["side"] == "trl"), None)
    rows = [
        "| side | update (s) | tokens/s (real) | MFU | peak GiB (CUDA) | peak RSS MiB | decoder fwd | log-prob fwd "
        "| log-prob bwd | decoder bwd | optimizer | tokens computed | loss | grad norm | tokens/s vs trl "
        "| set-up + warm-up (s) |",
        "|" + "---|" * 16,
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['side']} | error: {r['error']} |" + " |" * 14)
            continue
        s = r["split_s"]
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        side = r["side"] + (" (ran padded: no flash-attn)" if r.get("packed") is False else "")
        rows.append(
            f"| {side} | {r['update_s']:.3f} | {r['tokens_per_s']:.0f} | {fmt(r['mfu'], '.1%')} "
            f"| {fmt(r['peak_gib'], '.1f')} | {r['peak_rss_mib']:.0f} | {s['decoder_fwd']:.3f} "
            f"| {s['logprob_fwd']:.3f} "
            f"| {s['logprob_bwd']:.3f} | {s['decoder_bwd']:.3f} | {s['optimizer']:.3f} | {r['computed_tokens']} "
            f"| {r['loss']:.6g} | {r['grad_norm']:.6g} | {fmt(ratio, '.2f')} "
            f"| {r.get('setup_s', 0):.0f} + {r.get('warmup_s', 0):.0f} |"
        )
    head = [
        f"# bench_trainer: {meta['shape']} on {meta['device']}",
        "",
        f"{meta['date']}; `{meta['command']}`; {meta['params'] / 1e6:.1f}M parameters, {meta['real_tokens']} real "
        f"tokens (16 rows); {meta['repeats']} timed updates after one warm-up, median; split in seconds, from one more "
        "update.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v) + ".",
        "",
    ]
    return "\n".join(head + rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=None, help="default: those this machine can run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per side")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on a CPU, torch's on CUDA)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="'' writes nothing")
    p.add_argument("--profile", default=None, help="write each side's profile of one more update: <this>_<side>.txt")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.shape, a.repeats, a.threads, a.profile)), flush=True)
        return
    import torch

    have = versions()
    cuda = torch.cuda.is_available()
    sides = a.sides or default_sides(cuda, have)
    threads = a.threads or (None if cuda else 1)  # one thread per process: a shared CPU's cores do not spin idle
    results = []
    for side in sides:
        profile = f"{a.profile}_{side}.txt" if a.profile else None
        results.append(run_side(side, a.shape, a.repeats, a.timeout, threads, profile))
        r = results[-1]
        ran = {None: "", True: ", packed", False: ", ran padded (no flash-attn)"}[r.get("packed")]
        print(side, r.get("error") or f"{r['update_s']:.3f} s, {r['tokens_per_s']:.0f} tok/s{ran}", flush=True)
        text = report(results, a, cuda, threads, have)
    print(text)


def report(results: list[dict], a, cuda: bool, threads: int | None, have: dict) -> str:
    """The results so far as markdown, written with their JSON to --out."""
    ok = [r for r in results if "error" not in r]
    device = ok[0]["device"] if ok else ("cuda" if cuda else "cpu")
    meta = {
        "shape": a.shape,
        "device": device,
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/bench_trainer.py " + " ".join(sys.argv[1:]),
        "repeats": a.repeats,
        "threads": threads,
        "params": ok[0]["params"] if ok else 0,
        "real_tokens": ok[0]["real_tokens"] if ok else 0,
        "versions": have,
    }
    text = markdown(results, meta)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        stem = os.path.join(a.out, f"trainer_{'cuda' if cuda else 'cpu'}_{a.shape}")
        with open(stem + ".md", "w") as f:
            f.write(text)
        with open(stem + ".json", "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return text


if __name__ == "__main__":
    main()
