"""`atelier tasks build …`: make tasks from real code (release diffs, mutations, suites).

Heavy modules are imported inside the commands so `atelier --help` stays fast.
"""

from __future__ import annotations

import enum

import typer

from atelier.cli.options import Backend

build_app = typer.Typer(invoke_without_command=True)   # its help: the callback's docstring


class Only(str, enum.Enum):
    release = "release"
    mutation = "mutation"


@build_app.callback()
def build_suite_cmd(
    ctx: typer.Context,
    suite: str = typer.Option(None, "--suite", help="A committed suite name (e.g. atelier-bench) or a spec .toml."),
    out: str = typer.Option(None, "--out", help="Suite directory to build into (resumable)."),
    only: Only = typer.Option(None, "--only", help="Build only the release-diff or the mutation entries."),
    limit: int = typer.Option(None, "--limit", min=1, help="First N release entries, at most N mutation tasks."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Entries built at once."),
    backend: Backend = typer.Option(Backend.bwrap, "--backend", help="bwrap (isolated) or local (isolates nothing)."),
    retry_dropped: bool = typer.Option(False, "--retry-dropped", help="Try again entries an earlier run dropped."),
    as_json: bool = typer.Option(False, "--json", help="Print the build report as JSON (no progress bar)."),
) -> None:
    """Build tasks from real code: a whole suite (--suite), or one builder (release-diff, mutate).

    A suite is built from its spec: sdists from PyPI (cached), every task
    validated (gold passes each run, empty patch fails) before it lands in OUT.
    Run it again to resume; OUT/build-report.json says what was dropped and why.

    Example: atelier tasks build --suite atelier-bench --out suites/bench --jobs 2"""
    # Long on purpose: one typer option per line is the command's interface; the body is short.
    if ctx.invoked_subcommand is not None:
        if suite is not None:
            from atelier.tasks.schema import TaskError

            raise TaskError("--suite builds a whole suite; it does not go with a subcommand",
                            hint=f"drop --suite, or drop `{ctx.invoked_subcommand}`")
        return
    if suite is None or out is None:
        if suite is None and out is None:
            typer.echo(ctx.get_help())
            raise typer.Exit(0)
        from atelier.tasks.schema import TaskError

        raise TaskError("--suite and --out go together",
                        hint="e.g. atelier tasks build --suite atelier-bench --out suites/bench")
    import json

    from atelier.tasks.suite import resolve_spec
    from atelier.tasks.suite_build import build_suite, planned_units, summarize_drops

    spec = resolve_spec(suite)
    kind = only.value if only is not None else None
    total = planned_units(spec, kind, limit)
    kw = dict(only=kind, limit=limit, jobs=jobs, backend=backend.value, retry_dropped=retry_dropped)
    if as_json:
        build = build_suite(spec, out, **kw)
        print(json.dumps(build.to_json()))
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=False) as bar:
            job = bar.add_task(f"{spec.spec.name}", total=total)

            def progress(n: int, msg: str) -> None:
                bar.update(job, advance=n, description=msg[:70])

            build = build_suite(spec, out, progress=progress, **kw)
        data = build.to_json()
        typer.echo(f"{spec.spec.name}: {data['built']} task(s) built, {data['kept']} already there, "
                   f"{data['dropped']} dropped, {data['errors']} entr{'y' if data['errors'] == 1 else 'ies'} "
                   f"with errors; splits {data['splits']}")
        for line in summarize_drops(build.entries):
            typer.echo("  " + line)
        typer.echo(f"report: {out}/build-report.json; index: {out}/index.toml")
    if not any(e.tasks for e in build.entries):
        raise typer.Exit(1)


