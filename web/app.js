// CPN portal: a hash-routed single page over the REST API. No framework, no build step.
// Every API string reaches the page through textContent or setAttribute; nothing is ever parsed as HTML.

const TOKEN_KEY = "cpn.token";
const POLL_MS = 2000;
const LIST_POLL_MS = 5000;
const TERMINAL = new Set(["Succeeded", "Failed", "Cancelled"]);
const ACTIVE = new Set(["Accepted", "Reserved", "Launching", "Running"]);
const STRATEGIES = ["auto", "ddp", "hierarchical", "local_sgd", "diloco", "gossip", "ssp", "async_ps", "ps_sync", "ps_backup"];
const MODELS = ["tiny", "small", "medium", "base", "large", "gpt2-xl", "llama-7b", "llama-13b", "llama-70b"];
const SVG_NS = "http://www.w3.org/2000/svg";
const WORLD_URL = "/ui/static/world.json";

const session = { me: null, timer: null, route: 0, stale: false, rejected: "", world: null, focus: null };

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

/** A table that stays inside the page: a focusable, named scroll region on wide screens, and one
 * card per row on narrow ones (each cell carries its column name for the CSS to show). */
function table(headers, rows, empty, label = "table") {
  if (!rows.length) return el("p", { class: "muted" }, empty);
  return el("div", { class: "scroll", tabindex: 0, role: "region", "aria-label": label },
    el("table", {},
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", { scope: "col" }, h)))),
      el("tbody", {}, rows.map((cells) => el("tr", {},
        cells.map((c, i) => el("td", { "data-label": headers[i] }, c)))))));
}

