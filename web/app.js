// CPN portal: a hash-routed single page over the REST API. No framework, no build step.
// Every API string reaches the page through textContent or setAttribute; nothing is ever parsed as HTML.

const TOKEN_KEY = "cpn.token";
const POLL_MS = 2000;
const LIST_POLL_MS = 5000;
const TERMINAL = new Set(["Succeeded", "Failed", "Cancelled"]);
const STRATEGIES = ["auto", "ddp", "hierarchical", "local_sgd", "diloco", "gossip", "ssp", "async_ps"];
const MODELS = ["tiny", "small", "medium", "base", "large", "gpt2-xl", "llama-7b", "llama-13b", "llama-70b"];
const SVG_NS = "http://www.w3.org/2000/svg";

const session = { me: null, timer: null, route: 0, stale: false };

// ---------------------------------------------------------------- DOM helpers

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function setAttrs(node, attrs) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
}

function append(node, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

function table(headers, rows, empty) {
  if (!rows.length) return el("p", { class: "muted" }, empty);
  return el("div", { class: "scroll" }, el("table", {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows.map((cells) => el("tr", {}, cells.map((c) => el("td", {}, c)))))));
}

function badge(text) {
  const tone = {
    Succeeded: "ok", Running: "run", Ready: "ok", True: "ok", Launching: "run", Reserved: "info",
    Accepted: "info", Quoted: "info", Pending: "muted", Failed: "bad", Cancelled: "muted", False: "bad",
    Warning: "warn", Normal: "muted",
  }[text] || "muted";
  return el("span", { class: `badge ${tone}` }, text ?? "-");
}

function bar(percent, label) {
  const pct = Math.max(0, Math.min(100, Number(percent) || 0));
  return el("div", { class: "bar", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100,
                     "aria-valuenow": pct.toFixed(0), "aria-label": label },
    el("div", { class: "fill", style: `width:${pct}%` }));
}

function section(title, ...children) {
  return el("section", { class: "card" }, el("h2", {}, title), ...children);
}

// ---------------------------------------------------------------- formatting

const fmt = {
  num: (v, digits = 0) => (v === null || v === undefined || Number.isNaN(Number(v)) ? "-"
    : Number(v).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits })),
  loss: (v) => (v === null || v === undefined ? "-" : Number(v).toFixed(3)),
  money: (m) => (m && m.total !== undefined ? `${Number(m.total).toFixed(2)} ${m.currency || ""}`.trim() : "-"),
  duration(seconds) {
    if (seconds === null || seconds === undefined) return "-";
    const s = Math.max(0, Math.round(Number(seconds)));
    if (s >= 3600) return `${Math.floor(s / 3600)}h ${Math.round((s % 3600) / 60)}m`;
    if (s >= 60) return `${Math.floor(s / 60)}m ${s % 60}s`;
    return `${s}s`;
  },
  time: (iso) => (iso ? el("time", { datetime: iso },
    new Date(iso).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false })) : "-"),
  bytes: (n) => (n >= 1e9 ? `${(n / 1e9).toFixed(2)} GB` : n >= 1e6 ? `${(n / 1e6).toFixed(1)} MB` : `${(n / 1e3).toFixed(0)} kB`),
  si(v) {
    const n = Number(v);
    if (!Number.isFinite(n)) return "-";
    const a = Math.abs(n);
    if (a >= 1e9) return `${+(n / 1e9).toFixed(1)}G`;
    if (a >= 1e6) return `${+(n / 1e6).toFixed(1)}M`;
    if (a >= 1e3) return `${+(n / 1e3).toFixed(1)}k`;
    return `${+n.toFixed(2)}`;
  },
  placement: (items) => (items || []).map((p) => `${p.gpus}× ${p.gpuModel} @ ${p.site}`).join(", ") || "-",
};

// ---------------------------------------------------------------- API

class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code || "http_error";
    this.field = err.field || null;
    this.details = err.details || {};
  }
}

function token() { return localStorage.getItem(TOKEN_KEY); }

