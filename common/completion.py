"""What a rollout yields, shared by every sampler backend (common/hf_sampler.py, common/vllm_sampler.py,
common/vllm_server.py) and the environment driver (common/env.py): a `Completion`, the `Segment` one generation
request gives, the record of an episode with an environment (`EnvStats`) or the Python tool (`ToolStats`), the checks
every backend makes on a request, and the per-request seeds that make vLLM's sampling reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace


@dataclass
class ToolStats:
    """A completion's tool use: programs run, those that failed (an exception, a non-zero exit, the output cap) and
    those that timed out, their seconds and the part of those that overlapped generation."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    overlap_seconds: float = 0.0


@dataclass
class EnvStats:
    """An episode with an environment (common/env.py): the turns the environment answered, each turn's reward and the
    completion token it follows (the turn's last model token: where a token-level algorithm puts it), whether the
    environment called it a success, the error it raised (the episode then ended with reward 0), whether the turn cap
    ended it, the observation tokens appended and how many observations were cut to the budget, and the seconds the
    environment took to answer."""

    turns: int = 0
    rewards: list[float] = field(default_factory=list)
    reward_at: list[int] = field(default_factory=list)
    success: bool = False
    error: str = ""
    capped: bool = False
    obs_tokens: int = 0
    obs_truncated: int = 0
    seconds: float = 0.0

    @property
    def reward(self) -> float:
        """The episode's return, the sequence reward: its turns' rewards summed, 0 when the environment raised."""
        return 0.0 if self.error else float(sum(self.rewards))


@dataclass
class Completion:
    """One sampled completion."""

    token_ids: list[int]
    """generated tokens, EOS included if generated, no padding"""
    text: str
    """the tokens decoded with skip_special_tokens=True"""
    truncated: bool
    """True when generation hit max_new_tokens without EOS (vLLM finish_reason == "length")"""
    logprobs: list[float] | None = None
    """the sampler's log-prob of each generated token after temperature and top-p, when available (0.0 on
    the tokens an environment appended, which the mask leaves out)"""
    mask: list[int] | None = None
    """with an environment: 1 for each token the model sampled, 0 for the tokens it appended (the tool's output, an
    observation); None: every token is the model's (common.batching.make_batch folds it into the loss mask)"""
    tool: ToolStats | None = None
    """with the tool: its use in this completion (calls, errors, timeouts, seconds); None without the tool"""
    env: EnvStats | None = None
    """with an environment (the tool included): the episode's record; None without one"""

    def __post_init__(self) -> None:
        if isinstance(self.tool, dict):  # read back from a checkpoint's JSON
            self.tool = ToolStats(**self.tool)
        if isinstance(self.env, dict):
            self.env = EnvStats(**self.env)

    def model_tokens(self) -> int:
        """How many of the tokens the model sampled (all of them without an environment)."""
        return len(self.token_ids) if self.mask is None else sum(self.mask)


@dataclass
class Segment:
    """What one generation request gave: the sampled ids, their processed log-probs (None: the backend gives none),
    the backend's text (cut after a stop string), and how it ended: `stop` the stop string (None for EOS or the
    budget), `truncated` when the budget ran out."""

    token_ids: list[int]
    logprobs: list[float] | None
    text: str
    stop: str | None
    truncated: bool


def check_request(prompt_token_ids: Sequence[Sequence[int]], n: int, max_new_tokens: int) -> None:
    """What every backend refuses before generating: n or max_new_tokens below 1, an empty prompt."""
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    if any(len(p) == 0 for p in prompt_token_ids):
        raise ValueError("empty prompt: every prompt needs at least one token")


def done_future(result) -> Future:
    """A future that already holds `result`: what an in-process sampler's `submit` returns (it generated at once)."""
    future: Future = Future()
    future.set_result(result)
    return future


def copy_completion(c: Completion) -> Completion:
    """A deep copy (greedy decoding samples a group once and copies it n times: copies, not aliases)."""
    copies = {k: list(v) for k in ("token_ids", "logprobs", "mask") if (v := getattr(c, k)) is not None}
    tool = None if c.tool is None else replace(c.tool)
    env = None if c.env is None else replace(c.env, rewards=list(c.env.rewards), reward_at=list(c.env.reward_at))
    return replace(c, **copies, tool=tool, env=env)


def request_seed(seed: int, call: int, prompt: int, n: int) -> int:
    """The seed of one prompt's request: distinct over (seed, call, prompt), n apart (vLLM seeds the i-th of a
    request's n samples with seed + i), below 2**62."""
    import numpy as np

    base = int(np.random.SeedSequence([seed % 2**63, call, prompt]).generate_state(1, np.uint64)[0]) % 2**62
    return base - base % max(n, 1)


def episode_seed(seed: int, call: int, prompt: int, sample: int, wave: int, n: int) -> int:
    """The seed of one episode's request number `wave` (an environment's episode is a request per model turn): the
    first is the sample's seed without an environment (its prompt's request seed + its index), later ones distinct
    over (seed, call, prompt, sample, wave)."""
    import numpy as np

    if wave == 0:
        return request_seed(seed, call, prompt, n) + sample
    key = [seed % 2**63, call, prompt, sample, wave]
    return int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0]) % 2**62
