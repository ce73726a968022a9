"""A model-based test of the worker's coordinator, shared by its two runs.

Hypothesis drives the real coordinator, executor and AnthropicWriter (the
real ``anthropic`` SDK, over an in-process transport that answers each
request as a rule decides) through rounds, answers of every kind, database
statements failing or losing their answers, cancels, sweeps, heartbeats and
shutdown. The model is tiny: what the provider did with each request it got.
After every step the invariants are checked:

* at most one request per job was billed (or may have been: an unknown
  outcome counts as billed);
* no request was sent for a job that was not running under this worker;
* every request sent has its ledger row, and once closed by the worker, the
  row's ``billed`` matches what the provider did;
* what the budget holds for the jobs (charged, or reserved while they run)
  is never below what the provider billed;
* a job sends a request again only after its previous one was refused;
* a job that reached completed or failed never changes again (its status,
  story and error), so that an end written by a worker that no longer holds
  the job (cancelled, swept, or running under another worker) changes
  nothing; a job another worker holds is ended by nobody but a cancel or a
  sweep.

The last two read what only the database knows, and a world that cannot say
(the recording store, which keeps no job rows of its own) answers None: the
guards that hold them are proven on Postgres. Besides the rules Hypothesis
picks among, ``scenario`` steps drive the orders that are the most dangerous
(an end arriving after a cancel or a sweep, a lost claim while a call is in
flight) on purpose, so that tests/model/test_worker_model_pg.py can play
them every time.

A ``World`` gives the machine its store and what it needs to check them; the
recording store (tests/fakes/recording_worker_store.py: the coordinator's
decisions, answered as the rules configured) and the real one on Postgres
(tests/model/test_worker_model_pg.py: the SQL's guards) are both worlds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol

import anthropic
import httpx2
import psycopg
import stamina
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.config import WorkerSettings
from shared.status import ErrorCode, LlmOutcome
from worker.anthropic_writer import AnthropicWriter
from worker.coordinator import SHUTDOWN, Coordinator
from worker.store import WorkerStore

MAX_TOKENS = 100
INPUT_ESTIMATE = 50
INPUT_BILLED = 20  # what the provider counts for every prompt: below any bound

# what the provider did with a request: billed, refused (not billed), or
# answered in a way that says nothing (a 5xx): it may have billed
BILLED, REFUSED, UNKNOWN = "billed", "refused", "unknown"

ANSWERS = {
    "stream": BILLED,
    "stream_odd_usage": BILLED,  # final usage of 3,000,000,000 output tokens, input -1
    "stream_odd_headers": BILLED,  # anthropic-ratelimit-* of nan, a reset that is no date
    "dropped": BILLED,  # the stream breaks after it started
    "rate_limited": REFUSED,
    "rate_limited_nan": REFUSED,  # retry-after: nan
    "rate_limited_final": REFUSED,  # x-should-retry: false
    "overloaded": REFUSED,
    "rejected": REFUSED,  # a 400
    "server_error": UNKNOWN,  # a 500 before anything streamed
}


def model_settings() -> WorkerSettings:
    return WorkerSettings(worker_concurrency=2, worker_poll_interval_s=5.0, heartbeat_interval_s=1.0,
                          heartbeat_timeout_s=3.0, worker_shutdown_grace_s=30.0, metrics_port=0,
                          llm_max_tokens=MAX_TOKENS, llm_retry_attempts=4, anthropic_api_key="model",
                          llm_timeout_s=300.0, job_timeout_s=480.0)


# the default model's price, as the api reserves it
PRICE = model_settings().price()


@dataclass(frozen=True)
class JobState:
    """What a job's row says of its end."""

    status: str
    worker_id: str | None
    story_id: str | None
    error_code: str | None
    error_text: str | None


ENDED = ("completed", "failed")
OTHER_WORKER = "w-other"


