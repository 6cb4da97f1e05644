// bulkgen dashboard: plain JavaScript over the JSON API (fetch + Bearer key), charts as inline SVG.
"use strict";

const ACTIVE = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
const STATUSES = ["validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled",
  "expired"];
const KEY_NAME = "bulkgen.apiKey";
const PAGE_SIZE = 20;
const main = () => document.getElementById("main");
let timer = null;      // the current view's refresh
let viewToken = 0;     // bumps on navigation so a late answer never draws over the next view

// ---- small helpers -------------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v;   // the CSP refuses style attributes, not the CSSOM
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function pad(n) { return String(n).padStart(2, "0"); }
function fmtTime(s) {
  if (!s) return "—";
  const d = new Date(s * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}
function fmtShort(s) {  // tables: the time alone for today, else the date and minute
  if (!s) return "—";
  const d = new Date(s * 1000), now = new Date();
  if (d.toDateString() === now.toDateString()) return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}`;
}
function fmtDur(s) {
  if (s === null || s === undefined) return "—";
  s = Math.round(s);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}
function fmtNum(x, digits = 1) {
  if (x === null || x === undefined) return "—";
  return Number(x).toLocaleString(undefined, { maximumFractionDigits: digits });
}
function fmtMs(s) { return s === null || s === undefined ? "—" : `${fmtNum(s * 1000, 1)} ms`; }
function finishedAt(b) { return b.completed_at || b.failed_at || b.cancelled_at || b.expired_at; }
function statusBadge(status) { return el("span", { class: `status ${status}` }, status.replace("_", " ")); }
function announce(text) { document.getElementById("live").textContent = text; }

function progress(counts) {
  const total = counts.total || 0, done = counts.completed || 0, failed = counts.failed || 0;
  const pct = (n) => (total ? (100 * n) / total : 0);
  return el("div", {},
    el("div", { class: "progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": total,
      "aria-valuenow": done + failed, "aria-label": `${done + failed} of ${total} requests done` },
    el("div", { class: "done", style: `width:${pct(done)}%` }), el("div", { class: "fail", style: `width:${pct(failed)}%` })),
    el("div", { class: "progress-text" }, `${done} done · ${failed} failed · ${total} total`));
}

// ---- the API, with the key ----------------------------------------------------------------------------
class ApiError extends Error {
  constructor(message, status, body) { super(message); this.status = status; this.body = body; }
}

let keyPrompt = null;
function askKey(reason) {
  if (keyPrompt) return keyPrompt;
  const dialog = document.getElementById("key-dialog");
  document.getElementById("key-reason").textContent = reason;
  const input = document.getElementById("key-input");
  input.value = "";
  keyPrompt = new Promise((resolve) => {
    const form = document.getElementById("key-form");
    const done = (ev) => {
      ev.preventDefault();
      if (!input.value.trim()) return;
      form.removeEventListener("submit", done);
      sessionStorage.setItem(KEY_NAME, input.value.trim());
      dialog.close();
      keyPrompt = null;
      showForget();
      resolve();
    };
    form.addEventListener("submit", done);
    dialog.addEventListener("cancel", (ev) => ev.preventDefault());  // a key is needed to go on
  });
  dialog.showModal();
  input.focus();
  return keyPrompt;
}

function showForget() { document.getElementById("forget-key").hidden = !sessionStorage.getItem(KEY_NAME); }

async function api(path, options = {}) {
  for (;;) {
    const key = sessionStorage.getItem(KEY_NAME);
    const headers = Object.assign({}, options.headers || {});
    if (key) headers.Authorization = `Bearer ${key}`;
    const res = await fetch(path, Object.assign({}, options, { headers }));
    if (res.status === 401) {
      sessionStorage.removeItem(KEY_NAME);
      showForget();
      await askKey(key ? "That key was refused. Enter a valid API key." : "This service needs an API key.");
      continue;
    }
    if (options.raw) {
      if (!res.ok) throw new ApiError(`HTTP ${res.status}`, res.status, null);
      return res;
    }
    const body = await res.json().catch(() => null);
    if (!res.ok) {
      const message = body && body.error ? body.error.message : `HTTP ${res.status}`;
      throw new ApiError(message, res.status, body);
    }
    return body;
  }
}

async function download(fileId, name) {
  const res = await api(`/v1/files/${encodeURIComponent(fileId)}/content`, { raw: true });
  const url = URL.createObjectURL(await res.blob());
  const a = el("a", { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

function downloadLink(fileId, name, text) {
  return el("a", { href: `/v1/files/${fileId}/content`, download: name, class: "button",
    onclick: (ev) => { ev.preventDefault(); download(fileId, name).catch((e) => announce(e.message)); } }, text);
}

function errorBox(message) { return el("div", { class: "error-box", role: "alert" }, message); }

function errorsTable(errors) {
  const rows = (errors && errors.data) || [];
  if (!rows.length) return el("p", { class: "muted" }, "None.");
  return el("div", { class: "table-wrap" }, el("table", { class: "errors" },
    el("thead", {}, el("tr", {}, el("th", {}, "Line"), el("th", {}, "Code"), el("th", {}, "Field"), el("th", {}, "Message"))),
    el("tbody", {}, rows.map((e) => el("tr", {},
      el("td", { class: "num" }, e.line === null || e.line === undefined ? "—" : `line ${e.line}`),
      el("td", {}, el("code", {}, e.code || "")), el("td", {}, e.param || "—"), el("td", {}, e.message))))));
}

// ---- charts ---------------------------------------------------------------------------------------------
function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function frame(W, H, L, B, xMax, yMax, xUnit, yFmt) {
  const g = svg("g", {});
  g.append(svg("line", { class: "axis", x1: L, y1: 8, x2: L, y2: H - B }));
  g.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - 8, y2: H - B }));
  for (const f of [0, 0.5, 1]) {
    const y = H - B - f * (H - B - 8);
    g.append(svg("text", { x: L - 4, y: y + 4, "text-anchor": "end" }, yFmt(f * yMax)));
  }
  g.append(svg("text", { x: L, y: H - B + 14, "text-anchor": "start" }, "0"));
  g.append(svg("text", { x: W - 8, y: H - B + 14, "text-anchor": "end" }, `${fmtNum(xMax, 2)} ${xUnit}`));
  return g;
}

function lineChart(title, points, value, opts = {}) {
  // A step plot: each timeline point covers [t_s, t_s + width_s).
  const W = 360, H = 170, L = 46, B = 22;
  const ys = points.map(value);
  const xMax = Math.max(1e-9, ...points.map((p) => p.t_s + p.width_s));
  const yMax = opts.yMax || niceMax(Math.max(0, ...ys));
  const chart = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  chart.append(svg("title", {}, title));
  chart.append(frame(W, H, L, B, xMax, yMax, "s", opts.yFmt || ((v) => fmtNum(v, 2))));
  if (points.length) {
    const X = (x) => L + (x / xMax) * (W - 8 - L), Y = (y) => H - B - (Math.min(y, yMax) / yMax) * (H - B - 8);
    let d = `M${X(points[0].t_s).toFixed(1)},${Y(ys[0]).toFixed(1)}`;
    points.forEach((p, i) => { d += ` V${Y(ys[i]).toFixed(1)} H${X(p.t_s + p.width_s).toFixed(1)}`; });
    chart.append(svg("path", { class: "line", d }));
  }
  return chart;
}

function histChart(title, hist) {
  const W = 360, H = 170, L = 46, B = 22;
  const counts = hist.counts || [], edges = (hist.edges || []).map((e) => e * 1000);
  const xMax = edges.length ? edges[edges.length - 1] : 1, yMax = niceMax(Math.max(0, ...counts));
  const chart = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  chart.append(svg("title", {}, title));
  chart.append(frame(W, H, L, B, xMax, yMax, "ms", (v) => fmtNum(v, 0)));
  const bw = (W - 8 - L) / Math.max(1, counts.length);
  counts.forEach((c, i) => {
    const h = (c / yMax) * (H - B - 8);
    if (c > 0) chart.append(svg("rect", { class: "bar", x: L + i * bw + 0.5, y: H - B - h, width: Math.max(1, bw - 1), height: h }));
  });
  return chart;
}

function figure(title, chart, note) {
  return el("figure", { class: "card figure", style: "margin:0" }, el("h3", {}, title), chart, note ? el("p", { class: "muted" }, note) : null);
}

// ---- views ----------------------------------------------------------------------------------------------
function refresh(fn, ms) {  // a hidden tab stops asking: every look at a batch list reads storage
  clearTimeout(timer);
  const tick = () => { if (document.hidden) timer = setTimeout(tick, ms); else fn(); };
  timer = setTimeout(tick, ms);
}

async function batchesView(params) {
  const token = viewToken;
  const status = params.get("status") || "";
  const after = params.get("after") || "";
  const filter = el("select", { id: "status-filter", onchange: (ev) => {
    location.hash = ev.target.value ? `#/?status=${ev.target.value}` : "#/";
  } }, el("option", { value: "" }, "All"), STATUSES.map((s) => el("option", { value: s, selected: s === status }, s.replace("_", " "))));
  const body = el("div", {}, el("p", { class: "muted" }, "Loading…"));
  main().replaceChildren(el("h1", {}, "Batches"),
    el("div", { class: "row" }, el("label", { for: "status-filter" }, "Status"), filter,
      el("a", { href: "#/new", class: "button" }, "New batch")), body);

  async function load() {
    // Newest first, from GET /v1/batches; a status filter reads on until it has a page (at most 4 reads).
    let rows = [], cursor = after || null, more = true;
    for (let reads = 0; rows.length < PAGE_SIZE && more && reads < 4; reads++) {
      const q = new URLSearchParams({ limit: status ? "50" : String(PAGE_SIZE) });
      if (cursor) q.set("after", cursor);
      const page = await api(`/v1/batches?${q}`);
      for (const b of page.data) {
        cursor = b.id;
        if (!status || b.status === status) rows.push(b);
        if (rows.length === PAGE_SIZE) break;
      }
      more = page.has_more || (rows.length === PAGE_SIZE && cursor !== page.last_id);
    }
    if (token !== viewToken) return;
    body.replaceChildren(rows.length ? batchesTable(rows) : el("p", { class: "muted", id: "empty" },
      status ? `No ${status.replace("_", " ")} batches here.` : "No batches yet. Create one with New batch."),
    el("div", { class: "pager" },
      after ? el("a", { class: "button", href: status ? `#/?status=${status}` : "#/" }, "Newest") : null,
      more ? el("a", { class: "button", href: `#/?${new URLSearchParams(Object.assign(status ? { status } : {}, { after: cursor }))}` }, "Older") : null));
    refresh(() => load().catch(showError), rows.some((b) => ACTIVE.has(b.status)) ? 2000 : 15000);
  }
  await load();
}

