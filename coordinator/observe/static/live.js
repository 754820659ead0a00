// The live view of an edgepfl run: polls state.json every second and draws the run, its rounds
// (small SVG line charts) and its devices. The token the page was opened with (?token=T) goes
// with every fetch as a bearer token. What the tests read is in data attributes: each device's
// row (data-device, data-state, ...) and each chart (data-chart, data-points, data-rounds).
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token");
const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
const COLORS = { blue: "#2f6fdf", orange: "#e07b1f", green: "#2e9b57", red: "#d0433a", grey: "#9aa3b2" };

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined) node.setAttribute(key, String(value));
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

const fixed = (value, digits) => (value === null || value === undefined ? "–" : Number(value).toFixed(digits));
const count = (value) => (value === null || value === undefined ? "–" : String(value));

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 90) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function ago(then, now) {
  if (then === null || then === undefined) return "–";
  const seconds = Math.max(0, now - then);
  return seconds < 3600 ? `${duration(seconds)} ago` : new Date(then * 1000).toLocaleString();
}

function card(label, value, extra) {
  return el("div", { class: "card" }, el("div", { class: "label" }, label), el("div", { class: "value" }, value),
            ...(extra ? [extra] : []));
}

function renderSummary(state) {
  const run = state.run;
  const last = state.rounds.length ? state.rounds[state.rounds.length - 1] : null;
  const megabytes = state.rounds.reduce((sum, r) => sum + r.mb_up + r.mb_down, 0);
  const rejected = Object.values(state.rejections).reduce((sum, n) => sum + n, 0);
  const planned = run.rounds === null ? "?" : run.rounds;
  const progress = el("div", { class: "progress" },
                      el("div", { style: `width: ${run.rounds ? Math.min(100, 100 * run.completed / run.rounds) : 0}%` }));
  const cards = [
    card("round", `${run.completed} of ${planned}` + (run.current ? ` (${run.current} running)` : ""), progress),
    card("phase", run.phase),
    card("seconds per round", duration(run.seconds_per_round)),
    card("time left", run.finished ? "done" : duration(run.seconds_left)),
    card("devices online", state.source === "live" ? `${run.online} of ${run.devices}` : `${run.devices} devices`),
    card("accuracy (mean)", fixed(last && last.accuracy, 4)),
    card("traffic in rounds", `${megabytes.toFixed(2)} MB`),
    card("rejected messages", String(rejected)),
  ];
  if (last && last.epsilon !== null && last.epsilon !== undefined) cards.push(card("epsilon spent", fixed(last.epsilon, 3)));
  document.getElementById("summary").replaceChildren(...cards);
  const title = `${run.algorithm || "?"} on ${run.dataset || "?"}, model ${run.model || "?"}` +
                (run.run_id ? ` · run ${run.run_id}` : "");
  document.getElementById("run-title").textContent = title;
  document.body.dataset.round = run.completed;
  document.body.dataset.rounds = run.rounds === null ? "" : run.rounds;
  document.body.dataset.source = state.source;
}

// The smallest of 4 x (1, 2, 2.5 or 5 x a power of ten) at or above `value`: four even grid steps.
function niceTop(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value / 4));
  const multiple = [1, 2, 2.5, 5, 10].find((m) => 4 * m * power >= value);
  return 4 * multiple * power;
}

