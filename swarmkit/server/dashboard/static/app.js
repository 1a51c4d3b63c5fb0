// swarmkit dashboard: polls the server's dashboard API and draws plain DOM and SVG.
// No dependencies; every text from the server goes through textContent (never innerHTML).
"use strict";

const POLL_MS = 2000;
const COLORS = ["#1565c0", "#2e7d32", "#c62828", "#6a1b9a", "#ef6c00", "#00838f", "#5d4037", "#ad1457"];
const STATE_COLORS = { OFFLINE: "#9e9e9e", BOOTING: "#8e24aa", ROLLING: "#2e7d32", ROLLING_POST: "#f9a825",
  WEIGHT_SYNCING: "#1565c0" };
const metrics = [];  // every metrics.jsonl row seen so far
let timer = null;
let chartAdapter = "";  // model.adapters: the charts show this adapter's steps only ("" = every step)

// ------------------------------------------------------------------ helpers
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}
function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}
function fmt(x, digits = 3) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? x.toExponential(2) : x.toFixed(digits);
}
function secs(s) {
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}
async function api(path) {
  const r = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (r.status === 401) { location.reload(); throw new Error("signed out"); }
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}
function table(columns, rows, empty) {
  if (!rows.length) return el("div", { class: "empty", text: empty });
  const head = el("tr", {}, ...columns.map(c => el("th", { text: c[0] })));
  const body = rows.map(r => el("tr", {}, ...columns.map(c => {
    const v = c[1](r);
    const cell = el("td", typeof v === "number" ? { class: "num" } : {});
    cell.append(v instanceof Node ? v : fmt(v));
    return cell;
  })));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...body));
}
function kv(pairs) {
  const dl = el("dl", { class: "kv" });
  for (const [k, v] of pairs) dl.append(el("dt", { text: k }), el("dd", { text: fmt(v) }));
  return dl;
}
function replace(id, node) { const box = document.getElementById(id); box.replaceChildren(node); }
// the adapter a metrics row's step trained (model.adapters: its key adapter/<name>/step), else null
function rowAdapter(r) {
  const k = Object.keys(r).find(k => k.startsWith("adapter/") && k.endsWith("/step"));
  return k ? k.slice("adapter/".length, -"/step".length) : null;
}
// the metrics rows the charts draw: every row, or the steps of the adapter chosen
function shown() { return chartAdapter ? metrics.filter(r => rowAdapter(r) === chartAdapter) : metrics; }
// a <select> offering "" (anyText) and each name, keeping its choice when still offered
function fillSelect(sel, names, anyText) {
  const v = sel.value;
  sel.replaceChildren(el("option", { value: "", text: anyText }), ...names.map(n => el("option", { value: n, text: n })));
  sel.value = names.includes(v) ? v : "";
}

