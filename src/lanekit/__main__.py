"""``python -m lanekit``: the same as the ``lanekit`` command."""

import sys

from lanekit.cli import main

sys.exit(main())
