"""Plan-building benchmark (same as ``kvbridge bench plan``).

    python benchmarks/plan_bench.py [--json] [--reps N]
"""

import sys

from kvbridge.bench.plan import main

if __name__ == "__main__":
    sys.exit(main())
