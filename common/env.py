"""Environments during rollouts: whatever answers the model mid-sequence (docs/environments.md).

An episode is the model generating until its turn ends (EOS or one of the environment's stop strings), the environment
answering the turn, and so on until the environment says done, the token budget (--max-new-tokens) runs out or
--env-max-turns turns were answered. The answer's observation is appended to the sequence by token id, with mask 0 (in
the sequence, out of the loss), so the trainer scores exactly the ids the sampler produced plus the observations' ids
and the whole text is never re-tokenised. Each turn's reward is kept (`EnvStats.rewards`, with the completion token it
follows in `reward_at`, for token-level algorithms: `token_rewards`), and their sum is the sequence reward the scripts
train on (`common.data.TrainData.score`). The Python tool (common/tool.py) is one environment: its turns end at a
closing fence, its answers are the programs' output blocks, and it gives no reward (the verifier scores the text).

    env = open_env(args, tokenizer)                 # one per process: load_data and load_sampler share it
    sampler = make_sampler(..., env=env)            # every backend drives its episodes with `run_episodes`
    completions = sampler.generate(prompts, n, T, top_p, budget, tasks=tasks)   # tasks: the episodes' seeds

`--env <package>:<id>` picks the environment: `builtin:guess` (`GuessNumber`, the tests' game), `gem:<GEM id>` (GEM's
games, e.g. gem:game:GuessTheNumber-v0-easy), or `<module>:<class>`, a class of your own with GEM's (gymnasium's)
`reset(seed) -> (observation, info)` and `step(action) -> (observation, reward, terminated, truncated, info)`.

One driver. `after_segment` and `after_turn` are the state transition, pure functions of an `Episode` that return a
new one; `run_episodes` loops them over rounds of generation: each round the backend generates one segment for every
live episode (`generate(requests, finished, stopped)`, calling `finished(i, segment)` as each request ends), the
environment's answers are waited for when the round ends, and their observations appended. Rounds keep a backend's
batches a function of the samples alone, not of the environment's timing, so rollouts are reproducible.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from common.args import SharedArgs
from common.completion import Completion, EnvStats, Segment, copy_completion, done_future
from common.sandbox import BusyClock

EVAL_TASKS = 1_000_000  # held-out tasks are seeds from here on; training tasks are seeds 0 .. --env-tasks - 1
SUCCESS_RETURN = 1.0  # GEM's LanguageGameReward.success_reward: a game's rewards sum to it when it is won


@dataclass
class Turn:
    """An environment's answer to one model turn."""

    observation: str = ""
    """text appended before the model's next turn (masked out of the loss); not appended when `done`"""
    reward: float = 0.0
    done: bool = False
    success: bool = False
    """with `done`: whether the episode was won (env/success_frac)"""
    error: str = ""
    """the exception the environment raised: the episode ends with reward 0, counted in env/errors"""
    seconds: float = 0.0
    result: Any = None
    """what the environment keeps of the turn for its own statistics (the Python tool: the RunResult)"""


@dataclass
class Episode:
    """One episode being generated: its prompt (index in the call) and sample index, the environment's task (a seed)
    and per-episode state, the ids so far (the model's segments and the observations), their mask and sampler
    log-probs, its record, and what the driver needs next: `action` the text the environment must answer before the
    next turn (None: none pending), `waves` the requests so far (seeds the next), where the last model segment starts
    and the stop string that ended it. `stats`: the environment's own statistics (the Python tool: ToolStats)."""

    prompt: int
    sample: int
    task: Any = None
    state: Any = None
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    record: EnvStats = field(default_factory=EnvStats)
    stats: Any = None
    done: bool = False
    truncated: bool = False
    action: str | None = None
    waves: int = 0
    last_start: int = 0  # where the last model segment begins (its stop string cuts the final text)
    last_stop: str | None = None


