"""A run's timeline from its event log: per request (received, queued, first scheduled,
first token, last token, end) and per engine step (batch size, tokens, KV use).

`text` prints it one line per request (`tailrace replay LOG --timeline`); `html` writes
one self-contained page (`--html FILE`): a waterfall of the requests (queue, prefill and
decode segments, preemption and abort/error marks, a hover with the request's figures)
above the engine's steps over time. No network: the CSS, the script and the data are
inline.
"""
from __future__ import annotations

import html as html_escape
from typing import TYPE_CHECKING

import attrs
import orjson

if TYPE_CHECKING:
    from pipeline.core.logfile import Log


@attrs.define
class RequestTimes:
    request_id: str
    api: str = "?"
    stream: bool | None = None
    n: int = 1
    received: float | None = None        # seconds since the log's start
    queued: float | None = None          # admitted
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    end: float | None = None             # finished, aborted or failed
    outcome: str = "unfinished"          # finished | aborted | failed | rejected | unfinished
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None
    preemptions: list[float] = attrs.field(factory=list)

    def durations(self) -> dict[str, float | None]:
        """queue, prefill, decode and total, in milliseconds (None when unknown)."""
        def ms(a, b):
            return None if a is None or b is None else round((b - a) * 1e3, 3)
        return {"queue": ms(self.received, self.first_scheduled),
                "prefill": ms(self.first_scheduled, self.first_token),
                "decode": ms(self.first_token, self.last_token),
                "total": ms(self.received, self.end)}


@attrs.define
class StepRow:
    step: int
    t: float                  # when its tokens came back (seconds since the log's start)
    duration_s: float | None  # the GPU step's own time
    batch: int                # sequences in the step
    tokens: int               # tokens computed (prefill chunks and decodes)
    prefill_tokens: int
    kv_used: int
    kv_total: int | None
    running: int
    waiting: int
    preempted: int


@attrs.define
class Timeline:
    requests: list[RequestTimes]
    steps: list[StepRow]
    wall_time: float | None   # the wall clock at t = 0
    header: dict


def build(log: Log) -> Timeline:
    events = log.events
    header = log.header
    t0 = header.get("t", events[0].get("t", 0.0) if events else 0.0)
    kv_total = header.get("kv_blocks_total")
    reqs: dict[str, RequestTimes] = {}
    durations: dict[int, float] = {}
    steps: list[StepRow] = []

    def rel(t):
        return None if t is None else round(t - t0, 6)

    def get(rid: str) -> RequestTimes:
        r = reqs.get(rid)
        if r is None:
            r = reqs[rid] = RequestTimes(rid)
        return r

    for ev in events:
        kind, rid, t = ev.get("event"), ev.get("request_id"), ev.get("t")
        if kind == "received":
            r = get(rid)
            r.api = ev.get("api", r.api)
            r.received = rel(ev.get("arrival", t))
            body = ev.get("body")
            if isinstance(body, dict):
                r.stream = bool(body.get("stream"))
        elif kind == "admitted":
            get(rid).queued = rel(t)
        elif kind in ("rejected", "render_failed"):
            r = get(rid)
            r.outcome, r.end = "rejected", rel(t)
            r.status = ev.get("status", 500)
            r.error = ev.get("message") or ev.get("error")
        elif kind == "step":
            durations[ev.get("step")] = ev.get("duration_s")
        elif kind == "scheduled":
            msg = ev.get("message") or {}
            done = rel(msg.get("done_at") or t)
            for req in msg.get("new_requests", ()):
                r = get(req["request_id"])
                r.api, r.stream, r.n = req.get("api", r.api), req.get("stream"), req.get("n", 1)
                if r.received is None:
                    r.received = rel(req.get("arrival"))
            for d in msg.get("deltas", ()):
                r = get(d["request_id"])
                if d.get("scheduled_at") and r.first_scheduled is None:
                    r.first_scheduled = rel(d["scheduled_at"])
                if d.get("token_ids"):
                    if r.first_token is None:
                        r.first_token = done
                    r.last_token = done
                if d.get("error"):
                    r.error = d["error"]
            plan = ev.get("plan") or {}
            chunks = plan.get("chunks", ())
            preempted = ev.get("preempted") or ()
            for seq_id in preempted:
                get(seq_id.split("#")[0]).preemptions.append(rel(t))
            if chunks or preempted:
                steps.append(StepRow(
                    step=msg.get("step", plan.get("step", 0)), t=done,
                    duration_s=durations.get(plan.get("step")), batch=len(chunks),
                    tokens=sum(c[2] for c in chunks),
                    prefill_tokens=sum(c[2] for c in chunks if c[2] > 1 or not c[3]),
                    kv_used=msg.get("kv_blocks_used", 0), kv_total=kv_total,
                    running=msg.get("num_running", 0), waiting=msg.get("num_waiting", 0),
                    preempted=len(preempted)))
        elif kind == "finished":
            r = get(rid)
            reason = ev.get("finish_reason")
            r.finish_reason, r.end = reason, rel(t)
            r.outcome = {"abort": "aborted", "error": "failed"}.get(reason, "finished")
            r.prompt_tokens = ev.get("prompt_tokens")
            r.cached_tokens = ev.get("cached_tokens")
            r.output_tokens = ev.get("completion_tokens")
            r.reasoning_tokens = ev.get("reasoning_tokens")
        elif kind == "reply_end":
            r = get(rid)
            r.status = ev.get("status")
            if r.status and r.status >= 500 and r.outcome == "finished":
                r.outcome = "failed"
    for s in steps:
        if s.duration_s is None:
            s.duration_s = durations.get(s.step)
    ordered = sorted(reqs.values(), key=lambda r: (r.received is None, r.received or 0.0))
    return Timeline(ordered, steps, header.get("wall_time"), header)


