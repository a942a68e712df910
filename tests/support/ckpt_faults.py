"""A fault campaign against tiered checkpoints: inject faults, then check that nothing bad is ever loaded.

Kinds of fault (each run in a forked child that is SIGKILLed where stated, or in this process):
  kill_local_write   SIGKILL after N bytes of a checkpoint reached the local tier
  kill_drain         SIGKILL after N bytes reached the remote tier
  kill_local_marker  SIGKILL while the local commit marker is half written (before its rename)
  kill_remote_marker SIGKILL while the remote marker is half written
  kill_random        SIGKILL at a random moment of a save/drain loop
  enospc             a save larger than the (16 MiB tmpfs) local tier
  bitrot             a byte of a complete local checkpoint overwritten
  node_lost          the whole local tier removed (a job restarted on a new node)
  s3                 503s and dropped connections mid-upload (the fault proxy), counted per request

After every fault: a fresh ``Checkpoints`` must name as latest a step at least as new as the newest one
the child saw complete (after the epilog's ``ckpt drain`` for the remote), and whatever ``load`` returns
must equal what was saved for that step.  Counts: faults, partial or corrupt checkpoints loaded (must be
0), latest-complete checkpoints lost (must be 0).

    python -m tests.support.ckpt_faults --faults 200 [--s3]    # run from the repository root, as root
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from stagingloader.checkpoints import Checkpoints, TransferPolicy
from stagingloader.checkpoints import tiers as tiers_mod
from stagingloader.checkpoints.layout import MARKER, OBJECT_FILE
from stagingloader.checkpoints.tiers import FolderTier, complete_steps, open_tier, verify_step
from stagingloader.checkpoints.transfer import copy_step
from stagingloader.errors import NoSpaceError

KILL_KINDS = ("kill_local_write", "kill_drain", "kill_local_marker", "kill_remote_marker", "kill_random")
KINDS = (*KILL_KINDS, "enospc", "bitrot", "node_lost")
MIB = 1 << 20


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.rand((1 + step % 3) * MIB // 4, generator=g), "step": step}


def matches(obj: Any, step: int) -> bool:
    want = state(step)
    return isinstance(obj, dict) and obj.get("step") == step and torch.equal(obj["w"], want["w"])


class Campaign:
    def __init__(self, work: Path, *, remote: str | None = None, storage_options: dict[str, Any] | None = None,
                 seed: int = 0) -> None:
        self.work = work
        self.local = work / "local"
        self.remote = remote or str(work / "remote")
        self.options = storage_options or {}
        self.rng = random.Random(seed)
        self.next_step = 1
        self.acked = 0  # newest step a save returned for
        self.drained = 0  # newest step known complete on the remote
        self.counts: Counter[str] = Counter()
        self.bad_loads = 0
        self.faults = 0
        self.landed = True
        self.coalesce = True
        self.lost = 0

    def open(self, **kw: Any) -> Checkpoints:
        return Checkpoints(local=self.local, remote=self.remote, storage_options=self.options, keep_local=2,
                           keep_remote=3, transfer=TransferPolicy(deadline=30, coalesce=self.coalesce), **kw)

    # ---- the faults ------------------------------------------------------------------------------
    def run(self, kind: str) -> None:
        self.landed = True
        getattr(self, f"_{kind}", None)() if kind in ("enospc", "bitrot", "node_lost") else self._kill(kind)
        if self.landed:  # a kill that came after the child finished injected nothing
            self.counts[kind] += 1
            self.faults += 1
        self.check()

    def _kill(self, kind: str) -> None:
        steps = list(range(self.next_step, self.next_step + 3))
        self.next_step += 3
        acks = self.work / "acks"
        acks.unlink(missing_ok=True)
        at = self.rng.randrange(1, 3 * MIB)
        nth = self.rng.randrange(1, 4)
        pid = os.fork()
        if pid == 0:  # the child: save, drain, and die where the fault says
            code = 0
            try:
                _child(self, kind, steps, at, nth, acks)
            except BaseException as e:
                print(f"child {kind}: {type(e).__name__}: {e}", file=sys.stderr)
                code = 1
            os._exit(code)
        if kind == "kill_random":
            time.sleep(self.rng.uniform(0.0, 0.4))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        self.landed = os.WIFSIGNALED(status)
        self.counts["child_" + ("killed" if self.landed else f"exit{os.WEXITSTATUS(status)}")] += 1
        for line in acks.read_text().split() if acks.exists() else []:
            what, step = line.split(":")
            if what == "saved":
                self.acked = max(self.acked, int(step))
            else:
                self.drained = max(self.drained, int(step))
        self.epilog_drain()

    def _enospc(self) -> None:
        with self.open() as ck:
            step = self.next_step
            self.next_step += 1
            try:
                ck.save(step, {"w": torch.zeros(40 * MIB // 4), "step": step})
            except NoSpaceError:
                return
            raise AssertionError("a 40 MiB save fitted a 16 MiB tier")

    def _bitrot(self) -> None:
        local = FolderTier(str(self.local))
        done = complete_steps(local)
        if not done:
            return
        path = local.step_dir(self.rng.choice(done)) / OBJECT_FILE
        with path.open("r+b") as f:
            f.seek(self.rng.randrange(0, path.stat().st_size))
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))

    def _node_lost(self) -> None:
        self.epilog_drain()
        shutil.rmtree(self.local, ignore_errors=True)

    # ---- the checks ------------------------------------------------------------------------------
    def epilog_drain(self) -> None:
        """What the Slurm epilog does: `stagingloader ckpt drain` of every local complete step."""
        local, remote = FolderTier(str(self.local)), open_tier(self.remote, self.options)
        on_remote = set(complete_steps(remote))
        for step in complete_steps(local):
            marker = local.read_marker(step)
            if step in on_remote or marker is None or verify_step(local, step, marker):
                continue  # a corrupt local copy is not drained: it is never vouched for
            copy_step(local, remote, step, marker, TransferPolicy(deadline=30))
            self.drained = max(self.drained, step)

    def check(self) -> None:
        with self.open() as ck:
            latest = ck.latest()
            newest_known = max(self.drained, self.acked if self.acked > self.drained else 0)
            if newest_known and (latest is None or latest < newest_known):
                print(f"LOST: latest {latest} < {newest_known} after {dict(self.counts)}", file=sys.stderr)
                self.lost += 1
            if latest is None:
                return
            try:
                obj = ck.load(weights_only=False)
            except Exception as e:  # no intact copy at all: counted as lost, never as loaded
                print(f"load failed after {dict(self.counts)}: {e}", file=sys.stderr)
                self.lost += 1
                return
            if not matches(obj, obj.get("step", -1) if isinstance(obj, dict) else -1):
                self.bad_loads += 1
            remote = open_tier(self.remote, self.options)
            for tier in (FolderTier(str(self.local)), remote):
                for step in complete_steps(tier):
                    marker = tier.read_marker(step)
                    if marker is not None and verify_step(tier, step, marker) and tier is remote:
                        self.bad_loads += 1  # a corrupt checkpoint vouched for by a remote marker


def _child(c: Campaign, kind: str, steps: list[int], at: int, nth: int, acks: Path) -> None:
    written = [0]
    markers = [0]
    real_atomic = tiers_mod.atomic_write

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def half_marker(path: Any, data: bytes, **kw: Any) -> None:
        remote_side = not str(path).startswith(str(c.local))
        if str(path).endswith(MARKER) and (remote_side == (kind == "kill_remote_marker")):
            markers[0] += 1
            if markers[0] == nth:
                tmp = Path(path).with_name(f".{Path(path).name}.tmp-killed")
                tmp.write_bytes(data[: len(data) // 2])
                die()
        real_atomic(path, data, **kw)

    tiers_mod.atomic_write = half_marker  # type: ignore[assignment]
    real_writing = tiers_mod.FolderTier.writing

    @contextlib.contextmanager
    def counting(self: FolderTier, step: int, rel: str) -> Any:
        remote_side = str(self.root) != str(c.local)
        with real_writing(self, step, rel) as f:
            if remote_side != (kind == "kill_drain") or kind not in ("kill_local_write", "kill_drain"):
                yield f
                return

            class Killer:
                def write(self, data: Any) -> int:
                    written[0] += len(memoryview(data).cast("B"))
                    if written[0] >= at:
                        die()
                    return int(f.write(data) or 0)

            yield Killer()

    tiers_mod.FolderTier.writing = counting  # type: ignore[method-assign]
    with c.open() as ck, acks.open("a") as log:
        for step in steps:
            ck.save(step, state(step))
            log.write(f"saved:{step}\n")
            log.flush()
        ck.wait()
        log.write(f"drained:{steps[-1]}\n")
        log.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--s3", action="store_true", help="also run against the S3 server behind the fault proxy")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = run_campaign(args.faults, seed=args.seed, s3=args.s3)
    print(json.dumps(report, indent=1))
    return 0 if report["partial_or_corrupt_loaded"] == 0 and report["latest_complete_lost"] == 0 else 1


def run_campaign(faults: int, *, seed: int = 0, s3: bool = False, work: Path | None = None) -> dict[str, Any]:
    """Inject ``faults`` faults (kinds in turn) on a 16 MiB tmpfs local tier; returns the counts."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        base = work or Path(tmp)
        local = base / "tier"
        local.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(local)], check=True)
        try:
            c = Campaign(base, seed=seed)
            c.local = local / "ckpt"
            i = 0
            while c.faults < faults:
                c.run(KINDS[i % len(KINDS)])  # in turn; where each strikes is drawn from the seed
                i += 1
            report = {"faults": c.faults, "by_kind": dict(c.counts),
                      "partial_or_corrupt_loaded": c.bad_loads, "latest_complete_lost": c.lost,
                      "newest_step_saved": c.acked, "newest_step_drained": c.drained}
            if s3:
                report["s3"] = _s3_faults(base, seed)
        finally:
            subprocess.run(["umount", "-l", str(local)], check=False)
    report["seconds"] = round(time.monotonic() - t0, 1)
    return report


def _s3_faults(base: Path, seed: int) -> dict[str, Any]:
    from tests.support.faultproxy import FaultProxy
    from tests.support.s3server import S3Server

    with S3Server() as server:
        server.make_bucket("campaign")
        host, port = server.endpoint_url.split("//")[1].split(":")
        with FaultProxy(host, int(port), error_rate=0.15, drop_rate=0.15, seed=seed) as proxy:
            c = Campaign(base / "s3", remote="s3://campaign/run",
                         storage_options=server.storage_options(endpoint_url=proxy.endpoint_url))
            c.coalesce = False  # every step's upload meets the faults
            with c.open() as ck:
                for step in range(1, 13):
                    ck.save(step, state(step))
                    c.acked = step
            c.drained = c.acked
            c.check()
            return {"faults": proxy.errors_injected + proxy.drops_injected, "actions": dict(proxy.actions),
                    "partial_or_corrupt_loaded": c.bad_loads, "latest_complete_lost": c.lost}


if __name__ == "__main__":
    sys.exit(main())