async function api(path, { method = "GET", body } = {}) {
  const headers = { Accept: "application/json" };
  if (token()) headers.Authorization = `Bearer ${token()}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await resp.json().catch(() => null);
  if (!resp.ok) {
    if (resp.status === 401 && session.me) signOut("Your token was rejected; sign in again.");
    throw new ApiError(resp.status, data);
  }
  return data;
}

const enc = encodeURIComponent;
const API = {
  whoami: () => api("/api/v1/whoami"),
  topSites: () => api("/api/v1/top/sites"),
  clusters: () => api("/api/v1/clusters"),
  links: () => api("/api/v1/links"),
  jobs: () => api("/api/v1/jobs"),
  job: (name) => api(`/api/v1/jobs/${enc(name)}`),
  submit: (manifest) => api("/api/v1/jobs", { method: "POST", body: manifest }),
  quotes: (name) => api(`/api/v1/jobs/${enc(name)}/quotes`),
  accept: (name, quote) => api(`/api/v1/jobs/${enc(name)}/accept`, { method: "POST", body: { quote } }),
  cancel: (name) => api(`/api/v1/jobs/${enc(name)}/cancel`, { method: "POST", body: {} }),
  metrics: (name) => api(`/api/v1/jobs/${enc(name)}/metrics`),
  subtasks: (name) => api(`/api/v1/jobs/${enc(name)}/subtasks`),
  events: (name) => api(`/api/v1/events?job=${enc(name)}`),
  providerSubtasks: () => api("/api/v1/subtasks"),
  invoices: () => api("/api/v1/invoices"),
};

function errorBox(err) {
  const box = el("div", { class: "error", role: "alert" },
    el("strong", {}, err.message || String(err)));
  if (err.field) box.append(el("div", {}, "Field: ", el("code", {}, err.field)));
  for (const more of (err.details && err.details.errors) || []) {
    box.append(el("div", {}, el("code", {}, more.field || "-"), ": ", more.message));
  }
  return box;
}

function flash(message) {
  const node = document.getElementById("flash");
  node.textContent = message || "";
  node.hidden = !message;
}

// ---------------------------------------------------------------- routing

function stopPolling() {
  if (session.timer) clearTimeout(session.timer);
  session.timer = null;
}

/** Run `tick` now and every `ms` while the route that started it is still showing. */
function poll(ms, tick) {
  const route = session.route;
  const loop = async () => {
    if (route !== session.route) return;
    let again = true;
    try {
      again = (await tick()) !== false;
      if (session.stale) flash("");
      session.stale = false;
    } catch (err) {
      if (err instanceof ApiError && [401, 403, 404].includes(err.status)) {
        if (err.status !== 401) flash(err.message);
        return;
      }
      session.stale = true;
      flash(`Refresh failed (retrying): ${err.message}`);
    }
    if (again && route === session.route) session.timer = setTimeout(loop, ms);
  };
  return loop();
}

async function route() {
  stopPolling();
  session.route += 1;
  flash("");
  const main = document.getElementById("main");
  if (!token()) return renderSignIn(main);
  if (!session.me) {
    try {
      session.me = await API.whoami();
    } catch (err) {
      if (err.status === 401) localStorage.removeItem(TOKEN_KEY);
      return renderSignIn(main, err);
    }
  }
  showChrome();
  const [page, arg] = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  for (const link of document.querySelectorAll("#nav a")) {
    if (link.dataset.route === (page || "overview")) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  main.replaceChildren();
  const view = {
    jobs: () => (arg === "new" ? renderNewJob(main) : arg ? renderJob(main, arg) : renderJobs(main)),
    billing: () => renderBilling(main),
  }[page] || (() => renderOverview(main));
  await view();
  main.focus({ preventScroll: true });
}

function showChrome() {
  const me = session.me;
  document.getElementById("nav").hidden = false;
  document.getElementById("who").hidden = false;
  document.getElementById("who-name").textContent = me.name;
  document.getElementById("who-role").textContent = me.role;
  document.getElementById("nav-billing").textContent = isProvider() ? "Payouts" : "Invoices";
}

function isProvider() { return session.me && session.me.role === "provider"; }

function signOut(message) {
  localStorage.removeItem(TOKEN_KEY);
  session.me = null;
  document.getElementById("nav").hidden = true;
  document.getElementById("who").hidden = true;
  location.hash = "#/overview";
  route().then(() => flash(message || ""));
}

// ---------------------------------------------------------------- sign in

function renderSignIn(main, err) {
  document.getElementById("nav").hidden = true;
  document.getElementById("who").hidden = true;
  const input = el("input", { id: "token", name: "token", type: "password", autocomplete: "off", required: true,
                              placeholder: "cpn_…", "aria-describedby": "token-help" });
  const form = el("form", { class: "card narrow", id: "signin" },
    el("h1", {}, "Sign in to CPN"),
    el("label", { for: "token" }, "API token"), input,
    el("p", { id: "token-help", class: "muted" },
      "Paste a token from ", el("code", {}, "cpn token create NAME --role user"),
      ". It stays in this browser's local storage until you sign out."),
    err ? errorBox(err) : null,
    el("button", { type: "submit" }, "Sign in"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    localStorage.setItem(TOKEN_KEY, input.value.trim());
    session.me = null;
    route();
  });
  main.replaceChildren(form);
  input.focus();
}

// ---------------------------------------------------------------- overview

async function renderOverview(main) {
  const body = el("div", { class: "stack" });
  main.append(el("h1", {}, "Overview"), body);
  await poll(LIST_POLL_MS, async () => {
    const [top, clusters, links] = await Promise.all([API.topSites(), API.clusters(), API.links()]);
    body.replaceChildren(sitesCard(top.items), clustersCard(clusters.items), linksCard(links.items));
  });
}

function sitesCard(items) {
  const rows = items.map((s) => {
    const pct = s.capacity ? (100 * s.leased) / s.capacity : 0;
    return [el("strong", {}, s.metadata.name), s.region, s.provider, `${s.ready}/${s.clusters}`,
      el("div", { class: "util" }, bar(pct, `GPU utilisation of ${s.metadata.name}`),
        el("span", {}, `${s.leased}/${s.capacity} GPUs · ${s.utilization}`)),
      s.running];
  });
  return section("Sites", table(["Site", "Region", "Provider", "Ready clusters", "GPU utilisation", "Running"],
    rows, "No sites registered yet."));
}

function clustersCard(items) {
  const rows = items.map((c) => {
    const st = c.status || {};
    return [el("strong", {}, c.metadata.name), c.spec.site, badge(st.ready === "True" ? "Ready" : "NotReady"),
      `${(st.allocatable || {}).gpus ?? 0}/${(st.capacity || {}).gpus ?? 0}`, st.gpuModel ?? "-",
      st.price ?? "-", c.spec.driver ?? "-"];
  });
  return section("Clusters", table(["Cluster", "Site", "Status", "Free GPUs", "GPU model", "Price / GPU-h",
    "Driver"], rows, "No clusters registered yet."));
}

function linksCard(items) {
  const rows = items.map((l) => [l.metadata.name, `${l.spec.a} ↔ ${l.spec.b}`, fmt.num(l.spec.bandwidthGbps, 2),
    fmt.num(l.spec.rttMs, 1), l.spec.pricePerGB]);
  return section("WAN links", table(["Link", "Sites", "Gbps", "RTT ms", "Price / GB"], rows, "No links."));
}

// ---------------------------------------------------------------- jobs list

async function renderJobs(main) {
  if (isProvider()) return renderProviderWork(main);
  const body = el("div");
  main.append(el("div", { class: "row" }, el("h1", {}, "Jobs"),
    el("a", { class: "button", href: "#/jobs/new" }, "New job")), section("Your training jobs", body));
  await poll(LIST_POLL_MS, async () => {
    const jobs = (await API.jobs()).items;
    body.replaceChildren(table(["Job", "Phase", "Progress", "Loss", "Cost", "Strategy", "Sites"], jobs.map(jobRow),
      "No jobs yet. Start one with “New job”."));
  });
}

function jobRow(job) {
  const st = job.status || {};
  const prog = st.progress || {};
  const name = job.metadata.name;
  return [el("a", { href: `#/jobs/${enc(name)}` }, name), badge(st.phase),
    el("div", { class: "util" }, bar(percentOf(st), `progress of ${name}`), el("span", {}, `${fmt.num(percentOf(st), 1)}%`)),
    fmt.loss(prog.loss), fmt.money(st.cost), st.strategy || job.spec.strategy, st.sites || "-"];
}