# -- text ----------------------------------------------------------------------------------
def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.3f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _n(v) -> str:
    return "-" if v is None else str(v)


def text(tl: Timeline) -> str:
    lines = []
    if tl.wall_time is not None:
        import datetime
        start = datetime.datetime.fromtimestamp(tl.wall_time, datetime.timezone.utc)
        lines.append(f"# t = 0 at {start.isoformat(timespec='milliseconds')}; times in seconds "
                     f"since, durations in ms")
    head = ("request", "api", "received", "queued", "scheduled", "1st_token", "last_token",
            "end", "queue_ms", "prefill_ms", "decode_ms", "total_ms", "prompt", "cached",
            "output", "outcome")
    rows = [head]
    for r in tl.requests:
        d = r.durations()
        api = r.api + ("" if r.stream is None else ("/stream" if r.stream else ""))
        if r.n > 1:
            api += f"/n={r.n}"
        outcome = r.outcome
        if r.outcome == "finished":
            outcome = r.finish_reason or "finished"
        elif r.outcome in ("failed", "rejected"):
            outcome = r.outcome + (f" {r.status}" if r.status else "")
        if r.preemptions:
            outcome += f" (preempted x{len(r.preemptions)})"
        rows.append((r.request_id, api, _s(r.received), _s(r.queued), _s(r.first_scheduled),
                     _s(r.first_token), _s(r.last_token), _s(r.end), _ms(d["queue"]),
                     _ms(d["prefill"]), _ms(d["decode"]), _ms(d["total"]), _n(r.prompt_tokens),
                     _n(r.cached_tokens), _n(r.output_tokens), outcome))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    lines.append(f"# {len(tl.requests)} requests, {len(tl.steps)} engine steps")
    return "\n".join(lines) + "\n"


