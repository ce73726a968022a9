// The story page: check and save the API key, ask for a story, follow the
// job, show it. Every value from the api is untrusted (the story is LLM
// output): it is only ever inserted as text (textContent), never parsed as HTML.
//
// The page says one thing at a time, in a parent's words (#status); the
// technical code of a failure goes to a details line for whoever helps them.
import { ApiError, problemOf, problemText, retryAfterMs, send, sleep } from "./http.js";

const KEY_STORAGE = "storyjobs.apiKey";
// the job being followed, so a reload (a phone switching apps) picks it up again
const JOB_STORAGE = "storyjobs.jobId";
const POLL_DEFAULT_MS = 2000;
// someone is watching: never wait longer than this between polls
const POLL_MAX_MS = 5000;
// a story of the batch lane comes with its whole batch, in minutes or hours:
// the api's Retry-After is honoured, up to this
const BATCH_POLL_MAX_MS = 5 * 60 * 1000;
// a busy queue is waited out for as long as a story itself may take
// (JOB_TIMEOUT_S's default) before the page stops and offers "Try again"
const BUSY_RETRY_FOR_MS = 8 * 60 * 1000;
// no single wait longer than this, whatever Retry-After says
const BUSY_WAIT_MAX_MS = 30000;
// the network or the server gone: tried for this long
const OUTAGE_RETRY_FOR_MS = 2 * 60 * 1000;
// a busy-waiting page adds up to this share of the wait, so pages turned
// away together do not come back together
const JITTER = 0.2;
// the estimate shown moves towards the api's by at most this much per poll
// when it grows (bad news comes gently)...
const ESTIMATE_UP_MAX_S = 3;
// ... and by at most this share when it shrinks
const ESTIMATE_DOWN_SHARE = 0.25;
// the languages offered; the browser's own is added when missing
const LANGUAGES = ["en", "fr", "de", "es", "it", "nl", "pt", "pl", "sv", "da", "nb", "fi", "cs", "tr", "el",
  "ru", "uk", "ar", "he", "hi", "ja", "ko", "zh"];
const NO_JOB = "00000000-0000-0000-0000-000000000000";

const byId = (id) => document.getElementById(id);
const view = {
  keyForm: byId("key-form"),
  keyInput: byId("api-key"),
  keyKeep: byId("key-keep"),
  keySaved: byId("key-saved"),
  keyMessage: byId("key-message"),
  changeKey: byId("change-key"),
  storyForm: byId("story-form"),
  prompt: byId("prompt"),
  childName: byId("child-name"),
  age: byId("age"),
  length: byId("length"),
  language: byId("language"),
  tonight: byId("tonight"),
  submit: byId("submit"),
  job: byId("job"),
  status: byId("status"),
  progress: byId("progress"),
  percent: byId("percent"),
  details: byId("details"),
  cancel: byId("cancel"),
  retry: byId("retry"),
  story: byId("story"),
  storyTitle: byId("story-title"),
  storyText: byId("story-text"),
  storyWriting: byId("story-writing"),
};

// bumped for each story followed; a loop of an older one stops
let generation = 0;
let currentJobId = null;
// the request whose POST ended without a known outcome, with its key: asked
// again (Try again, or the same story) it reuses the key, so a job the
// server did store is found rather than written twice
let unsettled = null;
let lastBody = null;

// -- the key --------------------------------------------------------------------------

// The key lives in this tab's sessionStorage, gone when the tab closes,
// unless the parent asks to keep it on this device (localStorage): a key
// left in a shared browser spends the family's budget.
const apiKey = () => sessionStorage.getItem(KEY_STORAGE) || localStorage.getItem(KEY_STORAGE) || "";

function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  localStorage.removeItem(KEY_STORAGE);
}

function storeKey(key, onThisDevice) {
  forgetKey();
  (onThisDevice ? localStorage : sessionStorage).setItem(KEY_STORAGE, key);
}

