"""Sandbox benchmark: prints one JSON object (see atelier.sandbox.bench).

    python benchmarks/sandbox.py [--quick]
"""

import json
import sys

from atelier.sandbox import bench

if __name__ == "__main__":
    print(json.dumps(bench.run(quick="--quick" in sys.argv[1:])))
