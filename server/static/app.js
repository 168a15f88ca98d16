// The dreamstage dashboard: one page, no build step, nothing loaded from elsewhere.
//
// It follows GET /events with fetch() streaming rather than EventSource,
// because EventSource cannot send an Authorization header and a server
// started with an API key wants one on every route. Every POST sends a JSON
// body with content-type application/json for the same reason.
"use strict";

const KEY_STORAGE = "dreamstage.apiKey";
const MAX_RECEIPT_ROWS = 200;      // table rows kept in the DOM, newest first
const MAX_CHART_POINTS = 5000;     // loss points kept for the chart
const EMA_BETA = 0.9;              // the moving average drawn over chunk losses
const RECONNECT_MS = [500, 1000, 2000, 5000];

const $ = (sel) => document.querySelector(sel);
const state = {
  job: null,            // the followed job, as GET /train/{id} reports it
  receipts: [],         // its receipts as {seq, receipt}, oldest first
  adapters: null,       // GET /adapters
  slots: null,          // the last slots event
  devices: [],
  training: true,
  recording: null,      // serve --record: the retention {days, mib}; false: off
  pending: {},          // per adapter: {count, mode, ...} (GET /v1/feedback/pending)
};

// -- HTTP -----------------------------------------------------------------------------
function headers(json) {
  const h = {};
  const key = localStorage.getItem(KEY_STORAGE);
  if (key) h["Authorization"] = "Bearer " + key;
  if (json) h["content-type"] = "application/json";
  return h;
}

async function api(method, path, body) {
  const init = { method, headers: headers(method !== "GET") };
  if (method !== "GET") init.body = JSON.stringify(body === undefined ? {} : body);
  const r = await fetch(path, init);
  let data = null;
  try { data = await r.json(); } catch (_) { /* not JSON */ }
  if (!r.ok) {
    const e = data && data.error;
    const where = e && e.param ? ` (${e.param})` : "";
    throw new Error(`${r.status}${where}: ${e ? e.message : r.statusText}`);
  }
  return data;
}

// -- formatting -------------------------------------------------------------------------
const num = (v, d = 2) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(d);
const pct = (v) => (v === null || v === undefined) ? "–" : (100 * v).toFixed(1) + "%";
function duration(s) {
  if (s === null || !Number.isFinite(s)) return "–";
  s = Math.max(0, Math.round(s));
  const m = Math.floor(s / 60), h = Math.floor(m / 60);
  return h ? `${h}h${String(m % 60).padStart(2, "0")}m` : m ? `${m}m${String(s % 60).padStart(2, "0")}s` : `${s}s`;
}
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("data-")) e.setAttribute(k, v); else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
function notice(text) {
  const n = $("#notice");
  n.hidden = !text;
  n.textContent = text || "";
}

// -- charts (inline SVG) ------------------------------------------------------------------
const SVG = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

