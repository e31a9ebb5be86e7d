// pdserve dashboard: polls GET /v1/stats (server-side windowed figures) and draws them with plain DOM and SVG.
// The API key (for servers started with --api-key) comes from ?key= or a prompt, is kept in sessionStorage for
// this tab only, and is sent as a Bearer token; the URL's ?key= is removed from the address bar at once.
"use strict";
const KEY_ITEM = "pdserve-api-key";
const POLL_MS = 2000;
const HISTORY = 150; // points kept per chart (5 min at 2 s)
const history = new Map(); // model id -> [{ttft, itl, running, waiting, kv}]
let asked = false;

(function takeKeyFromUrl() {
  const url = new URL(window.location.href);
  if (url.searchParams.has("key")) {
    sessionStorage.setItem(KEY_ITEM, url.searchParams.get("key"));
    url.searchParams.delete("key");
    window.history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
  const w = url.searchParams.get("window");
  if (w) {
    const sel = document.getElementById("window");
    if (![...sel.options].some((o) => o.value === w)) sel.add(new Option(`${w} s`, w));
    sel.value = w;
  }
})();

function askKey() {
  const k = window.prompt("API key of this server (kept in this tab only):", sessionStorage.getItem(KEY_ITEM) || "");
  if (k !== null) sessionStorage.setItem(KEY_ITEM, k.trim());
}
document.getElementById("key-button").addEventListener("click", () => { askKey(); poll(); });
document.getElementById("window").addEventListener("change", () => { history.clear(); poll(); });

// ---- formatting ----------------------------------------------------------------------------------------------
const isNum = (v) => typeof v === "number" && Number.isFinite(v);
function ms(v) { return !isNum(v) ? "–" : v >= 1000 ? `${(v / 1000).toFixed(2)} s` : v >= 100 ? `${v.toFixed(0)} ms` : `${v.toFixed(1)} ms`; }
function pct(v) { return isNum(v) ? `${(100 * v).toFixed(v < 0.1 ? 1 : 0)}%` : "–"; }
function num(v, d = 1) { return isNum(v) ? v.toFixed(d) : "–"; }
function si(v, unit) {
  if (!isNum(v)) return "–";
  const p = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]].find(([f]) => Math.abs(v) >= f);
  return p ? `${(v / p[0]).toFixed(1)} ${p[1]}${unit}` : `${v.toFixed(1)} ${unit}`;
}
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : String(c));
  return e;
}

// a figure: label, big value (data-stat names it for tests and scripts), a sub line, an optional bar (0..1)
function card(label, stat, value, raw, sub = "", bar = null) {
  const v = el("div", { class: "value", "data-stat": stat, "data-value": isNum(raw) ? String(raw) : "" }, value);
  const c = el("div", { class: "card" }, el("div", { class: "label" }, label), v);
  if (sub) c.append(el("div", { class: "sub" }, sub));
  if (bar) {
    const b = el("div", { class: "bar" },
      el("span", { style: `width:${Math.min(100, 100 * (bar.value || 0))}%;background:${bar.color}` }));
    if (isNum(bar.mark)) b.append(el("i", { style: `left:${Math.min(100, 100 * bar.mark)}%` }));
    c.append(b);
  }
  return c;
}
function latencyCard(label, stat, p) {
  return card(label, `${stat}.p50`, ms(p.p50), p.p50, `p90 ${ms(p.p90)} · p99 ${ms(p.p99)} · n ${p.count}`);
}
function rooflineCards(steps, kinds, color) {
  return kinds.filter((k) => steps.by_kind[k]).map((k) => {
    const s = steps.by_kind[k];
    return card(`${k} steps: MFU / MBU`, `steps.${k}.mfu`, `${pct(s.mfu)} / ${pct(s.mbu)}`, s.mfu,
      `${si(s.flops_per_s, "FLOP/s")} · ${si(s.bytes_per_s, "B/s")} · nearer: ${s.nearer_roof || "–"} · ` +
      `step p50 ${ms(s.step_ms.p50)}`, { value: Math.max(s.mfu || 0, s.mbu || 0), color });
  });
}