function badge(text) {
  const tone = {
    Succeeded: "ok", Running: "run", Ready: "ok", True: "ok", Launching: "run", Reserved: "info",
    Accepted: "info", Quoted: "info", Profiling: "run", Pending: "muted", Failed: "bad", Cancelled: "muted", False: "bad",
    Warning: "warn", Normal: "muted", Recommended: "ok", Expired: "bad",
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

const UNITS = { "gpu-hours": "GPU-h", egress: "GB", "data-transfer": "GB" };

const fmt = {
  num: (v, digits = 0) => (v === null || v === undefined || Number.isNaN(Number(v)) ? "-"
    : Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits })),
  loss: (v) => (v === null || v === undefined ? "-" : Number(v).toFixed(3)),
  money: (m) => (m && m.total !== undefined && m.total !== null
    ? `${Number(m.total).toFixed(2)} ${m.currency || ""}`.trim() : "-"),
  duration(seconds) {
    if (seconds === null || seconds === undefined) return "-";
    const s = Math.max(0, Math.round(Number(seconds)));
    if (s >= 3600) return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
    if (s >= 60) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${s} s`;
  },
  time: (iso) => (iso ? el("time", { datetime: iso },
    new Date(iso).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false })) : "-"),
  when(iso) {
    if (!iso) return "-";
    const d = new Date(iso);
    const today = d.toDateString() === new Date().toDateString();
    const text = today ? d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", hour12: false })
      : d.toLocaleString([], { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", hour12: false });
    return el("time", { datetime: iso, title: d.toLocaleString() }, text);
  },
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
  /** A price line in words: "0.0083 GPU-h × 0.90 USD/GPU-h = 0.01 USD". */
  line(l, currency) {
    const unit = UNITS[l.item] || l.item;
    const qty = Number(l.quantity);
    const each = l.unitPrice !== undefined ? ` × ${l.unitPrice} ${currency}/${unit}` : "";
    return `${qty < 0.01 ? qty.toPrecision(2) : fmt.num(qty, 4)} ${unit}${each} = ${l.amount} ${currency}`;
  },
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
/** A job as its owner calls it: references read "owner/name". */
const jobName = (ref) => String(ref || "").split("/").pop();
const API = {
  whoami: () => api("/api/v1/whoami"),
  topSites: () => api("/api/v1/top/sites"),
  topLinks: () => api("/api/v1/top/links"),
  sites: () => api("/api/v1/sites"),
  clusters: () => api("/api/v1/clusters"),
  links: () => api("/api/v1/links"),
  jobs: () => api("/api/v1/jobs"),
  job: (name) => api(`/api/v1/jobs/${enc(name)}`),
  preview: (manifest) => api("/api/v1/jobs?dryRun=true", { method: "POST", body: manifest }),
  submit: (manifest) => api("/api/v1/jobs", { method: "POST", body: manifest }),
  replace: (name, manifest) => api(`/api/v1/jobs/${enc(name)}`, { method: "PUT", body: manifest }),
  quotes: (name) => api(`/api/v1/jobs/${enc(name)}/quotes`),
  accept: (name, quote) => api(`/api/v1/jobs/${enc(name)}/accept`, { method: "POST", body: { quote } }),
  cancel: (name) => api(`/api/v1/jobs/${enc(name)}/cancel`, { method: "POST", body: {} }),
  /** The run downsampled to `maxPoints` (min/mean/max per step range, the newest step exact) and its
   * totals; with a cursor (`sinceAttempt`, `sinceStep`) only the ranges from the one holding it on. */
  metrics: (name, query) => api(`/api/v1/jobs/${enc(name)}/metrics?${new URLSearchParams(query)}`),
  subtasks: (name) => api(`/api/v1/jobs/${enc(name)}/subtasks`),
  events: (name) => api(`/api/v1/events?job=${enc(name)}`),
  providerSubtasks: () => api("/api/v1/subtasks"),
  invoices: () => api("/api/v1/invoices"),
  quotas: () => api("/api/v1/quotas"),
};

/** The world outline shipped with the portal (Natural Earth 1:110m land), fetched once. */
async function world() {
  if (!session.world) {
    session.world = fetch(WORLD_URL).then((r) => (r.ok ? r.json() : { rings: [] })).catch(() => ({ rings: [] }));
  }
  return session.world;
}

/** The words a user reads for a manifest path the API blamed. */
const FIELD_WORDS = {
  "metadata.name": "Name", "spec.model": "Model", "spec.tokens": "Tokens",
  "spec.globalBatchTokens": "Global batch", "spec.strategy": "Strategy", "spec.gpus.min": "GPUs min",
  "spec.gpus.max": "GPUs max", "spec.gpus": "GPUs", "spec.sites.min": "Sites min", "spec.sites.max": "Sites max",
  "spec.sites": "Sites", "spec.objective": "Objective",
};

/** An API message without a leading "spec.x.y: " (the field is shown by name, next to its input). */
function plainMessage(err) {
  const msg = err.message || String(err);
  const cut = msg.match(/^[a-zA-Z][\w.[\]]*:\s+(.*)$/s);
  const text = cut && cut[0].split(":")[0].includes(".") ? cut[1] : msg;
  return text.charAt(0).toUpperCase() + text.slice(1);
}

function errorBox(err) {
  const words = err.field && FIELD_WORDS[err.field];
  const box = el("div", { class: "error", role: "alert" },
    el("strong", {}, words ? `${words}: ${plainMessage(err)}` : plainMessage(err)));
  if (err.field && !words) box.append(el("div", {}, "Field: ", el("code", {}, err.field)));
  for (const more of (err.details && err.details.errors) || []) {
    box.append(el("div", {}, FIELD_WORDS[more.field] || el("code", {}, more.field || "-"), ": ", more.message));
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

const RETRY_MAX_MS = 60000;

/** Run `tick` now and every `ms` while the route that started it is still showing. A refresh that
 * fails is retried after 2×, 4×, … the period (at most a minute), and the banner says when. Focus
 * stays on the element that had it: a refresh rebuilds the page, so it moves to its new twin. */
function poll(ms, tick) {
  const route = session.route;
  let failures = 0;
  const loop = async () => {
    if (route !== session.route) return;
    let again = true;
    let wait = ms;
    try {
      again = (await tick()) !== false;
      if (session.stale) flash("");
      session.stale = false;
      failures = 0;
    } catch (err) {
      if (err instanceof ApiError && [401, 403, 404].includes(err.status)) {
        if (err.status !== 401) flash(err.message);
        return;
      }
      failures += 1;
      wait = Math.min(RETRY_MAX_MS, ms * 2 ** failures);
      session.stale = true;
      flash(`Refresh failed (retrying in ${fmt.duration(wait / 1000)}): ${err.message}`);
    }
    if (route === session.route) restoreFocus();
    if (again && route === session.route) session.timer = setTimeout(loop, wait);
  };
  return loop();
}

/** Where focus is, in words that survive a re-render: its id, or its path of child positions from
 * <main>. Recorded on every focus change, so a refresh that removes the focused element can put
 * focus back on the element now at the same place. */
function focusKey(node) {
  const main = document.getElementById("main");
  if (!node || node === document.body || node === main || !main.contains(node)) return null;
  if (node.id) return { id: node.id };
  const path = [];
  for (let n = node; n !== main; n = n.parentElement) path.unshift([...n.parentElement.children].indexOf(n));
  return { path };
}

function restoreFocus() {
  const key = session.focus;
  const active = document.activeElement;
  if (!key || (active && active !== document.body && active.isConnected)) return;
  let node = key.id ? document.getElementById(key.id) : document.getElementById("main");
  for (const i of key.path || []) node = node && node.children[i];
  const usable = node && node.isConnected && !node.disabled && !node.closest("[hidden]");
  (usable ? node : document.getElementById("main")).focus({ preventScroll: true });
}

document.addEventListener("focusin", (ev) => { session.focus = focusKey(ev.target); });
document.addEventListener("focusout", (ev) => {  // the user left it for nothing (a click on the page): forget it
  if (!ev.relatedTarget) setTimeout(() => { if (ev.target.isConnected && document.activeElement === document.body) session.focus = null; });
});

async function route() {
  stopPolling();
  session.route += 1;
  session.focus = null;
  flash("");
  const main = document.getElementById("main");
  if (!token()) return renderSignIn(main);
  if (!session.me) {
    try {
      session.me = await API.whoami();
    } catch (err) {
      if (err.status === 401) {
        session.rejected = token();  // keep what was pasted in the box: a typo is fixed, not retyped
        localStorage.removeItem(TOKEN_KEY);
      }
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
  document.title = `${{ jobs: arg === "new" ? "New job" : arg ? `Job ${arg}` : "Jobs", billing: "Invoices" }[page]
    || "Overview"} · CPN portal`;
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
  session.rejected = "";
  document.getElementById("nav").hidden = true;
  document.getElementById("who").hidden = true;
  location.hash = "#/overview";
  route().then(() => flash(message || ""));
}

// ---------------------------------------------------------------- sign in

function renderSignIn(main, err) {
  document.getElementById("nav").hidden = true;
  document.getElementById("who").hidden = true;
  document.title = "Sign in · CPN portal";
  const input = el("input", { id: "token", name: "token", type: "password", autocomplete: "off", required: true,
                              placeholder: "cpn_…", "aria-describedby": err ? "token-help token-error" : "token-help",
                              "aria-invalid": err ? "true" : null });
  input.value = session.rejected || "";
  const form = el("form", { class: "card narrow", id: "signin" },
    el("h1", {}, "Sign in to CPN"),
    el("label", { for: "token" }, "API token"), input,
    err ? el("div", { id: "token-error" }, errorBox(err)) : null,
    el("p", { id: "token-help", class: "muted" },
      "Paste a token from ", el("code", {}, "cpn token create NAME --role user"),
      ". It stays in this browser's local storage until you sign out."),
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
  const outline = await world();
  await poll(LIST_POLL_MS, async () => {
    const [top, sites, clusters, links, use, jobs] = await Promise.all([API.topSites(), API.sites(), API.clusters(),
      API.links(), API.topLinks(), isProvider() ? { items: [] } : API.jobs()]);
    const running = jobs.items.filter((j) => ACTIVE.has((j.status || {}).phase) && (j.status || {}).placement);
    body.replaceChildren(networkCard(outline, sites.items, top.items, use.items, running),
      sitesCard(top.items), clustersCard(clusters.items, top.items), linksCard(links.items, use.items));
  });
}

const LINK_USE = [
  [0, "idle", "no running job spans it"], [1, "one", "1 running job"], [2, "many", "2 or more running jobs"]];

/** Sites at their latitude/longitude over the shipped land outline; links as lines whose width
 * grows with bandwidth and whose colour says how many running jobs span them; the sites of the
 * user's running jobs ringed. An equirectangular projection fitted to the sites (never tiles). */
function networkCard(outline, sites, top, use, running) {
  const placed = sites.filter((s) => s.spec && s.spec.location);
  const unplaced = sites.filter((s) => !(s.spec && s.spec.location)).map((s) => s.metadata.name);
  const byName = new Map(placed.map((s) => [s.metadata.name, s.spec.location]));
  const usage = new Map(top.map((s) => [s.metadata.name, s]));
  const mine = new Map();
  for (const job of running) {
    for (const p of job.status.placement) mine.set(p.site, [...(mine.get(p.site) || []), job.metadata.name]);
  }
  const lats = placed.map((s) => s.spec.location.lat);
  const lons = placed.map((s) => s.spec.location.lon);
  let [w, e, so, n] = placed.length ? [Math.min(...lons), Math.max(...lons), Math.min(...lats), Math.max(...lats)]
    : [-170, 190, -58, 80];
  const padLon = Math.max(12, (e - w) * 0.25);
  const padLat = Math.max(8, (n - so) * 0.25);
  [w, e, so, n] = [Math.max(-180, w - padLon), Math.min(180, e + padLon), Math.max(-80, so - padLat), Math.min(84, n + padLat)];
  const k = Math.cos(((so + n) / 2) * (Math.PI / 180));
  const W = 720;
  const H = Math.max(220, Math.min(480, Math.round((W * (n - so)) / ((e - w) * k))));
  const sx = W / ((e - w) * k);
  const sy = H / (n - so);
  const s = Math.min(sx, sy);
  const ox = (W - (e - w) * k * s) / 2;
  const oy = (H - (n - so) * s) / 2;
  const x = (lon) => ox + (lon - w) * k * s;
  const y = (lat) => oy + (n - lat) * s;
  const land = outline.rings.map((r) => {
    let d = "";
    for (let i = 0; i < r.length; i += 2) d += `${i ? "L" : "M"}${x(r[i]).toFixed(1)} ${y(r[i + 1]).toFixed(1)}`;
    return `${d}Z`;
  }).join("");
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "network-map", id: "network-map", role: "img",
    "aria-labelledby": "network-map-title" });
  const lines = svg("g", { class: "links" });
  const used = new Map(use.map((l) => [l.metadata.name, l]));
  const maxGbps = Math.max(1, ...use.map((l) => l.bandwidthGbps || 0));
  let linkCount = 0;
  for (const l of use) {
    const a = byName.get(l.a);
    const b = byName.get(l.b);
    if (!a || !b) continue;
    linkCount += 1;
    const jobs = (used.get(l.metadata.name) || {}).jobs || 0;
    const tone = LINK_USE[Math.min(2, jobs)][1];
    const width = 1.5 + 6 * Math.sqrt((l.bandwidthGbps || 0) / maxGbps);
    lines.append(svg("line", { x1: x(a.lon), y1: y(a.lat), x2: x(b.lon), y2: y(b.lat), class: `link ${tone}`,
      "stroke-width": width.toFixed(1), "data-link": l.metadata.name },
      svg("title", {}, `${l.metadata.name}: ${l.a} ↔ ${l.b}, ${fmt.num(l.bandwidthGbps, 1)} Gbit/s, `
        + `${fmt.num(l.rttMs, 1)} ms RTT, ${jobs} running job${jobs === 1 ? "" : "s"}`)));
  }
  const dots = svg("g", { class: "sites" });
  for (const site of placed) {
    const name = site.metadata.name;
    const { lat, lon } = site.spec.location;
    const u = usage.get(name) || { leased: 0, capacity: 0 };
    const jobsHere = mine.get(name) || [];
    const r = 5 + Math.min(9, Math.sqrt(u.capacity || 0) * 1.5);
    dots.append(svg("g", { class: `site${jobsHere.length ? " active" : ""}`, "data-site": name },
      jobsHere.length ? svg("circle", { cx: x(lon), cy: y(lat), r: r + 5, class: "halo" }) : null,
      svg("circle", { cx: x(lon), cy: y(lat), r, class: "dot" }),
      svg("text", { x: x(lon) + r + 4, y: y(lat) + 4 }, name),
      svg("title", {}, `${name}: ${u.leased}/${u.capacity} GPUs leased`
        + (jobsHere.length ? `; your running job ${jobsHere.join(", ")}` : ""))));
  }
  root.append(svg("title", { id: "network-map-title" }, mapSummary(placed, linkCount, mine)),
    svg("path", { d: land, class: "land" }), lines, dots);
  const legend = el("ul", { class: "legend map-legend" },
    ...LINK_USE.map(([, tone, text]) => el("li", { class: `key link-${tone}` }, `link: ${text}`)),
    el("li", { class: "key width" }, `line width: bandwidth (widest ${fmt.num(maxGbps, 0)} Gbit/s)`),
    el("li", { class: "key active" }, "ringed: a site of your running job"));
  return section("Network", el("figure", { class: "map" }, root,
    el("figcaption", {}, mapSummary(placed, linkCount, mine),
      unplaced.length ? ` Not on the map (no location): ${unplaced.join(", ")}.` : "")), legend);
}

function mapSummary(placed, linkCount, mine) {
  const active = [...mine.keys()];
  return `${placed.length} site${placed.length === 1 ? "" : "s"} and ${linkCount} link${linkCount === 1 ? "" : "s"}`
    + ` on a map of land outlines.${active.length ? ` Sites of your running jobs: ${active.join(", ")}.` : ""}`;
}

function sitesCard(items) {
  const rows = items.map((s) => {
    const pct = s.capacity ? (100 * s.leased) / s.capacity : 0;
    return [el("strong", { class: "name" }, s.metadata.name), s.region, s.provider, `${s.ready}/${s.clusters}`,
      el("div", { class: "util" }, bar(pct, `GPU utilisation of ${s.metadata.name}`),
        el("span", {}, `${s.leased}/${s.capacity} GPUs leased · ${s.utilization}`)),
      s.running];
  });
  return section("Sites", table(["Site", "Region", "Provider", "Ready clusters", "GPU utilisation", "Running sub-tasks"],
    rows, "No sites registered yet.", "Sites"));
}

/** Free GPUs come from the same lease count as the sites' utilisation, so the two always agree. */
function clustersCard(items, top) {
  const free = new Map(top.flatMap((s) => (s.byCluster || []).map((c) => [c.name, c])));
  const rows = items.map((c) => {
    const st = c.status || {};
    const f = free.get(c.metadata.name);
    const cap = (st.capacity || {}).gpus ?? 0;
    return [el("strong", { class: "name" }, c.metadata.name), c.spec.site,
      badge(st.ready === "True" ? "Ready" : "NotReady"),
      `${f ? f.free : (st.allocatable || {}).gpus ?? 0}/${f ? f.capacity : cap}`, st.gpuModel ?? "-",
      st.price ?? "-", c.spec.driver ?? "-"];
  });
  return section("Clusters", table(["Cluster", "Site", "Status", "Free GPUs", "GPU model", "Price per GPU-h",
    "Driver"], rows, "No clusters registered yet.", "Clusters"));
}

function linksCard(items, use) {
  const jobs = new Map(use.map((l) => [l.metadata.name, l.jobs]));
  const rows = items.map((l) => [l.metadata.name, `${l.spec.a} ↔ ${l.spec.b}`,
    `${fmt.num(l.spec.bandwidthGbps, 2)} Gbit/s`, `${fmt.num(l.spec.rttMs, 1)} ms`, `${l.spec.pricePerGB} per GB`,
    String(jobs.get(l.metadata.name) ?? 0)]);
  return section("WAN links", table(["Link", "Sites", "Bandwidth", "RTT", "Price", "Running jobs"], rows, "No links.",
    "WAN links"));
}

// ---------------------------------------------------------------- jobs list

function created(job) { return Date.parse(job.metadata.creationTimestamp || "") || 0; }

async function renderJobs(main) {
  if (isProvider()) return renderProviderWork(main);
  const body = el("div");
  main.append(el("div", { class: "row" }, el("h1", {}, "Jobs"),
    el("a", { class: "button", href: "#/jobs/new" }, "New job")), section("Your training jobs", body));
  await poll(LIST_POLL_MS, async () => {
    const jobs = (await API.jobs()).items.sort((a, b) => created(b) - created(a));
    body.replaceChildren(table(["Job", "Created", "Phase", "Progress", "Loss", "Cost", "Strategy", "Sites"],
      jobs.map(jobRow), "No jobs yet. Start one with “New job”.", "Your training jobs"));
  });
}

function jobRow(job) {
  const st = job.status || {};
  const prog = st.progress || {};
  const name = job.metadata.name;
  // NAMESPACE/NAME addresses one job even where an admin sees several users' jobs of that name
  const ref = job.metadata.namespace ? `${job.metadata.namespace}/${name}` : name;
  return [el("a", { href: `#/jobs/${enc(ref)}`, class: "name" }, name), fmt.when(job.metadata.creationTimestamp),
    badge(st.phase),
    el("div", { class: "util" }, bar(percentOf(st), `progress of ${name}`), el("span", {}, `${fmt.num(percentOf(st), 1)}%`)),
    fmt.loss(prog.loss), fmt.money(st.cost), st.strategy || job.spec.strategy, st.sites || "-"];
}

