"""``shardwise verify-rules --opinfo``: the OpInfo sweep (opinfo.py) as rich tables, DTensor beside it.

One row per OpInfo (its cases by kind, the replicate fallback's exact ones, DTensor's count),
totals, the cases that are wrong or crash (bugs: exit status 1), random ones marked, the aten
ops without a rule ranked by the cases they stop, and the OpInfos DTensor shards where shardwise
does not. ``--json FILE`` writes every case (and DTensor's) as rows.
"""
from __future__ import annotations

import json
import os
import sys
import time

from .opinfo import KINDS, OpinfoReport, op_infos, sweep


def dtensor_summary(report: OpinfoReport, dtensor: list) -> dict:
    """DTensor's cases counted as the issue did (no 'no sharding strategy' error), and the OpInfos
    DTensor shards (some case without that error) where every shardwise case is unsupported."""
    ours = report.by_op()
    by_op: dict = {}
    for r in dtensor:
        by_op.setdefault(r["op"], []).append(r)
    unsupported = {op for op, rows in ours.items() if all(r.plain.kind == "unsupported" for r in rows)}
    return {
        "cases": len(dtensor),
        "no_strategy_error_free": sum(r["kind"] != "no_strategy" for r in dtensor),
        "ok": sum(r["kind"] == "ok" for r in dtensor),
        "other_error": sum(r["kind"] == "error" for r in dtensor),
        "covers_where_shardwise_does_not": sorted(
            op for op in unsupported if any(r["kind"] != "no_strategy" for r in by_op.get(op, []))),
        "per_op": {op: sum(r["kind"] != "no_strategy" for r in rows) for op, rows in by_op.items()},
    }


def _op_table(report: OpinfoReport, dt: dict | None):
    from rich.table import Table

    t = Table(title=f"OpInfo through shardwise ({report.samples} sample(s) per op, dims: {report.dims})")
    for col in ("op", "cases", *KINDS, "fallback exact", *(("DTensor",) if dt else ()), "note"):
        t.add_column(col, justify="left" if col in ("op", "note") else "right", overflow="fold")
    for op, rows in report.by_op().items():
        counts = [sum(r.plain.kind == k for r in rows) for k in KINDS]
        fb = sum(r.fallback is not None and r.fallback.kind == "exact" for r in rows)
        odd = next((r for r in rows if r.plain.kind != "exact"), None)
        note = ("random; " if rows[0].random else "") + (f"{odd.plain.kind}: {odd.plain.detail}" if odd else "")
        dcol = (str(dt["per_op"].get(op, 0)),) if dt else ()
        t.add_row(op, str(len(rows)), *[str(c) if c else "" for c in counts], str(fb) if fb else "", *dcol, note)
    return t


def totals_text(report: OpinfoReport, dt: dict | None) -> str:
    plain, final, ops = report.totals(), report.totals(final=True), report.op_totals()
    lines = [f"cases: {len(report.rows)} of {len(report.by_op())} OpInfos ({len(report.skipped)} without a case), "
             f"{report.seconds:.0f}s",
             "plain:             " + ", ".join(f"{k} {plain[k]}" for k in KINDS),
             "replicate_fallback: " + ", ".join(f"{k} {final[k]}" for k in KINDS),
             f"OpInfos: exact {ops['exact']}, partly {ops['partly']}, none {ops['none']}"]
    if dt:
        lines.append(f"DTensor (fake 2-rank group): {dt['no_strategy_error_free']} of {dt['cases']} cases raise no "
                     f"'no sharding strategy' error ({dt['ok']} no error at all, {dt['other_error']} other errors); "
                     f"OpInfos it shards where every shardwise case is unsupported: "
                     f"{len(dt['covers_where_shardwise_does_not'])}")
    return "\n".join(lines)


def details_text(report: OpinfoReport, dt: dict | None) -> str:
    def row(r):
        fb = f"; under replicate_fallback: {r.fallback.kind} {r.fallback.detail}" if r.fallback else ""
        return f"  {r.case.op} sample {r.case.sample} {r.case.label}: {r.plain.kind} {r.plain.detail}{fb}"

    bugs = report.bugs()
    out = [f"BUGS (wrong or crash): {len(bugs)}"]
    out += [row(r) + (" (random op)" if r.random else "") for r in bugs]
    out += ["UNSUPPORTED aten ops (cases each stops): " + ", ".join(f"{op} {n}" for op, n in
                                                                    report.unsupported_ops().items())]
    out += [f"REFUSED: {sum(r.plain.kind == 'refused' for r in report.rows)}"]
    out += [row(r) for r in report.rows if r.plain.kind == "refused"]
    if dt:
        out.append("DTensor shards, shardwise does not: " + ", ".join(dt["covers_where_shardwise_does_not"]))
    if report.skipped:
        out.append("no case: " + ", ".join(f"{op} ({why})" for op, why in report.skipped.items()))
    return "\n".join(out)


def run_cli(op: str | None = None, samples: int = 2, json_path: str | None = None, dtensor: bool = True,
            out=None) -> int:
    """The sweep, printed; 1 when a case is wrong or crashes."""
    from rich.console import Console

    from ..progress import quiet_stderr
    from .opinfo_dtensor import dtensor_counts

    out = out or sys.stdout
    console = Console(file=out, width=max(160, Console().width))
    total = len(op_infos(op))
    with quiet_stderr() as fd:
        err = os.fdopen(os.dup(fd), "w")
        tick = lambda name, rep: print(f"\r[{time.strftime('%H:%M:%S')}] {len(rep.by_op())}/{total} {name:<40}",  # noqa: E731
                                       end="", file=err, flush=True)
        report = sweep(op_filter=op, samples=samples, progress=tick)
        print(file=err)
        err.close()
    if not report.rows:
        print(f"no OpInfo case for {op!r}", file=out)
        return 2
    drows = dtensor_counts(samples, "all", op) if dtensor else []
    dt = dtensor_summary(report, drows) if dtensor else None
    console.print(_op_table(report, dt))
    print(totals_text(report, dt), file=out)
    print(details_text(report, dt), file=out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "samples": samples,
                       "seconds": report.seconds, "totals": report.totals(), "fallback_totals": report.totals(True),
                       "op_totals": report.op_totals(), "rows": report.json_rows(), "skipped": report.skipped,
                       "dtensor": dt and {k: v for k, v in dt.items() if k != "per_op"},
                       "dtensor_rows": drows}, f, indent=1)
    return 1 if report.bugs() else 0
