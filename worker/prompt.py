"""The one versioned prompt template. Its version is stored with every story,
so a change of wording is visible in the data: bump PROMPT_VERSION with it."""

from __future__ import annotations

from shared.story_request import StoryRequest

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


def split_title(text: str) -> tuple[str, str]:
    """(title, body) from the model's answer; a missing title line is tolerated."""
    stripped = text.strip()
    first, _, rest = stripped.partition("\n")
    line = first.strip().lstrip("#").strip()
    if line.lower().startswith("title:"):
        title = line[len("title:"):].strip().strip('"*')
        return (title or "A bedtime story")[:200], rest.strip()
    return "A bedtime story", stripped