class Env:
    """What the driver asks of an environment; one object per process (`open_env`), shared by every episode. A
    subclass overrides what differs: `GymEnv` (GEM's games, your own class, the built-in game), common.tool.Tool."""

    rewards = True
    """its episodes' returns are the sequence reward (the Python tool: False, the verifier scores the text)"""
    early = False
    """an answer depends on the action alone, so HF generate may start it the step a row stops (the Python tool)"""
    max_turns: int | None = None
    """answered turns after which an episode ends (--env-max-turns); None: no cap"""

    def __init__(self) -> None:
        self.clock = BusyClock()  # the sampler marks generation with it (answers overlapping it)

    def start(self, task: Any) -> Any:
        """A new episode's state (None: the environment keeps none)."""
        return None

    def stops(self, ep: Episode) -> list[str]:
        """Strings that end the model's next turn, besides EOS and the template's."""
        return []

    def ends(self, ep: Episode, seg: Segment) -> bool:
        """Whether a turn that ended this way ends the episode unanswered (the Python tool: EOS)."""
        return False

    def action(self, ep: Episode, seg: Segment) -> str | None:
        """The action a turn ends with, which the environment answers; None: it answers nothing, generation goes on."""
        return seg.text

    def answer(self, ep: Episode) -> Future:
        """A future of the Turn answering `ep.action` (a failed future: the environment raised)."""
        raise NotImplementedError

    def observe(self, ep: Episode, turn: Turn) -> list[int]:
        """The ids appended for `turn`'s observation after `ep`'s last turn."""
        raise NotImplementedError

    def new_stats(self) -> Any:
        """A new episode's statistics of the environment's own (None: it keeps none)."""
        return None

    def tally(self, stats: Any, turn: Turn) -> Any:
        """The environment's own statistics after `turn` (a new object)."""
        return stats

    def fields(self, ep: Episode) -> dict[str, Any]:
        """What a finished episode puts in its Completion besides ids, mask, log-probs and text."""
        return {"env": ep.record}

    def finish(self, state: Any) -> None:
        """Releases an episode's state."""

    def close(self) -> None:
        """Releases the environment (idempotent)."""
        _forget(self)


# The state transition ---------------------------------------------------------------------------------------------
def after_segment(ep: Episode, seg: Segment, budget: int, env: Env) -> Episode:
    """`ep` after the model's segment `seg` (cut to `budget` new tokens in all): done (the budget ran out, or the turn
    ends the episode), or waiting for the environment's answer to its `action`, or going on (no action)."""
    room = budget - len(ep.token_ids)
    ids = seg.token_ids[:room]
    logprobs = ep.logprobs + seg.logprobs[: len(ids)] if ep.logprobs is not None and seg.logprobs is not None else None
    new = replace(
        ep,
        token_ids=ep.token_ids + ids,
        mask=ep.mask + [1] * len(ids),
        logprobs=logprobs,
        last_start=len(ep.token_ids),
        last_stop=seg.stop,
        waves=ep.waves + 1,
        action=None,
    )
    if len(seg.token_ids) > room or seg.truncated:  # the budget ran out mid-turn
        return replace(new, done=True, truncated=True)
    if env.ends(ep, seg):
        return replace(new, done=True)
    if len(new.token_ids) >= budget and not env.rewards:  # no room for an answer, and nothing to gain from one
        return replace(new, done=True, truncated=True)
    return replace(new, action=env.action(ep, seg))  # None: generation goes on, nothing appended


