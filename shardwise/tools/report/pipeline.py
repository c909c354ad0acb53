"""A pipeline plan's schedule for the reports: ranks x time, each action a box.

    data = pipeline_data(pm.plan)                          # the modelled timeline (plan.timeline)
    data = pipeline_data(pm.plan, pm.pipeline_timeline())  # or the runner's measured one
    svg = timeline_svg(data)                               # drawn in the HTML report (html.py)
"""
from __future__ import annotations

from html import escape

from ...core.units import fmt_seconds

KIND_FILL = {"F": "#4e79a7", "B": "#f28e2b", "W": "#59a14f"}


def pipeline_data(plan, measured=None) -> dict:
    """The schedule of ``plan`` (a PipelinePlan) as JSON-ready data: per pipeline rank its actions
    with start and end seconds, from the modelled timeline (``plan.timeline``), or from
    ``measured``, the runner's (``pm.pipeline_timeline()``, a search/schedules.Timeline)."""
    st = plan.stats()
    sched = plan.schedule
    tl = measured if measured is not None else plan.timeline
    rows: dict = {}
    for a, r in tl.rank_of.items():
        rows.setdefault(r, []).append({"kind": a.kind, "stage": a.stage, "mb": a.mb, "start": tl.start[a],
                                       "end": tl.finish[a]})
    end = tl.end
    return {"schedule": sched.name, "ranks": sched.p, "stages_per_rank": sched.v, "microbatches": sched.m,
            "measured": measured is not None, "end": end, "bubble_fraction": st["bubble_fraction"],
            "rows": {str(r): sorted(v, key=lambda x: x["start"]) for r, v in sorted(rows.items())},
            "stages": st["pipeline"]["stages"], "split_points": st["pipeline"]["split_points"]}


def timeline_svg(data: dict, width: int = 900, row_h: int = 26) -> str:
    """Ranks x time: one row per pipeline rank, each action a box (F blue, B orange, W green)
    labelled stage.microbatch, with its times on hover."""
    end = data["end"] or 1.0
    left, rows = 70, data["rows"]
    h = row_h * len(rows) + 30
    out = [(f'<svg id="pipeline" width="{width + left + 10}" height="{h}" role="img" '
            'aria-label="pipeline schedule">')]
    for i, (r, acts) in enumerate(rows.items()):
        y = 10 + i * row_h
        out.append(f'<text x="4" y="{y + row_h * 0.6:.0f}" font-size="12">rank {escape(r)}</text>')
        for a in acts:
            x0 = left + a["start"] / end * width
            w = max(1.0, (a["end"] - a["start"]) / end * width)
            label = f"{a['kind']}{a['stage']}.{a['mb']}"
            tip = f"{label}: {fmt_seconds(a['start'])} - {fmt_seconds(a['end'])}"
            out.append(f'<g><title>{escape(tip)}</title><rect x="{x0:.1f}" y="{y}" width="{w:.1f}" '
                       f'height="{row_h - 4}" fill="{KIND_FILL.get(a["kind"], "#999")}" stroke="#fff"/>')
            if w > 26:
                out.append(f'<text x="{x0 + 2:.1f}" y="{y + row_h * 0.55:.0f}" font-size="10" fill="#fff">'
                           f'{escape(label)}</text>')
            out.append("</g>")
    out.append(f'<text x="{left}" y="{h - 6}" font-size="11" fill="#666">0</text>'
               f'<text x="{left + width - 60}" y="{h - 6}" font-size="11" fill="#666">{escape(fmt_seconds(end))}'
               "</text></svg>")
    return "".join(out)


def section(data: dict) -> str:
    """The report's pipeline section (HTML), or "" for a plan without a pipeline."""
    if not data:
        return ""
    how = "measured by the runner" if data["measured"] else "modelled by the plan's cost model"
    stages = "".join(f"<tr><td>{s['stage']}</td><td>{s['rank']}</td><td>{escape(', '.join(s['layers']))}</td>"
                     f"<td>{fmt_seconds(s['forward_s'])}</td><td>{fmt_seconds(s['backward_s'])}</td>"
                     f"<td>{s['in_flight']}</td></tr>" for s in data["stages"])
    legend = "".join(f'<span><i class="sw" style="background:{c}"></i>{k}</span>' for k, c in KIND_FILL.items())
    return (f"<h2>Pipeline schedule</h2><p class=\"muted\">{escape(data['schedule'])}: {data['ranks']} ranks x "
            f"{data['stages_per_rank']} stage(s), {data['microbatches']} microbatches; ranks x time {how}; bubble "
            f"{data['bubble_fraction']:.1%}; split points {escape(', '.join(data['split_points']) or '-')}</p>"
            f'<div class="legend">{legend}</div>{timeline_svg(data)}'
            "<table><thead><tr><th>stage</th><th>rank</th><th>layers</th><th>forward</th><th>backward</th>"
            f"<th>in flight</th></tr></thead><tbody>{stages}</tbody></table>")