function batchesTable(rows) {
  return el("div", { class: "table-wrap" }, el("table", { id: "batches" },
    el("thead", {}, el("tr", {}, ["Batch", "Status", "Progress", "Model", "Endpoint", "Created", "Finished", "ETA", "Metadata"]
      .map((h, i) => el("th", { scope: "col", class: [4, 6, 8].includes(i) ? "hide-sm" : null }, h)))),
    el("tbody", {}, rows.map((b) => {
      const eta = b.status === "in_progress" && b.metrics && b.metrics.eta_s !== null && b.metrics.eta_s !== undefined
        ? `≈ ${fmtDur(b.metrics.eta_s)}` : "—";
      const meta = Object.entries(b.metadata || {}).map(([k, v]) => `${k}=${v}`).join(", ");
      return el("tr", { "data-id": b.id, "data-status": b.status },
        el("td", { "data-label": "Batch" }, el("a", { href: `#/batch/${b.id}`, class: "mono" }, b.id)),
        el("td", { "data-label": "Status" }, statusBadge(b.status)),
        el("td", { "data-label": "Progress" }, progress(b.request_counts)),
        el("td", { class: "nowrap", "data-label": "Model" }, b.model || "—"),
        el("td", { class: "hide-sm mono", "data-label": "Endpoint" }, b.endpoint),
        el("td", { class: "num", title: fmtTime(b.created_at), "data-label": "Created" }, fmtShort(b.created_at)),
        el("td", { class: "num hide-sm", title: fmtTime(finishedAt(b)), "data-label": "Finished" }, fmtShort(finishedAt(b))),
        el("td", { class: "num", "data-label": "ETA" }, eta), el("td", { class: "hide-sm", "data-label": "Metadata" }, meta || "—"));
    }))));
}

