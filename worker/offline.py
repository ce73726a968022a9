"""The offline story writer: deterministic text after OFFLINE_DELAY_S, no
network. For demos and tests only; the worker says so loudly when it uses it."""

from __future__ import annotations

import asyncio
import hashlib

from shared import prompt
from shared.story_request import StoryRequest
from worker.writing import FREE, Draft, JobCall, Price

_ANIMALS = ("owl", "hedgehog", "otter", "fox", "bear cub", "little whale", "rabbit", "tortoise")
_PLACES = ("a quiet meadow", "a hill under the stars", "a warm burrow", "a moonlit lake", "an old oak tree")
# how many slices a delayed story is "streamed" in, so progress and the
# draft can be seen
_STEPS = 10


class OfflineWriter:
    provider = "offline"
    model = "offline-writer"
    price: Price = FREE

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def compose(self, request: StoryRequest) -> tuple[str, str]:
        seed = hashlib.sha256(request.prompt.encode("utf-8", "replace")).digest()
        animal = _ANIMALS[seed[0] % len(_ANIMALS)]
        place = _PLACES[seed[1] % len(_PLACES)]
        hero = request.child_name or f"a small {animal}"
        title = f"The {animal.title()} and {request.prompt.strip()[:60]}"
        sentences = [
            f"Once upon a time, in {place}, there lived {hero}.",
            f"Tonight the story was about {request.prompt.strip()}.",
            "The wind hummed softly and the stars came out one by one.",
            f"{hero[0].upper() + hero[1:]} listened to the night, and the night listened back.",
            "Everything that had been busy all day grew slow and still.",
            "A warm blanket, a last yawn, and eyes that closed all by themselves.",
            "And so, safe and sound, everyone drifted off to sleep. The end.",
        ]
        repeat = {"short": 1, "medium": 2, "long": 4}[request.length]
        body = "\n\n".join(" ".join(sentences) for _ in range(repeat))
        return title, body

    async def write(self, request: StoryRequest, call: JobCall) -> Draft:
        title, body = self.compose(request)
        words = len(body.split())
        # nothing leaves the machine, but the ledger says what a provider would have done
        call.sending()
        call.accepted()
        call.input_tokens = len(prompt.user_message(request).split()) + len(prompt.SYSTEM.split())
        # streamed as a model answers: its title line, then the story
        answer = f"Title: {title}\n\n{body}"
        if self.delay_s > 0:
            for step in range(1, _STEPS + 1):
                await asyncio.sleep(self.delay_s / _STEPS)
                call.text.append(answer[len(answer) * (step - 1) // _STEPS:len(answer) * step // _STEPS])
                call.output_tokens = words * step // _STEPS
        else:
            call.text.append(answer)
        call.finished(call.input_tokens, words)
        return Draft(
            title=title,
            body=body,
            model=self.model,
            prompt_version=prompt.PROMPT_VERSION,
            input_tokens=call.input_tokens,
            output_tokens=call.output_tokens,
            cost_usd=call.cost_usd,
        )

    async def aclose(self) -> None:
        return None
