"""``python -m tpde.cli``."""

import sys

from tpde.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
