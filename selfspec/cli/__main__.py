"""`python -m selfspec.cli`: the `selfspec` command."""

import sys

from selfspec.cli import main

sys.exit(main())
