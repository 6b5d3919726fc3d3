"""Checks of :mod:`orchestrator.config` kept out of it (its size): values that become words of a job's
command lines."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def _not_an_option(value: str) -> str:
    """A value the job passes as an operand (a path, an image, a bind): one with a leading ``-`` would be read
    as an option by the program it reaches (quoting does not help: argparse and apptainer see the word itself),
    one slurmfleet sets itself (``--api-key=...``) included."""
    if value.startswith("-"):
        raise ValueError(f"{value!r} starts with '-', which the engine's or apptainer's command line would read "
                         "as an option (write a path as ./-name)")
    return value


Operand = Annotated[str, AfterValidator(_not_an_option)]
"""A string that reaches a job's command line as an operand, never as an option."""
