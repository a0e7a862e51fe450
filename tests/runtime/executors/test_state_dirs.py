"""Executors' own state directories: removed when their maker died, never otherwise
(Note [stale state directories])."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trims.runtime.executors import state_dirs
from trims.runtime.executors.state_dirs import OWNER, make_owned_dir, sweep_stale

PREFIX = "trims-test-state-"


@pytest.fixture
def tmpdir_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory the executors use, private to the test."""
    monkeypatch.setattr(state_dirs.tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_directory_whose_maker_was_killed_is_removed_by_the_next_executor(
    tmpdir_root: Path,
) -> None:
    # a real process makes its directory, then dies by SIGKILL (no cleanup of any kind runs)
    maker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, tempfile
                tempfile.tempdir = {str(tmpdir_root)!r}
                from trims.runtime.executors.state_dirs import make_owned_dir
                owned = make_owned_dir({PREFIX!r})
                (owned.path / "instance.log").write_text("what a function printed")
                print(owned.path, flush=True)
                sys.stdin.read()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert maker.stdout is not None
    dead = Path(maker.stdout.readline().strip())
    assert (dead / "instance.log").exists()
    # while it lives, nobody removes its directory
    assert sweep_stale(PREFIX) == []
    maker.send_signal(signal.SIGKILL)
    maker.wait()

    owned = make_owned_dir(PREFIX)
    try:
        assert not dead.exists()
        assert owned.path.exists() and (owned.path / OWNER).exists()
    finally:
        owned.remove()
    assert not owned.path.exists()


def test_live_foreign_and_odd_directories_are_left_alone(tmpdir_root: Path) -> None:
    alive = make_owned_dir(PREFIX)  # held by this process
    no_lock = tmpdir_root / f"{PREFIX}older"  # made before locks, or by another tool
    no_lock.mkdir()
    target = tmpdir_root / "elsewhere"
    target.mkdir()
    (target / OWNER).write_text("")
    (tmpdir_root / f"{PREFIX}link").symlink_to(target)  # a link to a directory
    linked = tmpdir_root / f"{PREFIX}linked-owner"  # .owner is a link to a real lock file
    linked.mkdir()
    (linked / OWNER).symlink_to(target / OWNER)
    unrelated = tmpdir_root / "other-dead"
    unrelated.mkdir()
    (unrelated / OWNER).write_text("")
    try:
        assert sweep_stale(PREFIX) == []
        for path in (alive.path, no_lock, target, linked, unrelated):
            assert path.exists(), path
        assert (tmpdir_root / f"{PREFIX}link").is_symlink()
    finally:
        alive.remove()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user owns")
def test_a_lock_file_another_user_owns_does_not_make_a_directory_removable(
    tmpdir_root: Path,
) -> None:
    """The function user can write to the local executor's directory but cannot make a file
    owned by root: a .owner that is not ours never lets the sweep remove anything."""
    planted = tmpdir_root / f"{PREFIX}planted"
    planted.mkdir()
    (planted / OWNER).write_text("")
    os.chown(planted / OWNER, 65534, 65534)
    assert sweep_stale(PREFIX) == []
    assert planted.exists()
    # the same directory with a lock file of ours and nobody holding it is removed
    os.chown(planted / OWNER, 0, 0)
    assert sweep_stale(PREFIX) == [planted]
    assert not planted.exists()


async def test_an_executor_without_a_state_dir_makes_a_locked_one_and_removes_it(
    tmpdir_root: Path,
) -> None:
    from trims.runtime.executors.local import LocalExecutor, LocalExecutorSettings

    stale = tmpdir_root / "trims-local-killed"
    stale.mkdir()
    (stale / OWNER).write_text("")  # its maker is gone: nobody holds the lock
    executor = LocalExecutor(LocalExecutorSettings(preload=("numpy",)))
    path = executor.state_dir
    assert path.parent == tmpdir_root and path.name.startswith("trims-local-")
    assert (path / OWNER).exists()
    assert not stale.exists()
    assert sweep_stale("trims-local-") == []  # the executor's own is held
    await executor.close()
    assert not path.exists()
