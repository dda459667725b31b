"""`python -m target_service [flags]` = `specdec serve target [flags]`."""

import sys

from specdec.cli import main

sys.exit(main(["serve", "target", *sys.argv[1:]]))
