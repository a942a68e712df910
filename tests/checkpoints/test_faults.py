"""A slice of the checkpoint fault campaign (tests/support/ckpt_faults.py runs >= 200): SIGKILL during the
local write, the drain and either marker; ENOSPC on a real 16 MiB tmpfs; bit rot; a lost node-local tier."""

from __future__ import annotations

from tests.support.ckpt_faults import KINDS, run_campaign


def test_no_fault_loads_a_partial_checkpoint_or_loses_the_latest_complete() -> None:
    report = run_campaign(4 * len(KINDS), seed=11)
    assert report["partial_or_corrupt_loaded"] == 0, report
    assert report["latest_complete_lost"] == 0, report
    assert all(report["by_kind"][k] >= 3 for k in KINDS), report
    assert report["by_kind"]["child_killed"] >= 15, report  # the kills landed (a child that finished is not one)
    assert report["newest_step_drained"] > 10, report  # and the job made progress between faults
