"""The example jobs' argument parser: a bad flag is one ``error:`` line on each rank, not argparse's usage block.

``whale launch -n 4 examples/gpt/train.py --schedule interleave`` parses the flags on every rank, so argparse's
usage block (33 lines for the GPT job) came four times with the one line that says what is wrong lost among them,
and the ranks exited 2 without a report, so the launcher said that the first of them failed "without reporting an
error". :class:`Parser` reports a usage error the way the jobs report any configuration error
(``wh.report_error`` without a traceback): ``error: [rank 1] ConfigError: argument --schedule: unknown schedule
'interleave'; choose gpipe, 1f1b, interleaved or zb (see train.py --help)`` on each rank, recorded for the
launcher's summary ("failed first (exit code 2) with ConfigError"), and exits 2 as argparse does. ``--help``
still prints the whole usage.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

import whale as wh


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose :meth:`error` is one line (module docstring)."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as this rank's one ``error:`` line, pointing to ``--help``, and exit with status 2."""
        wh.report_error(wh.ConfigError(f"{message} (see {self.prog} --help)"), traceback=False)
        sys.exit(2)