// series: [{points: [[x, y], ...], cls, dots}]
function drawChart(svg, series, xLabel) {
  const [, , W, H] = svg.getAttribute("viewBox").split(" ").map(Number);
  const L = 46, R = 10, T = 10, B = 26;
  while (svg.firstChild) svg.firstChild.remove();
  const all = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[1]));
  svg.setAttribute("data-points", String(series.length ? series[0].points.length : 0));
  svg.append(svgEl("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
  svg.append(svgEl("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  if (!all.length) {
    const t = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" });
    t.textContent = "no points yet";
    svg.append(t);
    return;
  }
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = Math.min(...all.map((p) => p[1])), y1 = Math.max(...all.map((p) => p[1]));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.05; y0 = Math.max(0, y0 - pad); y1 += pad;
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  for (const [y, anchor] of [[y0, "end"], [y1, "end"], [(y0 + y1) / 2, "end"]]) {
    const t = svgEl("text", { x: L - 4, y: sy(y) + 4, "text-anchor": anchor });
    t.textContent = y.toFixed(2);
    svg.append(t);
  }
  for (const [x, anchor] of [[x0, "start"], [x1, "end"]]) {
    const t = svgEl("text", { x: sx(x), y: H - 8, "text-anchor": anchor });
    t.textContent = `${xLabel} ${Math.round(x)}`;
    svg.append(t);
  }
  for (const s of series) {
    const pts = s.points.filter((p) => Number.isFinite(p[1]));
    if (pts.length > 1) svg.append(svgEl("polyline", { class: s.cls, points: pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ") }));
    if (s.dots || pts.length === 1) for (const p of pts) svg.append(svgEl("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.5, class: s.dots || "dot" }));
  }
}

function drawLoss() {
  const pts = [], avg = [];
  let ema = 0, n = 0;
  for (const { seq, receipt: r } of state.receipts) {
    if (r.status !== "ok" || !r.tokens || r.loss === null) continue;
    pts.push([seq, r.loss]);
    ema = EMA_BETA * ema + (1 - EMA_BETA) * r.loss; n += 1;
    avg.push([seq, ema / (1 - Math.pow(EMA_BETA, n))]);
  }
  drawChart($("#loss-chart"), [{ points: pts, cls: "train" }, { points: avg, cls: "avg" }], "receipt");
  const p = (state.job && state.job.progress) || {};
  // the examples' own loss (train_loss_per_epoch mixes in the drift guard's rehearsal windows,
  // which stay near the base's entropy); a rehearsal-only epoch has none and draws no dot
  const own = p.examples_loss_per_epoch && p.examples_loss_per_epoch.length ? p.examples_loss_per_epoch
    : (p.train_loss_per_epoch || []);
  const train = own.map((v, i) => [i + 1, v]);
  const held = (p.eval_loss_per_epoch || []).map((v, i) => [i + 1, v]).filter((q) => q[1] !== null);
  drawChart($("#epoch-chart"), [{ points: train, cls: "avg", dots: "avgdot" }, { points: held, cls: "eval", dots: "evaldot" }], "epoch");
}

// -- sections ---------------------------------------------------------------------------------
function renderSlots(ev) {
  $("#decode-rate").textContent = num(ev.decode_tok_s, 1);
  const body = $("#slots tbody");
  body.replaceChildren(...ev.slots.map((s) => el("tr", { class: s.busy ? "busy" : "" },
    el("td", {}, s.id), el("td", {}, s.state), el("td", {}, s.prompt_tokens),
    el("td", {}, s.busy ? `${s.generated_tokens} / ${s.max_tokens ?? "–"}` : "–"),
    el("td", {}, s.cached_tokens), el("td", { class: "adapter" }, s.busy ? s.adapter : (s.cached_adapter ? `(${s.cached_adapter})` : "–")))));
  state.slots = ev.slots;
  renderNames();
}

function stat(label, value, id) {
  return el("div", {}, el("dt", {}, label), el("dd", id ? { id } : {}, value));
}

function renderJob() {
  const job = state.job;
  const title = $("#job-title");
  for (const b of ["pause", "resume", "cancel"]) $("#job-" + b).disabled = true;
  if (!job) { title.textContent = state.training ? "no job yet" : "training is off (no --state-dir)"; return; }
  const p = job.progress || {}, pacing = job.pacing || {}, spec = job.spec || {};
  title.textContent = `job ${job.id} · ${job.out} · ${spec.examples} example${spec.examples === 1 ? "" : "s"} · window ${job.window} · chunk ${p.current_chunk ?? job.chunk} · cache ${job.context_cache_type}`;
  title.setAttribute("data-state", job.state);
  const windows = p.windows || 0, epochs = p.epochs || 1, total = windows * epochs;
  let done = total ? Math.min(total, (p.epoch || 0) * windows + (p.window_in_epoch || 0)) : 0;
  if (job.state === "done") done = total;
  const frac = total ? done / total : 0;
  $("#progress-bar").style.width = (100 * frac).toFixed(1) + "%";
  $("#progress-text").textContent = `${job.state} · ${(100 * frac).toFixed(0)}% · epoch ${Math.min((p.epoch || 0) + 1, epochs)}/${epochs} · window ${job.state === "done" ? windows : p.window_in_epoch || 0}/${windows}`;
  // ETA at the rate so far: windows done per second since the job started,
  // both ends on the server's clock (the browser's may be set differently).
  let eta = null;
  if (job.started && job.updated && done > 0 && done < total && job.state === "running") {
    eta = (job.updated - job.started) / done * (total - done);
  }
  const bound = pacing.mode === "max_slowdown" ? `bound ${pct(pacing.target)}` : pacing.mode ? `share ${pct(pacing.target)}` : "";
  $("#job-stats").replaceChildren(
    stat("state", job.state, "stat-state"),
    stat("micro-steps", p.step ?? 0, "stat-step"),
    stat("loss (avg)", num(p.loss_avg, 3), "stat-loss"),
    stat("held-out loss", num(p.eval_loss, 3), "stat-eval"),
    stat("train tok/s", num(p.train_tok_s, 1), "stat-tok-s"),
    stat("ETA", duration(eta), "stat-eta"),
    stat("slowdown (realized)", (pacing.decode_batches_with || pacing.decode_batches_without)
      ? `${pct(pacing.realized_slowdown)} ${bound}` : `no chat load yet · ${bound}`, "stat-slowdown"),
    stat("dream share", pct(pacing.dream_share)),
    stat("pause per micro-step p50 / p95 / max", `${num(pacing.micro_step_ms_p50, 0)} / ${num(pacing.micro_step_ms_p95, 0)} / ${num(pacing.micro_step_ms_max, 0)} ms`, "stat-pause"),
    stat("decode tok/s with / without", `${num(pacing.decode_tok_s_with, 1)} / ${num(pacing.decode_tok_s_without, 1)}`),
    stat("refusals", p.refusals ?? 0, "stat-refusals"),
  );
  $("#job-message").textContent = job.message || "";
  $("#job-pause").disabled = job.state !== "running";
  $("#job-resume").disabled = job.state !== "paused";
  $("#job-cancel").disabled = !["queued", "starting", "running", "paused", "held"].includes(job.state);
  renderMemory();
}

const PARTS = ["graph_mib", "context_mib", "adapter_mib", "optimizer_mib", "walk_mib"];

// Receipts carry the job's memory summed over devices, so the job gets one
// row against its allowance, and each device a row of its own use.
function renderMemory() {
  const job = state.job, box = $("#memory");
  const mem = (job && job.memory) || {};
  const held = PARTS.reduce((a, k) => a + (mem[k] || 0), 0);
  const budget = job && job.spec ? job.spec.memory_budget_mib : null;
  const lastRefusal = job && job.refusals && job.refusals.length ? job.refusals[job.refusals.length - 1] : null;
  // The allowance the gate measured at the last refusal, else the budget the job set.
  const measured = lastRefusal && lastRefusal.refused_allowance_mib !== null ? lastRefusal.refused_allowance_mib : null;
  const jobBar = el("div", { class: "bar" });
  const scale = Math.max(held, budget || 0, measured !== null ? measured + held : 0) || 1;
  for (const k of PARTS) {
    if (!mem[k]) continue;
    const part = el("span", { class: k, title: `${k}: ${num(mem[k], 1)} MiB` });
    part.style.width = Math.max(0.3, 100 * mem[k] / scale) + "%";
    jobBar.append(part);
  }
  const jobLabel = measured !== null
    ? `${num(held, 1)} MiB; allowance ${num(measured, 1)} MiB at the last refusal${budget ? ` (budget ${budget} MiB)` : ""}`
    : budget ? `${num(held, 1)} of a ${budget} MiB budget (less the gate's slack)`
      : `${num(held, 1)} MiB; no budget: each device's free memory bounds it`;
  const rows = [el("div", { class: "memrow", "data-row": "job" },
    el("div", { class: "label" }, el("b", {}, "job "), el("span", {}, jobLabel)), jobBar)];
  for (const d of state.devices) {
    const used = d.total_mib - d.free_mib;
    const bar = el("div", { class: "bar" });
    const part = el("span", { class: "used", title: `in use: ${num(used, 0)} MiB` });
    part.style.width = (100 * used / (d.total_mib || 1)) + "%";
    bar.append(part);
    rows.push(el("div", { class: "memrow", "data-row": d.name },
      el("div", { class: "label" }, el("b", {}, `${d.name} `), el("span", {}, `${num(d.free_mib, 0)} MiB free of ${num(d.total_mib, 0)} MiB`)), bar));
  }
  const legend = el("div", { class: "legend" }, ...PARTS.map((k) =>
    el("span", {}, el("i", { class: k }), `${k.replace("_mib", "")} ${num(mem[k], 1)}`)));
  for (const i of legend.querySelectorAll("i")) i.style.background = `var(--${i.className.replace("_mib", "")})`;
  box.replaceChildren(...rows, legend);
  $("#memory-note").textContent = lastRefusal
    ? `last refusal: chunk at ${lastRefusal.refused_chunk_pos} (${lastRefusal.refused_chunk_tokens} tokens) needed ${num(lastRefusal.refused_need_mib, 1)} MiB, allowance ${num(lastRefusal.refused_allowance_mib, 1)} MiB`
    : "";
}

function receiptRow(seq, r) {
  if (r.kind === "drift") {           // a drift measurement (docs/architecture/drift.md), not a micro-step
    const text = `drift${r.final === false ? ` (epoch ${r.epoch}, a slice of the held-out anchors)` : ""}: ` +
      `anchors_changed ${num(r.anchors_changed, 3)} (${r.anchors_changed_count}/${r.anchors}` +
      `${r.noise_margin != null ? ` beyond the noise; at all ${r.anchors_changed_raw_count}` : ""}), ` +
      `drift_kl ${num(r.drift_kl, 4)}, max_drift ${r.max_drift}`;
    return el("tr", { class: "drift", "data-seq": seq }, el("td", {}, seq), el("td", {}, "drift"),
      ...Array.from({ length: 7 }, () => el("td", {}, "–")), el("td", { class: "msg" }, text));
  }
  const refused = r.status === "refused";
  return el("tr", { class: r.status, "data-seq": seq },
    el("td", {}, seq), el("td", {}, r.status),
    el("td", {}, refused ? r.refused_chunk_pos : r.chunk_pos),
    el("td", {}, refused ? r.refused_chunk_tokens : r.chunk_tokens),
    el("td", {}, r.status === "ok" && r.tokens ? num(r.loss, 3) : "–"),
    el("td", {}, num(r.ms, 0)), el("td", {}, num(r.graph_mib, 1)),
    el("td", {}, refused ? num(r.refused_need_mib, 1) : "–"),
    el("td", {}, refused ? num(r.refused_allowance_mib, 1) : "–"),
    el("td", { class: "msg" }, r.message || ""));
}

function addReceipt(ev) {
  state.receipts.push({ seq: ev.seq, receipt: ev.receipt });
  if (state.receipts.length > MAX_CHART_POINTS) state.receipts.shift();
  const body = $("#receipts tbody");
  body.prepend(receiptRow(ev.seq, ev.receipt));
  while (body.children.length > MAX_RECEIPT_ROWS) body.lastChild.remove();
  $("#receipts-count").textContent = `${state.job ? state.job.receipts : state.receipts.length} for job ${ev.job_id}`;
}

function renderAdapters() {
  const a = state.adapters;
  if (!a) return;
  const served = $("#served");
  served.setAttribute("data-version", String(a.served_version));
  served.textContent = `serving v${a.served_version}` + (a.served ? ` · ${a.served.name} v${a.served.version}` : " · base model");
  $("#adapters-note").textContent = a.served_error || (a.promotions.length ? `promotion stack: ${a.promotions.map((p) => `${p.name} v${p.version} → served v${p.served_version}`).join(", ")}` : "nothing promoted: the base model serves");
  $("#rollback").disabled = !a.promotions.length;
  const rows = [...a.adapters].reverse().map((ad) => {
    const btn = el("button", { type: "button", class: "promote", "data-name": ad.name, "data-version": ad.version }, ad.promoted ? "serving" : "promote");
    btn.disabled = ad.promoted;
    btn.addEventListener("click", () => act(() => api("POST", `/adapters/${encodeURIComponent(ad.name)}/promote`, { version: ad.version }), "#adapters-note"));
    return el("tr", { class: ad.promoted ? "serving" : "" }, el("td", {}, ad.name), el("td", {}, ad.version),
      el("td", {}, num(ad.eval_loss, 3)), el("td", {}, ad.job_id ?? "–"),
      el("td", {}, ad.promoted ? `v${ad.served_version}` : ""), el("td", {}, btn));
  });
  $("#adapters tbody").replaceChildren(...rows);
  renderNames();
}

// One row per adapter name: what it serves, the requests in slots now, its job and versions.
function renderNames() {
  const a = state.adapters;
  if (!a || !a.names) return;
  const serving = (name) => (state.slots || []).filter((s) => s.busy && s.adapter && s.adapter.split("@")[0] === name).length;
  $("#names tbody").replaceChildren(...a.names.map((n) => el("tr", { "data-name": n.name },
    el("td", {}, n.name), el("td", {}, n.served ? `v${n.served.version}` : "–"), el("td", { class: "requests" }, serving(n.name)),
    el("td", {}, n.training ? "training" : (n.queued_jobs.length ? `${n.queued_jobs.length} queued` : "")),
    el("td", {}, n.versions.join(", ")), el("td", { class: "pending" }, state.pending[n.name] ? state.pending[n.name].count : ""))));
}

// -- records and feedback (serve --record) ------------------------------------------------------------
async function checkRecording() {
  try {
    state.recording = (await api("GET", "/v1/records?limit=1")).retention;
  } catch (_) {
    state.recording = false;
  }
  const b = $("#recording");
  b.className = "badge " + (state.recording ? "on" : "off");
  b.textContent = state.recording ? `recording (kept ${state.recording.days} d, ${state.recording.mib} MiB)` : "not recording";
  await refreshPending();
}

async function refreshPending() {
  if (!state.recording) return;
  try {
    state.pending = (await api("GET", "/v1/feedback/pending")).pending;
  } catch (_) {
    return;
  }
  const parts = Object.entries(state.pending).map(([n, v]) => `${n} ${v.count} (learning ${v.mode})`);
  $("#feedback-pending").textContent = parts.length ? "feedback pending: " + parts.join(", ") : "no feedback pending";
  renderNames();
}

// Thumbs up / down and a correction box under an answer; each posts POST /v1/feedback on its id.
function feedbackControls(id) {
  const out = el("span", { class: "message" });
  const send = async (body) => {
    out.classList.remove("error");
    try {
      const r = await api("POST", "/v1/feedback", { id, ...body });
      out.textContent = `feedback ${r.id} (${r.kind}): ${r.pending} pending for ${r.adapter}`;
      await refreshPending();
    } catch (e) {
      out.textContent = e.message;
      out.classList.add("error");
    }
  };
  const up = el("button", { type: "button", class: "up", title: "a good answer (rating +1)" }, "👍");
  const down = el("button", { type: "button", class: "down", title: "a bad answer (rating -1)" }, "👎");
  const box = el("input", { type: "text", class: "correction", placeholder: "the answer it should have given" });
  const fix = el("button", { type: "button", class: "correct" }, "correct");
  up.addEventListener("click", () => send({ rating: 1 }));
  down.addEventListener("click", () => send({ rating: -1 }));
  fix.addEventListener("click", () => { if (box.value.trim()) send({ correction: box.value }); });
  return el("div", { class: "feedback" }, up, down, box, fix, out);
}

async function act(fn, where) {
  const out = $(where);
  out.classList.remove("error");
  try {
    await fn();
  } catch (e) {
    out.textContent = e.message;
    out.classList.add("error");
  }
}

// -- the event stream --------------------------------------------------------------------------
function onEvent(kind, data) {
  switch (kind) {
    case "hello":
      state.training = data.training;
      if (!data.training) renderJob();
      break;
    case "slots": renderSlots(data); break;
    case "job":
      if (!state.job || state.job.id !== data.id) {
        state.receipts = [];
        $("#receipts tbody").replaceChildren();
      }
      state.job = data;
      renderJob();
      drawLoss();
      break;
    case "receipt":
      if (state.job && state.job.id !== data.job_id) break;   // the stream moved on; its job event came first
      addReceipt(data);
      drawLoss();
      break;
    case "adapters": state.adapters = data; renderAdapters(); refreshPending(); break;
    case "devices": state.devices = data.devices; renderMemory(); break;
  }
}

function setConn(ok, text) {
  const c = $("#conn");
  c.className = "badge " + (ok ? "on" : "off");
  c.textContent = text;
}

async function follow() {
  let attempt = 0;
  for (;;) {
    try {
      const r = await fetch("/events", { headers: headers(false), cache: "no-store" });
      if (!r.ok) {
        let msg = r.statusText;
        try { msg = (await r.json()).error.message; } catch (_) { /* not JSON */ }
        notice(r.status === 401 || r.status === 403 ? `${r.status}: ${msg} (enter the API key above)` : `${r.status}: ${msg}`);
        throw new Error(msg);
      }
      notice("");
      setConn(true, "live");
      attempt = 0;
      const reader = r.body.getReader(), dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          let kind = "message", data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("event:")) kind = line.slice(6).trim();
            else if (line.startsWith("data:")) data += line.slice(5).trim();
          }
          if (data) onEvent(kind, JSON.parse(data));
        }
      }
    } catch (e) {
      console.warn("event stream:", e);
    }
    setConn(false, "reconnecting");
    await new Promise((ok) => setTimeout(ok, RECONNECT_MS[Math.min(attempt++, RECONNECT_MS.length - 1)]));
  }
}

// -- forms ----------------------------------------------------------------------------------------
// JSONL (every line an object) or chat turns "role: text"; a blank line starts another conversation.
function parseExamples(text) {
  const lines = text.split("\n");
  if (lines.filter((l) => l.trim()).every((l) => l.trim().startsWith("{"))) {
    const out = [];
    lines.forEach((l, i) => {
      if (!l.trim()) return;
      try { out.push(JSON.parse(l)); } catch (e) { throw new Error(`line ${i + 1}: not valid JSON: ${e.message}`); }
    });
    return out;
  }
  const convs = [];
  let cur = [];
  lines.forEach((l, i) => {
    if (!l.trim()) { if (cur.length) convs.push(cur); cur = []; return; }
    const m = /^\s*(system|user|assistant)\s*:\s?(.*)$/i.exec(l);
    if (m) cur.push({ role: m[1].toLowerCase(), content: m[2] });
    else if (cur.length) cur[cur.length - 1].content += "\n" + l;
    else throw new Error(`line ${i + 1}: a chat turn starts with "user:", "assistant:" or "system:"`);
  });
  if (cur.length) convs.push(cur);
  return convs.map((messages) => ({ messages }));
}

async function postJob(ev) {
  ev.preventDefault();
  const out = $("#train-result");
  out.classList.remove("error");
  try {
    const examples = parseExamples($("#train-examples").value);
    if (!examples.length) throw new Error("examples: paste at least one example");
    const body = { examples, promote: $("#train-promote").value };
    for (const [id, key, conv] of [["#train-window", "window", Number], ["#train-epochs", "epochs", Number], ["#train-lr", "lr", Number], ["#train-out", "out", String]]) {
      const v = $(id).value.trim();
      if (v) body[key] = conv(v);
    }
    const extra = $("#train-extra").value.trim();
    if (extra) {
      let more;
      try { more = JSON.parse(extra); } catch (e) { throw new Error(`more fields: not valid JSON: ${e.message}`); }
      if (!more || typeof more !== "object" || Array.isArray(more)) throw new Error("more fields: a JSON object, e.g. {\"rank\": 8}");
      Object.assign(body, more);
    }
    const job = await api("POST", "/train", body);
    out.textContent = `job ${job.id} ${job.state}`;
  } catch (e) {
    out.textContent = e.message;
    out.classList.add("error");
  }
}

async function ask(ev) {
  ev.preventDefault();
  const text = $("#chat-input").value.trim();
  if (!text) return;
  const mode = $("#chat-mode").value, max = Number($("#chat-max").value) || 24;
  const li = el("li", { class: "pending" }, el("div", { class: "q" }, text), el("div", { class: "a" }, "…"));
  $("#chat-log").prepend(li);
  try {
    const r = mode === "chat"
      ? await api("POST", "/v1/chat/completions", { messages: [{ role: "user", content: text }], max_tokens: max, temperature: 0 })
      : await api("POST", "/v1/completions", { prompt: text, max_tokens: max, temperature: 0 });
    const answer = mode === "chat" ? r.choices[0].message.content : r.choices[0].text;
    li.querySelector(".a").replaceChildren(document.createTextNode(answer), el("span", { class: "v", "data-version": r.adapter_version }, `adapter v${r.adapter_version}`));
    li.className = "answered";
    li.dataset.id = r.id;
    if (state.recording) li.append(feedbackControls(r.id));
  } catch (e) {
    li.querySelector(".a").textContent = e.message;
    li.className = "failed";
  }
}

function jobAction(action) {
  return () => act(() => api("POST", `/train/${state.job.id}/${action}`), "#job-message");
}

function init() {
  const key = $("#api-key");
  key.value = localStorage.getItem(KEY_STORAGE) || "";
  key.addEventListener("change", () => {
    if (key.value) localStorage.setItem(KEY_STORAGE, key.value); else localStorage.removeItem(KEY_STORAGE);
    location.reload();   // the open event stream was started with the old key
  });
  $("#train-form").addEventListener("submit", postJob);
  $("#chat-form").addEventListener("submit", ask);
  $("#rollback").addEventListener("click", () => act(() => api("POST", "/adapters/rollback"), "#adapters-note"));
  for (const a of ["pause", "resume", "cancel"]) $("#job-" + a).addEventListener("click", jobAction(a));
  drawLoss();
  checkRecording();
  follow();
}

init();