def after_turn(ep: Episode, turn: Turn, obs_ids: list[int], budget: int, env: Env) -> Episode:
    """`ep` after the environment answered its action with `turn`, whose observation is `obs_ids`: its reward
    recorded on the turn's last model token, the observation appended with mask 0 (cut to the budget, counted), and
    done when the environment says so, raised, the budget is spent or the turn cap is reached."""
    r = ep.record
    record = replace(
        r,
        turns=r.turns + 1,
        rewards=r.rewards + [turn.reward],
        reward_at=r.reward_at + [len(ep.token_ids) - 1],
        seconds=r.seconds + turn.seconds,
    )
    new = replace(ep, action=None, stats=env.tally(ep.stats, turn))
    if turn.error:
        return replace(new, record=replace(record, error=turn.error), done=True)
    if turn.done:
        return replace(new, record=replace(record, success=turn.success), done=True)
    room = budget - len(ep.token_ids)
    ids = obs_ids[:room]
    record = replace(
        record, obs_tokens=r.obs_tokens + len(ids), obs_truncated=r.obs_truncated + (len(ids) < len(obs_ids))
    )
    new = replace(
        new,
        record=record,
        token_ids=ep.token_ids + ids,
        mask=ep.mask + [0] * len(ids),
        logprobs=None if ep.logprobs is None else ep.logprobs + [0.0] * len(ids),
    )
    if len(new.token_ids) >= budget:
        return replace(new, done=True, truncated=True)
    if env.max_turns is not None and record.turns >= env.max_turns:
        return replace(new, record=replace(record, capped=True), done=True)
    return new


def failed_turn(error: BaseException) -> Turn:
    """The Turn of an environment that raised: the episode ends, reward 0, the error kept (one line: its first
    non-blank line, terminal colours removed)."""
    lines = [x.strip(" *") for x in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()]
    first = next((x for x in lines if x), "")[:200]
    return Turn(done=True, error=f"{type(error).__name__}: {first}")


# The driver -------------------------------------------------------------------------------------------------------
@dataclass
class Request:
    """One generation request of a round: the prefix (prompt + the episode's ids so far), the tokens it may add,
    its stop strings, its seed (vLLM) and `unit`: requests of one unit share their prefix (a prompt's first turns,
    which HF generate samples as one prompt with several return sequences)."""

    prefix: list[int]
    max_tokens: int
    stop: list[str]
    seed: int
    unit: int


def run_episodes(
    env: Env,
    prompts: Sequence[Sequence[int]],
    rows: int,
    budget: int,
    stop: Sequence[str],
    generate: Callable,
    seed: Callable[[Episode], int] = lambda ep: 0,
    tasks: Sequence[Any] | None = None,
) -> list[Episode]:
    """`rows` episodes of every prompt (groups contiguous), driven to their end. `generate(requests, finished,
    stopped)` is the backend: it generates one segment per request and calls `finished(i, segment)` as request i
    ends; where it can (HF generate), `stopped(i, ids, text, stop_string)` the step a request meets a stop string.
    `seed(episode)` seeds its next request; `tasks[i]` starts prompt i's episodes (None: each prompt's index)."""
    episodes = []
    for i in range(len(prompts)):
        task = tasks[i] if tasks is not None else i
        episodes += [Episode(i, j, task=task, state=env.start(task), stats=env.new_stats()) for j in range(rows)]
    try:
        while live := [k for k, ep in enumerate(episodes) if not ep.done]:
            requests = []
            for k in live:
                ep = episodes[k]
                unit = ep.prompt if ep.waves == 0 else len(prompts) + k
                prefix = list(prompts[ep.prompt]) + ep.token_ids
                requests.append(Request(prefix, budget - len(ep.token_ids), list(stop) + env.stops(ep), seed(ep), unit))
            play_round(env, episodes, live, requests, budget, generate)
    finally:
        for ep in episodes:
            env.finish(ep.state)
    return episodes