async function batchView(id) {
  const token = viewToken;
  const head = el("div", {}), facts = el("div", { class: "grid" }), errs = el("div", {}), charts = el("div", {});
  const cancel = el("button", { type: "button", class: "danger", id: "cancel", hidden: true, onclick: async () => {
    if (!confirm(`Cancel batch ${id}? Requests not yet run will not run.`)) return;
    cancel.disabled = true;
    try { await api(`/v1/batches/${id}/cancel`, { method: "POST" }); announce("Cancelling"); await load(); } catch (e) { showError(e); }
  } }, "Cancel batch");
  main().replaceChildren(el("p", {}, el("a", { href: "#/" }, "← Batches")), head, el("div", { class: "row" }, cancel), facts,
    el("h2", {}, "Batch errors"), errs, el("h2", {}, "Metrics"), charts);

  async function load() {
    const [b, tl] = await Promise.all([api(`/v1/batches/${id}`), api(`/v1/dashboard/batches/${id}/timeline`)]);
    if (token !== viewToken) return;
    head.replaceChildren(el("h1", {}, "Batch ", el("span", { class: "mono" }, b.id)),
      el("div", { class: "row" }, statusBadge(b.status), progress(b.request_counts),
        b.output_file_id ? downloadLink(b.output_file_id, `${b.id}_output.jsonl`, "Download output") : null,
        b.error_file_id ? downloadLink(b.error_file_id, `${b.id}_error.jsonl`, "Download errors") : null));
    cancel.hidden = !ACTIVE.has(b.status) || b.status === "cancelling";
    cancel.disabled = false;
    const u = b.usage || {}, m = b.metrics || {};
    const dl = (pairs) => el("dl", { class: "facts" }, pairs.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
    facts.replaceChildren(
      el("section", { class: "card", "aria-label": "Lifecycle" }, el("h2", {}, "Lifecycle"), dl([
        ["Created", fmtTime(b.created_at)], ["In progress", fmtTime(b.in_progress_at)], ["Finalizing", fmtTime(b.finalizing_at)],
        ["Completed", fmtTime(b.completed_at)], ["Failed", fmtTime(b.failed_at)], ["Cancelling", fmtTime(b.cancelling_at)],
        ["Cancelled", fmtTime(b.cancelled_at)], ["Expired", fmtTime(b.expired_at)], ["Expires", fmtTime(b.expires_at)],
        ["Time left", b.status === "in_progress" && m.eta_s !== undefined && m.eta_s !== null ? `≈ ${fmtDur(m.eta_s)}` : "—"]])),
      el("section", { class: "card", "aria-label": "Requests" }, el("h2", {}, "Requests and usage"), dl([
        ["Total", fmtNum(b.request_counts.total, 0)], ["Completed", fmtNum(b.request_counts.completed, 0)],
        ["Failed", fmtNum(b.request_counts.failed, 0)], ["Input tokens", fmtNum(u.input_tokens, 0)],
        ["Cached tokens", fmtNum((u.input_tokens_details || {}).cached_tokens, 0)],
        ["Output tokens", fmtNum(u.output_tokens, 0)], ["Total tokens", fmtNum(u.total_tokens, 0)]])),
      el("section", { class: "card", "aria-label": "Details" }, el("h2", {}, "Details"), dl([
        ["Model", b.model || "—"],
        ["LoRA adapters", Object.entries(m.adapters || {}).map(([k, v]) => `${k}: ${fmtNum(v.requests, 0)} requests, ${fmtNum(v.output_tokens, 0)} output tokens`).join("; ") || "—"],
        ["Endpoint", b.endpoint], ["Window", b.completion_window],
        ["Input file", b.input_file_id], ["Output file", b.output_file_id || "—"], ["Error file", b.error_file_id || "—"],
        ["Metadata", Object.entries(b.metadata || {}).map(([k, v]) => `${k}=${v}`).join(", ") || "—"]])),
      ...[healthCard(m.output_health, dl)].filter(Boolean));
    errs.replaceChildren(el("div", {}, errorsTable(b.errors), b.error_file_id ? el("p", { class: "muted" },
      "Requests that failed or did not run are listed, one line each, in the error file (Download errors).") : null));
    charts.replaceChildren(metricsPanel(tl, m));
    if (ACTIVE.has(b.status)) refresh(() => load().catch(showError), 1500);
  }
  await load();
}

const HEALTH_CHECKS = [["empty_answer", "Empty answers"], ["reasoning_without_answer", "Reasoning, no answer"],
  ["schema_failed", "Failed their schema"], ["tool_call_unparsed", "Tool calls not parsed"]];

function healthCard(h, dl) {
  // what the answers are (bulkgen.metrics.health): finish reasons and problems, each with its first custom_ids
  if (!h || !h.answers) return null;
  const reasons = Object.entries(h.finish_reasons || {}).map(([k, v]) => `${k}: ${fmtNum(v, 0)}`).join(" · ") || "—";
  const problem = ([key, label]) => {
    const p = h[key] || { count: 0, custom_ids: [] };
    return [label, p.count ? `${fmtNum(p.count, 0)} (${p.custom_ids.join(", ")}${p.count > p.custom_ids.length ? ", …" : ""})` : "0"];
  };
  return el("section", { class: "card", "aria-label": "Output health", id: "output-health" }, el("h2", {}, "Output health"),
    dl([["Answers", fmtNum(h.answers, 0)], ["Finish reasons", reasons], ...HEALTH_CHECKS.map(problem)]));
}

function metricsPanel(tl, m) {
  const pts = tl.points || [];
  const s = tl.summary || {};
  const pct = (v) => (v === null || v === undefined ? "—" : `${fmtNum(v, 2)}%`);
  const lat = (k) => { const p = s[k] || {}; return `p50 ${fmtMs(p.p50)} · p95 ${fmtMs(p.p95)} · p99 ${fmtMs(p.p99)} · ${p.count || 0} requests`; };
  if (!pts.length && !s.requests) return el("p", { class: "muted", id: "no-metrics" }, "No metrics yet: they appear once requests finish.");
  return el("div", { id: "metrics" },
    el("div", { class: "card" }, el("dl", { class: "facts" },
      el("dt", {}, "Output tokens/s"), el("dd", {}, fmtNum(s.output_tokens_per_s)),
      el("dt", {}, "Slot efficiency"), el("dd", {}, s.slot_efficiency === null || s.slot_efficiency === undefined ? "—" : fmtNum(s.slot_efficiency * 100, 1) + "%"),
      el("dt", {}, "Decode padding"), el("dd", {}, pct(s.decode_padding_pct)),
      el("dt", {}, "Prefill padding"), el("dd", {}, pct(s.prefill_padding_pct)),
      el("dt", {}, "Wall time"), el("dd", {}, s.wall_time_s !== undefined ? `${fmtNum(s.wall_time_s, 2)} s` : "—"),
      el("dt", {}, "Preemptions"), el("dd", {}, fmtNum(s.preemptions, 0)))),
    el("div", { class: "grid" },
      figure("Output tokens/s over time", lineChart("Output tokens per second over time", pts, (p) => p.output_tokens_per_s),
        `mean ${fmtNum(s.output_tokens_per_s)} tokens/s`),
      figure("Slot occupancy over time", lineChart("Slot occupancy over time", pts, (p) => p.occupancy,
        { yMax: 1, yFmt: (v) => `${Math.round(v * 100)}%` }), `slot efficiency ${s.slot_efficiency === null || s.slot_efficiency === undefined ? "—" : fmtNum(s.slot_efficiency * 100, 1) + "%"}`),
      figure("Batch size over time", lineChart("Mean active sequences of this batch over time", pts, (p) => p.batch_size),
        `decode padding ${pct(s.decode_padding_pct)} · prefill padding ${pct(s.prefill_padding_pct)}`),
      figure("Time to first token", histChart("TTFT distribution", tl.histograms.ttft_s), lat("ttft_s")),
      figure("Time per output token", histChart("TPOT distribution", tl.histograms.tpot_s), lat("tpot_s")),
      figure("Queue wait", histChart("Queue wait distribution", tl.histograms.queue_wait_s), lat("queue_wait_s"))));
}

function newView() {
  let file = null;
  const out = el("div", { id: "result" });
  const fileInput = el("input", { type: "file", id: "file-input", accept: ".jsonl,.json,.txt,application/jsonl", class: "sr-only", tabindex: -1, "aria-hidden": "true" });
  const fileName = el("span", { id: "file-name", class: "muted" }, "No file chosen.");
  const endpoint = el("select", { id: "endpoint", name: "endpoint" },
    el("option", { value: "/v1/chat/completions" }, "/v1/chat/completions"), el("option", { value: "/v1/completions" }, "/v1/completions"));
  const windowIn = el("input", { id: "window", name: "completion_window", value: "24h", required: true, pattern: "\\s*\\d+\\s*h\\s*", size: 8 });
  const metaRows = el("div", { id: "meta-rows" });
  const addMeta = () => {
    const n = metaRows.children.length + 1;
    metaRows.append(el("div", { class: "meta-row" },
      el("input", { "aria-label": `Metadata key ${n}`, placeholder: "key", class: "meta-key", maxlength: 64 }),
      el("input", { "aria-label": `Metadata value ${n}`, placeholder: "value", class: "meta-value", maxlength: 512 })));
  };
  addMeta();
  const choose = async (f) => {
    file = f;
    fileName.textContent = f ? `${f.name} (${fmtNum(f.size, 0)} bytes)` : "No file chosen.";
    if (!f) return;
    const first = (await f.slice(0, 65536).text()).split("\n")[0];  // preselect the endpoint of line 1
    try { const url = JSON.parse(first).url; if ([...endpoint.options].some((o) => o.value === url)) endpoint.value = url; } catch (e) { /* shown on submit */ }
  };
  fileInput.addEventListener("change", () => choose(fileInput.files[0] || null));
  const drop = el("div", { class: "drop", id: "drop" }, el("p", {}, "Drop a JSONL file here, or"),
    el("label", { for: "file-input", class: "button", tabindex: 0, role: "button",
      onkeydown: (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); fileInput.click(); } } }, "Choose a file"),
    fileInput, el("p", {}, fileName));
  drop.addEventListener("dragover", (ev) => { ev.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (ev) => { ev.preventDefault(); drop.classList.remove("over"); choose(ev.dataTransfer.files[0] || null); });
  const submit = el("button", { type: "submit", class: "primary", id: "submit" }, "Create batch");
  const form = el("form", { id: "new-batch", novalidate: true, onsubmit: async (ev) => {
    ev.preventDefault();
    if (!file) { out.replaceChildren(errorBox("Choose a JSONL file first.")); return; }
    const metadata = {};
    for (const row of metaRows.children) {
      const k = row.querySelector(".meta-key").value.trim(), v = row.querySelector(".meta-value").value;
      if (k) metadata[k] = v;
    }
    submit.disabled = true;
    try { await createBatch(file, endpoint.value, windowIn.value.trim(), metadata, out); } finally { submit.disabled = false; }
  } },
  drop,
  el("div", { class: "field" }, el("label", { for: "endpoint" }, "Endpoint"), endpoint),
  el("div", { class: "field" }, el("label", { for: "window" }, "Completion window"), windowIn,
    el("span", { class: "muted" }, "Whole hours, such as 24h.")),
  el("fieldset", { class: "field", style: "border:none;padding:0" }, el("legend", {}, el("b", {}, "Metadata (optional)")), metaRows,
    el("div", {}, el("button", { type: "button", onclick: addMeta }, "Add metadata"))),
  el("div", { class: "row" }, submit));
  main().replaceChildren(el("h1", {}, "New batch"), el("div", { class: "card" }, form), out);
}

