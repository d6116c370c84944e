"""``python -m data_tools COMMAND ...`` (same as ``megabeta-data``)."""

import sys

from data_tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