@build_app.command("release-diff")
def release_diff_cmd(
    package: str = typer.Option(None, "--package", help="PyPI name (with --from/--to), or the name for local dirs."),
    from_version: str = typer.Option(None, "--from", help="The older release (the base)."),
    to_version: str = typer.Option(None, "--to", help="The newer release (its tests and changelog)."),
    old_dir: str = typer.Option(None, "--old-dir", help="The older release's unpacked source, instead of PyPI."),
    new_dir: str = typer.Option(None, "--new-dir", help="The newer release's unpacked source."),
    out: str = typer.Option(..., "--out", help="Suite directory; the task goes to OUT/<id>."),
    runs: int = typer.Option(3, "--runs", min=1, help="Test runs per side; tests must agree in all."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds one test run may take."),
    no_deps: bool = typer.Option(False, "--no-deps", help="Install none of the package's requirements."),
    backend: Backend = typer.Option(Backend.bwrap, "--backend", help="bwrap (isolated) or local (isolates nothing)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing task directory."),
) -> None:
    """A task from two consecutive releases: base = older, gold = the non-test diff,
    hidden tests = the newer tests, prompt = the changelog entry. Exit 1 when dropped.
    Example: atelier tasks build release-diff --package cachetools --from 5.1.0 --to 5.2.0 --out suites/rel"""
    from atelier.tasks.schema import TaskError

    local = old_dir is not None or new_dir is not None
    if local and (old_dir is None or new_dir is None):
        raise TaskError("--old-dir and --new-dir go together", hint="pass both release directories")
    if not local and not (package and from_version and to_version):
        raise TaskError("nothing to build from",
                        hint="pass --package NAME --from A --to B, or --old-dir A --new-dir B")
    from atelier.tasks import release

    kw = dict(runner=release.sandbox_runner(backend.value), runs=runs, timeout_s=timeout,
              progress=lambda msg: typer.echo(msg, err=True), overwrite=overwrite,
              requirements=[] if no_deps else None)
    if local:
        report = release.build_release_task(old_dir, new_dir, out, package=package,
                                            old_version=from_version, new_version=to_version, **kw)
    else:
        report = release.build_from_pypi(package, from_version, to_version, out, **kw)
    if report.dropped is not None:
        typer.echo(f"dropped {report.task_id}: {report.dropped}")
        raise typer.Exit(1)
    typer.echo(f"wrote {report.task_dir}: {report.fail_to_pass} fail-to-pass, "
               f"{report.pass_to_pass} pass-to-pass, {len(report.flaky)} flaky dropped, "
               f"{report.files_changed} file(s) in the gold patch")


@build_app.command("mutate")
def mutate_cmd(
    repo: str = typer.Option(..., "--repo", help="A Python repository whose own tests pass."),
    out: str = typer.Option(..., "--out", help="Suite directory; each task goes to OUT/<id>."),
    n: int = typer.Option(10, "--n", min=1, help="How many tasks to build."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same tasks."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds one test run may take."),
    backend: Backend = typer.Option(Backend.bwrap, "--backend", help="Where tests run: bwrap (isolated) or local."),
) -> None:
    """Tasks from AST-level bugs (1-3 per task, across files) that break tests
    which passed before; the gold patch restores the original code.
    Example: atelier tasks build mutate --repo ~/src/mypkg --out suites/mut --n 50"""
    from pathlib import Path

    from atelier.tasks.mutation_tasks import build_mutation_tasks, sandbox_pytest_runner
    from atelier.tasks.schema import TaskError

    if not Path(repo).is_dir():
        raise TaskError(f"repository {repo} not found", hint="pass the directory of a Python repository")
    report = build_mutation_tasks(Path(repo), Path(out), n=n, seed=seed,
                                  run_tests=sandbox_pytest_runner(backend.value, timeout))
    for task_id in report.tasks:
        typer.echo(f"wrote {Path(out) / task_id}")
    reasons: dict[str, int] = {}
    for dropped in report.dropped:
        reasons[dropped.reason] = reasons.get(dropped.reason, 0) + 1
    typer.echo(f"{len(report.tasks)} of {n} tasks written; {len(report.dropped)} candidates dropped"
               + "".join(f"\n  {count} x {reason}" for reason, count in sorted(reasons.items())))
    if not report.tasks:
        raise typer.Exit(1)
