"""A model-based test of the claim's fair turns on Postgres (a fresh database
per example), over the real statements: admissions through the api's
admission statement (one client's batch, or several clients' in one batch as
the api's batcher sends them), a saturated client that refills its queue to
CLIENT_QUEUE_MAX the moment one of its jobs is claimed, a client cancelling
some of its pending jobs (the client's DELETE, under the admission lock) and
sending new ones, an idempotency key sent again, the operator's bulk cancel
of a client's pending jobs, a client's weight changed from the console, the
sweeper raising the claim's floor (migration 030), and
claims by several claimers (the unlimited claim, 1 to 3 jobs each; no rate
limit is configured, so the limiter's pass-over never applies). The claimers
never stop: each client's action is followed by a few claims, and runs of
claims with nothing else happening are a rule of their own.

The model is each client's pending jobs and weight. After every step:

* each client's pending jobs are the model's, no more, no fewer (admissions
  admit up to the client's bound, a key sent again adds nothing, a claim
  takes only pending jobs and as many as it may);
* no pending job's turn is below the claim's floor;
* the bound of docs/provider-limits.md: for two clients i and j, over any
  run of consecutive claims during which both had pending jobs throughout,
  |claims_i / w_i - claims_j / w_j| <= 1 / w_i + 1 / w_j.

What the bound is checked over, exactly. A pair's window opens when both
clients have pending jobs (and both are settled, below) and closes when
either has none; a claim counts in it when both still have pending jobs
after it (a claim that takes a client's last job closes the window). Within
a window, the difference claims_i / w_i - claims_j / w_j is taken after
every claim statement, and the bound is checked for every run between two
of those points (the largest difference less the smallest, 0 at the
window's start included), not only from the window's start. A weight
changed applies to the jobs admitted after it (the doc: pending jobs keep
their turns), so the old weight's turns still pace the client until one of
its jobs admitted after the change is claimed: until then the client is not
settled, and its pairs have no window; the window opened once it settles
runs at the new weight.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from api.admission import admission
from api.store import ApiStore
from shared import store
from shared.config import ApiSettings
from shared.console_rows import JobFilter
from shared.console_store import ConsoleStore
from shared.story_request import StoryRequest
from sweeper.store import PgSweeperStore
from tests.model.machine_pg import PostgresMachine
from tests.support import worker_statements
from tests.support.database import client_id_of

CLIENTS = ("a", "b", "c")
CLAIMERS = ("w1", "w2", "w3")
CLIENT_QUEUE_MAX = 6
QUEUE_MAX = 1_000
REQUEST = StoryRequest(prompt="a fox")
# claims (claimer, up to how many jobs) made while a client acts: the claimers never stop
MEANWHILE = st.lists(st.tuples(st.sampled_from(CLAIMERS), st.integers(1, 3)), max_size=4)


@dataclass
class Client:
    id: int
    weight: int = 1
    # pending jobs, in the order they were admitted
    pending: list[uuid.UUID] = field(default_factory=list)
    # every idempotency key sent, and the job it made
    keys: dict[str, uuid.UUID] = field(default_factory=dict)
    # refills its queue to CLIENT_QUEUE_MAX the moment a claim frees a slot
    saturated: bool = False
    # None: settled. After a weight change, the jobs admitted since, until one of them is claimed
    since_weight_change: set[uuid.UUID] | None = None


@dataclass
class Window:
    """A pair's run of claims during which both clients had pending jobs throughout."""

    claims: dict[str, int]
    lowest: Fraction = Fraction(0)
    highest: Fraction = Fraction(0)
    # who took each claim statement's jobs, for the failure's message
    history: list[str] = field(default_factory=list)