def play_round(env: Env, episodes: list[Episode], live: list[int], requests: list[Request], budget: int, generate):
    """One round: a segment for each live episode (`requests[i]` is `episodes[live[i]]`'s), each answer started as
    its segment ends, then every answer waited for and its observation appended (an environment that raised ends its
    episode: `failed_turn`). Updates `episodes` in place, one new Episode per transition."""
    answers: dict[int, Future] = {}
    early: dict[int, tuple[str, Future]] = {}

    def finished(i: int, seg: Segment) -> None:
        k = live[i]
        ep = after_segment(episodes[k], seg, budget, env)
        if ep.action is not None:  # the answer starts now, beside the rest of the round
            started = early.pop(i, None)
            answers[k] = started[1] if started and started[0] == ep.action else _answer(env, ep)
        episodes[k] = ep

    def stopped(i: int, ids: list[int], text: str, hit: str | None) -> None:
        if env.early and i not in early:  # HF generate: the row stopped, the batch goes on
            ep = after_segment(episodes[live[i]], Segment(ids, None, text, hit, False), budget, env)
            if ep.action is not None:
                early[i] = (ep.action, _answer(env, ep))

    with env.clock.busy():
        generate(requests, finished, stopped)
    for k, future in answers.items():
        try:
            turn = future.result()
        except Exception as e:  # noqa: BLE001 - an environment's fault ends its episode, not the run
            turn = failed_turn(e)
        ep = episodes[k]
        obs = [] if turn.done or turn.error else env.observe(ep, turn)
        episodes[k] = after_turn(ep, turn, obs, budget, env)


def _answer(env: Env, ep: Episode) -> Future:
    """env.answer, with an environment that raises at once turned into a failed future."""
    try:
        return env.answer(ep)
    except Exception as e:  # noqa: BLE001
        future: Future = Future()
        future.set_exception(e)
        return future


def episode_text(ep: Episode, decode, stop: Sequence[str]) -> str:
    """A finished episode's text: all its ids decoded, the last model segment cut after the template's stop string
    that ended it (as without an environment)."""
    text = decode(ep.token_ids)
    if ep.last_stop is None or ep.last_stop not in stop:
        return text
    head = decode(ep.token_ids[: ep.last_start])
    if not text.startswith(head):  # a character split across the boundary: cut the whole text
        head = ""
    tail = text[len(head) :]
    ends = [i + len(s) for s in stop if (i := tail.find(s)) >= 0]
    return head + (tail[: min(ends)] if ends else tail)


def episode_completions(
    env: Env, episodes: list[Episode], decode, stop: Sequence[str], copies: int = 1
) -> list[Completion]:
    """The Completions of finished episodes, in order, each copied `copies` times (greedy decoding: one episode
    stands for a prompt's n samples)."""
    out = []
    for ep in episodes:
        c = Completion(
            ep.token_ids, episode_text(ep, decode, stop), ep.truncated, ep.logprobs, ep.mask, **env.fields(ep)
        )
        out += [c] if copies == 1 else [copy_completion(c) for _ in range(copies)]
    return out


def token_rewards(completions: Sequence[Completion], width: int) -> list[list[float]]:
    """[N, width] per-token rewards of episodes with an environment: each turn's reward on the turn's last model token
    (EnvStats.reward_at), 0 elsewhere and on completions without an episode record; an episode whose environment
    raised gets none (its return is 0). For algorithms with token-level rewards (ppo.py, reinforce_pp.py)."""
    out = [[0.0] * width for _ in completions]
    for row, c in zip(out, completions):
        if c.env is not None and not c.env.error:
            for r, at in zip(c.env.rewards, c.env.reward_at):
                if 0 <= at < width:
                    row[at] += r
    return out


# Rendering observations as the model's chat template does ------------------------------------------------------
A_MARK, U_MARK, O_MARK = "ASSISTANT-TURN-1f7c", "USER-TURN-1f7c", "OBSERVATION-1f7c"


