"""``python -m kvbridge``: the ``kvbridge`` command, for environments whose scripts are not on PATH."""

import sys

from kvbridge.entry import main

sys.exit(main())
