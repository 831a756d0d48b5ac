"""`atelier sandbox …`: run a command in a fresh sandbox; benchmark sandboxes.

Heavy modules are imported inside the commands so `atelier --help` stays fast.
"""

from __future__ import annotations

import enum
import json
import sys
from pathlib import Path
from typing import List

import typer

from atelier.cli.options import Backend


class Network(str, enum.Enum):
    none = "none"
    host = "host"
    proxy = "proxy"


sandbox_app = typer.Typer(help="Isolated coding environments.", no_args_is_help=True)


@sandbox_app.command(
    "run",
    context_settings={"allow_interspersed_args": False},
)
def run(
    command: List[str] = typer.Argument(..., help="The command and its arguments (after --)."),
    workspace: Path = typer.Option(..., "--workspace", "-w", help="Directory to run over; never changed."),
    timeout: float = typer.Option(60.0, "--timeout", help="Wall-clock limit in seconds (exit 124 past it)."),
    memory_mb: int = typer.Option(2048, "--memory-mb",
                                  help="Memory of the whole sandbox: a process past it is killed "
                                       "(a memory cgroup where one is writable, else a watchdog "
                                       "plus this address-space limit per process)."),
    network: Network = typer.Option(Network.none, "--network",
                                    help="none (sealed), proxy (only --allow pairs, through a logging "
                                         "HTTP(S) proxy) or host (explicit)."),
    allow: List[str] = typer.Option([], "--allow", metavar="HOST:PORT",
                                    help="With --network proxy: a host:port the sandbox may reach (repeat)."),
    egress_log: Path = typer.Option(None, "--egress-log",
                                    help="With --network proxy: append one JSON line per attempt here."),
    backend: Backend = typer.Option(Backend.bwrap, "--backend", help="bwrap (isolated) or local (isolates nothing)."),
    show_diff: bool = typer.Option(False, "--diff", help="Print the workspace diff afterwards."),
) -> None:
    """Run one command in a fresh sandbox over DIR, streaming its output, and
    exit with its exit code. The directory itself is never modified.

    With --network proxy the sandbox reaches only the --allow pairs, through a
    logging HTTP(S) proxy.

    Example: atelier sandbox run -w . --diff -- python -m pytest -q"""
    from atelier.config import load_config
    from atelier.sandbox import SandboxConfig, create_sandbox

    overrides = [f"timeout_s={timeout}", f"memory_mb={memory_mb}", f"network={network.value}",
                 f"backend={backend.value}"]
    if allow:
        overrides.append(f"egress.allow={json.dumps(allow)}")
    if egress_log is not None:
        overrides.append(f"egress.log={json.dumps(str(egress_log))}")
    config = load_config(SandboxConfig, None, overrides)

    def stream(name: str, chunk: bytes) -> None:
        out = sys.stdout if name == "stdout" else sys.stderr
        out.buffer.write(chunk)
        out.flush()

    with create_sandbox(workspace, config) as sb:
        result = sb.exec(list(command), on_output=stream)
        if result.timed_out:
            print(f"\natelier: command timed out after {timeout:g} s", file=sys.stderr)
        if result.oom_killed:
            print(f"\natelier: a process was killed for passing the sandbox's memory limit of "
                  f"{memory_mb} MiB (enforced by {sb.memory_enforcement})", file=sys.stderr)
        if result.host_oom_killed:
            print("\natelier: the host's OOM killer killed a process of the sandbox (the host is "
                  "short of memory)", file=sys.stderr)
        if result.truncated:
            print("\natelier: output was longer than the capture limit; the stream above is whole",
                  file=sys.stderr)
        if show_diff:
            sys.stdout.write(sb.diff())
    raise typer.Exit(result.exit_code)


@sandbox_app.command("bench")
def bench(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object only."),
    quick: bool = typer.Option(False, "--quick", help="Fewer repetitions (a smoke run)."),
) -> None:
    """Measure sandbox create, exec, fork, rate and density against a plain
    copy (and Docker where a daemon answers).

    Example: atelier sandbox bench --quick --json"""
    from atelier.sandbox import bench as sandbox_bench

    if as_json:
        result = sandbox_bench.run(quick=quick)
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    with console.status("benchmarking sandboxes") as status:
        result = sandbox_bench.run(quick=quick, progress=lambda m: status.update(f"benchmarking: {m}"))
    table = Table(title="atelier sandbox benchmark")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key != "targets_met":
            table.add_row(key, str(value))
    console.print(table)
    for target, met in result["targets_met"].items():
        mark = "[green]met[/]" if met else ("[dim]n/a[/]" if met is None else "[red]missed[/]")
        console.print(f"  {target}: {mark}")
