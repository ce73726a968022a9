// The story page: save the API key, ask for a story, follow the job, show it.
// Every value from the api is untrusted (the story is LLM output): it is only
// ever inserted as text (textContent), never parsed as HTML.
"use strict";

(() => {
  const KEY_STORAGE = "storyjobs.apiKey";
  // the job being followed, so a reload (a phone switching apps) picks it up again
  const JOB_STORAGE = "storyjobs.jobId";
  const POLL_DEFAULT_MS = 2000;
  // someone is watching: never wait longer than this between polls
  const POLL_MAX_MS = 5000;
  const POST_ATTEMPTS = 5;
  // a longer Retry-After on the POST is reported rather than waited out
  const RETRY_AFTER_MAX_MS = 60000;

  const byId = (id) => document.getElementById(id);
  const view = {
    keyForm: byId("key-form"),
    keyInput: byId("api-key"),
    keySaved: byId("key-saved"),
    changeKey: byId("change-key"),
    storyForm: byId("story-form"),
    prompt: byId("prompt"),
    childName: byId("child-name"),
    age: byId("age"),
    length: byId("length"),
    submit: byId("submit"),
    job: byId("job"),
    status: byId("status"),
    progress: byId("progress"),
    cancel: byId("cancel"),
    error: byId("error"),
    story: byId("story"),
    storyTitle: byId("story-title"),
    storyText: byId("story-text"),
  };

  // bumped for each story followed; a poll loop of an older one stops
  let generation = 0;
  let currentJobId = null;

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  // jittered, so pages cut off together do not come back together
  const backoffMs = (failures) => Math.min(500 * 2 ** (failures - 1), 8000) * (0.5 + Math.random() / 2);
  const retryable = (response) => response.status === 429 || response.status >= 500;

  function retryAfterMs(response) {
    const seconds = Number(response.headers.get("Retry-After"));
    return Number.isFinite(seconds) && seconds > 0 ? seconds * 1000 : null;
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

  // the key lives in this tab's sessionStorage, or in localStorage when the
  // parent asks to keep it on this device
  const apiKey = () => sessionStorage.getItem(KEY_STORAGE) || localStorage.getItem(KEY_STORAGE) || "";
  function forgetKey() {
    sessionStorage.removeItem(KEY_STORAGE);
    localStorage.removeItem(KEY_STORAGE);
  }

  function call(method, path, { headers = {}, body } = {}) {
    return fetch(path, {
      method,
      headers: { Authorization: `Bearer ${apiKey()}`, ...headers },
      body,
      cache: "no-store",
    });
  }

  async function problemDetail(response) {
    try {
      const problem = await response.json();
      return String(problem.detail || problem.title || `HTTP ${response.status}`);
    } catch {
      return `HTTP ${response.status}`;
    }
  }

  // -- what the page shows --------------------------------------------------

  function showKeyState() {
    const saved = Boolean(apiKey());
    view.keyForm.hidden = saved;
    view.keySaved.hidden = !saved;
  }

  function showStatus(text, { busy = false, cancellable = false } = {}) {
    view.job.hidden = false;
    view.status.textContent = text;
    view.progress.hidden = !busy;
    view.cancel.hidden = !cancellable;
  }

  function showError(text) {
    view.error.textContent = text || "";
    view.error.hidden = !text;
  }

  function showStory(story) {
    view.storyTitle.textContent = story.title;
    const paragraphs = story.text.split(/\n\s*\n/).map((text) => text.trim()).filter(Boolean);
    view.storyText.replaceChildren(
      ...paragraphs.map((text) => {
        const paragraph = document.createElement("p");
        paragraph.textContent = text;
        return paragraph;
      }),
    );
    view.story.hidden = false;
    const still = window.matchMedia("(prefers-reduced-motion: reduce)").matches;
    view.story.scrollIntoView({ behavior: still ? "auto" : "smooth", block: "start" });
  }

  function timeLeft(job) {
    const seconds = job.estimated_seconds_remaining;
    if (seconds === null || seconds === undefined) return "";
    if (seconds < 90) return ` About ${Math.max(1, Math.round(seconds))} seconds left.`;
    return ` About ${Math.round(seconds / 60)} minutes left.`;
  }

  function showJob(job) {
    view.job.dataset.status = job.status;
    if (job.status === "pending") {
      const place = job.queue_position ? `Waiting in line: position ${job.queue_position}.` : "Waiting in line.";
      showStatus(place + timeLeft(job), { busy: true, cancellable: true });
    } else if (job.status === "running") {
      const written = job.progress ? `Writing the story… ${job.progress} tokens so far.` : "Writing the story…";
      showStatus(written + timeLeft(job), { busy: true, cancellable: true });
    } else if (job.status === "completed") {
      showStatus("The story is ready.");
      showStory(job.story);
    } else {
      const error = job.error || { code: "unknown", message: "" };
      if (error.code === "cancelled") {
        showStatus("Cancelled.");
      } else {
        showStatus("The story could not be written.");
        showError(`${error.message || "No reason was given."} (${error.code})`);
      }
    }
  }

  function showFailure(error) {
    view.progress.hidden = true;
    view.cancel.hidden = true;
    if (error instanceof ApiError && error.status === 401) {
      forgetKey();
      showKeyState();
      view.job.hidden = true;
      showError("The API key was refused. Enter it again.");
      view.keyInput.focus();
    } else if (error instanceof ApiError) {
      showError(error.message);
    } else {
      showError("Something went wrong on this page. Reload it and try again.");
    }
  }

  function clearStory() {
    showError("");
    view.story.hidden = true;
    view.storyTitle.textContent = "";
    view.storyText.replaceChildren();
  }

  // -- talking to the api ---------------------------------------------------

  // One Idempotency-Key for every attempt: a retry after a lost answer gets
  // the job the first attempt stored, never a second story.
  async function startJob(body) {
    const idempotencyKey = newIdempotencyKey();
    for (let attempt = 1; ; attempt += 1) {
      const last = attempt >= POST_ATTEMPTS;
      let response;
      try {
        response = await call("POST", "/stories/generate", {
          headers: { "Content-Type": "application/json", "Idempotency-Key": idempotencyKey },
          body: JSON.stringify(body),
        });
      } catch {
        if (last) throw new ApiError(0, "The server cannot be reached. Check the connection and try again.");
        showStatus("Connection trouble; trying again…", { busy: true });
        await sleep(backoffMs(attempt));
        continue;
      }
      if (response.status === 202) return response.json();
      const wait = retryAfterMs(response) ?? backoffMs(attempt);
      if (!retryable(response) || last || wait > RETRY_AFTER_MAX_MS) {
        throw new ApiError(response.status, await problemDetail(response));
      }
      showStatus(response.status === 429 ? "Many stories are being written; trying again shortly…"
        : "The server is busy; trying again…", { busy: true });
      await sleep(wait);
    }
  }

  // The job's state, or null when the network or the server failed for now.
  async function fetchJob(jobId) {
    let response;
    try {
      response = await call("GET", `/stories/jobs/${encodeURIComponent(jobId)}`);
      if (response.ok) return { response, job: await response.json() };
    } catch {
      return { response: null, job: null };
    }
    if (!retryable(response)) throw new ApiError(response.status, await problemDetail(response));
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
        await sleep(Math.min(retryAfterMs(response) ?? POLL_DEFAULT_MS, POLL_MAX_MS));
      } else {
        // the job goes on at the server: keep asking, it always ends
        failures += 1;
        showStatus("Connection lost; still trying…", { busy: true, cancellable: true });
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

  // -- events -------------------------------------------------------------------

  view.keyForm.addEventListener("submit", (event) => {
    event.preventDefault();
    const key = view.keyInput.value.trim();
    if (!key) {
      showError("Paste your API key first.");
      return;
    }
    forgetKey();
    (byId("key-keep").checked ? localStorage : sessionStorage).setItem(KEY_STORAGE, key);
    view.keyInput.value = "";
    showError("");
    showKeyState();
    view.prompt.focus();
  });

  view.changeKey.addEventListener("click", () => {
    forgetKey();
    showKeyState();
    view.keyInput.focus();
  });

  view.storyForm.addEventListener("submit", (event) => {
    event.preventDefault();
    if (!apiKey()) {
      showError("Enter your API key first.");
      view.keyInput.focus();
      return;
    }
    const prompt = view.prompt.value.trim();
    if (!prompt) {
      showError("Say what the story should be about.");
      view.prompt.focus();
      return;
    }
    const body = { prompt, length: view.length.value };
    if (view.childName.value.trim()) body.child_name = view.childName.value.trim();
    if (view.age.value) body.age = Number(view.age.value);

    const mine = ++generation;
    clearStory();
    showStatus("Sending…", { busy: true });
    run(mine, async () => {
      const accepted = await startJob(body);
      if (mine !== generation) return;
      currentJobId = accepted.job_id;
      localStorage.setItem(JOB_STORAGE, accepted.job_id);
      showJob({ status: accepted.status });
      await follow(accepted.job_id, mine);
    });
  });

  view.cancel.addEventListener("click", async () => {
    if (!currentJobId) return;
    const mine = generation;
    view.cancel.disabled = true;
    try {
      const response = await call("DELETE", `/stories/jobs/${encodeURIComponent(currentJobId)}`);
      // 409: it finished first; the poll loop shows how
      if (response.ok && mine === generation) {
        generation += 1;
        showJob(await response.json());
        view.submit.disabled = false;
        localStorage.removeItem(JOB_STORAGE);
      } else if (!response.ok && response.status !== 409) {
        showError(await problemDetail(response));
      }
    } catch {
      showError("The cancel did not reach the server; try again.");
    } finally {
      view.cancel.disabled = false;
    }
  });

  showKeyState();
  const unfinished = localStorage.getItem(JOB_STORAGE);
  if (unfinished && apiKey()) {
    const mine = ++generation;
    currentJobId = unfinished;
    showStatus("Checking on your story…", { busy: true });
    run(mine, () => follow(unfinished, mine));
  }
})();