// ---- one model's block -----------------------------------------------------------------------------------------
function renderModel(name, b, id) {
  const node = document.getElementById("model-template").content.firstElementChild.cloneNode(true);
  node.dataset.model = name;
  node.querySelector(".model-name").append(name, el("span", { class: "muted" },
    ` · last ${num(Math.min(b.window_s, b.span_s), 0)} s`));
  const v = node.querySelector(".verdict");
  v.dataset.verdict = b.verdict.verdict;
  v.querySelector(".verdict-name").textContent = b.verdict.verdict;
  for (const f of b.verdict.findings) v.querySelector(".findings").append(el("li", {}, f.text));
  const n = b.verdict.numbers;
  v.querySelector(".numbers").textContent = `TTFT p50 ${ms(n.ttft_p50_ms)} (limit ${ms(n.ttft_limit_ms)}) · ITL p50 ` +
    `${ms(n.itl_p50_ms)} (ITL_ref ${ms(n.itl_ref_ms)}, limit ${ms(n.itl_limit_ms)}) · queue share ` +
    `${pct(n.queue_share)} · preemptions ${num(n.preemptions, 0)} · KV watermark ${pct(n.kv_watermark)} · ` +
    `decode MBU ${pct(n.decode_mbu)} / MFU ${pct(n.decode_mfu)}`;

  const r = b.requests, lat = b.latency_ms, kv = b.kv_cache, load = b.load;
  node.querySelector(".summary").append(
    card("requests finished", "requests.finished", String(r.finished), r.finished, `${num(r.per_s, 2)} req/s`),
    card("errors", "requests.errors", String(r.errors), r.errors),
    card("running", "load.running", String(load.running), load.running, `peak ${load.running_peak}`),
    card("waiting", "load.waiting", String(load.waiting), load.waiting, `peak ${load.waiting_peak}`));

  const qp = (lat.queue.mean || 0) + (lat.prefill.mean || 0);
  const pre = node.querySelector(".phase.prefill .cards");
  pre.append(latencyCard("TTFT", "ttft", lat.ttft),
    card("queue vs prefill (mean)", "queue.mean", `${ms(lat.queue.mean)} / ${ms(lat.prefill.mean)}`, lat.queue.mean,
      `queue share ${pct(qp ? lat.queue.mean / qp : null)}`, { value: qp ? lat.prefill.mean / qp : 0, color: "var(--prefill)" }),
    card("prompt tokens/s", "requests.prompt_tokens_per_s", num(r.prompt_tokens_per_s), r.prompt_tokens_per_s,
      `mean prompt ${num(r.mean_prompt_tokens, 0)} tok`),
    card("prefix-cache hit rate", "prefix_cache.hit_rate", pct(b.prefix_cache.hit_rate), b.prefix_cache.hit_rate,
      `${b.prefix_cache.hits} / ${b.prefix_cache.queries} tokens`),
    ...(b.prefix_cache.disk ? [card("disk-tier hit rate", "prefix_cache.disk.hit_rate",
      pct(b.prefix_cache.disk.hit_rate), b.prefix_cache.disk.hit_rate,
      `${b.prefix_cache.disk.hits} / ${b.prefix_cache.disk.lookups} blocks · ${num(b.prefix_cache.disk.bytes / 2 ** 20, 0)} MiB on disk`)] : []),
    ...rooflineCards(b.steps, ["prefill", "mixed"], "var(--prefill)"));
  const dec = node.querySelector(".phase.decode .cards");
  dec.append(latencyCard("ITL", "itl", lat.itl), latencyCard("TPOT", "tpot", lat.tpot),
    card("generation tokens/s", "requests.generation_tokens_per_s", num(r.generation_tokens_per_s),
      r.generation_tokens_per_s, `mean output ${num(r.mean_generation_tokens, 0)} tok`),
    card("KV cache usage", "kv_cache.usage", pct(kv.usage), kv.usage, `watermark ${pct(kv.watermark)}` +
      (isNum(kv.num_blocks) ? ` · ${kv.used_blocks}/${kv.num_blocks} blocks` : ""),
      { value: kv.usage, mark: kv.watermark, color: "var(--decode)" }),
    card("preemptions", "preemptions", String(b.preemptions), b.preemptions),
    ...rooflineCards(b.steps, ["decode"], "var(--decode)"));
  const t = b.kv_transfer;
  if (t.pulls || t.pinned_blocks || t.requests_loading) {
    dec.append(card("KV pulls", "kv_transfer.pulls", String(t.pulls), t.pulls,
      `p50 ${ms(lat.kv_transfer.p50)} · ${num(t.pull_gb_per_s, 2)} GB/s · failed ${t.failed} · loading ${t.requests_loading ?? 0}`));
    pre.append(card("KV pinned for decode", "kv_transfer.pinned_blocks", String(t.pinned_blocks ?? 0), t.pinned_blocks));
  }
  renderCharts(node.querySelector(".charts"), id, b);
  renderTables(node.querySelector(".extra"), b);
  return node;
}