// true: the api knows the key; false: it refused it; null: no answer now.
// An id no job has: a known key is told 404, an unknown one 401.
async function keyAccepted(key) {
  try {
    const response = await send("GET", `/stories/jobs/${NO_JOB}`, { key });
    // read to its end: a body left unread holds the request open
    await response.arrayBuffer();
    if (response.status === 401) return false;
    return response.status === 404 || response.ok ? true : null;
  } catch {
    return null;
  }
}

// -- what the page shows ----------------------------------------------------------

function showKeyState() {
  const saved = Boolean(apiKey());
  view.keyForm.hidden = saved;
  view.keySaved.hidden = !saved;
}

function sayAboutKey(text) {
  view.keyMessage.textContent = text || "";
  view.keyMessage.hidden = !text;
}

// The one message: progress hidden unless given, no details, no buttons.
function say(text, { problem = false, percent = null, cancellable = false, retry = false, details = "" } = {}) {
  view.job.hidden = false;
  view.job.classList.toggle("problem", problem);
  view.status.textContent = text;
  const busy = percent !== null;
  view.progress.hidden = !busy;
  view.percent.hidden = !busy;
  if (busy) {
    view.progress.value = percent;
    view.percent.textContent = `${percent} %`;
  }
  view.details.textContent = details;
  view.details.hidden = !details;
  view.cancel.hidden = !cancellable;
  view.retry.hidden = !retry;
}

function showText(title, text) {
  view.storyTitle.textContent = title;
  const paragraphs = text.split(/\n\s*\n/).map((part) => part.trim()).filter(Boolean);
  view.storyText.replaceChildren(
    ...paragraphs.map((part) => {
      const paragraph = document.createElement("p");
      paragraph.textContent = part;
      return paragraph;
    }),
  );
}

function showStory(story) {
  // a story read as it was written is not scrolled away from: its words stay where the reader is
  const drafted = !view.story.hidden;
  showText(story.title, story.text);
  view.story.classList.remove("writing");
  view.story.removeAttribute("aria-busy");
  view.storyWriting.hidden = true;
  view.story.hidden = false;
  if (!drafted) {
    const still = window.matchMedia("(prefers-reduced-motion: reduce)").matches;
    view.story.scrollIntoView({ behavior: still ? "auto" : "smooth", block: "start" });
  }
}

// The model's answer as it streams: a first line "Title: ..." (when it has
// come), then the story.
export function draftParts(text) {
  const newline = text.indexOf("\n");
  const first = newline < 0 ? text : text.slice(0, newline);
  const title = /^\s*#*\s*title:(.*)$/i.exec(first);
  if (!title) return { title: "", text };
  return { title: title[1].trim().replace(/^["*]+|["*]+$/g, ""), text: newline < 0 ? "" : text.slice(newline + 1) };
}

// The story as it is written so far, with a sign that more is coming.
function showDraft(text) {
  const parts = draftParts(text);
  if (!parts.title && !parts.text.trim()) return;
  showText(parts.title, parts.text);
  view.story.classList.add("writing");
  view.story.setAttribute("aria-busy", "true");
  view.storyWriting.hidden = false;
  view.story.hidden = false;
}

function clearStory() {
  view.story.hidden = true;
  view.story.classList.remove("writing");
  view.story.removeAttribute("aria-busy");
  view.storyWriting.hidden = true;
  view.storyTitle.textContent = "";
  view.storyText.replaceChildren();
}

// What the page holds of the job it follows, to ask only for what changed:
// the draft's text so far and its length in code points (the api counts
// characters so, not in JavaScript's UTF-16 units), and the last answer with
// its ETag (a 304 means: still that).
let followed = null;

function followedFresh(jobId) {
  followed = { jobId, text: "", chars: 0, etag: null, job: null };
  return followed;
}

