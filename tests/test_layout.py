"""The test tree's own shape.

Test folders have no `__init__.py`, so pytest imports each test module by its
basename: two `test_x.py` in different folders stop collection of the whole
suite ("import file mismatch"). This guard names the clash instead.
"""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).parent


def test_no_two_test_modules_share_a_basename():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"rename one of each group (pytest imports test modules by basename): {clashes}"
