"""`python -m evaluation ...` runs `ktserve eval` without the rest of the CLI."""

import sys

from evaluation.cli import main

sys.exit(main())
