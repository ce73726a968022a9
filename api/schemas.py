"""Response bodies of the api (request bodies: shared/story_request.py)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

import msgspec

from api.rows import StoryRow
from shared.status import JobStatus, Lane

_LANE = msgspec.Meta(description="interactive: written now; batch: within the day, at half the price "
                                 "(usually within the hour).")
_DUE_BY = msgspec.Meta(description=(
    "Batch lane only: when the story is due at the latest (RFC 3339): its batch's expiry once the batch is "
    "sent, else the end of the collection it waits for plus 24 hours. Null on the interactive lane."))


class JobAccepted(msgspec.Struct, frozen=True):
    job_id: uuid.UUID
    status: JobStatus
    lane: Annotated[Lane, _LANE] = Lane.INTERACTIVE
    due_by: Annotated[datetime, _DUE_BY] | None = None


class JobError(msgspec.Struct, frozen=True):
    code: str
    message: str


class WrittenStory(msgspec.Struct, frozen=True):
    """A story as it was written: its text and what writing it took."""

    story_id: uuid.UUID
    title: str
    text: str
    model: str
    prompt_version: str
    input_tokens: int
    output_tokens: int


class Story(WrittenStory, frozen=True):
    """A written story: in a completed job's state, and at GET /stories/{story_id}."""

    job_id: uuid.UUID
    cost_usd: Annotated[str, msgspec.Meta(description="Decimal, in US dollars.")]
    created_at: datetime

    @classmethod
    def of(cls, row: StoryRow) -> Story:
        return cls(story_id=row.story_id, job_id=row.job_id, title=row.title, text=row.body, model=row.model,
                   prompt_version=row.prompt_version, input_tokens=row.input_tokens,
                   output_tokens=row.output_tokens, cost_usd=str(row.cost_usd), created_at=row.created_at)


class JobDraft(msgspec.Struct, frozen=True):
    """The story as it is written so far, while the job runs."""

    text: Annotated[str, msgspec.Meta(description=(
        "The text written so far, as the model streams it (its first line is usually `Title: ...`); with "
        "`?since=N`, only the text after character N."))]
    chars: Annotated[int, msgspec.Meta(ge=0, description=(
        "How long the whole draft is, in Unicode code points: the `since` of the next poll."))]
    updated_at: Annotated[datetime, msgspec.Meta(description="When the draft last grew.")] | None


class JobState(msgspec.Struct, frozen=True):
    """Where a job stands. Fields that do not apply to its status are null."""

    job_id: uuid.UUID
    status: JobStatus
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    queue_position: Annotated[int, msgspec.Meta(ge=1, description="1 = next to start (pending only).")] | None
    progress: Annotated[int, msgspec.Meta(ge=0, description="Output tokens written so far (running).")] | None
    percent_done: Annotated[int, msgspec.Meta(
        ge=0, le=100, description=("How much of the story is written: 0 while pending, from the output "
                                   "written against what the story's length usually takes while running "
                                   "(never 100 before it is done), 100 when completed; null when failed.")
    )] | None
    estimated_seconds_remaining: Annotated[
        float, msgspec.Meta(ge=0, description="From the pace of recent jobs; null when unknown.")
    ] | None
    story: Story | None
    story_url: str | None
    error: JobError | None
    lane: Annotated[Lane, _LANE] = Lane.INTERACTIVE
    due_by: Annotated[datetime, _DUE_BY] | None = None
    draft: Annotated[JobDraft, msgspec.Meta(description=(
        "Running only: the story as it is written so far (null otherwise; the final text is `story`)."))] | None = None


class Health(msgspec.Struct, frozen=True):
    status: Literal["ok"]