class ChatFormat:
    """How prompts and observations become ids. With a chat template (`chat`): the first observation is a user message
    rendered with the generation prompt, and each later one the text the template puts between the end of the model's
    turn and the next generation prompt: the rest of the assistant turn's end (less the end-of-turn token the model
    sampled itself, e.g. ChatML's "<|im_end|>", so "\\n"), the user turn wrapping the observation, the generation
    prompt. It is read off the template once, by rendering a two-message chat with and without a third message (the
    delta; verl's agent loop and GEM's chat wrapper render the same messages). Without (raw text, --prompt-template
    none): the prompt is the text with the tokenizer's document prefix (common.data.encode_prompt), an observation is
    its text on lines of its own. `system`: a system prompt before the first observation (--prompt-template
    qwen-boxed: Qwen2.5-Math's, "... put your final answer within \\boxed{}", the form GEM's games read)."""

    def __init__(self, tokenizer, chat: bool, system: str | None = None):
        self.tokenizer, self.system = tokenizer, system
        self.lock = threading.Lock()  # a server's rollouts run in threads; fast tokenizers object to sharing
        self.chat = bool(chat and getattr(tokenizer, "chat_template", None))
        if not self.chat:
            return
        msgs = self.messages(U_MARK) + [{"role": "assistant", "content": A_MARK}]
        base = tokenizer.apply_chat_template(msgs, tokenize=False)
        full = tokenizer.apply_chat_template(
            msgs + [{"role": "user", "content": O_MARK}], tokenize=False, add_generation_prompt=True
        )
        if not full.startswith(base) or A_MARK not in base or full[len(base) :].count(O_MARK) != 1:
            raise SystemExit(
                "--env: the tokenizer's chat template renders a new turn by changing the earlier ones, so observations "
                "cannot be appended by token id; use --prompt-template none (raw text)"
            )
        self.turn_end = base[base.rindex(A_MARK) + len(A_MARK) :]
        self.before, self.after = full[len(base) :].split(O_MARK)

    def prompt_ids(self, text: str) -> list[int]:
        """The episode's prompt: its first observation."""
        if not self.chat:
            from common.data import encode_prompt  # common.data imports this module

            return encode_prompt(text, "none", self.tokenizer)
        rendered = self.tokenizer.apply_chat_template(self.messages(text), tokenize=False, add_generation_prompt=True)
        return self.encode(rendered)

    def messages(self, first: str) -> list[dict[str, str]]:
        """An episode's first messages: the system prompt (if any) and the first observation as the user's."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": first}]

    def observation_text(self, text: str, model_ids: Sequence[int], model_text: str) -> str:
        """The text appended after a model turn (`model_ids`, decoded `model_text`) for an observation `text`."""
        if not self.chat:
            return ("" if not model_text or model_text.endswith("\n") else "\n") + text + "\n"
        end = self.turn_end
        last = self.tokenizer.convert_ids_to_tokens(int(model_ids[-1])) if model_ids else None
        if last and end.startswith(last):  # the model ended its turn itself (its EOS is the template's turn end)
            end = end[len(last) :]
        return end + self.before + text + self.after

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)


# Gymnasium-style environments: GEM's games, your own class, the built-in game ----------------------------------
_RNG_LOCK = threading.Lock()


class EpisodeRandom:
    """The global `random` and NumPy states of one episode. GEM's games (and many others) draw from the global RNGs
    and reseed them in reset(seed); each call runs with the episode's own states swapped in, and the trainer's are put
    back, so episodes are reproducible whatever their interleaving and the trainer's RNG streams are untouched."""

    def __init__(self, seed: int):
        saved = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        self.py, self.np = random.getstate(), np.random.get_state()
        random.setstate(saved[0])
        np.random.set_state(saved[1])

    @contextlib.contextmanager
    def inside(self):
        with _RNG_LOCK:
            saved = random.getstate(), np.random.get_state()
            random.setstate(self.py)
            np.random.set_state(self.np)
            try:
                yield
            finally:
                self.py, self.np = random.getstate(), np.random.get_state()
                random.setstate(saved[0])
                np.random.set_state(saved[1])


