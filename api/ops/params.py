"""The parameters the console's endpoints share: job filters, paths, and the
404 they answer for an unknown job, client or key."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from litestar.openapi.spec import OpenAPIFormat
from litestar.params import Parameter, PathParameter

from api.ops.schemas import BIGINT_MAX
from shared.status import ErrorCode, JobStatus

StatusParam = Annotated[JobStatus | None, Parameter(description="Only jobs in this status.")]
ClientParam = Annotated[int | None, Parameter(ge=1, le=BIGINT_MAX,
                                              description="Only this client's jobs (`client_id` of /ops/api/clients).")]
ErrorParam = Annotated[ErrorCode | None, Parameter(description="Only failed jobs with this error code.")]
AfterParam = Annotated[datetime | None,
                       Parameter(description="Only jobs created at or after this time (UTC if no zone).")]
BeforeParam = Annotated[datetime | None, Parameter(description="Only jobs created before this time (UTC if no zone).")]
JobIdParam = Annotated[str, PathParameter(description="The job's job_id.", schema_extra={"format": OpenAPIFormat.UUID})]
ClientIdPath = Annotated[int, PathParameter(ge=1, le=BIGINT_MAX, description="`client_id` of /ops/api/clients.")]

NOT_FOUND = {404: "No such job, client or key."}


def utc(moment: datetime | None) -> datetime | None:
    """A time without a zone is taken as UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)
