"""Which steps a tier may delete: pure, so that the rule is written (and tested) once.

Keep the newest ``keep`` complete steps (all of them when ``keep`` is None).  Never delete a
protected step: the newest complete step of *any* tier, one being written, drained or read.  An
incomplete step older than the newest complete one is debris of a killed or failed save and goes;
an incomplete step newer than it may still be being written (by another rank) and stays.
"""

from __future__ import annotations

from collections.abc import Collection


def steps_to_remove(*, steps: Collection[int], complete: Collection[int], keep: int | None,
                    protected: Collection[int]) -> list[int]:
    """The steps of a tier that retention removes, oldest first."""
    done = sorted(set(complete) & set(steps))
    if not done:
        return []
    newest = done[-1]
    kept = set(done if keep is None else done[-keep:] if keep > 0 else [])
    kept.add(newest)
    keep_also = set(protected)
    out = []
    for step in sorted(steps):
        if step in kept or step in keep_also:
            continue
        if step in complete or step < newest:
            out.append(step)
    return out
