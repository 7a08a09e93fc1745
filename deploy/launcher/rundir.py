"""The runs folder and a run's folder, settled before anything starts: writable, one ``relay up`` at a time
per runs folder, and private to the user who runs it.

- A runs folder that cannot be written (a read-only mount, another user's folder) is refused with the fix
  (another ``--runs-dir``), not met later as a raw ``[Errno 30]`` half-way through the start.
- One ``relay up`` per runs folder: two runs in one folder share ``runs/latest`` (it would move to the
  second while the first still trains) and the machine (each ran 3x slower). The lock is an ``flock`` on
  ``<runs>/.relay-up.lock``, held for the whole run and released by the kernel when the process ends,
  however it ends: a killed run never leaves a stale lock behind.
- The run folder is 0700 and ``relay up`` runs with umask 077, so every file in it (each weight version,
  the logs, Redis's append-only file with all the training data) is its user's alone; its children
  (redis-server among them) inherit the umask.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from pathlib import Path

LOCK = ".relay-up.lock"
PRIVATE_UMASK = 0o077


class RunsFolderError(Exception):
    """The runs folder cannot hold this run; the message says why and what to do."""


def check_writable(runs_dir: Path) -> None:
    """``runs_dir`` exists (made if missing) and a file can be written in it; RunsFolderError otherwise."""
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=runs_dir, prefix=".relay-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        why = "it is on a read-only file system" if e.errno == errno.EROFS else e.strerror or str(e)
        raise RunsFolderError(
            f"cannot write the run into {runs_dir}: {why}; give a writable folder with --runs-dir DIR"
        ) from None


class RunsLock:
    """The runs folder's lock (:data:`LOCK`), taken for the whole of one ``relay up``."""

    def __init__(self, runs_dir: Path):
        self.path = runs_dir / LOCK
        self._file = None

    def acquire(self, run_id: str, resuming: bool = False) -> "RunsLock":
        """Take the lock, or RunsFolderError naming the run that holds it and the fix."""
        f = self._locked(open(self.path, "a+"), resuming)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()} {run_id}\n")  # for a second relay up's message; the flock is the lock
        f.flush()
        self._file = f
        return self

    def check(self, resuming: bool = False) -> None:
        """RunsFolderError when another process holds the lock; writes nothing (no lock file, no folder, when
        there is none yet)."""
        try:
            f = open(self.path)
        except OSError:  # none yet (nothing can hold it), or unreadable: claim_runs_folder says why
            return
        with self._locked(f, resuming):
            pass

    def _locked(self, f, resuming: bool):
        """``f`` (the lock file) with the lock taken, or RunsFolderError (``f`` closed)."""
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().split()
            f.close()
            who = f"run {holder[1]}, pid {holder[0]}" if len(holder) >= 2 else "another run"
            fix = (
                "wait for it to end (or stop it with Ctrl-C), then resume this run"
                if resuming
                else "wait for it to end (or stop it with Ctrl-C), or give this run a runs folder of its own with "
                "--runs-dir DIR (its runs/latest is its own)"
            )
            raise RunsFolderError(
                f"another relay up ({who}) is running in {self.path.parent}: two runs in one runs "
                f"folder share runs/latest and slow each other down; {fix}"
            ) from None
        return f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the file releases the flock
            self._file = None


def check_runs_folder(p: dict) -> None:
    """Before the pre-start checks, so that a second relay up is refused at once: RunsFolderError when
    another relay up holds the runs folder of the run ``p``. Writes nothing (claim_runs_folder takes the lock
    once the checks have passed)."""
    RunsLock(p["runs_dir"]).check(resuming=p.get("resumed") is not None)


def claim_runs_folder(p: dict) -> RunsLock:
    """The checks of this module for the run ``p`` (:func:`deploy.launcher.plan.plan`): its runs folder
    writable, then locked for it; the lock is held until :meth:`RunsLock.release` or the process ends."""
    check_writable(p["runs_dir"])
    return RunsLock(p["runs_dir"]).acquire(p["run_id"], resuming=p.get("resumed") is not None)


def make_private(run_dir: Path, new: bool) -> None:
    """The run folder, mode 0700: made for a new run, its mode set again for a resumed one (made by a
    ``relay up`` from before the folder was private)."""
    if new:
        run_dir.mkdir(mode=0o700, parents=True)
    os.chmod(run_dir, 0o700)


def link_base_model(learner_dir: Path, model: str) -> None:
    """``learner/base_model``: the model the run starts from, for the commands that take the last run's
    model (``--model runs/latest/learner/base_model``). The learner builds the tiny model there; a model
    folder given with ``--model`` is linked there (no copy), so that the same command works from this
    run too."""
    if model == "tiny":
        return
    link = learner_dir / "base_model"
    learner_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not link.exists() and not link.is_symlink():
        link.symlink_to(Path(model).resolve(), target_is_directory=True)
