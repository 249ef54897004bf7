"""The commit convention (CONTRIBUTING.md, "Commits"): an imperative subject of at most 72 characters.

The hook in `.githooks/commit-msg` refuses a longer subject where a clone enables it; these tests hold the hook to
the rule and, since a hook is opt-in per clone, check the history itself from the commit that added the hook on.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from conftest import REPO

HOOK = REPO / ".githooks" / "commit-msg"
MAX_SUBJECT_CHARS = 72


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def has_history() -> bool:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return False
    try:
        return git("rev-parse", "--is-shallow-repository").strip() == "false"
    except subprocess.CalledProcessError:
        return False


@pytest.mark.parametrize("subject, accepted", [
    ("x" * MAX_SUBJECT_CHARS, True),
    ("x" * (MAX_SUBJECT_CHARS + 1), False),
    ("é" * MAX_SUBJECT_CHARS, True),  # characters, not bytes
])
def test_the_hook_refuses_a_subject_over_72_characters(tmp_path, subject, accepted):
    message = tmp_path / "COMMIT_EDITMSG"
    message.write_text(f"# a comment line git strips\n{subject}\n\nA body line may be as long as it needs: {'y' * 200}\n",
                       encoding="utf-8")
    result = subprocess.run(["sh", str(HOOK), str(message)], capture_output=True, text=True,
                            env={**os.environ, "LC_ALL": "C"})  # a caller's byte locale must not count bytes
    assert (result.returncode == 0) == accepted, result.stderr
    assert accepted or "keep it to 72 or fewer" in result.stderr


@pytest.mark.skipif(not has_history(), reason="needs the full git history (not a shallow clone or an export)")
def test_every_commit_since_the_hook_has_a_subject_of_at_most_72_characters():
    added = git("log", "--diff-filter=A", "--format=%H", "--", ".githooks/commit-msg").split()
    assert added, "the commit that added .githooks/commit-msg is not in this history"
    subjects = git("log", "--format=%h %s", f"{added[-1]}^..HEAD").splitlines()
    too_long = [line for line in subjects if len(line.split(" ", 1)[1]) > MAX_SUBJECT_CHARS]
    assert not too_long, "subjects over 72 characters:\n" + "\n".join(too_long)