@dataclass
class SentRequest:
    job_id: int
    ours_when_sent: bool
    done: asyncio.Future[str]
    billing: str | None = None  # set when answered
    # what the provider really charged for it (a request that may have been
    # billed is counted at the most it can cost)
    cost: Decimal = Decimal(0)


class World(Protocol):
    """A store for the coordinator, and what the invariants read of it."""

    # read-only, so that a world may hold a store of its own type that is a WorkerStore
    @property
    def store(self) -> WorkerStore: ...

    async def add_pending(self, n: int) -> list[int]: ...

    async def end_elsewhere(self, job_id: int, code: ErrorCode) -> None: ...

    async def claim_elsewhere(self) -> int | None:
        """Another worker claims the next pending job (its id, or None)."""
        ...

    def fail_next(self, method: str, error: Exception, *, after_effect: bool) -> None: ...

    async def is_ours(self, job_id: int) -> bool: ...

    async def running(self) -> list[int]: ...

    async def ledger(self) -> dict[tuple[int, int], tuple[LlmOutcome, bool]]: ...

    async def budget_held(self) -> Decimal | None:
        """What the budget counts for every job: charged when ended,
        reserved (the worst case) while pending or running; None where the
        world keeps no budget."""
        ...

    async def job_states(self) -> dict[int, JobState] | None:
        """Every job's row; None where the world keeps no job rows."""
        ...


class ScriptedProvider:
    """The provider behind an in-process transport: each request waits until
    a rule answers it."""

    def __init__(self, is_ours: Callable[[int], Any]) -> None:
        self._is_ours = is_ours
        self.requests: list[SentRequest] = []

    @property
    def waiting(self) -> list[SentRequest]:
        return [r for r in self.requests if r.billing is None and not r.done.done()]

    def for_job(self, job_id: int) -> list[SentRequest]:
        return [r for r in self.requests if r.job_id == job_id]

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        match = re.search(r"story (\d+)", json.dumps(body["messages"]))
        assert match is not None, body
        job_id = int(match.group(1))
        sent = SentRequest(job_id, bool(await self._is_ours(job_id)), asyncio.get_running_loop().create_future())
        self.requests.append(sent)
        try:
            kind = await sent.done
        except asyncio.CancelledError:
            # the client went away before an answer: it may have been billed
            sent.billing, sent.cost = UNKNOWN, PRICE.cost(INPUT_BILLED, MAX_TOKENS)
            raise
        sent.billing = ANSWERS[kind]
        if kind in ("stream", "stream_odd_headers"):
            sent.cost = PRICE.cost(INPUT_BILLED, 30)
        elif sent.billing != REFUSED:
            # an absurd usage, a broken stream or a 5xx: at most the whole max_tokens
            sent.cost = PRICE.cost(INPUT_BILLED, MAX_TOKENS)
        return _response(kind, body)


def _response(kind: str, body: dict[str, Any]) -> httpx2.Response:
    headers = {"request-id": "req_model"}
    if kind.startswith("rate_limited") or kind in ("overloaded", "rejected", "server_error"):
        status = {"overloaded": 529, "rejected": 400, "server_error": 500}.get(kind, 429)
        if kind == "rate_limited":
            headers["retry-after"] = "0.01"
        elif kind == "rate_limited_nan":
            headers["retry-after"] = "nan"
        elif kind == "rate_limited_final":
            headers["x-should-retry"] = "false"
        return httpx2.Response(status, headers=headers,
                               json={"type": "error", "error": {"type": "api_error", "message": kind}})
    if kind == "stream_odd_headers":
        headers.update({"anthropic-ratelimit-output-tokens-remaining": "nan",
                        "anthropic-ratelimit-requests-limit": "nan",
                        "anthropic-ratelimit-requests-remaining": "-3",
                        "anthropic-ratelimit-tokens-reset": "not a date"})
    headers["content-type"] = "text/event-stream"
    odd = kind == "stream_odd_usage"
    events = _events(body.get("model", "m"), input_tokens=-1 if odd else INPUT_BILLED,
                     output_tokens=3_000_000_000 if odd else 30)
    if kind == "dropped":
        return httpx2.Response(200, headers=headers, stream=_Dropping(events[:3]))
    return httpx2.Response(200, headers=headers, content=b"".join(events))


