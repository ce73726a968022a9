"""The benchmark harness end to end, in quick mode, on the test Postgres.

No timing is asserted: the machine is shared and noisy. What is checked is
that the harness runs the real processes, measures, and writes its results.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.bench import fair_claim, history, statement_cost, story_move
from tests.bench.smoke import run_quick

pytestmark = [pytest.mark.system, pytest.mark.slow]

EXPECTED_POSITIVE = {
    "drain": {"procs1_conc1", "procs1_conc10", "procs4_conc1", "procs4_conc10"},
    "pickup": {"p50_ms", "p99_ms"},
}


def test_quick_drain_and_pickup_write_json_with_positive_figures(server_url: str, tmp_path: Path) -> None:
    """`python -m tests.bench --quick --only drain,pickup` exits 0 and writes a JSON result in
    which every expected figure has a positive median, min and max, and a Markdown table."""
    document = run_quick("drain,pickup", server_url, tmp_path)
    assert document["quick"] is True
    assert set(document["benchmarks"]) == set(EXPECTED_POSITIVE)
    for name, keys in EXPECTED_POSITIVE.items():
        bench = document["benchmarks"][name]
        assert bench["error"] is None
        assert keys <= set(bench["figures"])
        for key in keys:
            figure = bench["figures"][key]
            assert {"label", "unit", "median", "min", "max", "samples"} <= set(figure)
            assert figure["min"] > 0 and figure["median"] > 0 and figure["max"] > 0, (name, key, figure)
    assert {row["benchmark"] for row in document["table"]} == set(EXPECTED_POSITIVE)
    assert document["markdown"].startswith("# storyjobs benchmarks")


# figures every system of the peer comparison reports, wherever Postgres runs
# (the backends' CPU needs a local server, so it is not among them)
PEER_FIGURES = {"drain_one_jobs_per_s", "drain_batched_jobs_per_s", "drain_one_xacts_per_job",
                "drain_batched_xacts_per_job", "pickup_p50_ms", "pickup_p99_ms"}


@pytest.fixture(scope="module")
def quick_peers(server_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run of the peer comparison, shared by the tests below."""
    return run_quick("peers", server_url, tmp_path_factory.mktemp("bench-peers"))


def _assert_positive_figures(bench: dict[str, Any], system: str) -> None:
    for key in PEER_FIGURES:
        figure = bench["figures"].get(f"{system}.{key}")
        assert figure is not None, (system, key, sorted(bench["figures"]))
        assert figure["min"] > 0 and figure["median"] > 0, (system, key, figure)


def test_quick_peers_measure_storyjobs_beside_the_bare_loop(quick_peers: dict[str, Any]) -> None:
    """`--quick --only peers` exits 0, measures storyjobs and the bare loop in one round, and reports
    their ratios in the JSON and in the Markdown section of the peer comparison."""
    bench = quick_peers["benchmarks"]["peers"]
    assert bench["error"] is None
    for system in ("storyjobs", "bare"):
        _assert_positive_figures(bench, system)
    ratio = bench["figures"]["vs_bare.drain_one_jobs_per_s"]
    assert ratio["median"] > 0 and ratio["samples"] == [ratio["median"]]
    assert "## storyjobs beside its peers" in quick_peers["markdown"]


@pytest.mark.parametrize("peer", ["pgqueuer", "procrastinate"])
def test_quick_peers_measure_each_installed_peer(quick_peers: dict[str, Any], peer: str) -> None:
    """Each peer queue that is installed gets its figures and its ratios in the quick run."""
    if importlib.util.find_spec(peer) is None:
        pytest.skip(f"{peer} is not installed: the bench extra brings it (`make bench` installs it, "
                    "`make test` does not)")
    bench = quick_peers["benchmarks"]["peers"]
    _assert_positive_figures(bench, peer)
    for key in ("drain_one_jobs_per_s", "drain_batched_jobs_per_s", "pickup_p99_ms"):
        assert bench["figures"][f"vs_{peer}.{key}"]["median"] > 0, key


