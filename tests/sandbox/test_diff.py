"""Diffs that `git apply` accepts. `git apply` is the oracle: build an old
tree, change a copy, diff the two, apply the diff to another copy of the old
tree, and the result must equal the new tree byte for byte (contents, the
executable bit, symlink targets). Then the same through a real sandbox, where
the changed paths come from overlay layers (whiteouts, opaque directories)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from atelier.sandbox import diff as diffs
from atelier.sandbox import fsutil

pytestmark = pytest.mark.timeout(60)

Tree = dict[str, tuple]

if shutil.which("git") is None:
    pytest.skip("git is needed as the oracle of diffs", allow_module_level=True)

OLD: dict[str, bytes | str] = {
    "README.md": "# title\n\n" + "".join(f"line {i}\n" for i in range(40)),
    "src/app.py": "import os\n\n\ndef main():\n    return os.getcwd()\n",
    "src/util.py": "X = 1\n",
    "docs/guide.txt": "guide\n",
    "no-newline.txt": "first\nlast without newline",
    "image.bin": b"\x89PNG\r\n\x1a\n\0\0\0" + bytes(range(256)) * 8,
    "script.sh": "#!/bin/sh\necho hi\n",
    "tool*": "#!/bin/sh\necho tool\n",
    "with space.txt": "spaced\n",
    "link-to-readme": "->README.md",
    "pkg/a.py": "A = 1\n",
    "pkg/b.py": "B = 2\n",
    "pkg/deep/c.py": "C = 3\n",
}


def read_tree(root: Path) -> Tree:
    """Files and symlinks (what git tracks): kind, executable bit, content."""
    out: Tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not (dirpath == str(root) and d == ".git")]
        for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("symlink", os.readlink(path))
            else:
                out[rel] = ("file", bool(st.st_mode & 0o100), Path(path).read_bytes())
    return out


def tree_diff(old: Path, new: Path) -> str:
    old_fd = os.open(old, os.O_RDONLY | os.O_DIRECTORY)
    new_fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY)
    try:
        paths = diffs.all_files(old_fd) | diffs.all_files(new_fd)
        return diffs.unified_diff(paths, old=lambda p: fsutil.entry_beneath(old_fd, p),
                                  new=lambda p: fsutil.entry_beneath(new_fd, p))
    finally:
        os.close(old_fd)
        os.close(new_fd)


def git_apply(base: Path, patch: str, dest: Path) -> Tree:
    """Apply `patch` with `git apply` to a copy of `base` at `dest`; return the result."""
    shutil.copytree(base, dest, symlinks=True)
    subprocess.run(["git", "init", "-q", str(dest)], check=True)
    res = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=dest,
                         input=patch.encode("utf-8", errors="surrogateescape"), capture_output=True)
    assert res.returncode == 0, f"git apply failed: {res.stderr.decode()}\n--- patch ---\n{patch}"
    return read_tree(dest)


def check(tmp_path: Path, change: Callable[[Path], None], write_tree) -> str:
    old = write_tree(tmp_path / "old", OLD)
    new = tmp_path / "new"
    shutil.copytree(old, new, symlinks=True)
    change(new)
    patch = tree_diff(old, new)
    if patch == "":
        assert read_tree(old) == read_tree(new)
        return patch
    assert git_apply(old, patch, tmp_path / "applied") == read_tree(new)
    return patch


# -- single changes ------------------------------------------------------------

def modify_text(t: Path) -> None:
    lines = (t / "README.md").read_text().splitlines(keepends=True)
    lines[3] = "changed line\n"
    lines[30:32] = ["inserted a\n", "inserted b\n", "inserted c\n"]
    (t / "README.md").write_text("".join(lines))
    (t / "src/app.py").write_text("import os\nimport sys\n\n\ndef main():\n    return sys.argv\n")


def add_nested(t: Path) -> None:
    (t / "new/deeply/nested").mkdir(parents=True)
    (t / "new/deeply/nested/file.py").write_text("print('new')\n")


def delete_file(t: Path) -> None:
    (t / "docs/guide.txt").unlink()
    (t / "src/util.py").unlink()


def modify_binary(t: Path) -> None:
    data = bytearray((t / "image.bin").read_bytes())
    data[100:110] = b"\xff" * 10
    (t / "image.bin").write_bytes(bytes(data) + b"\0tail")


def text_to_binary(t: Path) -> None:
    (t / "src/util.py").write_bytes(b"\0\1\2binary now")


def make_executable(t: Path) -> None:
    (t / "script.sh").chmod(0o755)
    (t / "tool").chmod(0o644)


def mode_and_content(t: Path) -> None:
    (t / "script.sh").write_text("#!/bin/sh\necho changed\n")
    (t / "script.sh").chmod(0o755)


def add_symlink(t: Path) -> None:
    (t / "src/link-to-app").symlink_to("app.py")
    (t / "dangling").symlink_to("/nowhere/at/all")


def change_symlink(t: Path) -> None:
    (t / "link-to-readme").unlink()
    (t / "link-to-readme").symlink_to("src/app.py")


def no_trailing_newline(t: Path) -> None:
    (t / "no-newline.txt").write_text("first\nlast changed, still without newline")
    (t / "src/util.py").write_text("X = 1")  # newline removed
    (t / "docs/guide.txt").write_text("guide\nmore")


def add_newline_at_end(t: Path) -> None:
    (t / "no-newline.txt").write_text("first\nlast without newline\n")


def add_empty_file(t: Path) -> None:
    (t / "empty.txt").write_bytes(b"")
    (t / "pkg/deep/__init__.py").write_bytes(b"")


def empty_an_existing_file(t: Path) -> None:
    (t / "src/util.py").write_bytes(b"")


def odd_names(t: Path) -> None:
    (t / "with space.txt").write_text("spaced, changed\n")
    (t / "new dir").mkdir()
    (t / "new dir/another file.txt").write_text("x\n")
    (t / "café.py").write_text("ÉTÉ = 'été'\n")
    (t / "日本/データ.txt").parent.mkdir()
    (t / "日本/データ.txt").write_text("こんにちは\n")
    (t / 'quote"and\\backslash').write_text("q\n")
    (t / "tab\there").write_text("t\n")


def delete_directory(t: Path) -> None:
    shutil.rmtree(t / "pkg")


def replace_directory(t: Path) -> None:
    shutil.rmtree(t / "pkg")
    (t / "pkg").mkdir()
    (t / "pkg/only.py").write_text("ONLY = 1\n")


def file_becomes_symlink(t: Path) -> None:
    (t / "src/util.py").unlink()
    (t / "src/util.py").symlink_to("app.py")


def symlink_becomes_file(t: Path) -> None:
    (t / "link-to-readme").unlink()
    (t / "link-to-readme").write_text("a file now\n")


def file_becomes_directory(t: Path) -> None:
    (t / "docs/guide.txt").unlink()
    (t / "docs/guide.txt").mkdir()
    (t / "docs/guide.txt/index.md").write_text("index\n")


def directory_becomes_file(t: Path) -> None:
    shutil.rmtree(t / "pkg/deep")
    (t / "pkg/deep").write_text("a file now\n")


def everything(t: Path) -> None:
    for change in CHANGES[:-1]:
        if change not in (delete_directory, replace_directory, directory_becomes_file,
                          text_to_binary, file_becomes_symlink, empty_an_existing_file,
                          no_trailing_newline, delete_file, add_newline_at_end):
            change(t)
    replace_directory(t)


CHANGES = [modify_text, add_nested, delete_file, modify_binary, text_to_binary, make_executable,
           mode_and_content, add_symlink, change_symlink, no_trailing_newline, add_newline_at_end,
           add_empty_file, empty_an_existing_file, odd_names, delete_directory, replace_directory,
           file_becomes_symlink, symlink_becomes_file, file_becomes_directory,
           directory_becomes_file, everything]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__)
def test_git_apply_reproduces_the_change(tmp_path, change, host) -> None:
    check(tmp_path, change, host.write_tree)


def test_no_change_no_diff(tmp_path, host) -> None:
    assert check(tmp_path, lambda t: None, host.write_tree) == ""


# -- details of the format -----------------------------------------------------

def test_no_newline_marker(tmp_path, host) -> None:
    patch = check(tmp_path, no_trailing_newline, host.write_tree)
    assert "-last without newline\n\\ No newline at end of file\n" in patch
    assert "+last changed, still without newline\n\\ No newline at end of file\n" in patch


def test_headers_of_new_deleted_mode_and_binary(tmp_path, host) -> None:
    patch = check(tmp_path, lambda t: (add_nested(t), delete_file(t), make_executable(t),
                                       modify_binary(t), add_symlink(t)), host.write_tree)
    assert "new file mode 100644\n" in patch
    assert "deleted file mode 100644\n" in patch
    assert "old mode 100644\nnew mode 100755\n" in patch
    assert "old mode 100755\nnew mode 100644\n" in patch
    assert "new file mode 120000\n" in patch
    assert "GIT binary patch\nliteral " in patch


def test_quoted_names_match_git(tmp_path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    names = ["café.py", 'quote"x', "tab\there", "plain name.txt"]
    for name in names:
        (repo / name).write_text("x\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    out = subprocess.run(["git", "diff", "--cached", "--name-only", "-z"], cwd=repo,
                         capture_output=True, check=True).stdout
    assert sorted(out.decode().strip("\0").split("\0")) == sorted(names)
    listed = subprocess.run(["git", "-c", "core.quotepath=true", "diff", "--cached", "--stat=500"],
                            cwd=repo, capture_output=True, text=True, check=True).stdout
    for name in names:
        # git's own quoting of each name appears verbatim in its output.
        assert diffs._quote(name) in listed


def test_blob_id_matches_git(tmp_path) -> None:
    for data in (b"", b"hello\n", bytes(range(256))):
        f = tmp_path / "blob"
        f.write_bytes(data)
        oid = subprocess.run(["git", "hash-object", str(f)], capture_output=True, text=True,
                             check=True).stdout.strip()
        assert diffs.blob_id(data) == oid


def test_same_entry_gives_nothing() -> None:
    entry = fsutil.Entry("file", False, b"x\n")
    assert diffs.file_diff("a", entry, entry) == b""
    assert diffs.file_diff("a", None, None) == b""


# -- through a real sandbox ----------------------------------------------------

SANDBOX_EDITS = r"""
set -e
sed -i 's/^line 3$/changed line/' README.md
mkdir -p new/deeply/nested && echo "print('new')" > new/deeply/nested/file.py
rm docs/guide.txt && rmdir docs
printf '\377\0\001' >> image.bin
chmod +x script.sh && chmod -x tool
ln -s app.py src/link-to-app
printf 'first\nlast changed, no newline' > no-newline.txt
: > empty.txt
echo 'spaced, changed' > 'with space.txt'
echo "ÉTÉ = 'été'" > café.py
mkdir 日本 && echo こんにちは > 日本/データ.txt
rm link-to-readme && echo 'a file now' > link-to-readme
mv src/util.py src/utils.py
touch src/app.py && chmod 600 README.md && chmod 644 README.md && chmod 600 pkg/a.py && chmod 644 pkg/a.py
rm -rf pkg && mkdir pkg && echo 'ONLY = 1' > pkg/only.py
"""


def sandbox_tree(sb) -> Tree:
    """The workspace as the sandbox shows it: listed by `find` inside, files
    read with `read_bytes`."""
    res = sb.exec(r"find . -mindepth 1 \( -type f -o -type l \) -printf '%y\0%m\0%P\0%l\0'")
    assert res.ok, res.stderr
    fields = res.stdout.split("\0")[:-1]
    out: Tree = {}
    for kind, mode, path, target in zip(*[iter(fields)] * 4):
        if kind == "l":
            out[path] = ("symlink", target)
        else:
            out[path] = ("file", bool(int(mode, 8) & 0o100), sb.read_bytes(path))
    return out


@pytest.fixture(params=["overlay", "copy"])
def workspace(request) -> str:
    return request.param


def test_sandbox_diff_applies(make_sandbox, tmp_path, workspace, host) -> None:
    snap = host.write_tree(tmp_path / "snap", OLD)
    sb = make_sandbox(snap, workspace=workspace)
    assert sb.mode == workspace
    res = sb.exec(SANDBOX_EDITS)
    assert res.ok, res.stderr
    patch = sb.diff()
    assert "a/src/app.py" not in patch  # touched (copied up), not changed
    assert git_apply(snap, patch, tmp_path / "applied") == sandbox_tree(sb)


def test_deleting_and_recreating_a_directory(make_sandbox, tmp_path, workspace, host) -> None:
    snap = host.write_tree(tmp_path / "snap", OLD)
    sb = make_sandbox(snap, workspace=workspace)
    assert sb.exec("rm -rf pkg && mkdir pkg && echo 'ONLY = 1' > pkg/only.py && rm -rf src").ok
    patch = sb.diff()
    for gone in ("pkg/a.py", "pkg/b.py", "pkg/deep/c.py", "src/app.py", "src/util.py"):
        assert f"diff --git a/{gone} b/{gone}\ndeleted file mode 100644\n" in patch
    assert "diff --git a/pkg/only.py b/pkg/only.py\nnew file mode 100644\n" in patch
    assert patch.count("diff --git") == 6
    assert git_apply(snap, patch, tmp_path / "applied") == sandbox_tree(sb)


def test_diff_of_forks(make_sandbox, tmp_path, workspace, host) -> None:
    snap = host.write_tree(tmp_path / "snap", OLD)
    parent = make_sandbox(snap, workspace=workspace)
    assert parent.exec("rm -rf pkg && mkdir pkg && echo one > pkg/one.py && echo p > p.txt"
                       " && rm README.md").ok
    parent_patch = parent.diff()
    child = make_sandbox.track(parent.fork())
    assert child.exec("rm -rf pkg/one.py && echo two > pkg/two.py && rm p.txt && echo c > c.txt"
                      " && echo back > README.md && rm -rf docs").ok
    grandchild = make_sandbox.track(child.fork())
    assert grandchild.exec("rm -rf pkg && echo g > g.txt").ok

    assert parent.diff() == parent_patch
    for i, sb in enumerate((parent, child, grandchild)):
        assert git_apply(snap, sb.diff(), tmp_path / f"applied{i}") == sandbox_tree(sb)
