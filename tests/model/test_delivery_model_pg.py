"""A model-based test of the webhook deliverer's statements on Postgres (a
fresh database per example): the claim with its lease, the finishes
(success, failure, 410) on the delivery loop's own rules, late finishes of
attempts whose lease ran out and was claimed again, workers killed (their
leases lapse), the operator's retry, endpoints disabled and deleted, time
moving on (deliveries made due by writing next_attempt_at, never by
sleeping) and the sweeper's prune.

The model is a dict of what each delivery should be. After every step:

* every delivery is as the model says (state, attempts, lease);
* an attempt's end is recorded exactly when it is the delivery's attempt in
  flight, and at most once;
* nothing is claimed (so nothing sent) for a delivery that is not pending and
  due, or past the schedule; an endpoint the model disabled is never sent to;
* attempts never exceed webhooks.MAX_ATTEMPTS;
* no job is pruned while one of its deliveries is pending;
* the claim's fairness: no client is given a slot at a turn (its attempts in
  flight + its k-th slot) beyond that of a client it left due deliveries of;

and at the end, with nothing left to do but let the schedule run, every
event ends delivered or dead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from api.store import ApiStore
from shared import webhooks
from shared.console_store import ConsoleStore
from sweeper.store import PgSweeperStore
from tests.model.machine_pg import PostgresMachine
from tests.support.database import client_id_of, enqueue
from worker.delivery.rows import DeliveryOutcome, WebhookDeliveryClaim
from worker.delivery.store import PgDeliveryStore

LEASE_S = 60.0
CLIENTS = ("a", "b", "c")


@dataclass
class Delivery:
    client: str
    endpoint: uuid.UUID
    job_id: int
    state: str = "pending"
    attempts: int = 0
    lease: int = 0
    # an attempt holds the delivery and its lease has not run out
    in_flight: bool = False
    due: bool = True


@dataclass
class Attempt:
    claim: WebhookDeliveryClaim
    recorded: bool = False


class DeliveryMachine(PostgresMachine):
    label = "delivery"

    def __init__(self) -> None:
        super().__init__()
        with self.made():
            self.clients = {name: self.run(client_id_of(self.conn, name)) for name in CLIENTS}
            self.endpoints: dict[uuid.UUID, str] = {}
            self.disabled: set[uuid.UUID] = set()
            for name in CLIENTS:
                for n in range(2):
                    row = self.run(ApiStore(self.conn).webhook_endpoint_insert(
                        client_id=self.clients[name], url=f"https://{name}{n}.example.com/in",
                        events=webhooks.EVENTS, secret=webhooks.new_secret(), max_per_client=10))
                    assert row is not None
                    self.endpoints[row.id] = name
            self.deliveries: dict[int, Delivery] = {}
            self.attempts: list[Attempt] = []
            self.recorded: set[tuple[int, int]] = set()
            self.jobs: set[int] = set()

    # -- reading the database ----------------------------------------------------------

    async def _rows(self) -> dict[int, tuple[str, int, int, bool]]:
        cur = await self.conn.execute("SELECT id, state, attempts, lease, leased_until > now() IS TRUE "
                                      "FROM webhook_deliveries")
        return {r[0]: (r[1], r[2], r[3], r[4]) for r in await cur.fetchall()}

    # -- rules --------------------------------------------------------------------------

    @precondition(lambda self: len(self.jobs) < 6)
    @rule(client=st.sampled_from(CLIENTS))
    def a_job_ends(self, client: str) -> None:
        """A job of the client is cancelled: one delivery per enabled endpoint of it."""
        client_id = self.clients[client]
        public_id = self.run(enqueue(self.conn, client_id, "story"))
        self.run(ApiStore(self.conn).job_cancel(client_id=client_id, job_id=public_id))
        cur = self.run(self.conn.execute(
            "SELECT d.id, d.endpoint_id, d.job_id FROM webhook_deliveries d JOIN story_jobs j ON j.id = d.job_id "
            "WHERE j.public_id = %s", (public_id,)))
        rows = self.run(cur.fetchall())
        assert sorted(r[1] for r in rows) == sorted(e for e, c in self.endpoints.items()
                                                    if c == client and e not in self.disabled)
        for delivery_id, endpoint, job_id in rows:
            self.deliveries[delivery_id] = Delivery(client=client, endpoint=endpoint, job_id=job_id)
            self.jobs.add(job_id)

    @rule(limit=st.integers(1, 3))
    def claim(self, limit: int) -> None:
        """A worker with ``limit`` free slots claims; the loop finishes a disabled endpoint's dead at once."""
        in_flight = {c: sum(1 for d in self.deliveries.values() if d.client == c and d.in_flight) for c in CLIENTS}
        due = {c: sum(1 for d in self.deliveries.values() if d.client == c and d.state == "pending" and d.due)
               for c in CLIENTS}
        claimed = self.run(PgDeliveryStore(self.conn).claim(limit=limit, lease_s=LEASE_S))
        assert len(claimed) <= limit
        taken = dict.fromkeys(CLIENTS, 0)
        for claim in claimed:
            model = self.deliveries[claim.id]
            assert model.state == "pending" and model.due and not model.in_flight, (claim.id, model)
            assert model.attempts < webhooks.MAX_ATTEMPTS, "claimed past the schedule"
            assert claim.lease > model.lease, "a lease number that was not new"
            assert claim.endpoint_disabled == (model.endpoint in self.disabled)
            model.attempts, model.lease, model.in_flight, model.due = claim.attempts, claim.lease, True, False
            taken[model.client] += 1
            attempt = Attempt(claim)
            self.attempts.append(attempt)
            if claim.endpoint_disabled:
                # the loop sends nothing and records it dead
                self._finish(attempt, "dead")
        # the deliveries past the schedule the claim reached are dead now; each took its turn
        rows = self.run(self._rows())
        for delivery_id, model in self.deliveries.items():
            if model.due and model.state == "pending" and model.attempts >= webhooks.MAX_ATTEMPTS \
                    and rows[delivery_id][0] == "dead":
                model.state, model.due, model.lease = "dead", False, rows[delivery_id][2]
                taken[model.client] += 1
        # fairness: a client left with due deliveries (its next at turn in flight + taken + 1) was
        # served no later than any other client's last slot
        for left in CLIENTS:
            if due[left] > taken[left]:
                worst = in_flight[left] + taken[left] + 1
                for served in CLIENTS:
                    if taken[served]:
                        assert in_flight[served] + taken[served] <= worst, (in_flight, due, taken)

    def _finish(self, attempt: Attempt, outcome: DeliveryOutcome, status_code: int | None = None) -> None:
        claim = attempt.claim
        model = self.deliveries.get(claim.id)
        # its lease may have run out: it is still the delivery's attempt until another claim
        current = (model is not None and model.state == "pending" and model.lease == claim.lease
                   and (claim.id, claim.lease) not in self.recorded)
        retry_in = 5.0 if outcome == "retry" else 0.0
        answer = self.run(PgDeliveryStore(self.conn).finish(
            delivery_id=claim.id, lease=claim.lease, outcome=outcome, retry_in_s=retry_in,
            status_code=status_code, error=None if outcome == "delivered" else "failed"))
        assert (answer is not None) == current, (claim, model, outcome)
        attempt.recorded = True
        if answer is None or model is None:
            return
        self.recorded.add((claim.id, claim.lease))
        model.in_flight, model.due = False, False
        model.state = {"delivered": "delivered", "retry": "pending", "dead": "dead", "gone": "dead"}[outcome]
        if outcome == "gone":
            self.disabled.add(model.endpoint)
            for other in self.deliveries.values():
                if other.endpoint == model.endpoint and other.state == "pending":
                    other.state, other.in_flight, other.due = "dead", False, False

    @precondition(lambda self: any(not a.recorded for a in self.attempts))
    @rule(data=st.data(), answer=st.sampled_from(["success", "failure", "gone"]))
    def an_attempt_ends(self, data: st.DataObject, answer: str) -> None:
        """An attempt (in flight, or one that outlived its lease) ends as the loop decides from the answer."""
        attempt = data.draw(st.sampled_from([a for a in self.attempts if not a.recorded]))
        if answer == "success":
            self._finish(attempt, "delivered", 200)
        elif answer == "gone":
            self._finish(attempt, "gone", 410)
        elif webhooks.retry_in_s(attempt.claim.attempts, None, scale=1.0) is None:
            self._finish(attempt, "dead", 500)
        else:
            self._finish(attempt, "retry", 500)

    @precondition(lambda self: any(d.in_flight for d in self.deliveries.values()))
    @rule(data=st.data(), killed=st.booleans())
    def a_lease_runs_out(self, data: st.DataObject, killed: bool) -> None:
        """A worker is killed (its attempt never ends) or is slow: the attempt's lease runs out, due again."""
        delivery_id = data.draw(st.sampled_from(sorted(i for i, d in self.deliveries.items() if d.in_flight)))
        self.run(self.conn.execute("UPDATE webhook_deliveries SET next_attempt_at = now() - interval '1 second', "
                                   "leased_until = now() - interval '1 second' WHERE id = %s", (delivery_id,)))
        model = self.deliveries[delivery_id]
        model.in_flight, model.due = False, True
        if killed:
            for attempt in self.attempts:
                if attempt.claim.id == delivery_id and attempt.claim.lease == model.lease:
                    attempt.recorded = True

    @rule()
    def time_passes(self) -> None:
        """Every retry's wait is over."""
        self.run(self.conn.execute("UPDATE webhook_deliveries SET next_attempt_at = now() - interval '1 second' "
                                   "WHERE state = 'pending' AND leased_until IS NULL"))
        for model in self.deliveries.values():
            if model.state == "pending" and not model.in_flight:
                model.due = True

    @precondition(lambda self: any(d.state == "dead" for d in self.deliveries.values()))
    @rule(data=st.data())
    def an_operator_retries(self, data: st.DataObject) -> None:
        """An operator sends a dead delivery again: its endpoint enabled, its schedule from the start."""
        delivery_id = data.draw(st.sampled_from(sorted(i for i, d in self.deliveries.items() if d.state == "dead")))
        assert self.run(ConsoleStore(self.conn).webhooks.webhook_delivery_retry(delivery_id=delivery_id)) is not None
        model = self.deliveries[delivery_id]
        model.state, model.attempts, model.lease, model.due, model.in_flight = "pending", 0, model.lease + 1, True, False
        self.disabled.discard(model.endpoint)

    @rule(endpoint=st.integers(0, 5))
    def an_endpoint_is_disabled(self, endpoint: int) -> None:
        """An endpoint is disabled (as a 410 elsewhere would): nothing is sent to it any more."""
        endpoint_id = list(self.endpoints)[endpoint % len(self.endpoints)]
        self.run(self.conn.execute("UPDATE webhook_endpoints SET disabled_at = now() WHERE id = %s", (endpoint_id,)))
        self.disabled.add(endpoint_id)

    @precondition(lambda self: len(self.endpoints) > 3)
    @rule(endpoint=st.integers(0, 5))
    def an_endpoint_is_deleted(self, endpoint: int) -> None:
        """The client deletes an endpoint: its deliveries go with it; their attempts record nothing."""
        endpoint_id = list(self.endpoints)[endpoint % len(self.endpoints)]
        client = self.endpoints.pop(endpoint_id)
        assert self.run(ApiStore(self.conn).webhook_endpoint_delete(client_id=self.clients[client],
                                                                    endpoint_id=endpoint_id))
        self.disabled.discard(endpoint_id)
        for delivery_id in [i for i, d in self.deliveries.items() if d.endpoint == endpoint_id]:
            del self.deliveries[delivery_id]

    @rule()
    def the_sweeper_prunes(self) -> None:
        """The prune, as if every job had ended long ago: only jobs with no delivery pending go."""
        self.run(PgSweeperStore(self.conn).prune_finished(retention_s=60, batch_size=100,
                                                          now=datetime.now(UTC) + timedelta(days=1)))
        cur = self.run(self.conn.execute("SELECT id FROM story_jobs"))
        kept = {r[0] for r in self.run(cur.fetchall())}
        for job_id in self.jobs - kept:
            assert not any(d.job_id == job_id and d.state == "pending" for d in self.deliveries.values()), job_id
        for delivery_id in [i for i, d in self.deliveries.items() if d.job_id not in kept]:
            del self.deliveries[delivery_id]
        self.jobs &= kept

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def the_deliveries_are_as_the_model_says(self) -> None:
        rows = self.run(self._rows())
        assert set(rows) == set(self.deliveries)
        for delivery_id, (state, attempts, lease, in_flight) in rows.items():
            model = self.deliveries[delivery_id]
            assert (state, attempts, lease, in_flight) == (model.state, model.attempts, model.lease,
                                                           model.in_flight), (delivery_id, model)
            assert attempts <= webhooks.MAX_ATTEMPTS

    # -- the end ------------------------------------------------------------------------

    def drain(self) -> None:
        """Nothing left to do but let the schedule run with receivers that always fail: all end."""
        for attempt in self.attempts:
            attempt.recorded = True
        for _ in range(3 * webhooks.MAX_ATTEMPTS):
            self.time_passes()
            for model in self.deliveries.values():
                if model.in_flight:
                    model.in_flight = False
            self.run(self.conn.execute("UPDATE webhook_deliveries SET next_attempt_at = now() - interval '1 second', "
                                       "leased_until = NULL WHERE state = 'pending'"))
            claimed = self.run(PgDeliveryStore(self.conn).claim(limit=100, lease_s=LEASE_S))
            for claim in claimed:
                failed = webhooks.retry_in_s(claim.attempts, None, scale=1.0) is None or claim.endpoint_disabled
                assert self.run(PgDeliveryStore(self.conn).finish(
                    delivery_id=claim.id, lease=claim.lease, outcome="dead" if failed else "retry",
                    retry_in_s=5.0, error="failed")) is not None
        cur = self.run(self.conn.execute("SELECT count(*) FROM webhook_deliveries WHERE state = 'pending'"))
        assert self.run(cur.fetchone()) == (0,), "a delivery that never ends"


@pytest.fixture
def delivery_machine(server_url: str, template_db: str) -> Iterator[type[DeliveryMachine]]:
    DeliveryMachine.server_url, DeliveryMachine.template = server_url, template_db
    yield DeliveryMachine


def test_the_deliverer_keeps_its_promise_on_postgres(delivery_machine: type[DeliveryMachine]) -> None:
    """The model's invariants hold for every sequence of claims, ends, lapses, retries, endpoints and prunes."""
    examples = int(os.environ.get("STORYJOBS_MODEL_EXAMPLES", "25"))
    run_state_machine_as_test(delivery_machine, settings=settings(
        max_examples=examples, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