def _events(model: str, *, input_tokens: int, output_tokens: int) -> list[bytes]:
    def event(name: str, data: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

    return [
        event("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 1}}}),
        event("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}}),
        event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                      "delta": {"type": "text_delta", "text": "Title: Moon\nSleep now."}}),
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                "usage": {"output_tokens": output_tokens}}),
        event("message_stop", {"type": "message_stop"}),
    ]


class _Dropping(httpx2.AsyncByteStream):
    def __init__(self, events: list[bytes]) -> None:
        self._events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._events:
            yield chunk
        raise httpx2.ReadError("the connection broke")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _no_wait(_: float) -> None:
    await asyncio.sleep(0)


STORE_METHODS = ("claim", "settle", "fail_running", "claims_of_lost_answer", "heartbeat", "call_retry",
                 "call_finish")


@dataclass
class Drive:
    """What one run of the machine owns."""

    loop: asyncio.AbstractEventLoop
    world: World
    provider: ScriptedProvider
    coordinator: Coordinator
    writer: AnthropicWriter
    clock: FakeClock
    settle: Callable[[], Any]
    stopped: bool = False
    closed_jobs: set[int] = field(default_factory=set)
    # each job's row as first seen ended, which it keeps
    ended: dict[int, JobState] = field(default_factory=dict)
    # jobs ended by a cancel or a sweep, and those another worker claimed
    ended_elsewhere: set[int] = field(default_factory=set)
    elsewhere: set[int] = field(default_factory=set)


