"""The plan as one self-contained HTML file (inline CSS and SVG, no network, no CDN):

- the model layer by layer, each node a cell coloured by its output placement (forward, then
  backward), with its module path, op and source line on hover;
- communication per layer and per collective kind as bar charts;
- memory per rank (parameters, gradients, optimizer state, peak activations) as stacked bars;
- the parameters' placements and every node with its module path and source line.

    shardwise plan tests/models/zoo.py:transformer --mesh 2x2 --names dp,tp --html plan.html
"""
from __future__ import annotations

from html import escape

from ...core.units import fmt_bytes
from ...core.units import fmt_seconds
from ...lower.allocator import ALLOCATOR_NAMES, ALLOCATORS
from .pipeline import section as pipeline_section
from .text import param_groups

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf")
KIND_COLOURS = {"all_reduce": "#e15759", "all_gather": "#4e79a7", "reduce_scatter": "#f28e2b",
                "all_to_all": "#59a14f", "ring": "#b07aa1", "send_recv": "#76b7b2"}
MEM_COLOURS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer_state": "#e15759",
               "activations": "#59a14f"}

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0} .card{background:#fff;border:1px solid #ddd;border-radius:6px;
padding:8px 14px} .card b{display:block;font-size:18px} .muted{color:#666} svg{background:#fff;border:1px solid #ddd;
border-radius:6px} table{border-collapse:collapse;background:#fff;font-size:12.5px} td,th{border:1px solid #e2e2e2;
padding:2px 6px;text-align:left;vertical-align:top} th{background:#f0f0f0;position:sticky;top:0} code{font-size:12px}
.legend span{display:inline-block;margin:2px 10px 2px 0} .sw{display:inline-block;width:12px;height:12px;
vertical-align:middle;margin-right:4px;border-radius:2px} input{padding:4px 8px;margin:6px 0;width:320px}
.scroll{max-height:520px;overflow:auto;border:1px solid #ddd}
"""

FILTER_JS = """
document.getElementById('filter').addEventListener('input', function (e) {
  var q = e.target.value.toLowerCase();
  var rows = document.querySelectorAll('#nodes tbody tr');
  for (var i = 0; i < rows.length; i++) {
    rows[i].style.display = rows[i].textContent.toLowerCase().indexOf(q) >= 0 ? '' : 'none';
  }
});
"""


def _colours(data: dict) -> dict:
    """Placement string -> colour, the commonest placement first."""
    count: dict = {}
    for r in data["nodes"]:
        count[r["placement"]] = count.get(r["placement"], 0) + 1
    order = sorted(count, key=lambda p: -count[p])
    return {p: PALETTE[i] if i < len(PALETTE) else f"hsl({(i * 137.5) % 360:.0f},55%,{45 + 10 * (i % 3)}%)"
            for i, p in enumerate(order)}


def _legend(items: dict) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i class="sw" style="background:{c}"></i>{escape(k)}</span>' for k, c in items.items()) + "</div>"


def _layers_svg(data: dict, colours: dict, cell: int = 9) -> str:
    """One row per module: its forward nodes then its backward nodes, one coloured cell each."""
    modules: dict = {}
    for r in data["nodes"]:
        modules.setdefault(r["module"] or "(top level)", {"forward": [], "backward": []})[
            "backward" if r["phase"] == "backward" else "forward"].append(r)
    label_w, row_h = 260, cell + 5
    fw = max((len(m["forward"]) for m in modules.values()), default=1)
    bw = max((len(m["backward"]) for m in modules.values()), default=0)
    gap = 24
    width = label_w + (fw + bw) * (cell + 1) + gap + 20
    height = 24 + row_h * len(modules) + 8
    parts = [f'<svg id="layers" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
             f'<text x="{label_w}" y="15" font-size="12" fill="#555">forward</text>',
             f'<text x="{label_w + fw * (cell + 1) + gap}" y="15" font-size="12" fill="#555">backward</text>']
    for i, (mod, phases) in enumerate(modules.items()):
        y = 24 + i * row_h
        parts.append(f'<text x="{label_w - 6}" y="{y + cell}" font-size="11" text-anchor="end">'
                     f'{escape(mod[-40:])}</text>')
        for phase, x0 in (("forward", label_w), ("backward", label_w + fw * (cell + 1) + gap)):
            for j, r in enumerate(phases[phase]):
                tip = f"{r['name']} ({r['op']}) {r['placement']}\n{r['module']}\n{r['source']}"
                if r["collectives"]:
                    tip += "\n" + "\n".join(c["repr"] for c in r["collectives"])
                stroke = ' stroke="#000" stroke-width="1.5"' if r["collectives"] else ""
                parts.append(f'<rect x="{x0 + j * (cell + 1)}" y="{y}" width="{cell}" height="{cell}" rx="1.5" '
                             f'fill="{colours.get(r["placement"], "#999")}"{stroke}><title>{escape(tip)}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


def _hbars(rows: list, colours: dict, svg_id: str, unit=fmt_bytes, label_w: int = 260) -> str:
    """Horizontal stacked bars: rows of (label, {segment: value})."""
    bar_w, row_h = 420, 18
    top = max((sum(v.values()) for _, v in rows), default=0) or 1
    height = 10 + row_h * max(len(rows), 1) + 10
    width = label_w + bar_w + 110
    parts = [f'<svg id="{svg_id}" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    if not rows:
        parts.append('<text x="12" y="24" font-size="12" fill="#555">none</text>')
    for i, (label, segs) in enumerate(rows):
        y, x = 10 + i * row_h, label_w
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" font-size="11" text-anchor="end">{escape(label[-40:])}</text>')
        for seg, v in segs.items():
            w = bar_w * v / top
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="{row_h - 4}" '
                         f'fill="{colours.get(seg, "#999")}"><title>{escape(f"{label}: {seg} {unit(v)}")}</title></rect>')
            x += w
        parts.append(f'<text x="{x + 6:.1f}" y="{y + 12}" font-size="11" fill="#444">{unit(sum(segs.values()))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _node_table(data: dict) -> str:
    head = "<tr><th>node</th><th>op</th><th>module</th><th>phase</th><th>inputs -> outputs</th><th>shape</th>" \
           "<th>collectives</th><th>source</th></tr>"
    body = []
    for r in data["nodes"] + data["outputs"]:
        comm = "<br>".join(escape(c["repr"]) for c in r["collectives"])
        shape = escape(" ".join(str(s) for s in r["out_shapes"] if s is not None))
        body.append(f"<tr><td>{escape(r['name'])}</td><td><code>{escape(r['op'])}</code></td><td>{escape(r['module'])}"
                    f"</td><td>{r['phase']}</td><td>{escape(' '.join(r['ins']))} -&gt; {escape(' '.join(r['outs']))}</td>"
                    f"<td>{shape}</td><td>{comm}</td><td><code>{escape(r['source'])}</code></td></tr>")
    return (f'<div class="scroll"><table id="nodes"><thead>{head}</thead><tbody>{"".join(body)}</tbody>'
            f"</table></div>")


def _param_table(data: dict) -> str:
    rows = "".join(f"<tr><td>{escape(p)}</td><td>{escape(pl)}</td><td>{shape}</td><td>{n}</td>"
                   f"<td>{escape(why)}</td></tr>" for p, pl, shape, n, why in param_groups(data))
    return ("<table><tr><th>parameter</th><th>placements</th><th>shape</th><th>count</th><th>placed by</th></tr>"
            f"{rows}</table>")


def _layer_table(data: dict) -> str:
    """The cost per layer (lower/explain.layer_rows): what Plan.summary() ends with."""
    rows = "".join(f"<tr><td>{escape(lc['layer'])}</td><td>{fmt_bytes(lc['comm_bytes'])}</td>"
                   f"<td>{fmt_seconds(lc['comm_s'])}</td><td>{fmt_seconds(lc['compute_s'])}</td>"
                   f"<td>{lc['flops']:.3g}</td><td>{fmt_bytes(lc['state_bytes'])}</td>"
                   f"<td>{fmt_bytes(lc['peak_live_bytes'])}</td></tr>" for lc in data.get("layers", []))
    return ("<table><tr><th>layer</th><th>sent</th><th>comm time</th><th>compute</th><th>flop</th>"
            f"<th>params + grads + optimizer</th><th>peak live</th></tr>{rows}</table>")


def _cards(data: dict) -> str:
    st, mem = data["stats"], data["memory_per_rank"]
    n = sum(k["count"] for k in data["by_kind"].values())
    peak = max(m["parameters"] + m["gradients"] + m.get("optimizer_state", 0) + m["activations"] for m in mem)
    cards = [("mesh", f"{'x'.join(map(str, data['mesh']['shape']))} ({', '.join(data['mesh']['names'])})"),
             ("nodes", str(len(data["nodes"]))), ("collectives", str(n)),
             ("sent per rank", fmt_bytes(int(st.get("comm_bytes", 0)))),
             ("est. comm time", f"{float(st.get('comm_time_s', 0)) * 1e6:.1f} us"),
             ("est. step time", fmt_seconds(float(st.get("est_step_time_s", 0)))),
             ("peak memory per rank", fmt_bytes(peak))]
    if data.get("reserved_memory_bytes"):  # a step or forward plan, not a pipeline's schedule
        mode = ALLOCATORS[0]  # torchtitan's setting
        cards.append((f"CUDA allocator reserve ({ALLOCATOR_NAMES[mode]})",
                      fmt_bytes(data["reserved_memory_bytes"][mode])))
    return '<div class="cards">' + "".join(f'<div class="card"><span class="muted">{k}</span><b>{escape(v)}</b></div>'
                                           for k, v in cards) + "</div>"


def render(data: dict) -> str:
    """The HTML page for ``data`` (report.data.plan_data)."""
    colours = _colours(data)
    per_layer = [(m["module"], m["bytes_by_kind"]) for m in data["by_module"] if m["comm_bytes"]]
    per_kind = [(k, {k: v["bytes"]}) for k, v in sorted(data["by_kind"].items(), key=lambda kv: -kv[1]["bytes"])]
    mem = [(f"rank {m['rank']}", {k: m[k] for k in MEM_COLOURS}) for m in data["memory_per_rank"]]
    planner = f'<p class="muted">planner: {escape(data["planner"])}</p>' if data.get("planner") else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(data['title'])}</title>
<style>{CSS}</style></head><body>
<h1>{escape(data['title'])}</h1>
<p class="muted">{escape(data['stage'])} plan · shardwise</p>{planner}
{_cards(data)}
{pipeline_section(data.get("pipeline"))}
<h2>The model layer by layer, coloured by placement</h2>
<p class="muted">One cell per node (its first output's placement per mesh dim {escape(', '.join(data['mesh']['names']))});
outlined cells wait for a collective. Hover for the node, module and source line.</p>
{_legend(colours)}
{_layers_svg(data, colours)}
<h2>Communication per layer</h2>
<p class="muted">Bytes each rank sends per {escape(data['stage'])}, by collective kind.</p>
{_legend({k: c for k, c in KIND_COLOURS.items() if k in data['by_kind']})}
{_hbars(per_layer, KIND_COLOURS, "comm-layer")}
<h2>Communication per kind</h2>
{_hbars(per_kind, KIND_COLOURS, "comm-kind")}
<h2>Memory per rank</h2>
{_legend(MEM_COLOURS)}
{_hbars(mem, MEM_COLOURS, "memory", label_w=80)}
<h2>Cost per layer</h2>
<p class="muted">Per rank: bytes sent and their modelled time, compute on each node's busiest rank, state held,
and the most bytes live while one of the layer's nodes runs.</p>
{_layer_table(data)}
<h2>Parameters</h2>
{_param_table(data)}
<h2>Nodes</h2>
<input id="filter" placeholder="filter: module, op, placement, source ..." aria-label="filter nodes">
{_node_table(data)}
<script>{FILTER_JS}</script>
</body></html>
"""


def write(data: dict, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(data))
