"""How one job's call ended: the Outcome its executor (worker/executor.py)
returns, which travels to the round in the job's ``Finished`` report
(worker/inbox.py) and becomes the end the job needs written
(worker/held.py)."""

from __future__ import annotations

import msgspec

from shared.status import ErrorCode
from worker.rows import Draft
from worker.writing import CallRecord


class Completed(msgspec.Struct, frozen=True):
    draft: Draft
    call: CallRecord


class Failed(msgspec.Struct, frozen=True):
    error_code: ErrorCode
    message: str
    call: CallRecord


class Stopped(msgspec.Struct, frozen=True):
    """The call was stopped (``reason``: the shutdown, or what ended the
    job elsewhere); ``call`` is where it stood."""

    call: CallRecord
    reason: str


class Lost(msgspec.Struct, frozen=True):
    """The job was ended elsewhere before a retry could be sent: nothing
    more was sent; ``call`` is the refused attempt, whose row (and the
    job's charge) still says what whoever ended the job assumed."""

    reason: str
    call: CallRecord


Outcome = Completed | Failed | Stopped | Lost
