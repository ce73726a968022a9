"""The one versioned prompt template. Its version is stored with every story,
so a change of wording is visible in the data: bump PROMPT_VERSION with it."""

from __future__ import annotations

import math

from shared.story_request import NAME_MAX_CHARS, PROMPT_MAX_CHARS, StoryRequest

PROMPT_VERSION = "bedtime-v1"

SYSTEM = (
    "You write bedtime stories for young children. Every story is calm, kind and "
    "age-appropriate: no violence, no fear that is not soothed, no brand names. It ends "
    "with the characters safe, warm and falling asleep. Write in plain prose without "
    "markdown. The first line is the title, as 'Title: <title>'; the story follows."
)

# output token budget by requested length; LLM_MAX_TOKENS caps it
LENGTH_TOKENS = {"short": 800, "medium": 1600, "long": 3200}
LENGTH_WORDS = {"short": "about 300 words", "medium": "about 600 words", "long": "about 1200 words"}


def user_message(request: StoryRequest) -> str:
    parts = [f"Write a bedtime story of {LENGTH_WORDS[request.length]} about: {request.prompt.strip()}"]
    if request.child_name:
        parts.append(f"The child listening is called {request.child_name.strip()}; make them a gentle part of it.")
    if request.age is not None:
        parts.append(f"The child is {request.age} years old: choose words and ideas for that age.")
    parts.append(f"Write it in the language with BCP 47 tag '{request.language}'.")
    return "\n".join(parts)


def max_tokens(request: StoryRequest, ceiling: int) -> int:
    return min(LENGTH_TOKENS[request.length], ceiling)


# the tokens of a request's framing (roles, message boundaries) beyond its text
_FRAMING_TOKENS = 32
# a common English text's bytes per token, for the rate limiter's estimate
_BYTES_PER_TOKEN = 3


def input_tokens_at_most(request: StoryRequest) -> int:
    """An upper bound on the request's input tokens: a byte-level tokenizer's
    tokens each stand for at least one byte of text, so the UTF-8 length of
    what is sent bounds them. A spend budget reserves this."""
    return len(SYSTEM.encode()) + len(user_message(request).encode()) + _FRAMING_TOKENS


def _largest_request() -> StoryRequest:
    widest = "\U0001f319"  # four bytes in UTF-8, the most a character takes
    # the longest language tag StoryRequest accepts: 3 letters and three 8-character subtags
    return StoryRequest(prompt=widest * PROMPT_MAX_CHARS, child_name=widest * NAME_MAX_CHARS, age=12,
                        length="long", language="zzz" + "-abcdefgh" * 3)


def input_tokens_estimate(request: StoryRequest) -> int:
    """A likely count of the request's input tokens, which the shared rate
    limiter reserves before the call and corrects with the provider's count
    after it."""
    return math.ceil(input_tokens_at_most(request) / _BYTES_PER_TOKEN)


# the estimate of the largest request the api accepts: the rate bucket must
# hold at least that many input tokens, or such a job could never start
INPUT_TOKENS_ESTIMATE_MAX = input_tokens_estimate(_largest_request())


def split_title(text: str) -> tuple[str, str]:
    """(title, body) from the model's answer; a missing title line is tolerated."""
    stripped = text.strip()
    first, _, rest = stripped.partition("\n")
    line = first.strip().lstrip("#").strip()
    if line.lower().startswith("title:"):
        title = line[len("title:"):].strip().strip('"*')
        return (title or "A bedtime story")[:200], rest.strip()
    return "A bedtime story", stripped