async function renderProviderWork(main) {
  const body = el("div");
  main.append(el("h1", {}, "Work on your clusters"), section("Sub-tasks", body));
  await poll(LIST_POLL_MS, async () => {
    const items = (await API.providerSubtasks()).items;
    body.replaceChildren(table(["Sub-task", "Job", "Cluster", "Site", "GPUs", "Phase", "Launches", "Message"],
      items.map((t) => [t.metadata.name, t.spec.job, t.spec.cluster, t.spec.site, t.spec.gpus,
        badge(t.status.phase), t.status.launches, t.status.message || ""]),
      "No sub-tasks have run on your clusters yet."));
  });
}

// ---------------------------------------------------------------- new job + quotes

function field(label, input, hint) {
  const id = input.id;
  return el("div", { class: "field" }, el("label", { for: id }, label), input,
    hint ? el("small", { class: "muted" }, hint) : null);
}

function numberInput(id, value, min) {
  return el("input", { id, name: id, type: "number", value, min, step: 1, required: true });
}

function select(id, options, value) {
  return el("select", { id, name: id }, options.map((o) => el("option", { value: o, selected: o === value }, o)));
}

function renderNewJob(main) {
  const costWeight = el("input", { id: "objective", name: "objective", type: "range", min: 0, max: 100, value: 50 });
  const weightText = el("output", { for: "objective" }, "cost 50% · time 50%");
  costWeight.addEventListener("input", () => {
    weightText.textContent = `cost ${costWeight.value}% · time ${100 - costWeight.value}%`;
  });
  const suggested = `job-${new Date().toISOString().slice(5, 19).replace(/[-:T]/g, "")}`;
  const form = el("form", { id: "new-job", class: "card" },
    el("h2", {}, "Describe the training job"),
    el("div", { class: "grid" },
      field("Name", el("input", { id: "name", name: "name", required: true, value: suggested,
                                   pattern: "[a-z0-9]([a-z0-9.\\-]*[a-z0-9])?", maxlength: 63 }),
            "lowercase letters, digits, '-' or '.'"),
      field("Model", select("model", MODELS, "tiny")),
      field("Tokens", numberInput("tokens", 900000, 1)),
      field("Global batch (tokens)", numberInput("batch", 3072, 1)),
      field("Strategy", select("strategy", STRATEGIES, "auto"), "auto lets the planner choose"),
      field("GPUs min", numberInput("gpus-min", 1, 1)),
      field("GPUs max", numberInput("gpus-max", 3, 1)),
      field("Sites min", numberInput("sites-min", 1, 1)),
      field("Sites max", numberInput("sites-max", 3, 1)),
      el("div", { class: "field" }, el("label", { for: "objective" }, "Objective"), costWeight, weightText)),
    el("div", { class: "row end" }, el("a", { href: "#/jobs", class: "button ghost" }, "Back"),
      el("button", { type: "submit" }, "Get quotes")));
  const out = el("div", { "aria-live": "polite" });
  main.append(el("h1", {}, "New job"), form, out);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    markInvalid(form, null);
    out.replaceChildren(el("p", { class: "muted" }, "Submitting and pricing…"));
    try {
      const job = await API.submit(manifestFrom(form));
      const name = job.metadata.name;
      const quotes = (await API.quotes(name)).items;
      out.replaceChildren(quotesCard(name, quotes, job.status && job.status.message));
    } catch (err) {
      out.replaceChildren(errorBox(err));
      markInvalid(form, err.field);
    } finally {
      button.disabled = false;
    }
  });
}

