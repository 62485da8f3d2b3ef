"""vLLM with the Python tool, on the tool model (tests/toy.py build_tool_model), in a process of its own (an
in-process engine joins torch.distributed and patches torch): the colocated engine (tests/test_tool.py), or a
client of tools/vllm_server.py at 127.0.0.1:PORT that first pushes the tool model's weights (tests/test_server.py).

    python -m tests.tool_worker MODEL_DIR OUT.json [PORT MAX_NEW_TOKENS]

Writes: each script's greedy completion (ids, mask, truncated) and tool calls; the largest |sampler log-prob -
trainer log-prob| over the model's sampled tokens at T = 1 (the trainer: the HF model on prompt + completion, as
common.batching.make_batch lays it out) and how many tool tokens those rollouts held; whether sampling again with the
same seeds (the call counter put back) gives the same rollouts."""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.batching import make_batch
    from common.logprobs import TokenLogProbs, compute_logps
    from common.sampling import VLLMSampler
    from common.tool import ToolConfig
    from tests.toy import TOOL_SCRIPTS

    model_dir, out_path = sys.argv[1], sys.argv[2]
    port, budget = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 3 else (None, 200)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [tok(p).input_ids for p in TOOL_SCRIPTS]
    config = ToolConfig(timeout_s=5.0, max_calls=2)
    if port is None:
        sampler = VLLMSampler(model_dir, seed=11, gpu_memory_utilization=0.02, max_model_len=512, tool=config)
    else:
        from common.vllm_server import ServerSampler

        sampler = ServerSampler("127.0.0.1", port, seed=11, timeout=120, tool=config, tokenizer=tok)
        sampler.update_weights(model)  # the server serves the toy model: the tool model's weights first
    greedy = sampler.generate(prompts, 2, 0.0, 1.0, budget)[::2]
    sampled = sampler.generate(prompts, 3, 1.0, 1.0, min(budget, 160))
    sampler.calls = 1  # replay the second call: the same seeds
    again = sampler.generate(prompts, 3, 1.0, 1.0, min(budget, 160))
    sampler.close()
    batch = make_batch(prompts, sampled, tok.pad_token_id, "cpu")
    plan = [(list(range(len(sampled))), batch["p_len"], batch["mask"].shape[1])]
    with torch.no_grad():
        logps = compute_logps(TokenLogProbs(model), batch, 1.0, plan)
    gap = ((logps - batch["sampler_logps"]).abs() * batch["mask"]).max().item()
    report = {
        "greedy": [{"ids": c.token_ids, "mask": c.mask, "truncated": c.truncated} for c in greedy],
        "calls": [c.tool.calls for c in greedy],
        "logprob_gap": gap,
        "tool_tokens": int((batch["attn"][:, batch["p_len"] :] - batch["mask"]).sum()),
        "repeat_equal": [(c.token_ids, c.mask) for c in sampled] == [(c.token_ids, c.mask) for c in again],
    }
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