// ---- charts: the page's own history of the polled figures --------------------------------------------------------
function renderCharts(box, id, b) {
  const h = history.get(id) || [];
  h.push({ ttft: b.latency_ms.ttft.p50, itl: b.latency_ms.itl.p50, running: b.load.running,
           waiting: b.load.waiting, kv: 100 * b.kv_cache.usage });
  if (h.length > HISTORY) h.shift();
  history.set(id, h);
  box.append(chart("latency p50 (ms)", h, [["ttft", "TTFT", "var(--prefill)"], ["itl", "ITL", "var(--decode)"]]),
    chart("load", h, [["running", "running", "var(--decode)"], ["waiting", "waiting", "var(--prefill)"],
                      ["kv", "KV %", "var(--muted)"]]));
}
function chart(title, h, series) {
  const W = 400, H = 100, ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const max = Math.max(1e-9, ...h.flatMap((p) => series.map(([k]) => (isNum(p[k]) ? p[k] : 0))));
  for (const [k, , color] of series) {
    const pts = h.map((p, i) => `${(i / Math.max(1, h.length - 1)) * W},${H - (H - 4) * ((isNum(p[k]) ? p[k] : 0) / max)}`);
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", color);
    line.setAttribute("stroke-width", "2");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
  }
  const legend = series.map(([, label, color]) => el("span", { style: `color:${color}` }, `■ ${label} `));
  return el("div", { class: "chart" }, el("div", { class: "muted" }, `${title} · max ${num(max)} `, ...legend), svg);
}

function renderTables(box, b) {
  const kinds = Object.entries(b.steps.by_kind);
  if (kinds.length) {
    const t = el("table", { class: "steps" }, el("tr", {}, ...["step kind", "steps", "busy", "step p50", "GFLOP/s",
      "GB/s", "MFU", "MBU", "nearer roof"].map((x) => el("th", {}, x))));
    for (const [k, s] of kinds) {
      t.append(el("tr", {}, ...[k, s.steps, pct(s.busy_share), ms(s.step_ms.p50), num((s.flops_per_s || 0) / 1e9),
        num((s.bytes_per_s || 0) / 1e9, 2), pct(s.mfu), pct(s.mbu), s.nearer_roof || "–"].map((x) => el("td", {}, x))));
    }
    box.append(el("div", { class: "muted" }, `roofs: ${si(b.steps.peak_flops, "FLOP/s")}, ${si(b.steps.peak_bandwidth, "B/s")}`), t);
  }
  const tenants = Object.entries(b.tenants || {});
  if (tenants.length) {
    const t = el("table", { class: "tenants" }, el("tr", {}, ...["tenant", "finished", "req/s", "gen tok/s",
      "TTFT p50", "TPOT p50"].map((x) => el("th", {}, x))));
    for (const [name, s] of tenants) {
      t.append(el("tr", {}, ...[name, s.finished, num(s.per_s, 2), num(s.generation_tokens_per_s),
        ms(s.ttft_ms.p50), ms(s.tpot_ms.p50)].map((x) => el("td", {}, x))));
    }
    box.append(t);
  }
}

// ---- one server, or a router's instances side by side ---------------------------------------------------------------
function renderServer(stats, prefix) {
  const box = el("div", { class: "server" });
  for (const [name, block] of Object.entries(stats.models)) box.append(renderModel(name, block, `${prefix}|${name}`));
  return box;
}
function renderRouter(data) {
  const cols = { prefill: el("div", { class: "column" }), decode: el("div", { class: "column" }) };
  for (const inst of data.instances) {
    const card = el("div", { class: "instance", "data-url": inst.url, "data-role": inst.role },
      el("h2", {}, `${inst.role} · ${inst.url} `, el("span", { class: "muted" }, inst.healthy ? "healthy" : "unhealthy")));
    card.append(inst.stats ? renderServer(inst.stats, inst.url) : el("div", { class: "error" }, inst.error));
    cols[inst.role].append(card);
  }
  const grid = el("div", { class: "instances" }, cols.prefill, cols.decode);
  if (!cols.prefill.childElementCount) cols.prefill.append(el("div", { class: "muted" }, "no prefill instance (colocated)"));
  return grid;
}

async function poll() {
  const status = document.getElementById("status");
  const win = document.getElementById("window").value;
  const key = sessionStorage.getItem(KEY_ITEM);
  try {
    const resp = await fetch(`/v1/stats?window=${encodeURIComponent(win)}`,
      { headers: key ? { Authorization: `Bearer ${key}` } : {}, cache: "no-store" });
    if (resp.status === 401) {
      status.textContent = "API key needed (button above)";
      status.className = "error";
      if (!asked) { asked = true; askKey(); setTimeout(poll, 0); }
      return;
    }
    if (!resp.ok) throw new Error(`/v1/stats answered ${resp.status}`);
    const data = await resp.json();
    document.getElementById("role").textContent = data.role;
    const main = document.getElementById("main");
    main.replaceChildren(data.role === "router" ? renderRouter(data) : renderServer(data, "self"));
    main.dataset.updated = String(data.time);
    status.textContent = `updated ${new Date(data.time * 1000).toLocaleTimeString()}`;
    status.className = "muted";
  } catch (err) {
    status.textContent = String(err);
    status.className = "error";
  }
}
poll();
setInterval(poll, POLL_MS);
