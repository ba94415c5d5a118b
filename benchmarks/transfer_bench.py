"""1 GiB through kvbridge vs the raw engine call vs memcpy (see kvbridge.bench.transfer)."""

import sys

from kvbridge.bench.transfer import main

if __name__ == "__main__":
    sys.exit(main())
