"""Requests in, completions out, and the per-sequence state the engine keeps in between."""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# temperatures below this are greedy (logits / T overflows near 0); vLLM draws the same line
GREEDY_BELOW = 1e-5


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is not a count or a seed


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: greedy when temperature < GREEDY_BELOW (0, the default). top_k keeps the k likeliest
    tokens, then top_p the likeliest of those whose mass (renormalized over them) reaches p, as in Hugging Face's
    and vLLM's samplers. seed: any integer; its low 32 bits pick the draws."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # run to max_new_tokens past EOS (throughput benchmarks on random weights)

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (_is_number(self.temperature) and 0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None, defaults: SamplingParams | None = None) -> SamplingParams:
        """Per-row overrides on top of `defaults`; unknown keys raise ValueError."""
        base = dict((defaults or cls()).__dict__)
        unknown = set(values or {}) - set(base)
        if unknown:
            raise ValueError(f"unknown sampling_params keys: {sorted(unknown)}")
        for key, value in (values or {}).items():
            if value is not None:
                base[key] = _stops(value) if key == "stop" else value
        return cls(**base)


def _stops(value: Any) -> tuple:
    """A row's `stop`: one string, or a list of them (checked by SamplingParams)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise ValueError(f"stop must be a string or a list of strings, got {value!r}")


def _token_ints(ids: list | tuple) -> bool:
    """Whether every id is an integer (Python's or NumPy's, not a bool)."""
    return all(type(t) is int for t in ids) or all(  # fast path first
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]  # or a 1-D NumPy array or torch tensor of integer ids, taken as its list
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        ids = self.prompt_token_ids
        if not isinstance(ids, (list, tuple, str)) and getattr(ids, "ndim", None) == 1 and hasattr(ids, "tolist"):
            try:
                converted = ids.tolist()  # Python ints (floats or bools stay what they are: error rows)
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                return  # a tensor without data (the meta device): an error row, as any other type
            if _token_ints(converted):  # else its error row names the array's type, not the list's
                self.prompt_token_ids = converted

    def problem(self, max_model_len: int, vocab_size: int | None = None) -> str | None:
        """Why the engine cannot run this request, or None: an empty or too long prompt, or one that is not a list
        of token ids in [0, vocab_size)."""
        ids = self.prompt_token_ids
        if not isinstance(ids, (list, tuple)) or not _token_ints(ids):
            return f"prompt_token_ids must be a list of integer token ids, got {type(ids).__name__}"
        n = len(ids)
        if n == 0:
            return "empty prompt"
        if n >= max_model_len:
            return (f"prompt of {n} tokens leaves no room to generate within max_model_len={max_model_len} (the "
                    "model's context, or --max-model-len)")
        if vocab_size is not None and not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            return f"token id {bad} is outside the model's vocabulary [0, {vocab_size})"
        return None

    def may_stop_early(self, eos_ids: set[int]) -> bool:
        """Whether it may end before max_new_tokens: a stop string, or an EOS (of `eos_ids`) it does not ignore. Such
        a row takes pages as it grows (EngineConfig.page_growth); one that runs to max_new_tokens gains nothing from
        growing and might be preempted, so it reserves its whole length."""
        return bool(self.sampling.stop) or (bool(eos_ids) and not self.sampling.ignore_eos)

    def error(self, message: str) -> Completion:
        n = len(self.prompt_token_ids) if isinstance(self.prompt_token_ids, (list, tuple)) else 0
        return Completion(self.request_id, "", [], n, "error", message)


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    num_input_tokens: int
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    ttft_s: float | None = None
    decode_s: float | None = None  # first token to last, less the time it spent preempted (preempted_s)
    # times its cache was given up for others' and rebuilt by a prefill of prompt + output (each rebuild makes one
    # of its tokens, so decode steps made len(token_ids) - 1 - preemptions); an OOM reset starts the count again
    preemptions: int = 0
    preempted_s: float = 0.0  # time from its preemptions to the token each rebuild made


@dataclass(eq=False)
class Submission:
    """One LLMEngine.add() call: its completions in request order, filled in as its sequences finish."""

    results: list[Completion | None]
    t_start: float  # time to first token counts from here
    on_done: Callable[[Submission], None] | None = None
    pending: int = 0  # sequences not finished yet
    # the cache's peak content (packed and residual bytes, and the same tokens in bf16) while it was in flight
    peaks: dict[str, int] = field(default_factory=lambda: {"kv_cache_bytes": 0, "kv_cache_bytes_bf16": 0})
    busy_s: float = 0.0  # its share of the engine's time (EngineService)


@dataclass
class Sequence:
    """A request in flight: its slot and pages in the cache, and the tokens made so far."""

    index: int  # position in its submission's request list
    request: Request
    max_new_tokens: int
    seed: int
    submission: Submission | None = None
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None  # set when a stop string cuts the output
    t_first: float | None = None
    preemptions: int = 0  # times it gave up its cache to older sequences (Scheduler.preempt) and was requeued
    t_preempted: float | None = None  # perf_counter at its last preemption, until its rebuild's first token
    preempted_s: float = 0.0  # time out of the cache: from each preemption to the token its rebuild made
    grows: bool = False  # takes pages as it grows (EngineConfig.page_growth, for a row that may stop early)

    @classmethod
    def start(cls, index: int, request: Request, max_new_tokens: int, submission: Submission | None = None
              ) -> Sequence:
        seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(31)
        return cls(index=index, request=request, max_new_tokens=max_new_tokens, seed=seed, submission=submission)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def total_len(self) -> int:
        """Tokens the sequence will occupy in the cache at most (the last token is never fed back)."""
        return self.prompt_len + self.max_new_tokens - 1

    def plan_len(self, share: float) -> int:
        """Tokens the memory plan sizes this sequence's slot for: its whole length, or if it grows its prompt and
        `share` of its new tokens (EngineConfig.growth_plan_share; at 0.5 about what it holds over its life)."""
        return self.prompt_len + int(share * (self.max_new_tokens - 1)) if self.grows else self.total_len

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill of this sequence runs: its prompt, and after a preemption the output so far as well."""
        ids = self.request.prompt_token_ids
        return list(ids) + self.output if self.output else ids

    @property
    def cached_len(self) -> int:
        """Tokens in the cache after the next decode step stores its input token."""
        return self.prompt_len + len(self.output)

    def hit_stop_string(self, tokenizer) -> bool:
        """True (and `text` cut before it) when the output now contains one of the request's stop strings."""
        stops = self.request.sampling.stop
        if not stops:
            return False
        # A stop string first appears at the step whose token completes it, so it lies in the last few tokens:
        # decode only those each step (decoding the whole output every step is quadratic in its length), and
        # the whole output once a tail shows a stop (the cut position comes from the whole text). A stop of m
        # characters spans at most 4m tokens (byte-fallback tokens carry a UTF-8 byte each).
        window = 4 * max(len(s) for s in stops) + 8
        if len(self.output) > window:
            tail = tokenizer.decode(self.output[-window:], skip_special_tokens=True)
            if not any(s in tail for s in stops):
                return False
        text = tokenizer.decode(self.output, skip_special_tokens=True)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            self.text = text[:cut]
            return True
        return False
