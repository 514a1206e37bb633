/* kvserve dashboard: renders /api/pools/ data (chart, workers, page maps, canary, incidents) and polls it; draws the
   recorded series of /api/history/ (time series, window picker) and the per-tenant usage of /api/usage/.
   Plain DOM + inline SVG, no libraries; every server string goes through textContent, never innerHTML. */
(function () {
  "use strict";
  var SVG_NS = "http://www.w3.org/2000/svg";
  var CANVAS_ABOVE = 16384; // pages: larger pools are drawn on a canvas instead of one element per page
  var root, pageMapKeys = {};

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    setAttrs(node, attrs);
    (children || []).forEach(function (c) {
      if (c === null || c === undefined) return;
      node.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
    });
    return node;
  }
  function svg(tag, attrs, text) {
    var node = document.createElementNS(SVG_NS, tag);
    setAttrs(node, attrs);
    if (text !== undefined) node.textContent = String(text);
    return node;
  }
  function setAttrs(node, attrs) {
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") node.textContent = attrs[k];
      else if (attrs[k] !== null && attrs[k] !== undefined) node.setAttribute(k, attrs[k]);
    });
  }
  function fmt(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }
  function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }
  function ago(ts) {
    var s = Math.max(0, Date.now() / 1000 - ts);
    return s < 90 ? s.toFixed(0) + " s ago" : s < 5400 ? (s / 60).toFixed(0) + " min ago" : (s / 3600).toFixed(1) + " h ago";
  }
  function shortId(id) { return id.length > 30 ? id.slice(0, 27) + "…" : id; }
  function badge(cls, text) { return el("span", { "class": "badge " + cls }, [text]); }
  function replace(id, node) {
    var box = document.getElementById(id);
    box.replaceChildren(node);
  }
  function tenantColor(code) {
    if (code === 0) return "#e8eaed";
    if (code === -1) return "#6e7781"; // the DOM map hatches dirty cells (CSS) so no tenant hue can look like them
    if (code === -2) return "#cf222e";
    if (code === -3) return "#24292f";
    return "hsl(" + ((code * 137.508) % 360).toFixed(0) + ",62%,48%)";
  }

  // --- summary tiles ---------------------------------------------------------------------------
  function renderSummary(d) {
    var unsafe = d.workers.filter(function (w) { return !w.safe; }).length;
    var quarantined = d.workers.filter(function (w) { return w.quarantined; }).length;
    var canary = d.latest_canary;
    var tiles = [
      ["Effective context limit", d.effective_context_limit === null ? "cannot serve" : fmt(d.effective_context_limit),
        d.effective_context_limit === null ? "bad" : "good", "effective-limit"],
      ["Window served", fmt(d.served_window), "", "served-window"],
      ["Live workers", String(d.workers.length), d.workers.length ? "" : "bad", "live-workers"],
      ["Unsafe pools", String(unsafe), unsafe ? "bad" : "good", "unsafe-count"],
      ["Quarantined", String(quarantined), quarantined ? "bad" : "good", "quarantined-count"],
      ["Latest canary", canary ? OUTCOME[outcomeOf(canary)][1] : "none yet", canary ? OUTCOME[outcomeOf(canary)][2] : "", "canary-result"],
      ["Open incidents", String(d.open_incidents_total), d.open_incidents_total ? "bad" : "good", "open-incidents"],
    ];
    var box = el("div", { "class": "summary" }, tiles.map(function (t) {
      return el("div", { "class": "tile " + t[2], "data-testid": t[3] }, [
        el("div", { "class": "label" }, [t[0]]), el("div", { "class": "value" }, [t[1]])]);
    }));
    box.id = "summary";
    document.getElementById("summary").replaceWith(box);
  }

  // --- capacity vs window chart (inline SVG, grouped bars) ---------------------------------------
  function renderChart(d) {
    if (!d.workers.length) { replace("capacity-chart", el("p", { "class": "empty" }, ["No live workers."])); return; }
    var groupW = 190, barW = 56, top = 40, plotH = 220, left = 70, right = 120, bottom = 66;
    var width = left + d.workers.length * groupW + right, height = top + plotH + bottom;
    var max = Math.max.apply(null, d.workers.map(function (w) { return Math.max(w.capacity_tokens, w.window); })
      .concat([d.effective_context_limit || 0]));
    var scale = function (v) { return plotH * v / (max * 1.08); };
    var base = top + plotH;
    var chart = svg("svg", { viewBox: "0 0 " + width + " " + height, width: width, height: height, role: "img",
      "aria-label": "Pool capacity vs window" });
    [0, 0.25, 0.5, 0.75, 1].forEach(function (f) {
      var y = base - scale(max * f);
      chart.appendChild(svg("line", { x1: left - 4, x2: width - right + 10, y1: y, y2: y, stroke: "#e1e4e8" }));
      chart.appendChild(svg("text", { x: left - 8, y: y + 4, "text-anchor": "end", "font-size": 10, fill: "#666" }, fmt(Math.round(max * f))));
    });
    chart.appendChild(svg("rect", { x: left, y: 6, width: 10, height: 10, fill: "#0969da" }));
    chart.appendChild(svg("text", { x: left + 14, y: 15, "font-size": 11 }, "pool capacity (tokens)"));
    chart.appendChild(svg("rect", { x: left + 160, y: 6, width: 10, height: 10, fill: "#8250df" }));
    chart.appendChild(svg("text", { x: left + 174, y: 15, "font-size": 11 }, "window served (tokens)"));
    d.workers.forEach(function (w, i) {
      var x0 = left + i * groupW + 30;
      var g = svg("g", { "class": "chart-group", "data-worker": w.id, "data-capacity": w.capacity_tokens,
        "data-window": w.window, "data-safe": String(w.safe) });
      [["capacity", w.capacity_tokens, "#0969da", 0], ["window", w.window, "#8250df", barW + 6]].forEach(function (b) {
        var h = scale(b[1]);
        g.appendChild(svg("rect", { "class": "bar " + b[0], x: x0 + b[3], y: base - h, width: barW, height: h, fill: b[2] }));
        g.appendChild(svg("text", { "class": "bar-value " + b[0], x: x0 + b[3] + barW / 2, y: base - h - 4,
          "text-anchor": "middle", "font-size": 11, "font-weight": 600 }, fmt(b[1])));
      });
      g.appendChild(svg("text", { x: x0 + barW + 3, y: base + 15, "text-anchor": "middle", "font-size": 11 },
        w.role + (w.quarantined ? " (quarantined)" : "")));
      g.appendChild(svg("text", { x: x0 + barW + 3, y: base + 29, "text-anchor": "middle", "font-size": 9, fill: "#666" }, shortId(w.id).slice(0, 24)));
      g.appendChild(svg("rect", { x: x0 + barW - 30, y: base + 36, width: 66, height: 18, rx: 9, fill: w.safe ? "#1a7f37" : "#cf222e" }));
      g.appendChild(svg("text", { "class": "verdict", x: x0 + barW + 3, y: base + 49, "text-anchor": "middle", "font-size": 11,
        "font-weight": 700, fill: "#fff" }, w.safe ? "SAFE" : "UNSAFE"));
      chart.appendChild(g);
    });
    if (d.effective_context_limit) {
      var y = base - scale(d.effective_context_limit);
      chart.appendChild(svg("line", { "class": "limit-line", x1: left, x2: width - right + 10, y1: y, y2: y, stroke: "#cf222e",
        "stroke-dasharray": "6 4" }));
      chart.appendChild(svg("text", { x: width - right + 14, y: y - 2, "font-size": 11, fill: "#cf222e" }, "API limit"));
      chart.appendChild(svg("text", { x: width - right + 14, y: y + 12, "font-size": 11, "font-weight": 600, fill: "#cf222e" },
        fmt(d.effective_context_limit) + " tokens"));
    }
    chart.appendChild(svg("line", { x1: left, x2: width - right + 10, y1: base, y2: base, stroke: "#57606a" }));
    replace("capacity-chart", chart);
  }

  // --- workers table ----------------------------------------------------------------------------
  function sparkline(history, now) {
    var W = 150, H = 28, spark = svg("svg", { width: W, height: H, "class": "sparkline", viewBox: "0 0 " + W + " " + H });
    spark.appendChild(svg("rect", { x: 0, y: 0, width: W, height: H, fill: "#f6f8fa" }));
    var pts = history.map(function (s) {
      var total = s[1] + s[2] + s[3];
      return [W * (1 - (now - s[0]) / 3600), H - 2 - (H - 4) * (total ? s[1] / total : 0)];
    });
    if (pts.length === 1) spark.appendChild(svg("circle", { cx: pts[0][0], cy: pts[0][1], r: 2, fill: "#0969da" }));
    if (pts.length > 1) spark.appendChild(svg("polyline", { points: pts.map(function (p) { return p[0].toFixed(1) + "," + p[1].toFixed(1); }).join(" "),
      fill: "none", stroke: "#0969da", "stroke-width": 1.5 }));
    var peak = history.reduce(function (m, s) { var t = s[1] + s[2] + s[3]; return Math.max(m, t ? s[1] / t : 0); }, 0);
    return el("div", { "class": "spark", title: history.length + " samples in the last hour" },
      [spark, el("div", { "class": "hint" }, ["peak " + pct(peak) + " · " + history.length + (history.length === 1 ? " sample" : " samples")])]);
  }

  function renderWorkers(d) {
    if (!d.workers.length) { replace("workers-table", el("p", { "class": "empty" }, ["No live workers."])); return; }
    var head = ["Worker", "Capacity", "Window", "Config", "Used", "Free", "Dirty", "Utilization now", "Last hour",
      "Faults", "Quarantine", "Heartbeat"];
    var rows = d.workers.map(function (w) {
      return el("tr", { "class": "worker-row", "data-worker": w.id }, [
        el("td", {}, [el("strong", {}, [w.role]), " ", el("code", {}, [w.id]), el("br"), el("span", { "class": "hint" },
          [w.host + " · " + w.device + " · " + w.precision + " · KV " + w.dtype + " · scrub " + w.scrub_policy])]),
        el("td", { "class": "capacity" }, [fmt(w.capacity_tokens), el("br"), el("span", { "class": "hint" },
          [fmt(w.num_pages) + " pages × " + w.page_size + (w.pool_mb == null ? "" : " · " + fmt(w.pool_mb) + " MB " + w.dtype)])]),
        el("td", { "class": "window" }, [fmt(w.window)]),
        el("td", {}, [badge(w.safe ? "safe" : "unsafe", w.safe ? "SAFE" : "UNSAFE")]),
        el("td", { "class": "used" }, [fmt(w.used)]),
        el("td", { "class": "free" }, [fmt(w.free)]),
        el("td", { "class": "dirty" }, [fmt(w.dirty)]),
        el("td", {}, w.ledger_error ? [el("span", { "class": "fault" }, ["ledger: " + w.ledger_error])] :
          [el("span", { "class": "util" }, [el("span", { style: "width:" + (100 * w.utilization).toFixed(1) + "%" })]), " " + pct(w.utilization)]),
        el("td", {}, [sparkline(w.history, d.generated_at)]),
        el("td", {}, w.faults.length ? [el("span", { "class": "fault" }, [w.faults.join(", ")])] : ["none"]),
        el("td", {}, w.quarantined ? [badge("quarantined", "QUARANTINED"), el("br"), w.quarantine_reason || "",
          el("br"), el("a", { href: root.dataset.workersUrl }, ["release…"])] : [badge("serving", "serving")]),
        el("td", {}, [w.heartbeat_age_s.toFixed(1) + " s ago"]),
      ]);
    });
    replace("workers-table", el("table", { id: "workers" }, [
      el("thead", {}, [el("tr", {}, head.map(function (h) { return el("th", {}, [h]); }))]), el("tbody", {}, rows)]));
  }

  // --- page maps --------------------------------------------------------------------------------
  function legendOf(map) {
    var items = [[0, "free"], [-1, "dirty (awaiting scrub)"]].concat(map.legend.map(function (e) {
      return [e.code, e.label + ": " + fmt(e.pages) + " pages" + (e.cached ? " (" + fmt(e.cached) + " prefix-cached)" : "") +
        ", " + e.num_requests + " request(s)", e.request_ids];
    }));
    return el("div", { "class": "legend" }, items.map(function (it) {
      return el("span", { "class": "legend-item", title: it[2] ? it[2].join("\n") : "" },
        [el("span", { "class": it[0] === -1 ? "swatch dirty" : "swatch", style: it[0] === -1 ? null : "background:" + tenantColor(it[0]) }), it[1]]);
    }));
  }
  function labelsOf(map) {
    var labels = { 0: "free", "-1": "dirty", "-2": "lost (books do not balance)", "-3": "not a chat request" };
    map.legend.forEach(function (e) { labels[e.code] = e.label; });
    return labels;
  }
  function cellsOf(map) {
    var labels = labelsOf(map);
    if (map.cells.length > CANVAS_ABOVE) {
      var cols = 400, rows = Math.ceil(map.cells.length / cols), canvas = el("canvas", { "class": "pagemap-canvas",
        width: cols, height: rows, "data-num-cells": map.cells.length, style: "width:" + cols * 3 + "px;height:" + rows * 3 + "px" });
      var ctx = canvas.getContext("2d");
      map.cells.forEach(function (c, i) { ctx.fillStyle = tenantColor(c); ctx.fillRect(i % cols, Math.floor(i / cols), 1, 1); });
      return canvas;
    }
    var grid = el("div", { "class": "pagemap", "data-num-cells": map.cells.length });
    map.cells.forEach(function (c, i) {
      var cls = c === 0 ? "cell" : c === -1 ? "cell dirty" : c === -2 ? "cell lost" : c === -3 ? "cell other" : "cell owned";
      var cell = el("span", { "class": cls, title: "page " + i + ": " + labels[c], "data-code": c });
      if (c > 0) cell.style.background = tenantColor(c);
      grid.appendChild(cell);
    });
    return grid;
  }
  function renderPageMaps(d) {
    var box = document.getElementById("page-maps");
    var ids = d.workers.map(function (w) { return w.id; });
    Array.prototype.slice.call(box.children).forEach(function (b) { if (ids.indexOf(b.dataset.worker) < 0) b.remove(); });
    if (!d.workers.length) { box.replaceChildren(el("p", { "class": "empty" }, ["No live workers."])); pageMapKeys = {}; return; }
    var empty = box.querySelector(".empty"); if (empty) empty.remove();
    d.workers.forEach(function (w) {
      var map = d.page_maps[w.id], key = map ? JSON.stringify(map) : "none";
      var block = box.querySelector('.pagemap-block[data-worker="' + CSS.escape(w.id) + '"]');
      var head = el("div", { "class": "pagemap-head" }, [el("strong", {}, [w.role]), " ", el("code", {}, [w.id]),
        " — " + fmt(w.num_pages) + " pages · " + fmt(w.used) + " used · " + fmt(w.free) + " free · " + fmt(w.dirty) + " dirty"]);
      if (block && pageMapKeys[w.id] === key) { block.firstChild.replaceWith(head); return; }
      pageMapKeys[w.id] = key;
      var fresh = el("div", { "class": "pagemap-block", "data-worker": w.id }, [head].concat(map ? [legendOf(map), cellsOf(map)] :
        [el("p", { "class": "fault" }, [w.ledger_error || "no ledger for this worker"])]));
      if (block) block.replaceWith(fresh); else box.appendChild(fresh);
    });
  }

  // --- canary and incidents ---------------------------------------------------------------------
  // outcome -> [badge class, label, tile class]: not judged (busy, unreachable, timed out) is a warning, not a failure
  var OUTCOME = { passed: ["pass", "PASSED", "good"], wrong: ["fail", "WRONG", "bad"],
                  not_judged: ["not-judged", "NOT JUDGED", "warn"] };
  function outcomeOf(x) { return OUTCOME[x.outcome] ? x.outcome : (x.passed ? "passed" : "wrong"); }
  function outcomeBadge(outcome, prefix) { return badge(OUTCOME[outcome][0], (prefix ? prefix + " " : "") + OUTCOME[outcome][1]); }
  function perWorker(k) {  // live probes: one line per worker, each probe's outcome
    var workers = Object.keys(k.per_worker || {});
    if (!workers.length) return null;
    return el("ul", { "class": "canary-workers" }, workers.map(function (w) {
      var probes = k.per_worker[w];
      return el("li", { "class": "canary-worker", "data-worker": w }, [el("code", {}, [w]), " "].concat(
        Object.keys(probes).map(function (p) {
          var o = OUTCOME[probes[p]] ? probes[p] : (probes[p] === true ? "passed" : "wrong");
          return el("span", { "class": "canary-probe", "data-probe": p, "data-outcome": o }, [outcomeBadge(o, p)]);
        })));
    }));
  }
  function renderCanary(d) {
    var c = d.latest_canary;
    if (!c) { replace("canary", el("p", { "class": "empty" }, ["No canary run yet."])); return; }
    var rows = c.checks.map(function (k) {
      return el("tr", { "class": "canary-check", "data-check": k.name }, [el("td", {}, [k.name]),
        el("td", { "data-outcome": outcomeOf(k) }, [outcomeBadge(outcomeOf(k))]),
        el("td", {}, [k.duration_s === null || k.duration_s === undefined ? "–" : Number(k.duration_s).toFixed(2) + " s"]),
        el("td", {}, [perWorker(k) || el("a", { href: c.url + "#check-" + encodeURIComponent(k.name), "class": "canary-details" },
          [Object.keys(k.details || {}).join(", ") || "details"])])]);
    });
    replace("canary", el("div", {}, [
      el("p", {}, [el("a", { href: c.url, "class": "canary-run-link" }, ["Run #" + c.id]),
        " started " + new Date(c.started_at).toLocaleString() + " ", outcomeBadge(outcomeOf(c)),
        " · ", el("a", { href: c.url }, ["every check and probe, as tables"])]),
      el("table", {}, [el("thead", {}, [el("tr", {}, ["Check", "Result", "Duration", "Details"].map(function (h) { return el("th", {}, [h]); }))]),
        el("tbody", {}, rows)])]));
  }
  function renderIncidents(d) {
    if (!d.open_incidents.length) { replace("incidents", el("p", { "class": "empty" }, ["No open incidents."])); return; }
    var rows = d.open_incidents.map(function (i) {
      return el("tr", { "class": "incident-row", "data-incident": i.id }, [
        el("td", {}, [el("a", { href: i.admin_url }, ["#" + i.id])]),
        el("td", {}, [new Date(i.created_at).toLocaleString()]),
        el("td", {}, [badge(i.severity, i.severity)]),
        el("td", { "class": "kind" }, [i.kind]),
        el("td", {}, [el("code", {}, [i.worker || i.pool || "–"])]),
        el("td", {}, [i.pages.join(", ") || "–"]),
        el("td", {}, [i.reader_request ? el("code", {}, [shortId(i.reader_request)]) : "–",
          i.previous_owner_request ? " read pages of " : "", i.previous_owner_request ? el("code", {}, [shortId(i.previous_owner_request)]) : ""]),
        el("td", {}, [i.detected_by].concat(i.canary_url ? [" · ", el("a", { href: i.canary_url, "class": "canary-link" }, ["canary run"])] : [])),
        el("td", {}, [i.quarantined ? "worker was quarantined" : "", i.acknowledged ? " · acknowledged" : ""]),
      ]);
    });
    var more = d.open_incidents_total > d.open_incidents.length ? el("p", { "class": "hint" }, [
      "showing " + d.open_incidents.length + " of " + d.open_incidents_total]) : null;
    replace("incidents", el("div", {}, [el("table", {}, [el("thead", {}, [el("tr", {},
      ["#", "When", "Severity", "Kind", "Worker / pool", "Pages", "Requests", "Detected by", "State"].map(function (h) { return el("th", {}, [h]); }))]),
      el("tbody", {}, rows)]), more]));
  }


  // --- history: time series from /api/history/ (inline SVG line charts, one point marker per sample) ----------
  var PALETTE = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#57606a", "#e16f24", "#0a7a8a"];
  function compact(v) {
    if (v === null || v === undefined) return "–";
    var a = Math.abs(v);
    return a >= 1e6 ? (v / 1e6).toFixed(1) + "M" : a >= 1e4 ? (v / 1e3).toFixed(0) + "k" : a >= 100 ? v.toFixed(0) :
      a >= 1 ? v.toFixed(1) : a === 0 ? "0" : v.toPrecision(2);
  }
  function lineChart(key, title, unit, series, h) {
    var W = 330, H = 140, L = 42, R = 8, T = 8, B = 20, now = h.now, win = h.window_s;
    var values = [];
    series.forEach(function (s) { s.points.forEach(function (p) { if (p[1] !== null && p[1] !== undefined) values.push(p[1]); }); });
    var max = Math.max.apply(null, values.concat([0])) || 1;
    var x = function (ts) { return L + (W - L - R) * (1 - (now - ts) / win); };
    var y = function (v) { return T + (H - T - B) * (1 - v / (max * 1.1)); };
    var chart = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": title });
    [0, 0.5, 1].forEach(function (f) {
      chart.appendChild(svg("line", { x1: L, x2: W - R, y1: y(max * f), y2: y(max * f), stroke: "#e1e4e8" }));
      chart.appendChild(svg("text", { x: L - 4, y: y(max * f) + 3, "text-anchor": "end", "font-size": 9, fill: "#666" }, compact(max * f)));
    });
    [1, 0.5, 0].forEach(function (f) {
      var t = now - win * f, label = f === 0 ? "now" : "-" + (win * f >= 3600 ? (win * f / 3600) + " h" : (win * f / 60) + " min");
      chart.appendChild(svg("text", { x: x(t), y: H - 6, "text-anchor": f === 1 ? "start" : f === 0 ? "end" : "middle", "font-size": 9, fill: "#666" }, label));
    });
    var drawn = 0;
    series.forEach(function (s, i) {
      var color = s.color || PALETTE[i % PALETTE.length], run = [];
      var g = svg("g", { "class": "series", "data-series": s.name });
      function flush() {
        if (run.length > 1) g.appendChild(svg("polyline", { points: run.join(" "), fill: "none", stroke: color, "stroke-width": 1.5 }));
        run = [];
      }
      s.points.forEach(function (p) {
        if (p[1] === null || p[1] === undefined) { flush(); return; }  // no value: a gap, never a zero
        var px = x(p[0]).toFixed(1), py = y(p[1]).toFixed(1);
        run.push(px + "," + py);
        g.appendChild(svg("circle", { "class": "pt", cx: px, cy: py, r: 1.6, fill: color, "data-ts": p[0], "data-value": p[1] },
          undefined)).appendChild(svg("title", {}, s.name + ": " + compact(p[1]) + unit + " at " + new Date(p[0] * 1000).toLocaleTimeString()));
        drawn += 1;
      });
      flush();
      chart.appendChild(g);
    });
    var legend = el("div", { "class": "legend" }, series.map(function (s, i) {
      var last = null;
      s.points.forEach(function (p) { if (p[1] !== null && p[1] !== undefined) last = p[1]; });
      return el("span", { "class": "legend-item" }, [el("span", { "class": "swatch", style: "background:" + (s.color || PALETTE[i % PALETTE.length]) }),
        s.name + " " + compact(last) + unit]);
    }));
    return el("div", { "class": "chart", "data-chart": key, "data-points": drawn }, [el("h3", {}, [title]), chart,
      series.length ? legend : el("p", { "class": "empty" }, ["no samples in this window"])]);
  }
  function historyCharts(h) {
    var svc = h.service, col = function (name, scale) {
      return svc.map(function (s) { return [s.ts, s[name] === null || s[name] === undefined ? null : s[name] * (scale || 1)]; });
    };
    var codes = {};
    svc.forEach(function (s) { Object.keys(s.errors || {}).forEach(function (c) { codes[c] = (codes[c] || 0) + s.errors[c]; }); });
    var top = Object.keys(codes).sort(function (a, b) { return codes[b] - codes[a]; }).slice(0, 5);
    var errors = [{ name: "all codes", color: "#cf222e", points: svc.map(function (s) {
      return [s.ts, s.interval_s === null ? null : Object.keys(s.errors || {}).reduce(function (n, c) { return n + s.errors[c]; }, 0)]; }) }]
      .concat(top.map(function (c, i) { return { name: c, color: PALETTE[(i + 2) % PALETTE.length], points: svc.map(function (s) {
        return [s.ts, s.interval_s === null ? null : (s.errors || {})[c] || 0]; }) }; }));
    var pools = Object.keys(h.pools).map(function (id) {
      return { name: id, points: h.pools[id].map(function (p) { var t = p[1] + p[2] + p[3]; return [p[0], t ? 100 * p[1] / t : 0]; }) };
    });
    return [
      lineChart("throughput", "Throughput (generated tokens/s)", "", [{ name: "tokens/s", points: col("tokens_per_s") }], h),
      lineChart("ttft", "Time to first token (s)", " s", [{ name: "p50", points: col("ttft_p50_s") },
        { name: "p99", color: "#cf222e", points: col("ttft_p99_s") }], h),
      lineChart("errors", "Failed requests per sample, by code", "", errors, h),
      lineChart("refused", "429s per sample (fair share, throttle)", "", [{ name: "429s", color: "#bf8700", points: col("refused_429") }], h),
      lineChart("queue", "Queue depth", "", [{ name: "tasks in the broker", points: col("queue_tasks") },
        { name: "waiting for pages", color: "#8250df", points: col("waiting") }], h),
      lineChart("preemptions", "Preemptions per sample", "", [{ name: "preemptions", color: "#e16f24", points: col("preemptions") }], h),
      lineChart("prefix-cache", "Prefix-cache hit rate (%)", " %", [{ name: "hit rate", color: "#1a7f37", points: col("prefix_cache_hit_rate", 100) }], h),
      lineChart("pools", "Pool utilization (% of pages used)", " %", pools, h),
    ];
  }
  function renderHistory(h) {
    document.getElementById("history-charts").replaceChildren.apply(document.getElementById("history-charts"), historyCharts(h));
    var hint = document.getElementById("history-hint");
    hint.textContent = h.service.length + " samples in this window · one every " + h.sample_every_s + " s, kept " +
      (h.retention_s / 3600) + " h · sampled by celery beat whether or not anyone watches";
    root.dataset.historyAt = String(h.now);
  }
  function pollHistory() {
    var win = document.getElementById("history-window").value;
    getJson(root.dataset.historyApi + "?window=" + encodeURIComponent(win)).then(renderHistory).catch(function (e) {
      document.getElementById("history-hint").textContent = "history unavailable (" + e.message + ")";
    });
  }

  // --- usage per tenant (/api/usage/) ----------------------------------------------------------------
  function renderUsage(u) {
    if (!u.tenants.length) { replace("usage-table", el("p", { "class": "empty" }, ["No usage in this period."])); return; }
    var head = ["Tenant", "Requests", "Completed", "Prompt tokens", "Completion tokens", "Cached tokens", "Cache hit rate",
      "429s", "Failed", "Failures by code"];
    var rows = u.tenants.map(function (t) {
      var codes = Object.keys(t.failures).map(function (c) { return c + ": " + t.failures[c]; }).join(", ");
      return el("tr", { "class": "usage-row", "data-tenant": t.tenant_id }, [el("td", { "class": "tenant" }, [t.label])].concat(
        [t.requests, t.completed, t.prompt_tokens, t.completion_tokens, t.cached_tokens].map(function (n) { return el("td", { "class": "num" }, [fmt(n)]); }),
        [el("td", { "class": "num" }, [pct(t.cache_hit_rate)]), el("td", { "class": "num refused" }, [fmt(t.refused_429)]),
         el("td", { "class": "num failed" }, [fmt(t.failed)]), el("td", {}, [codes || "–"])]));
    });
    replace("usage-table", el("table", { "class": "usage" }, [el("thead", {}, [el("tr", {}, head.map(function (h, i) {
      return el("th", { "class": i ? "num" : "" }, [h]); }))]), el("tbody", {}, rows)]));
  }
  function pollUsage() {
    var seconds = Number(document.getElementById("usage-period").value);
    var to = new Date(Math.ceil(Date.now() / 3600000) * 3600000), from = new Date(to.getTime() - seconds * 1000);
    var query = "?from=" + encodeURIComponent(from.toISOString()) + "&to=" + encodeURIComponent(to.toISOString());
    document.getElementById("usage-csv").setAttribute("href", root.dataset.usageCsv + query);
    getJson(root.dataset.usageApi + query).then(renderUsage).catch(function (e) {
      replace("usage-table", el("p", { "class": "fault" }, ["usage unavailable (" + e.message + ")"]));
    });
  }
  function getJson(url) {
    return fetch(url, { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } })
      .then(function (r) {
        if (!r.ok) throw new Error(r.status === 403 ? "session expired: log in again" : "HTTP " + r.status);
        return r.json();
      });
  }

  // --- refresh loop -----------------------------------------------------------------------------
  function render(d) {
    renderSummary(d); renderChart(d); renderWorkers(d); renderPageMaps(d); renderCanary(d); renderIncidents(d);
    var status = document.getElementById("status-line");
    status.className = d.error ? "status stale" : "status";
    status.textContent = d.error ? d.error : "live · updated " + new Date(d.generated_at * 1000).toLocaleTimeString() +
      " · refreshes every " + (Number(root.dataset.refreshMs) / 1000) + " s";
    root.dataset.generatedAt = String(d.generated_at);
  }
  function poll() {
    fetch(root.dataset.api, { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } })
      .then(function (r) {
        if (!r.ok) throw new Error(r.status === 403 ? "session expired: log in again" : "HTTP " + r.status);
        return r.json();
      })
      .then(render)
      .catch(function (e) {
        var status = document.getElementById("status-line");
        status.className = "status stale";
        status.textContent = "stale: refresh failed (" + e.message + "); showing the last data";
      });
  }
  document.addEventListener("DOMContentLoaded", function () {
    root = document.getElementById("dashboard");
    render(JSON.parse(document.getElementById("dashboard-data").textContent));
    setInterval(poll, Number(root.dataset.refreshMs) || 3000);
    document.getElementById("history-window").addEventListener("change", pollHistory);
    document.getElementById("usage-period").addEventListener("change", pollUsage);
    pollHistory(); pollUsage();
    setInterval(function () { pollHistory(); pollUsage(); }, Number(root.dataset.historyRefreshMs) || 15000);
  });
})();