// ------------------------------------------------------------------ charts
// series: [{name, points: [[x, y], ...]}]; draws lines with min/max labels and a legend
function lineChart(title, series, xLabel = "step") {
  const W = 360, H = 170, L = 46, R = 8, T = 8, B = 22;
  const box = el("div", { class: "chart" }, el("h3", { text: title }));
  const pts = series.flatMap(s => s.points).filter(p => p[1] !== null && Number.isFinite(p[1]));
  if (!pts.length) { box.append(el("div", { class: "empty", text: "no data yet" })); return box; }
  let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
  let [y0, y1] = [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => T + (y1 - y) / (y1 - y0) * (H - T - B);
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": title });
  g.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#ccd" }),
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#ccd" }));
  const label = (x, y, text, anchor) => { const t = svg("text", { x, y, "font-size": 10, fill: "#5b6475",
    "text-anchor": anchor }); t.textContent = text; g.append(t); };
  label(L - 4, T + 8, fmt(y1), "end"); label(L - 4, H - B, fmt(y0), "end");
  label(L, H - 6, fmt(x0), "start"); label(W - R, H - 6, fmt(x1) + " " + xLabel, "end");
  const legend = el("div", { class: "legend" });
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const good = s.points.filter(p => p[1] !== null && Number.isFinite(p[1]));
    if (!good.length) return;
    const d = good.map((p, k) => (k ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join(" ");
    g.append(svg("path", { d, fill: "none", stroke: color, "stroke-width": 1.6, "vector-effect": "non-scaling-stroke" }));
    if (good.length === 1) g.append(svg("circle", { cx: sx(good[0][0]), cy: sy(good[0][1]), r: 2.5, fill: color }));
    const swatch = el("i");
    swatch.style.background = color;  // CSSOM, which the page's CSP allows (style attributes it does not)
    legend.append(el("span", {}, swatch, s.name + " " + fmt(good[good.length - 1][1])));
  });
  box.append(g, legend);
  return box;
}
// rl: the key is a policy-gradient number, meaningless on a step of demonstrations only (supervised)
// kinds: the metrics rows it reads ("train" steps; "eval" rounds are recorded at the step they ran after)
function series(name, key, rl = false, kinds = ["train"]) {
  const sftOnly = r => r.demonstrations > 0 && r.demonstrations === r.episodes;
  return { name, points: shown().filter(r => kinds.includes(r.kind) && r[key] !== undefined && !(rl && sftOnly(r)))
    .map(r => [r.step, r[key]]) };
}
function families(prefix) {
  const names = new Set();
  for (const r of metrics) for (const k of Object.keys(r)) if (k.startsWith(prefix)) names.add(k.slice(prefix.length));
  return [...names].sort();
}

function drawCharts() {
  const charts = [];
  const train = families("reward_mean/"), evals = families("eval_reward/");
  charts.push(lineChart("Reward per task family (train)",
    train.length ? train.map(f => series(f, "reward_mean/" + f)) : [series("all", "reward_mean")]));
  charts.push(lineChart("Reward per task family (eval, held out)", evals.map(f => series(f, "eval_reward/" + f, false, ["train", "eval"]))));
  charts.push(lineChart("Loss", [series("loss", "loss", true), series("pg loss", "pg_loss", true),
    series("sft nll", "sft_nll")]));
  charts.push(lineChart("KL, entropy, clip fraction", [series("approx KL", "approx_kl", true),
    series("entropy", "entropy", true), series("clip frac", "clip_frac", true)]));
  charts.push(lineChart("Gradient norm", [series("grad norm", "grad_norm")]));
  // task-reported numbers: shares (0..1, e.g. valid_tool_call) sit with the collapse signals, counts apart
  const isShare = f => metrics.every(r => r["task/" + f] === undefined || (r["task/" + f] >= 0 && r["task/" + f] <= 1));
  const taskNames = families("task/").filter(f => !f.startsWith("outcome/"));
  const taskShares = taskNames.filter(isShare), taskCounts = taskNames.filter(f => !isShare(f));
  charts.push(lineChart("Collapse signals", [series("identical groups", "collapse/identical_groups", true),
    series("flat groups", "collapse/flat_groups", true), series("entropy", "collapse/entropy", true),
    ...taskShares.map(f => series(f, "task/" + f, true))]));
  const outcomes = families("task/outcome/");  // a task's share of rollouts per way an episode ended (multi_calc)
  if (outcomes.length) charts.push(lineChart("Episode outcomes (share of the step's rollouts)",
    outcomes.map(f => series(f, "task/outcome/" + f, true))));
  if (taskCounts.length) charts.push(lineChart("Task numbers (step means)",
    taskCounts.map(f => series(f, "task/" + f, true))));
  const adapters = [...new Set(metrics.map(rowAdapter).filter(a => a !== null))].sort();
  if (adapters.length) {  // model.adapters: each adapter's reward at the run's steps, whatever the filter
    charts.unshift(lineChart("Reward per adapter (train)", adapters.map(a => ({ name: a,
      points: metrics.filter(r => r[`adapter/${a}/reward_mean`] !== undefined).map(r => [r.step, r[`adapter/${a}/reward_mean`]]) }))));
  }
  const rate = [], epm = [], rows = shown();
  for (let i = 1; i < rows.length; i++) {
    const a = rows[i - 1], b = rows[i], dt = b.time - a.time;
    if (dt > 0) { rate.push([b.step, (b.trained_tokens ?? b.tokens ?? 0) / dt]); epm.push([b.step, (b.episodes ?? 0) / dt * 60]); }
  }
  charts.push(lineChart("Throughput", [{ name: "trained tokens/s", points: rate }, { name: "episodes/min", points: epm }]));
  charts.push(lineChart("Step time split (s)", [series("waiting (drain)", "drain_s"), series("merging", "build_time_s"),
    series("training", "train_time_s"), series("weight sync", "weight_sync_s")]));
  document.getElementById("charts").replaceChildren(...charts);
}

function drawStates(spans, now) {
  if (!spans.length) return el("div", { class: "empty", text: "no history" });
  const W = 1000, H = 34, t0 = spans[0].start, span = Math.max(now - t0, 1e-3);
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", class: "states" });
  for (const s of spans) {
    const x = (s.start - t0) / span * W, w = Math.max(s.seconds / span * W, 0.8);
    const r = svg("rect", { x, y: 2, width: w, height: H - 4, fill: STATE_COLORS[s.state] || "#999" });
    const tip = svg("title", {}); tip.textContent = `${s.state}: ${secs(s.seconds)}`; r.append(tip); g.append(r);
  }
  const legend = el("div", { class: "legend" });
  const totals = {};
  for (const s of spans) totals[s.state] = (totals[s.state] || 0) + s.seconds;
  for (const [state, total] of Object.entries(totals)) {
    const i = el("i"); i.style.background = STATE_COLORS[state] || "#999";
    legend.append(el("span", {}, i, `${state} ${secs(total)}`));
  }
  return el("div", {}, g, legend);
}

// ------------------------------------------------------------------ overview
async function refreshOverview() {
  const o = await api("/api/v1/dashboard/overview?after=" + metrics.length);
  if (o.metrics.total < metrics.length) { metrics.length = 0; }  // a new run: start over
  metrics.push(...o.metrics.rows);
  const s = o.status;
  const badge = document.getElementById("state");
  badge.textContent = s.state; badge.className = "badge s-" + s.state;
  document.getElementById("headline").textContent =
    `${s.model || "no model"} · step ${s.global_step} · policy v${s.policy_version} · up ${secs(s.uptime_s || 0)}` +
    (s.training_finished ? " · training finished: " + s.training_finished : "") + (s.last_error ? " · error: " + s.last_error : "") +
    (s.pool?.alarm?.active ? " · COLLAPSE ALARM" + (s.pool.alarm.paused ? " (training paused)" : "") : "") +
    (o.live ? "" : " · " + (s.source || "not live"));
  replace("states", drawStates(o.states, o.now));
  const pool = s.pool || {}, fill = pool.fill, trainer = pool.trainer || {};
  const poolBox = el("div");
  const alarm = pool.alarm || {};
  if (alarm.message) {  // the collapse alarm: raised now, or the last one (docs/training.md "Collapse alarm")
    const taken = alarm.last?.taken ? ` · action taken: ${alarm.last.taken}` : "";
    poolBox.append(el("div", { class: alarm.active ? "async bad" : "async", id: "collapse-alarm",
      text: (alarm.active ? "" : "last alarm (cleared): ") + (alarm.paused || alarm.message) + taken +
        (alarm.rollbacks ? ` · ${alarm.rollbacks} rollback(s)` : "") }));
  }
  if (trainer.mode === "async") {
    poolBox.append(el("div", { class: "async", text: `async training (η = ${trainer.max_staleness}): ` +
      (trainer.training ? `step ${s.global_step + 1} training in the background` : "trainer idle") +
      ` · ${trainer.ready_batches} batch(es) ready · ${trainer.in_flight} of ${trainer.capacity} episodes in flight` }));
  }
  if (s.replicas && s.replicas.length) {
    const alive = s.replicas.filter((r) => r.alive).length;
    poolBox.append(el("div", { class: alive < s.replicas.length ? "async bad" : "async",
      text: `inference replicas ${alive} of ${s.replicas.length} in rotation: ` + s.replicas.map((r) =>
        `#${r.index} ${r.device || "default"} ` + (r.alive ? `${r.in_flight} in flight, ${r.episodes} episodes`
          : `OUT (${r.error})`)).join(" · ") }));
  }
  if (fill) {
    const bar = el("div", { class: "fill" }, el("div"));
    bar.firstChild.style.width = Math.min(100, 100 * fill.current / Math.max(fill.target, 1)) + "%";
    poolBox.append(el("div", { text: `${pool.policy || "policy"}: ${fill.current} of ${fill.target} ${fill.unit}` +
      (pool.ready ? " (ready: training next)" : "") }), bar);
  }
  poolBox.append(kv([["episodes in pool", pool.episodes], ["tasks in pool", pool.tasks], ["reserved", pool.reserved],
    ["trained", pool.trained], ["filtered", pool.filtered], ["clients active", s.clients?.active],
    ["ready votes", s.clients?.ready]]));
  if (o.pool_tasks.length) {
    poolBox.append(table([["task in the pool", r => r.task_id],
      ["episodes", r => r.needed ? `${r.episodes} / ${r.needed}` : r.episodes],
      ["rewards differ", r => r.rewards_differ ? "yes" : "no"]], o.pool_tasks.slice(0, 8), ""));
  }
  replace("pool", poolBox);
  const e = s.episodes || {};
  replace("counts", kv([["running", e.running], ["train / eval running", `${e.running_train} / ${e.running_eval}`],
    ["registered", e.registered], ["finished", e.finished], ["eval finished", e.eval_finished],
    ["aborted", e.aborted], ["reaped", e.reaped], ["calls", s.calls], ["tokens generated", s.tokens_generated]]));
  const adapters = pool.adapters || {};
  const names = Object.keys(adapters);
  document.getElementById("adapters-row").hidden = !names.length;
  if (names.length) {
    fillSelect(document.getElementById("chart-adapter"), names, "every adapter");
    replace("adapters", table([["adapter", r => r.name], ["step", r => r.step], ["policy version", r => r.policy_version],
      ["waiting in pool", r => r.waiting], ["running", r => r.running], ["last reward", r => r.reward_mean]],
    names.map(n => ({ name: n, ...adapters[n] })), ""));
  }
  const last = pool.last_step || {};
  replace("laststep", kv([["step", last.step], ["reward", last.reward_mean], ["loss", last.loss],
    ["samples", last.samples], ["merge ratio", last.merge_ratio],
    ["identical groups", last["collapse/identical_groups"]], ["flat groups", last["collapse/flat_groups"]],
    ["entropy", last["collapse/entropy"]], ["step time (s)", last.cycle_time_s],
    ["weight sync (s)", last.weight_sync_s]]));
  drawCharts();
  replace("running", table([["episode", r => link(r)], ["task", r => r.task_id], ["kind", r => r.eval ? "eval" : "train"],
    ...(names.length ? [["adapter", r => r.adapter]] : []), ["roles", r => r.roles.join(", ")], ["client", r => r.client_id], ["age", r => secs(r.age_s)],
    ["calls", r => r.calls], ["tokens", r => r.tokens]], o.running,
    o.live ? "no episode is running" : "a live server's only (this is a run folder)"));
  replace("clients", table([["client", r => r.client_id], ["last seen", r => secs(r.last_seen_s) + " ago"],
    ["active", r => r.active ? "yes" : "no"], ["ready vote", r => r.ready ? "yes" : "no"]], o.clients,
    o.live ? "no client yet" : "a live server's only (this is a run folder)"));
}
function rewardText(e) {
  if (e.reward === null && e.rewards) {
    return "rewards " + Object.entries(e.rewards).map(([role, v]) => `${role} ${fmt(v)}`).join(", ");
  }
  return `reward ${fmt(e.reward)}`;
}
function link(r) { return el("a", { href: "#/episode/" + encodeURIComponent(r.episode_id), text: r.episode_id }); }

// ------------------------------------------------------------------ episodes
async function refreshEpisodes() {
  const q = new URLSearchParams();
  for (const [k, v] of new FormData(document.getElementById("filters"))) if (v) q.set(k, v);
  const out = await api("/api/v1/dashboard/episodes?" + q);
  const adapters = out.adapters || [];
  document.getElementById("adapter-label").hidden = !adapters.length;
  if (adapters.length) fillSelect(document.getElementById("adapter-filter"), adapters, "any");
  const ticked = new Set();
  const compare = document.getElementById("compare");
  compare.disabled = true;
  const tick = r => el("input", { type: "checkbox", onchange: ev => {
    ev.target.checked ? ticked.add(r.episode_id) : ticked.delete(r.episode_id);
    compare.disabled = ticked.size !== 2;
    compare.onclick = () => { location.hash = "#/compare/" + [...ticked].map(encodeURIComponent).join("/"); };
  } });
  replace("episode-list", table([["", tick], ["episode", link], ["task", r => r.task_id],
    ["kind", r => r.eval ? "eval" : "train"], ...(adapters.length ? [["adapter", r => r.adapter]] : []),
    ["status", r => r.status], ["roles", r => r.roles.join(", ")], ["client", r => r.client_id], ["reward", r => r.reward ?? rewardText(r)], ["calls", r => r.calls],
    ["tokens", r => r.tokens],
    ["policy", r => r.policy_version]], out.episodes, "no episode matches"));
}

// ------------------------------------------------------------------ trajectories
function heat(lp) {  // probability 0 -> red, 1 -> green
  const p = Math.exp(lp);
  return `hsl(${(120 * p).toFixed(0)} 75% 80%)`;
}
// an advantage as a colour: red below 0, green above, white at 0 (saturating at |a| = 2)
function advHeat(a) {
  const s = Math.min(1, Math.abs(a) / 2);
  return `hsl(${a < 0 ? 0 : 120} 75% ${(96 - 36 * s).toFixed(0)}%)`;
}
function timelineCard(tl, title, version, byAdvantage) {
  const box = el("div", { class: "tokens" });
  for (const b of tl.blocks) {
    b.tokens.forEach(([text, id, lp, trained, adv], i) => {
      const span = el("span", { class: `tok a-${b.author}` + (trained ? " trained" : ""), text });
      const v = b.versions ? b.versions[i] : (b.author === "llm" ? version : undefined);  // per token: a partial rollout has two
      const hasAdv = adv !== undefined && adv !== null;
      const tip = [b.author, id === null ? null : "id " + id, lp === null ? null : "logprob " + lp.toFixed(3),
        lp === null ? null : "p " + Math.exp(lp).toFixed(3), trained ? "trained" : "not trained",
        hasAdv ? "advantage " + adv.toFixed(3) : null,
        v === undefined ? null : "policy v" + v].filter(x => x !== null);
      span.title = tip.join(" · ");
      if (byAdvantage && hasAdv) span.style.background = advHeat(adv);
      else if (trained && lp !== null) span.style.background = heat(lp);
      box.append(span);
    });
  }
  const meta = Object.entries(tl.meta || {}).filter(([k]) => ["call", "choice", "policy_version", "call_reward"].includes(k))
    .map(([k, v]) => `${k} ${v}`).join(" · ");
  return el("div", { class: "timeline" }, el("h3", { text: `${title}${tl.role ? " · role " + tl.role : ""}${meta ? " · " + meta : ""}` }), box);
}
function colourKey() {
  const key = el("div", { class: "legend key" });
  for (const a of ["user", "env", "history", "template", "llm"]) {
    const i = el("i", { class: "a-" + a }); key.append(el("span", {}, i, a));
  }
  key.append(el("span", {}, " trained tokens: underlined, shaded by p ", el("span", { class: "heat" }), " 0 → 1;" +
    " training samples of a trained episode: by advantage ", el("span", { class: "advheat" }), " −2 → +2"));
  return key;
}
async function episodePanel(id) {
  const v = await api("/api/v1/dashboard/episodes/" + encodeURIComponent(id));
  const e = v.episode;
  const panel = el("div", { class: "episode", "data-episode": e.episode_id });
  panel.append(el("div", { class: "episode-head" }, el("h2", { text: e.episode_id }),
    el("span", { text: `task ${e.task_id}` }), el("span", { text: e.eval ? "eval" : "train" }),
    e.adapter ? el("span", { text: `adapter ${e.adapter}` }) : null,
    el("span", { text: `status ${e.status}` }), el("span", { text: rewardText(e) }),
    el("span", { text: `client ${e.client_id}` }), el("span", { text: `${e.calls} calls, ${e.tokens} generated tokens` })));
  const body = el("div");
  const show = which => {
    const list = which === "samples" ? v.samples : v.timelines;
    const name = which === "samples" ? "sample" : "timeline";
    body.replaceChildren(...(list.length ? list.map((tl, k) => timelineCard(tl, `${name} ${k + 1} of ${list.length}`,
      tl.meta?.policy_version ?? e.policy_version, which === "samples" && v.advantages)) : [el("div", { class: "empty", text: "nothing recorded" })]));
    for (const b of toggle.children) b.classList.toggle("on", b.dataset.which === which);
  };
  const toggle = el("div", { class: "toggle" },
    el("button", { type: "button", "data-which": "timelines", text: `Timelines (${v.timelines.length})`, onclick: () => show("timelines") }),
    el("button", { type: "button", "data-which": "samples", text: `Training samples (${v.samples.length}, ${v.match} match)`, onclick: () => show("samples") }));
  panel.append(toggle, colourKey(), body);
  show("timelines");
  return panel;
}

// ------------------------------------------------------------------ routing
async function route() {
  clearInterval(timer);
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  const views = { overview: "view-overview", episodes: "view-episodes", episode: "view-episode", compare: "view-episode" };
  const name = parts[0] || "overview";
  for (const id of new Set(Object.values(views))) document.getElementById(id).hidden = id !== views[name];
  try {
    if (name === "episodes") { await refreshEpisodes(); }
    else if (name === "episode" || name === "compare") {
      const panels = await Promise.all(parts.slice(1, 3).map(episodePanel));
      replace("view-episode", panels.length > 1 ? el("div", { class: "compare" }, ...panels) : panels[0]);
    } else {
      await refreshOverview();
      timer = setInterval(() => refreshOverview().catch(console.warn), POLL_MS);
    }
  } catch (err) {
    if (err.message === "signed out") return;
    if (views[name] === "view-episode") replace("view-episode", el("div", { class: "empty", text: String(err.message) }));
    else console.warn(err);
  }
}
document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("filters").addEventListener("submit", ev => { ev.preventDefault(); refreshEpisodes(); });
  document.getElementById("chart-adapter").addEventListener("change", ev => { chartAdapter = ev.target.value; drawCharts(); });
  window.addEventListener("hashchange", route);
  route();
});
