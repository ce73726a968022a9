// The operators' console: overview, jobs, a job's page, clients, and the
// actions (cancel a job, cancel the pending jobs a filter matches, revoke a
// client's keys). Screens are hash routes (#/, #/jobs?..., #/jobs/ID,
// #/clients) over the JSON endpoints under /ops/api.
//
// Every value from the api is untrusted (stories and error texts come from
// an LLM and a provider): it is only ever inserted as text (textContent, or
// text nodes), never parsed as HTML. The operator key travels in the
// Authorization header of each request, never in a cookie.
"use strict";

(() => {
  const KEY_STORAGE = "storyjobs.operatorKey";
  const OVERVIEW_REFRESH_MS = 15000;
  const PAGE_SIZE = 50;
  // a page that came back short is continued by itself up to this many
  // requests (each looks at a bounded stretch of history)
  const AUTO_PAGES = 10;
  const SVG_NS = "http://www.w3.org/2000/svg";

  const byId = (id) => document.getElementById(id);
  const screens = ["key", "overview", "jobs", "job", "clients"];

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // -- the key -------------------------------------------------------------------

  const operatorKey = () => sessionStorage.getItem(KEY_STORAGE) || localStorage.getItem(KEY_STORAGE) || "";

  function forgetKey() {
    sessionStorage.removeItem(KEY_STORAGE);
    localStorage.removeItem(KEY_STORAGE);
  }

  // -- building the page: text only ----------------------------------------------

  // h("td", {class: "num"}, "12", child): strings become text nodes
  function h(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value !== null && value !== undefined && value !== false) node.setAttribute(name, String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svg(tag, attrs, title) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    if (title) {
      const tip = document.createElementNS(SVG_NS, "title");
      tip.textContent = title;
      node.append(tip);
    }
    return node;
  }

  const pad = (n) => String(n).padStart(2, "0");

  function when(iso) {
    if (!iso) return "—";
    const t = new Date(iso);
    return `${t.getFullYear()}-${pad(t.getMonth() + 1)}-${pad(t.getDate())} ${pad(t.getHours())}:${pad(t.getMinutes())}:${pad(t.getSeconds())}`;
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
    if (seconds < 120) return `${seconds.toFixed(1)} s`;
    if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
    return `${(seconds / 3600).toFixed(1)} h`;
  }

  const between = (from, to) => (from && to ? (new Date(to) - new Date(from)) / 1000 : null);
  const usd = (value) => `$${value}`;
  const count = (value) => Number(value).toLocaleString("en-US");
  const ratio = (value) => (value === null || value === undefined ? "—" : `${(value * 100).toFixed(1)} %`);
  const shortId = (id) => id.slice(0, 8);
  const jobHref = (id) => `#/jobs/${encodeURIComponent(id)}`;

  function show(screen) {
    for (const name of screens) byId(`${name}-screen`).hidden = name !== screen;
    byId("nav").hidden = screen === "key";
    byId("forget-key").hidden = screen === "key";
    for (const link of byId("nav").querySelectorAll("a")) {
      const current = link.dataset.screen === screen || (screen === "job" && link.dataset.screen === "jobs");
      if (current) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
  }

  function say(id, text) {
    byId(id).textContent = text || "";
    byId(id).hidden = !text;
  }

  const showError = (text) => say("error", text);
  const showNotice = (text) => say("notice", text);

  // -- talking to the api ------------------------------------------------------------

  async function problemDetail(response) {
    try {
      const problem = await response.json();
      return String(problem.detail || problem.title || `HTTP ${response.status}`);
    } catch {
      return `HTTP ${response.status}`;
    }
  }

  async function api(method, path, body) {
    const headers = { Authorization: `Bearer ${operatorKey()}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        cache: "no-store",
        credentials: "omit",
      });
    } catch {
      throw new ApiError(0, "The server cannot be reached. Check the connection and try again.");
    }
    if (!response.ok) throw new ApiError(response.status, await problemDetail(response));
    return response.json();
  }

  function query(params) {
    const search = new URLSearchParams();
    for (const [name, value] of Object.entries(params)) {
      if (value !== null && value !== undefined && value !== "") search.set(name, value);
    }
    const text = search.toString();
    return text ? `?${text}` : "";
  }

  function failed(error) {
    if (error instanceof ApiError && error.status === 401) {
      forgetKey();
      show("key");
      showError("The operator key was refused. Enter an operator key (a client's key does not open the console).");
      byId("key-input").focus();
    } else if (error instanceof ApiError) {
      showError(error.message);
    } else {
      showError("Something went wrong on this page. Reload it and try again.");
      throw error;
    }
  }

  // -- confirmation -----------------------------------------------------------------

  // resolves true when the operator confirms
  function confirmAction(text, yesLabel) {
    const dialog = byId("confirm");
    byId("confirm-text").textContent = text;
    byId("confirm-yes").textContent = yesLabel;
    return new Promise((resolve) => {
      const done = (answer) => {
        byId("confirm-yes").removeEventListener("click", yes);
        byId("confirm-no").removeEventListener("click", no);
        dialog.removeEventListener("cancel", no);
        dialog.close();
        resolve(answer);
      };
      const yes = () => done(true);
      const no = () => done(false);
      byId("confirm-yes").addEventListener("click", yes);
      byId("confirm-no").addEventListener("click", no);
      dialog.addEventListener("cancel", no);
      dialog.showModal();
    });
  }

  // -- the vocabulary, from the api's own OpenAPI document ------------------------------

  let vocabulary = null;

  // the values of an enum somewhere in a parameter's schema ($ref followed)
  function enumOf(schema, openapi) {
    if (!schema || typeof schema !== "object") return null;
    if (typeof schema.$ref === "string" && schema.$ref.startsWith("#/components/schemas/")) {
      return enumOf(openapi.components.schemas[schema.$ref.slice("#/components/schemas/".length)], openapi);
    }
    if (Array.isArray(schema.enum)) return schema.enum.filter((v) => v !== null);
    for (const key of ["oneOf", "anyOf", "allOf"]) {
      for (const part of schema[key] || []) {
        const found = enumOf(part, openapi);
        if (found) return found;
      }
    }
    return null;
  }

  async function loadVocabulary() {
    if (vocabulary) return vocabulary;
    vocabulary = { status: [], error_code: [] };
    try {
      const response = await fetch("/schema/openapi.json", { cache: "no-store", credentials: "omit" });
      const openapi = await response.json();
      for (const param of openapi.paths["/ops/api/jobs"].get.parameters || []) {
        if (param.name in vocabulary) vocabulary[param.name] = enumOf(param.schema, openapi) || [];
      }
    } catch {
      // the selects keep "any" only; the list still works
    }
    return vocabulary;
  }

  function fillSelect(select, values, labels = {}) {
    const chosen = select.value;
    select.replaceChildren(h("option", { value: "" }, "any"), ...values.map((value) =>
      h("option", { value }, labels[value] || value)));
    select.value = chosen;
  }

  // -- overview -----------------------------------------------------------------------

  const OVERVIEW_ROWS = [
    ["Jobs completed", "jobs", "completed", count],
    ["Jobs failed", "jobs", "failed", count],
    ["… of which cancelled", "jobs", "cancelled", count],
    ["Failure ratio (cancellations aside)", "jobs", "failure_ratio", ratio],
    ["Spend", "spend", "usd", usd],
    ["Billed requests", "spend", "billed_calls", count],
    ["Tokens billed, input", "spend", "input_tokens", count],
    ["Tokens billed, output", "spend", "output_tokens", count],
    ["Stories billed but not delivered", "undelivered", "jobs", count],
    ["… what they cost", "undelivered", "usd", usd],
    ["Provider 429s (rate limited)", "provider", "rate_limited", count],
    ["Provider 529s (overloaded)", "provider", "overloaded", count],
  ];

  function renderOverview(overview) {
    const queue = overview.queue;
    document.querySelector('[data-k="queue.pending"]').textContent = count(queue.pending);
    document.querySelector('[data-k="queue.queue_max"]').textContent = count(queue.queue_max);
    document.querySelector('[data-k="queue.running"]').textContent = count(queue.running);
    document.querySelector('[data-k="queue.oldest_pending_age"]').textContent =
      queue.pending ? duration(queue.oldest_pending_age_s) : "—";
    byId("overview-rows").replaceChildren(...OVERVIEW_ROWS.map(([label, group, field, format]) =>
      h("tr", {},
        h("th", { scope: "row" }, label),
        ...["last_hour", "last_day"].map((window) => h("td", { class: "num", "data-k": `${group}.${window}.${field}` },
          format(overview[group][window][field]))))));
    const today = overview.spend.today;
    byId("budget-today").textContent = today.budget_usd === null
      ? `${usd(today.spent_usd)} spent + ${usd(today.reserved_usd)} reserved (no daily budget)`
      : `${usd(today.spent_usd)} spent + ${usd(today.reserved_usd)} reserved of ${usd(today.budget_usd)}: ` +
        `${usd(today.left_usd)} left`;
    const limiter = overview.provider.limiter;
    const kinds = [["requests", "requests"], ["input_tokens", "input tokens"], ["output_tokens", "output tokens"]]
      .filter(([kind]) => limiter[kind] !== null)
      .map(([kind, label]) => `${label} ${count(Math.floor(limiter[kind].available))} of ` +
        `${count(Math.floor(limiter[kind].capacity))} (${count(limiter[kind].per_minute)}/min)`);
    byId("limiter-now").textContent = `${limiter.model}: ` +
      (limiter.paused_s > 0 ? `held for ${duration(limiter.paused_s)} after a 429; ` : "") +
      (kinds.length ? kinds.join(", ") : "no configured limit");
    byId("overview-updated").textContent = `as of ${when(overview.generated_at)}`;
  }

  function drawBars(target, minutes, series) {
    const width = 600;
    const height = 120;
    const step = width / minutes.length;
    const top = Math.max(1e-9, ...minutes.map((m) => series.reduce((sum, s) => sum + s.value(m), 0)));
    const nodes = [svg("line", { x1: 0, y1: height - 0.5, x2: width, y2: height - 0.5, class: "axis" })];
    minutes.forEach((minute, index) => {
      let base = height;
      const label = minute.minute.slice(11, 16);
      for (const s of series) {
        const value = s.value(minute);
        if (value <= 0) continue;
        const bar = Math.max(1, (value / top) * (height - 4));
        base -= bar;
        nodes.push(svg("rect", { x: index * step + 1, y: base, width: Math.max(1, step - 2), height: bar, class: s.cls },
          `${label} UTC: ${s.title(minute)}`));
      }
    });
    target.replaceChildren(...nodes);
  }

  function renderMinutes(minutes) {
    drawBars(byId("chart-jobs"), minutes, [
      { cls: "completed", value: (m) => m.completed, title: (m) => `${m.completed} completed` },
      { cls: "failed", value: (m) => m.failed, title: (m) => `${m.failed} failed` },
    ]);
    drawBars(byId("chart-spend"), minutes, [
      { cls: "spend", value: (m) => Number(m.spend_usd), title: (m) => `$${m.spend_usd} billed` },
    ]);
    // 429s: a mark under the minutes that had any
    const chart = byId("chart-spend");
    const step = 600 / minutes.length;
    minutes.forEach((m, index) => {
      if (m.rate_limited > 0) {
        chart.append(svg("rect", { x: index * step + 1, y: 0, width: Math.max(1, step - 2), height: 4, class: "limited" },
          `${m.minute.slice(11, 16)} UTC: ${m.rate_limited} answered 429`));
      }
    });
    const sum = (field) => minutes.reduce((total, m) => total + Number(m[field]), 0);
    byId("chart-totals").textContent =
      `In these 60 minutes: ${count(sum("completed"))} completed, ${count(sum("failed"))} failed, ` +
      `$${sum("spend_usd").toFixed(6)} billed, ${count(sum("rate_limited"))} 429s.`;
  }

  let overviewTimer = null;

  async function loadOverview() {
    clearTimeout(overviewTimer);
    const [overview, chart] = await Promise.all([api("GET", "/ops/api/overview"), api("GET", "/ops/api/minutes")]);
    if (route().screen !== "overview") return;
    renderOverview(overview);
    renderMinutes(chart.minutes);
    overviewTimer = setTimeout(() => {
      if (route().screen === "overview" && document.visibilityState === "visible") guard(loadOverview());
    }, OVERVIEW_REFRESH_MS);
  }

  // -- jobs ---------------------------------------------------------------------------

  const FILTERS = ["status", "client_id", "error_code", "created_after", "created_before"];
  let jobsCursor = null;
  let jobsFilter = {};
  let jobsGeneration = 0;

  // datetime-local values are local times; the api gets UTC
  const toUtc = (local) => (local ? new Date(local).toISOString() : "");

  function toLocalInput(iso) {
    if (!iso) return "";
    const t = new Date(iso);
    return `${t.getFullYear()}-${pad(t.getMonth() + 1)}-${pad(t.getDate())}T${pad(t.getHours())}:${pad(t.getMinutes())}:${pad(t.getSeconds())}`;
  }

  function filterFromForm() {
    const form = byId("filters");
    return {
      status: form.elements.status.value,
      client_id: form.elements.client_id.value,
      error_code: form.elements.error_code.value,
      created_after: toUtc(form.elements.created_after.value),
      created_before: toUtc(form.elements.created_before.value),
    };
  }

  function filterToForm(filter) {
    const form = byId("filters");
    form.elements.status.value = filter.status || "";
    form.elements.client_id.value = filter.client_id || "";
    form.elements.error_code.value = filter.error_code || "";
    form.elements.created_after.value = toLocalInput(filter.created_after);
    form.elements.created_before.value = toLocalInput(filter.created_before);
  }

  function jobRow(job) {
    return h("tr", { "data-job-id": job.job_id },
      h("td", {}, when(job.created_at)),
      h("td", { class: "mono" }, h("a", { href: jobHref(job.job_id), title: job.job_id }, shortId(job.job_id))),
      h("td", {}, job.client_name),
      h("td", {}, h("span", { class: `badge ${job.status}` }, job.status)),
      h("td", {}, job.error_code || ""),
      h("td", { class: "mono" }, job.worker_id || ""),
      h("td", { class: "num" }, `${job.billed_calls}/${job.calls}`),
      h("td", { class: "num" }, usd(job.cost_usd)));
  }

  async function loadClientsInto(select) {
    try {
      const { clients } = await api("GET", "/ops/api/clients");
      const chosen = select.value;
      select.replaceChildren(h("option", { value: "" }, "any"),
        ...clients.map((c) => h("option", { value: String(c.client_id) }, c.name)));
      select.value = chosen;
    } catch (error) {
      failed(error);
    }
  }

  function cancellable(filter) {
    return (!filter.status || filter.status === "pending") && !filter.error_code;
  }

  async function loadJobs(filter) {
    const mine = ++jobsGeneration;
    jobsFilter = filter;
    jobsCursor = null;
    byId("jobs-rows").replaceChildren();
    byId("jobs-more").hidden = true;
    byId("cancel-matching").hidden = !cancellable(filter);
    const words = await loadVocabulary();
    fillSelect(byId("f-status"), words.status);
    fillSelect(byId("f-error"), words.error_code);
    await loadClientsInto(byId("f-client"));
    filterToForm(filter);
    await moreJobs(mine);
  }

  async function moreJobs(mine) {
    byId("jobs-more").disabled = true;
    let found = 0;
    try {
      for (let request = 0; request < AUTO_PAGES; request += 1) {
        byId("jobs-status").textContent = "Loading…";
        const page = await api("GET", `/ops/api/jobs${query({ ...jobsFilter, cursor: jobsCursor, limit: PAGE_SIZE })}`);
        if (mine !== jobsGeneration) return;
        byId("jobs-rows").append(...page.jobs.map(jobRow));
        found += page.jobs.length;
        jobsCursor = page.next_cursor;
        if (!jobsCursor || found >= PAGE_SIZE) break;
      }
      const shown = byId("jobs-rows").children.length;
      byId("jobs-status").textContent = jobsCursor
        ? `${count(shown)} jobs shown; older jobs may match.`
        : `${count(shown)} jobs: all that match.`;
      byId("jobs-more").hidden = !jobsCursor;
    } finally {
      byId("jobs-more").disabled = false;
    }
  }

  function describeFilter(filter) {
    const parts = [];
    // the client of the filter sent, which the form may no longer show
    const client = [...byId("f-client").options].find((option) => option.value === String(filter.client_id));
    if (filter.client_id) parts.push(`of client ${client ? client.textContent : `#${filter.client_id}`}`);
    if (filter.created_after) parts.push(`created after ${when(filter.created_after)}`);
    if (filter.created_before) parts.push(`created before ${when(filter.created_before)}`);
    return parts.length ? ` ${parts.join(", ")}` : " (no filter: every pending job)";
  }

  async function cancelMatching() {
    const filter = { client_id: jobsFilter.client_id, created_after: jobsFilter.created_after,
      created_before: jobsFilter.created_before };
    const match = await api("GET", `/ops/api/cancel-pending${query(filter)}`);
    if (!match.pending) {
      showNotice("No pending job matches this filter: nothing to cancel.");
      return;
    }
    const text = `Cancel ${count(match.pending)} pending job${match.pending === 1 ? "" : "s"}${describeFilter(filter)}? ` +
      "Jobs that arrive from now on are not affected.";
    if (!(await confirmAction(text, `Cancel ${count(match.pending)} jobs`))) return;
    const body = { through: match.through };
    if (filter.client_id) body.client_id = Number(filter.client_id);
    if (filter.created_after) body.created_after = filter.created_after;
    if (filter.created_before) body.created_before = filter.created_before;
    const done = await api("POST", "/ops/api/cancel-pending", body);
    showNotice(`Cancelled ${count(done.cancelled)} pending job${done.cancelled === 1 ? "" : "s"}.`);
    await loadJobs(jobsFilter);
  }

  // -- a job ----------------------------------------------------------------------------

  let currentJob = null;

  function facts(target, pairs) {
    target.replaceChildren(...pairs.flatMap(([term, value, attrs = {}]) => [h("dt", {}, term), h("dd", attrs, value)]));
  }

  function paragraphs(text) {
    return text.split(/\n\s*\n/).map((part) => part.trim()).filter(Boolean).map((part) => h("p", {}, part));
  }

  function renderJob(job) {
    currentJob = job;
    byId("job-title").textContent = `Job ${shortId(job.job_id)}`;
    byId("job-id").textContent = job.job_id;
    byId("job-status").textContent = job.status;
    byId("job-status").className = `badge ${job.status}`;
    byId("job-cancel").hidden = !(job.status === "pending" || job.status === "running");
    facts(byId("job-facts"), [
      ["Client", `${job.client_name} (client ${job.client_id})`],
      ["Worker", job.worker_id || "—", { class: "mono" }],
      ["Output tokens", count(job.progress)],
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
    byId("ledger-rows").replaceChildren(...job.calls.map((call) => h("tr", { "data-attempt": call.attempt },
      h("td", { class: "num" }, call.attempt),
      h("td", {}, call.outcome),
      h("td", {}, call.billed ? "yes" : "no"),
      h("td", { class: "num" }, count(call.input_tokens)),
      h("td", { class: "num" }, count(call.output_tokens)),
      h("td", { class: "num" }, usd(call.cost_usd)),
      h("td", { class: "mono" }, call.request_id || "—"),
      h("td", {}, when(call.started_at)),
      h("td", {}, when(call.finished_at)),
      h("td", { class: "mono" }, call.worker_id),
      h("td", {}, call.error_text || ""))));
    if (!job.calls.length) {
      byId("ledger-rows").replaceChildren(h("tr", {}, h("td", { colspan: 11, class: "muted" }, "No request was sent.")));
    }
    const request = job.request || {};
    facts(byId("job-request"), Object.keys(request).sort().filter((name) => request[name] !== null)
      .map((name) => [name, String(request[name])]));
    const story = job.story;
    byId("job-story-box").hidden = !story;
    if (story) {
      byId("job-story-title").textContent = story.title;
      byId("job-story-text").replaceChildren(...paragraphs(story.text));
      say("job-story-note", story.delivered ? ""
        : `Written and billed (${usd(story.cost_usd)}), but never delivered: the job failed.`);
    }
  }

  async function loadJob(jobId) {
    renderJob(await api("GET", `/ops/api/jobs/${encodeURIComponent(jobId)}`));
  }

  async function cancelCurrentJob() {
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

  // -- clients -----------------------------------------------------------------------

  function keyItem(client, key) {
    const item = h("li", { "data-key-prefix": key.key_prefix },
      h("code", {}, key.key_prefix), " ",
      h("span", { class: "muted" }, key.revoked_at ? `revoked ${when(key.revoked_at)}` : `active since ${when(key.created_at)}`));
    if (!key.revoked_at) {
      const button = h("button", { type: "button", class: "link danger" }, "Revoke");
      button.addEventListener("click", () => guard(revokeKey(client, key)));
      item.append(" ", button);
    }
    return item;
  }

  function renderClients(clients) {
    byId("clients-rows").replaceChildren(...clients.map((client) => {
      const active = client.keys.filter((key) => !key.revoked_at);
      const all = h("button", { type: "button", class: "danger" }, "Revoke all keys…");
      all.disabled = active.length === 0;
      all.addEventListener("click", () => guard(revokeClient(client, active)));
      const jobs = h("a", { href: `#/jobs${query({ client_id: client.client_id })}` }, "jobs");
      return h("tr", { "data-client-id": client.client_id },
        h("td", {}, h("strong", {}, client.name), h("br"), h("span", { class: "muted" }, `client ${client.client_id} · `), jobs),
        h("td", {}, client.keys.length ? h("ul", { class: "keys" }, client.keys.map((key) => keyItem(client, key)))
          : h("span", { class: "muted" }, "no keys")),
        h("td", {}, all));
    }));
  }

  async function loadClients() {
    renderClients((await api("GET", "/ops/api/clients")).clients);
  }

  async function revokeClient(client, active) {
    const text = `Revoke ${active.length} active key${active.length === 1 ? "" : "s"} of ${client.name} ` +
      `(${active.map((key) => key.key_prefix).join(", ")})? Their next request is refused.`;
    if (!(await confirmAction(text, "Revoke"))) return;
    const done = await api("POST", `/ops/api/clients/${encodeURIComponent(client.client_id)}/revoke-keys`);
    showNotice(`Revoked ${done.revoked.length} key${done.revoked.length === 1 ? "" : "s"} of ${client.name}.`);
    await loadClients();
  }

  async function revokeKey(client, key) {
    if (!(await confirmAction(`Revoke key ${key.key_prefix} of ${client.name}? Its next request is refused.`, "Revoke"))) return;
    await api("POST", `/ops/api/keys/${encodeURIComponent(key.key_prefix)}/revoke`);
    showNotice(`Revoked key ${key.key_prefix} of ${client.name}.`);
    await loadClients();
  }

  // -- routes --------------------------------------------------------------------------

  function route() {
    const hash = location.hash.replace(/^#/, "") || "/";
    const [path, search = ""] = hash.split("?");
    const params = new URLSearchParams(search);
    const job = path.match(/^\/jobs\/([^/]+)$/);
    if (job) return { screen: "job", jobId: decodeURIComponent(job[1]) };
    if (path === "/jobs") {
      const filter = {};
      for (const name of FILTERS) filter[name] = params.get(name) || "";
      return { screen: "jobs", filter };
    }
    if (path === "/clients") return { screen: "clients" };
    return { screen: "overview" };
  }

  // runs an async step; a refused key or a failed request is shown, not thrown
  function guard(promise) {
    return promise.catch(failed);
  }

  async function render() {
    showError("");
    clearTimeout(overviewTimer);
    if (!operatorKey()) {
      show("key");
      byId("key-input").focus();
      return;
    }
    const where = route();
    show(where.screen);
    if (where.screen === "overview") await loadOverview();
    else if (where.screen === "jobs") await loadJobs(where.filter);
    else if (where.screen === "job") await loadJob(where.jobId);
    else await loadClients();
  }

  // -- events -------------------------------------------------------------------------

  byId("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = byId("key-input").value.trim();
    if (!key) {
      showError("Paste an operator key first.");
      return;
    }
    forgetKey();
    (byId("key-keep").checked ? localStorage : sessionStorage).setItem(KEY_STORAGE, key);
    byId("key-input").value = "";
    showNotice("");
    guard(render());
  });

  byId("forget-key").addEventListener("click", () => {
    forgetKey();
    showNotice("The key is forgotten on this device.");
    guard(render());
  });

  byId("filters").addEventListener("submit", (event) => {
    event.preventDefault();
    showNotice("");
    const target = `#/jobs${query(filterFromForm())}`;
    if (location.hash === target) guard(loadJobs(filterFromForm()));
    else location.hash = target;
  });

  byId("f-clear").addEventListener("click", () => {
    showNotice("");
    if (location.hash === "#/jobs") guard(loadJobs({}));
    else location.hash = "#/jobs";
  });

  byId("jobs-more").addEventListener("click", () => guard(moreJobs(jobsGeneration)));
  byId("cancel-matching").addEventListener("click", () => guard(cancelMatching()));
  byId("job-cancel").addEventListener("click", () => guard(cancelCurrentJob()));
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible" && route().screen === "overview" && operatorKey()) guard(loadOverview());
  });
  window.addEventListener("hashchange", () => {
    showNotice("");
    guard(render());
  });

  guard(render());
})();
