// Relay dashboard: loads the histories once, then follows /api/stream (server-sent events).
// No framework, no network access beyond the broker: charts are hand-drawn SVG.
// Everything shown comes from Redis, which anyone holding a service's Redis password can write: it is
// always text (textContent, attribute values, h() below), never HTML. Nothing here parses markup.
"use strict";

const KEEP = 5000;           // history points kept per series in the page
const COLORS = ["#2f6fde", "#1f9d55", "#c77c02", "#7b4fd6", "#d0312d", "#138a9e", "#8a5a00"];
const S = { state: null, learner: [], events: [], thr: [], cur: { learner: null, events: null, thr: null },
            updates: 0, es: null };
const $ = (id) => document.getElementById(id);
const SVGNS = "http://www.w3.org/2000/svg";

// ---------------------------------------------------------------------------- elements
// h("td", {class: "num"}, text, child, ...): an element whose attributes are set as values and whose
// children are nodes or text (a string becomes a text node, never markup); null/undefined/false skipped
function h(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "data") { for (const [dk, dv] of Object.entries(v)) e.dataset[dk] = String(dv); }
    else e.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined && c !== false) e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

// ---------------------------------------------------------------------------- formatting (text out)
function fmt(x, digits = 3) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(2);
  return x.toFixed(a >= 100 ? 1 : digits);
}
function ago(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return `${s.toFixed(1)} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}
function short(h) { return h ? h.slice(0, 12) : "–"; }
function idKey(id) { const [a, b] = String(id).split("-"); return [Number(a), Number(b || 0)]; }
function after(a, b) { const x = idKey(a), y = idKey(b); return x[0] > y[0] || (x[0] === y[0] && x[1] > y[1]); }
function setConn(kind, text) { const c = $("conn"); c.className = `conn conn-${kind}`; c.textContent = text || kind; }

// ---------------------------------------------------------------------------- data in
async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}
function addLearner(entries) {
  for (const e of entries) {
    if (S.cur.learner && !after(e.id, S.cur.learner)) continue;
    S.learner.push(e); S.cur.learner = e.id;
  }
  if (S.learner.length > KEEP) S.learner.splice(0, S.learner.length - KEEP);
}
function addEvents(entries) {
  for (const e of entries) {
    if (S.cur.events && !after(e.id, S.cur.events)) continue;
    S.events.push(e); S.cur.events = e.id;
  }
  if (S.events.length > KEEP) S.events.splice(0, S.events.length - KEEP);
}
function addThroughput(samples) {
  for (const s of samples) {
    if (S.cur.thr !== null && s.t <= S.cur.thr) continue;
    S.thr.push(s); S.cur.thr = s.t;
  }
  if (S.thr.length > KEEP) S.thr.splice(0, S.thr.length - KEEP);
}

async function boot() {
  try {
    const [st, L, E, T] = await Promise.all([getJSON("/api/state"), getJSON("/api/history/learner"),
      getJSON("/api/history/events"), getJSON("/api/history/throughput")]);
    S.state = st; addLearner(L.entries); addEvents(E.entries); addThroughput(T.samples);
    render();
  } catch (err) {
    setConn("error", `cannot load: ${err.message}`);
  }
  connect();
}

function connect() {
  const q = new URLSearchParams({ learner_after: S.cur.learner || "0-0", events_after: S.cur.events || "0-0",
                                  throughput_after: String(S.cur.thr || 0) });
  const es = new EventSource(`/api/stream?${q}`);
  S.es = es;
  es.addEventListener("state", (ev) => {
    S.state = JSON.parse(ev.data); S.updates += 1; document.body.dataset.updates = S.updates;
    setConn("live"); render();
  });
  es.addEventListener("learner", (ev) => addLearner(JSON.parse(ev.data)));
  es.addEventListener("events", (ev) => addEvents(JSON.parse(ev.data)));
  es.addEventListener("throughput", (ev) => addThroughput(JSON.parse(ev.data)));
  es.addEventListener("error", (ev) => { if (ev.data) setConn("error", JSON.parse(ev.data).error); });
  es.onerror = () => {  // reconnect with the current cursors (no duplicates, nothing missed)
    if (es.readyState === EventSource.CLOSED || es.readyState === EventSource.CONNECTING) {
      es.close(); setConn("reconnecting", "reconnecting…"); setTimeout(connect, 2000);
    }
  };
}

// ---------------------------------------------------------------------------- render
function render() {
  const st = S.state;
  if (!st) return;
  try {
    renderCards(st); renderGenerators(st); renderTimeline(st); renderCharts(); renderFailures(st); renderEpisodes(st); renderEval(st);
  } catch (err) {
    console.error(err); setConn("error", `render error: ${err.message}`);
  }
}

function renderCards(st) {
  $("run-id").textContent = st.run_id;
  $("ingest-insecure").hidden = st.ingest_auth !== "insecure";
  $("learner-version").textContent = st.learner_version ?? "–";
  $("learner-hash").textContent = st.learner_hash ? short(st.learner_hash) : "nothing published yet";
  $("learner-hash").title = st.learner_hash || "";
  const ln = st.learner || {};
  $("learner-step").textContent = ln.step !== undefined ? ln.step : "–";
  $("learner-done").textContent = st.done ? "done: the learner finished its steps" : "";
  const last = S.learner.slice(-10).map((e) => e.reward_mean).filter((x) => typeof x === "number");
  const avg = last.length ? last.reduce((a, b) => a + b, 0) / last.length : null;
  $("reward").textContent = `${fmt(ln.reward_mean)} / ${fmt(avg)}`;
  $("length").textContent = `${fmt(ln.completion_len_mean, 1)} / ${fmt(ln.completion_len_max)}`;
  const trunc = ln.completion_truncated_frac;
  $("truncated").textContent = typeof trunc === "number"
    ? `${Math.round(100 * trunc)}% stopped at max_tokens` + (trunc > 0.5 ? ": raise generator.sampling.max_tokens" : "")
    : "";
  $("truncated").classList.toggle("lag-bad", typeof trunc === "number" && trunc > 0.5);
  $("queue").textContent = `${st.queue_depth} / ${st.pending_groups}`;
  $("prompts-ready").textContent = `${st.prompts_ready} prompts ready`;
  const r = st.rates || {};
  $("rates").textContent = `${fmt(r.groups_in_per_s, 1)} / ${fmt(r.groups_out_per_s, 1)}`;
  const f = st.failures || {};
  const rej = Object.values(f.rejected || {}).reduce((a, b) => a + b, 0);
  const drop = Object.values(f.learner_dropped || {}).reduce((a, b) => a + b, 0);
  $("failures-total").textContent = rej + drop + (f.reward_failures || 0) + (f.refused_updates || 0);
  $("failures-sub").textContent = `rejected ${rej} · dropped ${drop} · reward ${f.reward_failures || 0} · refused ${f.refused_updates || 0}`;
}

function renderGenerators(st) {
  const gens = st.generators || [];
  $("gen-count").textContent = `(${gens.length})`;
  const maxStale = 4;
  const rows = gens.map((g) => {
    const cls = [g.hash_ok && !g.forged_announcements ? "" : "hash-mismatch", g.state === "dead" ? "dead" : ""].join(" ").trim();
    const lagCls = g.lag === null ? "" : g.lag > maxStale ? "lag-bad" : g.lag > 1 ? "lag-warn" : "";
    const hash = g.hash_ok ? short(g.hash) : `⚠ ${short(g.hash)} ≠ announced ${short(g.announced_hash)}`;
    const lat = typeof g.last_update_latency_s !== "number" ? "–" : `${(g.last_update_latency_s * 1000).toFixed(0)} ms`;
    const num = (text, extra) => h("td", { class: extra ? `num ${extra}` : "num" }, text);
    return h("tr", { data: { id: g.id, hashOk: g.hash_ok, state: g.state }, class: cls || null },
      h("td", {}, g.id), h("td", {}, g.backend ?? "–"),
      h("td", { class: "state-cell" }, h("span", { class: `badge st-${g.state}`, title: `reported: ${g.reported_state}` }, g.state)),
      num(fmt(g.version), "version"), num(fmt(g.lag), lagCls),
      h("td", { class: "hash", title: `served ${g.hash || ""}\nannounced ${g.announced_hash || ""}` }, hash),
      num(lat), num(fmt(g.tokens_per_s, 1)), h("td", {}, ago(g.age_s)),
      num(fmt(g.groups_sent)), num(fmt(g.refused_updates)), num(fmt(g.reward_failures)));
  });
  $("generators").tBodies[0].replaceChildren(...(rows.length ? rows
    : [h("tr", {}, h("td", { colspan: 12, class: "count" }, "no generator has sent a heartbeat yet"))]));
  const alerts = [];
  const forged = (st.flags || {}).forged_announcement;
  if (forged) alerts.push(`forged weight announcement in Redis (${forged.reason}): version ${forged.version}, ` +
    `hash ${short(forged.hash)}, ${forged.path}; generators ignore it`);
  for (const g of gens) {
    if (g.forged_announcements) alerts.push(`${g.id} ignored ${g.forged_announcements} forged announcement(s)`);
    if (!g.hash_ok) alerts.push(`${g.id} serves hash ${short(g.hash)} for version ${g.version}, but ${short(g.announced_hash)} was announced for it`);
    if (g.state === "dead") alerts.push(`${g.id}: no heartbeat for ${ago(g.age_s).replace(" ago", "")}`);
    for (const [h, why] of Object.entries(g.refused || {})) alerts.push(`${g.id} refused snapshot ${short(h)}: ${why}`);
  }
  $("alerts").replaceChildren(...alerts.map((a) => h("div", { class: "alert" }, a)));
}

// ---------------------------------------------------------------------------- SVG helpers
function el(tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function size(svg) { return [svg.clientWidth || 560, svg.clientHeight || 200]; }
function ticks(lo, hi, n) {
  const span = hi - lo, step0 = span / n, mag = 10 ** Math.floor(Math.log10(step0));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => span / s <= n) || step0;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-12; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

// series: [{name, color, points: [[x, y], ...], dash?}]; opts: {yMin, yMax, xfmt}
function lineChart(svg, series, opts = {}) {
  const [W, H] = size(svg), m = { l: 50, r: 12, t: 18, b: 22 };
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const pts = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[1]));
  if (!pts.length) { svg.append(el("text", { x: W / 2, y: H / 2, class: "empty" }, "no data yet")); return; }
  let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
  let y0 = opts.yMin ?? Math.min(...pts.map((p) => p[1])), y1 = opts.yMax ?? Math.max(...pts.map((p) => p[1]));
  if (opts.yMin === undefined && y0 > 0 && y0 < y1 * 0.5) y0 = 0;
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { if (opts.yMin !== undefined) y1 = y0 + 1; else { y0 -= 0.5; y1 += 0.5; } }
  const X = (x) => m.l + ((x - x0) / (x1 - x0)) * (W - m.l - m.r);
  const Y = (y) => H - m.b - ((y - y0) / (y1 - y0)) * (H - m.t - m.b);
  const yt = ticks(y0, y1, 4);
  const dec = yt.length > 1 ? Math.max(0, Math.ceil(-Math.log10(yt[1] - yt[0]) - 1e-9)) : 2;
  for (const v of yt) {
    svg.append(el("line", { x1: m.l, x2: W - m.r, y1: Y(v), y2: Y(v), class: "axis" }));
    svg.append(el("text", { x: m.l - 6, y: Y(v) + 4, "text-anchor": "end" }, Math.abs(v) < 1e-12 ? "0" : v.toFixed(dec)));
  }
  const xf = opts.xfmt || ((v) => fmt(v, 0));
  for (const v of ticks(x0, x1, 6)) {
    svg.append(el("text", { x: X(v), y: H - 6, "text-anchor": "middle" }, xf(v)));
  }
  let lx = m.l + 4;
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    const p = s.points.filter((q) => Number.isFinite(q[1]));
    if (p.length) {
      const d = p.map((q, j) => `${j ? "L" : "M"}${X(q[0]).toFixed(1)},${Y(q[1]).toFixed(1)}`).join("");
      svg.append(el("path", { d, fill: "none", stroke: color, "stroke-width": s.width || 1.5,
                              "stroke-dasharray": s.dash || "", opacity: s.opacity || 1 }));
      if (p.length === 1) svg.append(el("circle", { cx: X(p[0][0]), cy: Y(p[0][1]), r: 2.5, fill: color }));
    }
    const label = el("text", { x: lx, y: 12, style: `fill:${color}` }, s.name);
    svg.append(label);
    lx += 12 + 6.5 * s.name.length;
  });
}

function barChart(svg, bars) {  // bars: [[label, value]]
  const [W, H] = size(svg), m = { l: 50, r: 12, t: 12, b: 22 };
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  if (!bars.length) { svg.append(el("text", { x: W / 2, y: H / 2, class: "empty" }, "no data yet")); return; }
  const top = Math.max(...bars.map((b) => b[1]), 1);
  const bw = (W - m.l - m.r) / bars.length;
  const Y = (y) => H - m.b - (y / top) * (H - m.t - m.b);
  for (const v of ticks(0, top, 4)) {
    svg.append(el("line", { x1: m.l, x2: W - m.r, y1: Y(v), y2: Y(v), class: "axis" }));
    svg.append(el("text", { x: m.l - 6, y: Y(v) + 4, "text-anchor": "end" }, fmt(v, 0)));
  }
  bars.forEach(([label, v], i) => {
    const x = m.l + i * bw + bw * 0.15;
    const r = el("rect", { x, y: Y(v), width: bw * 0.7, height: H - m.b - Y(v), fill: COLORS[0] });
    r.append(el("title", {}, `staleness ${label}: ${v} samples`));
    svg.append(r);
    svg.append(el("text", { x: x + bw * 0.35, y: H - 6, "text-anchor": "middle" }, label));
  });
}

// ---------------------------------------------------------------------------- timeline
function renderTimeline(st) {
  const svg = $("timeline");
  const gens = (st.generators || []).map((g) => g.id);
  const rows = ["learner", ...gens];
  const [W] = size(svg), rowH = 22, m = { l: 90, r: 12, t: 8, b: 20 };
  const H = m.t + rows.length * rowH + m.b;
  svg.style.height = `${H}px`;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  // the last five minutes, or less when the run is younger (so a short run fills the width)
  const first = S.events.length ? S.events[0].t : st.time;
  const span = Math.min(300, Math.max(30, st.time - first + 5));
  const now = st.time, t0 = now - span;
  const X = (t) => m.l + ((t - t0) / (now - t0)) * (W - m.l - m.r);
  rows.forEach((name, i) => {
    const y = m.t + i * rowH + rowH / 2;
    svg.append(el("line", { x1: m.l, x2: W - m.r, y1: y, y2: y, class: "axis" }));
    svg.append(el("text", { x: m.l - 8, y: y + 4, "text-anchor": "end" }, name));
  });
  for (const s of ticks(0, span, 5)) {
    svg.append(el("text", { x: X(now - s), y: H - 5, "text-anchor": "middle" }, s ? `-${s} s` : "now"));
  }
  let lastLabelX = -1e9;
  for (const e of S.events) {
    if (e.t < t0) continue;
    const x = X(e.t);
    if (e.kind === "published") {
      const y = m.t + rowH / 2;
      const c = el("circle", { cx: x, cy: y, r: 4, fill: "#2f6fde" });
      c.append(el("title", {}, `published v${e.version} ${short(e.hash)}`));
      svg.append(c);
      if (x - lastLabelX > 34) {
        svg.append(el("text", { x: x + 5, y: y - 4 }, `v${e.version}`)); lastLabelX = x;
      }
    } else {
      const i = rows.indexOf(e.generator);
      if (i < 0) continue;
      const y = m.t + i * rowH + rowH / 2;
      const ok = e.kind === "applied";
      const mark = el(ok ? "rect" : "path", ok ? { x: x - 1.5, y: y - 6, width: 3, height: 12, fill: "#1f9d55" }
        : { d: `M${x - 5},${y - 5}L${x + 5},${y + 5}M${x - 5},${y + 5}L${x + 5},${y - 5}`, stroke: "#d0312d", "stroke-width": 2.5 });
      mark.append(el("title", {}, ok ? `${e.generator} applied v${e.version} ${(1000 * (e.latency_s || 0)).toFixed(0)} ms after publication`
        : `${e.generator} refused v${e.version}: ${e.reason}`));
      svg.append(mark);
    }
  }
}

// ---------------------------------------------------------------------------- charts
function series(key) { return S.learner.filter((e) => typeof e[key] === "number").map((e) => [e.step, e[key]]); }
function movingAverage(points, n) {
  const out = [];
  let sum = 0;
  points.forEach((p, i) => { sum += p[1]; if (i >= n) sum -= points[i - n][1]; out.push([p[0], sum / Math.min(i + 1, n)]); });
  return out;
}
function renderCharts() {
  const reward = series("reward_mean");
  lineChart($("chart-reward"), [{ name: "per step", points: reward, color: "#9bb7ec", width: 1 },
    { name: "average of 10", points: movingAverage(reward, 10), color: "#2f6fde", width: 2 }]);
  const hist = {};
  for (const e of S.learner) for (const [k, n] of Object.entries(e.staleness || {})) hist[k] = (hist[k] || 0) + n;
  const maxK = Math.max(-1, ...Object.keys(hist).map(Number));
  barChart($("chart-staleness"), Array.from({ length: maxK + 1 }, (_, k) => [String(k), hist[k] || 0]));
  lineChart($("chart-ess"), [{ name: "ESS", points: series("ess") }], { yMin: 0, yMax: 1 });
  const fracKeys = [...new Set(S.learner.flatMap((e) => Object.keys(e).filter((k) => k.startsWith("frac_"))))].sort();
  lineChart($("chart-frac"), fracKeys.map((k) => ({ name: k.replace("frac_", ""), points: series(k) })), { yMin: 0 });
  lineChart($("chart-kl"), [{ name: "mismatch KL", points: series("mismatch_kl") }]);
  const critic = series("value_loss").length > 0;  // shown only when the learner trains a critic
  $("panel-critic").style.display = critic ? "" : "none";
  if (critic) lineChart($("chart-critic"), [{ name: "value loss", points: series("value_loss") },
    { name: "explained variance", points: series("explained_variance") },
    { name: "value clip fraction", points: series("value_clip_frac"), dash: "4 3" }]);
  lineChart($("chart-padding"), [{ name: "padding", points: series("padding_fraction") }], { yMin: 0, yMax: 1 });
  const now = S.state.time;
  const tf = (v) => `${Math.round(v)} s`;
  lineChart($("chart-queue"), [{ name: "queue depth", points: S.thr.map((s) => [s.t - now, s.queue_depth]) },
    { name: "pending", points: S.thr.map((s) => [s.t - now, s.pending]), dash: "4 3" }], { yMin: 0, xfmt: tf });
  lineChart($("chart-rates"), [{ name: "in (accepted)", points: S.thr.map((s) => [s.t - now, s.in_per_s]) },
    { name: "out (consumed)", points: S.thr.map((s) => [s.t - now, s.out_per_s]) }], { yMin: 0, xfmt: tf });
}

function kvTable(title, obj) {  // [heading, table or "none"]: nodes, the keys and values as text
  const rows = Object.entries(obj || {}).filter(([, v]) => v);
  const body = rows.length ? h("table", {}, rows.map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", { class: "num" }, fmt(v)))))
    : h("div", { class: "none" }, "none");
  return [h("h3", {}, title), body];
}
function renderFailures(st) {
  const f = st.failures || {};
  const refused = {};
  for (const g of st.generators || []) if (g.refused_updates) refused[g.id] = g.refused_updates;
  $("failures").replaceChildren(...kvTable("groups rejected by the broker, by reason", f.rejected),
    ...kvTable("groups dropped by the learner, by reason", f.learner_dropped),
    ...kvTable("reward failures (samples), by plugin", f.reward_failures_by_plugin),
    ...kvTable("weight updates refused, by generator", refused),
    ...kvTable("learner: non-finite numbers refused", f.learner_nonfinite),
    ...kvTable("records in Redis skipped as malformed, by kind", f.malformed_records));
}

function renderEpisodes(st) {  // multi-turn episodes (docs/agents.md); hidden for single-turn tasks
  const e = st.episodes || {};
  $("panel-episodes").style.display = e.episodes ? "" : "none";
  if (!e.episodes) return;
  const drift = e.template_drift ? h("div", { class: "bad", id: "template-drift" }, `template drift: ${fmt(e.template_drift)} ` +
    "episode(s) whose conversation the chat template renders to other tokens than those sampled") : null;
  const row = (label, value, id) => h("tr", {}, h("td", {}, label), h("td", { class: "num", id }, value));
  $("episodes").replaceChildren(h("table", {}, row("episodes", fmt(e.episodes), "episodes-count"),
    row("turns per episode", fmt(e.turns_per_episode, 2), "episodes-turns"),
    row("environment seconds per episode", fmt(e.env_seconds_per_episode, 3)),
    row("template drift", fmt(e.template_drift))), ...(drift ? [drift] : []),
    ...kvTable("tool calls, by tool", e.tool_calls), ...kvTable("tool failures, by tool", e.tool_failures),
    ...kvTable("environment failures, by reason", e.env_failures));
}

function renderEval(st) {  // evaluation rounds on the held-out set (docs/eval.md)
  const rounds = st.eval || [];
  lineChart($("chart-eval"), [{ name: "pass@1", points: rounds.filter((e) => typeof e["pass@1"] === "number").map((e) => [e.version, e["pass@1"]]) },
    { name: "mean reward", points: rounds.filter((e) => typeof e.mean_reward === "number").map((e) => [e.version, e.mean_reward]), dash: "4 3" }],
    { yMin: 0 });
  const num = (text) => h("td", { class: "num" }, text);
  const rows = rounds.slice().reverse().map((e) => h("tr", { data: { version: e.version } },
    num(`${fmt(e.version)}${e.final === true ? " (final)" : ""}`), num(fmt(e["pass@1"])),
    num(e.k ? `${fmt(e["pass@k"])} (k=${fmt(e.k)})` : "–"), num(fmt(e.mean_reward)),
    num(fmt(e.mean_length, 1)), num(`${fmt(e.n_prompts)}/${fmt(e.prompts)}`), num(fmt(e.reward_failures))));
  $("eval").tBodies[0].replaceChildren(...(rows.length ? rows
    : [h("tr", {}, h("td", { colspan: 7, class: "count" }, "no evaluation round yet (every eval.every_versions versions)"))]));
}

window.addEventListener("resize", render);
boot();
