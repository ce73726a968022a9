"""The Message Batches part of the fake Anthropic provider, mounted by
tests/fakes/anthropic_server.py on ``/v1/messages/batches``.

It keeps batches as the real API describes them (``in_progress`` →
``canceling`` → ``ended``; request counts that stay ``processing`` until the
whole batch ends; ``expires_at`` a day after creation; results as JSONL only
once ended, in an order of their own), and it records what it billed: one
``Billed`` per ``succeeded`` request of an ended batch, nothing for
``errored``, ``canceled`` or ``expired``. That record is how a test proves
"billed at most once" across batches.

A test decides when a batch ends: ``end_batch(id)``, or a plan's
``auto_end_s`` (checked whenever a request or a test looks at the batch), or
the clock passing ``expires_at`` (``clock`` is injectable, so a test can move
past a day without waiting). Faults are planned as the messages part plans
its answers: ``queue(BatchPlan(...))`` for the next creates,
``queue_items_for(fragment, ItemPlan(...))`` for how requests end,
``queue_fault(op, Fault(...))`` for the next retrieve, list, results, cancel
or delete.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from urllib.parse import parse_qs

PREFIX = "/v1/messages/batches"
# what the API accepts, as documented
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_REQUESTS = 100_000
LIST_LIMIT_DEFAULT = 20
LIST_LIMIT_MAX = 1000
EXPIRES_AFTER = timedelta(hours=24)
# results are kept 29 days from creation; then the batch is archived
ARCHIVED_AFTER = timedelta(days=29)

ResultType = Literal["succeeded", "errored", "canceled", "expired"]
Operation = Literal["retrieve", "list", "results", "cancel", "delete"]
OPERATIONS: tuple[Operation, ...] = ("retrieve", "list", "results", "cancel", "delete")

_ERROR_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                 500: "api_error", 529: "overloaded_error"}


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class ItemPlan:
    """How one request of a batch ends."""

    result: ResultType = "succeeded"
    # errored: the error's type, e.g. invalid_request_error (the request is
    # wrong: sending it again cannot help), api_error or overloaded_error
    error_type: str = "api_error"
    # succeeded: the story's text, instead of generated filler
    text: str | None = None
    # succeeded: the usage reported, instead of word counts; any JSON value,
    # so that a test can send absurd ones (-1, 3e9, "many", None)
    input_tokens: Any = None
    output_tokens: Any = None
    # being processed when a cancel comes: it still ends as planned (and a
    # success is billed); the batch stays canceling until end_batch()
    in_progress: bool = False
    # the line's "result" object as sent, instead of the one built from the
    # above (e.g. {"type": "mystery"}); billing still follows ``result``
    result_json: Mapping[str, Any] | None = None
    # the whole JSONL line as sent (e.g. "not json"); billing still follows ``result``
    line: str | None = None


@dataclass(frozen=True)
class BatchPlan:
    """How to answer one create, and how the batch it makes runs."""

    # a status other than 200 refuses the create: no batch is made
    status: int = 200
    retry_after_s: int | None = None
    # headers added to an error answer (e.g. ("x-should-retry", "false"))
    headers: tuple[tuple[str, str], ...] = ()
    # with a status other than 200: the batch is made all the same (a 5xx
    # sent after the work was done)
    made_anyway: bool = False
    # the batch is made, then the connection is closed before any answer
    drop_answer: bool = False
    # the batch is made, and the answer waits this long (past the client's timeout)
    answer_after_s: float | None = None
    # fields of the create's answer replaced as they are (a garbled answer)
    answer_patch: Mapping[str, Any] = field(default_factory=dict)
    # the batch ends by itself this long after its creation; None: only
    # end_batch(), a cancel or expiry end it
    auto_end_s: float | None = None
    # how its requests end, by custom_id; the others by queue_items_for, then default_item
    items: Mapping[str, ItemPlan] = field(default_factory=dict)
    default_item: ItemPlan = field(default_factory=ItemPlan)


@dataclass(frozen=True)
class Fault:
    """How to spoil one answer of a retrieve, list, results, cancel or delete."""

    # close the connection without an answer; a cancel or delete has taken
    # effect first (the worse case: it happened, and the caller cannot know)
    drop: bool = False
    # answer this error status instead; nothing is done
    status: int | None = None
    retry_after_s: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    # results: close the connection after this many lines (and, with
    # mid_line, after half of the next one)
    after_lines: int | None = None
    mid_line: bool = False
    # fields of the batch in the answer replaced as they are (retrieve,
    # cancel, and every batch of a list page): absurd values
    patch: Mapping[str, Any] = field(default_factory=dict)
    # list: fields of the page replaced (has_more, first_id, last_id)
    page_patch: Mapping[str, Any] = field(default_factory=dict)
    # only for this batch; None: the next such request, whatever its batch
    batch_id: str | None = None


@dataclass
class Item:
    """One request of a batch, and how it ended."""

    custom_id: str
    params: dict[str, Any]
    plan: ItemPlan
    result: ResultType | None = None
    input_tokens: Any = None
    output_tokens: Any = None

    @property
    def prompt(self) -> str:
        return prompt_of(self.params)


@dataclass
class Batch:
    id: str
    number: int
    created_at: datetime
    items: list[Item]
    plan: BatchPlan
    ended_at: datetime | None = None
    cancel_initiated_at: datetime | None = None
    deleted: bool = False
    # the order its results are listed in, fixed when it ends
    result_order: list[int] = field(default_factory=list)

    @property
    def expires_at(self) -> datetime:
        return self.created_at + EXPIRES_AFTER

    @property
    def processing_status(self) -> str:
        if self.ended_at is not None:
            return "ended"
        return "canceling" if self.cancel_initiated_at is not None else "in_progress"

    def archived_at(self, now: datetime) -> datetime | None:
        at = self.created_at + ARCHIVED_AFTER
        return at if now >= at else None

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("processing", "succeeded", "errored", "canceled", "expired"), 0)
        for item in self.items:
            counts["processing" if item.result is None else item.result] += 1
        return counts


@dataclass(frozen=True)
class Billed:
    """A request the fake billed: a success in an ended batch."""

    batch_id: str
    custom_id: str
    prompt: str
    input_tokens: Any
    output_tokens: Any


@dataclass
class CreateCall:
    """One create the fake received."""

    number: int
    status: int
    request_count: int
    batch_id: str | None  # the batch it made, if any
    dropped: bool = False  # the answer was never sent (BatchPlan.drop_answer)
    error: str | None = None


def prompt_of(params: Mapping[str, Any]) -> str:
    messages = params.get("messages") or [{}]
    last = messages[-1] if isinstance(messages, list) and isinstance(messages[-1], dict) else {}
    content = last.get("content", "")
    return content if isinstance(content, str) else json.dumps(content)


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class Invalid(Exception):
    """A request the API refuses (400, invalid_request_error)."""


class Drop(Exception):
    """Raised by an ASGI handler after it started an answer: uvicorn then
    closes the connection mid-answer."""


# a connection-closing hook: given the request's scope, closes its connection
# at once (no answer at all); False when it cannot
AbortConnection = Callable[[Mapping[str, Any]], bool]


@dataclass
class FakeBatches:
    default: BatchPlan = field(default_factory=BatchPlan)
    clock: Callable[[], datetime] = _utcnow
    seed: int = 4321
    # set by FakeAnthropicServer; without it a drop sends a status line first
    abort_connection: AbortConnection | None = None
    creates: list[CreateCall] = field(default_factory=list)
    billed: list[Billed] = field(default_factory=list)
    _batches: dict[str, Batch] = field(default_factory=dict)
    _queued: deque[BatchPlan] = field(default_factory=deque)
    _items_for: dict[str, deque[ItemPlan]] = field(default_factory=dict)
    _faults: dict[str, deque[Fault]] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    # -- what tests use --------------------------------------------------------------

    def queue(self, *plans: BatchPlan) -> None:
        """The next creates get these plans, in order; then the default."""
        with self._lock:
            self._queued.extend(plans)

    def queue_items_for(self, prompt_fragment: str, *plans: ItemPlan) -> None:
        """The next requests (of any later create) whose prompt holds
        prompt_fragment end as these plans say, in order."""
        with self._lock:
            self._items_for.setdefault(prompt_fragment, deque()).extend(plans)

    def queue_fault(self, operation: Operation, *faults: Fault) -> None:
        """The next requests of this operation are spoilt so, in order.
        (The SDK's ``results`` retrieves the batch first: a "retrieve" fault
        spoils that too.)"""
        if operation not in OPERATIONS:
            raise ValueError(f"no such operation: {operation}")
        with self._lock:
            self._faults.setdefault(operation, deque()).extend(faults)

    def end_batch(self, batch_id: str) -> Batch:
        """Ends the batch now: each request as planned (or canceled, when a
        cancel came and it was not in progress)."""
        with self._lock:
            batch = self._batches[batch_id]
            if batch.ended_at is None:
                self._end(batch, self.clock(), expired=False)
            return batch

    def batch(self, batch_id: str) -> Batch:
        """The batch as the fake keeps it (deleted ones too)."""
        with self._lock:
            batch = self._batches[batch_id]
            self._settle(batch, self.clock())
            return batch

    @property
    def batches(self) -> list[Batch]:
        """Every batch made, oldest first (deleted ones too)."""
        with self._lock:
            now = self.clock()
            for batch in self._batches.values():
                self._settle(batch, now)
            return sorted(self._batches.values(), key=lambda b: b.number)

    def billed_for(self, prompt_fragment: str) -> list[Billed]:
        with self._lock:
            return [b for b in self.billed if prompt_fragment in b.prompt]

    def bills_by_custom_id(self) -> Counter[str]:
        """How many times each custom_id was billed, across batches."""
        with self._lock:
            return Counter(b.custom_id for b in self.billed)

    def make_batch(self, requests: list[dict[str, Any]], *, plan: BatchPlan | None = None,
                   created_at: datetime | None = None) -> str:
        """Makes a batch as a create would, without a request (e.g. another
        client's batch in the workspace, or one made a day ago)."""
        with self._lock:
            _validate(requests)
            return self._make(requests, plan or self.default, created_at or self.clock()).id

    # -- the model -------------------------------------------------------------------

    def _make(self, requests: list[dict[str, Any]], plan: BatchPlan, created_at: datetime) -> Batch:
        number = len(self._batches) + 1
        batch_id = f"msgbatch_{number:04d}{self._random.getrandbits(64):016x}"
        items = [Item(r["custom_id"], r["params"], self._item_plan(plan, r)) for r in requests]
        batch = Batch(id=batch_id, number=number, created_at=created_at, items=items, plan=plan)
        self._batches[batch_id] = batch
        return batch

    def _item_plan(self, plan: BatchPlan, request: dict[str, Any]) -> ItemPlan:
        if request["custom_id"] in plan.items:
            return plan.items[request["custom_id"]]
        prompt = prompt_of(request["params"])
        for fragment, plans in self._items_for.items():
            if plans and fragment in prompt:
                return plans.popleft()
        return plan.default_item

    def _settle(self, batch: Batch, now: datetime) -> None:
        """Ends the batch if its time has come: expiry, its auto-end, or a
        cancel with nothing left in progress."""
        if batch.ended_at is not None:
            return
        if now >= batch.expires_at:
            self._end(batch, batch.expires_at, expired=True)
        elif batch.plan.auto_end_s is not None and now >= batch.created_at + timedelta(seconds=batch.plan.auto_end_s) or batch.cancel_initiated_at is not None and not any(i.plan.in_progress for i in batch.items):
            self._end(batch, now, expired=False)

    def _end(self, batch: Batch, now: datetime, *, expired: bool) -> None:
        for item in batch.items:
            if expired:
                item.result = "expired"
            elif batch.cancel_initiated_at is not None and not item.plan.in_progress:
                item.result = "canceled"
            else:
                item.result = item.plan.result
            if item.result == "succeeded":
                text = _text_of(item)
                item.input_tokens = (item.plan.input_tokens if item.plan.input_tokens is not None
                                     else max(1, len(item.prompt.split())))
                item.output_tokens = (item.plan.output_tokens if item.plan.output_tokens is not None
                                      else len(text.split()))
                self.billed.append(Billed(batch.id, item.custom_id, item.prompt, item.input_tokens,
                                          item.output_tokens))
        batch.ended_at = now
        order = list(range(len(batch.items)))
        # results come in an order of their own, the same at every read
        random.Random(f"{self.seed}:{batch.id}").shuffle(order)
        batch.result_order = order

    def _next_fault(self, operation: Operation, batch_id: str | None) -> Fault | None:
        with self._lock:
            faults = self._faults.get(operation)
            if not faults:
                return None
            for fault in faults:
                if fault.batch_id is None or fault.batch_id == batch_id:
                    faults.remove(fault)
                    return fault
            return None

    def _visible(self, batch_id: str) -> Batch | None:
        batch = self._batches.get(batch_id)
        if batch is None or batch.deleted:
            return None
        self._settle(batch, self.clock())
        return batch

    def _batch_json(self, batch: Batch, base_url: str, patch: Mapping[str, Any] | None = None) -> dict[str, Any]:
        now = self.clock()
        data: dict[str, Any] = {
            "id": batch.id,
            "type": "message_batch",
            "processing_status": batch.processing_status,
            "request_counts": batch.counts(),
            "created_at": _iso(batch.created_at),
            "expires_at": _iso(batch.expires_at),
            "ended_at": _iso(batch.ended_at),
            "cancel_initiated_at": _iso(batch.cancel_initiated_at),
            "archived_at": _iso(batch.archived_at(now)),
            "results_url": f"{base_url}{PREFIX}/{batch.id}/results" if batch.ended_at is not None else None,
        }
        data.update(patch or {})
        return data

    # -- ASGI ---------------------------------------------------------------------------

    async def handle(self, scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        rest = path[len(PREFIX):].strip("/")
        parts = rest.split("/") if rest else []
        body = await _read_body(receive)
        base_url = _base_url(scope)
        if method == "POST" and not parts:
            await self._create(scope, body, receive, send, base_url)
        elif method == "GET" and not parts:
            await self._list(scope, receive, send, base_url)
        elif method == "GET" and len(parts) == 1:
            await self._retrieve(scope, parts[0], receive, send, base_url)
        elif method == "GET" and len(parts) == 2 and parts[1] == "results":
            await self._results(scope, parts[0], receive, send)
        elif method == "POST" and len(parts) == 2 and parts[1] == "cancel":
            await self._cancel(scope, parts[0], receive, send, base_url)
        elif method == "DELETE" and len(parts) == 1:
            await self._delete(scope, parts[0], receive, send)
        else:
            await error_answer(send, 404, "not_found_error", f"no route {method} {path}")

    async def _create(self, scope: Mapping[str, Any], body: bytes, receive: Any, send: Any, base_url: str) -> None:
        try:
            document = json.loads(body or b"{}")
            requests = document.get("requests") if isinstance(document, dict) else None
            _validate(requests)
        except (Invalid, ValueError) as exc:
            with self._lock:
                self.creates.append(CreateCall(len(self.creates) + 1, 400, 0, None, error=str(exc)))
            await error_answer(send, 400, "invalid_request_error", str(exc))
            return
        assert isinstance(requests, list)
        with self._lock:
            plan = self._queued.popleft() if self._queued else self.default
            made = plan.status == 200 or plan.made_anyway
            batch = self._make(requests, plan, self.clock()) if made else None
            self.creates.append(CreateCall(len(self.creates) + 1, plan.status, len(requests),
                                           batch.id if batch else None, dropped=plan.drop_answer))
            answer = self._batch_json(batch, base_url, plan.answer_patch) if batch else None
        if plan.drop_answer:
            await self._drop(scope, receive, send)
            return
        if plan.answer_after_s is not None:
            await _wait_or_disconnect(receive, plan.answer_after_s)
        if plan.status != 200:
            await error_answer(send, plan.status, _ERROR_STATUS.get(plan.status, "api_error"),
                               f"fake create answered {plan.status}", plan.retry_after_s, plan.headers)
            return
        await json_answer(send, 200, answer)

    async def _list(self, scope: Mapping[str, Any], receive: Any, send: Any, base_url: str) -> None:
        fault = self._next_fault("list", None)
        if await self._spoil(fault, scope, receive, send, before=True):
            return
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        try:
            limit = int(query.get("limit", LIST_LIMIT_DEFAULT))
        except ValueError:
            await error_answer(send, 400, "invalid_request_error", "limit: not an integer")
            return
        if not 1 <= limit <= LIST_LIMIT_MAX:
            await error_answer(send, 400, "invalid_request_error",
                               f"limit: must be between 1 and {LIST_LIMIT_MAX}")
            return
        after_id, before_id = query.get("after_id"), query.get("before_id")
        if after_id and before_id:
            await error_answer(send, 400, "invalid_request_error", "give after_id or before_id, not both")
            return
        with self._lock:
            now = self.clock()
            listed = [b for b in self._batches.values() if not b.deleted]
            for batch in listed:
                self._settle(batch, now)
            newest_first = sorted(listed, key=lambda b: b.number, reverse=True)
            ids = [b.id for b in newest_first]
            cursor = after_id or before_id
            if cursor is not None and cursor not in ids:
                page = None
            elif after_id is not None:
                start = ids.index(after_id) + 1
                page, has_more = newest_first[start:start + limit], start + limit < len(ids)
            elif before_id is not None:
                end = ids.index(before_id)
                start = max(end - limit, 0)
                page, has_more = newest_first[start:end], start > 0
            else:
                page, has_more = newest_first[:limit], limit < len(ids)
            patch = fault.patch if fault else None
            data = None if page is None else [self._batch_json(b, base_url, patch) for b in page]
        if data is None:
            await error_answer(send, 400, "invalid_request_error", f"no batch {cursor} to page from")
            return
        answer = {"data": data, "has_more": has_more, "first_id": data[0]["id"] if data else None,
                  "last_id": data[-1]["id"] if data else None}
        answer.update(fault.page_patch if fault else {})
        await json_answer(send, 200, answer)

    async def _retrieve(self, scope: Mapping[str, Any], batch_id: str, receive: Any, send: Any,
                        base_url: str) -> None:
        fault = self._next_fault("retrieve", batch_id)
        if await self._spoil(fault, scope, receive, send, before=True):
            return
        with self._lock:
            batch = self._visible(batch_id)
            answer = None if batch is None else self._batch_json(batch, base_url, fault.patch if fault else None)
        if answer is None:
            await error_answer(send, 404, "not_found_error", f"no batch {batch_id}")
            return
        await json_answer(send, 200, answer)

    async def _results(self, scope: Mapping[str, Any], batch_id: str, receive: Any, send: Any) -> None:
        fault = self._next_fault("results", batch_id)
        if await self._spoil(fault, scope, receive, send, before=True):
            return
        with self._lock:
            batch = self._visible(batch_id)
            now = self.clock()
            if batch is None or batch.archived_at(now) is not None:
                lines = None
                problem = (404, "not_found_error", f"no results for batch {batch_id}")
            elif batch.ended_at is None:
                lines = None
                problem = (400, "invalid_request_error", f"batch {batch_id} has not ended")
            else:
                lines = [_result_line(batch.items[i]) for i in batch.result_order]
        if lines is None:
            await error_answer(send, *problem)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-jsonl")]})
        cut = fault.after_lines if fault else None
        for index, line in enumerate(lines):
            if cut is not None and index == cut:
                if fault is not None and fault.mid_line:
                    await send({"type": "http.response.body", "body": line[: len(line) // 2], "more_body": True})
                raise Drop("fake provider cuts the results stream")
            await send({"type": "http.response.body", "body": line, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _cancel(self, scope: Mapping[str, Any], batch_id: str, receive: Any, send: Any,
                      base_url: str) -> None:
        fault = self._next_fault("cancel", batch_id)
        if await self._spoil(fault, scope, receive, send, before=True):
            return
        with self._lock:
            batch = self._visible(batch_id)
            if batch is None:
                problem: tuple[int, str, str] | None = (404, "not_found_error", f"no batch {batch_id}")
            elif batch.ended_at is not None:
                problem = (400, "invalid_request_error", f"batch {batch_id} has ended: it cannot be canceled")
            else:
                problem = None
                if batch.cancel_initiated_at is None:
                    batch.cancel_initiated_at = self.clock()
                # the answer says canceling; the end comes at the next look
                answer = self._batch_json(batch, base_url, fault.patch if fault else None)
        if problem is not None:
            await error_answer(send, *problem)
            return
        if await self._spoil(fault, scope, receive, send, before=False):
            return
        await json_answer(send, 200, answer)

    async def _delete(self, scope: Mapping[str, Any], batch_id: str, receive: Any, send: Any) -> None:
        fault = self._next_fault("delete", batch_id)
        if await self._spoil(fault, scope, receive, send, before=True):
            return
        with self._lock:
            batch = self._visible(batch_id)
            if batch is None:
                problem: tuple[int, str, str] | None = (404, "not_found_error", f"no batch {batch_id}")
            elif batch.ended_at is None:
                problem = (400, "invalid_request_error",
                           f"batch {batch_id} is still processing: cancel it, and delete it once it has ended")
            else:
                problem = None
                batch.deleted = True
        if problem is not None:
            await error_answer(send, *problem)
            return
        if await self._spoil(fault, scope, receive, send, before=False):
            return
        await json_answer(send, 200, {"id": batch_id, "type": "message_batch_deleted"})

    async def _spoil(self, fault: Fault | None, scope: Mapping[str, Any], receive: Any, send: Any, *,
                     before: bool) -> bool:
        """Applies a fault's error status (before anything is done) or drop
        (before for reads, after for cancel and delete); True when it answered."""
        if fault is None:
            return False
        if before and fault.status is not None:
            await error_answer(send, fault.status, _ERROR_STATUS.get(fault.status, "api_error"),
                               f"fake answered {fault.status}", fault.retry_after_s, fault.headers)
            return True
        changes = scope["method"] in ("POST", "DELETE")
        if fault.drop and before != changes:
            await self._drop(scope, receive, send)
            return True
        return False

    async def _drop(self, scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        """Closes the connection without an answer."""
        if self.abort_connection is not None and self.abort_connection(scope):
            # uvicorn sends no 500 once it has seen the connection go
            await _wait_or_disconnect(receive, 5.0)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        raise Drop("fake provider drops the connection")


def _validate(requests: object) -> None:
    """Raises Invalid as the API refuses a create: custom_id's pattern and
    uniqueness, params of a Message (no ``stream``), and the count."""
    if not isinstance(requests, list) or not requests:
        raise Invalid("requests: a list of at least one request is required")
    if len(requests) > MAX_REQUESTS:
        raise Invalid(f"requests: at most {MAX_REQUESTS} requests in a batch")
    seen: set[str] = set()
    for index, request in enumerate(requests):
        if not isinstance(request, dict):
            raise Invalid(f"requests.{index}: an object is required")
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise Invalid(f"requests.{index}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$")
        if custom_id in seen:
            raise Invalid(f"requests.{index}.custom_id: {custom_id!r} is used twice in this batch")
        seen.add(custom_id)
        params = request.get("params")
        if not isinstance(params, dict):
            raise Invalid(f"requests.{index}.params: an object is required")
        if "stream" in params:
            raise Invalid(f"requests.{index}.params.stream: streaming is not supported in a batch")
        if not isinstance(params.get("model"), str) or not params["model"]:
            raise Invalid(f"requests.{index}.params.model: required")
        max_tokens = params.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise Invalid(f"requests.{index}.params.max_tokens: a positive integer is required")
        messages = params.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Invalid(f"requests.{index}.params.messages: at least one message is required")


def _text_of(item: Item) -> str:
    if item.plan.text is not None:
        return item.plan.text
    words = min(40, int(item.params.get("max_tokens", 40)))
    return "Title: A Batched Story\n" + " ".join(["sleepy"] * words)


def _result_json(item: Item) -> dict[str, Any]:
    if item.plan.result_json is not None:
        return dict(item.plan.result_json)
    if item.result == "succeeded":
        return {"type": "succeeded", "message": {
            "id": f"msg_batch_{item.custom_id}", "type": "message", "role": "assistant",
            "model": item.params.get("model", "fake-model"),
            "content": [{"type": "text", "text": _text_of(item)}],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": item.input_tokens, "output_tokens": item.output_tokens}}}
    if item.result == "errored":
        return {"type": "errored", "error": {"type": "error", "request_id": f"req_batch_{item.custom_id}",
                                             "error": {"type": item.plan.error_type,
                                                       "message": f"fake {item.plan.error_type}"}}}
    return {"type": item.result}


def _result_line(item: Item) -> bytes:
    if item.plan.line is not None:
        return item.plan.line.encode() + b"\n"
    return json.dumps({"custom_id": item.custom_id, "result": _result_json(item)}).encode() + b"\n"


def _base_url(scope: Mapping[str, Any]) -> str:
    for name, value in scope.get("headers", []):
        if name == b"host":
            return f"http://{value.decode()}"
    host, port = scope["server"]
    return f"http://{host}:{port}"


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def _wait_or_disconnect(receive: Any, seconds: float) -> None:
    """Waits ``seconds``, or less if the client goes away."""

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    try:
        await asyncio.wait_for(gone(), timeout=seconds)
    except TimeoutError:
        return


async def json_answer(send: Any, status: int, data: object,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(data).encode()
    try:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *(extra or [])]})
        await send({"type": "http.response.body", "body": payload})
    except (OSError, RuntimeError):
        # the client went away (e.g. it timed out before a delayed answer)
        return


async def error_answer(send: Any, status: int, kind: str, message: str, retry_after_s: int | None = None,
                       headers: tuple[tuple[str, str], ...] = ()) -> None:
    extra = [] if retry_after_s is None else [(b"retry-after", str(retry_after_s).encode())]
    extra += [(name.encode(), value.encode()) for name, value in headers]
    await json_answer(send, status, {"type": "error", "error": {"type": kind, "message": message},
                                     "request_id": "req_fake_batches"}, extra)