const FORM_FIELDS = {
  "metadata.name": "name", "spec.model": "model", "spec.tokens": "tokens", "spec.globalBatchTokens": "batch",
  "spec.strategy": "strategy", "spec.gpus.min": "gpus-min", "spec.gpus.max": "gpus-max",
  "spec.sites.min": "sites-min", "spec.sites.max": "sites-max", "spec.objective": "objective",
};

/** Point at the input the server blamed: the error's `field` is a manifest path. */
function markInvalid(form, path) {
  for (const input of form.querySelectorAll("[aria-invalid]")) input.removeAttribute("aria-invalid");
  const key = Object.keys(FORM_FIELDS).find((f) => path === f || (path || "").startsWith(`${f}.`));
  const input = key && form.querySelector(`#${FORM_FIELDS[key]}`);
  if (!input) return;
  input.setAttribute("aria-invalid", "true");
  input.focus();
}

function manifestFrom(form) {
  const v = (id) => form.querySelector(`#${id}`).value;
  const n = (id) => Number(v(id));
  const cost = n("objective") / 100;
  return {
    apiVersion: "cpn/v1", kind: "TrainingJob", metadata: { name: v("name").trim() },
    spec: { model: v("model"), tokens: n("tokens"), globalBatchTokens: n("batch"), strategy: v("strategy"),
      gpus: { min: n("gpus-min"), max: n("gpus-max") }, sites: { min: n("sites-min"), max: n("sites-max") },
      objective: { cost, time: +(1 - cost).toFixed(2) } },
  };
}

