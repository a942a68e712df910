#!/usr/bin/env bash
# A new user's first run, as the README tells it: get the code, install it, stage, train, release, remove.
# Usage: new_user.sh REPO WORK   (WORK: an empty folder; everything the user makes goes there)
# Run by tests/cli/test_walkthrough.py, which then checks that nothing of the run is left in /dev/shm, /tmp or the
# user's state folder but what the docs say stays (the source, and the list of roots in the state folder).
# Offline: the install builds a wheel with the interpreter's own setuptools (no index, no build isolation).
set -euo pipefail
REPO=$1
WORK=$2
PY=${PYTHON:-python3}
cd "$WORK"

echo "== clone"
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1 \
        && [ -z "$(git -C "$REPO" status --porcelain -- stagingloader pyproject.toml README.md)" ]; then
    git clone -q "$REPO" checkout
else  # work not committed yet: a copy of the working tree stands in for the clone
    mkdir checkout
    cp -r "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/stagingloader" checkout/
    find checkout -name __pycache__ -prune -exec rm -rf {} +
fi

echo "== install"
(cd checkout && "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "$WORK/site" .)
rm -rf checkout/build checkout/*.egg-info
export PYTHONPATH="$WORK/site"
SL="$PY -m stagingloader"
where=$("$PY" -c 'import stagingloader; print(stagingloader.__file__)')
case $where in "$WORK/site/"*) ;; *) echo "the installed copy is not the one running: $where" >&2; exit 1 ;; esac

echo "== a dataset on shared storage"
"$PY" - "$WORK/shared/train" <<'PY'
import sys
from pathlib import Path

for i in range(40):
    p = Path(sys.argv[1]) / f"class{i % 2}" / f"{i:03d}.bin"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(bytes([i]) * (500 + 37 * i))
PY

echo "== stage"
$SL stage "$WORK/shared/train" --json -q > staged.json
$SL ls

echo "== train"
"$PY" - "$WORK/shared/train" <<'PY'
import sys

import stagingloader as sl

ds = sl.stage(sys.argv[1])   # the copy the CLI staged: reused, under this process's own lease
loader = sl.DataLoader(sl.StagedFiles(ds, decode=len), batch_size=8, shuffle=True)
seen = 0
for sizes, labels in loader:
    seen += len(sizes)
assert seen == 40, seen
print(f"trained on {seen} samples; {loader.stats}")
ds.release()
PY

echo "== release"
$SL release "$WORK/shared/train"

echo "== remove"
$SL rm "$WORK/shared/train"
$SL ls
