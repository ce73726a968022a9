"""``storyjobs generate``: the command-line client of the HTTP api.

    export STORYJOBS_API_KEY=sj_...          # from `storyjobs keys create NAME`
    storyjobs generate "a dragon who can't sleep" --wait
    storyjobs generate "a week of sea stories, day 1" --lane batch

It talks to STORYJOBS_URL (default http://127.0.0.1:8000) with the key from
STORYJOBS_API_KEY, or from --key-file. Each run makes one Idempotency-Key and
sends it with every attempt of its POST: a retry after a dropped connection, a
5xx or a 429 gets the job the first attempt stored, never a second story (nor
a second bill). Waiting, it polls the job as often as Retry-After says (at most
every POLL_INTERVAL_MAX_S, since a person is watching), rides out a lost
connection with backoff (stamina: in tests, its testing mode skips the
waits), and shows where the job stands on stderr: one line rewritten in
place on a terminal, a line per change otherwise.

Without --wait it prints the job id; with --wait, the story (title, a blank
line, the text), as it is written: each poll asks for the draft's text after
what was printed (``?since=N``) and sends the last ETag back
(``If-None-Match``: a 304 while nothing changed), and the words are printed
as they come; once the story is done, the rest of it. --json prints the
api's JSON instead: the accepted job, or the finished one.

--lane batch asks for the story through the batch lane: within the day, half
the price; usually within the hour. Its job waits for the next message
batch, and stderr says when it is due at the latest; waiting for it, the
client polls as seldom as the api asks (Retry-After, at least
BATCH_POLL_INTERVAL_S), up to every BATCH_POLL_MAX_S.

Exit codes:
    0  the job was accepted (without --wait) or the story is written
    1  the job failed or was cancelled; its error code and message on stderr
    2  usage: bad arguments, no API key, a malformed STORYJOBS_URL
    3  the API key was refused (401)
    4  another 4xx: the request was refused; the problem's detail on stderr
    5  the queue stayed full (429) through every attempt
    6  the api stayed unavailable (503, another 5xx, or unreachable)
  130  interrupted (Ctrl-C); a job already accepted goes on without us
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import httpx
import stamina

from shared import logs
from shared.prompt import split_title
from shared.status import JobStatus

DEFAULT_URL = "http://127.0.0.1:8000"

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAUTHORIZED = 3
EXIT_REFUSED = 4
EXIT_QUEUE_FULL = 5
EXIT_UNAVAILABLE = 6
EXIT_INTERRUPTED = 130

# attempts of the POST; every one carries the same Idempotency-Key
POST_ATTEMPTS = 5
# the longest Retry-After waited out; a longer one is reported to the user
RETRY_AFTER_MAX_S = 60.0
POLL_INTERVAL_DEFAULT_S = 2.0
POLL_INTERVAL_MAX_S = 5.0
# a batch job takes minutes to hours: nobody needs it asked after every few seconds
BATCH_POLL_MAX_S = 300.0
# the batch lane, in its own words
BATCH_LANE_WORDS = "within the day, half the price; usually within the hour"
# stamina's jittered exponential backoff, when the api sent no Retry-After:
# jittered, so clients cut off together do not come back together
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0
BACKOFF_JITTER_S = 0.5
# how long polling rides out an unreachable or failing api before giving up
POLL_OUTAGE_MAX_S = 300.0
REQUEST_TIMEOUT = httpx.Timeout(20.0, connect=5.0)

TERMINAL = (JobStatus.COMPLETED, JobStatus.FAILED)


class ClientError(Exception):
    """Ends the command with one line on stderr and an exit code."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message