function quotesCard(name, quotes, note) {
  const status = el("div", { "aria-live": "polite" });
  const grid = el("div", { class: "quotes" });
  const show = (items) => grid.replaceChildren(...items.map((q) => quoteCard(name, q, status, show)));
  show(quotes);
  return section(`Quotes for ${name}`, note ? el("p", { class: "muted" }, note) : null,
    quotes.length ? grid : el("p", { class: "muted" }, "No placement fits this job right now."), status);
}

function quoteCard(name, q, status, show) {
  const accept = el("button", { type: "button", "aria-label": `Accept the ${q.label} quote` }, `Accept ${q.label}`);
  accept.addEventListener("click", async () => {
    accept.disabled = true;
    status.replaceChildren(el("p", { class: "muted" }, `Accepting ${q.label}…`));
    try {
      await API.accept(name, q.id);
      location.hash = `#/jobs/${enc(name)}`;
    } catch (err) {
      const fresh = err.details && err.details.freshQuotes;
      status.replaceChildren(errorBox(err));
      if (err.status === 409 && fresh && fresh.length) {
        status.append(el("p", {}, "Prices changed; here are fresh quotes."));
        show(fresh);
      } else {
        accept.disabled = false;
      }
    }
  });
  const lines = (q.price && q.price.lines) || [];
  return el("article", { class: `quote${q.chosen ? " chosen" : ""}`, "data-label": q.label },
    el("h3", {}, q.label),
    el("p", { class: "price" }, fmt.money(q.price)),
    el("dl", {},
      el("dt", {}, "Predicted time"), el("dd", {}, fmt.duration(q.predictedSeconds)),
      el("dt", {}, "Strategy"), el("dd", {}, q.strategy),
      el("dt", {}, "Placement"), el("dd", {}, fmt.placement(q.placement)),
      el("dt", {}, "WAN traffic"), el("dd", {}, `${fmt.num(q.wanGB, 3)} GB`),
      el("dt", {}, "Expires"), el("dd", {}, fmt.time(q.expiresAt))),
    el("details", {}, el("summary", {}, `${lines.length} price line${lines.length === 1 ? "" : "s"}`),
      table(["Provider", "Cluster", "Item", "Qty", "Amount"],
        lines.map((l) => [l.provider, l.cluster, l.item, l.quantity, l.amount]), "No lines.")),
    accept);
}

// ---------------------------------------------------------------- job detail

