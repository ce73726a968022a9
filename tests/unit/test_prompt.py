"""The prompt (shared/prompt.py): every option in the message, the title read
back from the story."""

from __future__ import annotations

from shared import prompt
from shared.story_request import StoryRequest


def test_the_title_line_is_split_from_the_story() -> None:
    """'Title: X' on the first line becomes the title; without it a default title is used."""
    assert prompt.split_title("Title: The Owl\n\nOnce upon a time.") == ("The Owl", "Once upon a time.")
    assert prompt.split_title("# Title: **The Owl**\nText") == ("The Owl", "Text")
    assert prompt.split_title("Once upon a time.") == ("A bedtime story", "Once upon a time.")


def test_the_prompt_carries_every_option() -> None:
    """The child's name, age, length and language all reach the message, within the token budget."""
    request = StoryRequest(prompt="a fox", child_name="Mia", age=5, length="short", language="fr")
    message = prompt.user_message(request)
    assert all(part in message for part in ("a fox", "Mia", "5 years", "300 words", "'fr'"))
    assert prompt.max_tokens(request, 4000) == prompt.LENGTH_TOKENS["short"]
    assert prompt.max_tokens(StoryRequest(prompt="x", length="long"), 1000) == 1000
