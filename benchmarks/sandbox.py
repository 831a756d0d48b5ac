"""Sandbox benchmark: prints one JSON object (see atelier.sandbox.bench) and saves it under
benchmarks/results/ (not with --no-save).

    python benchmarks/sandbox.py [--quick] [--no-save]
"""

import json
import sys
from pathlib import Path

from atelier.sandbox import bench

sys.path.insert(0, str(Path(__file__).parent))
import record  # noqa: E402

if __name__ == "__main__":
    stamp = record.stamp()
    report = {"benchmark": "sandbox", **stamp, **bench.run(quick="--quick" in sys.argv[1:])}
    print(json.dumps(record.finish("sandbox", report, "--no-save" not in sys.argv[1:])))
