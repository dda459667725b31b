"""`python -m coordinator [flags]` = `specdec serve coordinator [flags]`."""

import sys

from specdec.cli import main

sys.exit(main(["serve", "coordinator", *sys.argv[1:]]))
