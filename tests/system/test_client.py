"""``storyjobs generate``, the real console script, against the real processes.

Between the client and the api sits a small TCP proxy that the tests break on
purpose: it turns connections away for a while, or forwards a request and
then drops the connection instead of relaying the answer.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.support.database import create_key_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import REPO, System

pytestmark = pytest.mark.system

STORYJOBS = Path(sys.executable).parent / "storyjobs"
PROMPT = "a dragon who can't sleep"
TITLE = "The Dragon Who Counted Stars"
BODY = ("Once upon a time a small dragon could not sleep.\n\n"
        "She counted the stars, one by one, until her eyes grew heavy. The end.")
STORY = f"Title: {TITLE}\n{BODY}"
# the worker reports progress often, so a poll can see tokens while it runs
HEARTBEATS: dict[str, Any] = {"HEARTBEAT_INTERVAL_S": 0.5, "HEARTBEAT_TIMEOUT_S": 10}

_POST_KEY = re.compile(rb"^POST /stories/generate .*?^idempotency-key: *([^\r\n]+)", re.I | re.M | re.S)
_REPLAYED = re.compile(rb"^idempotent-replayed: *true", re.I | re.M)


class FlakyProxy:
    """A TCP proxy in front of the api that a test can break: ``cut()`` closes
    every connection and turns new ones away until ``restore()``;
    ``lose_next_answer()`` forwards the next connection's request, then drops
    that connection the moment the api answers, before relaying a byte."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        # accept() wakes up now and then to notice the end of the test
        self._listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._cut = False
        self._lose_answers = 0
        self._closed = threading.Event()
        self.turned_away = 0
        self.answers_lost = 0
        self.answers_replayed = 0
        self.post_keys: list[str] = []
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True)
        self._accepter.start()

    def __enter__(self) -> FlakyProxy:
        return self

    def __exit__(self, *_: object) -> None:
        self._closed.set()
        self._accepter.join(timeout=5)
        self._shut_all()
        for thread in self._threads:
            thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()
        self._listener.close()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
        self._shut_all()

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def lose_next_answer(self) -> None:
        with self._lock:
            self._lose_answers += 1

    def _shut_all(self) -> None:
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                downstream, _ = self._listener.accept()
            except TimeoutError:
                continue
            downstream.settimeout(None)
            with self._lock:
                turn_away = self._cut
                lose_answer = not turn_away and self._lose_answers > 0
                if turn_away:
                    self.turned_away += 1
                if lose_answer:
                    self._lose_answers -= 1
            if turn_away:
                downstream.close()
                continue
            try:
                upstream = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                downstream.close()
                continue
            upstream.settimeout(None)
            link = (downstream, upstream)
            with self._lock:
                self._sockets.extend(link)
            for source, target, is_answer in ((downstream, upstream, False), (upstream, downstream, True)):
                thread = threading.Thread(target=self._pipe, args=(link, source, target, is_answer, lose_answer),
                                          daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pipe(self, link: tuple[socket.socket, socket.socket], source: socket.socket, target: socket.socket,
              is_answer: bool, lose_answer: bool) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    if is_answer and lose_answer:
                        # the api has answered, so the job is stored; the client never hears of it
                        self.answers_lost += 1
                        break
                    if is_answer:
                        self.answers_replayed += len(_REPLAYED.findall(data))
                    else:
                        self.post_keys.extend(key.decode() for key in _POST_KEY.findall(data))
                target.sendall(data)
        except OSError:
            pass  # the other side, or cut(), ended the link
        finally:
            # either direction ending ends both; the sockets are closed at __exit__
            for sock in link:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already shut
        sock.shutdown(socket.SHUT_RDWR)


@dataclass
class ClientRun:
    """``storyjobs generate ...`` running as a process; stdout and stderr go to files."""

    popen: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def finish(self, timeout: float = 90.0) -> int:
        return self.popen.wait(timeout=timeout)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)


def start_client(tmp_path: Path, url: str, api_key: str, *args: str) -> ClientRun:
    stdout_path, stderr_path = tmp_path / "client.out", tmp_path / "client.err"
    # the console script runs this checkout's code, as the processes do (procs.System)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "STORYJOBS_URL": url, "STORYJOBS_API_KEY": api_key,
           "PYTHONPATH": str(REPO)}
    with stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
        popen = subprocess.Popen([str(STORYJOBS), "generate", *args], env=env, stdout=stdout, stderr=stderr)
    return ClientRun(popen, stdout_path, stderr_path)


