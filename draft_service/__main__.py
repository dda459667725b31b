"""`python -m draft_service [flags]` = `specdec serve draft [flags]`."""

import sys

from specdec.cli import main

sys.exit(main(["serve", "draft", *sys.argv[1:]]))
