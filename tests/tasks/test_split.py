"""Tasks set apart by the source files their gold patches change, or at random (pure)."""

from __future__ import annotations

from atelier.tasks.split import hold_apart, split_by_file, train_extras

# task id -> the source file its gold patch changes
FILES = {"a1": "pkg/a.py", "a2": "pkg/a.py", "b1": "pkg/b.py", "c1": "pkg/c.py",
         "d1": "pkg/d.py", "d2": "pkg/d.py", "e1": "pkg/e.py", "t1": "pkg/t.py"}


def test_split_by_file_never_shares_a_file() -> None:
    files = {
        "a1": {"pkg/a.py"}, "a2": {"pkg/a.py"},
        "b1": {"pkg/b.py"}, "b2": {"pkg/b.py", "pkg/bc.py"},
        "c1": {"pkg/c.py", "pkg/bc.py"},  # linked to b2 by a shared file, so to b1 as well
        "d1": {"pkg/d.py"},
    }
    for seed in range(20):
        test = split_by_file(files, 3, seed)
        train = set(files) - test
        assert 1 <= len(test) <= 3 and train
        assert not set().union(*(files[t] for t in test)) & set().union(*(files[t] for t in train))
        assert {"b1", "b2", "c1"} <= test or not {"b1", "b2", "c1"} & test
    assert split_by_file(files, 3, 0) == split_by_file(files, 3, 0)
    # Everything linked: no split is possible.
    assert split_by_file({"x": {"f"}, "y": {"f", "g"}, "z": {"g"}}, 1, 0) == set()


def test_hold_apart_by_file_is_disjoint_bounded_and_seeded() -> None:
    files = {t: {f} for t, f in FILES.items()}
    for seed in range(6):
        for count in range(1, 7):
            chosen = hold_apart(files, count, seed, "file")
            assert chosen == split_by_file(files, count, seed) == hold_apart(files, count, seed, "file")
            assert 0 < len(chosen) <= count
            inside = set().union(*(files[t] for t in chosen))
            assert not inside & set().union(*(files[t] for t in files if t not in chosen))
    chosen = hold_apart(files, 3, 0, "random")
    assert len(chosen) == 3 and chosen == hold_apart(files, 3, 0, "random")
    assert len(hold_apart(files, 99, 0, "random")) == len(files) - 1   # the other side keeps a task


def test_extras_for_the_train_side_share_no_file_with_the_held_out_tasks():
    files = {"a": {"x.py"}, "b": {"y.py"}, "c": {"x.py", "z.py"}, "d": {"w.py"}}
    assert train_extras(["c", "d"], files, {"a"}, "file") == ["d"]
    assert train_extras(["c", "d"], files, {"a"}, "random") == ["c", "d"]