// One chart: `series` share the x axis (rounds); a series may carry a band (lo/hi arrays) and be drawn as dots.
function lineChart(id, name, rounds, series, { yMin = 0, yMax = null, digits = 2 } = {}) {
  const box = document.getElementById(id);
  const width = Math.max(300, box.clientWidth || 600), height = 180;
  const left = 44, right = 10, top = 10, bottom = 22;
  const svg = el("svg:svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, "data-chart": name,
                              "data-points": rounds.length, "data-rounds": rounds.join(",") });
  const values = series.flatMap((s) => [...s.values, ...(s.band ? s.band.flat() : [])]).filter((v) => v !== null);
  if (!rounds.length || !values.length) {
    svg.append(el("svg:text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, "no round yet"));
    box.replaceChildren(svg);
    return;
  }
  const top_ = yMax !== null ? yMax : niceTop(Math.max(...values) * 1.05);
  const x0 = rounds[0], x1 = rounds[rounds.length - 1] === x0 ? x0 + 1 : rounds[rounds.length - 1];
  const x = (r) => left + (width - left - right) * (r - x0) / (x1 - x0);
  const y = (v) => top + (height - top - bottom) * (1 - (v - yMin) / (top_ - yMin || 1));
  for (let i = 0; i <= 4; i++) {
    const v = yMin + (top_ - yMin) * i / 4;
    svg.append(el("svg:line", { class: "grid", x1: left, x2: width - right, y1: y(v), y2: y(v) }),
               el("svg:text", { x: left - 4, y: y(v) + 3, "text-anchor": "end" }, v.toFixed(digits)));
  }
  const step = Math.max(1, Math.ceil(rounds.length / 12));
  rounds.forEach((r, i) => {
    if (i % step === 0 || i === rounds.length - 1) {
      svg.append(el("svg:text", { x: x(r), y: height - 6, "text-anchor": "middle" }, r));
    }
  });
  for (const s of series) {
    if (s.band) {
      const upper = rounds.map((r, i) => [r, s.band[1][i]]).filter(([, v]) => v !== null);
      const lower = rounds.map((r, i) => [r, s.band[0][i]]).filter(([, v]) => v !== null).reverse();
      if (upper.length) {
        const points = [...upper, ...lower].map(([r, v]) => `${x(r)},${y(v)}`).join(" ");
        svg.append(el("svg:polygon", { points, fill: s.color, "fill-opacity": 0.15, stroke: "none" }));
      }
    }
    const drawn = rounds.map((r, i) => [r, s.values[i]]).filter(([, v]) => v !== null);
    if (!s.dotsOnly && drawn.length > 1) {
      const d = drawn.map(([r, v], i) => `${i ? "L" : "M"}${x(r)},${y(v)}`).join(" ");
      svg.append(el("svg:path", { d, fill: "none", stroke: s.color, "stroke-width": 2,
                                  "stroke-dasharray": s.dashed ? "5 3" : null }));
    }
    for (const [r, v] of drawn) {
      svg.append(el("svg:circle", { cx: x(r), cy: y(v), r: s.dotsOnly ? 2 : 3, fill: s.color, "data-series": s.label,
                                    "data-round": r }, el("svg:title", {}, `round ${r}: ${s.label} ${v.toFixed(4)}`)));
    }
  }
  const legend = el("div", { class: "legend" },
                    ...series.flatMap((s) => [el("i", { style: `background: ${s.color}` }), s.label]));
  box.replaceChildren(svg, legend);
}

// The accuracy axis starts at the multiple of 0.2 below the lowest accuracy (0 without any).
function accuracyFloor(values) {
  const lowest = Math.min(...values.filter((v) => v !== null));
  return Number.isFinite(lowest) ? Math.max(0, Math.floor(lowest * 5 - 0.1) / 5) : 0;
}

function renderCharts(state) {
  const rounds = state.rounds.map((r) => r.round);
  const pick = (key) => state.rounds.map((r) => (r[key] === undefined ? null : r[key]));
  const mean = pick("accuracy"), std = pick("accuracy_std");
  const band = [mean.map((m, i) => (m === null || std[i] === null ? null : Math.max(0, m - std[i]))),
                mean.map((m, i) => (m === null || std[i] === null ? null : Math.min(1, m + std[i])))];
  lineChart("chart-accuracy", "accuracy", rounds,
            [{ label: "mean", color: COLORS.blue, values: mean, band },
             { label: "min", color: COLORS.red, values: pick("accuracy_min"), dotsOnly: true }],
            { yMin: accuracyFloor([...mean, ...pick("accuracy_min")]), yMax: 1 });
  lineChart("chart-traffic", "traffic", rounds,
            [{ label: "MB up", color: COLORS.orange, values: pick("mb_up") },
             { label: "MB down", color: COLORS.blue, values: pick("mb_down"), dashed: true }]);
  lineChart("chart-participants", "participants", rounds,
            [{ label: "aggregated", color: COLORS.green, values: pick("participants") },
             { label: "selected", color: COLORS.grey, values: pick("selected"), dashed: true }], { digits: 0 });
  const epsilon = pick("epsilon");
  const private_ = epsilon.some((v) => v !== null);
  document.getElementById("figure-epsilon").hidden = !private_;
  if (private_) lineChart("chart-epsilon", "epsilon", rounds, [{ label: "epsilon", color: COLORS.green, values: epsilon }]);
}

function renderDevices(state) {
  const rows = state.devices.map((d) => {
    const stateName = d.online === null ? "unknown" : d.online ? "online" : "offline";
    const reasons = Object.entries(d.rejections);
    const rejections = reasons.map(([reason, n]) => `${reason} ×${n}`).join(", ");
    const kind = d.kind === "lite" ? "weak" : d.kind;
    const cell = (value, warn) => el("td", { class: warn ? "num warn" : "num" }, count(value));
    return el("tr", { "data-device": d.id, "data-kind": d.kind, "data-state": stateName,
                      "data-accuracy": d.accuracy === null ? "" : d.accuracy, "data-selected": d.selected,
                      "data-replied": d.replied, "data-late": d.late, "data-missing": d.missing,
                      "data-refused": d.refused, "data-rejections": reasons.map((e) => e.join(":")).join(","),
                      "data-release": d.release === null ? "" : d.release },
              el("td", {}, d.id), el("td", {}, kind), el("td", {}, el("span", { class: "state" }), stateName),
              el("td", {}, ago(d.last_seen, state.now)), cell(d.selected), cell(d.replied), cell(d.late, d.late),
              cell(d.missing, d.missing), cell(d.refused, d.refused),
              el("td", { class: "num", title: d.accuracy_round ? `round ${d.accuracy_round}` : "" }, fixed(d.accuracy, 4)),
              el("td", { class: d.kept ? "num warn" : "num", title: d.kept ? `kept: ${d.kept}` : "" },
                 d.release === null ? "–" : String(d.release)),
              el("td", { class: rejections ? "warn" : "" }, rejections || "–"));
  });
  document.querySelector("#devices tbody").replaceChildren(...rows);
}

function renderEvents(state) {
  const items = state.events.slice().reverse().map((e) => {
    const details = [e.round ? `round ${e.round}` : "", e.reason || ""].filter(Boolean).join(", ");
    return el("li", { "data-event": e.event, "data-time": e.time },
              el("span", { class: "when" }, ago(e.time, state.now)),
              el("span", { class: `what-${e.event}` }, e.event), " ", e.device || "",
              details ? ` (${details})` : "");
  });
  document.getElementById("events").replaceChildren(...items);
}

function setConnection(status) {
  const badge = document.getElementById("connection");
  badge.textContent = status;
  badge.className = `badge ${status}`;
  document.body.dataset.status = status;
}

async function poll() {
  try {
    const response = await fetch("state.json", { cache: "no-store",
                                                  headers: TOKEN ? { Authorization: `Bearer ${TOKEN}` } : {} });
    if (!response.ok) throw new Error(`state.json answered ${response.status}`);
    const state = await response.json();
    renderSummary(state);
    renderCharts(state);
    renderDevices(state);
    renderEvents(state);
    setConnection(state.run.finished ? "finished" : "live");
  } catch (error) {
    setConnection("disconnected");
    document.body.dataset.error = String(error);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