async function renderJob(main, name) {
  const phase = el("span", { id: "phase", "aria-live": "polite" });
  const cancel = el("button", { type: "button", class: "danger", hidden: true }, "Cancel job");
  const parts = {
    summary: el("div", { class: "stats" }), progress: el("div"), quotes: el("div"),
    chart: el("div", { class: "chart" }), speed: el("div", { class: "chart" }),
    subtasks: el("div"), events: el("div"),
  };
  main.append(
    el("div", { class: "row" }, el("h1", {}, `Job ${name} `, phase), cancel),
    parts.summary, parts.quotes,
    section("Progress", parts.progress),
    el("div", { class: "two" }, section("Loss vs tokens", parts.chart), section("Throughput (tokens/s)", parts.speed)),
    section("Sub-tasks per site", parts.subtasks), section("Events", parts.events));
  cancel.addEventListener("click", async () => {
    if (!confirm(`Cancel job ${name}?`)) return;
    cancel.disabled = true;
    try {
      await API.cancel(name);
    } catch (err) {
      flash(err.message);
    }
  });
  let quotesShown = false;
  await poll(POLL_MS, async () => {
    const [job, metrics, subtasks, events] = await Promise.all([
      API.job(name), API.metrics(name), API.subtasks(name), API.events(name)]);
    const st = job.status || {};
    if (phase.textContent !== st.phase) phase.replaceChildren(badge(st.phase));
    cancel.hidden = TERMINAL.has(st.phase);
    parts.summary.replaceChildren(...summaryStats(job));
    parts.progress.replaceChildren(progressView(st));
    if (st.phase === "Quoted" && !quotesShown) {
      quotesShown = true;
      parts.quotes.replaceChildren(quotesCard(name, (await API.quotes(name)).items, st.message));
    } else if (st.phase !== "Quoted") {
      parts.quotes.replaceChildren();
    }
    const series = lossSeries(metrics.items);
    parts.chart.replaceChildren(lossChart(series));
    parts.speed.replaceChildren(sparkline(series.speed), runFacts(metrics.items));
    parts.subtasks.replaceChildren(subtaskTable(subtasks.items, st.placement));
    parts.events.replaceChildren(eventTable(events.items));
    return !TERMINAL.has(st.phase);
  });
}

function stat(label, value, extra = "") {
  return el("div", { class: `stat ${extra}`.trim() }, el("span", { class: "label" }, label), el("span", { class: "value" }, value));
}

function summaryStats(job) {
  const st = job.status || {};
  const prog = st.progress || {};
  return [stat("Strategy", st.strategy || job.spec.strategy), stat("Sites running", st.sites || "-"),
    stat("Placement", fmt.placement(st.placement), "wide"), stat(TERMINAL.has(st.phase) ? "Cost" : "Cost so far", fmt.money(st.cost)),
    stat("Quoted price", fmt.money(st.price)), stat("Val loss", fmt.loss(prog.valLoss))];
}

/** A job that succeeded has trained its whole budget, whatever the last worker report said. */
function percentOf(st) {
  return st.phase === "Succeeded" ? 100 : Number((st.progress || {}).percent) || 0;
}

function progressView(st) {
  const prog = st.progress || {};
  const pct = percentOf(st);
  const eta = TERMINAL.has(st.phase) ? st.phase.toLowerCase() : `ETA ${fmt.duration(prog.etaSeconds)}`;
  return el("div", {},
    bar(pct, "job progress"),
    el("p", { class: "progress-text" },
      `${fmt.num(pct, 1)}% · ${fmt.si(prog.tokens || 0)} tokens · ${fmt.si(prog.tokensPerSecond || 0)} tokens/s · ${eta}`),
    st.message ? el("p", { class: "muted" }, st.message) : null);
}

/** Reports come per rank and not all at once; fold them per (attempt, step) into the mean train
 * loss and the job's throughput (mean tokens/s per rank × ranks of that attempt). */
