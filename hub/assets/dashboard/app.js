/* Starling hub dashboard.
 *
 * Plain JavaScript, no dependencies, nothing fetched from outside the hub. Reads GET /v1/status
 * (docs/observability.md) on load, after events from GET /v1/events (throttled) and on a timer,
 * and re-renders every view from that one JSON object. Every string from the server reaches the
 * page through textContent or setAttribute, never through innerHTML.
 */
'use strict';
(function () {
  // ---------------------------------------------------------------- constants

  const STATUS_URL = '/v1/status';
  const EVENTS_URL = '/v1/events';
  const MIN_FETCH_GAP_MS = 340;       // at most ~3 status reads a second
  const POLL_TRANSFER_MS = 2000;      // while a relay transfer is running
  const POLL_IDLE_MS = 5000;          // fallback otherwise
  const EVENTS_RETRY_MS = 5000;       // when the browser gives up on the stream
  const MAX_LOG = 200;
  const TIMELINE_VERSIONS = 8;
  const MAX_BATCHES = 12;
  const SVG_NS = 'http://www.w3.org/2000/svg';
  const EVENT_NAMES = ['hello', 'published', 'transfer', 'staged', 'active', 'connected',
    'disconnected', 'batch', 'step', 'fault', 'lagged'];
  const PALETTE = ['#3b6ea5', '#c4703a', '#4a9468', '#8a5aa8', '#b5505c', '#2f9196',
    '#9a8434', '#5d6b7a', '#a8577e', '#5f8a3a', '#6b62b8', '#a0643c'];
  const JOB_STATES = [
    ['done', '#5a9e74'], ['leased', '#3b6ea5'], ['pending', '#d5a642'],
    ['posted', '#aab4bf'], ['failed', '#c0483d']];

  // ---------------------------------------------------------------- state

  const state = {
    status: null,        // last /v1/status object
    skew: 0,             // server now_ms - local Date.now() at the last read
    fetchedAt: 0,        // local time of the last good read
    fetchError: null,    // message of the last failed read, null after a good one
    conn: 'connecting',
    eventCount: 0,
    live: [],            // log entries from the event stream, newest last
    timelineLog: false,  // log scale on the propagation timeline
    logAll: true,        // show connection/publish events beside faults
  };

  // ---------------------------------------------------------------- small helpers

  const isObj = (x) => x !== null && typeof x === 'object' && !Array.isArray(x);
  const arr = (x) => (Array.isArray(x) ? x : []);
  const objs = (x) => arr(x).filter(isObj);
  const obj = (x) => (isObj(x) ? x : {});
  const num = (x) => (typeof x === 'number' && isFinite(x) ? x : null);
  const str = (x) => (x === null || x === undefined ? '' : String(x));
  const $ = (id) => document.getElementById(id);

  function setAttrs(e, attrs) {
    if (!attrs) return;
    for (const k of Object.keys(attrs)) {
      const v = attrs[k];
      if (v === null || v === undefined || v === false) continue;
      if (k === 'text') e.textContent = String(v);
      else if (k === 'style' && isObj(v)) {
        for (const p of Object.keys(v)) if (v[p] !== null && v[p] !== undefined) e.style.setProperty(p, String(v[p]));
      } else if (k.startsWith('on') && typeof v === 'function') e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? '' : String(v));
    }
  }
  function addKids(e, kids) {
    for (const k of kids.flat(Infinity)) {
      if (k === null || k === undefined || k === false) continue;
      e.appendChild(k instanceof Node ? k : document.createTextNode(String(k)));
    }
  }
  /** HTML element; string children become text nodes. */
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    setAttrs(e, attrs);
    addKids(e, kids);
    return e;
  }
  /** SVG element; string children become text nodes. */
  function sv(tag, attrs, ...kids) {
    const e = document.createElementNS(SVG_NS, tag);
    setAttrs(e, attrs);
    addKids(e, kids);
    return e;
  }
  const svgTitle = (t) => sv('title', null, t);
  const placeholder = (t) => el('p', { class: 'placeholder' }, t || 'none yet');
  /** Replace an element's children (nested arrays flattened, strings as text). */
  function fill(e, ...kids) { e.textContent = ''; addKids(e, kids); }
  function setText(id, t) { const e = $(id); if (e) e.textContent = t; }

  const serverNow = () => Date.now() + state.skew;
  const pad = (n, w) => String(n).padStart(w || 2, '0');

  function fmtInt(n) {
    n = num(n);
    return n === null ? '—' : Math.round(n).toLocaleString('en-US');
  }
  function fmtNum(n, digits) {
    n = num(n);
    if (n === null) return '—';
    return n.toLocaleString('en-US', { minimumFractionDigits: digits, maximumFractionDigits: digits });
  }
  function fmtBytes(b) {
    b = num(b);
    if (b === null) return '—';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
    let i = 0;
    while (Math.abs(b) >= 1024 && i < units.length - 1) { b /= 1024; i++; }
    if (i === 0) return Math.round(b) + ' B';
    return b.toFixed(Math.abs(b) < 10 ? 2 : Math.abs(b) < 100 ? 1 : 0) + ' ' + units[i];
  }
  function fmtDur(ms) {
    ms = num(ms);
    if (ms === null) return '—';
    if (ms < 0) ms = 0;
    let s = Math.floor(ms / 1000);
    const d = Math.floor(s / 86400); s -= d * 86400;
    const h = Math.floor(s / 3600); s -= h * 3600;
    const m = Math.floor(s / 60); s -= m * 60;
    if (d > 0) return d + 'd ' + pad(h) + 'h';
    if (h > 0) return h + 'h ' + pad(m) + 'm';
    if (m > 0) return m + 'm ' + pad(s) + 's';
    return s + 's';
  }
  /** A short duration: "350 ms", "2.40 s", then fmtDur. */
  function fmtMs(ms) {
    ms = num(ms);
    if (ms === null) return '—';
    if (Math.abs(ms) < 1000) return Math.round(ms) + ' ms';
    if (Math.abs(ms) < 10000) return (ms / 1000).toFixed(2) + ' s';
    if (Math.abs(ms) < 60000) return (ms / 1000).toFixed(1) + ' s';
    return fmtDur(ms);
  }
  function fmtAgo(at) {
    at = num(at);
    if (at === null) return '—';
    const d = serverNow() - at;
    if (d < 1000) return 'just now';
    return fmtDur(d) + ' ago';
  }
  function fmtClock(at, withMs) {
    at = num(at);
    if (at === null) return '—';
    const d = new Date(at);
    const t = pad(d.getHours()) + ':' + pad(d.getMinutes()) + ':' + pad(d.getSeconds());
    return withMs ? t + '.' + pad(d.getMilliseconds(), 3) : t;
  }
  function fmtDate(at) {
    at = num(at);
    if (at === null) return '';
    const d = new Date(at);
    return d.getFullYear() + '-' + pad(d.getMonth() + 1) + '-' + pad(d.getDate()) + ' ' + fmtClock(at, true);
  }
  function fmtMbit(x) {
    x = num(x);
    if (x === null) return '—';
    const digits = x < 1 ? 2 : x < 100 ? 1 : 0;
    return x.toFixed(digits) + ' Mbit/s';
  }
  function fmtRatio(r) {
    r = num(r);
    if (r === null || r <= 0) return null;
    if (r >= 1) return (r >= 100 ? Math.round(r).toLocaleString('en-US') : r.toFixed(1)) + '× smaller than full';
    return (1 / r).toFixed(1) + '× larger than full';
  }
  const fmtVersion = (v) => (num(v) === null ? '—' : 'v' + num(v));
  function fmtPct(x) {
    x = num(x);
    if (x === null) return '—';
    return (x * 100).toFixed(x * 100 < 10 && x > 0 ? 1 : 0) + '%';
  }

  /** Sum of a {reason: count} object, with its breakdown as text. */
  function countsOf(x) {
    const o = obj(x);
    let total = 0;
    const parts = [];
    for (const k of Object.keys(o)) {
      const n = num(o[k]);
      if (n === null || n === 0) continue;
      total += n;
      parts.push(k + ' ' + fmtInt(n));
    }
    return { total, text: parts.join(', ') };
  }

  /** Evenly spaced "nice" ticks covering [min, max]. */
  function niceTicks(min, max, count, integer) {
    if (!(max > min)) {
      const c = min, d = integer ? 1 : (Math.abs(c) * 0.1 || 1);
      min = c - d; max = c + d;
      if (c >= 0 && min < 0) min = 0;
    }
    const raw = (max - min) / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / mag;
    let step = (f >= 7.5 ? 10 : f >= 3.5 ? 5 : f >= 1.5 ? 2 : 1) * mag;
    if (integer && step < 1) step = 1;
    const lo = Math.floor(min / step + 1e-9) * step;
    const hi = Math.ceil(max / step - 1e-9) * step;
    const ticks = [];
    for (let v = lo, i = 0; v <= hi + step / 2 && i < 100; v += step, i++) ticks.push(Number(v.toPrecision(12)));
    return { lo, hi, step, ticks };
  }
  function fmtTick(v, step) {
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(step >= 1e6 ? 0 : 1) + 'M';
    if (a >= 1e4) return (v / 1e3).toFixed(step >= 1e3 ? 0 : 1) + 'k';
    const digits = step >= 1 ? 0 : Math.min(4, Math.ceil(-Math.log10(step) - 1e-9));
    return v.toFixed(digits);
  }

  /** Stable colours: regions by their order in status.regions, actors by sorted name. */
  function colourMaps(st) {
    const regions = new Map();
    const addRegion = (n) => { n = str(n); if (n && !regions.has(n)) regions.set(n, PALETTE[regions.size % PALETTE.length]); };
    objs(st.regions).forEach((r) => addRegion(r.region));
    objs(st.actors).forEach((a) => addRegion(a.region));
    objs(st.versions).forEach((v) => objs(v.regions).forEach((r) => addRegion(r.region)));
    const names = new Set();
    objs(st.actors).forEach((a) => names.add(str(a.name)));
    objs(st.batches).forEach((b) => Object.keys(obj(b.shares)).forEach((n) => names.add(n)));
    const actors = new Map();
    [...names].sort().forEach((n, i) => actors.set(n, PALETTE[(i + 3) % PALETTE.length]));
    return {
      region: (n) => regions.get(str(n)) || '#7b8794',
      actor: (n) => actors.get(str(n)) || '#7b8794',
    };
  }

  function dot(connected, title) {
    const cls = connected === true ? 'ok' : connected === false ? 'bad' : 'unknown';
    const t = title || (connected === true ? 'connected' : connected === false ? 'not connected' : 'unknown');
    return el('span', { class: 'dot ' + cls, title: t, 'aria-label': t });
  }
  function swatch(colour) { return el('span', { class: 'swatch', style: { background: colour } }); }

  /** A horizontal stacked bar of [{label, value, colour}]. */
  function stackedBar(parts, extraClass) {
    const total = parts.reduce((s, p) => s + (num(p.value) > 0 ? p.value : 0), 0);
    const bar = el('div', { class: 'stack ' + (extraClass || '') });
    if (total <= 0) { bar.classList.add('empty'); return bar; }
    for (const p of parts) {
      if (!(num(p.value) > 0)) continue;
      bar.appendChild(el('span', {
        class: 'seg',
        title: p.label + ': ' + fmtInt(p.value) + ' (' + fmtPct(p.value / total) + ')',
        style: { 'flex-grow': String(p.value), background: p.colour },
      }));
    }
    return bar;
  }
  function legend(parts, showZero) {
    return el('div', { class: 'legend' }, parts.filter((p) => showZero || num(p.value) > 0).map((p) =>
      el('span', { class: 'legend-item' + (p.cls ? ' ' + p.cls : '') }, swatch(p.colour), el('span', null, p.label), ' ',
        el('strong', null, p.valueText !== undefined ? p.valueText : fmtInt(p.value)))));
  }

  /** Run one view's render; on error show it in that view instead of breaking the page. */
  function safe(boxId, fn) {
    try { fn(); } catch (e) {
      if (window.console) console.error('dashboard: ' + boxId, e);
      const box = $(boxId);
      if (box) fill(box, el('p', { class: 'placeholder error' }, 'could not render this view: ' + str(e && e.message ? e.message : e)));
    }
  }

  // ---------------------------------------------------------------- header

  function tickClock() {
    const st = obj(state.status);
    const started = num(st.started_at_ms);
    setText('uptime', started === null ? '—' : fmtDur(serverNow() - started));
    const up = $('updated');
    if (up) {
      if (!state.fetchedAt) up.textContent = '';
      else {
        const age = Date.now() - state.fetchedAt;
        up.textContent = 'updated ' + (age < 1500 ? 'just now' : fmtDur(age) + ' ago');
        up.classList.toggle('stale', age > 15000);
      }
    }
  }

  function renderHeader(st) {
    setText('model-id', st.model_id === null || st.model_id === undefined ? '—' : str(st.model_id));
    const v = num(st.version);
    setText('hub-version', v === null ? '—' : String(v));
    setText('checkpoint', num(st.checkpoint_bytes) === null ? '—' : fmtBytes(st.checkpoint_bytes));
    // Which codec set the last version was encoded with, and why (hover: the estimates).
    const codecs = obj(st.codecs);
    setText('codecs', codecs.chosen ? str(codecs.chosen) + ' (' + str(codecs.policy) + ')' : (codecs.policy ? str(codecs.policy) : '—'));
    const ce = $('codecs');
    if (ce) ce.title = codecs.why ? str(codecs.why) : '';
    tickClock();

    const relays = objs(st.regions).flatMap((r) => objs(r.relays));
    const actors = objs(st.actors);
    const relaysUp = relays.filter((r) => r.connected === true).length;
    const actorsUp = actors.filter((a) => a.connected === true).length;
    const behind = actors.filter((a) => num(a.behind) > 0).length;
    const peers = $('peers');
    if (peers) {
      fill(peers, [
        el('span', { class: relaysUp < relays.length ? 'warn-text' : null }, 'relays ' + relaysUp + '/' + relays.length),
        el('span', { class: 'sep' }, ' · '),
        el('span', { class: actorsUp < actors.length ? 'warn-text' : null }, 'actors ' + actorsUp + '/' + actors.length),
        behind > 0 ? [el('span', { class: 'sep' }, ' · '), el('span', { class: 'warn-text' }, behind + ' behind')] : null]);
    }
    const jobs = obj(st.jobs);
    const jt = $('job-totals');
    if (jt) {
      const items = [];
      for (const [k, colour] of [['posted'], ['pending'], ['leased'], ['done'], ['failed']].map((x) => [x[0], (JOB_STATES.find((j) => j[0] === x[0]) || [])[1]])) {
        const n = num(jobs[k]);
        if (n === null) continue;
        if (items.length) items.push(el('span', { class: 'sep' }, ' · '));
        items.push(el('span', { class: 'job-total' + (k === 'failed' && n > 0 ? ' bad-text' : '') }, swatch(colour), fmtInt(n) + ' ' + k));
      }
      fill(jt, (items.length ? items : ['—']));
    }
  }

  // ---------------------------------------------------------------- regions

  function renderRegions(st, colours) {
    const box = $('regions-body');
    const actors = objs(st.actors);
    const byName = new Map();
    actors.forEach((a) => { if (!byName.has(str(a.name))) byName.set(str(a.name), a); });
    const hubVersion = num(st.version);
    const seen = new Set();   // actor names already placed (each data-actor appears once)
    const cards = [];

    const regions = objs(st.regions).slice();
    const known = new Set(regions.map((r) => str(r.region)));
    // Regions that only an actor names, and actors with no region, still get a card.
    for (const a of actors) {
      const rn = str(a.region);
      if (!known.has(rn)) { known.add(rn); regions.push({ region: a.region, relays: [], actors: [], synthetic: true }); }
    }
    for (const r of regions) {
      const rn = str(r.region);
      const names = [];
      for (const n of arr(r.actors).map(str)) if (!seen.has(n)) { seen.add(n); names.push(n); }
      for (const a of actors) {
        const n = str(a.name);
        if (str(a.region) === rn && !seen.has(n)) { seen.add(n); names.push(n); }
      }
      cards.push(regionCard(r, names.map((n) => byName.get(n) || { name: n }), hubVersion, colours));
    }
    if (!cards.length) { fill(box, placeholder('no regions yet: no relay or actor has announced itself')); return; }
    fill(box, cards);
  }

  function regionCard(r, actors, hubVersion, colours) {
    const rn = str(r.region);
    const relays = objs(r.relays);
    const minV = num(r.min_version), maxV = num(r.max_version);
    let range = null;
    if (minV !== null || maxV !== null) {
      const lagging = hubVersion !== null && minV !== null && minV < hubVersion;
      range = el('span', { class: 'pill ' + (lagging ? 'warn' : 'ok'), title: 'oldest and newest active version among the region\'s actors' },
        minV === maxV ? 'all on ' + fmtVersion(minV) : fmtVersion(minV) + ' – ' + fmtVersion(maxV));
    }
    const attrs = { class: 'card region-card' };
    if (rn) attrs['data-region'] = rn;
    return el('article', attrs,
      el('header', { class: 'card-head' },
        swatch(colours.region(rn)),
        el('h3', null, rn || 'no region'),
        range,
        el('span', { class: 'muted small' }, relays.length + (relays.length === 1 ? ' relay' : ' relays') + ' · ' + actors.length + (actors.length === 1 ? ' actor' : ' actors'))),
      el('div', { class: 'relays' }, relays.length ? relays.map(relayLine) : el('p', { class: 'placeholder small' }, r.synthetic ? 'no relay announced for this region' : 'no relay yet')),
      actors.length ? actorTable(actors, hubVersion) : el('p', { class: 'placeholder small' }, 'no actors yet'));
  }

  function relayLine(r) {
    const name = str(r.name);
    const link = obj(r.link);
    const linkText = [];
    if (num(link.rate_mbit) !== null) linkText.push(fmtMbit(link.rate_mbit));
    if (num(link.rtt_ms) !== null) linkText.push(fmtNum(link.rtt_ms, link.rtt_ms < 10 ? 1 : 0) + ' ms RTT');
    const since = num(r.since_ms);
    return el('div', { class: 'relay-line', 'data-relay': name },
      dot(r.connected),
      el('strong', { class: 'relay-name' }, name || '(unnamed relay)'),
      r.connected === false ? el('span', { class: 'pill bad' }, 'disconnected')
        : since !== null ? el('span', { class: 'muted small', title: 'connected since ' + fmtDate(since) }, 'up ' + fmtDur(serverNow() - since)) : null,
      el('span', { class: 'kv' }, el('span', { class: 'k' }, 'version'), el('span', { class: 'v', 'data-field': 'version' }, fmtVersion(r.version))),
      el('span', { class: 'kv' }, el('span', { class: 'k' }, 'link'), el('span', { class: 'v' }, linkText.length ? linkText.join(' · ') : '—')),
      el('span', { class: 'kv' }, el('span', { class: 'k' }, 'sent'), el('span', { class: 'v' }, fmtBytes(r.bytes_sent))));
  }

  function actorTable(actors, hubVersion) {
    const head = ['actor · engine', 'active', 'staged', 'behind', 'tok/s', 'share', 'leases', 'accepted', 'refused'];
    const numeric = new Set(['active', 'staged', 'behind', 'tok/s', 'share', 'leases', 'accepted', 'refused']);
    return el('table', { class: 'grid actors' },
      el('thead', null, el('tr', null, head.map((h) => el('th', { class: numeric.has(h) ? 'num' : null }, h)))),
      el('tbody', null, actors.map((a) => actorRow(a, hubVersion))));
  }

  function actorRow(a, hubVersion) {
    const name = str(a.name);
    const active = num(a.active_version);
    const staged = num(a.staged_version);
    let behind = num(a.behind);
    if (behind === null && hubVersion !== null && active !== null) behind = hubVersion - active;
    const refused = countsOf(a.refused);
    const hb = num(a.last_heartbeat_ms);
    const tip = [name];
    if (a.connected === true) tip.push('job connection up'); else if (a.connected === false) tip.push('job connection down');
    if (a.source) tip.push('weights from ' + str(a.source));
    if (hb !== null) tip.push('last heartbeat ' + fmtAgo(hb));
    const engine = str(a.engine);
    return el('tr', { 'data-actor': name, class: behind > 0 ? 'is-behind' : null },
      el('td', { class: 'name', title: tip.join(' · ') },
        el('div', { class: 'name-line' }, dot(a.connected), el('span', { class: 'actor-name' }, name),
          a.source ? el('span', { class: 'tag' }, str(a.source)) : null),
        el('div', { class: 'engine', title: engine }, engine || 'engine unknown')),
      el('td', { class: 'num strong', 'data-field': 'active_version' }, active === null ? '—' : String(active)),
      el('td', { class: 'num', 'data-field': 'staged_version' }, staged === null ? '—' : String(staged)),
      el('td', { class: 'num', 'data-field': 'behind' },
        behind === null ? '—' : behind > 0 ? el('span', { class: 'pill warn' }, String(behind)) : el('span', { class: 'muted' }, String(behind))),
      el('td', { class: 'num', 'data-field': 'tokens_per_s' }, fmtNum(a.tokens_per_s, num(a.tokens_per_s) !== null && a.tokens_per_s < 100 ? 1 : 0)),
      el('td', { class: 'num', 'data-field': 'share' }, fmtPct(a.share)),
      el('td', { class: 'num', 'data-field': 'leases' }, fmtInt(a.leases)),
      el('td', { class: 'num', 'data-field': 'accepted' }, fmtInt(a.accepted)),
      el('td', { class: 'num' + (refused.total > 0 ? ' warn-text' : ' muted'), 'data-field': 'refused', title: refused.text || 'none refused' },
        a.refused === null || a.refused === undefined ? '—' : fmtInt(refused.total)));
  }

  // ---------------------------------------------------------------- propagation timeline

  // Lane geometry in SVG units; W and X1 follow the lane's pixel width (see fitTimeline) so
  // text stays at its CSS size on any screen.
  const TL = { W: 1000, X0: 78, X1: 785, ROW: 24, PAD: 6, INFO: 264 };

  function fitTimeline(box) {
    const avail = Math.round((box.clientWidth || 0) - TL.INFO);
    TL.W = avail >= 560 ? avail : 1000;
    TL.X1 = TL.W - 215;
  }

  function renderTimelineTools() {
    const box = $('timeline-tools');
    if (!box) return;
    const mk = (label, log) => el('button', {
      type: 'button', class: 'toggle' + (state.timelineLog === log ? ' on' : ''), 'aria-pressed': String(state.timelineLog === log),
      onclick: () => { state.timelineLog = log; renderTimelineTools(); safe('timeline-body', () => renderTimeline(obj(state.status), colourMaps(obj(state.status)))); },
    }, label);
    fill(box, 
      el('span', { class: 'legend tl-legend' },
        el('span', { class: 'legend-item' }, shapeIcon('sent'), 'relay sent'),
        el('span', { class: 'legend-item' }, shapeIcon('rstaged'), 'relay staged'),
        el('span', { class: 'legend-item' }, shapeIcon('astaged'), 'actor staged'),
        el('span', { class: 'legend-item' }, shapeIcon('active'), 'actor active')),
      el('span', { class: 'toggles' }, mk('linear', false), mk('log', true)));
  }

  function shapeIcon(type) {
    return sv('svg', { class: 'icon', viewBox: '-7 -7 14 14', width: 14, height: 14, 'aria-hidden': 'true' }, marker(type, 0, 0, '#52606d'));
  }

  function marker(type, x, y, colour) {
    switch (type) {
      case 'sent': return sv('rect', { x: x - 1.5, y: y - 7, width: 3, height: 14, fill: colour });
      case 'rstaged': return sv('path', { d: `M${x} ${y - 6}L${x + 6} ${y}L${x} ${y + 6}L${x - 6} ${y}Z`, fill: colour, stroke: '#fff', 'stroke-width': 1 });
      case 'astaged': return sv('circle', { cx: x, cy: y, r: 4, fill: '#fff', stroke: colour, 'stroke-width': 1.6 });
      default: return sv('circle', { cx: x, cy: y, r: 4.5, fill: colour, stroke: '#fff', 'stroke-width': 1 });
    }
  }

  function renderTimeline(st, colours) {
    const box = $('timeline-body');
    const versions = objs(st.versions).filter((v) => num(v.version) !== null)
      .sort((a, b) => b.version - a.version).slice(0, TIMELINE_VERSIONS);
    if (!versions.length) { fill(box, placeholder('no versions published yet')); return; }
    fitTimeline(box);

    const regionOrder = objs(st.regions).map((r) => str(r.region));
    const checkpoint = num(st.checkpoint_bytes);
    let maxOff = 0;
    const lanes = versions.map((v) => {
      const pub = num(v.published_at_ms);
      const rows = new Map();
      const row = (name) => {
        name = str(name);
        if (!rows.has(name)) rows.set(name, { region: name, entry: null, marks: [] });
        return rows.get(name);
      };
      const mark = (r, type, at, label) => {
        at = num(at);
        if (at === null || pub === null) return;
        const off = Math.max(0, at - pub);
        maxOff = Math.max(maxOff, off);
        r.marks.push({ type, off, label: label + ' +' + fmtMs(off) + ' (' + fmtClock(at, true) + ')' });
      };
      for (const r of objs(v.regions)) {
        const rr = row(r.region);
        rr.entry = r;
        const relay = r.relay ? str(r.relay) : 'relay';
        mark(rr, 'sent', r.relay_sent_at_ms, 'sent to ' + relay);
        mark(rr, 'rstaged', r.relay_staged_at_ms, relay + ' staged');
      }
      for (const a of objs(v.actors)) {
        const rr = row(a.region);
        mark(rr, 'astaged', a.staged_at_ms, str(a.actor) + ' staged');
        mark(rr, 'active', a.active_at_ms, str(a.actor) + ' active');
      }
      const list = [...rows.values()].sort((a, b) => {
        const ia = regionOrder.indexOf(a.region), ib = regionOrder.indexOf(b.region);
        return (ia < 0 ? 1e9 : ia) - (ib < 0 ? 1e9 : ib) || a.region.localeCompare(b.region);
      });
      // Draw staged before active, sends before staged, so the important marks sit on top.
      const orderOf = { sent: 0, rstaged: 1, astaged: 2, active: 3 };
      list.forEach((r) => r.marks.sort((a, b) => orderOf[a.type] - orderOf[b.type]));
      return { v, pub, rows: list };
    });

    // One scale for every lane so versions compare at a glance.
    let scale;
    if (state.timelineLog) {
      const hi = Math.max(10, maxOff * 1.1);
      const ticks = [0];
      for (let t = 1; t <= hi; t *= 10) ticks.push(t);
      scale = { x: (off) => TL.X0 + (Math.log10(1 + off) / Math.log10(1 + hi)) * (TL.X1 - TL.X0), ticks };
    } else {
      const nt = niceTicks(0, Math.max(maxOff, 10), 6);
      scale = { x: (off) => TL.X0 + (off / nt.hi) * (TL.X1 - TL.X0), ticks: nt.ticks };
    }

    const axis = sv('svg', { class: 'tl-axis', viewBox: `0 0 ${TL.W} 20`, width: '100%', preserveAspectRatio: 'xMidYMid meet', role: 'img', 'aria-label': 'time after publish' },
      scale.ticks.map((t) => sv('text', {
        x: scale.x(t), y: 14, class: 'tick',
        'text-anchor': t === 0 ? 'start' : scale.x(t) > TL.X1 - 30 ? 'end' : 'middle',
      }, t === 0 ? 'publish' : '+' + fmtMs(t))),
      sv('text', { x: TL.X1 + 12, y: 14, class: 'tick' }, 'per region'));

    const blocks = [el('div', { class: 'tl-row tl-axis-row' }, el('div', { class: 'tl-info muted small' }, 'version'), el('div', { class: 'tl-lane' }, axis))];
    for (const lane of lanes) blocks.push(timelineLane(lane, scale, colours, checkpoint));
    fill(box, el('div', { class: 'timeline' }, blocks));
  }

  function timelineLane(lane, scale, colours, checkpoint) {
    const v = lane.v;
    let ratio = num(v.ratio);
    if (ratio === null && checkpoint !== null && num(v.bytes) > 0) ratio = checkpoint / v.bytes;
    const ratioText = fmtRatio(ratio);
    const sub = [];
    if (num(v.base) !== null) sub.push('from v' + v.base);
    if (num(v.step) !== null) sub.push('step ' + v.step);
    const detail = [];
    if (num(v.changes) !== null) detail.push(fmtInt(v.changes) + ' changes');
    if (num(v.encode_ms) !== null) detail.push('encode ' + fmtMs(v.encode_ms));
    const info = el('div', { class: 'tl-info', 'data-version': String(v.version) },
      el('div', { class: 'tl-title' }, el('span', { class: 'tl-version' }, 'v' + v.version), el('span', { class: 'muted small' }, sub.join(' · '))),
      el('div', null, el('span', { class: 'strong' }, fmtBytes(v.bytes)), ratioText ? [' · ', el('span', { class: 'ratio' }, ratioText)] : null),
      el('div', { class: 'muted small' }, detail.join(' · ')),
      el('div', { class: 'muted small', title: fmtDate(lane.pub) }, lane.pub === null ? 'publish time unknown' : 'published ' + fmtClock(lane.pub) + ' · ' + fmtAgo(lane.pub)));

    let laneBody;
    if (!lane.rows.length) {
      laneBody = el('div', { class: 'tl-empty muted small' }, lane.pub === null ? 'no propagation data' : 'waiting for the first relay…');
    } else {
      const H = TL.PAD * 2 + lane.rows.length * TL.ROW;
      const g = [];
      for (const t of scale.ticks) {
        const x = scale.x(t);
        g.push(sv('line', { x1: x, x2: x, y1: 0, y2: H, class: t === 0 ? 'tl-zero' : 'tl-grid' }));
      }
      lane.rows.forEach((r, i) => {
        const y = TL.PAD + i * TL.ROW + TL.ROW / 2;
        const colour = colours.region(r.region);
        g.push(sv('text', { x: 4, y: y + 4, class: 'tl-region', fill: colour }, r.region.length > 11 ? r.region.slice(0, 10) + '…' : (r.region || '?')));
        g.push(sv('line', { x1: TL.X0, x2: TL.X1, y1: y, y2: y, class: 'tl-track' }));
        const last = r.marks.reduce((m, k) => Math.max(m, k.off), -1);
        if (last >= 0) g.push(sv('line', { x1: TL.X0, x2: scale.x(last), y1: y, y2: y, stroke: colour, 'stroke-width': 2, 'stroke-opacity': 0.45 }));
        for (const m of r.marks) {
          const node = marker(m.type, scale.x(m.off), y, colour);
          node.appendChild(svgTitle(m.label));
          g.push(node);
        }
        g.push(sv('text', { x: TL.X1 + 12, y: y + 4, class: 'tl-summary' }, regionSummary(r)));
      });
      laneBody = sv('svg', { class: 'tl-svg', viewBox: `0 0 ${TL.W} ${H}`, width: '100%', preserveAspectRatio: 'xMidYMid meet', role: 'img', 'aria-label': 'propagation of v' + v.version }, g);
    }
    return el('div', { class: 'tl-row' }, info, el('div', { class: 'tl-lane' }, laneBody));
  }

  function regionSummary(r) {
    const e = obj(r.entry);
    const total = num(e.actors);
    const activeCount = num(e.actors_active);
    const actives = r.marks.filter((m) => m.type === 'active');
    const n = activeCount !== null ? activeCount : actives.length;
    const parts = [];
    if (total !== null) parts.push(n + '/' + total + ' active');
    else parts.push(n + ' active');
    const allDone = total !== null && n >= total && total > 0;
    if (actives.length) {
      const last = actives.reduce((m, k) => Math.max(m, k.off), 0);
      parts.push((allDone ? 'all +' : 'last +') + fmtMs(last));
    } else if (r.marks.some((m) => m.type === 'rstaged')) parts.push('relay staged');
    else if (r.marks.some((m) => m.type === 'sent')) parts.push('relay receiving');
    else parts.push('awaiting relay');
    return parts.join(' · ');
  }

  // ---------------------------------------------------------------- transfers

  function renderTransfers(st, colours) {
    const box = $('transfers-body');
    const groups = [];
    for (const r of objs(st.regions)) {
      const relays = objs(r.relays);
      if (!relays.length) continue;
      groups.push(el('div', { class: 'xfer-region' },
        el('div', { class: 'xfer-region-head' }, swatch(colours.region(r.region)), el('strong', null, str(r.region) || 'no region')),
        relays.map((rel) => transferLine(rel))));
    }
    if (!groups.length) { fill(box, placeholder('no relays yet')); return; }
    fill(box, groups);
  }

  function transferLine(rel) {
    const t = isObj(rel.transfer) ? rel.transfer : null;
    const name = str(rel.name);
    const head = el('div', { class: 'xfer-head' }, dot(rel.connected), el('span', { class: 'relay-name' }, name || '(unnamed relay)'));
    if (!t) return el('div', { class: 'xfer', 'data-transfer': name }, head, el('div', { class: 'muted small' }, 'no transfer yet'));
    const bytes = num(t.bytes), of = num(t.of_bytes);
    const done = t.done === true;
    const running = t.done === false;
    head.appendChild(el('span', { class: 'strong' }, fmtVersion(t.version)));
    head.appendChild(el('span', { class: 'pill ' + (done ? 'ok' : running ? 'info' : '') }, done ? 'done' : running ? 'sending' : 'unknown'));
    let bar;
    if (of !== null && of > 0 && bytes !== null) {
      const frac = Math.max(0, Math.min(1, bytes / of));
      bar = el('div', { class: 'progress', title: fmtPct(frac) }, el('span', { class: 'fill' + (done ? ' done' : ''), style: { width: (frac * 100).toFixed(1) + '%' } }));
    } else {
      bar = el('div', { class: 'progress' + (running ? ' indeterminate' : ''), title: 'size not known yet' },
        done ? el('span', { class: 'fill done', style: { width: '100%' } }) : null);
    }
    const started = num(t.started_at_ms), lastAt = num(t.last_at_ms);
    const elapsed = started !== null ? (running ? serverNow() : (lastAt !== null ? lastAt : serverNow())) - started : null;
    const linkRate = num(obj(rel.link).rate_mbit);
    const good = num(t.goodput_mbit);
    const stats = [
      el('span', null, el('strong', null, fmtBytes(bytes)), ' of ', of === null ? el('span', { class: 'muted' }, '?') : fmtBytes(of),
        of !== null && of > 0 && bytes !== null ? el('span', { class: 'muted' }, ' (' + fmtPct(Math.min(1, bytes / of)) + ')') : null),
      el('span', { title: 'goodput over the transfer so far' }, 'goodput ', el('strong', null, fmtMbit(good)),
        linkRate !== null ? el('span', { class: 'muted' }, ' of ' + fmtMbit(linkRate) + ' link') : null),
      elapsed !== null ? el('span', { class: 'muted', title: 'started ' + fmtDate(started) }, (running ? 'running ' : 'took ') + fmtMs(elapsed)) : null,
    ];
    let goodBar = null;
    if (good !== null && linkRate !== null && linkRate > 0) {
      goodBar = el('div', { class: 'goodput', title: 'goodput ' + fmtPct(good / linkRate) + ' of the link rate' },
        el('span', { class: 'fill', style: { width: Math.min(100, (good / linkRate) * 100).toFixed(1) + '%' } }));
    }
    return el('div', { class: 'xfer' + (running ? ' running' : ''), 'data-transfer': name }, head, bar, el('div', { class: 'xfer-stats small' }, stats), goodBar);
  }

  // ---------------------------------------------------------------- jobs

  function renderJobs(st, colours) {
    const box = $('jobs-body');
    const jobs = isObj(st.jobs) ? st.jobs : null;
    const kids = [];
    if (jobs) {
      const parts = JOB_STATES.map(([k, c]) => ({ label: k, value: num(jobs[k]) || 0, colour: c, valueText: fmtInt(jobs[k]) }));
      kids.push(stackedBar(parts, 'big'));
      kids.push(legend(parts, true));
    } else kids.push(placeholder('no job counts yet'));

    const actors = objs(st.actors).slice().sort((a, b) => (num(b.tokens_per_s) || 0) - (num(a.tokens_per_s) || 0) || str(a.name).localeCompare(str(b.name)));
    kids.push(el('h3', { class: 'sub-head' }, 'Actors: throughput estimate τ and share of the newest batch'));
    if (!actors.length) kids.push(placeholder('no actors yet'));
    else {
      const maxT = actors.reduce((m, a) => Math.max(m, num(a.tokens_per_s) || 0), 0);
      kids.push(el('div', { class: 'tput-list' }, actors.map((a) => {
        const t = num(a.tokens_per_s);
        return el('div', { class: 'tput-row' },
          el('span', { class: 'tput-name', title: str(a.name) }, swatch(colours.actor(a.name)), str(a.name)),
          el('div', { class: 'tput-bar' }, t !== null && maxT > 0 ? el('span', { class: 'fill', style: { width: (t / maxT * 100).toFixed(1) + '%', background: colours.actor(a.name) } }) : null),
          el('span', { class: 'num' }, t === null ? '—' : fmtNum(t, t < 100 ? 1 : 0) + ' tok/s'),
          el('span', { class: 'num muted' }, 'share ' + fmtPct(a.share)),
          el('span', { class: 'num muted' }, fmtInt(a.leases) + (num(a.leases) === 1 ? ' lease' : ' leases')));
      })));
    }
    const refusals = {};
    for (const a of actors) {
      const r = obj(a.refused);
      for (const k of Object.keys(r)) if (num(r[k]) > 0) refusals[k] = (refusals[k] || 0) + r[k];
    }
    const reasons = Object.keys(refusals).sort((a, b) => refusals[b] - refusals[a]);
    if (actors.length) {
      kids.push(el('h3', { class: 'sub-head' }, 'Results refused since the hub started'));
      kids.push(reasons.length
        ? el('div', { class: 'legend' }, reasons.map((k) => el('span', { class: 'pill warn' }, k + ' ' + fmtInt(refusals[k]))))
        : el('p', { class: 'placeholder small' }, 'none'));
    }
    fill(box, kids);
  }

  // ---------------------------------------------------------------- batches

  function renderBatches(st, colours) {
    const box = $('batches-body');
    const batches = objs(st.batches).slice().sort((a, b) => (num(b.id) || 0) - (num(a.id) || 0)).slice(0, MAX_BATCHES);
    if (!batches.length) { fill(box, placeholder('no batches yet')); return; }
    const head = ['batch', 'version', 'state', 'progress', 'shares per actor', 'refusals', 'created', 'took'];
    const rows = batches.map((b) => {
      const jobs = obj(b.jobs);
      const jobParts = JOB_STATES.map(([k, c]) => ({ label: k, value: num(jobs[k]) || 0, colour: c }));
      const jobTotal = jobParts.reduce((s, p) => s + p.value, 0);
      const size = num(b.size) !== null ? b.size : jobTotal;
      const done = num(jobs.done) || 0;
      const failed = num(jobs.failed) || 0;
      const created = num(b.created_at_ms), finished = num(b.done_at_ms);
      let stateText = 'running', stateCls = 'info';
      if (b.cancelled === true) { stateText = 'cancelled'; stateCls = 'bad'; }
      else if (finished !== null || b.done === true) { stateText = failed > 0 ? 'done, ' + failed + ' failed' : 'done'; stateCls = failed > 0 ? 'warn' : 'ok'; }
      const shares = obj(b.shares);
      const shareParts = Object.keys(shares).filter((k) => num(shares[k]) !== null).sort()
        .map((k) => ({ label: k, value: shares[k], colour: colours.actor(k) }));
      const ref = countsOf(b.refusals);
      return el('tr', { 'data-batch': str(b.id) },
        el('td', { class: 'num strong' }, num(b.id) === null ? '—' : '#' + b.id),
        el('td', { class: 'num' }, fmtVersion(b.version)),
        el('td', null, el('span', { class: 'pill ' + stateCls }, stateText)),
        el('td', { class: 'progress-cell' },
          stackedBar(jobParts),
          el('span', { class: 'small muted', title: jobParts.map((p) => p.label + ' ' + p.value).join(', ') }, fmtInt(done) + ' / ' + fmtInt(size) + ' done')),
        el('td', { class: 'shares-cell' },
          shareParts.length ? [stackedBar(shareParts), legend(shareParts)] : el('span', { class: 'muted small' }, 'not scheduled yet')),
        el('td', { class: ref.total > 0 ? 'warn-text small' : 'muted small' }, ref.total > 0 ? ref.text : 'none'),
        el('td', { class: 'small', title: fmtDate(created) }, fmtAgo(created)),
        el('td', { class: 'num small' }, created !== null ? (finished !== null ? fmtMs(finished - created) : el('span', { class: 'muted' }, fmtMs(serverNow() - created) + '…')) : '—'));
    });
    fill(box, el('table', { class: 'grid batches' },
      el('thead', null, el('tr', null, head.map((h) => el('th', { class: h === 'batch' || h === 'version' || h === 'took' ? 'num' : null }, h)))),
      el('tbody', null, rows)));
  }

  // ---------------------------------------------------------------- charts

  /** A line chart of [{x, y, title}] as inline SVG with axes and tick labels. */
  function lineChart(points, opts) {
    const W = 600, H = 230, L = 58, R = 16, T = 12, B = 38;
    const xs = points.map((p) => p.x), ys = points.map((p) => p.y);
    // x spans the data exactly (batch ids); ticks are the nice values inside it.
    let xMin = Math.min(...xs), xMax = Math.max(...xs);
    if (!(xMax > xMin)) { xMin -= 1; xMax += 1; }
    const xn = niceTicks(xMin, xMax, 6, true);
    const xt = { lo: xMin, hi: xMax, step: xn.step, ticks: xn.ticks.filter((t) => t >= xMin - 1e-9 && t <= xMax + 1e-9) };
    let yMin = Math.min(...ys), yMax = Math.max(...ys);
    if (opts.zero) yMin = Math.min(0, yMin);
    if (opts.range) { yMin = Math.min(yMin, opts.range[0]); yMax = Math.max(yMax, opts.range[1]); }
    const yt = niceTicks(yMin, yMax, 4, false);
    const px = (x) => L + ((x - xt.lo) / (xt.hi - xt.lo || 1)) * (W - L - R);
    const py = (y) => H - B - ((y - yt.lo) / (yt.hi - yt.lo || 1)) * (H - T - B);
    const g = [];
    for (const t of yt.ticks) {
      g.push(sv('line', { x1: L, x2: W - R, y1: py(t), y2: py(t), class: 'grid-line' }));
      g.push(sv('text', { x: L - 6, y: py(t) + 4, 'text-anchor': 'end', class: 'tick' }, fmtTick(t, yt.step)));
    }
    // Thin out x labels so they never collide.
    const xEvery = Math.max(1, Math.ceil(xt.ticks.length / 7));
    xt.ticks.forEach((t, i) => {
      g.push(sv('line', { x1: px(t), x2: px(t), y1: H - B, y2: H - B + 4, class: 'axis' }));
      if (i % xEvery === 0) g.push(sv('text', { x: px(t), y: H - B + 16, 'text-anchor': 'middle', class: 'tick' }, fmtTick(t, xt.step)));
    });
    g.push(sv('line', { x1: L, x2: W - R, y1: H - B, y2: H - B, class: 'axis' }));
    g.push(sv('line', { x1: L, x2: L, y1: T, y2: H - B, class: 'axis' }));
    g.push(sv('text', { x: (L + W - R) / 2, y: H - 4, 'text-anchor': 'middle', class: 'axis-title' }, opts.xLabel));
    g.push(sv('text', { x: 12, y: (T + H - B) / 2, 'text-anchor': 'middle', class: 'axis-title', transform: `rotate(-90 12 ${(T + H - B) / 2})` }, opts.yLabel));
    const d = points.map((p, i) => (i ? 'L' : 'M') + px(p.x).toFixed(1) + ' ' + py(p.y).toFixed(1)).join('');
    if (points.length > 1) {
      const area = d + `L${px(points[points.length - 1].x).toFixed(1)} ${H - B}L${px(points[0].x).toFixed(1)} ${H - B}Z`;
      g.push(sv('path', { d: area, fill: opts.colour, 'fill-opacity': 0.08, stroke: 'none' }));
    }
    g.push(sv('path', { d, fill: 'none', stroke: opts.colour, 'stroke-width': 2, 'stroke-linejoin': 'round', 'stroke-linecap': 'round' }));
    const showDots = points.length <= 60;
    points.forEach((p, i) => {
      const lastOne = i === points.length - 1;
      if (!showDots && !lastOne) {
        // Invisible hit targets keep the tooltips when dots are hidden.
        g.push(sv('circle', { cx: px(p.x), cy: py(p.y), r: 4, fill: 'transparent' }, svgTitle(p.title)));
        return;
      }
      g.push(sv('circle', { cx: px(p.x), cy: py(p.y), r: lastOne ? 4 : 2.6, fill: lastOne ? opts.colour : '#fff', stroke: opts.colour, 'stroke-width': 1.5 }, svgTitle(p.title)));
    });
    return sv('svg', { class: 'chart-svg', viewBox: `0 0 ${W} ${H}`, width: '100%', preserveAspectRatio: 'xMidYMid meet', role: 'img', 'aria-label': opts.yLabel + ' by ' + opts.xLabel }, g);
  }

  function renderCharts(st) {
    const steps = objs(st.steps).filter((s) => num(s.batch) !== null).sort((a, b) => a.batch - b.batch);
    const tip = (s, what) => 'batch ' + s.batch + (num(s.version) !== null ? ' · v' + s.version : '') + ' · ' + what +
      (num(s.samples) !== null ? ' · ' + fmtInt(s.samples) + ' samples' : '') + (num(s.seconds) !== null ? ' · ' + fmtMs(s.seconds * 1000) : '');
    const reward = steps.filter((s) => num(s.mean_reward) !== null)
      .map((s) => ({ x: s.batch, y: s.mean_reward, title: tip(s, 'mean reward ' + s.mean_reward.toFixed(3)) }));
    const tput = steps.filter((s) => num(s.tokens_per_s) !== null)
      .map((s) => ({ x: s.batch, y: s.tokens_per_s, title: tip(s, fmtNum(s.tokens_per_s, 1) + ' tok/s' + (num(s.tokens) !== null ? ' · ' + fmtInt(s.tokens) + ' tokens' : '')) }));
    safe('reward-body', () => {
      const box = $('reward-body');
      if (!reward.length) { fill(box, placeholder('no finished batches yet')); setText('reward-last', ''); return; }
      const last = reward[reward.length - 1];
      setText('reward-last', 'latest ' + last.y.toFixed(3) + ' (batch ' + last.x + ') · ' + reward.length + (reward.length === 1 ? ' batch' : ' batches'));
      fill(box, lineChart(reward, { xLabel: 'batch', yLabel: 'mean reward', colour: '#4a9468', zero: false }));
    });
    safe('throughput-body', () => {
      const box = $('throughput-body');
      if (!tput.length) { fill(box, placeholder('no finished batches yet')); setText('throughput-last', ''); return; }
      const last = tput[tput.length - 1];
      setText('throughput-last', 'latest ' + fmtNum(last.y, 0) + ' tok/s (batch ' + last.x + ')');
      fill(box, lineChart(tput, { xLabel: 'batch', yLabel: 'tokens / s', colour: '#3b6ea5', zero: true }));
    });
  }

  // ---------------------------------------------------------------- fault & event log

  const FAULT_KINDS = { disconnect: 'bad', publish_failed: 'bad', anchor_failed: 'bad', refetch: 'warn', refused: 'warn', lease_expired: 'warn' };
  const EVENT_KINDS = { connected: 'ok', disconnected: 'muted', published: 'info', lagged: 'warn' };

  function logKey(e) { return [e.at_ms, e.kind, e.peer, e.version, e.detail].map(str).join('|'); }

  function renderLogTools() {
    const box = $('log-tools');
    if (!box) return;
    const cb = el('input', { type: 'checkbox', id: 'log-all', onchange: (ev) => { state.logAll = ev.target.checked; safe('log-body', () => renderLog(obj(state.status))); } });
    cb.checked = state.logAll;
    fill(box, el('label', { class: 'check', for: 'log-all' }, cb, ' show connections & publishes'));
  }

  function renderLog(st) {
    const box = $('log-body');
    const seen = new Set();
    const entries = [];
    const add = (e, isFault) => {
      const entry = { at_ms: num(e.at_ms), kind: str(e.kind) || 'fault', peer: e.peer, version: e.version, detail: e.detail, fault: isFault };
      const k = logKey(entry);
      if (seen.has(k)) return;
      seen.add(k);
      entries.push(entry);
    };
    objs(st.faults).forEach((f) => add(f, true));
    state.live.forEach((e) => add(e, e.fault === true));
    entries.sort((a, b) => (b.at_ms === null ? -Infinity : b.at_ms) - (a.at_ms === null ? -Infinity : a.at_ms));
    const faults = entries.filter((e) => e.fault).length;
    const shown = (state.logAll ? entries : entries.filter((e) => e.fault)).slice(0, MAX_LOG);
    setText('log-count', faults + (faults === 1 ? ' fault' : ' faults') + ' · ' + (entries.length - faults) + ' events since this page opened');
    if (!shown.length) { fill(box, placeholder(state.logAll ? 'no faults or events yet' : 'no faults yet')); return; }
    fill(box, el('div', { class: 'log-scroll' }, el('table', { class: 'grid log' },
      el('thead', null, el('tr', null, el('th', null, 'time'), el('th', null, 'kind'), el('th', null, 'peer'), el('th', { class: 'num' }, 'version'), el('th', null, 'detail'))),
      el('tbody', null, shown.map((e) => {
        const cls = e.fault ? (FAULT_KINDS[e.kind] || 'bad') : (EVENT_KINDS[e.kind] || 'muted');
        return el('tr', { class: e.fault ? 'is-fault' : null, 'data-kind': e.kind },
          el('td', { class: 'time', title: fmtDate(e.at_ms) + ' · ' + fmtAgo(e.at_ms) }, fmtClock(e.at_ms, true)),
          el('td', null, el('span', { class: 'pill ' + cls }, e.kind)),
          el('td', { class: 'peer' }, str(e.peer) || '—'),
          el('td', { class: 'num' }, num(e.version) === null ? '—' : String(e.version)),
          el('td', { class: 'detail' }, str(e.detail)));
      })))));
  }

  function pushLive(entry) {
    state.live.push(entry);
    if (state.live.length > MAX_LOG) state.live.splice(0, state.live.length - MAX_LOG);
    safe('log-body', () => renderLog(obj(state.status)));
  }

  // ---------------------------------------------------------------- render all

  function renderBanner() {
    const b = $('banner');
    if (!b) return;
    if (state.fetchError) {
      b.hidden = false;
      b.textContent = 'Could not read ' + STATUS_URL + ': ' + state.fetchError +
        (state.fetchedAt ? ' — showing data from ' + fmtDur(Date.now() - state.fetchedAt) + ' ago.' : '.');
    } else {
      b.hidden = true;
      b.textContent = '';
    }
  }

  function renderAll() {
    const st = obj(state.status);
    let colours;
    try { colours = colourMaps(st); } catch (e) { colours = { region: () => '#7b8794', actor: () => '#7b8794' }; }
    safe('header', () => renderHeader(st));
    safe('regions-body', () => renderRegions(st, colours));
    safe('timeline-body', () => renderTimeline(st, colours));
    safe('transfers-body', () => renderTransfers(st, colours));
    safe('jobs-body', () => renderJobs(st, colours));
    safe('batches-body', () => renderBatches(st, colours));
    renderCharts(st);
    safe('log-body', () => renderLog(st));
    renderBanner();
  }

  // ---------------------------------------------------------------- status reads

  let inFlight = false;
  let pending = false;
  let lastFetchStart = 0;
  let gapTimer = null;
  let pollTimer = null;

  function transferRunning() {
    const st = obj(state.status);
    return objs(st.regions).some((r) => objs(r.relays).some((rel) => isObj(rel.transfer) && rel.transfer.done === false));
  }

  function schedulePoll() {
    if (pollTimer) clearTimeout(pollTimer);
    pollTimer = setTimeout(() => { pollTimer = null; requestRefresh(); }, transferRunning() ? POLL_TRANSFER_MS : POLL_IDLE_MS);
  }

  /** Ask for a status read: at most one in flight, at most one per MIN_FETCH_GAP_MS. */
  function requestRefresh() {
    pending = true;
    pump();
  }

  function pump() {
    if (inFlight || !pending) return;
    const wait = lastFetchStart + MIN_FETCH_GAP_MS - Date.now();
    if (wait > 0) {
      if (!gapTimer) gapTimer = setTimeout(() => { gapTimer = null; pump(); }, wait);
      return;
    }
    pending = false;
    inFlight = true;
    lastFetchStart = Date.now();
    fetch(STATUS_URL, { cache: 'no-store', headers: { Accept: 'application/json' } })
      .then((r) => {
        if (!r.ok) throw new Error('HTTP ' + r.status);
        return r.json();
      })
      .then((st) => {
        if (!isObj(st)) throw new Error('not a JSON object');
        state.status = st;
        const now = num(st.now_ms);
        state.skew = now === null ? 0 : now - Date.now();
        state.fetchedAt = Date.now();
        state.fetchError = null;
        renderAll();
      })
      .catch((e) => {
        state.fetchError = str(e && e.message ? e.message : e) || 'failed';
        renderBanner();
        if (!state.status) {
          for (const id of ['regions-body', 'timeline-body', 'transfers-body', 'jobs-body', 'batches-body', 'reward-body', 'throughput-body', 'log-body']) {
            const box = $(id);
            if (box && box.querySelector('.placeholder')) fill(box, placeholder('waiting for ' + STATUS_URL + '…'));
          }
        }
      })
      .finally(() => {
        inFlight = false;
        schedulePoll();
        pump();
      });
  }

  // ---------------------------------------------------------------- event stream

  function setConn(s, text) {
    state.conn = s;
    const c = $('conn');
    if (c) c.setAttribute('data-state', s);
    setText('conn-text', text);
  }

  function parseData(ev) {
    try { const d = JSON.parse(ev.data); return isObj(d) ? d : {}; } catch (e) { return {}; }
  }

  function onEvent(name, ev) {
    state.eventCount++;
    if (state.conn !== 'live') setConn('live', 'live');
    const d = parseData(ev);
    const at = num(d.at_ms) !== null ? d.at_ms : serverNow();
    switch (name) {
      case 'fault':
        pushLive({ at_ms: at, kind: str(d.kind) || 'fault', peer: d.peer, version: d.version, detail: d.detail, fault: true });
        break;
      case 'connected':
      case 'disconnected': {
        const who = [d.role, d.region ? 'in ' + str(d.region) : null].filter(Boolean).map(str).join(' ');
        pushLive({ at_ms: at, kind: name, peer: d.peer, version: null, detail: who });
        break;
      }
      case 'published': {
        const parts = [];
        if (num(d.bytes) !== null) parts.push(fmtBytes(d.bytes));
        if (num(d.changes) !== null) parts.push(fmtInt(d.changes) + ' changes');
        const r = fmtRatio(d.ratio);
        if (r) parts.push(r);
        pushLive({ at_ms: at, kind: 'published', peer: null, version: d.version, detail: parts.join(' · ') });
        break;
      }
      case 'lagged':
        pushLive({ at_ms: at, kind: 'lagged', peer: null, version: null, detail: 'this page missed ' + (num(d.missed) !== null ? fmtInt(d.missed) : 'some') + ' events; status re-read' });
        break;
      default:
        break;
    }
    requestRefresh();
  }

  let source = null;
  function openEvents() {
    if (typeof window.EventSource !== 'function') { setConn('polling', 'polling (no event stream)'); return; }
    try { source = new EventSource(EVENTS_URL); } catch (e) {
      setConn('offline', 'no event stream');
      setTimeout(openEvents, EVENTS_RETRY_MS);
      return;
    }
    const es = source;
    es.onopen = () => { setConn('live', 'live'); requestRefresh(); };
    es.onerror = () => {
      if (es.readyState === EventSource.CLOSED) {
        es.close();
        setConn('offline', 'disconnected — retrying');
        setTimeout(openEvents, EVENTS_RETRY_MS);
      } else setConn('reconnecting', 'reconnecting…');
    };
    for (const n of EVENT_NAMES) es.addEventListener(n, (ev) => onEvent(n, ev));
    es.onmessage = (ev) => onEvent('message', ev);
  }

  // ---------------------------------------------------------------- start

  function start() {
    renderTimelineTools();
    renderLogTools();
    requestRefresh();
    openEvents();
    setInterval(tickClock, 1000);
    let resizeTimer = null;
    window.addEventListener('resize', () => {
      if (resizeTimer) clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => {
        resizeTimer = null;
        const st = obj(state.status);
        safe('timeline-body', () => renderTimeline(st, colourMaps(st)));
      }, 200);
    });
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
