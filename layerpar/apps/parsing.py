"""Command lines whose errors are one line: ``<command>: error: <message>``, exit 2.

argparse prints its usage block before an error; README promises one line naming the
option for every command (``layerpar``, ``python -m layerpar.bench ...``, the
studies), for the parser's own errors (an unknown option, a value of the wrong type)
as for the values each command checks itself (``parser.error(...)``).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line on standard error and exit
    status 2.  Subparsers made by `add_subparsers` are of the same class."""

    #: the line's first word(s); None: the parser's ``prog``
    command: Optional[str] = None
    #: a pointer to the help appended to the parser's own errors (`error`'s callers
    #: among the command's checks name the option themselves)
    hint = False

    def reports(self) -> bool:
        """Whether this process prints the line (a job's other ranks stay quiet)."""
        return True

    def error(self, message: str) -> Any:  # argparse's hook: never returns
        if self.hint:
            message = f"{message} (`{self.prog} --help` lists the options)"
        if self.reports():
            print(f"{self.command or self.prog}: error: {message}", file=sys.stderr,
                  flush=True)
        self.exit(2)
