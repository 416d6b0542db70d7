/* memviz HTML report: draws the JSON data embedded in the page (class memviz-data).
 * Plain JavaScript and SVG; no network, no libraries. Every text from the
 * data goes through textContent or setAttribute, never innerHTML. */
(function () {
  'use strict';
  // The data element sits just before this script and the page's root just
  // before that, so several reports can share one document (a notebook).
  var dataEl = document.currentScript.previousElementSibling;
  var root = dataEl.previousElementSibling;
  var D = JSON.parse(dataEl.textContent);
  var NS = 'http://www.w3.org/2000/svg';
  var main = root.querySelector('.mvz-main');
  var STEP_COLORS = {'torch allocated': '#e15759', 'torch reserved': '#f28e2c', 'device total': '#59a14f',
    'device memory (memviz) at step ends': '#1f3f6b'};
  var CATEGORY_COLORS = ['#76b7b2', '#af7aa1', '#b6992d', '#9c755f', '#ff9da7', '#6a9f58', '#d37295',
    '#8cd17d', '#a0cbe8', '#79706e'];

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) { e.setAttribute(k, attrs[k]); }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }
  function sv(tag, attrs, text) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs || {}) { e.setAttribute(k, attrs[k]); }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }
  function fmtBytes(n) {
    if (n === null || n === undefined) { return ''; }
    var units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'], v = Math.abs(n), i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    // Three significant digits at most, trailing zeros after the point dropped.
    var s = i === 0 || v >= 100 ? String(Math.round(v)) : v.toPrecision(3);
    if (s.indexOf('.') >= 0) { s = s.replace(/0+$/, '').replace(/\.$/, ''); }
    return (n < 0 ? '-' : '') + s + ' ' + units[i];
  }
  function fmtTime(us) {
    if (us === null || us === undefined) { return ''; }
    var s = us / 1e6;
    if (Math.abs(s) >= 100) { return s.toFixed(1) + ' s'; }
    if (Math.abs(s) >= 1) { return s.toFixed(3) + ' s'; }
    return (us / 1000).toFixed(2) + ' ms';
  }
  // A time axis label: as fmtTime, with as many decimals as the range shown needs to tell ticks apart.
  function fmtTick(us, span) {
    if (Math.abs(us) < 1e6 || span >= 6e6) { return fmtTime(us); }
    var digits = Math.min(6, Math.max(3, Math.ceil(-Math.log10(span / 6 / 1e6)) + 1));
    return (us / 1e6).toFixed(Math.abs(us) >= 1e8 ? Math.max(digits, 1) : digits) + ' s';
  }
  function fmtInt(n) { return n === null || n === undefined ? '' : Number(n).toLocaleString('en-US'); }
  function bisect(a, x) { var lo = 0, hi = a.length; while (lo < hi) { var m = (lo + hi) >> 1; if (a[m] <= x) { lo = m + 1; } else { hi = m; } } return lo; }
  function hash(s) { var h = 0; for (var i = 0; i < s.length; i++) { h = ((h << 5) - h + s.charCodeAt(i)) | 0; } return Math.abs(h); }
  function basename(p) { var i = p.lastIndexOf('/'); return i >= 0 ? p.slice(i + 1) : p; }

  var tip = el('div', {'class': 'mvz-tip'});
  root.appendChild(tip);
  function showTip(text, ev) {
    tip.textContent = text; tip.style.display = 'block';
    var x = ev.clientX + 14, y = ev.clientY + 14, r = tip.getBoundingClientRect();
    if (x + r.width > window.innerWidth - 8) { x = Math.max(4, ev.clientX - r.width - 14); }
    if (y + r.height > window.innerHeight - 8) { y = Math.max(4, ev.clientY - r.height - 14); }
    tip.style.left = x + 'px'; tip.style.top = y + 'px';
  }
  function hideTip() { tip.style.display = 'none'; }
  function section(title, id) {
    var s = el('section', {id: id}); s.appendChild(el('h2', {}, title)); main.appendChild(s); return s;
  }

  /* ---- summary ---------------------------------------------------------- */
  function summary() {
    var m = D.meta, s = section('Summary', 'mvz-summary'), parts = [];
    parts.push('tracked for ' + m.duration_s + ' s' + (m.running ? ' (still running)' : ''));
    parts.push(m.gpu_enabled ? 'GPU capture on' + (m.library ? ' (' + m.library + ')' : '')
      : 'GPU capture off' + (m.gpu_off_reason ? ': ' + m.gpu_off_reason : ''));
    if (m.depth) { parts.push('up to ' + m.depth + ' frames per allocation'); }
    if (m.pytorch) {
      parts.push('PyTorch memory seen through: ' + m.pytorch.route +
        (m.pytorch.reason ? ' (' + m.pytorch.reason + ')' : ''));
    }
    if (m.capture) { parts.push('capture: ' + m.capture); }
    parts.push('generated ' + m.generated);
    if (m.sample) {
      s.appendChild(el('p', {'class': 'warn sample'}, 'This is a SAMPLE: ' + m.sample.sentence + ' (recorded on ' +
        m.sample.date + ', running ' + m.sample.script + ').'));
    }
    s.appendChild(el('p', {'class': 'sub'}, parts.join(' \u00b7 ')));
    if (m.dropped) {
      s.appendChild(el('p', {'class': 'warn'}, 'memviz\u2019s store was full: ' + fmtInt(m.dropped) +
        ' allocations or stacks were not recorded, so the numbers here are too low.'));
    }
    if (!D.devices.length) {
      s.appendChild(el('p', {'class': 'note'}, 'No GPU allocation was recorded.')); return;
    }
    table(s, {columns: [{key: 'device', type: 'text'}, {key: 'current', type: 'bytes'},
      {key: 'peak', type: 'bytes'}, {key: 'peak at', type: 'time'}, {key: 'allocs', type: 'int'},
      {key: 'frees', type: 'int'}, {key: 'failed', type: 'int'}],
    rows: D.devices.map(function (d) { return [d.name, d.current, d.peak, d.peak_t, d.allocs, d.frees, d.failed]; }),
    more: 0}, {sortable: false, narrow: true});
    // What the driver says the process held, beside memviz's record (the section below has the split).
    ((D.outside && D.outside.devices) || []).forEach(function (d) {
      var p = el('p', {'class': 'note outside-summary', 'data-device': d.device, 'data-held': d.held,
        'data-recorded': d.recorded, 'data-beyond': d.beyond});
      p.appendChild(document.createTextNode(d.name + ': the process held ' + fmtBytes(d.held) + ' (' + d.source +
        ') when tracking stopped; memviz recorded ' + fmtBytes(d.recorded) + ' of it: '));
      p.appendChild(el('b', {}, fmtBytes(d.beyond) + ' beyond its record'));
      p.appendChild(document.createTextNode(' (see \u201cMemory beyond memviz\u2019s record\u201d).'));
      s.appendChild(p);
    });
  }

  /* ---- timeline ----------------------------------------------------------- */
  // The time range the charts open on (where memory moves, or the steps), null: the whole run.
  var opening = D.timeline.window ? [D.timeline.window.start, D.timeline.window.end] : null;
  var view = opening, hidden = {}, chartBoxes = [], dragging = null;
  // A chart's plot is as tall as what it holds against the device that holds the most (never under PH_MIN).
  var PH_FULL = 176, PH_MIN = 40;
  var heldMost = Math.max.apply(null, [1].concat(D.timeline.charts.map(function (c) { return c.held || 0; })));
  function plotHeight(held) { return Math.round(PH_MIN + (PH_FULL - PH_MIN) * Math.max(held || 0, 0) / heldMost); }
  window.addEventListener('mouseup', function (ev) { if (dragging) { dragging(ev); } });
  function seriesColor(s, i) {
    if (s.kind === 'total') { return '#4e79a7'; }
    if (s.kind === 'tensors') { return '#e15759'; }
    if (s.kind === 'step') { return STEP_COLORS[s.name.replace(/ \(all devices\)$/, '')] || '#555'; }
    return CATEGORY_COLORS[categoryIndex(s.name) % CATEGORY_COLORS.length];
  }
  var categoryOrder = {};
  function categoryIndex(name) {
    if (!(name in categoryOrder)) { categoryOrder[name] = Object.keys(categoryOrder).length; }
    return categoryOrder[name];
  }
  function niceMax(v) {
    if (v <= 0) { return 1; }
    var p = Math.pow(1024, Math.floor(Math.log(v) / Math.log(1024))), x = v / p;
    var steps = [1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12.5, 15, 20, 25, 30, 40, 50, 60, 80, 100,
      125, 150, 200, 250, 300, 400, 500, 600, 800, 1000, 1024];
    for (var i = 0; i < steps.length; i++) { if (steps[i] >= x) { return steps[i] * p; } }
    return 1024 * p;
  }
  function valueAt(s, t) { var i = bisect(s.t, t) - 1; return i >= 0 ? s.v[i] : null; }
  function drawChart(ch, box) {
    box.textContent = '';
    var W = Math.max(box.clientWidth || 0, 420), ml = 70, mr = 14, mt = 10, mb = 24;
    var ph = plotHeight(ch.held), H = ph + mt + mb, pw = W - ml - mr, yticks = ph < 60 ? 1 : ph < 90 ? 2 : 4;
    var x0 = view ? view[0] : 0, x1 = view ? view[1] : Math.max(D.timeline.end || 0, 1);
    if (x1 <= x0) { x1 = x0 + 1; }
    var ymax = 0;
    ch.series.forEach(function (s) {
      if (hidden[s.name]) { return; }
      var lo = Math.max(bisect(s.t, x0) - 1, 0), hi = Math.min(bisect(s.t, x1), s.v.length - 1);
      for (var i = lo; i <= hi; i++) { if (s.v[i] > ymax) { ymax = s.v[i]; } }
    });
    if (ch.peak && ch.peak.t !== null && ch.peak.t >= x0 && ch.peak.t <= x1) { ymax = Math.max(ymax, ch.peak.v); }
    ymax = niceMax(ymax * 1.04);
    function X(t) { return ml + (t - x0) / (x1 - x0) * pw; }
    function Y(v) { return mt + ph - v / ymax * ph; }
    var svg = sv('svg', {width: W, height: H, 'class': 'timeline', 'data-device': ch.device, 'data-held': ch.held,
      'data-start': x0, 'data-end': x1});
    var axis = sv('g', {'class': 'axis'});
    for (var k = 0; k <= yticks; k++) {
      var yv = ymax * k / yticks, yy = Y(yv);
      axis.appendChild(sv('line', {x1: ml, x2: ml + pw, y1: yy, y2: yy, 'class': 'grid'}));
      axis.appendChild(sv('text', {x: ml - 6, y: yy + 4, 'text-anchor': 'end', 'class': 'ytick'}, fmtBytes(yv)));
    }
    for (k = 0; k <= 6; k++) {
      var tv = x0 + (x1 - x0) * k / 6;
      axis.appendChild(sv('text', {x: X(tv), y: H - 6, 'class': 'xtick', 'data-t': Math.round(tv),
        'text-anchor': k === 0 ? 'start' : k === 6 ? 'end' : 'middle'}, fmtTick(tv, x1 - x0)));
    }
    svg.appendChild(axis);
    var clipId = 'clip' + ch.device + '_' + Math.random().toString(36).slice(2);
    var clip = sv('clipPath', {id: clipId});
    clip.appendChild(sv('rect', {x: ml, y: mt - 2, width: pw, height: ph + 4}));
    svg.appendChild(clip);
    var plot = sv('g', {'clip-path': 'url(#' + clipId + ')'});
    ch.series.forEach(function (s, i) {
      if (hidden[s.name] || !s.t.length) { return; }
      var lo = Math.max(bisect(s.t, x0) - 1, 0), hi = Math.min(bisect(s.t, x1), s.t.length - 1);
      var color = seriesColor(s, i), d = [], prev = null;
      for (var j = lo; j <= hi; j++) {
        var x = X(s.t[j]).toFixed(1), y = Y(s.v[j]).toFixed(1);
        if (prev === null) { d.push('M' + x + ' ' + y); } else if (s.kind === 'step') { d.push('L' + x + ' ' + y); } else { d.push('L' + x + ' ' + prev + 'L' + x + ' ' + y); }
        prev = y;
      }
      if (s.kind === 'total') {
        var area = d.join('') + 'L' + X(s.t[hi]).toFixed(1) + ' ' + Y(0) + 'L' + X(s.t[lo]).toFixed(1) + ' ' + Y(0) + 'Z';
        plot.appendChild(sv('path', {d: area, fill: color, 'fill-opacity': 0.25, stroke: 'none', 'class': 'area'}));
      }
      plot.appendChild(sv('path', {d: d.join(''), fill: 'none', stroke: color, 'stroke-width': s.kind === 'total' ? 1.6 : 1.3,
        'stroke-dasharray': s.kind === 'tensors' ? '5 3' : 'none', 'class': 'series', 'data-name': s.name}));
      if (s.kind === 'step' && hi - lo < 400) {
        for (j = lo; j <= hi; j++) { plot.appendChild(sv('circle', {cx: X(s.t[j]), cy: Y(s.v[j]), r: 2.2, fill: color})); }
      }
    });
    svg.appendChild(plot);
    if (ch.peak && ch.peak.t !== null && ch.peak.t >= x0 && ch.peak.t <= x1 && ch.peak.v > 0) {
      var px = X(ch.peak.t), py = Y(ch.peak.v);
      svg.appendChild(sv('line', {x1: px, x2: px, y1: mt, y2: mt + ph, stroke: '#c0392b', 'stroke-dasharray': '3 3', 'class': 'peak-line'}));
      svg.appendChild(sv('circle', {cx: px, cy: py, r: 4, fill: '#c0392b', 'class': 'peak'}));
      var right = px > ml + pw * 0.75;
      svg.appendChild(sv('text', {x: px + (right ? -6 : 6), y: Math.max(py - 6, mt + 10), 'text-anchor': right ? 'end' : 'start',
        fill: '#c0392b', style: 'fill:#c0392b;font-weight:600'}, 'peak ' + fmtBytes(ch.peak.v) + ' at ' + fmtTime(ch.peak.t)));
    }
    var cursor = sv('line', {y1: mt, y2: mt + ph, stroke: '#888', visibility: 'hidden'});
    var sel = sv('rect', {y: mt, height: ph, 'class': 'sel', visibility: 'hidden'});
    var overlay = sv('rect', {x: ml, y: mt, width: pw, height: ph, fill: 'transparent', 'class': 'overlay', style: 'cursor: crosshair'});
    svg.appendChild(cursor); svg.appendChild(sel); svg.appendChild(overlay);
    var drag = null;
    function tAt(ev) { var r = svg.getBoundingClientRect(); var x = Math.min(Math.max(ev.clientX - r.left, ml), ml + pw); return {x: x, t: x0 + (x - ml) / pw * (x1 - x0)}; }
    function finish(ev) {
      var p = tAt(ev), a = drag; drag = null; dragging = null; sel.setAttribute('visibility', 'hidden');
      if (a && Math.abs(p.x - a.x) >= 4) { view = [Math.min(a.t, p.t), Math.max(a.t, p.t)]; drawTimeline(); }
    }
    overlay.addEventListener('mousedown', function (ev) { ev.preventDefault(); drag = tAt(ev); dragging = finish; sel.setAttribute('x', drag.x); sel.setAttribute('width', 0); sel.setAttribute('visibility', 'visible'); });
    overlay.addEventListener('mousemove', function (ev) {
      var p = tAt(ev);
      if (drag) { sel.setAttribute('x', Math.min(drag.x, p.x)); sel.setAttribute('width', Math.abs(p.x - drag.x)); }
      cursor.setAttribute('x1', p.x); cursor.setAttribute('x2', p.x); cursor.setAttribute('visibility', 'visible');
      var lines = [ch.name + ' at ' + fmtTime(p.t)];
      ch.series.forEach(function (s) { if (!hidden[s.name]) { var v = valueAt(s, p.t); if (v !== null) { lines.push(s.name + ': ' + fmtBytes(v)); } } });
      showTip(lines.join('\n'), ev);
    });
    overlay.addEventListener('mouseleave', function () { cursor.setAttribute('visibility', 'hidden'); hideTip(); });
    overlay.addEventListener('dblclick', function () { view = opening; drawTimeline(); });
    box.appendChild(svg);
  }
  var zoomNote, wholeButton;
  function sameView(a, b) { return a === b || (a && b && a[0] === b[0] && a[1] === b[1]); }
  function drawTimeline() {
    chartBoxes.forEach(function (cb) { drawChart(cb.chart, cb.box); });
    if (!zoomNote) { return; }
    var W = D.timeline.window, run = 'the run lasted ' + fmtTime(D.timeline.end);
    var what = W ? (W.why === 'steps' ? 'the steps' : 'where memory moves') : '';
    if (opening && sameView(view, opening)) {
      zoomNote.textContent = 'showing ' + fmtTime(view[0]) + ' \u2013 ' + fmtTime(view[1]) + ', ' + what + ' (' + run +
        '); drag across a chart to zoom into a time range, double-click to come back here. ';
    } else if (view) {
      zoomNote.textContent = 'showing ' + fmtTime(view[0]) + ' \u2013 ' + fmtTime(view[1]) + '; double-click a chart to show ' +
        (opening ? what : 'everything') + '. ';
    } else {
      zoomNote.textContent = 'showing the whole run (' + fmtTime(D.timeline.end) + '); drag across a chart to zoom into a time range' +
        (opening ? ', double-click to show ' + what + '. ' : ', double-click to reset.');
    }
    zoomNote.setAttribute('data-view', view ? 'range' : 'whole');
    if (opening) {
      wholeButton.textContent = view ? 'show the whole run' : 'show ' + what;
      zoomNote.appendChild(wholeButton);
    }
  }
  function timeline() {
    var s = section('Memory over time', 'mvz-timeline');
    zoomNote = el('p', {'class': 'hint'});
    wholeButton = el('button', {type: 'button', 'class': 'btn whole-run'});
    wholeButton.addEventListener('click', function () { view = view ? null : opening; drawTimeline(); });
    s.appendChild(zoomNote);
    if (D.timeline.category_note) { s.appendChild(el('p', {'class': 'note'}, 'By category: ' + D.timeline.category_note + '.')); }
    D.timeline.charts.forEach(function (ch) {
      var wrap = el('div', {'class': 'chart'}), title = el('div', {'class': 'chart-title'}, ch.name);
      var legend = el('span', {'class': 'legend'});
      ch.series.forEach(function (se, i) {
        var item = el('span', {title: 'click to show or hide' + (se.note ? '; ' + se.note : '')});
        var sw = el('i'); sw.style.background = seriesColor(se, i);
        item.appendChild(sw); item.appendChild(document.createTextNode(se.name));
        if (hidden[se.name]) { item.className = 'off'; }
        item.addEventListener('click', function () { hidden[se.name] = !hidden[se.name]; item.className = hidden[se.name] ? 'off' : ''; drawTimeline(); });
        legend.appendChild(item);
      });
      title.appendChild(legend); wrap.appendChild(title);
      var box = el('div'); wrap.appendChild(box);
      // The lines' values at the peak and at the end, from the drawn series.
      [['at the peak', ch.peak && ch.peak.t], ['at the end', D.timeline.end]].forEach(function (w) {
        if (w[1] === null || w[1] === undefined) { return; }
        var row = el('p', {'class': 'note values', 'data-when': w[0]});
        row.appendChild(document.createTextNode(w[0] + ': '));
        var exact = w[0] === 'at the peak' && ch.peak.values ? ch.peak.values : {};
        ch.series.forEach(function (se) {
          if (se.kind === 'step') { return; }
          var v = se.name in exact ? exact[se.name] : valueAt(se, w[1]);
          if (v === null) { return; }
          if (row.children.length) { row.appendChild(document.createTextNode(' \u00b7 ')); }
          row.appendChild(el('span', {'data-name': se.name, 'data-bytes': v}, se.name + ' ' + fmtBytes(v)));
        });
        wrap.appendChild(row);
      });
      if (ch.recorded_categories) {
        wrap.appendChild(el('p', {'class': 'note'}, 'This trace keeps no category per allocation (an older memviz wrote it), so ' +
          'its lines say <unknown>; its tracker recorded at the peak: ' + Object.keys(ch.recorded_categories).map(function (k) {
            return k + ' ' + fmtBytes(ch.recorded_categories[k]); }).join(' \u00b7 ') + '.'));
      }
      s.appendChild(wrap);
      chartBoxes.push({chart: ch, box: box});
    });
    if (D.timeline.charts.some(function (ch) { return ch.series.some(function (se) { return se.kind === 'tensors'; }); })) {
      s.appendChild(el('p', {'class': 'note'}, 'Device memory is memviz\u2019s record: PyTorch\u2019s segments and the memory ' +
        'outside PyTorch, each byte once. PyTorch tensors (dashed) lie inside those segments, never added to them; ' +
        'the categories add up to the device memory.'));
    }
    if (!D.timeline.charts.length) { s.appendChild(el('p', {'class': 'note'}, 'No memory was recorded over time.')); }
    drawTimeline();
  }

  /* ---- flame graph (icicle) ----------------------------------------------- */
  var flameIdx = 0, flamePath = [], flameBox, flameNote;
  function nodeName(n) { var e = D.names[n[0]]; return e[1] ? e[0] + ' (' + basename(e[1]) + ':' + e[2] + ')' : e[0]; }
  function nodeColor(n) {
    var e = D.names[n[0]];
    if (!e[1]) { return e[0] === 'all' ? '#c9d3e0' : '#b9b3d6'; }
    var h = hash(e[1]);
    return 'hsl(' + (10 + h % 45) + ',' + (62 + h % 20) + '%,' + (62 + (hash(e[0]) % 14)) + '%)';
  }
  function drawFlame() {
    flameBox.textContent = '';
    var f = D.flames[flameIdx]; if (!f) { return; }
    if (flameNote) {
      var ls = f.launchers || [];
      flameNote.textContent = ls.length ? 'Each stack starts at the script: the frames of what ran it (' + ls.join(', ') +
        ') are left out.' : '';
    }
    var root = f.tree, focus = flamePath.length ? flamePath[flamePath.length - 1] : root;
    var W = Math.max(flameBox.clientWidth || 0, 420), RH = 18;
    function depth(n) { var d = 0; (n[3] || []).forEach(function (c) { d = Math.max(d, depth(c)); }); return d + 1; }
    var rows = flamePath.length + depth(focus);
    var svg = sv('svg', {width: W, height: rows * RH + 2, 'class': 'flame'});
    var total = root[1] || 1;
    function rect(n, x, w, row, onclick) {
      var g = sv('g');
      var r = sv('rect', {x: x.toFixed(2), y: row * RH, width: Math.max(w - 0.5, 0.5).toFixed(2), height: RH - 1, fill: nodeColor(n), rx: 1.5});
      g.appendChild(r);
      if (w > 36) {
        var label = nodeName(n), maxc = Math.floor((w - 6) / 6.3);
        if (label.length > maxc) { label = label.slice(0, Math.max(maxc - 1, 1)) + '\u2026'; }
        g.appendChild(sv('text', {x: x + 3, y: row * RH + 12.5}, label));
      }
      g.addEventListener('mousemove', function (ev) {
        var e = D.names[n[0]], where = e[1] ? '\n' + e[1] + ':' + e[2] : '';
        showTip(e[0] + where + '\n' + fmtBytes(n[1]) + ' (' + (100 * n[1] / total).toFixed(1) + '% of ' + f.name + ' at its peak) in ' + fmtInt(n[2]) + ' allocation' + (n[2] === 1 ? '' : 's'), ev);
      });
      g.addEventListener('mouseleave', hideTip);
      g.addEventListener('click', onclick);
      svg.appendChild(g);
    }
    var chain = [root].concat(flamePath.slice(0, -1));
    if (flamePath.length) {
      chain.forEach(function (n, i) { rect(n, 0, W, i, function () { flamePath = flamePath.slice(0, i); drawFlame(); }); });
    }
    var base = flamePath.length;
    function draw(n, x, w, row, path) {
      rect(n, x, w, row, function (ev) { ev.stopPropagation(); if (n === focus) { flamePath = flamePath.slice(0, -1); } else { flamePath = path; } drawFlame(); });
      var cx = x, kids = n[3] || [];
      for (var i = 0; i < kids.length; i++) {
        var cw = n[1] ? w * kids[i][1] / n[1] : 0;
        if (cw >= 0.5) { draw(kids[i], cx, cw, row + 1, path.concat([kids[i]])); }
        cx += cw;
      }
    }
    draw(focus, 0, W, base, flamePath.slice());
    svg.addEventListener('dblclick', function () { flamePath = []; drawFlame(); });
    flameBox.appendChild(svg);
  }
  function flame() {
    var s = section('Live memory at the peak, by stack', 'mvz-flame');
    if (!D.flames.length) { s.appendChild(el('p', {'class': 'note'}, 'Nothing was live at the peak.')); return; }
    s.appendChild(el('p', {'class': 'hint'}, 'Outermost frame on top, the allocating frame at the bottom; width is bytes live at the device\u2019s peak. Click a frame to zoom in, click it again or double-click to zoom out.'));
    flameNote = el('p', {'class': 'note launchers'}); s.appendChild(flameNote);
    var tabs = el('div', {'class': 'tabs'});
    D.flames.forEach(function (f, i) {
      var b = el('button', {type: 'button', 'class': i === 0 ? 'on' : ''}, f.name + ' (' + fmtBytes(f.tree[1]) + ')');
      b.addEventListener('click', function () { flameIdx = i; flamePath = []; Array.prototype.forEach.call(tabs.children, function (c) { c.className = ''; }); b.className = 'on'; drawFlame(); });
      tabs.appendChild(b);
    });
    if (D.flames.length > 1) { s.appendChild(tabs); }
    flameBox = el('div'); s.appendChild(flameBox);
    drawFlame();
  }

  /* ---- tables ------------------------------------------------------------- */
  function cell(v, type) {
    var td = el('td');
    if (type === 'bytes') { td.className = 'num'; td.textContent = fmtBytes(v); if (v !== null && v !== undefined) { td.title = fmtInt(v) + ' bytes'; } } else if (type === 'int' || type === 'num') { td.className = 'num'; td.textContent = typeof v === 'number' ? fmtInt(v) : (v === null ? '' : String(v)); } else if (type === 'pct') { td.className = 'num bar'; td.textContent = Number(v).toFixed(1) + '%'; td.style.backgroundSize = Math.min(Math.max(v, 0), 100) + '% 100%'; } else if (type === 'time') { td.className = 'num'; td.textContent = fmtTime(v); } else if (type === 'code') { td.className = 'code'; if (v) { td.appendChild(el('code', {}, v)); td.title = v; } } else { td.className = 'wrap'; td.textContent = v === null || v === undefined ? '' : String(v); }
    return td;
  }
  function table(parent, spec, opts) {
    opts = opts || {};
    var wrap = el('div', {'class': opts.narrow ? '' : 'scroll'}), state = {col: -1, dir: 0, filter: ''};
    var t = el('table', {'class': opts.narrow ? 'mvz-table narrow' : 'mvz-table'}), thead = el('thead'), tbody = el('tbody'), tr = el('tr');
    spec.columns.forEach(function (c, i) {
      var th = el('th', {'data-col': i}, c.key);
      if (opts.sortable !== false) {
        th.className = 'sortable'; th.title = 'click to sort';
        th.addEventListener('click', function () {
          var text = c.type === 'text' || c.type === 'code';
          if (state.col === i) { state.dir = -state.dir; } else { state.col = i; state.dir = text ? 1 : -1; }
          Array.prototype.forEach.call(tr.children, function (h) { h.removeAttribute('aria-sort'); });
          th.setAttribute('aria-sort', state.dir > 0 ? 'ascending' : 'descending');
          fill();
        });
      }
      tr.appendChild(th);
    });
    thead.appendChild(tr); t.appendChild(thead); t.appendChild(tbody);
    // Rows come sorted by size, largest first: say so, so the first click reverses it.
    spec.columns.forEach(function (c, i) {
      if (c.key === 'size' && opts.sortable !== false && state.col < 0) { state.col = i; state.dir = -1; tr.children[i].setAttribute('aria-sort', 'descending'); }
    });
    function fill() {
      tbody.textContent = '';
      var rows = spec.rows.slice(), f = state.filter.toLowerCase();
      if (f) { rows = rows.filter(function (r) { return r.some(function (v) { return v !== null && String(v).toLowerCase().indexOf(f) >= 0; }); }); }
      if (state.col >= 0) {
        var c = state.col, d = state.dir;
        rows.sort(function (a, b) {
          var x = a[c], y = b[c];
          if (x === y) { return 0; } if (x === null || x === undefined) { return 1; } if (y === null || y === undefined) { return -1; }
          if (typeof x === 'number' && typeof y === 'number') { return (x - y) * d; }
          return String(x).localeCompare(String(y), undefined, {numeric: true}) * d;
        });
      }
      rows.forEach(function (r) {
        var row = el('tr');
        if (spec.title_col !== undefined && r[spec.title_col]) { row.title = r[spec.title_col]; }
        spec.columns.forEach(function (col, i) { row.appendChild(cell(r[i], col.type)); });
        tbody.appendChild(row);
      });
      if (!rows.length) { var empty = el('tr'), td = el('td', {colspan: spec.columns.length, 'class': 'note'}, f ? 'no row matches' : 'nothing to show'); empty.appendChild(td); tbody.appendChild(empty); }
    }
    state.setFilter = function (v) { state.filter = v; fill(); };
    fill(); wrap.appendChild(t);
    parent.appendChild(wrap);
    if (spec.more) { parent.appendChild(el('p', {'class': 'note'}, '\u2026 and ' + fmtInt(spec.more) + ' more rows, not included in this report.')); }
    return state;
  }
  var TABLE_TITLES = {'lines': 'By line (at the peak)', 'lines at the tensor peak': 'By line (at the tensor peak)',
    'before tracking': 'Before tracking (by category)', 'autograd nodes': 'By autograd node', 'calls': 'By call', 'categories': 'By category',
    'labels': 'By label', 'threads': 'By thread', 'kinds': 'By kind', 'live at end': 'Live at the end (by line)'};
  function tables() {
    var s = section('Where the memory is', 'mvz-tables');
    s.appendChild(el('p', {'class': 'hint'}, 'Allocations live at each device\u2019s peak, grouped; click a column header to sort.'));
    var tabs = el('div', {'class': 'tabs'}), box = el('div'), current = null;
    var filter = el('input', {type: 'search', placeholder: 'filter rows', 'aria-label': 'filter rows'});
    Object.keys(D.tables).forEach(function (name, i) {
      var spec = D.tables[name];
      var b = el('button', {type: 'button', 'data-table': name}, (TABLE_TITLES[name] || name) + ' (' + (spec.rows.length + spec.more) + ')');
      b.addEventListener('click', function () {
        Array.prototype.forEach.call(tabs.querySelectorAll('button'), function (c) { c.className = ''; });
        b.className = 'on'; box.textContent = ''; current = table(box, spec); current.setFilter(filter.value);
      });
      tabs.appendChild(b);
      if (i === 0) { b.className = 'on'; current = table(box, spec); }
    });
    filter.addEventListener('input', function () { if (current) { current.setFilter(filter.value); } });
    tabs.appendChild(filter);
    s.appendChild(tabs); s.appendChild(box);
  }
  /* ---- steps: memory per step, the findings marked on their steps --------- */
  var STEP_PLOT_COLORS = {current: '#4e79a7', peak: '#9c755f', allocated: '#e15759', reserved: '#f28e2c',
    'device total': '#59a14f'};
  var STEP_PLOT_NAMES = {current: 'device memory (memviz) at the step\u2019s end', peak: 'device memory (memviz): the step\u2019s peak',
    allocated: 'torch allocated', reserved: 'torch reserved', 'device total': 'device total (as the step records give it)'};
  function stepHeld(dv) {
    var m = 0;
    Object.keys(dv.series).forEach(function (k) { dv.series[k].forEach(function (v) { if (v !== null && v > m) { m = v; } }); });
    return m;
  }
  var FINDING_COLORS = {growth: '#c0392b', fragmentation: '#8e44ad', spike: '#d35400', cache_churn: '#16a085',
    outside_pytorch: '#7f8c8d'};
  var stepBoxes = [];
  function findingColor(kind) { return FINDING_COLORS[kind] || '#b7791f'; }
  function rangesText(rs) {
    return rs.map(function (r) { return r[0] === r[1] ? 'step ' + r[0] : 'steps ' + r[0] + '\u2013' + r[1]; }).join(', ');
  }
  function drawStepPlot(dv, box) {
    box.textContent = '';
    var P = D.step_plot, xs = P.steps, n = xs.length;
    var most = Math.max.apply(null, [1].concat(P.devices.map(stepHeld)));
    var W = Math.max(box.clientWidth || 0, 420), ml = 70, mr = 14, mt = 18, mb = 24;
    var ph = Math.round(PH_MIN + (128 - PH_MIN) * stepHeld(dv) / most), H = ph + mt + mb, pw = W - ml - mr;
    var yticks = ph < 60 ? 1 : ph < 90 ? 2 : 4;
    var lo = Math.min.apply(null, xs), hi = Math.max.apply(null, xs), span = Math.max(hi - lo, 1);
    var half = n > 1 ? Math.max(pw / span / 2 * (P.bucket || 1), 1.5) : 8;
    function X(i) { return n > 1 ? ml + (i - lo) / span * pw : ml + pw / 2; }
    var names = Object.keys(dv.series), ymax = 0;
    names.forEach(function (k) { dv.series[k].forEach(function (v) { if (v !== null && v > ymax) { ymax = v; } }); });
    ymax = niceMax(ymax * 1.04);
    function Y(v) { return mt + ph - v / ymax * ph; }
    var svg = sv('svg', {width: W, height: H, 'class': 'step-plot', 'data-device': dv.device === null ? 'all' : dv.device,
      'data-held': stepHeld(dv)});
    var axis = sv('g', {'class': 'axis'});
    for (var k = 0; k <= yticks; k++) {
      var yv = ymax * k / yticks, yy = Y(yv);
      axis.appendChild(sv('line', {x1: ml, x2: ml + pw, y1: yy, y2: yy, 'class': 'grid'}));
      axis.appendChild(sv('text', {x: ml - 6, y: yy + 4, 'text-anchor': 'end'}, fmtBytes(yv)));
    }
    // Whole steps at an even spacing, the last step too when it is not next to one.
    var every = Math.max(1, Math.ceil(span / 6)), tvs = [];
    for (var tv = lo; tv <= hi && n > 1; tv += every) { tvs.push(tv); }
    if (n === 1) { tvs = [lo]; } else if (hi - tvs[tvs.length - 1] >= every / 2) { tvs.push(hi); }
    tvs.forEach(function (t, ti) {
      var anchor = n === 1 ? 'middle' : ti === 0 ? 'start' : X(t) > ml + pw - 24 ? 'end' : 'middle';
      axis.appendChild(sv('text', {x: X(t), y: H - 6, 'text-anchor': anchor}, 'step ' + t));
    });
    svg.appendChild(axis);
    (D.findings || []).forEach(function (f, fi) {
      if (!f.step_ranges || !f.step_ranges.length || (f.device !== null && f.device !== undefined && f.device !== dv.device)) { return; }
      var color = findingColor(f.kind), text = f.kind + ' (' + rangesText(f.step_ranges) + ')\n' + f.message;
      f.step_ranges.forEach(function (r) {
        var x0 = Math.max(X(r[0]) - half, ml), x1 = Math.min(X(r[1]) + half, ml + pw);
        var g = sv('g', {'class': 'finding-mark', 'data-kind': f.kind, 'data-finding': fi, 'data-first': r[0], 'data-last': r[1]});
        g.appendChild(sv('rect', {x: x0.toFixed(1), y: mt, width: Math.max(x1 - x0, 2).toFixed(1), height: ph, fill: color, 'fill-opacity': 0.13, stroke: color, 'stroke-opacity': 0.5}));
        g.appendChild(sv('text', {x: x0 + 3, y: mt - 5, fill: color, style: 'fill:' + color + ';font-weight:600'}, f.kind));
        g.style.cursor = 'pointer';
        g.addEventListener('mousemove', function (ev) { showTip(text, ev); });
        g.addEventListener('mouseleave', hideTip);
        g.addEventListener('click', function () { var c = document.getElementById('mvz-finding-' + fi); if (c) { c.scrollIntoView({block: 'center'}); } });
        svg.appendChild(g);
      });
    });
    names.forEach(function (name) {
      var vs = dv.series[name], d = [], color = STEP_PLOT_COLORS[name] || '#555', pen = false;
      for (var j = 0; j < n; j++) {
        if (vs[j] === null) { pen = false; continue; }
        d.push((pen ? 'L' : 'M') + X(xs[j]).toFixed(1) + ' ' + Y(vs[j]).toFixed(1)); pen = true;
      }
      if (n === 1 && vs[0] !== null) { d.push('L' + (X(xs[0]) + 0.1).toFixed(1) + ' ' + Y(vs[0]).toFixed(1)); }
      svg.appendChild(sv('path', {d: d.join(''), fill: 'none', stroke: color, 'stroke-width': 1.6,
        'stroke-dasharray': name === 'peak' ? '4 2' : 'none', 'class': 'step-series', 'data-name': name}));
      if (n <= 200) {
        for (j = 0; j < n; j++) { if (vs[j] !== null) { svg.appendChild(sv('circle', {cx: X(xs[j]), cy: Y(vs[j]), r: 2.2, fill: color, 'class': 'step-dot'})); } }
      }
    });
    box.appendChild(svg);
    svg.addEventListener('mousemove', function (ev) {
      if (ev.target.closest && ev.target.closest('.finding-mark')) { return; }
      var r = svg.getBoundingClientRect(), x = ev.clientX - r.left;
      if (x < ml || x > ml + pw) { hideTip(); return; }
      var best = 0;
      for (var j = 1; j < n; j++) { if (Math.abs(X(xs[j]) - x) < Math.abs(X(xs[best]) - x)) { best = j; } }
      var lines = [dv.name + ' step ' + xs[best] + (P.bucket > 1 ? ' (+' + (P.bucket - 1) + ' more, the highest shown)' : '')];
      names.forEach(function (name) { var v = dv.series[name][best]; if (v !== null) { lines.push(name + ': ' + fmtBytes(v)); } });
      showTip(lines.join('\n'), ev);
    });
    svg.addEventListener('mouseleave', hideTip);
  }
  function drawStepPlots() { stepBoxes.forEach(function (b) { drawStepPlot(b.dv, b.box); }); }
  function stepPlots(s) {
    var P = D.step_plot;
    if (!P || !P.steps.length) { return; }
    var marked = (D.findings || []).filter(function (f) { return f.step_ranges && f.step_ranges.length; });
    s.appendChild(el('p', {'class': 'hint'}, 'Memory per step' + (P.bucket > 1 ? ' (each point the highest of ' + P.bucket + ' steps)' : '') +
      (marked.length ? '; shaded: the steps a finding concerns (hover for it, click to go to it).' : '.')));
    P.devices.forEach(function (dv) {
      var wrap = el('div', {'class': 'chart'}), title = el('div', {'class': 'chart-title'}, dv.name);
      var legend = el('span', {'class': 'legend'});
      Object.keys(dv.series).forEach(function (name) {
        var item = el('span'), sw = el('i'); sw.style.background = STEP_PLOT_COLORS[name] || '#555';
        item.appendChild(sw); item.appendChild(document.createTextNode(STEP_PLOT_NAMES[name] || name)); legend.appendChild(item);
      });
      marked.forEach(function (f) {
        if (f.device !== null && f.device !== undefined && f.device !== dv.device) { return; }
        var item = el('span'), sw = el('i'); sw.style.background = findingColor(f.kind); sw.style.opacity = '0.45';
        item.appendChild(sw); item.appendChild(document.createTextNode(f.kind + ': ' + rangesText(f.step_ranges))); legend.appendChild(item);
      });
      title.appendChild(legend); wrap.appendChild(title);
      var box = el('div'); wrap.appendChild(box); s.appendChild(wrap);
      stepBoxes.push({dv: dv, box: box});
    });
    drawStepPlots();
    var sum = P.summary;
    if (sum && sum.devices.length) {
      var rows = [];
      sum.devices.forEach(function (dv) {
        ['current', 'peak', 'allocated', 'reserved'].forEach(function (name) {
          var x = dv[name]; if (!x) { return; }
          rows.push([dv.name + ' ' + (name === 'allocated' || name === 'reserved' ? 'torch ' + name : name), x.first, x.last, x.min, x.max, x.trend_per_step]);
        });
      });
      table(s, {columns: [{key: 'series', type: 'text'}, {key: 'first', type: 'bytes'}, {key: 'last', type: 'bytes'},
        {key: 'min', type: 'bytes'}, {key: 'max', type: 'bytes'}, {key: 'trend per step', type: 'bytes'}], rows: rows, more: 0},
      {sortable: false, narrow: true});
      s.appendChild(el('p', {'class': 'note'}, sum.count + ' step' + (sum.count === 1 ? '' : 's') + ' recorded; trend: the least-squares slope from step ' +
        sum.trend_from_step + ' to step ' + sum.last_step + (sum.trend_from_step !== sum.first_step ? ' (after the warm-up).' : '.')));
    }
  }
  function steps() {
    if (!D.steps) { return; }
    var s = section('Steps', 'mvz-steps');
    stepPlots(s);
    table(s, D.steps);
  }
  function findings() {
    if (!D.findings) { return; }
    var s = section('Findings', 'mvz-findings');
    if (!D.findings.length) { s.appendChild(el('p', {'class': 'note'}, 'No problem found.')); return; }
    var cards = el('div', {'class': 'cards'});
    D.findings.forEach(function (f, fi) {
      var c = el('div', {'class': 'card', id: 'mvz-finding-' + fi, 'data-kind': f.kind});
      c.style.borderLeftColor = findingColor(f.kind);
      c.appendChild(el('div', {'class': 'kind'}, f.kind + (f.severity ? ' \u00b7 ' + f.severity : '') +
        (f.step_ranges && f.step_ranges.length ? ' \u00b7 ' + rangesText(f.step_ranges) : '')));
      c.appendChild(el('div', {}, f.message));
      var kv = el('div', {'class': 'kv'});
      Object.keys(f.numbers_text).forEach(function (k) { kv.appendChild(el('span', {}, k + ': ' + f.numbers_text[k])); });
      if (kv.children.length) { c.appendChild(kv); }
      if (f.lines.length) { c.appendChild(el('pre', {}, f.lines.join('\n'))); }
      if (f.fix) { c.appendChild(el('div', {'class': 'fix'}, 'Fix: ' + f.fix)); }
      cards.appendChild(c);
    });
    s.appendChild(cards);
  }
  function failures() {
    if (!D.failures.length) { return; }
    var s = section('Failed allocations', 'mvz-failures');
    s.appendChild(el('p', {'class': 'bad'}, D.failures.length + ' allocation' + (D.failures.length === 1 ? ' was' : 's were') + ' refused by the driver. Hover a row for its stack.'));
    table(s, {columns: [{key: 'time', type: 'time'}, {key: 'size', type: 'bytes'}, {key: 'device', type: 'text'},
      {key: 'kind', type: 'text'}, {key: 'line', type: 'text'}, {key: 'source', type: 'code'}, {key: 'error', type: 'text'},
      {key: 'thread', type: 'text'}, {key: 'label', type: 'text'}], rows: D.failures, more: 0, title_col: 9});
  }

  /* ---- PyTorch's segments, each a bar of its live blocks ----------------- */
  function segments() {
    if (!D.segments) { return; }
    var S = D.segments, s = section('PyTorch\u2019s segments ' + S.when, 'mvz-segments');
    s.appendChild(el('p', {'class': 'sub'}, 'Each bar is one segment of PyTorch\u2019s caching allocator; the ' +
      'coloured parts are its live blocks (hover for the line that owns each), the grey rest is reserved and unused.'));
    S.rows.forEach(function (r) {
      var size = r[2], row = el('div', {'class': 'mvz-seg'});
      row.appendChild(el('div', {'class': 'mvz-seg-head'}, 'cuda:' + r[0] + ' ' + r[1] + ' \u00b7 ' + fmtBytes(size) +
        ' \u00b7 ' + fmtBytes(r[3]) + ' unused in ' + fmtInt(r[5]) + ' gap' + (r[5] === 1 ? '' : 's') +
        ' (largest ' + fmtBytes(r[4]) + ')' + (r[6] ? ' \u00b7 made at ' + r[6] : '')));
      var bar = el('div', {'class': 'mvz-seg-bar'});
      bar.style.position = 'relative'; bar.style.height = '14px'; bar.style.background = '#e4e4e4';
      r[7].forEach(function (b) {
        var blk = el('div', {'class': 'mvz-seg-block'});
        blk.style.position = 'absolute'; blk.style.top = '0'; blk.style.bottom = '0';
        blk.style.left = (100 * b[0] / size) + '%'; blk.style.width = Math.max(100 * b[1] / size, 0.15) + '%';
        blk.style.background = 'hsl(' + (hash(String(b[3] || b[2])) % 360) + ',55%,55%)';
        var text = fmtBytes(b[1]) + ' \u00b7 ' + (b[2] || '?') + (b[3] ? ' \u00b7 ' + b[3] : '');
        blk.addEventListener('mousemove', function (ev) { showTip(text, ev); });
        blk.addEventListener('mouseleave', hideTip);
        bar.appendChild(blk);
      });
      row.appendChild(bar);
      if (r[8]) { row.appendChild(el('p', {'class': 'note'}, '\u2026 and ' + fmtInt(r[8]) + ' smaller blocks not drawn.')); }
      s.appendChild(row);
    });
    if (S.more) { s.appendChild(el('p', {'class': 'note'}, '\u2026 and ' + fmtInt(S.more) + ' smaller segments, not included.')); }
  }

  /* ---- memory beyond memviz's record ----------------------------------- */
  function outside() {
    var O = D.outside;
    if (!O) { return; }
    var s = section('Memory beyond memviz\u2019s record', 'mvz-outside');
    s.appendChild(el('p', {'class': 'sub'}, 'What the driver says the process held when tracking stopped, less what memviz ' +
      'recorded then: split into what memviz can name and an unexplained rest.'));
    if (O.why_none) { s.appendChild(el('p', {'class': 'note'}, O.why_none + '.')); return; }
    O.devices.forEach(function (d) {
      var rows = [['held by the process (' + d.source + ')', d.held], ['recorded by memviz', d.recorded],
        ['beyond its record', d.beyond]];
      d.named.forEach(function (n) { rows.push(['\u2003' + n.what, n.bytes]); });
      Object.keys(d.before_tracking || {}).forEach(function (k) { rows.push(['\u2003made before tracking: ' + k, d.before_tracking[k]]); });
      rows.push(['\u2003unexplained', d.unexplained]);
      s.appendChild(el('div', {'class': 'chart-title'}, d.name));
      table(s, {columns: [{key: 'what', type: 'text'}, {key: 'bytes', type: 'bytes'}], rows: rows, more: 0},
        {sortable: false, narrow: true});
    });
    s.appendChild(el('p', {'class': 'note'}, 'Unexplained: memory no allocation call that memviz saw made; memviz cannot say ' +
      'what it is (the CUDA context and loaded kernels are usually part of it).'));
    O.notes.forEach(function (n) { s.appendChild(el('p', {'class': 'note'}, n.charAt(0).toUpperCase() + n.slice(1) + '.')); });
  }

  /* ---- what if: the recorded requests under other allocator settings ------- */
  function whatif() {
    var W = D.whatif;
    if (!W || !W.rows.length) { return; }
    var s = section('What if: other allocator settings', 'mvz-whatif');
    s.appendChild(el('p', {'class': 'sub'}, 'The recorded PyTorch requests replayed, in order and on their streams, ' +
      'through a model of PyTorch\u2019s caching allocator; the first row replays the recorded settings.'));
    var rows = W.rows.map(function (r) {
      var name = (r.setting || 'defaults') + (r.device_memory ? ' on ' + r.device_memory : '') +
        (r.recorded ? ' (recorded)' : '');
      return [name, 'cuda:' + r.device, r.reserved_peak, r.allocated_at_peak, r.unused_at_peak,
        r.largest_free_at_peak, r.cuda_mallocs, r.retries, r.oom ? 'OOM' : (r.limit === null ? '' : 'yes'),
        r.headroom];
    });
    table(s, {columns: [{key: 'setting', type: 'text'}, {key: 'device', type: 'text'},
      {key: 'reserved peak', type: 'bytes'}, {key: 'allocated then', type: 'bytes'}, {key: 'unused', type: 'bytes'},
      {key: 'largest free', type: 'bytes'}, {key: 'cudaMalloc', type: 'int'}, {key: 'retries', type: 'int'},
      {key: 'fits', type: 'text'}, {key: 'headroom', type: 'bytes'}], rows: rows, more: 0});
    W.rows.forEach(function (r) {
      if (r.oom) {
        s.appendChild(el('p', {'class': 'warn'}, (r.setting || 'defaults') + ', cuda:' + r.device + ': out of memory at ' +
          r.oom.line + (r.oom.backward ? ' (in the backward: ' + r.oom.backward + ')' : '') + ', ' +
          fmtBytes(r.oom.requested) + ' asked with ' + fmtBytes(r.oom.reserved) + ' reserved. Live then: ' +
          r.oom.top.map(function (x) { return x.line + ' ' + fmtBytes(x.bytes); }).join('; ') + '.'));
      }
      r.notes.forEach(function (n) { s.appendChild(el('p', {'class': 'note'}, n.charAt(0).toUpperCase() + n.slice(1) + '.')); });
    });
    s.appendChild(el('p', {'class': 'note'}, 'Not modelled: ' + W.not_modelled.join('; ') + '.'));
  }

  summary(); timeline(); flame(); tables(); segments(); steps(); findings(); failures(); outside(); whatif();
  if (D.findings_note && !D.findings) { main.appendChild(el('p', {'class': 'note'}, 'Findings: ' + D.findings_note + '.')); }
  var resizeTimer = null;
  window.addEventListener('resize', function () { clearTimeout(resizeTimer); resizeTimer = setTimeout(function () { drawTimeline(); drawFlame(); drawStepPlots(); }, 150); });
  root.setAttribute('data-ready', '1');
}());
