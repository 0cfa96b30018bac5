"""``python -m kvlife``: the command line."""

import sys

from kvlife.lifecycle.cli.main import main

sys.exit(main())