async function renderProviderWork(main) {
  const body = el("div");
  main.append(el("h1", {}, "Work on your clusters"), section("Sub-tasks", body));
  await poll(LIST_POLL_MS, async () => {
    const items = (await API.providerSubtasks()).items;
    body.replaceChildren(table(["Sub-task", "Job", "Cluster", "Site", "GPUs", "Phase", "Launches", "Message"],
      items.map((t) => [el("span", { class: "name" }, t.metadata.name), t.spec.job, t.spec.cluster, t.spec.site,
        t.spec.gpus, badge(t.status.phase), t.status.launches, t.status.message || ""]),
      "No sub-tasks have run on your clusters yet.", "Sub-tasks"));
  });
}

// ---------------------------------------------------------------- new job + quotes

/** A labelled input with its hint and an error slot, both tied to it by aria-describedby. */
function field(label, input, hint) {
  const id = input.id;
  const ids = [hint ? `${id}-hint` : null, `${id}-error`].filter(Boolean).join(" ");
  input.setAttribute("aria-describedby", ids);
  return el("div", { class: "field" }, el("label", { for: id }, label), input,
    hint ? el("small", { class: "muted", id: `${id}-hint` }, hint) : null,
    el("small", { class: "field-error", id: `${id}-error` }));
}

function numberInput(id, value, min) {
  return el("input", { id, name: id, type: "number", value, min, step: 1, required: true, inputmode: "numeric" });
}

