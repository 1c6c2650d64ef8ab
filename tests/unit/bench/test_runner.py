from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import stargate
from stargate.bench.runner import git_facts, run_metadata


def git(directory: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=directory,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout.strip()


def make_repo(root: Path) -> str:
    """A repository with one commit holding ``pkg/__init__.py``; its sha."""
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "pkg")
    git(root, "commit", "-q", "-m", "one")
    return git(root, "rev-parse", "HEAD")


def test_git_facts_are_the_checkout_that_tracks_the_package(tmp_path: Path) -> None:
    sha = make_repo(tmp_path)
    assert git_facts(tmp_path / "pkg") == {"sha": sha, "branch": "main", "dirty": False}
    (tmp_path / "new.txt").write_text("x")
    assert git_facts(tmp_path / "pkg")["dirty"] is True


def test_git_facts_without_a_checkout_claim_no_clean_tree(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    assert git_facts(tmp_path / "pkg") == {"sha": "unknown", "branch": "unknown", "dirty": None}
    make_repo(tmp_path / "repo")
    (tmp_path / "repo" / "copy").mkdir()
    (tmp_path / "repo" / "copy" / "__init__.py").write_text("")  # an installed copy inside a repository
    assert git_facts(tmp_path / "repo" / "copy")["dirty"] is None


def test_run_metadata_records_the_benchmarked_checkout_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = make_repo(tmp_path)
    monkeypatch.chdir(tmp_path)
    facts = run_metadata([])["git"]
    assert isinstance(facts, dict)
    assert facts["sha"] == git(Path(stargate.__file__).resolve().parent, "rev-parse", "HEAD") != other