// The api's estimate moves with each poll; the one shown counts down between
// polls and follows the api's only gradually, so it never leaps.
export class Remaining {
  constructor() {
    this.shown = null;
    this.at = 0;
  }

  update(next, now = performance.now()) {
    if (next === null || next === undefined) return this.current(now);
    const counted = this.current(now);
    this.shown = counted === null ? next
      : Math.min(counted + ESTIMATE_UP_MAX_S, Math.max(counted - Math.max(ESTIMATE_UP_MAX_S, counted * ESTIMATE_DOWN_SHARE), next));
    this.at = now;
    return this.shown;
  }

  current(now = performance.now()) {
    return this.shown === null ? null : Math.max(0, this.shown - (now - this.at) / 1000);
  }
}

let remaining = new Remaining();

export function timeLeftText(seconds) {
  if (seconds === null || seconds === undefined) return "";
  if (seconds < 10) return " Almost there.";
  if (seconds < 55) return ` About ${Math.max(10, Math.round(seconds / 5) * 5)} seconds left.`;
  if (seconds < 90) return " About a minute left.";
  return ` About ${Math.round(seconds / 60)} minutes left.`;
}

// When a story of the batch lane is due at the latest, in the parent's own
// time: "by Thu 21:30" (a day and a time, as it may be tomorrow).
export function dueText(iso) {
  const due = new Date(iso);
  if (!iso || Number.isNaN(due.getTime())) return "";
  const day = due.toLocaleDateString(undefined, { weekday: "short" });
  const time = due.toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit" });
  return `by ${day} ${time}`;
}

// A story of the batch lane waits for its batch: no place in line, no
// percentage, only when it is due.
function showBatchJob(job) {
  const due = dueText(job.due_by);
  const when = due ? ` It will be ready ${due} at the latest, usually within the hour.` : "";
  if (job.status === "pending") {
    say(`Your story will be written with the next batch of stories, at half the price.${when} ` +
      "You can close this page and come back later.", { cancellable: true });
  } else {
    say(`Your story is being written with its batch.${when}`, { cancellable: true });
  }
}

// What a parent is told of a failed job, by its code.
const FAILURES = {
  queue_timeout: "So many stories were asked for that yours waited too long to be started.",
  timed_out: "Your story took too long to write, so we stopped.",
  interrupted: "The storyteller was interrupted while writing your story.",
  llm_unavailable: "The storyteller is too busy to take your story right now.",
  llm_error: "The storyteller stopped in the middle of your story.",
  llm_rejected: "This story could not be written as asked. Changing what it is about may help.",
  invalid_request: "This story could not be written as asked. Changing what it is about may help.",
  internal_error: "Something went wrong on our side while writing your story.",
};

function showJob(job) {
  view.job.dataset.status = job.status;
  view.job.dataset.lane = job.lane || "interactive";
  if (job.lane === "batch" && (job.status === "pending" || job.status === "running")) {
    showBatchJob(job);
  } else if (job.status === "pending") {
    const place = job.queue_position > 1
      ? `Your story is in line: ${job.queue_position - 1} before it.` : "Your story is next in line.";
    say(place + timeLeftText(remaining.update(job.estimated_seconds_remaining)),
      { percent: 0, cancellable: true });
  } else if (job.status === "running") {
    const percent = job.percent_done ?? 0;
    say(`Writing your story… ${percent} % done.` + timeLeftText(remaining.update(job.estimated_seconds_remaining)),
      { percent, cancellable: true });
    if (followed && followed.jobId === job.job_id && followed.text) showDraft(followed.text);
  } else if (job.status === "completed") {
    say("Your story is ready.");
    showStory(job.story);
  } else {
    const error = job.error || { code: "unknown", message: "" };
    // an unfinished story is not left on the page as if it were one
    clearStory();
    if (error.code === "cancelled") {
      say("Cancelled.");
    } else {
      say(FAILURES[error.code] || "Your story could not be written.",
        { problem: true, retry: true, details: `Details for support: ${error.code}, job ${job.job_id}` });
    }
  }
}