class GymEnv(Env):
    """An environment class with GEM's (gymnasium's) interface, one object per episode: `make()` builds one,
    `reset(seed)` returns (observation, info), `step(action)` returns (observation, reward, terminated, truncated,
    info). A task is a seed. A turn is answered at once (in the driver's thread, timed); `info["suffix"]` (GEM: e.g.
    "Enter your next guess.") follows the observation on a line of its own; success is `info["success"]` where the
    game gives it, else a return of at least SUCCESS_RETURN (GEM's games sum to it when won). Its class attribute
    `stop` (if any) lists the strings that end a model turn besides EOS."""

    def __init__(self, make: Callable[[], Any], name: str, fmt: ChatFormat, max_turns: int | None):
        super().__init__()
        self.make, self.name, self.format, self.max_turns = make, name, fmt, max_turns
        self.stop = list(getattr(make, "stop", None) or [])

    def first_observation(self, task: Any) -> str:
        """The task's first observation (its prompt's text)."""
        rng = EpisodeRandom(int(task))
        with rng.inside():
            obs, info = self.make().reset(seed=int(task))
        return _with_suffix(obs, info)

    def start(self, task: Any) -> dict[str, Any]:
        rng = EpisodeRandom(int(task))
        with rng.inside():
            game = self.make()
            game.reset(seed=int(task))
        return {"game": game, "rng": rng}

    def stops(self, ep: Episode) -> list[str]:
        return list(self.stop)

    def answer(self, ep: Episode) -> Future:
        start, state = time.perf_counter(), ep.state
        with state["rng"].inside():
            obs, reward, terminated, truncated, info = state["game"].step(ep.action)
        reward = float(reward)
        done = bool(terminated or truncated)
        won = info.get("success") if isinstance(info, dict) and "success" in info else None
        success = bool(won) if won is not None else ep.record.reward + reward >= SUCCESS_RETURN - 1e-9
        turn = Turn(_with_suffix(obs, info), reward, done, done and success, seconds=time.perf_counter() - start)
        return done_future(turn)

    def observe(self, ep: Episode, turn: Turn) -> list[int]:
        model_ids = ep.token_ids[ep.last_start :]
        text = self.format.observation_text(turn.observation, model_ids, self.format.decode(model_ids))
        return self.format.encode(text)

    def finish(self, state: Any) -> None:
        close = getattr(state and state["game"], "close", None)
        if callable(close):
            close()


def _with_suffix(obs: Any, info: Any) -> str:
    suffix = info.get("suffix") if isinstance(info, dict) else None
    return f"{obs}\n{suffix}" if suffix else str(obs)


class GuessNumber:
    """The built-in game (`--env builtin:guess`): guess a hidden digit 0-9 in at most 4 turns; a turn ends at the
    first digit the model writes (its guess), and a wrong guess is answered ">" (the number is larger) or "<". Reward
    1 when guessed, else 0. Binary search always wins; a policy blind to the answers wins at most 4 in 10 (guessing
    4 fixed digits) and a uniform random guesser 1 - 0.9^4 = 0.34: a toy model learns it on a CPU in minutes
    (docs/environments.md)."""

    stop = [str(d) for d in range(10)]
    turns = 4

    def reset(self, seed: int | None = None):
        self.number = random.Random(seed).randrange(10)
        self.guesses = 0
        return "guess 0-9:", {}

    def step(self, action: str):
        self.guesses += 1
        digits = [ch for ch in action if ch.isdigit()]
        guess = int(digits[-1]) if digits else None
        if guess == self.number:
            return "=", 1.0, True, False, {"success": True}
        done = self.guesses >= self.turns
        hint = "?" if guess is None else ">" if self.number > guess else "<"
        return hint, 0.0, done, False, {"success": False}


BUILTIN = {"guess": GuessNumber}


