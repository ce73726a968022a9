"""Where a list goes on from, given out as an opaque token (a page's
``next_cursor``, a pending count's ``through``) and read back from one."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated

import msgspec

from api.ops.schemas import BIGINT_MAX
from api.problems import FieldError, ProblemError


class Position(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Where a list goes on from (below id; below (at, id) for live lists),
    or the last id a cancel confirmed; given out as an opaque token."""

    id: Annotated[int, msgspec.Meta(ge=0, le=BIGINT_MAX)]
    at: datetime | None = None

    def token(self) -> str:
        return base64.urlsafe_b64encode(msgspec.json.encode(self)).decode().rstrip("=")

    @classmethod
    def from_token(cls, token: str, field: str) -> Position:
        """The position a token names; a 400 naming ``field`` if the api did not make it."""
        try:
            return msgspec.json.decode(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)), type=cls)
        except (binascii.Error, ValueError, msgspec.DecodeError):
            raise ProblemError(400, "Invalid request", f"{field}: not a value this api gave",
                               errors=[FieldError(field=field, message="not a value this api gave")]) from None
