#!/usr/bin/env python
"""Run the chaos suite and the single-fault tests, and write docs/reliability.md from what they recorded.

    python tools/reliability_report.py                 # chaos seed 1 + the single-fault tests (~6 min on 2 cores)
    python tools/reliability_report.py --slow          # also the slow tier's chaos seeds 2, 3, 4
    python tools/reliability_report.py --from DIR      # only render: DIR holds a previous run's records

Every chaos run (tests/chaos) writes a JSON record under $SAO_CHAOS_REPORT_DIR: the faults it injected, at which
weight version, the seconds until the run trained its next step, and the trajectory ledger's counts at the end.
The single-fault tests' outcomes and durations come from pytest's JUnit XML. Nothing in the document is typed by
hand: rerun this script after changing what the suite does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SINGLE_FAULTS = {  # fault -> the tests that inject it (each asserts the named error or the recovery)
    "checkpoint: flipped bytes, truncated file, damaged common.pt / metadata, a save cut by a full disk (named)":
        ["tests/learner/test_checkpoint_integrity.py"],
    "NaN/Inf gradients: skipped, counted, abort after learner.max_nonfinite_updates":
        ["tests/learner/test_nonfinite.py"],
    "engine: NaN/inf sampling, a burst of 2x max running requests, oversized body, stalled client, huge text":
        ["tests/engines/test_engine_hardening.py"],
    "engine answering garbage JSON or hanging: taken out, the turn goes to another engine":
        ["tests/engines/test_client.py::test_a_garbage_or_hanging_engine_is_taken_out_and_the_turn_goes_to_another"],
    "weight push refused or cut at any bucket; engine killed mid-push":
        ["tests/weight_sync/test_weight_sync.py::test_a_push_refused_at_any_bucket_leaves_the_engine_as_it_was",
         "tests/weight_sync/test_weight_sync.py::test_a_push_cut_at_any_bucket_leaves_the_engine_as_it_was",
         "tests/weight_sync/test_weight_sync.py::test_an_engine_killed_mid_push_fails_the_push_and_the_next_goes_to_the_others"],
    "an engine refusing to join an update group: the push fails at once, not after connect_timeout_s":
        ["tests/weight_sync/test_connect.py"],
    "spool file cut mid-write or torn after its rename":
        ["tests/bus/test_spool.py"],
    "two workers with one id; trajectories not durable at a crash; a lost trajectory's prompt":
        ["tests/rollout/test_worker.py::test_a_restarted_worker_continues_where_the_cursor_stopped",
         "tests/rollout/test_worker.py::test_prompts_whose_trajectories_are_not_durable_stay_pending_in_the_saved_cursor",
         "tests/rollout/test_worker.py::test_a_trajectory_lost_from_a_damaged_spool_has_its_prompt_generated_again",
         "tests/run/test_ledger.py"],
    "truncated safetensors shard, unwritable run_dir, TP not dividing the heads":
        ["tests/run/test_errors.py"],
    "SIGTERM / SIGINT / STOP file; a leftover engine on the run's ports":
        ["tests/run/test_stop.py"],
    "two runs (or learners, or workers of one id) in one run dir: the second refused naming the first's pid":
        ["tests/run/test_dirlock.py"],
    "newest checkpoint damaged: the run falls back, sets it aside, saves again, retrains the abandoned steps":
        ["tests/run/test_fallback.py",
         "tests/bus/test_bus.py::test_a_late_commit_keeps_a_checkpoint_back_so_a_fallback_trains_it_again",
         "tests/bus/test_staleness.py::test_a_trajectory_from_a_version_the_learner_does_not_hold_is_never_negatively_stale"],
    "a full disk under the run dir or a log: whole lines, named dir and field, torn last lines repaired":
        ["tests/files/test_jsonl.py", "tests/run/test_full_disk.py",
         "tests/run/test_metrics.py::test_a_full_disk_under_tensorboard_is_named_and_metrics_stay_whole"],
    "a foreign producer on the bus (CURVE by default): refused, counted, nothing trained":
        ["tests/run/test_bus_auth.py"],
    "booleans / inf / nan as numbers; wrong-typed engine fields; config.json vs weights; --help everywhere":
        ["tests/config/test_config.py::test_a_boolean_or_non_finite_number_is_refused_naming_the_field",
         "tests/engines/test_engine_hardening.py::test_fields_of_the_wrong_type_get_a_400_naming_the_field",
         "tests/engines/test_engine_hardening.py::test_max_new_tokens_past_the_context_is_refused_as_sglang_refuses_it",
         "tests/engines/test_engine_hardening.py::test_a_chunked_body_is_read",
         "tests/engines/test_engine_hardening.py::test_a_config_json_that_does_not_describe_the_weights_is_named",
         "tests/test_cli_help.py"],
}  # fmt: skip


COLUMNS = {
    "produced": "produced",
    "consumed": "trained",
    "voided": "voided",
    "stale_dropped": "stale",
    "pending": "pending",
    "regenerated": "regenerated",
}  # ledger field -> column
"""The ledger counts the table shows (run/ledger.py LedgerReport's fields)."""


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def run_suite(out: Path, slow: bool) -> int:
    env = {**os.environ, "SAO_CHAOS_REPORT_DIR": str(out / "chaos")}
    tests = ["tests/chaos", *(t for ts in SINGLE_FAULTS.values() for t in ts)]
    marks = [] if slow else ["-m", "not slow"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marks, f"--junitxml={out / 'junit.xml'}",
           *tests]  # fmt: skip
    print("running:", " ".join(cmd[3:]), flush=True)
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def _outcomes(junit: Path) -> dict[str, tuple[str, float]]:
    """'file::test' (parameters stripped) -> (worst outcome, total seconds) over its cases."""
    out: dict[str, tuple[str, float]] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        name = f"{path}::{case.get('name', '').split('[')[0]}"
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")  # fmt: skip
        prev, seconds = out.get(name, ("passed", 0.0))
        out[name] = (max(prev, outcome, key=rank.__getitem__), seconds + float(case.get("time", 0)))
    return out


def render(out: Path) -> str:
    records = [json.loads(p.read_text()) for p in sorted((out / "chaos").glob("*.json"))]
    if not records:
        raise SystemExit(f"error: no chaos records under {out / 'chaos'}; run without --from first")
    lines = ["# Reliability", "",
             "Written by `python tools/reliability_report.py` from the records the chaos suite (`tests/chaos`) leaves "
             "and pytest's results of the single-fault tests; do not edit by hand.", "",
             "## Chaos runs", "",
             "Each run drives the real launcher or learner; the ledger's counts are `python -m megatron_sao ledger`'s "
             "at the end (produced, trained, voided: trained after the checkpoint a restart resumed from, then "
             "trained again; stale: dropped by the staleness gate; pending: in a spool at the end; regenerated: lost "
             "with a damaged spool file or a spool-less crash and generated again from its prompt).", "",
             _row(["run", "faults injected", *COLUMNS.values(), "ledger", "seconds"]),
             _row(["---"] * (len(COLUMNS) + 4))]  # fmt: skip
    for r in records:
        led = r.get("ledger", {})
        faults = "; ".join(f["fault"] for f in r["faults"])
        counts = [str(led.get(k, "")) for k in COLUMNS]
        lines.append(_row([r["test"], faults, *counts, "OK" if r["ok"] else "VIOLATIONS", str(r.get("seconds", ""))]))
    lines += ["", "## Recoveries", "", "Seconds from the fault until what the last column says.", "",
              "| fault | times injected | median s | max s | until |", "|---|---|---|---|---|"]  # fmt: skip
    by_fault: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        for f in r["faults"]:
            if "recovered_s" in f:
                by_fault.setdefault(f["fault"], []).append(f)
    for fault, hits in by_fault.items():
        times = [float(f["recovered_s"]) for f in hits]
        lines.append(_row([fault, str(len(hits)), f"{statistics.median(times):.1f}", f"{max(times):.1f}",
                           str(hits[0].get("until", "the next trained step"))]))  # fmt: skip
    load = [f for r in records if r["test"].startswith("load") for f in r["faults"]]
    if load:
        f = load[0]
        lines += ["", "## Load", "",
                  f"{f['fault']}: the producers ran at {f['achieved_per_s']} trajectories/s (the learner's pace); "
                  f"the learner's memory grew {f['learner_rss_growth_mb']} MB and a producer's "
                  f"{f['producer_rss_growth_mb']} MB while {f['payload_mb']} MB of trajectories went through; at most "
                  f"{f['max_queued']:.0f} waited in the learner's queue (the credits it granted); none was dropped or "
                  "trained twice."]  # fmt: skip
    junit = out / "junit.xml"
    if junit.is_file():
        outcomes = _outcomes(junit)
        lines += ["", "## Single faults", "", "| fault | tests | result | seconds |", "|---|---|---|---|"]
        for fault, tests in SINGLE_FAULTS.items():
            hits = {n: o for n, o in outcomes.items() if any(n == t or n.startswith(t + "::") for t in tests)}
            worst = "not run" if not hits else max((o for o, _ in hits.values()), key=["passed", "skipped",
                                                                                     "failed"].index)  # fmt: skip
            lines.append(f"| {fault} | {len(hits)} | {worst} | {sum(s for _, s in hits.values()):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", default=None, help="render the records already in this directory")
    p.add_argument("--slow", action="store_true", help="include the slow tier's chaos seeds")
    p.add_argument("--out", default=str(REPO / "docs" / "reliability.md"), help="the document to write")
    a = p.parse_args(argv)
    source = Path(a.source) if a.source else Path(tempfile.mkdtemp(prefix="sao-reliability-"))
    code = 0 if a.source else run_suite(source, a.slow)
    Path(a.out).write_text(render(source))
    print(f"wrote {a.out} from {source} (suite exit code {code})")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