function lossSeries(items) {
  const steps = new Map();
  const ranks = new Map();
  const val = [];
  for (const m of items) {
    if (!ranks.has(m.attempt)) ranks.set(m.attempt, new Set());
    ranks.get(m.attempt).add(m.rank);
    if (m.valLoss !== null && m.valLoss !== undefined) val.push([m.tokens, m.valLoss]);
    if (m.trainLoss === null || m.trainLoss === undefined) continue;
    const key = `${m.attempt}:${m.step}`;
    const s = steps.get(key) || { attempt: m.attempt, tokens: 0, loss: 0, n: 0, speed: 0 };
    s.tokens = Math.max(s.tokens, m.tokens);
    s.loss += m.trainLoss;
    s.n += 1;
    s.speed += m.tokensPerSecond || 0;
    steps.set(key, s);
  }
  const rows = [...steps.values()].sort((a, b) => a.tokens - b.tokens);
  return {
    train: rows.map((s) => [s.tokens, s.loss / s.n]),
    val: val.sort((a, b) => a[0] - b[0]),
    speed: rows.map((s) => [s.tokens, (s.speed / s.n) * ranks.get(s.attempt).size]),
  };
}

function ticks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((f) => f * mag).find((s) => raw <= s);
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
  return out;
}

function lossChart(series) {
  const W = 640, H = 300, L = 52, R = 16, T = 16, B = 40;
  const all = [...series.train, ...series.val];
  const xMax = Math.max(...all.map((p) => p[0]), 1);
  let yMin = all.length ? Math.min(...all.map((p) => p[1])) : 0;
  let yMax = all.length ? Math.max(...all.map((p) => p[1])) : 1;
  const pad = Math.max((yMax - yMin) * 0.05, 0.05);
  yMin -= pad;
  yMax += pad;
  const x = (v) => L + ((W - L - R) * v) / xMax;
  const y = (v) => T + ((H - T - B) * (yMax - v)) / (yMax - yMin);
  const points = (pts) => pts.map(([a, b]) => `${x(a).toFixed(1)},${y(b).toFixed(1)}`).join(" ");
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "loss-chart", role: "img", id: "loss-chart",
    "aria-label": `Loss curve: ${series.train.length} train points, ${series.val.length} validation points` });
  const axes = svg("g", { class: "axes" });
  for (const t of ticks(0, xMax, 6)) {
    axes.append(svg("line", { x1: x(t), x2: x(t), y1: T, y2: H - B, class: "grid" }),
      svg("text", { x: x(t), y: H - B + 16, "text-anchor": "middle" }, fmt.si(t)));
  }
  for (const t of ticks(yMin, yMax, 5)) {
    axes.append(svg("line", { x1: L, x2: W - R, y1: y(t), y2: y(t), class: "grid" }),
      svg("text", { x: L - 6, y: y(t) + 4, "text-anchor": "end" }, t.toFixed(2)));
  }
  axes.append(svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }),
    svg("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }),
    svg("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "title" }, "tokens"),
    svg("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", class: "title",
                  transform: `rotate(-90 12 ${(T + H - B) / 2})` }, "loss"));
  root.append(axes,
    svg("polyline", { points: points(series.train), class: "line train" }),
    svg("polyline", { points: points(series.val), class: "line val" }),
    ...series.val.map(([a, b]) => svg("circle", { cx: x(a), cy: y(b), r: 2.5, class: "dot val" })));
  if (!all.length) {
    root.append(svg("text", { x: (L + W - R) / 2, y: (T + H - B) / 2, "text-anchor": "middle", class: "title" },
      "waiting for the workers' first metrics…"));
  }
  const legend = el("div", { class: "legend" },
    el("span", { class: "key train" }, `train loss ${fmt.loss(series.train.at(-1)?.[1])}`),
    el("span", { class: "key val" }, `val loss ${fmt.loss(series.val.at(-1)?.[1])}`));
  return el("figure", {}, root, legend);
}

