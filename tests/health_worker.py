"""Worker for tests/test_distributed.py: common.metrics.health_metrics and tool_metrics on 1 or 2 processes
(torchrun, gloo).

    python tests/health_worker.py OUT.json
    torchrun --nproc_per_node 2 tests/health_worker.py OUT.json

Rank 0 holds the first two groups of TEXTS, rank 1 the last one (uneven on purpose: the gather pads); one process
holds all three. Rank 0 writes the metrics it would log."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GROUP = 2
TEXTS = [  # rank 0: plain answers; rank 1: reflection, language mixing and repetition
    "3 plus 4 is 7, so 7",
    "the sum is 8",
    "4",
    "5 and 5 make 10",
    "Wait, 答案 is 9. Let me check: 9. Let me check: 9.",
    "Alternatively however 6 6 6 6 6 6",
]
CORRECT = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
LENGTHS = [9, 4, 1, 6, 20, 14]
SHARES = {1: [slice(0, 6)], 2: [slice(0, 4), slice(4, 6)]}
# the Python tool's use per completion (calls, errors, timeouts, seconds, overlap) and its output tokens: rank 1 holds
# the timeout and most of the calls
TOOL = [(1, 0, 0, 0.5, 0.5), (0, 0, 0, 0.0, 0.0), (1, 1, 0, 0.25, 0.0), (0, 0, 0, 0.0, 0.0), (3, 0, 1, 12.0, 2.0)]
TOOL += [(2, 1, 0, 1.0, 1.0)]
TOOL_TOKENS = [4, 0, 9, 0, 30, 12]


def tool_completions():
    """The completions TOOL describes (each with LENGTHS model tokens and TOOL_TOKENS tool tokens)."""
    from common.sampling import Completion
    from common.tool import ToolStats

    return [
        Completion([1] * (n + k), t, False, None, [1] * n + [0] * k, ToolStats(*s))
        for n, k, t, s in zip(LENGTHS, TOOL_TOKENS, TEXTS, TOOL)
    ]


def main() -> None:
    from accelerate import Accelerator

    from common.metrics import health_metrics, tool_metrics
    from common.run import close_run

    accelerator = Accelerator(cpu=True)
    share = SHARES[accelerator.num_processes][accelerator.process_index]
    metrics = health_metrics(
        TEXTS[share], torch.tensor(CORRECT[share]), torch.tensor(LENGTHS[share]), GROUP, accelerator
    )
    metrics.update(tool_metrics(accelerator, tool_completions()[share]))
    if accelerator.is_main_process:
        with open(sys.argv[1], "w") as f:
            json.dump({"world": accelerator.num_processes, **metrics}, f)
    close_run(accelerator, None)


if __name__ == "__main__":
    main()