class WorkerMachine(RuleBasedStateMachine):
    """Rules that change the world; invariants after every step. A subclass
    says how its world is made (``make_world``) and let tasks run
    (``settle_rounds``)."""

    settle_rounds = 30

    def __init__(self) -> None:
        super().__init__()
        self._testing = stamina.set_testing(True, attempts=4, cap=True)
        loop = asyncio.new_event_loop()
        world = loop.run_until_complete(self.make_world())
        provider = ScriptedProvider(world.is_ours)
        settings = model_settings()
        clock = FakeClock()
        client = anthropic.AsyncAnthropic(api_key="model", base_url="http://provider.test", max_retries=0,
                                          http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(provider.handle)))
        writer = AnthropicWriter(settings, client=client)
        coordinator = Coordinator(settings, world.store, writer, listen=False, clock=clock, sleep=_no_wait)
        self.d = Drive(loop, world, provider, coordinator, writer, clock, settle=self._settle)

    async def make_world(self) -> World:
        raise NotImplementedError

    def run(self, coro: Any) -> Any:
        return self.d.loop.run_until_complete(coro)

    def _settle(self) -> None:
        """Lets the job tasks take every step they can: until nothing has
        moved (requests sent, answered, tasks finished) for a while, so that
        the state a rule sees does not depend on how fast the machine is."""
        async def steps() -> None:
            still, last = 0, None
            for turn in range(2000):
                await (asyncio.sleep(0.001) if turn % 10 == 9 else asyncio.sleep(0))
                tasks = [h.task for h in self.d.coordinator.held if h.task is not None]
                now = (len(self.d.provider.requests), len(self.d.provider.waiting),
                       sum(t.done() for t in tasks), len(tasks))
                still = still + 1 if now == last else 0
                last = now
                if still >= self.settle_rounds:
                    return
        self.run(steps())

    def teardown(self) -> None:
        try:
            self.d.coordinator.stop()
            self.d.coordinator.held.stop_all(SHUTDOWN)
            self._settle()
            self.run(self.d.writer.aclose())
            self.run(self.close_world())
        finally:
            self.d.loop.close()
            self._testing.__exit__(None, None, None)

    async def close_world(self) -> None:
        return None

    # -- rules ---------------------------------------------------------------------

    @rule(n=st.integers(1, 3))
    def add_jobs(self, n: int) -> None:
        """Jobs accepted, and announced as the api's insert does (NOTIFY)."""
        self.run(self.d.world.add_pending(n))
        self.d.coordinator.notified()
        self.round()

    @rule()
    def round(self) -> None:
        self.run(self.d.coordinator.round_once())
        self.d.settle()

    @precondition(lambda self: self.d.provider.waiting)
    @rule(data=st.data(), kind=st.sampled_from(sorted(ANSWERS)))
    def answer(self, data: st.DataObject, kind: str) -> None:
        self.answer_request(data.draw(st.sampled_from(self.d.provider.waiting)), kind)

    def answer_request(self, request: SentRequest, kind: str) -> None:
        request.done.set_result(kind)
        self.d.settle()
        self.round()  # a finished call wakes the coordinator

    # the orders in which a guard is all that stands between an end and a job
    # that is no longer ours: the job ended elsewhere while its call is open,
    # then the call's answer arrives (a story, a refusal that asks for a
    # retry, a failure), before any heartbeat tells the worker
    @precondition(lambda self: self.d.provider.waiting)
    @rule(data=st.data(), code=st.sampled_from([ErrorCode.CANCELLED, ErrorCode.INTERRUPTED]),
          kind=st.sampled_from(sorted(ANSWERS)))
    def answered_after_an_end_elsewhere(self, data: st.DataObject, code: ErrorCode, kind: str) -> None:
        """A cancel or a sweep ends a job whose request is in flight; then the provider answers it."""
        self.end_then_answer(data.draw(st.sampled_from(self.d.provider.waiting)), code, kind)

    def end_then_answer(self, request: SentRequest, code: ErrorCode, kind: str) -> None:
        self.end_job(request.job_id, code)
        self.answer_request(request, kind)

    # a claim whose answer is lost while a job this worker began is in
    # flight: adoption must leave the begun job alone
    @precondition(lambda self: self.d.provider.waiting and not self.d.stopped)
    @rule()
    def claim_lost_while_a_call_is_open(self) -> None:
        """A new job's claim commits but its answer is lost; the next round adopts what it claimed."""
        self.d.world.fail_next("claim", psycopg.OperationalError("the connection was lost"),
                               after_effect=True)
        self.add_jobs(1)
        self.round()

    # the claim and the settle fail most often: a lost answer costs most there
    @rule(method=st.sampled_from(STORE_METHODS + ("claim", "settle") * 2), lost_answer=st.booleans())
    def statement_fails(self, method: str, lost_answer: bool) -> None:
        """The next statement of this kind fails: refused for its data, or
        its connection lost (before or after its commit)."""
        if lost_answer:
            error: Exception = psycopg.OperationalError("the connection was lost")
            self.d.world.fail_next(method, error, after_effect=True)
        else:
            self.d.world.fail_next(method, psycopg.errors.DataError("refused for its data"), after_effect=False)

    @precondition(lambda self: True)
    @rule(data=st.data(), code=st.sampled_from([ErrorCode.CANCELLED, ErrorCode.INTERRUPTED]))
    def ended_elsewhere(self, data: st.DataObject, code: ErrorCode) -> None:
        """A cancel (DELETE) or a sweep ends a live job."""
        running = self.run(self.d.world.running())
        if running:
            self.end_job(data.draw(st.sampled_from(running)), code)

    def end_job(self, job_id: int, code: ErrorCode) -> None:
        self.run(self.d.world.end_elsewhere(job_id, code))
        self.d.ended_elsewhere.add(job_id)

    @rule()
    def claimed_by_another_worker(self) -> None:
        """Another worker claims the next pending job (and never ends it)."""
        job_id = self.run(self.d.world.claim_elsewhere())
        if job_id is not None:
            self.d.elsewhere.add(job_id)

    @rule()
    def heartbeat(self) -> None:
        with contextlib.suppress(psycopg.Error):  # the heartbeat loop waits it out
            self.run(self.d.coordinator.heartbeat_once())
        self.d.settle()

    @rule(seconds=st.sampled_from([0.5, 5.0, 31.0]))
    def time_passes(self, seconds: float) -> None:
        self.d.clock.now += seconds
        self.round()

    @precondition(lambda self: not self.d.stopped)
    @rule()
    def shutdown(self) -> None:
        self.d.stopped = True
        self.d.coordinator.stop()

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def at_most_one_billed_request_per_job(self) -> None:
        by_job: dict[int, int] = {}
        for request in self.d.provider.requests:
            if request.billing in (BILLED, UNKNOWN):
                by_job[request.job_id] = by_job.get(request.job_id, 0) + 1
        assert all(n <= 1 for n in by_job.values()), by_job

    @invariant()
    def no_request_for_a_job_not_ours(self) -> None:
        assert all(r.ours_when_sent for r in self.d.provider.requests), [
            r.job_id for r in self.d.provider.requests if not r.ours_when_sent]

    @invariant()
    def every_request_has_its_row_and_the_row_says_what_was_billed(self) -> None:
        ledger = self.run(self.d.world.ledger())
        for job_id in {r.job_id for r in self.d.provider.requests}:
            for attempt, request in enumerate(self.d.provider.for_job(job_id), start=1):
                assert (job_id, attempt) in ledger, (job_id, attempt, ledger)
                outcome, billed = ledger[(job_id, attempt)]
                if request.billing is None or outcome in (LlmOutcome.STARTED, LlmOutcome.INTERRUPTED):
                    continue  # not closed by what the worker knows yet
                assert billed == (request.billing != REFUSED), (job_id, attempt, outcome, billed,
                                                                 request.billing)

    @invariant()
    def the_budget_never_holds_less_than_the_provider_billed(self) -> None:
        billed = sum((r.cost for r in self.d.provider.requests), Decimal(0))
        held = self.run(self.d.world.budget_held())
        assert held is None or held >= billed, (held, billed)

    @invariant()
    def a_request_is_sent_again_only_after_a_refusal(self) -> None:
        """A second request for a job (a retry, or the job begun again) is
        sent only once the first was answered with a refusal."""
        for job_id in {r.job_id for r in self.d.provider.requests}:
            earlier = self.d.provider.for_job(job_id)[:-1]
            assert all(r.billing == REFUSED for r in earlier), (job_id, [r.billing for r in earlier])

    @invariant()
    def an_ended_job_never_changes(self) -> None:
        """Completed or failed is for good: status, story and error as first
        seen, whoever writes to the job afterwards."""
        states = self.run(self.d.world.job_states())
        if states is None:
            return
        for job_id, state in states.items():
            first = self.d.ended.get(job_id)
            if first is not None:
                assert state == first, (job_id, first, state)
            elif state.status in ENDED:
                self.d.ended[job_id] = state

    @invariant()
    def a_job_another_worker_holds_is_ended_only_elsewhere(self) -> None:
        states = self.run(self.d.world.job_states())
        if states is None:
            return
        for job_id in self.d.elsewhere:
            state = states[job_id]
            assert state.worker_id == OTHER_WORKER, (job_id, state)
            assert state.status == "running" or (job_id in self.d.ended_elsewhere and state.status == "failed"), (
                job_id, state)

    def check_invariants_now(self) -> None:
        """Every invariant, as Hypothesis checks them after a step (for the
        scenarios that call the rules themselves)."""
        self.at_most_one_billed_request_per_job()
        self.no_request_for_a_job_not_ours()
        self.every_request_has_its_row_and_the_row_says_what_was_billed()
        self.the_budget_never_holds_less_than_the_provider_billed()
        self.a_request_is_sent_again_only_after_a_refusal()
        self.an_ended_job_never_changes()
        self.a_job_another_worker_holds_is_ended_only_elsewhere()