// An error that ended a request (not a failed job): said in plain words.
function showFailure(error) {
  if (error instanceof ApiError && error.status === 401) {
    forgetKey();
    showKeyState();
    view.job.hidden = true;
    sayAboutKey("This key was not accepted. Check it and enter it again.");
    view.keyInput.focus();
    return;
  }
  if (!(error instanceof ApiError)) {
    say("Something went wrong on this page.", { problem: true, retry: true, details: String(error) });
    return;
  }
  const reason = error.problem.reason || error.problem.type || "";
  const details = `Details for support: HTTP ${error.status || "none"}${reason ? `, ${reason}` : ""}: ${error.message}`;
  let text;
  if (error.status === 0) text = "We cannot reach the story server. Check the connection.";
  else if (error.status === 429 && String(error.problem.type || "").endsWith("budget-exhausted")) {
    text = "Today's stories have all been written. New ones can be asked for tomorrow.";
  } else if (error.status === 429) text = "Lots of stories are being written right now, and we stopped waiting.";
  else if (error.status >= 500) text = "The story server is not answering properly right now.";
  else text = "This story could not be asked for as it is.";
  say(text, { problem: true, retry: true, details });
}

// -- talking to the api ---------------------------------------------------------------

const jittered = (ms) => ms * (1 + Math.random() * JITTER);
const backoffMs = (failures) => Math.min(1000 * 2 ** (failures - 1), BUSY_WAIT_MAX_MS);

// Waits ms while saying how many seconds are left, a second at a time.
async function countdown(ms, mine, text) {
  const end = performance.now() + ms;
  for (;;) {
    const left = Math.ceil((end - performance.now()) / 1000);
    if (mine !== generation || left <= 0) return;
    say(`${text} Next try in ${left} s.`, { cancellable: false });
    await sleep(Math.min(1000, end - performance.now()));
  }
}

// One Idempotency-Key for every attempt: a retry after a lost answer gets
// the job the first attempt stored, never a second story. A full queue (429)
// or a busy server is waited out, honouring Retry-After, for a long while.
async function startJob(body, idempotencyKey, mine) {
  const began = performance.now();
  let failures = 0;
  for (;;) {
    let response = null;
    try {
      response = await send("POST", "/stories/generate", {
        key: apiKey(), headers: { "Idempotency-Key": idempotencyKey }, json: body,
      });
    } catch (error) {
      if (performance.now() - began > OUTAGE_RETRY_FOR_MS) throw error;
    }
    if (mine !== generation) return null;
    if (response && response.status === 202) return response.json();
    let problem = {};
    if (response) {
      problem = await problemOf(response);
      const retryable = (response.status === 429 && !String(problem.type || "").endsWith("budget-exhausted"))
        || response.status >= 500;
      const patience = response.status === 429 ? BUSY_RETRY_FOR_MS : OUTAGE_RETRY_FOR_MS;
      if (!retryable || performance.now() - began > patience) {
        throw new ApiError(response.status, problemText(problem, response.status), problem);
      }
    }
    failures += 1;
    const asked = response ? retryAfterMs(response) : null;
    const wait = jittered(Math.min(asked ?? backoffMs(failures), BUSY_WAIT_MAX_MS));
    const text = response && response.status === 429
      ? "Lots of stories are being written right now. We'll keep trying."
      : "We cannot reach the story server right now. We'll keep trying.";
    await countdown(wait, mine, text);
    if (mine !== generation) return null;
  }
}

// Adds a poll's draft to what the page holds: the text after the characters
// it asked from. A draft shorter than that (the server lost it) is asked for
// whole at the next poll.
function takeDraft(state, since, draft) {
  if (!draft) return;
  if (draft.chars < since) {
    state.text = "";
    state.chars = 0;
    state.etag = null;
    return;
  }
  state.text += draft.text;
  state.chars = draft.chars;
}

