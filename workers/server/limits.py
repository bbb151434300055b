"""The bounds on one request's work, in one place (README's "Request limits" lists them).

Every per-request structure whose cost grows with the input is bounded before
anything is built from it: setup (parsing, compiling automata) stays within
milliseconds, and the per-token work that lands on the engine thread, which
every running request shares, stays small. The bounds sit far above what real
clients send; beyond one, the answer is a 400 naming it.
"""
from __future__ import annotations

from .errors import ApiError

MAX_N = 16                 # choices per request: each is an engine request (a batch slot)
MAX_CHOICES = 64           # prompts x n
MAX_LOGPROBS = 20          # OpenAI's top_logprobs limit, vLLM's default --max-logprobs
MAX_STOP_STRINGS = 128     # OpenAI allows 4; vLLM has no bound
MAX_STOP_CHARS = 512       # per stop string
MAX_STOP_TOKEN_IDS = 256   # each token is checked against them
MAX_LOGIT_BIAS = 1024      # entries (OpenAI's limit is 300); each row adds them every step
MAX_MESSAGES = 2048
MAX_GUIDED_CHOICES = 1024
MAX_GUIDED_CHOICE_CHARS = 4096   # per choice
MAX_REGEX_CHARS = 4096     # and the NFA: workers/engine/guided/regex.py MAX_STATES
# JSON schemas: workers/engine/guided/schema.py (OpenAI's structured-output limits)


def too_many(param: str, what: str, limit: int, got: int) -> ApiError:
    return ApiError(400, f"'{param}' may have at most {limit} {what}, got {got}", param=param,
                    code="invalid_value")


def check_count(param: str, items: list | dict, limit: int, what: str) -> None:
    if len(items) > limit:
        raise too_many(param, what, limit, len(items))


def check_stops(stops: list[str]) -> None:
    """At most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS each: their
    automaton (workers/engine/stopping.py) is then ~1 MB and built in tens of ms at most."""
    check_count("stop", stops, MAX_STOP_STRINGS, "stop strings")
    for i, s in enumerate(stops):
        if not s:
            raise ApiError(400, "'stop' strings must not be empty", param="stop",
                           code="invalid_value")
        if len(s) > MAX_STOP_CHARS:
            raise ApiError(400, f"'stop' strings may have at most {MAX_STOP_CHARS} characters, "
                           f"stop[{i}] has {len(s)}", param="stop", code="invalid_value")
