// streamrft dashboard: follows /api/runs/<run>/events (Server-Sent Events) and draws the
// run's state. No libraries, nothing fetched from anywhere but this server.
"use strict";

const COLORS = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#65a30d",
  "#db2777", "#4f46e5", "#ca8a04"];
const SVG = "http://www.w3.org/2000/svg";

let current = null;      // the run shown
let stream = null;       // its EventSource
let clockSkew = 0;       // server time - this page's time, seconds
let latestKind = "";     // where the shown payload came from: "broker", "file"

const $ = (id) => document.getElementById(id);

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function fmt(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en");
  return Number(v).toFixed(digits === undefined ? 2 : digits);
}

function age(t) {
  if (!t) return "–";
  const s = Math.max(0, Date.now() / 1000 + clockSkew - t);
  if (s < 60) return `${s.toFixed(0)} s`;
  if (s < 3600) return `${(s / 60).toFixed(0)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KB", "MB", "GB", "TB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log(n) / Math.log(1024)));
  return `${(n / 1024 ** i).toFixed(i ? 1 : 0)} ${units[i]}`;
}

function niceTicks(lo, hi, n) {
  if (hi <= lo) hi = lo + 1;
  const raw = (hi - lo) / n;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(t);
  return ticks;
}

// Decimals that tell ticks `step` apart (0.25 -> 2, 0.002 -> 3, 5 -> 0).
function tickDigits(ticks) {
  if (ticks.length < 2) return 2;
  const step = Math.abs(ticks[1] - ticks[0]);
  let digits = Math.max(0, Math.ceil(-Math.log10(step) - 1e-9));
  if (Math.abs(Math.round(step * 10 ** digits) - step * 10 ** digits) > 1e-6) digits += 1;
  return Math.min(digits, 6);
}

// A line chart of series [{name, points: [[x, y]...]}] into the element `host`.
function lineChart(host, series, opts) {
  const W = 460, H = 200, L = 44, R = 10, T = 10, B = 26;
  const all = series.flatMap((s) => s.points);
  host.dataset.points = String(all.length);
  host.replaceChildren();
  if (!all.length) {
    host.append(el("p", { class: "empty" }, opts.empty || "no data yet"));
    return;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let y0 = opts.yMin !== undefined ? opts.yMin : Math.min(...all.map((p) => p[1]));
  let y1 = opts.yMax !== undefined ? opts.yMax : Math.max(...all.map((p) => p[1]));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  const yTicks = niceTicks(y0, y1, 4);
  for (const t of yTicks) {
    root.append(svg("line", { x1: L, x2: W - R, y1: sy(t), y2: sy(t), class: "grid" }));
    const label = svg("text", { x: L - 6, y: sy(t) + 4, class: "tick", "text-anchor": "end" });
    label.textContent = fmt(t, tickDigits(yTicks));
    root.append(label);
  }
  const xTicks = niceTicks(x0, x1, 5);
  for (const t of xTicks) {
    const label = svg("text", { x: sx(t), y: H - 8, class: "tick", "text-anchor": "middle" });
    label.textContent = fmt(t, tickDigits(xTicks));
    root.append(label);
  }
  root.append(svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  series.forEach((s, i) => {
    if (!s.points.length) return;
    const color = s.color || COLORS[i % COLORS.length];
    const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    root.append(svg("path", { d, class: "line", stroke: color, "data-series": s.name, "data-points": String(s.points.length) }));
    if (s.points.length < 40) {
      for (const p of s.points) root.append(svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: color }));
    }
  });
  const xl = svg("text", { x: W - R, y: H - B - 4, class: "axis-label", "text-anchor": "end" });
  xl.textContent = opts.xLabel || "";
  root.append(xl);
  host.append(root);
  if (series.length > 1) {
    const legend = el("div", { class: "legend" });
    series.forEach((s, i) => {
      const item = el("span", { class: "legend-item" });
      item.append(el("i", { style: `background:${s.color || COLORS[i % COLORS.length]}` }), s.name);
      legend.append(item);
    });
    host.append(legend);
  }
}

// A bar chart of [[k, value]...] (k: versions behind) into `host`.
function barChart(host, bars, opts) {
  const W = 460, H = 200, L = 44, R = 10, T = 10, B = 26;
  host.dataset.bars = String(bars.length);
  host.replaceChildren();
  if (!bars.length) {
    host.append(el("p", { class: "empty" }, opts.empty || "no data yet"));
    return;
  }
  const max = Math.max(1, ...bars.map(([, n]) => n));
  const slot = (W - L - R) / bars.length;
  const sy = (y) => H - B - (y / max) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  for (const t of niceTicks(0, max, 4)) {
    root.append(svg("line", { x1: L, x2: W - R, y1: sy(t), y2: sy(t), class: "grid" }));
    const label = svg("text", { x: L - 6, y: sy(t) + 4, class: "tick", "text-anchor": "end" });
    label.textContent = fmt(t, 0);
    root.append(label);
  }
  bars.forEach(([k, n], i) => {
    const x = L + i * slot + slot * 0.15;
    const newer = k < 0;
    const bar = svg("rect", { x, y: sy(n), width: slot * 0.7, height: H - B - sy(n), class: newer ? "bar newer" : "bar", "data-k": String(k) });
    const title = svg("title");
    title.textContent = newer
      ? `${n} groups sampled with a version ${-k} newer than the trainer held`
      : `${n} groups ${k} version(s) old`;
    bar.append(title);
    root.append(bar);
    const label = svg("text", { x: x + slot * 0.35, y: H - 8, class: "tick", "text-anchor": "middle" });
    label.textContent = newer ? `${k} (newer)` : String(k);
    root.append(label);
  });
  host.append(root);
}

function renderRuns(data) {
  const list = $("runs");
  list.replaceChildren();
  list.dataset.count = String(data.runs.length);
  for (const row of data.runs) {
    const item = el("li", { "data-run": row.run, class: row.run === current ? "active" : "" });
    const link = el("a", { href: `?run=${encodeURIComponent(row.run)}` }, row.run);
    link.addEventListener("click", (e) => { e.preventDefault(); choose(row.run); });
    item.append(link);
    const where = [row.on_broker ? "broker" : null, row.metrics_file ? "metrics.jsonl" : null].filter(Boolean);
    item.append(el("small", {}, where.join(" · ") || (row.folder ? "run folder, nothing read yet" : "no topics, no run folder")));
    list.append(item);
  }
  if (!data.runs.length) list.append(el("li", { class: "muted" }, "no runs found"));
  $("broker").textContent = data.broker ? `broker: ${data.broker}` : "no broker reachable";
}

async function loadRuns() {
  try {
    const resp = await fetch("/api/runs");
    const data = await resp.json();
    if (!current) {
      const asked = new URLSearchParams(location.search).get("run");
      const newest = [...data.runs].sort((a, b) => a.last - b.last || a.run.localeCompare(b.run)).pop();
      const first = asked || data.default || (newest ? newest.run : null);
      if (first) choose(first);
    }
    renderRuns(data);
  } catch (err) {
    $("broker").textContent = `cannot list runs: ${err}`;
  }
}

function choose(run) {
  if (stream) stream.close();
  current = run;
  history.replaceState(null, "", `?run=${encodeURIComponent(run)}`);
  $("run-title").textContent = run;
  document.title = `${run} · streamrft`;
  for (const li of document.querySelectorAll("#runs li")) li.classList.toggle("active", li.dataset.run === run);
  setSource("connecting…", false);
  stream = new EventSource(`/api/runs/${encodeURIComponent(run)}/events`);
  stream.onmessage = (msg) => {
    const payload = JSON.parse(msg.data);
    clockSkew = payload.server_time - Date.now() / 1000;
    render(payload);
  };
  stream.onerror = () => {
    if (stream.readyState === EventSource.CLOSED) setSource("stream closed (unknown run?)", false);
    else setSource("reconnecting…", false);
  };
}

function setSource(text, live) {
  $("source-text").textContent = text;
  $("source").dataset.live = live ? "true" : "false";
}

// A KPI the run's metrics.jsonl cannot know (no status, control or dead-letter topic).
function unknowable(id, p) {
  const unknown = p.kind === "file";
  $(`${id}-note`).textContent = unknown ? "not in metrics.jsonl" : "";
  $(id).parentElement.classList.toggle("unknown", unknown);
  if (unknown) $(id).textContent = "–";
  return unknown;
}

function render(p) {
  const v = p.view;
  setSource(p.source, p.live);
  document.body.dataset.kind = p.kind;
  document.body.dataset.seq = String(p.seq);
  $("kpi-step").textContent = String(v.trainer.step);
  $("kpi-version").textContent = v.versions.latest >= 0 ? String(v.versions.latest) : "–";
  $("kpi-rate").textContent = fmt(v.throughput_now, 1);
  $("kpi-rate-label").textContent = v.curves.throughput.unit;
  const st = v.curves.step_seconds;
  $("kpi-step-time").textContent = st.length ? `${fmt(st[st.length - 1][1])} s` : "–";
  if (!unknowable("kpi-versions", p)) $("kpi-versions").textContent = String(v.versions.announced);
  if (!unknowable("rebalances", p)) $("rebalances").textContent = String(v.rebalances);
  const dead = $("dead-letter-count");
  dead.dataset.count = String(v.dead_letters.count);
  if (!unknowable("dead-letter-count", p)) dead.textContent = String(v.dead_letters.count);
  $("kpi-dead").classList.toggle("alarm", v.dead_letters.count > 0);
  $("dead-letters-empty").textContent = p.kind === "file"
    ? "– (not in metrics.jsonl: dead letters are on the run's broker only)"
    : "none: every message decoded";

  const reward = Object.entries(v.curves.reward)
    .sort(([a], [b]) => (a === "trainer" ? -1 : b === "trainer" ? 1 : a.localeCompare(b)))
    .map(([name, points]) => ({ name, points }));
  lineChart($("chart-reward"), reward, { xLabel: "step" });
  lineChart($("chart-eval"), [{ name: "eval/accuracy", points: v.curves.eval_accuracy }],
    { yMin: 0, yMax: 1, xLabel: "trainer step", empty: "no evaluation yet" });
  const tp = v.curves.throughput;
  $("chart-rate-caption").firstChild.textContent = `${tp.unit[0].toUpperCase()}${tp.unit.slice(1)} `;
  lineChart($("chart-rate"), [{ name: tp.unit, points: tp.points }], { yMin: 0, xLabel: "seconds since start" });
  lineChart($("chart-step-time"), [{ name: "train/step_seconds", points: st }], { yMin: 0, xLabel: "trainer step" });
  barChart($("chart-staleness"), v.staleness, { empty: "no trained groups yet" });
  latestKind = p.kind;
  renderComponents(v.components);
  renderVersions(v.versions.recent);
  renderLetters(v.dead_letters.latest);
  latestSamples = v.samples || [];
  $("samples-empty").textContent = p.kind === "file"
    ? "none in the run folder's samples.jsonl (explorer.samples_per_step: 0 publishes none)"
    : "none yet (explorer.samples_per_step: 0 publishes none)";
  renderSamples();
}

let latestSamples = [];  // the shown payload's samples, newest first

function sampleFilter() {
  const task = $("sample-task").value.trim();
  const lo = $("sample-min").value === "" ? -Infinity : Number($("sample-min").value);
  const hi = $("sample-max").value === "" ? Infinity : Number($("sample-max").value);
  return (s) => (!task || s.task_id.includes(task)) && s.reward >= lo && s.reward <= hi;
}

// every text of a sample goes through textContent: what a model or a task says is never markup
function renderSamples() {
  const host = $("samples");
  const shown = latestSamples.filter(sampleFilter());
  host.replaceChildren();
  host.dataset.count = String(shown.length);
  $("sample-count").dataset.count = String(shown.length);
  $("sample-count").textContent = `${shown.length} of ${latestSamples.length}`;
  $("samples-empty").hidden = latestSamples.length > 0;
  for (const s of shown) {
    const box = el("article", { class: "sample", "data-task": s.task_id, "data-explorer": s.explorer });
    const versions = s.versions.length ? `versions ${s.versions.join(" → ")}` : `version ${s.version}`;
    const head = el("div", { class: "sample-head" });
    head.append(el("span", { class: "mono" }, s.task_id));
    head.append(el("span", { class: "reward" }, `reward ${fmt(s.reward, 3)}`));
    head.append(el("span", { class: "muted" },
      `${s.explorer} step ${s.step} · ${s.workflow} · ${versions} · `));
    head.lastChild.append(el("span", { class: "age", "data-t": String(s.created_at) }, age(s.created_at)));
    box.append(head);
    const text = el("pre", { class: "sample-text" });
    for (const part of s.parts) text.append(el("span", { class: `part part-${part.role}`, title: part.role }, part.text));
    box.append(text);
    host.append(box);
  }
}

for (const id of ["sample-task", "sample-min", "sample-max"]) $(id).addEventListener("input", renderSamples);

function renderComponents(rows) {
  const body = $("components");
  body.replaceChildren();
  body.dataset.count = String(rows.length);
  for (const c of rows) {
    const tr = el("tr", { "data-component": c.component, "data-state": c.state || "UNKNOWN", "data-role": c.role });
    tr.append(el("td", { class: "mono" }, c.component));
    tr.append(el("td", {}, c.role || "–"));
    const state = el("td");
    state.append(el("span", { class: `state state-${(c.state || "unknown").toLowerCase()}` }, c.state || "no status"));
    tr.append(state);
    tr.append(el("td", { class: "num" }, String(c.step)));
    tr.append(el("td", { class: "num" }, c.version >= 0 ? String(c.version) : "–"));
    tr.append(el("td", { class: `num ${c.lag > 1 ? "warn" : ""}` }, c.lag === null ? "–" : String(c.lag)));
    tr.append(el("td", { class: "num age", "data-t": String(c.heartbeat) }, age(c.heartbeat)));
    tr.append(el("td", {}, c.partitions.replace("tasks partitions ", "") || "–"));
    const reassigned = c.role === "explorer" && latestKind !== "file" ? String(c.rebalances) : "–";
    tr.append(el("td", { class: "num" }, reassigned));
    tr.append(el("td", { class: "detail", title: c.detail }, c.detail));
    body.append(tr);
  }
}

function renderVersions(recent) {
  const body = $("versions");
  body.replaceChildren();
  for (const r of [...recent].reverse()) {
    const tr = el("tr", { "data-version": String(r.version) });
    tr.append(el("td", { class: "num" }, String(r.version)));
    tr.append(el("td", { class: "num" }, String(r.step)));
    tr.append(el("td", {}, r.method + (r.lora ? " (LoRA)" : "")));
    tr.append(el("td", { class: "num" }, bytes(r.bytes)));
    tr.append(el("td", { class: "num age", "data-t": String(r.created_at) }, age(r.created_at)));
    body.append(tr);
  }
}

function renderLetters(letters) {
  const body = $("dead-letters");
  body.replaceChildren();
  $("dead-letters-empty").hidden = letters.length > 0;
  for (const d of [...letters].reverse()) {
    const tr = el("tr", { class: "letter" });
    tr.append(el("td", { class: "num age", "data-t": String(d.created_at) }, age(d.created_at)));
    tr.append(el("td", { class: "mono" }, d.component));
    tr.append(el("td", { class: "mono" }, d.source_topic));
    tr.append(el("td", { class: "num" }, `${d.partition}@${d.offset}`));
    tr.append(el("td", {}, d.error_type));
    tr.append(el("td", { class: "detail", title: d.reason }, d.reason));
    body.append(tr);
  }
}

// ages tick every second without new data
setInterval(() => {
  for (const cell of document.querySelectorAll(".age")) cell.textContent = age(Number(cell.dataset.t));
}, 1000);
setInterval(loadRuns, 5000);
loadRuns();