// The job's state, or null when the network or the server failed for now.
// Asks for the draft after what the page holds, and with the last ETag: a
// 304 answers the last state again, with no body.
async function fetchJob(jobId) {
  const state = followed && followed.jobId === jobId ? followed : followedFresh(jobId);
  const since = state.chars;
  let response;
  try {
    const headers = state.etag && state.job ? { "If-None-Match": state.etag } : {};
    response = await send("GET", `/stories/jobs/${encodeURIComponent(jobId)}?since=${since}`,
      { key: apiKey(), headers });
    // the last state again; its estimate is not repeated: the countdown goes on from where it is
    if (response.status === 304 && state.job) {
      return { response, job: { ...state.job, estimated_seconds_remaining: null } };
    }
    if (response.ok) {
      const job = await response.json();
      if (state !== followed) return { response, job };
      const lost = Boolean(job.draft) && job.draft.chars < since;
      takeDraft(state, since, job.draft);
      state.etag = lost ? null : response.headers.get("ETag");
      state.job = job;
      return { response, job };
    }
  } catch {
    return { response: null, job: null };
  }
  if (response.status !== 429 && response.status < 500) {
    const problem = await problemOf(response);
    throw new ApiError(response.status, problemText(problem, response.status), problem);
  }
  // only its Retry-After matters; read to its end all the same (a body left
  // unread holds the request, and a connection, open)
  await response.arrayBuffer().catch(() => null);
  return { response, job: null };
}

async function follow(jobId, mine) {
  let failures = 0;
  while (mine === generation) {
    const { response, job } = await fetchJob(jobId);
    if (mine !== generation) return;
    if (job) {
      failures = 0;
      showJob(job);
      if (job.status === "completed" || job.status === "failed") return;
      const longest = job.lane === "batch" ? BATCH_POLL_MAX_MS : POLL_MAX_MS;
      await sleep(Math.min(retryAfterMs(response) ?? POLL_DEFAULT_MS, longest));
    } else {
      // the job goes on at the server: keep asking, it always ends
      failures += 1;
      say("The connection was lost. Your story is still being written; we keep checking.",
        { cancellable: true });
      await sleep(Math.min((response && retryAfterMs(response)) ?? backoffMs(failures), POLL_MAX_MS));
    }
  }
}

async function run(mine, work) {
  view.submit.disabled = true;
  try {
    await work();
  } catch (error) {
    if (mine === generation) showFailure(error);
  } finally {
    if (mine === generation) {
      view.submit.disabled = false;
      localStorage.removeItem(JOB_STORAGE);
    }
  }
}