# -- html ----------------------------------------------------------------------------------
_CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fff}
h1{font-size:18px;margin:0 0 4px} .meta{color:#666;margin-bottom:12px}
.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:12px;height:10px;margin-right:4px;vertical-align:middle}
#waterfall{position:relative;border-top:1px solid #ddd}
.row{display:flex;align-items:center;height:20px;border-bottom:1px solid #f0f0f0}
.row:hover{background:#f6f8ff}
#axisrow{display:flex;height:16px}#axisrow .label{height:16px}
#axis{position:relative;flex:1;height:16px;font:10px sans-serif;color:#666}
.tick{position:absolute;top:2px;border-left:1px solid #bbb;padding-left:2px}
.label{width:230px;flex:none;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;
 font:11px monospace;padding-right:8px}
.lane{position:relative;flex:1;height:14px}
.seg{position:absolute;top:2px;height:10px;min-width:1px}
.queue{background:#c9ccd1}.prefill{background:#f0a030}.decode{background:#3a7bd5}
.mark{position:absolute;top:0;width:2px;height:14px}
.preempt{background:#8e44ad}.abort{background:#e67e22;width:4px}.error{background:#d62728;width:4px}
#tip{position:fixed;display:none;background:#222;color:#fff;padding:6px 8px;border-radius:4px;
 font:11px/1.35 monospace;white-space:pre;pointer-events:none;z-index:9}
h2{font-size:14px;margin:18px 0 6px} svg{display:block;border:1px solid #ddd}
.axis{font:10px sans-serif;fill:#666}
"""

_JS = r"""
(function(){
const D = JSON.parse(document.getElementById('data').textContent);
const span = Math.max(1e-6, D.end);
const pct = t => (100 * t / span).toFixed(3) + '%';
const wf = document.getElementById('waterfall'), tip = document.getElementById('tip');
function seg(lane, cls, a, b) {
  if (a == null || b == null) return;
  const s = document.createElement('div'); s.className = 'seg ' + cls;
  s.style.left = pct(a); s.style.width = pct(Math.max(0, b - a)); lane.appendChild(s);
}
function mark(lane, cls, t) {
  if (t == null) return;
  const m = document.createElement('div'); m.className = 'mark ' + cls;
  m.style.left = pct(t); lane.appendChild(m);
}
const f = v => v == null ? '-' : v;
for (const r of D.requests) {
  const row = document.createElement('div'); row.className = 'row';
  row.dataset.requestId = r.request_id;
  const label = document.createElement('div'); label.className = 'label';
  label.textContent = (r.request_id.length > 14 ? r.request_id.slice(0, 12) + '\u2026' : r.request_id)
    + ' ' + r.api + (r.stream ? '/stream' : '') + (r.n > 1 ? ' n=' + r.n : '');
  label.title = r.request_id; row.appendChild(label);
  const lane = document.createElement('div'); lane.className = 'lane'; row.appendChild(lane);
  const end = r.end != null ? r.end : D.end;
  seg(lane, 'queue', r.received, r.first_scheduled != null ? r.first_scheduled : end);
  seg(lane, 'prefill', r.first_scheduled, r.first_token != null ? r.first_token : (r.first_scheduled != null ? end : null));
  seg(lane, 'decode', r.first_token, r.last_token);
  for (const p of r.preemptions) mark(lane, 'preempt', p);
  if (r.outcome == 'aborted') mark(lane, 'abort', end);
  if (r.outcome == 'failed' || r.outcome == 'rejected') mark(lane, 'error', end);
  const d = r.durations;
  const info = [r.request_id, 'api        ' + r.api + (r.stream ? ' (stream)' : '') + (r.n > 1 ? ' n=' + r.n : ''),
    'outcome    ' + r.outcome + (r.finish_reason ? ' (' + r.finish_reason + ')' : '') + (r.status ? ' status ' + r.status : ''),
    'queue      ' + f(d.queue) + ' ms', 'prefill    ' + f(d.prefill) + ' ms',
    'decode     ' + f(d.decode) + ' ms', 'total      ' + f(d.total) + ' ms',
    'prompt     ' + f(r.prompt_tokens) + ' tokens (' + f(r.cached_tokens) + ' cached)',
    'output     ' + f(r.output_tokens) + ' tokens',
    'preempted  ' + r.preemptions.length + 'x'];
  if (r.error) info.push('error      ' + r.error);
  row.addEventListener('mousemove', e => {
    tip.textContent = info.join('\n'); tip.style.display = 'block';
    tip.style.left = (e.clientX + 14) + 'px'; tip.style.top = (e.clientY + 10) + 'px';
  });
  row.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
  wf.appendChild(row);
}
document.getElementById('count').textContent = D.requests.length;
// a time axis above the rows
const axis = document.getElementById('axis'), step = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
  0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600].find(s => span / s <= 10) || 1200;
for (let t = 0; t <= span + 1e-9; t += step) {
  const k = document.createElement('span'); k.className = 'tick'; k.style.left = pct(t);
  k.textContent = (step < 1 ? t.toFixed(step < 0.01 ? 3 : step < 0.1 ? 2 : 1) : t.toFixed(0)) + ' s';
  axis.appendChild(k);
}
// the engine's steps: batch size and tokens as bars, KV use as a line
const svg = document.getElementById('steps'), W = svg.clientWidth || 1000, H = 160, pad = 238;
const NS = 'http://www.w3.org/2000/svg';
function el(name, attrs) { const e = document.createElementNS(NS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]); svg.appendChild(e); return e; }
const x = t => pad + (W - pad - 2) * t / span;
const maxTok = Math.max(1, ...D.steps.map(s => s.tokens));
const maxBatch = Math.max(1, ...D.steps.map(s => s.batch));
el('text', {x: 4, y: 14, class: 'axis'}).textContent = 'tokens per step (max ' + maxTok + ')';
el('text', {x: 4, y: 94, class: 'axis'}).textContent = 'batch size (max ' + maxBatch + ')';
const maxKv = Math.max(1, ...D.steps.map(s => s.kv_used));
el('text', {x: 4, y: 150, class: 'axis'}).textContent = 'KV blocks used (max ' + maxKv + ' of ' + f(D.kv_total) + ')';
let path = '';
for (const s of D.steps) {
  const x1 = x(s.t - (s.duration_s || 0)), w = Math.max(1, x(s.t) - x1);
  const h1 = 60 * s.tokens / maxTok, h2 = 50 * s.batch / maxBatch;
  const b = el('rect', {x: x1, y: 70 - h1, width: w, height: h1, fill: s.prefill_tokens ? '#f0a030' : '#3a7bd5', class: 'step'});
  el('rect', {x: x1, y: 130 - h2, width: w, height: h2, fill: '#6b8e23'});
  const t = document.createElementNS(NS, 'title');
  t.textContent = 'step ' + s.step + ': batch ' + s.batch + ', ' + s.tokens + ' tokens (' + s.prefill_tokens + ' prefill), KV ' + s.kv_used + '/' + f(s.kv_total) + ', running ' + s.running + ', waiting ' + s.waiting + (s.preempted ? ', preempted ' + s.preempted : '');
  b.appendChild(t);
  const ky = 158 - 24 * s.kv_used / maxKv;
  path += (path ? 'L' : 'M') + x(s.t).toFixed(1) + ' ' + ky.toFixed(1);
}
if (path) el('path', {d: path, stroke: '#d62728', fill: 'none', 'stroke-width': 1.5});
})();
"""


def html(tl: Timeline) -> str:
    times = [t for r in tl.requests for t in (r.end, r.last_token, r.received) if t is not None]
    times += [s.t for s in tl.steps]
    data = {
        "end": max(times, default=1.0),
        "kv_total": tl.header.get("kv_blocks_total"),
        "requests": [{**attrs.asdict(r), "durations": r.durations()} for r in tl.requests],
        "steps": [attrs.asdict(s) for s in tl.steps],
    }
    payload = orjson.dumps(data).decode().replace("</", "<\\/")
    model = html_escape.escape(str(tl.header.get("model_name") or tl.header.get("model") or "?"))
    version = html_escape.escape(str(tl.header.get("tailrace_version", "?")))
    start = ""
    if tl.wall_time is not None:
        import datetime
        start = datetime.datetime.fromtimestamp(tl.wall_time, datetime.timezone.utc).isoformat(
            timespec="seconds")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tailrace timeline</title>
<style>{_CSS}</style></head><body>
<h1>tailrace timeline</h1>
<div class="meta">{model} &middot; tailrace {version} &middot; started {start} &middot;
<span id="count">0</span> requests, {len(tl.steps)} engine steps, {data['end']:.3f} s</div>
<div class="legend"><span><i class="queue"></i>queue</span><span><i class="prefill"></i>prefill
</span><span><i class="decode"></i>decode</span><span><i class="preempt"></i>preemption</span>
<span><i class="abort"></i>abort</span><span><i class="error"></i>error</span></div>
<div id="axisrow"><div class="label"></div><div id="axis"></div></div>
<div id="waterfall"></div>
<h2>Engine steps</h2>
<svg id="steps" width="100%" height="162"></svg>
<div class="meta">Steps: tokens computed (orange: a prefill chunk is in the step; blue:
decodes only), batch size (green), KV blocks in use (red). Hover a row or a bar for its
figures.</div>
<div id="tip"></div>
<script type="application/json" id="data">{payload}</script>
<script>{_JS}</script>
</body></html>
"""
