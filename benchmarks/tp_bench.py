"""Heterogeneous-TP planning benchmark (same as ``kvbridge bench tp``)."""

import sys

from kvbridge.bench.tp import main

if __name__ == "__main__":
    sys.exit(main())
