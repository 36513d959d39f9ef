"""Finding `mpiexec` and stopping an MPI job completely.

Shared by the `layerpar` command line (which relaunches itself under mpiexec), the
scaling studies (one job per rank count) and the test suite (workers under a timeout).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Optional

__all__ = ["kill_job", "mpiexec_path"]


def mpiexec_path() -> Optional[str]:
    """The mpiexec beside sys.executable (a venv's `mpich` wheel), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec")


def _descendants(root: int) -> list[int]:
    """Process ids below `root` in the process tree (read from Linux /proc; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_job(pid: int) -> None:
    """SIGKILL mpiexec `pid` (started with start_new_session=True), its process group and
    every process below it.

    The process group alone is not enough: MPICH's hydra starts its proxy and every
    rank in sessions of their own (they would die a moment later, once the proxy
    notices, but a busy-polling rank burns a core until then).
    """
    tree = _descendants(pid)
    targets: list[tuple[Any, int]] = [(os.killpg, pid)] + [(os.kill, p) for p in tree]
    for kill, target in targets:
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