function sparkline(points) {
  if (!points.length) return el("p", { class: "muted" }, "No throughput yet.");
  const W = 320, H = 80, P = 4;
  const xMax = Math.max(...points.map((p) => p[0]), 1);
  const yMax = Math.max(...points.map((p) => p[1]), 1);
  const coords = points.map(([a, b]) => `${(P + ((W - 2 * P) * a) / xMax).toFixed(1)},${(H - P - ((H - 2 * P) * b) / yMax).toFixed(1)}`);
  const last = points.at(-1)[1];
  return el("figure", {},
    svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "sparkline", role: "img", id: "speed-chart",
                 "aria-label": `Throughput, latest ${fmt.si(last)} tokens per second, peak ${fmt.si(yMax)}` },
      svg("polyline", { points: `${P},${H - P} ${coords.join(" ")} ${coords.at(-1).split(",")[0]},${H - P}`, class: "area" }),
      svg("polyline", { points: coords.join(" "), class: "line speed" })),
    el("figcaption", {}, `latest ${fmt.si(last)} tokens/s · peak ${fmt.si(yMax)}`));
}

/** Wall time and WAN bytes are cumulative per rank within an attempt; report the latest attempt. */
function runFacts(items) {
  const attempt = Math.max(0, ...items.map((m) => m.attempt));
  const latest = items.filter((m) => m.attempt === attempt);
  const wan = new Map();
  for (const m of latest) wan.set(m.rank, Math.max(wan.get(m.rank) || 0, m.wanBytes || 0));
  const wall = Math.max(0, ...latest.map((m) => m.wallSeconds || 0));
  const total = [...wan.values()].reduce((a, b) => a + b, 0);
  return el("dl", { class: "facts" },
    el("dt", {}, "Workers reporting"), el("dd", {}, String(wan.size)),
    el("dt", {}, "Attempt"), el("dd", {}, attempt ? String(attempt) : "-"),
    el("dt", {}, "Training time"), el("dd", {}, fmt.duration(wall)),
    el("dt", {}, "WAN traffic"), el("dd", {}, fmt.bytes(total)));
}

function subtaskTable(items, placement) {
  const gpuModel = new Map((placement || []).map((p) => [p.cluster, p.gpuModel]));
  return table(["Site", "Cluster", "GPUs", "Attempt", "Phase", "Launches", "Message"],
    items.map((t) => [el("strong", {}, t.site), t.cluster, `${t.gpus}× ${gpuModel.get(t.cluster) || ""}`.trim(),
      t.attempt, badge(t.phase), t.launches, t.message || ""]),
    "No sub-tasks yet: they start once a quote is accepted.");
}

function eventTable(items) {
  const recent = items.slice(-50).reverse();
  return table(["Time", "Type", "Reason", "Message"],
    recent.map((e) => [fmt.time(e.at), badge(e.type), e.reason, e.message]), "No events.");
}

// ---------------------------------------------------------------- invoices / payouts

async function renderBilling(main) {
  const provider = isProvider();
  const body = el("div", { class: "stack" });
  main.append(el("h1", {}, provider ? "Payouts" : "Invoices"), body);
  await poll(LIST_POLL_MS, async () => {
    const items = (await API.invoices()).items;
    if (!items.length) {
      body.replaceChildren(el("p", { class: "muted" }, provider ? "No payouts yet." : "No invoices yet."));
      return;
    }
    const grand = items.reduce((sum, inv) => sum + Number(inv.status.total || 0), 0);
    body.replaceChildren(
      el("p", { class: "total" }, `${provider ? "Earned" : "Billed"} in total: ${grand.toFixed(2)} ${items[0].spec.currency || ""}`),
      ...items.map((inv) => section(`${inv.spec.job} — ${Number(inv.status.total).toFixed(2)} ${inv.spec.currency || ""}`,
        el("p", { class: "muted" }, provider ? null : el("a", { href: `#/jobs/${enc(inv.spec.job)}` }, "Open job"),
          ` contract ${inv.spec.contract || "-"}`),
        table(["Provider", "Cluster", "Item", "Quantity", "Unit price", "Amount"],
          inv.status.lines.map((l) => [l.provider, l.cluster, l.item, l.quantity, l.unitPrice, l.amount]),
          "No lines."))));
  });
}

// ---------------------------------------------------------------- boot

window.addEventListener("hashchange", route);
document.getElementById("signout").addEventListener("click", () => signOut("Signed out."));
route();