class StatusLine:
    """Where the job stands, on stderr: one line rewritten with \\r on a
    terminal; elsewhere (logs, pipes) a plain line each time the state changes."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._state = ""
        self._width = 0

    def show(self, state: str, detail: str = "") -> None:
        line = f"{state} {detail}".rstrip()
        if self._tty:
            # longer than the terminal, it would wrap and \r could not take it back
            line = line[:shutil.get_terminal_size().columns - 1]
            self._stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif state != self._state:
            self._stream.write(line + "\n")
        self._state = state
        self._stream.flush()

    def say(self, line: str) -> None:
        """A line of its own, not overwritten by the next status."""
        self.end()
        self._stream.write(line + "\n")
        self._stream.flush()

    def end(self) -> None:
        if self._tty and self._width:
            self._stream.write("\n")
            self._width = 0
        self._state = ""


def _retry_after_s(response: httpx.Response) -> float | None:
    # the api sends delay-seconds; an HTTP-date is treated as absent
    try:
        return max(float(response.headers["retry-after"]), 0.0)
    except (KeyError, ValueError):
        return None


def _retryable(response: httpx.Response) -> bool:
    return response.status_code == 429 or response.status_code >= 500


def _trouble(response: httpx.Response) -> str:
    """What a retryable answer means, for the status line."""
    if response.status_code == 429:
        return "the queue is full (429)"
    if response.status_code == 503:
        return "the api is unavailable (503)"
    return f"the api failed ({response.status_code})"


def _detail(response: httpx.Response) -> str:
    """The problem's detail (RFC 9457), else its title, else the status."""
    try:
        problem = response.json()
    except ValueError:
        problem = None
    if isinstance(problem, dict) and (problem.get("detail") or problem.get("title")):
        return str(problem.get("detail") or problem.get("title"))
    return f"HTTP {response.status_code} {response.reason_phrase}".strip()


def _refusal(response: httpx.Response) -> ClientError:
    status = response.status_code
    detail = _detail(response)
    if status == 401:
        return ClientError(EXIT_UNAUTHORIZED, f"the API key was refused (401): {detail}")
    if status == 429:
        later = _retry_after_s(response)
        hint = f"; try again in {later:.0f} s" if later else ""
        return ClientError(EXIT_QUEUE_FULL, f"no room in the queue (429): {detail}{hint}")
    if status >= 500:
        return ClientError(EXIT_UNAVAILABLE, f"{_trouble(response)}: {detail}")
    return ClientError(EXIT_REFUSED, f"the request was refused ({status}): {detail}")