async function createBatch(file, endpoint, window, metadata, out) {
  const token = viewToken;
  const say = (text) => { out.replaceChildren(el("p", { class: "notice", role: "status" }, text)); announce(text); };
  try {
    say(`Uploading ${file.name}…`);
    const form = new FormData();
    form.append("purpose", "batch");
    form.append("file", file, file.name);
    const f = await api("/v1/files", { method: "POST", body: form });
    say("Creating the batch…");
    let b = await api("/v1/batches", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ input_file_id: f.id, endpoint, completion_window: window,
        metadata: Object.keys(metadata).length ? metadata : null }) });
    while (b.status === "validating") {           // validation may run in the background
      say("Validating the file…");
      await new Promise((r) => setTimeout(r, 500));
      b = await api(`/v1/batches/${b.id}`);
    }
    if (token !== viewToken) return;
    if (b.status === "failed") {
      const n = ((b.errors || {}).data || []).length;
      out.replaceChildren(el("div", { class: "error-box", role: "alert", id: "validation-errors" },
        el("p", {}, el("b", {}, `The file failed validation (${n} error${n === 1 ? "" : "s"}). `),
          "Batch ", el("a", { href: `#/batch/${b.id}`, class: "mono" }, b.id), " was not run."),
        errorsTable(b.errors)));
      announce(`The file failed validation with ${n} errors`);
      return;
    }
    location.hash = `#/batch/${b.id}`;
  } catch (e) {
    out.replaceChildren(errorBox(e.message));
    announce(e.message);
  }
}

