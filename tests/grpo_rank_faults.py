"""grpo.py whose verifier also reports rank + 1 timed-out verifications per call (RANK from torchrun), so a test on
2 processes can tell a metric summed over ranks (1 + 2 = 3 per step) from rank 0's own count (1)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import reward  # noqa: E402

real_score = reward.score


def score(texts, golds, answer_format="any"):
    correct, info = real_score(texts, golds, answer_format=answer_format)
    return correct, {**info, "timeouts": info["timeouts"] + int(os.environ.get("RANK", "0")) + 1}


reward.score = score  # before grpo imports it by name

import tyro  # noqa: E402

import grpo  # noqa: E402

if __name__ == "__main__":
    grpo.main(tyro.cli(grpo.Args))