def test_quick_ops_list_writes_its_four_cases(server_url: str, tmp_path: Path) -> None:
    """`python -m tests.bench --quick --only ops_list` exits 0 and writes p50 and p99 for the first page, the
    deep page, the failed jobs and the filter matching nothing, each positive."""
    bench = run_quick("ops_list", server_url, tmp_path)["benchmarks"]["ops_list"]
    assert bench["error"] is None
    expected = {f"{case}_{p}_ms" for case in ("first", "deep", "failed", "nomatch") for p in ("p50", "p99")}
    assert set(bench["figures"]) == expected
    assert all(figure["median"] > 0 for figure in bench["figures"].values())


def test_quick_statement_cost_counts_the_round_statement(server_url: str, tmp_path: Path) -> None:
    """`python -m tests.bench --quick --only statement_cost` exits 0 and counts the instructions per job of
    the round's transaction under callgrind, with and without a rate limit: a round of ten costs less per job
    than a round of one (one statement and one commit for ten), and the limiter's arithmetic, the webhook
    outbox's rows and longer stories cost more."""
    if shutil.which("valgrind") is None or statement_cost._server_bindir() is None:
        pytest.skip("valgrind or the Postgres server binaries are not installed")
    bench = run_quick("statement_cost", server_url, tmp_path)["benchmarks"]["statement_cost"]
    assert bench["error"] is None
    one, batched, limited, webhook, long_story = (
        bench["figures"][f"{key}_kinstr_per_job"]["median"]
        for key in ("one", "batched", "one_limited", "one_webhook", "long_story_batched"))
    assert 0 < batched < one < limited
    assert one < webhook and batched < long_story


def test_quick_poll_measures_the_api_beside_the_bare_app(server_url: str, tmp_path: Path) -> None:
    """`--quick --only poll` loads the api and the bare Litestar app in the same run, with no errors from the
    api, and reports their ratio, the api's requests/s over the bare app's."""
    bench = run_quick("poll", server_url, tmp_path)["benchmarks"]["poll"]
    assert bench["error"] is None
    figures = {key: figure["median"] for key, figure in bench["figures"].items()}
    assert figures["api_rps"] > 0 and figures["bare_rps"] > 0 and figures["api_errors"] == 0
    assert figures["ratio"] == pytest.approx(figures["api_rps"] / figures["bare_rps"])


def test_quick_webhooks_deliver_the_backlog(server_url: str, tmp_path: Path) -> None:
    """`python -m tests.bench --quick --only webhooks` exits 0 with a positive delivery rate at both concurrencies."""
    bench = run_quick("webhooks", server_url, tmp_path)["benchmarks"]["webhooks"]
    assert bench["error"] is None
    assert set(bench["figures"]) == {"per_s_concurrency_4", "per_s_concurrency_16"}
    assert all(figure["median"] > 0 for figure in bench["figures"].values())


def test_quick_batch_lane_bills_the_batch_lane_half_the_interactive_price(server_url: str, tmp_path: Path) -> None:
    """`python -m tests.bench --quick --only batch_lane` exits 0 with both lanes' stories completed: the same
    stories cost half as much through the batch lane, and each lane's last story has a positive time."""
    bench = run_quick("batch_lane", server_url, tmp_path)["benchmarks"]["batch_lane"]
    assert bench["error"] is None
    figures = {key: figure["median"] for key, figure in bench["figures"].items()}
    assert figures["interactive_cost_usd"] > 0 and figures["batch_cost_usd"] > 0
    assert figures["cost_ratio"] == pytest.approx(0.5, abs=0.01)
    assert figures["interactive_last_story_s"] > 0 and figures["batch_last_story_s"] > 0


