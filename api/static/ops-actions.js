// The console's "Recent operator actions": what operators did (who, which
// action, on what, how many it changed), from /ops/api/actions, loaded each
// time the section is opened. Self-contained: it reads the operator key
// where ops.js keeps it, and inserts every value as text only.
"use strict";

(() => {
  const KEY_STORAGE = "storyjobs.operatorKey";
  const section = document.getElementById("actions-log");
  const rows = document.getElementById("actions-rows");
  const status = document.getElementById("actions-status");
  if (!section || !rows || !status) return;

  function cell(text) {
    const td = document.createElement("td");
    td.textContent = text;
    return td;
  }

  function target(action) {
    if (action.job_id) return `job ${action.job_id}`;
    if (!action.filter) return "";
    return Object.entries(action.filter).filter(([, value]) => value !== null)
      .map(([name, value]) => `${name}=${value}`).join(", ");
  }

  async function load() {
    const key = sessionStorage.getItem(KEY_STORAGE) || localStorage.getItem(KEY_STORAGE) || "";
    status.textContent = "Loading…";
    try {
      const answer = await fetch("/ops/api/actions?limit=50", { headers: { Authorization: `Bearer ${key}` } });
      if (!answer.ok) throw new Error(`the api answered ${answer.status}`);
      const { actions } = await answer.json();
      rows.replaceChildren(...actions.map((action) => {
        const tr = document.createElement("tr");
        tr.append(cell(new Date(action.acted_at).toLocaleString()), cell(`${action.operator} (${action.operator_key_prefix})`),
          cell(action.action), cell(target(action)), cell(String(action.touched)));
        return tr;
      }));
      status.textContent = actions.length ? "" : "No operator action yet.";
    } catch (error) {
      status.textContent = `Could not load the actions: ${error.message}`;
    }
  }

  section.addEventListener("toggle", () => {
    if (section.open) load();
  });
})();
