"""The fault campaign's CI slice (benchmarks/fault_campaign.py --quick): kills at every step, racing stagers and
gc on a changing source, a full tmpfs, a source rewritten during its copy, Ctrl-C and SIGTERM at random moments.
The S3 part runs in test_s3.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_fault_campaign_leaves_nothing_corrupt_or_lost() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fault_campaign.py"), "--quick", "--json",
                           "--parts", "kills,race,enospc,rewrite,interrupt,ckpt_restore"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    total = report["total"]
    assert total["corrupt visible files"] == 0
    assert total["versions lost under a live lease"] == 0
    assert total["resumes"] > 0 and total["resumes completed"] == total["resumes"]
    kills = report["kills"]
    assert kills["faults"] == kills["runs"] >= 10, "a kill point was never reached"
    assert report["race"]["source changes"] > 0 and report["race"]["gc runs"] > 0
    assert report["enospc"]["runs"] and report["rewrite"]["runs"]
    interrupt = report["interrupt"]  # Ctrl-C and SIGTERM: exit 130/143 within the bound, no traceback, resumed
    assert interrupt.get("hung", 0) == 0 and interrupt.get("bad exits", 0) == 0
    assert interrupt["faults"] >= 3, "no signal landed while the stage ran"
    restore = report["ckpt_restore"]  # checkpoint restores and drains killed at random points
    assert restore["runs"] and restore["corrupt visible files"] == 0
