"""One VLLMSampler engine on SmolLM2-135M-Instruct (CPU, fp32), checked against the trainer; writes a JSON report
(run by tests/test_real_model.py in a subprocess: an in-process engine joins torch.distributed and patches torch).

    python -m tests.real_model_worker MODEL_DIR REPORT_JSON

- packed_layers: layers running vLLM's packed CPU GEMMs, repacked after each push;
- diff_before / diff_after: max |sampler log-prob - trainer log-prob| over every sampled token at T=1 on chat
  prompts, before any change and after the trainer's weights were perturbed and pushed; stale: the same with the
  perturbed trainer and the engine not yet pushed to;
- vllm_truncation: "ok" when truncated is exactly "the last token is not <|im_end|>" and both kinds occur;
- r1_tokens / r1_text: the greedy completion of an r1 prompt with the stop string </answer>.
"""

from __future__ import annotations

import json
import sys

import torch

from tests.vllm_worker import trainer_logps

CHAT = ["What is 7 + 5?", "Name a colour.", "Tom has 3 apples and gets 4 more. How many apples does he have now?"]
R1_PROMPT = (  # an r1-template prompt the model ends quickly: the answer is already in the tag
    "A conversation between User and Assistant. The Assistant thinks in <think> </think> and answers in "
    "<answer> </answer>.\nUser: What is 2 + 2?\nAssistant: <think> 2 + 2 = 4. </think> <answer> 4"
)


def chat_prompts(tok) -> list[list[int]]:
    chats = [[{"role": "user", "content": q}] for q in CHAT]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def gap(sampler, model, prompts: list[list[int]], n: int = 2, max_new: int = 24) -> float:
    out = sampler.generate(prompts, n, 1.0, 1.0, max_new)
    return max(
        (trainer_logps(model, prompts[i // n], c.token_ids, 1.0) - torch.tensor(c.logprobs).double()).abs().max().item()
        for i, c in enumerate(out)
    )


def main(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.vllm_sampler import VLLMSampler, repack_cpu_linears

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sampler = VLLMSampler(model_dir, seed=0, gpu_memory_utilization=0.02, max_model_len=512)
    prompts = chat_prompts(tok)
    report: dict = {"packed_layers": sampler.llm.apply_model(repack_cpu_linears)[0]}
    report["diff_before"] = gap(sampler, model, prompts)
    torch.manual_seed(0)
    with torch.no_grad():  # a change of the size a few optimizer steps make: every weight matrix, 2% of its scale
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(1 + 0.02 * torch.randn_like(p))
    report["stale"] = gap(sampler, model, prompts)
    sampler.update_weights(model)
    report["diff_after"] = gap(sampler, model, prompts)

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    outs = sampler.generate(prompts, 2, 0.7, 1.0, 200) + sampler.generate(prompts, 2, 0.7, 1.0, 3)
    wrong = [c.token_ids[-3:] for c in outs if c.truncated != (c.token_ids[-1] != eos)]
    kinds = {c.truncated for c in outs}
    report["vllm_truncation"] = "ok" if not wrong and kinds == {True, False} else f"wrong {wrong}, kinds {kinds}"

    sampler.update_weights(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))  # the original
    sampler.stop = ["</answer>"]
    (c,) = sampler.generate([tok(R1_PROMPT)["input_ids"]], 1, 0.0, 1.0, 48)
    report.update(r1_tokens=c.token_ids, r1_text=c.text, r1_truncated=c.truncated)
    return report


if __name__ == "__main__":
    with open(sys.argv[2], "w") as f:
        json.dump(main(sys.argv[1]), f)