function newIdempotencyKey() {
  if (crypto.randomUUID) return crypto.randomUUID();
  // randomUUID exists only in secure contexts (https, localhost): a v4 UUID by hand
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  bytes[6] = (bytes[6] & 0x0f) | 0x40;
  bytes[8] = (bytes[8] & 0x3f) | 0x80;
  const hex = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

function ask(body) {
  const same = unsettled && JSON.stringify(unsettled.body) === JSON.stringify(body);
  const idempotencyKey = same ? unsettled.key : newIdempotencyKey();
  unsettled = { body, key: idempotencyKey };
  lastBody = body;
  const mine = ++generation;
  remaining = new Remaining();
  followed = null;
  clearStory();
  say("Sending your request…", { percent: 0 });
  run(mine, async () => {
    const accepted = await startJob(body, idempotencyKey, mine);
    if (mine !== generation || accepted === null) return;
    // the job exists: a new request from now on is a new story
    unsettled = null;
    currentJobId = accepted.job_id;
    localStorage.setItem(JOB_STORAGE, accepted.job_id);
    showJob({ job_id: accepted.job_id, status: accepted.status, lane: accepted.lane, due_by: accepted.due_by });
    await follow(accepted.job_id, mine);
  });
}

function storyBody() {
  const body = { prompt: view.prompt.value.trim(), length: view.length.value, language: view.language.value };
  if (view.childName.value.trim()) body.child_name = view.childName.value.trim();
  if (view.age.value) body.age = Number(view.age.value);
  // the batch lane: within the day, at half the price
  if (view.tonight.checked) body.lane = "batch";
  return body;
}

// -- the language -------------------------------------------------------------------

function fillLanguages() {
  const browser = (navigator.language || "en").trim();
  const primary = browser.split("-")[0].toLowerCase();
  const tags = LANGUAGES.includes(browser) || !/^[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8})*$/.test(browser)
    ? LANGUAGES : [browser, ...LANGUAGES];
  const name = (tag) => {
    try {
      const own = new Intl.DisplayNames([tag], { type: "language" }).of(tag);
      return own ? own.charAt(0).toLocaleUpperCase(tag) + own.slice(1) : tag;
    } catch {
      return tag;
    }
  };
  view.language.replaceChildren(...tags.map((tag) => {
    const option = document.createElement("option");
    option.value = tag;
    option.textContent = name(tag);
    return option;
  }));
  view.language.value = tags.includes(browser) ? browser : (LANGUAGES.includes(primary) ? primary : "en");
}

// -- events -------------------------------------------------------------------------

view.keyForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  const key = view.keyInput.value.trim();
  if (!key) {
    sayAboutKey("Paste your API key first.");
    return;
  }
  const button = view.keyForm.querySelector("button[type=submit]");
  button.disabled = true;
  sayAboutKey("Checking the key…");
  const accepted = await keyAccepted(key);
  button.disabled = false;
  if (accepted === false) {
    sayAboutKey("This key was not accepted. Check it and enter it again.");
    view.keyInput.focus();
    return;
  }
  storeKey(key, view.keyKeep.checked);
  view.keyInput.value = "";
  sayAboutKey(accepted ? "" : "The key could not be checked now; it is saved and will be checked with your first story.");
  showKeyState();
  view.prompt.focus();
});

view.changeKey.addEventListener("click", () => {
  forgetKey();
  sayAboutKey("");
  showKeyState();
  view.keyInput.focus();
});

view.storyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  if (!apiKey()) {
    sayAboutKey("Enter your API key first.");
    view.keyInput.focus();
    return;
  }
  const body = storyBody();
  if (!body.prompt) {
    say("Say what the story should be about.", { problem: true });
    view.prompt.focus();
    return;
  }
  ask(body);
});

view.retry.addEventListener("click", () => {
  if (lastBody) ask(lastBody);
});

view.cancel.addEventListener("click", async () => {
  if (!currentJobId) return;
  const mine = generation;
  view.cancel.disabled = true;
  try {
    const response = await send("DELETE", `/stories/jobs/${encodeURIComponent(currentJobId)}`, { key: apiKey() });
    // 409: it finished first; the poll loop shows how
    if (response.ok && mine === generation) {
      generation += 1;
      showJob(await response.json());
      view.submit.disabled = false;
      localStorage.removeItem(JOB_STORAGE);
    } else if (!response.ok && response.status !== 409) {
      const problem = await problemOf(response);
      say("The story could not be cancelled.", { problem: true, cancellable: true,
        details: `Details for support: HTTP ${response.status}: ${problemText(problem, response.status)}` });
    } else {
      await response.arrayBuffer().catch(() => null);
    }
  } catch {
    say("The cancel did not reach the server. Try again.", { cancellable: true, problem: true });
  } finally {
    view.cancel.disabled = false;
  }
});

fillLanguages();
showKeyState();
const unfinished = localStorage.getItem(JOB_STORAGE);
if (unfinished && apiKey()) {
  const mine = ++generation;
  currentJobId = unfinished;
  say("Checking on your story…", { percent: 0 });
  run(mine, () => follow(unfinished, mine));
}