function select(id, options, value) {
  return el("select", { id, name: id }, options.map((o) => el("option", { value: o, selected: o === value }, o)));
}

function renderNewJob(main) {
  const costWeight = el("input", { id: "objective", name: "objective", type: "range", min: 0, max: 100, value: 50,
                                   "aria-valuetext": "cost 50%, time 50%" });
  const weightText = el("output", { for: "objective", id: "objective-value" }, "cost 50% · time 50%");
  costWeight.addEventListener("input", () => {
    weightText.textContent = `cost ${costWeight.value}% · time ${100 - costWeight.value}%`;
    costWeight.setAttribute("aria-valuetext", `cost ${costWeight.value}%, time ${100 - costWeight.value}%`);
  });
  const suggested = `job-${new Date().toISOString().slice(5, 19).replace(/[-:T]/g, "")}`;
  const form = el("form", { id: "new-job", class: "card", novalidate: true },
    el("h2", {}, "Describe the training job"),
    el("div", { class: "grid" },
      field("Name", el("input", { id: "name", name: "name", required: true, value: suggested, autocomplete: "off",
                                   pattern: "[a-z0-9]([a-z0-9.\\-]*[a-z0-9])?", maxlength: 63 }),
            "lowercase letters, digits, '-' or '.'"),
      field("Model", select("model", MODELS, "tiny"), "every preset trains; one no GPU holds whole is sharded over a site's GPUs"),
      field("Tokens", numberInput("tokens", 900000, 1), "training budget"),
      field("Global batch (tokens)", numberInput("batch", 3072, 1)),
      field("Strategy", select("strategy", STRATEGIES, "auto"), "auto lets the planner choose"),
      field("GPUs min", numberInput("gpus-min", 1, 1)),
      field("GPUs max", numberInput("gpus-max", 3, 1)),
      field("Sites min", numberInput("sites-min", 1, 1)),
      field("Sites max", numberInput("sites-max", 3, 1)),
      field("Objective", costWeight, "left: fastest · right: cheapest")),
    el("p", { class: "objective-text", "aria-hidden": "true" }, weightText),
    el("div", { class: "row end" }, el("a", { href: "#/jobs", class: "button ghost" }, "Back"),
      el("button", { type: "submit" }, "Get quotes")));
  const status = el("p", { class: "muted", role: "status", id: "quote-status" });
  const out = el("div", { id: "quotes-out" });
  main.append(el("h1", {}, "New job"), form, status, out);
  let shown = null;  // the manifest the quotes on screen were priced for
  form.addEventListener("input", () => {
    if (shown && JSON.stringify(manifestFrom(form)) !== JSON.stringify(shown)) {
      out.classList.add("stale");
      for (const b of out.querySelectorAll("button.accept")) b.disabled = true;
      status.textContent = "The form changed since these quotes: Get quotes again to price it.";
    }
  });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    markInvalid(form, null);
    status.textContent = "Pricing…";
    const manifest = manifestFrom(form);
    try {
      const preview = await API.preview(manifest);
      shown = manifest;
      const quotes = preview.status.quotes || [];
      out.classList.remove("stale");
      out.replaceChildren(quotesCard(manifest.metadata.name, quotes, status, {
        manifest, draft: preview.status.draft }));
      status.textContent = quoteSummary(quotes, preview.status.draft);
    } catch (err) {
      shown = null;
      out.replaceChildren(errorBox(err));
      status.textContent = "";
      markInvalid(form, err);
    } finally {
      button.disabled = false;
    }
  });
}

