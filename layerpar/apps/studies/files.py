"""Crash-safe files for scaling studies: every write is complete or absent, every read
is checked, and a damaged file is refused, never rewritten.

A study runs for hours and is resumed from what it wrote, so an interrupted write
(Ctrl-C, a killed job, a full disk) must not leave half a line that the next resume
would misread or glue the next result onto.  Every file is therefore written whole
to a temporary file in the same folder, flushed to disk and renamed over the old one
(`write_text`, `write_bytes`, `append_line`): a reader sees the old file or the new
one.  Reading (`read_jsonl`, and the CSV reader in `runner`) checks what it reads and
raises `StudyFileError` naming the file, the line and how to recover.

`check_output_dir` checks, before any measurement, that the output folder can be
created and written; `check_output_file` the same for one output file (a benchmark's
``--csv``).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Union

__all__ = ["StudyFileError", "append_line", "check_output_dir", "check_output_file",
           "first_line", "refuse_foreign", "read_jsonl", "write_bytes", "write_text"]

PathLike = Union[str, Path]


class StudyFileError(ValueError):
    """A study file or folder that cannot be used as it is.  Raised before anything is
    measured or written, so the file is left exactly as it was."""


def write_bytes(path: PathLike, data: bytes) -> None:
    """Replace `path` by `data` atomically: a temporary file beside it, fsync, rename.

    On any failure (a full disk, an interrupt) the temporary file is removed and
    `path` keeps its old content.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a results file is not
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text(path: PathLike, text: str) -> None:
    """`write_bytes` of UTF-8 text."""
    write_bytes(path, text.encode("utf-8"))


def append_line(path: PathLike, line: str) -> None:
    """Append one line to `path` (created if missing) so that it is complete or absent.

    The file is rewritten whole (`write_bytes`): study files are small, and an append
    in place could leave half a line behind.  Refuses (`StudyFileError`) a file whose
    last line is incomplete rather than gluing `line` onto it.
    """
    path = Path(path)
    if "\n" in line or "\r" in line:
        raise ValueError("`line` must be a single line")
    old = path.read_bytes() if path.exists() else b""
    if old and not old.endswith(b"\n"):
        n = old.count(b"\n") + 1
        raise StudyFileError(
            f"{path}: line {n} is incomplete (it does not end with a newline: a write "
            f"was interrupted); nothing was changed.  Delete that line (or the file) "
            f"and run again")
    write_bytes(path, old + line.encode("utf-8") + b"\n")


def read_jsonl(path: PathLike, recovery: str) -> list[dict[str, Any]]:
    """The JSON objects of a one-object-per-line file; [] if it does not exist.

    Every line must be complete (end with a newline) and hold one JSON object;
    otherwise `StudyFileError` names the file and line, and adds `recovery` (what the
    user can do about it).
    """
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    out = []
    lines = data.split(b"\n")
    for n, raw in enumerate(lines, start=1):
        if n == len(lines):
            if raw:  # text after the last newline: a line cut short
                raise StudyFileError(
                    f"{path}: line {n} is incomplete (it does not end with a newline: a "
                    f"write was interrupted); nothing was changed.  {recovery}")
            break
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise StudyFileError(f"{path}: line {n} is not valid JSON ({exc}); nothing "
                                 f"was changed.  {recovery}") from None
        if not isinstance(obj, dict):
            raise StudyFileError(f"{path}: line {n} is not a JSON object; nothing was "
                                 f"changed.  {recovery}")
        out.append(obj)
    return out


def check_output_dir(folder: PathLike, name: str, files: tuple[str, ...] = ()) -> Path:
    """Create `folder` if needed and check that files can be written in it.

    `name` is what the user called it (``--out``, ``out_dir``), for the message;
    `files` are names inside it that will be written and must not be folders.
    Raises `StudyFileError` before anything is measured.
    """
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise StudyFileError(f"`{name}` {path} is a file, not a folder; give a folder "
                             f"(it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StudyFileError(f"`{name}` {path} cannot be created: {exc.strerror or exc}"
                             ) from None
    try:
        _probe(path)
    except OSError as exc:
        raise StudyFileError(f"`{name}` {path} is not writable: {exc.strerror or exc}"
                             ) from None
    for f in files:
        if (path / f).is_dir():
            raise StudyFileError(f"`{name}`: {path / f} is a folder; the study writes a "
                                 f"file there (move the folder away)")
    return path


def refuse_foreign(out: Path, ours: dict[str, Callable[[bytes], bool]], writer: str) -> None:
    """Raise `StudyFileError` before anything runs where a file of `out` named in `ours`
    exists and its predicate (given the file's bytes) says `writer` did not write it:
    a file a person wrote is never replaced."""
    for name, test in ours.items():
        path = out / name
        if path.exists() and not test(path.read_bytes()):
            raise StudyFileError(f"{path} exists and was not written by {writer}; nothing "
                                 "was changed.  Move it away or choose another `--out`")


def first_line(data: bytes) -> str:
    """The first line of a file's bytes, decoded leniently (for `refuse_foreign`)."""
    return data.split(b"\n", 1)[0].decode("utf-8", "replace")


def _probe(folder: Path) -> None:
    """Create and remove a file in `folder` (OSError where it cannot be written: the
    one test that holds for root, read-only mounts and /proc alike)."""
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
    os.close(fd)
    os.unlink(probe)


def check_output_file(file: PathLike, name: str, header: Optional[str] = None) -> Path:
    """Check, before anything is measured, that `file` can be written: not a folder, in
    a folder that exists, and writable there (tried: a probe file is created and
    removed, or an existing file opened for appending, which changes nothing in it).
    `name` is what the user called it (``--csv``), for the message.  With `header`
    (the first columns of the CSV the caller writes, ``"model,layers,levels"``), an
    existing file is replaced only where its first line starts with them: the same
    benchmark's earlier output.  Anything else (a person's own CSV, whatever its
    columns, a README given by mistake) is refused.  Raises `StudyFileError`."""
    path = Path(file)
    if path.is_dir():
        raise StudyFileError(f"`{name}` {path} is a folder; give a file path")
    if header is not None and path.is_file():
        with open(path, "rb") as fh:
            head = fh.read(65536)
        line = first_line(head).rstrip("\r")
        if head and not (line == header or line.startswith(header + ",")):
            raise StudyFileError(
                f"`{name}` {path} exists and is not this benchmark's CSV (its first line "
                f"does not start with the columns {header}), so it is not replaced; "
                "nothing was changed.  Move it away or give another path")
    folder = path.parent
    if not folder.is_dir():
        raise StudyFileError(f"`{name}` {path} cannot be written: its folder {folder} "
                             "does not exist")
    try:
        if path.exists():
            with open(path, "ab"):
                pass
        else:
            _probe(folder)
    except OSError as exc:
        raise StudyFileError(f"`{name}` {path} cannot be written: {exc.strerror or exc}"
                             ) from None
    return path
