"""Running the `megabeta` command in the test's process."""

from __future__ import annotations

from megabeta.cli import main


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout, stderr of `megabeta ARGV` (argparse's exit 2 included)."""
    try:
        status = main(list(argv))
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err
