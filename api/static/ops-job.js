// A job's page: its facts summed from its ledger (and, for a batch job, its
// batch and when it is due), timeline, every request sent to the provider,
// the request and the story; or, for an id that names no job, that alone.
import { ApiError } from "./http.js";
import { badge, between, byId, count, duration, h, shortId, usd, when } from "./format.js";
import { api, confirmAction, say, showNotice } from "./ops-ui.js";

let currentJob = null;

function facts(target, pairs) {
  target.replaceChildren(...pairs.flatMap(([term, value, attrs = {}]) => [h("dt", {}, term), h("dd", attrs, value)]));
}

function paragraphs(text) {
  return text.split(/\n\s*\n/).map((part) => part.trim()).filter(Boolean).map((part) => h("p", {}, part));
}

const OFFLINE = "offline";

// a batch job's batch, as the batches screen names it
function batchFacts(job) {
  if (job.lane !== "batch") return [];
  const facts = [];
  if (job.batch) {
    const b = job.batch;
    facts.push(["Batch", [h("a", { href: "#/batches" }, `#${b.id}`),
      ` ${b.state}` + (b.processing_status ? ` (${b.processing_status})` : "") +
      (b.provider_batch_id ? `, ${b.provider_batch_id}` : "")], { "data-k": "job.batch" }]);
  }
  if (job.waiting_for_batch_since) {
    facts.push(["Waiting for a batch", `since ${when(job.waiting_for_batch_since)}`, { "data-k": "job.waiting" }]);
  }
  if (job.due_by) facts.push(["Due by", when(job.due_by), { "data-k": "job.due_by" }]);
  return facts;
}

function renderJob(job) {
  currentJob = job;
  byId("job-missing").hidden = true;
  byId("job-found").hidden = false;
  byId("job-title").textContent = `Job ${shortId(job.job_id)}`;
  byId("job-status").replaceChildren(badge(job.status, job.error ? job.error.code : null));
  byId("job-id").textContent = job.job_id;
  byId("job-cancel").hidden = !(job.status === "pending" || job.status === "running");
  const billed = job.calls.filter((call) => call.billed);
  const sum = (field) => billed.reduce((total, call) => total + Number(call[field] || 0), 0);
  const writers = [...new Set(job.calls.map((call) => call.provider))];
  facts(byId("job-facts"), [
    ["Client", `${job.client_name} (client ${job.client_id})`],
    ["Lane", job.lane === "batch" ? "batch: in a message batch, at half the price, within the day" : "interactive",
      { "data-k": "job.lane" }],
    ...batchFacts(job),
    ["Worker", job.worker_id || "—", { class: "mono" }],
    ["Writer", writers.length ? writers.map((w) => (w === OFFLINE ? "offline writer (no charge)" : w)).join(", ") : "—"],
    ["Tokens billed", `${count(sum("input_tokens"))} in, ${count(sum("output_tokens"))} out`, { "data-k": "job.tokens" }],
    ["Billed", `${job.billed_calls} of ${job.calls.length} requests, ${usd(job.cost_usd)}`, { "data-k": "job.cost" }],
  ]);
  byId("job-error-box").hidden = !job.error;
  byId("job-error-code").textContent = job.error ? job.error.code : "";
  byId("job-error-text").textContent = job.error ? job.error.message : "";
  const t = job.timeline;
  byId("job-timeline").replaceChildren(
    h("li", {}, h("strong", {}, "Created "), when(t.created_at)),
    h("li", {}, h("strong", {}, "Claimed "), when(t.claimed_at),
      t.claimed_at ? h("span", { class: "muted" }, ` after waiting ${duration(between(t.created_at, t.claimed_at))}`) : null),
    h("li", {}, h("strong", {}, "Last heartbeat "), when(t.last_heartbeat_at)),
    h("li", {}, h("strong", {}, "Finished "), when(t.finished_at),
      t.finished_at && t.claimed_at ? h("span", { class: "muted" }, ` after running ${duration(between(t.claimed_at, t.finished_at))}`) : null));
  // a call's error text has a row of its own, the table's whole width: never clipped, at any width
  byId("ledger-rows").replaceChildren(...job.calls.flatMap((call) => [h("tr", { "data-attempt": call.attempt },
    h("td", { class: "num" }, call.attempt),
    h("td", {}, call.outcome),
    h("td", {}, call.billed ? "yes" : "no"),
    h("td", { class: "num" }, count(call.input_tokens)),
    h("td", { class: "num" }, count(call.output_tokens)),
    h("td", { class: "num" }, usd(call.cost_usd)),
    h("td", { class: "mono" }, call.request_id || "—"),
    h("td", {}, when(call.started_at)),
    h("td", { class: "num" }, duration(between(call.started_at, call.finished_at))),
    h("td", { class: "mono" }, call.worker_id)),
  call.error_text ? h("tr", { class: "error-row", "data-error-of": call.attempt },
    h("td", { colspan: 10, class: "error-text" }, call.error_text)) : null]).filter(Boolean));
  if (!job.calls.length) {
    byId("ledger-rows").replaceChildren(h("tr", {}, h("td", { colspan: 10, class: "muted" }, "No request was sent.")));
  }
  const request = job.request || {};
  facts(byId("job-request"), Object.keys(request).sort().filter((name) => request[name] !== null)
    .map((name) => [name, String(request[name])]));
  // a running job's draft, as its client's poll shows it: the text streamed so far, raw
  const draft = job.draft;
  byId("job-draft-box").hidden = !draft;
  if (draft) {
    byId("job-draft-text").replaceChildren(...paragraphs(draft.text));
    byId("job-draft-note").textContent = draft.updated_at
      ? `Still being written: ${count(draft.chars)} characters, the last at ${when(draft.updated_at)}.`
      : "Still being written: no text yet.";
  }
  const story = job.story;
  byId("job-story-box").hidden = !story;
  if (story) {
    byId("job-story-title").textContent = story.title;
    byId("job-story-text").replaceChildren(...paragraphs(story.text));
    say("job-story-note", story.delivered ? ""
      : `Written and billed (${usd(story.cost_usd)}), but never delivered: the job failed.`);
  }
}

function renderMissing(jobId) {
  currentJob = null;
  byId("job-found").hidden = true;
  byId("job-missing").hidden = false;
  byId("job-missing-id").textContent = jobId;
}

export async function loadJob(jobId) {
  // nothing of the previous job stays on screen while this one loads
  byId("job-found").hidden = true;
  byId("job-missing").hidden = true;
  try {
    renderJob(await api("GET", `/ops/api/jobs/${encodeURIComponent(jobId)}`));
  } catch (error) {
    if (error instanceof ApiError && (error.status === 404 || error.status === 400)) renderMissing(jobId);
    else throw error;
  }
}

export async function cancelCurrentJob() {
  const job = currentJob;
  if (!job) return;
  if (!(await confirmAction(`Cancel job ${job.job_id} (${job.status}, client ${job.client_name})?`, "Cancel the job"))) return;
  try {
    await api("POST", `/ops/api/jobs/${encodeURIComponent(job.job_id)}/cancel`);
    showNotice(`Job ${shortId(job.job_id)} cancelled.`);
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 409)) throw error;
    showNotice(`The job had already finished: ${error.message}.`);
  }
  await loadJob(job.job_id);
}