function quoteSummary(quotes, draft) {
  if (!quotes.length) return "No placement fits this job right now.";
  const cheapest = quotes.reduce((a, b) => (Number(a.price.total) <= Number(b.price.total) ? a : b));
  return `${quotes.length} quotes, from ${fmt.money(cheapest.price)}; nothing is created until you accept one`
    + `${draft ? " (your draft of this name gets the new spec)" : ""}.`;
}

const FORM_FIELDS = {
  "metadata.name": "name", "spec.model": "model", "spec.tokens": "tokens", "spec.globalBatchTokens": "batch",
  "spec.strategy": "strategy", "spec.gpus.min": "gpus-min", "spec.gpus.max": "gpus-max", "spec.gpus": "gpus-min",
  "spec.sites.min": "sites-min", "spec.sites.max": "sites-max", "spec.sites": "sites-min",
  "spec.objective": "objective",
};

/** Put the server's complaint next to the input it is about (the error's `field` is a manifest path). */
function markInvalid(form, err) {
  for (const input of form.querySelectorAll("[aria-invalid]")) input.removeAttribute("aria-invalid");
  for (const slot of form.querySelectorAll(".field-error")) slot.textContent = "";
  const path = err && err.field;
  const key = Object.keys(FORM_FIELDS).sort((a, b) => b.length - a.length)
    .find((f) => path === f || (path || "").startsWith(`${f}.`));
  const input = key && form.querySelector(`#${FORM_FIELDS[key]}`);
  if (!input) return;
  input.setAttribute("aria-invalid", "true");
  form.querySelector(`#${input.id}-error`).textContent = plainMessage(err);
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

/** The three quotes side by side. `pending` (a dry run's quotes) holds the manifest: accepting one
 * creates the job (or gives the user's draft of that name the new spec) and then accepts the same
 * offer; without it the quotes are a stored job's and are accepted directly. */
function quotesCard(name, quotes, status, pending = null) {
  const grid = el("div", { class: "quotes" });
  const note = el("p", { class: "muted" });
  const show = (items, stored) => {
    grid.replaceChildren(...items.map((q) => quoteCard(name, q, status, stored ? null : pending, show)));
    note.textContent = stored ? "Saved as a draft; accept one of its quotes below." : "";
  };
  show(quotes, !pending);
  const card = section(`Quotes for ${name}`, note,
    quotes.length ? grid : el("p", { class: "muted" }, "No placement fits this job right now."));
  card.classList.add("quotes-card");
  const route = session.route;
  const tick = () => {  // a quote that expires while it is on screen says so before it is clicked
    if (route !== session.route || !card.isConnected) return;
    for (const art of grid.querySelectorAll("article.quote[data-expires]")) {
      if (Date.parse(art.dataset.expires) <= Date.now() && !art.classList.contains("expired")) markExpired(art);
    }
    setTimeout(tick, 1000);
  };
  setTimeout(tick, 1000);
  return card;
}

function markExpired(art) {
  art.classList.add("expired");
  const button = art.querySelector("button.accept");
  if (button) button.disabled = true;
  art.querySelector("h3").append(" ", badge("Expired"));
  art.append(el("p", { class: "muted" }, "This quote has expired: get quotes again."));
}

async function acceptQuote(name, q, status, pending, show) {
  if (q.confirm && !confirm(`The ${q.label} quote costs ${fmt.money(q.price)}, `
      + `${fmt.num(q.timesCheapest, 1)}× the cheapest quote. Accept it?`)) {
    status.textContent = `Not accepted: ${q.label} stays on offer.`;
    return;
  }
  status.textContent = `Accepting ${q.label}…`;
  let id = q.id;
  if (pending) {
    if (pending.draft) await API.replace(name, pending.manifest);
    else await API.submit(pending.manifest);
    const stored = (await API.quotes(name)).items;
    const same = stored.find((s) => s.label === q.label);
    if (!same || same.price.total !== q.price.total || JSON.stringify(same.placement) !== JSON.stringify(q.placement)) {
      status.textContent = "Capacity changed while you decided: here are the job's own quotes.";
      show(stored, true);
      return;
    }
    id = same.id;
  }
  await API.accept(name, id);
  location.hash = `#/jobs/${enc(name)}`;
}

function quoteCard(name, q, status, pending, show) {
  const expired = q.state === "expired";
  const blocked = expired || (q.state && q.state !== "open" && !q.chosen);
  const accept = el("button", { type: "button", class: "accept", disabled: blocked ? true : null },
    `Accept ${q.label}`);
  accept.addEventListener("click", async () => {
    accept.disabled = true;
    try {
      await acceptQuote(name, q, status, pending, show);
    } catch (err) {
      const fresh = err.details && err.details.freshQuotes;
      status.textContent = plainMessage(err);
      const form = document.getElementById("new-job");
      if (form && err.field) markInvalid(form, err);
      if (err.status === 409 && fresh && fresh.length) {
        status.textContent = `${plainMessage(err)} Prices changed; here are fresh quotes.`;
        show(views(fresh), true);
      }
    } finally {
      if (accept.isConnected && !blocked) accept.disabled = false;
    }
  });
  const currency = (q.price && q.price.currency) || "";
  const lines = (q.price && q.price.lines) || [];
  const differs = q.sameAs ? `Same as ${q.sameAs}`
    : q.timesCheapest && q.timesCheapest > 1.005 ? `${fmt.num(q.timesCheapest, 1)}× the cheapest price` : "Lowest price";
  const art = el("article", { class: `quote${q.recommended ? " recommended" : ""}${expired ? " expired" : ""}`,
                              "data-label": q.label, "data-expires": q.expiresAt || null,
                              "aria-labelledby": `quote-${q.label}` },
    el("h3", { id: `quote-${q.label}` }, q.label, q.recommended ? " " : null,
      q.recommended ? badge("Recommended") : null, expired ? " " : null, expired ? badge("Expired") : null),
    el("p", { class: "price" }, fmt.money(q.price)),
    el("p", { class: "differs" }, differs),
    el("dl", {},
      el("dt", {}, "Predicted time"), el("dd", {}, q.predictedDuration || fmt.duration(q.predictedSeconds)),
      el("dt", {}, "GPUs"), el("dd", {}, String(q.gpus ?? (q.placement || []).reduce((a, p) => a + p.gpus, 0))),
      el("dt", {}, "Strategy"), el("dd", {}, q.strategy),
      el("dt", {}, "Placement"), el("dd", {}, fmt.placement(q.placement)),
      el("dt", {}, "WAN traffic"), el("dd", {}, `${fmt.num(q.wanGB, 3)} GB`),
      el("dt", {}, "Expires"), el("dd", {}, fmt.time(q.expiresAt))),
    q.trains && q.trains.note ? el("p", { class: "muted" }, q.trains.note) : null,
    q.basis === "profiled" && q.profile ? el("p", { class: "muted" },
      `Profiled: ${fmt.num(q.profile.measuredStepSeconds, 3)} s per step measured on ${q.profile.gpus}×` +
      `${q.profile.gpuModel} at ${q.profile.site}; ${fmt.num(q.profile.stepSeconds, 3)} s per step here`) : null,
    expired ? el("p", { class: "muted" }, "This quote has expired: get quotes again.") : null,
    el("details", {}, el("summary", {}, `${lines.length} price line${lines.length === 1 ? "" : "s"}`),
      el("ul", { class: "lines" }, lines.map((l) => el("li", {},
        el("span", { class: "line-what" }, `${l.item} on ${l.cluster} (${l.provider})`),
        el("span", { class: "line-sum" }, fmt.line(l, currency)))))),
    accept);
  return art;
}

/** Quotes that came back raw (a 409's fresh quotes) get the same reading aids as the API's views. */
function views(items) {
  const cheapest = Math.min(...items.map((q) => Number(q.price.total)));
  return items.map((q, i) => {
    const same = items.slice(0, i).find((o) => o.strategy === q.strategy && o.price.total === q.price.total
      && JSON.stringify(o.placement) === JSON.stringify(q.placement));
    return { ...q, sameAs: same ? same.label : null, recommended: q.label === "balanced",
      timesCheapest: cheapest > 0 ? Number(q.price.total) / cheapest : 1,
      confirm: cheapest > 0 && Number(q.price.total) / cheapest >= 10 };
  });
}

// ---------------------------------------------------------------- job detail

async function renderJob(main, name) {
  const phase = el("span", { id: "phase", "aria-live": "polite" });
  const cancel = el("button", { type: "button", class: "danger", hidden: true }, "Cancel job");
  const parts = {
    failure: el("div"), summary: el("div", { class: "stats" }), progress: el("div"), quotes: el("div"),
    chart: el("div", { class: "chart" }), speed: el("div", { class: "chart" }),
    subtasks: el("div"), events: el("div"),
  };
  main.append(
    el("div", { class: "row" }, el("h1", {}, el("span", { class: "name" }, `Job ${jobName(name)}`), " ", phase), cancel),
    parts.failure, parts.summary, parts.quotes,
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
  const run = { width: 0, points: [] };
  await poll(POLL_MS, async () => {
    const [job, metrics, subtasks, events] = await Promise.all([
      API.job(name), fetchSeries(name, run), API.subtasks(name), API.events(name)]);
    const st = job.status || {};
    if (phase.textContent !== st.phase) phase.replaceChildren(badge(st.phase));
    cancel.hidden = TERMINAL.has(st.phase);
    parts.failure.replaceChildren(st.phase === "Failed" ? failureBox(st, events.items) : "");
    parts.summary.replaceChildren(...summaryStats(job, metrics.totals));
    parts.progress.replaceChildren(progressView(st));
    if (st.phase === "Quoted" && !quotesShown) {
      quotesShown = true;
      const status = el("p", { class: "muted", role: "status" });
      parts.quotes.replaceChildren(quotesCard(name, (await API.quotes(name)).items, status), status);
    } else if (st.phase !== "Quoted") {
      parts.quotes.replaceChildren();
    }
    const series = lossSeries(run.points);
    parts.chart.replaceChildren(lossChart(series, waitingText(st)));
    parts.speed.replaceChildren(sparkline(series.speed), runFacts(metrics.totals));
    parts.subtasks.replaceChildren(subtaskTable(subtasks.items, st.placement));
    parts.events.replaceChildren(eventTable(events.items));
    return !TERMINAL.has(st.phase);
  });
}

/** Why a job failed, in one box at the top: its last condition or message, and the failing event. */
function failureBox(st, events) {
  const cond = (st.conditions || []).filter((c) => c.status === "True" || c.type === "Failed").at(-1) || {};
  const event = events.filter((e) => e.reason === "Failed" || e.type === "Warning").at(-1);
  const reason = st.message || cond.message || (event && event.message) || "no reason recorded";
  return el("div", { class: "error", role: "alert", id: "failure" },
    el("strong", {}, "This job failed"), el("div", {}, reason),
    cond.reason ? el("div", { class: "muted" }, `Reason: ${cond.reason}`) : null);
}

/** What the empty loss chart says, by phase: only a run that can report is waiting for metrics. */
function waitingText(st) {
  return {
    Profiling: "timing a few of the job's steps at one site; quotes follow (spec.profile)",
    Quoted: "no run yet: accept a quote to start it",
    Accepted: "reserved: the run starts when its sites launch it",
    Reserved: "reserved: the run starts when its sites launch it",
    Launching: "waiting for the workers' first metrics…",
    Running: "waiting for the workers' first metrics…",
    Cancelled: "cancelled before any metrics were reported",
    Failed: "failed before any metrics were reported",
    Succeeded: "no metrics were reported",
  }[st.phase] || "no metrics yet";
}

function stat(label, value, extra = "") {
  return el("div", { class: `stat ${extra}`.trim() }, el("span", { class: "label" }, label), el("span", { class: "value" }, value));
}

function summaryStats(job, totals) {
  const st = job.status || {};
  const prog = st.progress || {};
  const ended = TERMINAL.has(st.phase);
  const sites = new Set((st.placement || []).map((p) => p.site)).size;
  return [stat("Strategy", st.strategy || job.spec.strategy),
    ended ? stat("Sites used", sites ? String(sites) : "-") : stat("Sites running", st.sites || "-"),
    stat("Placement", fmt.placement(st.placement), "wide"), stat(ended ? "Cost" : "Cost so far", fmt.money(st.cost)),
    stat("Quoted price", fmt.money(st.price)), stat("Val loss", fmt.loss(prog.valLoss)),
    timeStat(st, totals)];
}

/** Run time as measured (from launch to the end; while running, the workers' training time so far)
 * beside the compute model's prediction, as `cpnctl describe` shows it. */
function timeStat(st, totals) {
  const measured = st.measured || {};
  const predicted = measured.predictedSeconds ?? st.predictedSeconds;
  const final = measured.wallSeconds !== undefined;
  const took = final ? measured.wallSeconds : totals && totals.wallSeconds ? totals.wallSeconds : null;
  const text = took === null ? "-" : `${fmt.duration(took)}${final ? "" : " so far"}`;
  const ratio = measured.ratio ? ` (${fmt.num(measured.ratio, 2)}×)` : "";
  return stat("Measured vs predicted time", el("span", { id: "run-time" },
    `${text} · predicted ${predicted ? fmt.duration(predicted) : "-"}${ratio}`), "wide");
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

const SERIES_POINTS = 400;

/** Only what is new since the last look: the server re-sends the step range holding the cursor and
 * every later one, which replace the tail of what the page has; when the ranges widened (the run
 * grew past the point budget) the whole run comes again, still at most SERIES_POINTS points. */
async function fetchSeries(name, run) {
  const last = run.points.at(-1);
  const query = { maxPoints: SERIES_POINTS, maxReports: 0 };
  let answer = await API.metrics(name, last ? { ...query, sinceAttempt: last.attempt, sinceStep: last.stepTo } : query);
  const whole = !last || answer.series.width !== run.width;
  if (last && whole) answer = await API.metrics(name, query);
  const fresh = answer.series.points;
  if (whole) {
    run.points = fresh;
  } else if (fresh.length) {
    const [a, s] = [fresh[0].attempt, fresh[0].stepFrom];
    run.points = [...run.points.filter((p) => p.attempt < a || (p.attempt === a && p.stepTo < s)), ...fresh];
  }
  run.width = answer.series.width;
  return answer;
}

/** The chart's lines from the server's ranges: each range's mean (its min and max are in the data
 * for a band), at the range's last cumulative token count; tokens/s is the job's. */
function lossSeries(points) {
  const at = (key) => points.filter((p) => p[key]).map((p) => [p.tokens, p[key].mean]).sort((a, b) => a[0] - b[0]);
  return { train: at("trainLoss"), val: at("valLoss"), speed: at("tokensPerSecond") };
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

function lossChart(series, waiting = "waiting for the workers' first metrics…") {
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
      waiting));
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

/** The run's totals as the server read them from the newest cumulative reports (never a window). */
function runFacts(totals) {
  return el("dl", { class: "facts" },
    el("dt", {}, "Workers reporting"), el("dd", { id: "fact-workers" }, String(totals.workers || 0)),
    el("dt", {}, "Attempt"), el("dd", {}, totals.attempt ? String(totals.attempt) : "-"),
    el("dt", {}, "Step"), el("dd", { id: "fact-step" }, totals.step === null ? "-" : String(totals.step)),
    el("dt", {}, "Tokens"), el("dd", { id: "fact-tokens" }, fmt.num(totals.tokens)),
    el("dt", {}, "Training time"), el("dd", {}, fmt.duration(totals.wallSeconds)),
    el("dt", {}, "WAN traffic"), el("dd", { id: "fact-wan" }, fmt.bytes(totals.wanBytes || 0)));
}

function subtaskTable(items, placement) {
  const gpuModel = new Map((placement || []).map((p) => [p.cluster, p.gpuModel]));
  return table(["Site", "Cluster", "GPUs", "Attempt", "Phase", "Launches", "Message"],
    items.map(({ spec = {}, status = {} }) => [el("strong", {}, spec.site ?? "-"), spec.cluster ?? "-",
      `${spec.gpus ?? "-"}× ${gpuModel.get(spec.cluster) || ""}`.trim(), spec.attempt ?? "-", badge(status.phase),
      status.launches ?? 0, status.message || ""]),
    "No sub-tasks yet: they start once a quote is accepted.", "Sub-tasks per site");
}

function eventTable(items) {
  const recent = items.slice(-50).reverse();
  return table(["Time", "Type", "Reason", "Message"],
    recent.map((e) => [fmt.time(e.at), badge(e.type), e.reason, e.message]), "No events.", "Events");
}

// ---------------------------------------------------------------- invoices / payouts

async function renderBilling(main) {
  const provider = isProvider();
  const body = el("div", { class: "stack" });
  main.append(el("h1", {}, provider ? "Payouts" : "Invoices"), body);
  await poll(LIST_POLL_MS, async () => {
    const items = (await API.invoices()).items;
    const quotas = provider ? [] : quotaSections((await API.quotas()).items);
    if (!items.length) {
      body.replaceChildren(...quotas, el("p", { class: "muted" }, provider ? "No payouts yet." : "No invoices yet."));
      return;
    }
    const grand = items.reduce((sum, inv) => sum + Number(inv.status.total || 0), 0);
    body.replaceChildren(...quotas,
      el("p", { class: "total" }, `${provider ? "Earned" : "Billed"} in total: ${grand.toFixed(2)} ${items[0].spec.currency || ""}`),
      ...items.map((inv) => {
        const cur = inv.spec.currency || "";
        return section(`${jobName(inv.spec.job)} — ${Number(inv.status.total).toFixed(2)} ${cur}`,
          el("p", { class: "muted" }, provider ? null : el("a", { href: `#/jobs/${enc(inv.spec.job)}` }, `Open job ${jobName(inv.spec.job)}`),
            ` contract ${inv.spec.contract || "-"}`),
          invoiceSums(inv.status, cur, provider),
          table(["Provider", "Cluster", "Item", "Quantity", "Unit price", "Amount"],
            inv.status.lines.map((l) => [l.provider, l.cluster, l.item, `${l.quantity} ${UNITS[l.item] || ""}`.trim(),
              `${l.unitPrice} ${cur}/${UNITS[l.item] || "unit"}`, el("span", { class: "amount" }, `${l.amount} ${cur}`)]),
            "No lines.", `Lines of ${jobName(inv.spec.job)}`));
      }));
  });
}

const QUOTA_LIMITS = [["maxGpus", "gpus", "GPUs held now"], ["maxJobs", "jobs", "jobs active now"],
  ["gpuHoursPerMonth", "gpuHours", "GPU-hours this month"], ["spendPerMonth", "spend", "spend this month"]];

/** The quotas binding the user (theirs and their teams'): each limit against what it counts, as
 * `cpnctl describe quota` shows them. None bind: nothing is shown. */
function quotaSections(items) {
  if (!items.length) return [];
  const rows = items.flatMap((q) => QUOTA_LIMITS.filter(([key]) => q.spec[key] !== undefined).map(([key, field, what]) => [
    q.metadata.name, q.status.boundTo, key, String(q.status.used[field]),
    key === "spendPerMonth" ? `${q.spec[key]} ${q.spec.currency || ""}` : String(q.spec[key]), what]));
  return [section("Quotas", table(["Quota", "Bound to", "Limit", "Used", "Of", "Counts"], rows, "No limits.", "Quotas"))];
}

const CONTRACT_WORDS = { active: "running: this invoice grows until the job ends", completed: "final (job succeeded)",
  failed: "final (job failed)", cancelled: "final (job cancelled)" };

/** The invoice's exact figures (lines to 6 places add up to the subtotal; the total is rounded once,
 * to the cent) beside the quote the user accepted, and whether the invoice is still growing. */
function invoiceSums(st, cur, provider) {
  const state = st.contractState;
  return el("dl", { class: "facts invoice-sums" },
    el("dt", {}, "Subtotal (exact)"), el("dd", { class: "subtotal" }, `${st.subtotal} ${cur}`),
    el("dt", {}, "Credits"), el("dd", {}, `${st.credits} ${cur}`),
    el("dt", {}, "Total (to the cent)"), el("dd", {}, `${st.total} ${cur}`),
    provider ? null : el("dt", {}, "Quoted"),
    provider ? null : el("dd", { class: "quoted" }, st.quotedTotal ? `${st.quotedTotal} ${cur}` : "-"),
    el("dt", {}, "State"), el("dd", { class: "state" }, CONTRACT_WORDS[state] || state || "-"));
}

// ---------------------------------------------------------------- boot

window.addEventListener("hashchange", route);
document.querySelector("a.skip").addEventListener("click", (ev) => {  // #main is a landmark, not a page
  ev.preventDefault();
  document.getElementById("main").focus();
});
document.getElementById("signout").addEventListener("click", () => signOut("Signed out."));
route();