class FairTurnsMachine(PostgresMachine):
    label = "fair"

    def __init__(self) -> None:
        super().__init__()
        self.clients = {name: Client(id=self.run(client_id_of(self.conn, name))) for name in CLIENTS}
        self.by_id = {c.id: name for name, c in self.clients.items()}
        self.console = ConsoleStore(self.conn)
        self.windows: dict[tuple[str, str], Window] = {}

    # -- the api's and the worker's statements -----------------------------------------

    def _admit(self, asked: list[tuple[str, str]]) -> None:
        """One batch of admissions (client, idempotency key) through the api's statement; the model checks
        each answer: a key seen before answers its job, a new one is admitted while its client has room."""
        batch = [admission(self.clients[name].id, key, REQUEST, ApiSettings()) for name, key in asked]
        results = self.run(ApiStore(self.conn).job_insert_if_admitted(admissions=batch, queue_max=QUEUE_MAX,
                                                                      client_queue_max=CLIENT_QUEUE_MAX))
        for (name, key), result in zip(asked, results, strict=True):
            client = self.clients[name]
            if key in client.keys:
                assert (result.outcome, result.public_id) == ("existing", client.keys[key]), (name, result)
            elif len(client.pending) < CLIENT_QUEUE_MAX:
                assert result.outcome == "inserted" and result.public_id is not None, (name, result)
                client.keys[key] = result.public_id
                client.pending.append(result.public_id)
                if client.since_weight_change is not None:
                    client.since_weight_change.add(result.public_id)
            else:
                assert result.outcome == "client_queue_full", (name, len(client.pending), result)

    def _post(self, name: str, jobs: int) -> None:
        self._admit([(name, uuid.uuid4().hex) for _ in range(jobs)])

    def _refill_saturated(self) -> None:
        for name, client in self.clients.items():
            if client.saturated and len(client.pending) < CLIENT_QUEUE_MAX:
                self._post(name, CLIENT_QUEUE_MAX - len(client.pending))

    def _claim(self, claimer: str, limit: int) -> None:
        """One claim statement; the windows it keeps open count it; then the saturated clients refill."""
        waiting = sum(len(c.pending) for c in self.clients.values())
        result = self.run(worker_statements.job_claim(self.conn, worker_id=claimer, claim_limit=limit,
                                                 provider="anthropic", model="m"))
        assert len(result.claimed) == min(limit, waiting), (limit, waiting, result.claimed)
        taken = dict.fromkeys(CLIENTS, 0)
        for job in result.claimed:
            name = self.by_id[job.client_id]
            client = self.clients[name]
            assert job.public_id in client.pending, (name, job.public_id)
            client.pending.remove(job.public_id)
            taken[name] += 1
            if client.since_weight_change is not None and job.public_id in client.since_weight_change:
                # a turn at the new weight was served: the client's later turns follow from it
                client.since_weight_change = None
        for (i, j), window in self.windows.items():
            if not (self.clients[i].pending and self.clients[j].pending):
                continue  # the claim took one's last job: the window closes below
            window.claims[i] += taken[i]
            window.claims[j] += taken[j]
            difference = (Fraction(window.claims[i], self.clients[i].weight)
                          - Fraction(window.claims[j], self.clients[j].weight))
            window.lowest, window.highest = min(window.lowest, difference), max(window.highest, difference)
            window.history.append(f"{claimer}:" + "".join(n * taken[n] for n in CLIENTS))
        self._keep_windows()
        self._refill_saturated()
        self._keep_windows()

    def _claims(self, claims: list[tuple[str, int]]) -> None:
        for claimer, limit in claims:
            if not any(c.pending for c in self.clients.values()):
                break
            self._claim(claimer, limit)

    def _keep_windows(self) -> None:
        """Closes the windows of pairs where one has no pending job or is not settled; opens the others."""
        for i, j in itertools.combinations(CLIENTS, 2):
            a, b = self.clients[i], self.clients[j]
            open_ = bool(a.pending and b.pending) and a.since_weight_change is None and b.since_weight_change is None
            if not open_:
                self.windows.pop((i, j), None)
            elif (i, j) not in self.windows:
                self.windows[(i, j)] = Window(claims={i: 0, j: 0})

    # -- rules --------------------------------------------------------------------------

    @initialize(weights=st.tuples(*(st.integers(1, 3) for _ in CLIENTS)),
                jobs=st.tuples(*(st.integers(0, CLIENT_QUEUE_MAX) for _ in CLIENTS)),
                saturated=st.tuples(*(st.booleans() for _ in CLIENTS)))
    def the_clients_come(self, weights: tuple[int, ...], jobs: tuple[int, ...], saturated: tuple[bool, ...]) -> None:
        """Each client starts with a weight (no turn given yet: nothing to settle), some jobs queued, and some
        keep their queue full from the start."""
        for name, weight, queued, full in zip(CLIENTS, weights, jobs, saturated, strict=True):
            assert self.run(store.api_client_weight_set(self.conn, client_id=self.clients[name].id, weight=weight))
            self.clients[name].weight = weight
            if queued:
                self._post(name, queued)
            self.clients[name].saturated = full
        self._refill_saturated()
        self._keep_windows()

    @rule(client=st.sampled_from(CLIENTS), jobs=st.integers(1, CLIENT_QUEUE_MAX), meanwhile=MEANWHILE)
    def a_client_posts(self, client: str, jobs: int, meanwhile: list[tuple[str, int]]) -> None:
        """A client sends a batch of new requests: admitted while its queue has room."""
        self._post(client, jobs)
        self._keep_windows()
        self._claims(meanwhile)

    @rule(asked=st.lists(st.sampled_from(CLIENTS), min_size=2, max_size=6), meanwhile=MEANWHILE)
    def clients_post_together(self, asked: list[str], meanwhile: list[tuple[str, int]]) -> None:
        """Several clients' requests in one admission batch, as the api's batcher sends them."""
        self._admit([(name, uuid.uuid4().hex) for name in asked])
        self._keep_windows()
        self._claims(meanwhile)

    @rule(client=st.sampled_from(CLIENTS), saturated=st.booleans(), meanwhile=MEANWHILE)
    def a_client_keeps_its_queue_full(self, client: str, saturated: bool, meanwhile: list[tuple[str, int]]) -> None:
        """A client starts (refilling to its bound now) or stops sending again the moment a slot frees."""
        self.clients[client].saturated = saturated
        self._refill_saturated()
        self._keep_windows()
        self._claims(meanwhile)

    @precondition(lambda self: any(c.pending for c in self.clients.values()))
    @rule(data=st.data(), again=st.booleans(), meanwhile=MEANWHILE)
    def a_client_cancels_and_sends_again(self, data: st.DataObject, again: bool,
                                         meanwhile: list[tuple[str, int]]) -> None:
        """A client cancels a run of its pending jobs (its DELETE: the last ones, the first ones, some in the
        middle, or all) and, ``again``, sends as many new requests."""
        name = data.draw(st.sampled_from([n for n in CLIENTS if self.clients[n].pending]))
        client = self.clients[name]
        first = data.draw(st.integers(0, len(client.pending) - 1))
        doomed = client.pending[first:first + data.draw(st.integers(1, len(client.pending) - first))]
        for job_id in doomed:
            result = self.run(ApiStore(self.conn).job_cancel(client_id=client.id, job_id=job_id))
            assert result is not None and result.cancelled and result.previous_status == "pending", result
            client.pending.remove(job_id)
        self._keep_windows()
        if again:
            self._post(name, len(doomed))
            self._keep_windows()
        self._claims(meanwhile)

    @precondition(lambda self: any(c.keys for c in self.clients.values()))
    @rule(data=st.data(), with_new=st.booleans(), meanwhile=MEANWHILE)
    def a_key_is_sent_again(self, data: st.DataObject, with_new: bool, meanwhile: list[tuple[str, int]]) -> None:
        """A client sends a key it used before (whatever became of its job), alone or with a new one:
        the same job is answered, nothing new is queued for it."""
        name = data.draw(st.sampled_from([n for n in CLIENTS if self.clients[n].keys]))
        key = data.draw(st.sampled_from(sorted(self.clients[name].keys)))
        self._admit([(name, key)] + ([(name, uuid.uuid4().hex)] if with_new else []))
        self._keep_windows()
        self._claims(meanwhile)

    @precondition(lambda self: any(c.pending for c in self.clients.values()))
    @rule(data=st.data(), meanwhile=MEANWHILE)
    def an_operator_cancels_a_clients_pending_jobs(self, data: st.DataObject, meanwhile: list[tuple[str, int]]) -> None:
        """The console's bulk cancel of every pending job of a client, under the admission lock."""
        name = data.draw(st.sampled_from([n for n in CLIENTS if self.clients[n].pending]))
        client = self.clients[name]
        filters = JobFilter(client_id=client.id)
        counted = self.run(self.console.jobs.ops_job_count_pending(filters=filters))
        assert counted.pending == len(client.pending) and counted.through_id is not None
        cancelled = self.run(self.console.jobs.ops_job_cancel_pending(filters=filters, through_id=counted.through_id))
        assert sorted(cancelled) == sorted(client.pending)
        client.pending.clear()
        self._keep_windows()
        self._claims(meanwhile)

    @rule(client=st.sampled_from(CLIENTS), weight=st.integers(1, 3), meanwhile=MEANWHILE)
    def a_clients_weight_changes(self, client: str, weight: int, meanwhile: list[tuple[str, int]]) -> None:
        """The console sets a client's weight: its jobs admitted from now on take it."""
        model = self.clients[client]
        assert self.run(store.api_client_weight_set(self.conn, client_id=model.id, weight=weight))
        if weight != model.weight:
            model.weight, model.since_weight_change = weight, set()
        self._keep_windows()
        self._claims(meanwhile)

    @rule(meanwhile=MEANWHILE)
    def the_sweeper_raises_the_claims_floor(self, meanwhile: list[tuple[str, int]]) -> None:
        """The sweeper's pass raises the turn the claim's walk starts at (under the admission lock)."""
        self.run(PgSweeperStore(self.conn).advance_claim_floor(lock_timeout_s=5))
        self._claims(meanwhile)

    @precondition(lambda self: any(c.pending for c in self.clients.values()))
    @rule(claims=st.lists(st.tuples(st.sampled_from(CLAIMERS), st.integers(1, 3)), min_size=1, max_size=12))
    def claimers_claim(self, claims: list[tuple[str, int]]) -> None:
        """Claimers claim one after the other, each up to 1 to 3 jobs, while nothing else happens."""
        self._claims(claims)

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def each_clients_pending_jobs_are_the_models(self) -> None:
        cur = self.run(self.conn.execute("SELECT client_id, public_id FROM story_jobs WHERE status = 'pending'"))
        found: dict[str, set[uuid.UUID]] = {name: set() for name in CLIENTS}
        for client_id, public_id in self.run(cur.fetchall()):
            found[self.by_id[client_id]].add(public_id)
        assert found == {name: set(c.pending) for name, c in self.clients.items()}

    @invariant()
    def no_pending_job_is_below_the_claims_floor(self) -> None:
        cur = self.run(self.conn.execute(
            "SELECT f.turn, min(j.turn) FROM job_claim_floor f "
            "LEFT JOIN story_jobs j ON j.status = 'pending' AND j.lane = 'interactive' GROUP BY f.turn"))
        floor, smallest = self.run(cur.fetchone())
        assert smallest is None or smallest >= floor, (floor, smallest)

    @invariant()
    def no_client_is_served_beyond_its_share(self) -> None:
        for (i, j), window in self.windows.items():
            bound = Fraction(1, self.clients[i].weight) + Fraction(1, self.clients[j].weight)
            assert window.highest - window.lowest <= bound, (
                f"{i} (weight {self.clients[i].weight}) and {j} (weight {self.clients[j].weight}): "
                f"claims_{i}/w_{i} - claims_{j}/w_{j} went from {window.lowest} to {window.highest}, "
                f"more than {bound}, over the claims {window.history}")


@pytest.fixture
def fair_turns_machine(server_url: str, template_db: str) -> Iterator[type[FairTurnsMachine]]:
    FairTurnsMachine.server_url, FairTurnsMachine.template = server_url, template_db
    yield FairTurnsMachine


def test_every_client_gets_its_share_of_the_claims_on_postgres(fair_turns_machine: type[FairTurnsMachine]) -> None:
    """The claims stay within the fairness bound, and the pending jobs as the model says, for every sequence
    of admissions, refills, cancels, replays, operator cancels, weight changes and claims."""
    examples = int(os.environ.get("STORYJOBS_MODEL_EXAMPLES", "25"))
    run_state_machine_as_test(fair_turns_machine, settings=settings(
        max_examples=examples, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