def db_rows(database_url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(query).fetchall()


@pytest.fixture
def llm(fake_llm: FakeAnthropicServer) -> dict[str, Any]:
    """The worker environment that points the SDK at the fake provider."""
    return {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": fake_llm.base_url}


def test_generate_wait_shows_progress_then_prints_the_story(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, tmp_path: Path
) -> None:
    """With --wait the client reports the job as it runs on stderr and prints title, blank line and text as they
    are written, before the story is done; stdout is then the story, as a story printed at once is."""
    hold = threading.Event()
    fake_llm.fake.default = Plan(chunks=4, text=STORY, hold=hold)
    key = create_key_sync(database_url, "cli")
    api = system.api()
    system.worker(**llm, **HEARTBEATS)
    system.sweeper(**HEARTBEATS)

    client = start_client(tmp_path, api.base_url, key, PROMPT, "--wait", "--child-name", "Mia", "--age", "5",
                          "--length", "short", "--language", "fr")
    try:
        wait_until_sync(lambda: re.search(r"^writing, \d+ %", client.stderr, re.M) is not None, timeout=60,
                        what="the client to show how much is written")
        # the whole text streamed, its end held back: the words are out while the job still runs
        wait_until_sync(lambda: client.stdout.startswith(f"{TITLE}\n\n{BODY.split()[0]}"), timeout=60,
                        what="the client to print the story as it is written")
        assert db_rows(database_url, "SELECT status::text FROM story_jobs") == [("running",)]
        hold.set()
        assert client.finish() == 0, client.stderr
    finally:
        client.stop()

    assert client.stdout == f"{TITLE}\n\n{BODY}\n"
    job_id = db_rows(database_url, "SELECT public_id::text FROM story_jobs")[0][0]
    assert client.stderr.splitlines()[0] == f"job {job_id} accepted"
    assert re.search(r"^writing, \d+ %", client.stderr, re.M)
    assert not re.search(r"tokens|1 s left", client.stderr)
    assert re.search(r"^written, 100 %$", client.stderr, re.M)
    [call] = fake_llm.fake.billed
    assert "Mia" in call.prompt and "5 years old" in call.prompt and "'fr'" in call.prompt


def test_generate_wait_survives_a_dropped_connection_while_polling(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, tmp_path: Path
) -> None:
    """The api becomes unreachable while the client polls a running job; it keeps trying and prints the story."""
    hold = threading.Event()
    fake_llm.fake.default = Plan(chunks=4, text=STORY, hold=hold)
    key = create_key_sync(database_url, "cli")
    api = system.api()
    system.worker(**llm, **HEARTBEATS)
    system.sweeper(**HEARTBEATS)

    with FlakyProxy(api.port) as proxy:
        client = start_client(tmp_path, proxy.url, key, PROMPT, "--wait")
        try:
            wait_until_sync(lambda: "writing" in client.stderr, timeout=60,
                            what="the client to see the job running")
            proxy.cut()
            wait_until_sync(lambda: proxy.turned_away >= 2, timeout=60,
                            what="the client to try again while cut off")
            proxy.restore()
            hold.set()
            assert client.finish() == 0, client.stderr
        finally:
            client.stop()

    assert client.stdout == f"{TITLE}\n\n{BODY}\n"
    assert "lost the connection to the api" in client.stderr
    assert db_rows(database_url, "SELECT status::text FROM story_jobs") == [("completed",)]
    assert len(fake_llm.fake.billed) == 1


def test_generate_retries_a_lost_answer_with_the_same_key_and_gets_the_same_job(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, tmp_path: Path
) -> None:
    """The api stores the job but its answer is lost; the retry with the same Idempotency-Key gets that job:
    one job row, one billed call."""
    fake_llm.fake.default = Plan(chunks=4, text=STORY)
    key = create_key_sync(database_url, "cli")
    api = system.api()
    system.worker(**llm)
    system.sweeper()

    with FlakyProxy(api.port) as proxy:
        proxy.lose_next_answer()
        client = start_client(tmp_path, proxy.url, key, PROMPT, "--wait", "--json")
        try:
            assert client.finish() == 0, client.stderr
        finally:
            client.stop()

    job = json.loads(client.stdout)
    assert job["status"] == "completed" and job["story"]["title"] == TITLE
    assert proxy.answers_lost == 1 and proxy.answers_replayed == 1
    assert len(proxy.post_keys) == 2 and proxy.post_keys[0] == proxy.post_keys[1]
    assert db_rows(database_url, "SELECT public_id::text, idempotency_key, status::text FROM story_jobs") == [
        (job["job_id"], proxy.post_keys[0], "completed")]
    assert db_rows(database_url, "SELECT count(*) FROM llm_calls WHERE billed") == [(1,)]
    assert len(fake_llm.fake.billed) == 1


def test_generate_reports_a_failed_job_with_its_code_and_exit_status_1(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, tmp_path: Path
) -> None:
    """A job the provider refuses ends failed; the client says why in one line and exits 1."""
    fake_llm.fake.default = Plan(status=400)
    key = create_key_sync(database_url, "cli")
    api = system.api()
    system.worker(**llm)

    client = start_client(tmp_path, api.base_url, key, PROMPT, "--wait")
    try:
        assert client.finish() == 1, client.stderr
    finally:
        client.stop()

    assert client.stdout == ""
    assert client.stderr.splitlines()[-1].startswith("storyjobs: the story was not written (llm_rejected): ")


def test_generate_with_a_wrong_key_exits_3_and_stores_nothing(
    system: System, database_url: str, tmp_path: Path
) -> None:
    """A key the api does not know is a one-line error and exit status 3, and no job."""
    create_key_sync(database_url, "cli")
    api = system.api()

    client = start_client(tmp_path, api.base_url, "sj_000000000000_not-a-real-key-at-all-0000000000000000", PROMPT)
    try:
        assert client.finish() == 3
    finally:
        client.stop()

    assert client.stderr == "storyjobs: the API key was refused (401): the API key is not valid\n"
    assert db_rows(database_url, "SELECT count(*) FROM story_jobs") == [(0,)]


def test_generate_through_the_batch_lane_says_when_the_story_is_due_and_prints_it(
    system: System, database_url: str, tmp_path: Path
) -> None:
    """--lane batch sends "lane": "batch"; the client says the lane in its own words and when the story is due,
    waits for the batch (the offline batch writer: no provider key), then prints the story."""
    key = create_key_sync(database_url, "cli")
    lane: dict[str, Any] = {"BATCH_COLLECT_S": 1, "BATCH_POLL_INTERVAL_S": 1, "OFFLINE_DELAY_S": 1}
    api = system.api(**lane)
    system.worker(**lane)

    client = start_client(tmp_path, api.base_url, key, PROMPT, "--lane", "batch", "--wait")
    try:
        assert client.finish() == 0, client.stderr
    finally:
        client.stop()

    [(job_id, lane_, batch_state)] = db_rows(
        database_url, "SELECT j.public_id::text, j.lane::text, b.state FROM story_jobs j "
                      "JOIN message_batches b ON b.id = j.batch_id")
    assert (lane_, batch_state) == ("batch", "ended")
    lines = client.stderr.splitlines()
    assert lines[0] == f"job {job_id} accepted"
    assert re.fullmatch(r"batch lane: within the day, half the price; usually within the hour; "
                        r"due by \d{4}-\d\d-\d\d \d\d:\d\d \S+", lines[1]), lines[1]
    assert any(re.fullmatch(r"(waiting for the next batch|in a batch), due by \d{4}-\d\d-\d\d \d\d:\d\d \S+", line)
               for line in lines[2:]), lines
    assert re.search(r"^written, 100 %$", client.stderr, re.M)
    title, blank, *text = client.stdout.splitlines()
    assert title and blank == "" and text

    quick = start_client(tmp_path, api.base_url, key, "a second sea story", "--lane", "batch")
    try:
        assert quick.finish() == 0, quick.stderr
    finally:
        quick.stop()
    assert re.fullmatch(r"[0-9a-f-]{36}\n", quick.stdout)
    assert quick.stderr.startswith("batch lane: within the day, half the price; usually within the hour; due by ")
