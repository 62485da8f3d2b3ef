"""Checks one VLLMSampler engine on CPU and prints what it measured as one JSON line (run by tests/test_vllm.py in
a subprocess: an in-process vLLM engine joins torch.distributed and patches torch, so each engine gets a process).

    python -m tests.vllm_worker MODEL_DIR [--no-cpu-weight-fix]

Measures, on the model in MODEL_DIR (tied or untied output layer):
- the trainer's RNG states and thread count before and after building the engine;
- the Sampler contract: group order and sizes, EOS kept as the last token, the truncation flag, greedy copies;
- max |sampler log-prob - trainer log-prob| at T=1 and T=0.7 (processed log-probs, top_p=1), the trainer's being
  log_softmax(logits / T) of the HF model on prompt + completion;
- weight sync by both routes: the same difference after one linear layer changes, before and after the push
  (`reload_weights`, then `load_weights`), and, untied, after the output layer alone changes.
--no-cpu-weight-fix builds the engine without `keep_cpu_linear_weights`, to show what the fix guards (a route that
raises is reported as `<route>_error`).
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys

import numpy as np
import torch

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
N, MAX_NEW = 3, 6


def trainer_logps(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def logprob_gap(sampler, model, temperature: float, prompts=PROMPTS, n: int = N) -> float:
    """max over every sampled token of |sampler's log-prob - trainer's|, completions matched to their prompts by
    the group order the contract promises (a wrong order makes the gap large)."""
    out = sampler.generate(prompts, n, temperature, 1.0, MAX_NEW)
    assert len(out) == len(prompts) * n
    gaps = [
        (trainer_logps(model, prompts[i // n], c.token_ids, temperature) - torch.tensor(c.logprobs).double())
        .abs()
        .max()
        .item()
        for i, c in enumerate(out)
    ]
    return max(gaps)


def main(model_dir: str, fix: bool) -> dict:
    from transformers import AutoModelForCausalLM

    import common.vllm_sampler as sampling

    if not fix:
        sampling.keep_cpu_linear_weights = lambda: None
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    before = (random.random(), float(np.random.rand()), torch.rand(1).item(), torch.get_num_threads())
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    sampler = sampling.VLLMSampler(model_dir, seed=3, gpu_memory_utilization=0.02, max_model_len=64)
    after = (random.random(), float(np.random.rand()), torch.rand(1).item(), torch.get_num_threads())
    res: dict = {"rng_and_threads_kept": before == after}
    torch.set_num_threads(before[3])  # refused (a warning, no change) if vLLM's replacement were still installed
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    # A copy whose EOS logit is 8 * h0 (h0: the first coordinate of the normalised final hidden state, zero for every
    # other coordinate): EOS wins wherever h0 > ~0.3, so some completions stop early and others run out of budget.
    eos = model.generation_config.eos_token_id
    eos_model = copy.deepcopy(model)
    with torch.no_grad():
        eos_model.model.norm.weight.zero_()[0] = 1.0
        eos_model.lm_head.weight[eos, 0] = 8.0
    sampler.update_weights(eos_model)
    out = sampler.generate(PROMPTS, N, 1.0, 1.0, MAX_NEW)
    res["count"] = len(out)
    res["eos_last_and_not_truncated"] = all(
        c.token_ids[-1] == eos and not c.truncated for c in out if eos in c.token_ids
    )
    res["eos_only_last"] = all(eos not in c.token_ids[:-1] for c in out)
    res["truncated_means_full_budget"] = all(
        len(c.token_ids) == MAX_NEW and c.token_ids[-1] != eos for c in out if c.truncated
    )
    res["some_eos"] = sum(eos in c.token_ids for c in out)
    res["some_truncated"] = sum(c.truncated for c in out)
    res["logprobs_len_ok"] = all(len(c.logprobs) == len(c.token_ids) for c in out)
    sampler.update_weights(model)
    greedy = sampler.generate(PROMPTS, N, 0.0, 1.0, MAX_NEW)
    res["greedy_copies"] = all(greedy[i].token_ids == greedy[i - i % N].token_ids for i in range(len(greedy)))
    res["greedy_gap"] = max(
        (trainer_logps(model, PROMPTS[i // N], c.token_ids, 1.0) - torch.tensor(c.logprobs).double()).abs().max().item()
        for i, c in enumerate(greedy)
    )
    res["gap_t1"] = logprob_gap(sampler, model, 1.0)
    res["gap_t07"] = logprob_gap(sampler, model, 0.7)
    state = sampler.state_dict()
    first = [c.token_ids for c in sampler.generate(PROMPTS, N, 1.0, 1.0, MAX_NEW)]
    sampler.load_state_dict(state)
    res["resampled_same"] = first == [c.token_ids for c in sampler.generate(PROMPTS, N, 1.0, 1.0, MAX_NEW)]
    # torch threads inside the engine's generate (cpu_threads=1, then the default) and inside a push's reload (1)
    seen: list[int] = []
    engine_generate, engine_rpc = sampler.llm.generate, sampler.llm.collective_rpc
    sampler.llm.generate = lambda *a, **k: (seen.append(torch.get_num_threads()), engine_generate(*a, **k))[1]
    sampler.llm.collective_rpc = lambda *a, **k: (seen.append(torch.get_num_threads()), engine_rpc(*a, **k))[1]
    for threads in (1, None):
        sampler.cpu_threads = threads
        sampler.generate(PROMPTS[:1], 1, 1.0, 1.0, 2)
    sampler.cpu_threads = 1
    sampler.update_weights(model)  # the same weights again
    sampler.llm.generate, sampler.llm.collective_rpc, sampler.cpu_threads = (engine_generate, engine_rpc, None)
    expected = [1, max(1, min(before[3], len(os.sched_getaffinity(0)) - 1)), 1]  # all cores but one, <= the trainer's
    res["generate_threads"] = seen == expected and torch.get_num_threads() == before[3]

    for route in ("reload_weights", "load_weights"):
        sampler.weight_sync = route
        with torch.no_grad():  # one linear layer alone
            model.model.layers[1].mlp.down_proj.weight.mul_(4.0).add_(0.05)
        res[f"{route}_linear_before"] = logprob_gap(sampler, model, 1.0)
        try:
            sampler.update_weights(model)
        except Exception as e:  # noqa: BLE001 - what a route without the CPU fix does
            res[f"{route}_error"] = f"{type(e).__name__}: {e}"[:300]
            continue
        res[f"{route}_linear_after"] = logprob_gap(sampler, model, 1.0)
        if not model.config.tie_word_embeddings:
            with torch.no_grad():  # the untied output layer alone
                model.lm_head.weight.mul_(3.0)
            res[f"{route}_head_before"] = logprob_gap(sampler, model, 1.0)
            sampler.update_weights(model)
            res[f"{route}_head_after"] = logprob_gap(sampler, model, 1.0)
    return res


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], "--no-cpu-weight-fix" not in sys.argv)), flush=True)
