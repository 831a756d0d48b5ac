"""What differs between the Python versions atelier supports (`requires-python >= 3.10`).

- `tomllib`: the standard library's TOML reader from 3.11; on 3.10 the
  `tomli` backport it was taken from (same API), a dependency only there.
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = ["tomllib"]