def _network(exc: httpx.TransportError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _wait_text(seconds: float | None) -> str:
    """The time left in round words, as the story page says it."""
    if seconds is None:
        return ""
    if seconds < 10:
        return "(almost there)"
    if seconds < 55:
        return f"(about {max(10, round(seconds / 5) * 5)} s left)"
    if seconds < 90:
        return "(about a minute left)"
    return f"(about {round(seconds / 60)} min left)"


class Remaining:
    """The time left shown: it counts down between polls and follows the
    api's estimate by a few seconds at a time, as the story page's does."""

    UP_MAX_S = 3.0
    DOWN_SHARE = 0.25

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._shown: float | None = None
        self._at = 0.0

    def update(self, estimate: float | None) -> float | None:
        now = self._clock()
        counted = None if self._shown is None else max(0.0, self._shown - (now - self._at))
        if estimate is None:
            return counted
        self._shown = estimate if counted is None else min(
            counted + self.UP_MAX_S, max(counted - max(self.UP_MAX_S, counted * self.DOWN_SHARE), estimate))
        self._at = now
        return self._shown


class _Retryable(Exception):
    """One request's answer (or lack of one) that is worth retrying: what
    went wrong, how long the api asked us to wait, and the error to end with
    if no attempt is left."""

    def __init__(self, trouble: str, final: ClientError, retry_after_s: float | None = None) -> None:
        super().__init__(trouble)
        self.trouble = trouble
        self.final = final
        self.retry_after_s = retry_after_s


def _retry_hook(status: StatusLine, *, max_wait_s: float) -> Callable[[BaseException], bool | float]:
    """stamina's ``on``: retry a _Retryable after its Retry-After (at most
    max_wait_s), else after stamina's own backoff, saying so on the status line."""

    def hook(exc: BaseException) -> bool | float:
        if not isinstance(exc, _Retryable):
            return False
        if exc.retry_after_s is None:
            status.show(f"{exc.trouble},", "retrying")
            return True
        delay = min(exc.retry_after_s, max_wait_s)
        status.show(f"{exc.trouble},", f"retrying in {delay:.1f} s")
        return delay

    return hook


async def start_job(http: httpx.AsyncClient, body: dict[str, Any], status: StatusLine) -> dict[str, Any]:
    """POST the story request; the accepted job ({job_id, status}). Every
    attempt carries the same Idempotency-Key."""
    headers = {"Idempotency-Key": str(uuid.uuid4())}

    async def post() -> dict[str, Any]:
        try:
            response = await http.post("/stories/generate", json=body, headers=headers)
        except httpx.TransportError as exc:
            raise _Retryable(f"no answer from the api ({_network(exc)})",
                             ClientError(EXIT_UNAVAILABLE, f"cannot reach {http.base_url}: {_network(exc)}")) from None
        if response.status_code == 202:
            accepted: dict[str, Any] = response.json()
            return accepted
        retry_after = _retry_after_s(response)
        if not _retryable(response) or (retry_after or 0) > RETRY_AFTER_MAX_S:
            raise _refusal(response)
        raise _Retryable(_trouble(response), _refusal(response), retry_after)

    try:
        async for attempt in stamina.retry_context(
            on=_retry_hook(status, max_wait_s=RETRY_AFTER_MAX_S), attempts=POST_ATTEMPTS, timeout=None,
            wait_initial=BACKOFF_FIRST_S, wait_max=BACKOFF_MAX_S, wait_jitter=BACKOFF_JITTER_S,
        ):
            with attempt:
                return await post()
    except _Retryable as exc:
        raise exc.final from None
    raise AssertionError("unreachable: stamina either returns or raises")


class StoryPrinter:
    """The story printed as it is written: the title once its line has come,
    a blank line, then the text, as the drafts bring it; at the end, what the
    drafts had not brought yet. What is printed is what ``_report`` prints of
    a finished story (the title line split off as the worker splits it, the
    text without the whitespace around it), so stdout is the same story
    whether it came in pieces or at once. ``chars``: how much of the draft
    came, in code points, the next poll's ``since``."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._streamed = ""
        self._printed: str | None = None  # None: not even the title yet
        self.chars = 0

    @property
    def started(self) -> bool:
        return self._printed is not None

    def draft(self, draft: dict[str, Any] | None) -> None:
        """A poll's draft: the text after ``chars``, and its whole length. A
        draft shorter than what came (the server lost it) is waited for
        until it is long again: its text is the same."""
        if not draft or int(draft.get("chars") or 0) < self.chars:
            return
        self._streamed += str(draft.get("text") or "")
        self.chars = int(draft["chars"])
        line, newline, _ = self._streamed.partition("\n")
        if not newline:
            return
        title, _ = split_title(line)
        titled = title != "A bedtime story" or line.strip().lstrip("#").strip().lower().startswith("title:")
        body = (self._streamed[len(line) + 1:] if titled else self._streamed).lstrip()
        # whitespace at the end waits: the finished story is stripped of it
        ready = body.rstrip()
        if self._printed is None:
            self._out.write(f"{title}\n\n")
            self._printed = ""
        self._out.write(ready[len(self._printed):])
        self._printed = ready
        self._out.flush()

    def finish(self, story: dict[str, Any]) -> None:
        """The story once written: the rest of its text, or the whole of it
        when nothing was printed (or what was does not lead to it)."""
        text = str(story.get("text", ""))
        if self._printed is not None and text.startswith(self._printed):
            self._out.write(f"{text[len(self._printed):]}\n")
        else:
            if self._printed is not None:
                self._out.write("\n\n")
            self._out.write(f"{story.get('title', '')}\n\n{text}\n")
        self._out.flush()


async def wait_for_job(http: httpx.AsyncClient, job_id: str, status: StatusLine,
                       printer: StoryPrinter | None = None) -> dict[str, Any]:
    """Poll the job until it is completed or failed; that last answer. Polls
    come as often as Retry-After says (at most every POLL_INTERVAL_MAX_S); a
    failing poll is retried for up to POLL_OUTAGE_MAX_S. With a printer,
    the story's draft is printed as it comes: each poll asks for its text
    after what was printed, and sends back the last ETag (a 304 is the last
    answer again)."""
    last: tuple[str, dict[str, Any]] | None = None

    async def poll() -> httpx.Response:
        params = {"since": printer.chars} if printer is not None else {}
        headers = {"If-None-Match": last[0]} if last is not None else {}
        try:
            response = await http.get(f"/stories/jobs/{job_id}", params=params, headers=headers)
        except httpx.TransportError as exc:
            trouble = f"lost the connection to the api ({_network(exc)})"
            raise _Retryable(trouble, _gave_up(job_id, trouble)) from None
        if response.status_code == 200 or (response.status_code == 304 and last is not None):
            return response
        if not _retryable(response):
            raise _refusal(response)
        raise _Retryable(_trouble(response), _gave_up(job_id, _trouble(response)), _retry_after_s(response))

    remaining = Remaining()
    while True:
        try:
            async for attempt in stamina.retry_context(
                on=_retry_hook(status, max_wait_s=POLL_INTERVAL_MAX_S), attempts=None, timeout=POLL_OUTAGE_MAX_S,
                wait_initial=BACKOFF_FIRST_S, wait_max=POLL_INTERVAL_MAX_S, wait_jitter=BACKOFF_JITTER_S,
            ):
                with attempt:
                    response = await poll()
        except _Retryable as exc:
            raise exc.final from None
        if response.status_code == 304 and last is not None:
            # the last state again; its estimate is not repeated: the countdown goes on from where it is
            job, fresh = {**last[1], "estimated_seconds_remaining": None}, False
        else:
            job, fresh = response.json(), True
            etag = response.headers.get("etag")
            last = (etag, job) if etag else None
        if printer is None or not printer.started:
            # once the words are on the terminal, a status line would be written over them
            _show_job(job, status, remaining)
        if fresh and printer is not None and job["status"] == JobStatus.RUNNING and job.get("draft"):
            status.end()
            printer.draft(job["draft"])
        if job["status"] in TERMINAL:
            return job
        longest = BATCH_POLL_MAX_S if job.get("lane") == "batch" else POLL_INTERVAL_MAX_S
        await asyncio.sleep(min(_retry_after_s(response) or POLL_INTERVAL_DEFAULT_S, longest))


def _gave_up(job_id: str, trouble: str) -> ClientError:
    return ClientError(EXIT_UNAVAILABLE, f"gave up waiting for job {job_id}: {trouble}; "
                                         "the job goes on, ask for it again later")


def _due_text(job: dict[str, Any]) -> str:
    """A batch job's due time, in this machine's time zone."""
    try:
        due = datetime.fromisoformat(str(job["due_by"])).astimezone()
    except (KeyError, TypeError, ValueError):
        return ""
    return f"due by {due:%Y-%m-%d %H:%M %Z}".rstrip()


def _show_job(job: dict[str, Any], status: StatusLine, remaining: Remaining) -> None:
    if job.get("lane") == "batch" and job["status"] in (JobStatus.PENDING, JobStatus.RUNNING):
        # no position nor percentage: the story comes with its whole batch
        state = "waiting for the next batch" if job["status"] == JobStatus.PENDING else "in a batch"
        status.show(f"{state},", _due_text(job))
        return
    estimate = _wait_text(remaining.update(job.get("estimated_seconds_remaining")))
    if job["status"] == JobStatus.PENDING:
        position = job.get("queue_position")
        status.show(f"queued, position {position}" if position else "queued", estimate)
    elif job["status"] == JobStatus.RUNNING:
        status.show(f"writing, {job.get('percent_done') or 0} %", estimate)
    elif job["status"] == JobStatus.COMPLETED:
        status.show("written, 100 %")


def _print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _report(job: dict[str, Any], as_json: bool, printer: StoryPrinter | None = None) -> int:
    if as_json:
        _print_json(job)
    if job["status"] == JobStatus.FAILED:
        if printer is not None and printer.started:
            # what was printed is not the story: say so where it ends
            sys.stdout.write("\n")
        error = job.get("error") or {}
        raise ClientError(EXIT_JOB_FAILED, f"the story was not written ({error.get('code', 'unknown')}): "
                                           f"{error.get('message') or 'no reason given'}")
    if not as_json:
        (printer or StoryPrinter(sys.stdout)).finish(job.get("story") or {})
    return EXIT_OK


def _api_key(key_file: Path | None) -> str:
    if key_file is not None:
        try:
            key = key_file.read_text().strip()
        except OSError as exc:
            raise ClientError(EXIT_USAGE, f"cannot read the key file: {exc}") from None
    else:
        key = os.environ.get("STORYJOBS_API_KEY", "").strip()
    if not key:
        raise ClientError(EXIT_USAGE, "no API key: set STORYJOBS_API_KEY or pass --key-file "
                                      "(make one with `storyjobs keys create NAME`)")
    return key


def _base_url() -> str:
    url = os.environ.get("STORYJOBS_URL", "").strip() or DEFAULT_URL
    if not url.startswith(("http://", "https://")):
        raise ClientError(EXIT_USAGE, f"STORYJOBS_URL must start with http:// or https:// (got {url!r})")
    return url.rstrip("/")


def _story_request(args: argparse.Namespace) -> dict[str, Any]:
    options = {"child_name": args.child_name, "age": args.age, "length": args.length,
               "language": args.language, "lane": args.lane}
    # options left out take the api's defaults
    return {"prompt": args.prompt, **{name: value for name, value in options.items() if value is not None}}


async def run_generate(args: argparse.Namespace) -> int:
    # stdout is the story: log lines go to stderr, errors only (stamina logs
    # each retry as a warning, which the status line already says)
    logs.configure("error", process="cli")
    status = StatusLine(sys.stderr)
    job_id = None
    try:
        base_url = _base_url()
        headers = {"Authorization": f"Bearer {_api_key(args.key_file)}", "User-Agent": "storyjobs-cli"}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=REQUEST_TIMEOUT) as http:
            accepted = await start_job(http, _story_request(args), status)
            job_id = accepted["job_id"]
            status.end()
            if args.wait:
                status.say(f"job {job_id} accepted")
            if accepted.get("lane") == "batch":
                status.say(f"batch lane: {BATCH_LANE_WORDS}; {_due_text(accepted)}")
            if not args.wait:
                if args.json:
                    _print_json(accepted)
                else:
                    sys.stdout.write(f"{job_id}\n")
                return EXIT_OK
            printer = None if args.json else StoryPrinter(sys.stdout)
            job = await wait_for_job(http, job_id, status, printer)
        status.end()
        code = _report(job, args.json, printer)
        if printer is not None and printer.started:
            # the status the words held back, once they are all out
            _show_job(job, status, Remaining())
            status.end()
        return code
    except ClientError as exc:
        status.end()
        sys.stderr.write(f"storyjobs: {exc.message}\n")
        return exc.exit_code
    except asyncio.CancelledError:
        # Ctrl-C under asyncio.run: end quietly with the usual code, not a traceback
        status.end()
        if job_id is not None:
            sys.stderr.write(f"storyjobs: stopped waiting; job {job_id} goes on\n")
        return EXIT_INTERRUPTED


def add_generate_command(commands: Any) -> None:
    generate = commands.add_parser(
        "generate", help="ask the api for a story (STORYJOBS_URL, STORYJOBS_API_KEY)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    generate.add_argument("prompt", help="what the story is about")
    generate.add_argument("--wait", action="store_true", help="wait for the story and print it")
    generate.add_argument("--json", action="store_true", help="print the api's JSON answer instead")
    generate.add_argument("--child-name", help="the listener's name, woven into the story")
    generate.add_argument("--age", type=int, help="the listener's age, 2-12")
    generate.add_argument("--length", choices=["short", "medium", "long"], help="default: medium")
    generate.add_argument("--language", help="BCP 47 tag of the story's language, e.g. en, fr, pt-BR")
    generate.add_argument("--lane", choices=["interactive", "batch"],
                          help=f"interactive (default): written now; batch: {BATCH_LANE_WORDS}")
    generate.add_argument("--key-file", type=Path,
                          help="read the API key from this file instead of STORYJOBS_API_KEY")
    generate.set_defaults(run=run_generate)