# Choosing and opening an environment -----------------------------------------------------------------------------
def env_factory(spec: str) -> tuple[Callable[[], Any], str]:
    """(a callable that builds one episode's game, its name) for --env `spec` = "<package>:<id>", or a one-line
    SystemExit naming --env (unknown package, id or class)."""
    package, sep, name = spec.partition(":")
    if not sep or not package or not name:
        raise SystemExit(
            f"--env must be <package>:<id> (e.g. builtin:guess, gem:game:GuessTheNumber-v0-easy), got {spec!r}"
        )
    if package == "builtin":
        if name not in BUILTIN:
            raise SystemExit(f"--env {spec}: no built-in environment {name!r}; built in: {', '.join(BUILTIN)}")
        return BUILTIN[name], name
    if package == "gem":
        try:
            import gem
            from gem.envs.registration import ENV_REGISTRY
        except ImportError as e:
            raise SystemExit(f"--env {spec}: GEM is not installed ({e}); pip install gem-llm==0.1.0") from None
        if name not in ENV_REGISTRY:
            near = [k for k in ENV_REGISTRY if k.split("-")[0] == name.split("-")[0]][:5] or list(ENV_REGISTRY)[:5]
            raise SystemExit(f"--env {spec}: GEM has no environment {name!r}; e.g. {', '.join(near)}")

        def make():
            return gem.make(name)

        return make, name
    try:
        module = importlib.import_module(package)
    except ImportError as e:
        raise SystemExit(
            f"--env {spec}: cannot import {package!r} ({e}); packages: builtin, gem, or a module"
        ) from None
    cls = getattr(module, name, None)
    if not callable(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise SystemExit(f"--env {spec}: {package} has no class {name!r} with reset(seed) and step(action)")
    return cls, name


def check_env_args(args: SharedArgs) -> None:
    """One-line SystemExit for bad --env / --env-* values and combinations (before anything is written)."""
    if args.env == "none":
        return
    make, _ = env_factory(args.env)
    try:  # one task started: a game that needs what is not here (GEM's word games: NLTK's lists) says so now
        with EpisodeRandom(0).inside():
            make().reset(seed=0)
    except Exception as e:  # noqa: BLE001 - any failure becomes one line
        raise SystemExit(f"--env {args.env}: cannot start a task here: {failed_turn(e).error}") from None
    if args.tool != "none":
        raise SystemExit("--env and --tool: one environment a run; the Python tool is its own (--tool python)")
    if args.env_max_turns < 1 or args.env_tasks < 1 or args.env_eval_tasks < 1:
        raise SystemExit("--env-max-turns, --env-tasks and --env-eval-tasks must be >= 1")
    if args.gt_injection:
        raise SystemExit("--gt-injection needs reference solutions; an environment's episodes have none: drop it")


_OPEN: list[tuple[Any, Any, Env]] = []  # (spec, tokenizer, env): the process's environments


def open_env(args: SharedArgs, tokenizer) -> Env | None:
    """This process's environment for `args` (--env, or --tool python; None without either): built on first use
    (the Python tool checks its sandbox then, once), the same object afterwards, so the data (prompts,
    demonstrations) and the sampler share it; closing it (the sampler's close, at the end of the run) forgets it."""
    from common.tool import Tool, tool_config  # common.tool builds on this module

    spec = (args.env, args.env_max_turns, args.prompt_template, tool_config(args))
    if args.env == "none" and spec[3] is None:
        return None
    for key, tok, env in _OPEN:
        if key == spec and tok is tokenizer:
            return env
    if args.env != "none":
        make, name = env_factory(args.env)
        from common.data import SYSTEM_BOXED  # common.data imports this module

        system = SYSTEM_BOXED if args.prompt_template == "qwen-boxed" else None
        fmt = ChatFormat(tokenizer, args.prompt_template != "none", system)
        env = GymEnv(make, name, fmt, args.env_max_turns)
    else:
        env = Tool(spec[3], tokenizer)
    _OPEN.append((spec, tokenizer, env))
    return env


def _forget(env: Env) -> None:
    _OPEN[:] = [item for item in _OPEN if item[2] is not env]