async function workersView() {
  const token = viewToken;
  const body = el("div", {}, el("p", { class: "muted" }, "Loading…"));
  main().replaceChildren(el("h1", {}, "Workers"), body);
  async function load() {
    const res = await api("/v1/dashboard/workers");
    if (token !== viewToken) return;
    body.replaceChildren(res.data.length ? el("div", { class: "table-wrap" }, el("table", { id: "workers" },
      el("thead", {}, el("tr", {}, ["Worker", "Device", "Model", "Busy (last 30 s)", "Serving"].map((h) => el("th", { scope: "col" }, h)))),
      el("tbody", {}, res.data.map((w) => el("tr", { "data-id": w.id },
        el("td", { class: "mono" }, w.id),
        el("td", {}, w.tensor_parallel > 1 ? `${w.device} × ${w.tensor_parallel} ranks` : w.device),
        el("td", {}, w.model || "none loaded"),
        el("td", {}, el("div", { class: "progress", role: "meter", "aria-valuemin": 0, "aria-valuemax": 100,
          "aria-valuenow": Math.round(w.busy_share * 100), "aria-label": `busy ${Math.round(w.busy_share * 100)}%` },
        el("div", { class: "done", style: `width:${w.busy_share * 100}%` })),
        el("div", { class: "progress-text" }, `${Math.round(w.busy_share * 100)}% busy`)),
        el("td", {}, w.batches.map((b) => el("div", {},
          el("a", { href: `#/batch/${b.id}`, class: "mono" }, b.id), ` (${b.requests_in_flight} requests in flight)`)),
        w.other_batches ? el("div", { class: "muted" }, `${w.other_batches} batch${w.other_batches === 1 ? "" : "es"} of other tenants`) : null,
        !w.batches.length && !w.other_batches ? "idle" : null))))))
      : el("p", { class: "muted" }, "No workers."));
    refresh(() => load().catch(showError), 2000);
  }
  await load();
}

// ---- routing --------------------------------------------------------------------------------------------
function showError(e) {
  main().append(errorBox(e.message || String(e)));
}

async function route() {
  clearTimeout(timer);
  viewToken++;
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, query] = hash.split("?");
  const params = new URLSearchParams(query || "");
  let nav = "batches";
  try {
    if (path.startsWith("/batch/")) await batchView(decodeURIComponent(path.slice(7)));
    else if (path === "/new") { nav = "new"; newView(); }
    else if (path === "/workers") { nav = "workers"; await workersView(); }
    else await batchesView(params);
  } catch (e) { showError(e); }
  for (const a of document.querySelectorAll("[data-nav]")) {
    if (a.dataset.nav === nav && !path.startsWith("/batch/")) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
}

window.addEventListener("hashchange", () => { route(); main().focus({ preventScroll: true }); });
document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("forget-key").addEventListener("click", () => { sessionStorage.removeItem(KEY_NAME); showForget(); route(); });
  showForget();
  route();
});