def test_quick_fair_claim_shares_the_claims_with_a_saturated_client(server_url: str, tmp_path: Path) -> None:
    """`python -m tests.bench --quick --only fair_claim` exits 0 with every figure, and a client that refills
    its full queue the moment a slot frees gets 1/k of every window of claims, no more, while the others'
    first jobs wait less with the fair claim than behind its queue with the first-come one."""
    bench = run_quick("fair_claim", server_url, tmp_path)["benchmarks"]["fair_claim"]
    assert bench["error"] is None
    assert set(bench["figures"]) == set(fair_claim.SPECS)
    figures = {key: figure["median"] for key, figure in bench["figures"].items()}
    # one connection claims in turn order: the shares are exact, not timings
    assert figures["saturated_share_max_x_k"] <= 1.1
    assert 0.9 <= figures["saturated_others_share_min_x_k"] <= figures["saturated_others_share_max_x_k"] <= 1.1
    assert figures["saturated_first_job_claims_ahead_fair"] < figures["saturated_first_job_claims_ahead_fifo"]


def test_quick_history_measures_every_figure_on_an_empty_and_a_loaded_database(server_url: str,
                                                                                tmp_path: Path) -> None:
    """`python -m tests.bench --quick --only history` (30,000 finished jobs) exits 0 with every figure for both
    databases, and the day's prune deletes a thirtieth of the history on the loaded one, dropping its stories'
    partition and then the day's ledger rows, and nothing on the empty one; the next day's jobs then fit in the
    space it made."""
    bench = run_quick("history", server_url, tmp_path)["benchmarks"]["history"]
    assert bench["error"] is None
    assert set(bench["figures"]) == set(history.SPECS)
    figures = {key: figure["median"] for key, figure in bench["figures"].items()}
    assert figures["empty.prune_day_jobs"] == 0
    assert 900 <= figures["loaded.prune_day_jobs"] <= 1100
    # and, with the ledger's own retention, that day's ledger rows, their jobs gone
    assert figures["empty.ledger_prune_day_rows"] == 0
    assert 900 <= figures["loaded.ledger_prune_day_rows"] <= figures["loaded.prune_day_jobs"]
    # the day's stories went with their partition, and their space with it
    assert figures["empty.prune_day_story_partitions"] == 0 and figures["loaded.prune_day_story_partitions"] == 1
    assert figures["loaded.size_after_prune_mb"] < figures["loaded.size_before_prune_mb"]
    # and by table: every table of the history listed, the stories' partition's space back
    space = bench["params"]["prune_day_space_loaded"]
    assert {"stories", "story_jobs", "job_idempotency_keys", "webhook_deliveries", "llm_calls"} <= set(space)
    assert space["stories"]["back_mb"] > 0
    # the next day: the empty database grows by a day's size, the loaded one's day fits in the space its prune
    # made (the stories in a new partition, the rest in the rows the prune deleted)
    assert figures["empty.next_day_growth_mb"] > 0
    assert figures["loaded.next_day_growth_mb"] < figures["empty.next_day_growth_mb"] / 2
    assert set(space) <= set(bench["params"]["next_day_space_loaded"])
    assert all(figures[f"{state}.post_p99_ms"] > 0 and figures[f"{state}.claim_held_snapshot_p99_ms"] > 0
               for state in history.STATES)
    # the WAL each database's POSTs wrote: at least their jobs
    assert all(figures[f"{state}.post_wal_kb"] > 0.1 for state in history.STATES)


def test_quick_story_move_moves_the_stories_under_partitions_while_they_are_read_and_written(
    server_url: str, tmp_path: Path,
) -> None:
    """`python -m tests.bench --quick --only story_move` (30,000 finished jobs before migration 029) exits 0
    with every figure: reads and writes went on before and during the move."""
    bench = run_quick("story_move", server_url, tmp_path)["benchmarks"]["story_move"]
    assert bench["error"] is None
    assert set(bench["figures"]) == set(story_move.SPECS)
    figures = {key: figure["median"] for key, figure in bench["figures"].items()}
    assert figures["migrate_s"] > 0 and figures["first_pass_s"] > 0
    assert all(figures[f"{kind}_max_during_ms"] > 0 for kind in ("read", "write"))
