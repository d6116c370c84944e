import sys

from megabeta.train.cli import main

sys.exit(main())
