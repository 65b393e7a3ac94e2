"""`python -m nanoserve` runs the CLI."""

import sys

from nanoserve.cli import main

sys.exit(main())
