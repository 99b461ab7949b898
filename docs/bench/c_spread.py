"""q4's draft cost c across the saved benchmark reports, set beside the baseline's one-token pass of the same run.

    python docs/bench/c_spread.py [REPORT.json ...]      (from the repository's root)

Default: the reports of 2026-12-06 (docs/bench/2026-12-06-*.json), the q4 drafter on Q4_1B blocks with its
head re-scored in int8 and the target's keys and values shared; earlier reports ran earlier drafters.

For every `python -m engine bench --json` report with an `engine-baseline` and an `engine-q4` row on a workload
(chat and held-out chat by default), one line: the report, its CPU kernel variant, the copy bandwidth measured at
its start (and after its runs, `start>after`, where the report has it), the baseline's mean one-token pass (ms),
q4's drafting ms per drafted token, c (their ratio, as the bench computes it) and q4's speedup on that workload.
Lines are sorted by the baseline's pass, per kernel variant; each variant's lines are then split at the median pass
and the two halves' median c and speedup are printed. Reads the reports only: every figure is recomputable from
them.
"""

import glob
import json
import statistics
import sys

WORKLOADS = ("chat", "chat-heldout")


def lines_of(path: str) -> list[dict]:
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        return []
    rows = [r for r in report["rows"] if isinstance(r, dict)]
    machine = report.get("machine") or {}
    out = []
    for workload in WORKLOADS:
        base = next((r for r in rows if r.get("system") == "engine-baseline" and r.get("workload") == workload), None)
        q4 = next((r for r in rows if r.get("system") == "engine-q4" and r.get("workload") == workload), None)
        if not base or not q4 or not base.get("pass_ms") or not q4.get("draft_ms_per_token"):
            continue
        out.append(
            {
                "report": path.rsplit("/", 1)[-1],
                "kernel": machine.get("cpu_kernel") or "?",
                "copy_gbs": machine.get("copy_bandwidth_gbs"),
                "copy_after": machine.get("copy_bandwidth_gbs_after"),
                "workload": workload,
                "pass_ms": base["pass_ms"],
                "draft_ms": q4["draft_ms_per_token"],
                "c": q4["draft_ms_per_token"] / base["pass_ms"],
                "speedup": q4.get("speedup_vs_engine_baseline"),
            }
        )
    return out


def main(paths: list[str]) -> None:
    lines = [line for path in paths for line in lines_of(path)]
    for kernel in sorted({line["kernel"] for line in lines}):
        for workload in WORKLOADS:
            mine = sorted(
                (x for x in lines if x["kernel"] == kernel and x["workload"] == workload), key=lambda x: x["pass_ms"]
            )
            if not mine:
                continue
            print(f"\n{kernel}, {workload}: {len(mine)} reports")
            print(f"{'report':62} {'copy GB/s':>11} {'pass ms':>8} {'draft ms':>9} {'c':>6} {'speedup':>8}")
            for x in mine:
                copy = f"{x['copy_gbs']:.0f}" if x["copy_gbs"] else "?"
                copy += f">{x['copy_after']:.0f}" if x["copy_after"] else ""
                speed = f"{x['speedup']:.2f}x" if x["speedup"] else "?"
                print(
                    f"{x['report'][:62]:62} {copy:>11} {x['pass_ms']:8.2f} {x['draft_ms']:9.2f} {x['c']:6.3f} {speed:>8}"
                )
            half = len(mine) // 2
            if half:
                for name, part in (("faster baseline passes", mine[:half]), ("slower baseline passes", mine[-half:])):
                    speeds = [x["speedup"] for x in part if x["speedup"]]
                    print(
                        f"  {name} ({len(part)}, {part[0]['pass_ms']:.2f}-{part[-1]['pass_ms']:.2f} ms): median draft "
                        f"{statistics.median(x['draft_ms'] for x in part):.2f} ms, c {statistics.median(x['c'] for x in part):.3f}"
                        + (f", speedup {statistics.median(speeds):.2f}x" if speeds else "")
                    )


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(glob.glob("docs/bench/2026-12-06-*.json")))
