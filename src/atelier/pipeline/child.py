"""One stage of `atelier run` in a process of its own (see `runner.run_in_child`).

    python -m atelier.pipeline.child RUN_DIR RECIPE_DIR STAGE EVENTS_FD

Reads the run's frozen `config.toml` and `stages.json`, runs the stage and
writes its events to EVENTS_FD, one JSON object per line: `{"say": text}`,
`{"progress": [done, total]}`, and last `{"outputs": {...}}` (exit 0) or
`{"error": message, "hint": hint}` for an `AtelierError` (exit 2), or
`{"bug": message, "hint": hint}` for a `BugError` (a bug a batch edge caught
and logged with its traceback: exit 1). Any other exception is a bug: its
traceback goes to stderr (the stage's log) and the exit status is 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from atelier.config import load_config
from atelier.errors import AtelierError, BugError
from atelier.pipeline.config import RunConfig
from atelier.pipeline.runner import StageLedger
from atelier.pipeline.stages import BY_NAME, StageContext


def main(argv: list[str]) -> int:
    run_dir, recipe_dir, stage, fd = Path(argv[0]), Path(argv[1]), argv[2], int(argv[3])
    with os.fdopen(fd, "w", encoding="utf-8", buffering=1) as events:
        def emit(**event: object) -> None:
            events.write(json.dumps(event) + "\n")

        try:
            config = load_config(RunConfig, run_dir / "config.toml")
            context = StageContext(config, run_dir, recipe_dir, lambda text: emit(say=text), StageLedger(run_dir),
                                   lambda _stage, done, total: emit(progress=[done, total]))
            emit(outputs=context.run(BY_NAME[stage]))
        except AtelierError as exc:
            emit(error=exc.message, hint=exc.hint)
            return 2
        except BugError as exc:
            emit(bug=exc.message, hint=exc.hint)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
