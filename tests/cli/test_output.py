"""Output that reads cleanly and options that mean what they say, through the real commands: one set of numbers in a
plan, rates in the unit that fits, singular and plural, every command and option described, unknown storage options
refused for every protocol, secrets on the command line or in a readable file named once, and no leftovers."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from stagingloader.advice.plan import Facts, TierFacts, assess, gbps
from stagingloader.cli.main import build_parser
from stagingloader.units import human_rate, plural
from tests.conftest import cli_json, one_error, run_cli
from tests.support.trees import make_tree

REPO = Path(__file__).resolve().parents[2]


def test_rates_and_counts_read_as_people_write_them() -> None:
    assert [human_rate(x) for x in (0, 812, 4_200, 110e6, 1.234e9, 52e9)] == \
        ["0 B/s", "812 B/s", "4.20 kB/s", "110 MB/s", "1.23 GB/s", "52.0 GB/s"]
    assert human_rate(1234.5, "files") == "1,234 files/s"
    assert [plural(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]


def test_stage_of_one_small_file_says_1_file_and_no_zero_rate(tmp_path: Path, root: Path) -> None:
    src = make_tree(tmp_path / "one", {"a.bin": 3000})
    text = run_cli("stage", str(src), "--root", str(root)).stdout
    assert "1 file," in text and "1 files" not in text and "0.00 GB/s" not in text
    assert re.search(r"\(\d[\d.]* [kMG]?B/s\)", text), text
    again = run_cli("stage", str(src), "--root", str(root)).stdout
    assert "reused all 1 file\n" in again
    verify = run_cli("verify", str(src), "--root", str(root)).stdout
    assert "; 1 file, " in verify and "0.00 GB/s" not in verify


def _facts(measured: float, mean: float, rate: float) -> Facts:
    tier = TierFacts("/dev/shm", "tmpfs", "tmpfs", 10 << 30, 5.0, 5.0)
    return Facts("/nfs/d", True, 1000, int(mean * 1000), mean, mean, measured, (tier,), (), 64 << 30, rate, 1, 1, 0)


def test_a_plan_has_one_set_of_numbers_and_its_verdict_follows_from_them() -> None:
    # the report: "needs 0.122 GB/s; the source delivers 0.122 GB/s", then "GPU utilisation capped at 90%"
    p = assess(_facts(0.122, 122_000, 1000))
    assert p.source_gbps == pytest.approx(0.122 * 0.9) and p.direct_stalls
    assert p.verdict.startswith(f"needs {gbps(0.122)}; the source delivers {gbps(0.1098)}: reading it directly")
    assert "capped at 90%" in p.verdict and gbps(0.1098) == "110 MB/s"
    assert f"the source delivers {gbps(0.1098)}" in p.streaming["message"]  # the same figure, rounded the same way
    fine = assess(_facts(1.0, 122_000, 1000))
    assert not fine.direct_stalls and "enough to read it directly" in fine.verdict and "capped" not in fine.verdict


def test_plan_prints_the_same_source_figure_everywhere(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i:03d}.bin": 20_000 for i in range(50)})
    tier = tmp_path / "tier"
    tier.mkdir()
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    proc = run_cli("plan", str(src), "--samples-per-s", "100", "--tier", str(tier), "--seconds", "1", env=env)
    assert proc.returncode == 0, proc.stderr
    figures = set(re.findall(r"the source delivers ([\d.,]+ [kMG]?B/s)", proc.stdout))
    assert len(figures) == 1, proc.stdout  # the header, the verdict and the streaming line agree
    assert "0.00 GB/s" not in proc.stdout and "1 GPUs" not in proc.stdout and "50 files" in proc.stdout
    assert not list(tier.iterdir()) and (tmp_path / "state" / "stagingloader").is_dir()


def test_probe_keeps_its_results_in_the_state_folder(tmp_path: Path, src: Path) -> None:
    state = tmp_path / "state"
    out = cli_json("probe", str(src), "--seconds", "1", env={"XDG_STATE_HOME": str(state), "STAGINGLOADER_ROOT": ""})
    assert Path(out["saved"]).parent == state / "stagingloader" and Path(out["saved"]).is_file()
    text = run_cli("probe", str(src), "--seconds", "1", env={"XDG_STATE_HOME": str(state)}).stdout
    assert not re.search(r"\((\w+), \1\)", text.splitlines()[0]), text  # never "(tmpfs, tmpfs)"


def test_every_command_and_option_is_described_in_help() -> None:
    def walk(p: argparse.ArgumentParser, name: str) -> list[str]:
        missing = [] if p.description else [f"{name}: no description"]
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                helps = {c.dest: c.help for c in a._choices_actions}
                for sub, sp in a.choices.items():
                    missing += [] if helps.get(sub) else [f"{name} {sub}: no help line"]
                    missing += walk(sp, f"{name} {sub}")
            elif not a.help:
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}: no help")
        return missing

    assert walk(build_parser(), "stagingloader") == []
    for cmd in ("rm", "release", "gc", "ls", "plan", "stats", "probe", "manifest"):
        page = run_cli(cmd, "--help")
        assert page.returncode == 0 and page.stdout.count("\n\n") >= 2, (cmd, page.stdout)
    assert "rm" in run_cli("--help").stdout


def test_an_unknown_storage_option_is_a_usage_error_for_a_local_source(src: Path, root: Path) -> None:
    one_error(run_cli("stage", str(src), "--root", str(root), "-o", "bogus=1"), 2, "unknown storage option 'bogus'",
              "local source")
    one_error(run_cli("manifest", str(src), "-o", "bogus=1", "-o", "other=2"), 2, "'bogus', 'other'")
    assert not list(root.iterdir())


def test_a_secret_on_the_command_line_or_in_a_readable_file_is_named_once(src: Path, root: Path,
                                                                           tmp_path: Path) -> None:
    staged = cli_json("stage", str(src), "--root", str(root))
    loose = tmp_path / "opts.json"
    loose.write_text("{}")
    os.chmod(loose, 0o644)
    proc = run_cli("verify", staged["dataset_dir"], "--options-file", str(loose), "-o", "secret=abc", "-o", "key=K")
    assert proc.returncode == 0, proc.stderr
    warnings = proc.stderr.strip().splitlines()
    assert len([w for w in warnings if "permissions 0644 are too open" in w and "chmod 600" in w]) == 1, warnings
    assert len([w for w in warnings if "-o secret=..., -o key=..." in w and "ps" in w]) == 1, warnings
    assert "abc" not in proc.stderr
    os.chmod(loose, 0o600)
    quiet = run_cli("verify", staged["dataset_dir"], "--options-file", str(loose))
    assert quiet.returncode == 0 and "too open" not in quiet.stderr


def test_the_readme_install_lines_can_be_followed_as_written() -> None:
    readme = (REPO / "README.md").read_text()
    assert "OWNER" not in readme and "github.com/OWNER" not in readme
    assert "pip install ." in readme


def test_stage_no_wait_quiet_prints_the_dataset_folder_alone(tmp_path: Path, root: Path) -> None:
    """``DATA=$(stagingloader stage SRC --no-wait -q)`` captures the folder that StagedFiles reads, nothing else."""
    from stagingloader import StagedFiles

    src = make_tree(tmp_path / "src", {f"c/{i}.bin": 1000 for i in range(5)})
    for _ in range(2):  # while it streams, then once it is staged
        proc = run_cli("stage", str(src), "--root", str(root), "--no-wait", "-q", "--lease", "quiet")
        try:
            assert proc.returncode == 0, proc.stderr
            assert len(proc.stdout.splitlines()) == 1, proc.stdout
            assert len(StagedFiles(proc.stdout.strip())) == 5
        finally:
            assert run_cli("release", str(src), "--root", str(root), "--lease", "quiet").returncode == 0
