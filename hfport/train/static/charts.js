/* hfport charts: hand-written SVG line charts for a fine-tune's metrics.jsonl entries. No dependencies, no network.
   Shared by report.html (inlined by hfport/train/report.py) and the server's dashboard (/static/charts.js).

   HfCharts.panels(runs)            -> panel specs: one per metric group (loss, learning rate, grad norm, each eval
                                       metric family, throughput, memory, CPU/GPU use); runs = [{name, entries}]
   HfCharts.render(el, runs, opts)  -> draws every panel into el; overlays the runs (dash pattern per run)
   HfCharts.lttb(points, n)         -> Largest-Triangle-Three-Buckets downsampling for drawing (data stays whole)
*/
(function (root) {
  "use strict";
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#1f6feb", "#d1242f", "#1a7f37", "#8250df", "#bc4c00", "#0a7a8a", "#bf3989", "#57606a",
                  "#9a6700", "#4b3fd6"];
  const DASHES = ["", "6 3", "2 3", "10 3 2 3"];
  const W = 440, H = 230, L = 56, R = 12, T = 26, B = 34;  // plot margins: left room for tick labels
  const MAX_LINES = 10;

  // --- downsampling -------------------------------------------------------------------------------------------
  function lttb(pts, n) {
    if (pts.length <= n || n < 3) return pts;
    const out = [pts[0]], every = (pts.length - 2) / (n - 2);
    let a = 0;
    for (let i = 0; i < n - 2; i++) {
      const s = Math.floor((i + 1) * every) + 1, e = Math.min(Math.floor((i + 2) * every) + 1, pts.length);
      let ax = 0, ay = 0;
      for (let j = s; j < e; j++) { ax += pts[j][0]; ay += pts[j][1]; }
      ax /= (e - s) || 1; ay /= (e - s) || 1;
      const rs = Math.floor(i * every) + 1, re = Math.floor((i + 1) * every) + 1;
      let best = -1, pick = rs;
      for (let j = rs; j < re; j++) {
        const area = Math.abs((pts[a][0] - ax) * (pts[j][1] - pts[a][1]) - (pts[a][0] - pts[j][0]) * (ay - pts[a][1]));
        if (area > best) { best = area; pick = j; }
      }
      out.push(pts[pick]); a = pick;
    }
    out.push(pts[pts.length - 1]);
    return out;
  }

  // --- grouping entries into panels ---------------------------------------------------------------------------
  const SUFFIX = /_(macro|micro|weighted|samples|avg)$/;
  function family(key) {  // eval_f1_macro, eval_f1/positive -> f1; eval_exact_match -> exact_match
    return key.slice(5).split("/")[0].replace(SUFFIX, "");
  }
  function numeric(v) { return typeof v === "number" && isFinite(v); }

  function panels(runs) {
    const specs = new Map();  // id -> {id, title, unit, log, keys: Map(key -> label)}
    function add(id, title, key, label, extra) {
      if (!specs.has(id)) specs.set(id, Object.assign({id, title, keys: new Map()}, extra || {}));
      specs.get(id).keys.set(key, label);
    }
    for (const run of runs) {
      for (const e of run.entries) {
        for (const [k, v] of Object.entries(e)) {
          if (!numeric(v) || k === "step" || k === "epoch") continue;
          if (e.type === "train") {
            if (k === "loss") add("loss", "loss", "train:loss", "train loss", {log: true});
            else if (k === "lr") add("lr", "learning rate", "train:lr", "lr");
            else if (k === "grad_norm") add("grad_norm", "gradient norm (before clipping)", "train:grad_norm", "grad norm",
                                           {log: true});
          } else if (e.type === "eval" && k.startsWith("eval_")) {
            if (k === "eval_loss") add("loss", "loss", "eval:eval_loss", "eval loss", {log: true});
            else { const f = family(k); add("eval:" + f, "eval " + f, "eval:" + k, k.slice(5)); }
          } else if (e.type === "perf") {
            if (k === "tokens_per_s") add("tokens", "throughput (tokens/s)", "perf:" + k, "tokens/s");
            else if (k === "steps_per_s") add("steps", "throughput (steps/s)", "perf:" + k, "steps/s");
            else if (k === "eta_s") add("eta", "ETA (s)", "perf:" + k, "ETA s");
            else if (k.endsWith("_gb") && !k.endsWith("_total_gb")) add("memory", "memory (GB)", "perf:" + k, k.slice(0, -3));
            else if (k === "cpu_percent" || /^gpu\d+_util$/.test(k)) add("util", "CPU / GPU use (%)", "perf:" + k, k);
          }
        }
      }
    }
    const order = ["loss", "lr", "grad_norm"];
    const rank = (id) => order.includes(id) ? order.indexOf(id) : id.startsWith("eval:") ? 10 : 20;
    return [...specs.values()].sort((a, b) => rank(a.id) - rank(b.id) || a.id.localeCompare(b.id));
  }

  function seriesOf(run, key) {
    const [type, name] = [key.slice(0, key.indexOf(":")), key.slice(key.indexOf(":") + 1)];
    const pts = [];
    for (const e of run.entries) if (e.type === type && numeric(e[name])) pts.push([e.step, e[name]]);
    return pts;
  }

  // --- axes ---------------------------------------------------------------------------------------------------
  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) { const d = Math.abs(lo) * 0.1 || 1; lo -= d; hi += d; }
    const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / mag;
    const step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
    const start = Math.floor(lo / step) * step, ticks = [];
    for (let t = start; t <= hi + step * 0.5; t += step) ticks.push(+t.toPrecision(12));
    return ticks;
  }
  function logTicks(lo, hi) {
    const ticks = [];
    for (let p = Math.floor(Math.log10(lo)); p <= Math.ceil(Math.log10(hi)); p++) {
      for (const m of (Math.ceil(Math.log10(hi)) - Math.floor(Math.log10(lo)) > 3 ? [1] : [1, 2, 5])) ticks.push(m * Math.pow(10, p));
    }
    return ticks.filter((t) => t >= lo / 1.0001 && t <= hi * 1.0001);
  }
  function fmt(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1e5 || a < 1e-3) return v.toExponential(1).replace("e+", "e");
    return String(+v.toPrecision(4));
  }
  function el(tag, attrs, text) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // --- one panel ----------------------------------------------------------------------------------------------
  function drawPanel(box, spec, runs, state) {
    box.replaceChildren();
    const lines = [];  // {label, color, dash, pts}
    let i = 0;
    for (const [key, label] of spec.keys) {
      if (i >= MAX_LINES) break;
      runs.forEach((run, r) => {
        const pts = seriesOf(run, key);
        if (pts.length) lines.push({label: runs.length > 1 ? run.name + " · " + label : label, color: COLORS[i % COLORS.length],
                                    dash: DASHES[r % DASHES.length], pts});
      });
      i++;
    }
    const head = document.createElement("div");
    head.className = "hc-head";
    const title = document.createElement("span");
    title.className = "hc-title"; title.textContent = spec.title;
    head.append(title);
    const log = !!(spec.log && state.log[spec.id]);
    if (spec.log) {
      const lab = document.createElement("label"), cb = document.createElement("input");
      cb.type = "checkbox"; cb.checked = log; cb.className = "hc-log";
      cb.onchange = () => { state.log[spec.id] = cb.checked; drawPanel(box, spec, runs, state); };
      lab.append(cb, " log scale"); head.append(lab);
    }
    box.append(head);
    if (!lines.length) { const p = document.createElement("div"); p.className = "hc-empty"; p.textContent = "no points yet"; box.append(p); return; }

    const all = lines.flatMap((l) => l.pts);
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const [x, y] of all) {
      if (x < x0) x0 = x; if (x > x1) x1 = x;
      if (log && y <= 0) continue;
      if (y < y0) y0 = y; if (y > y1) y1 = y;
    }
    if (x1 <= x0) x1 = x0 + 1;
    const useLog = log && y0 > 0 && isFinite(y0);
    let yt;
    if (useLog) { if (y1 <= y0) y1 = y0 * 10; yt = logTicks(y0, y1); if (yt.length < 2) yt = [y0, y1]; }
    else { yt = niceTicks(y0, y1, 5); y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]); }
    const xt = niceTicks(x0, x1, 5).filter((t) => t >= x0 && t <= x1);
    const ly0 = useLog ? Math.log10(y0) : y0, ly1 = useLog ? Math.log10(y1) : y1;
    const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
    const sy = (y) => { const v = useLog ? Math.log10(Math.max(y, y0)) : y; return H - B - (v - ly0) / ((ly1 - ly0) || 1) * (H - T - B); };

    const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "hc-svg", role: "img", "aria-label": spec.title});
    for (const t of yt) {
      svg.append(el("line", {x1: L, x2: W - R, y1: sy(t), y2: sy(t), stroke: "#e5e7eb"}));
      svg.append(el("text", {x: L - 5, y: sy(t) + 3.5, "text-anchor": "end", class: "hc-tick"}, fmt(t)));
    }
    for (const t of xt) {
      svg.append(el("line", {x1: sx(t), x2: sx(t), y1: H - B, y2: H - B + 4, stroke: "#6b7280"}));
      svg.append(el("text", {x: sx(t), y: H - B + 15, "text-anchor": "middle", class: "hc-tick"}, fmt(t)));
    }
    svg.append(el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#6b7280"}));
    svg.append(el("line", {x1: L, x2: L, y1: T, y2: H - B, stroke: "#6b7280"}));
    svg.append(el("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", class: "hc-axis"}, "step"));
    const budget = Math.max(50, 2 * (W - L - R));  // about two points per pixel column
    for (const line of lines) {
      const pts = lttb(line.pts, budget);
      const d = pts.map(([x, y], k) => (k ? "L" : "M") + sx(x).toFixed(1) + " " + sy(y).toFixed(1)).join("");
      svg.append(el("path", {d, fill: "none", stroke: line.color, "stroke-width": 1.6, "stroke-dasharray": line.dash,
                             class: "hc-line", "data-label": line.label, "data-points": line.pts.length}));
      if (line.pts.length <= 30) for (const [x, y] of pts) svg.append(el("circle", {cx: sx(x), cy: sy(y), r: 2.4, fill: line.color}));
    }
    // hover read-out: the nearest step of each line
    const cursor = el("line", {y1: T, y2: H - B, stroke: "#9ca3af", "stroke-dasharray": "3 3", visibility: "hidden"});
    svg.append(cursor);
    const overlay = el("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "transparent", class: "hc-hover"});
    svg.append(overlay);
    const tip = document.createElement("div");
    tip.className = "hc-tip"; tip.style.display = "none";
    overlay.addEventListener("mousemove", (ev) => {
      const rect = svg.getBoundingClientRect();
      const x = x0 + ((ev.clientX - rect.left) * W / rect.width - L) / (W - L - R) * (x1 - x0);
      const rows = lines.map((line) => {
        let lo = 0, hi = line.pts.length - 1;
        while (hi - lo > 1) { const m = (lo + hi) >> 1; if (line.pts[m][0] < x) lo = m; else hi = m; }
        const p = Math.abs(line.pts[lo][0] - x) <= Math.abs(line.pts[hi][0] - x) ? line.pts[lo] : line.pts[hi];
        return [line, p];
      });
      const near = rows.reduce((a, r) => Math.abs(r[1][0] - x) < Math.abs(a[1][0] - x) ? r : a)[1][0];
      cursor.setAttribute("x1", sx(near)); cursor.setAttribute("x2", sx(near)); cursor.setAttribute("visibility", "visible");
      tip.replaceChildren();
      const h = document.createElement("div"); h.textContent = "step " + near; h.style.fontWeight = "600"; tip.append(h);
      for (const [line, p] of rows) {
        const row = document.createElement("div");
        row.style.color = line.color; row.textContent = line.label + ": " + fmt(p[1]) + (p[0] !== near ? " (step " + p[0] + ")" : "");
        tip.append(row);
      }
      tip.style.display = "block";
      tip.style.left = Math.min(ev.clientX - rect.left + 12, rect.width - 150) + "px";
      tip.style.top = (ev.clientY - rect.top + 8) + "px";
    });
    overlay.addEventListener("mouseleave", () => { tip.style.display = "none"; cursor.setAttribute("visibility", "hidden"); });
    const plot = document.createElement("div");
    plot.className = "hc-plot"; plot.append(svg, tip);
    box.append(plot);
    const legend = document.createElement("div");
    legend.className = "hc-legend";
    for (const line of lines) {
      const item = document.createElement("span");
      item.className = "hc-key";
      const sw = document.createElementNS(NS, "svg"); sw.setAttribute("width", 18); sw.setAttribute("height", 8);
      sw.append(el("line", {x1: 0, x2: 18, y1: 4, y2: 4, stroke: line.color, "stroke-width": 2, "stroke-dasharray": line.dash}));
      const last = line.pts[line.pts.length - 1][1];
      item.append(sw, " " + line.label + " " + fmt(last));
      legend.append(item);
    }
    box.append(legend);
  }

  const CSS = `.hc-grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:12px}
.hc-panel{border:1px solid #d0d7de;border-radius:6px;padding:6px 8px;background:#fff}
.hc-head{display:flex;justify-content:space-between;align-items:center;font-size:13px}
.hc-title{font-weight:600}.hc-plot{position:relative}.hc-svg{width:100%;height:auto;display:block}
.hc-tick{font-size:10px;fill:#57606a;font-family:system-ui,sans-serif}.hc-axis{font-size:11px;fill:#57606a}
.hc-legend{font-size:12px;display:flex;flex-wrap:wrap;gap:4px 12px}.hc-empty{color:#888;font-size:12px;padding:1em}
.hc-tip{position:absolute;pointer-events:none;background:rgba(255,255,255,.95);border:1px solid #d0d7de;
border-radius:4px;padding:4px 6px;font-size:12px;white-space:nowrap;box-shadow:0 1px 4px rgba(0,0,0,.12)}`;

  function render(container, runs, opts) {
    const state = (opts && opts.state) || {log: {}};
    if (!document.getElementById("hc-style")) {
      const style = document.createElement("style"); style.id = "hc-style"; style.textContent = CSS;
      document.head.append(style);
    }
    container.replaceChildren();
    container.classList.add("hc-grid");
    const specs = panels(runs);
    if (!specs.length) {
      const p = document.createElement("div"); p.className = "hc-empty"; p.textContent = "no metrics yet"; container.append(p);
    }
    for (const spec of specs) {
      const box = document.createElement("div");
      box.className = "hc-panel"; box.dataset.panel = spec.id;
      container.append(box);
      drawPanel(box, spec, runs, state);
    }
    return state;
  }

  root.HfCharts = {render, panels, lttb, niceTicks, family};
})(typeof window !== "undefined" ? window : globalThis);
