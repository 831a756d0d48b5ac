"""Tasks: the format, loading with clear errors, dependency environments and
honest grading.

- `schema`: `Task` and what `task.toml` may hold.
- `loader`: `load_task(dir)`, `load_suite(dir)`; every problem a `TaskError`.
- `envs`: `ensure_env(task)`, one shared read-only venv per Python+requirements.
- `junit`: JUnit XML → `{node id: status}` (pure; the release builder's probe runs).
- `grade`: `grade(task, patch | sandbox) -> GradeResult`; `score` is the pure part.
  Results come from `reporter` (run inside the test process, fed on stdin,
  writing on the stdout pipe), checked by `tamper` (stream, canaries,
  verdict; pure); `screen` is the static patch screen (`tamper_suspect`).
- `writer`: `write_task(...)`, the one way builders and importers write a task.
- `validate`, `stats`: gold passes three times and the empty patch fails;
  prompt and patch sizes beside the reference benchmark's.
- Builders: `release` (+ `changelog`) for consecutive releases of a package;
  `mutate` (operators, pure) and `mutation_tasks` (running and writing);
  `pytest_ini`, the test command both give their tasks (project pythonpath,
  addopts without coverage/xdist, idle environment plugins off).
- Importers: `swebench`, `harbor`.
- Suites: `suite` (committed specs under `suites/`: packages, versions,
  test selections, splits) and `suite_build` (`build_suite`: fetch, build,
  validate, resume, report).

Heavy parts are not imported here: `from atelier.tasks.grade import grade`.
"""

from __future__ import annotations

from atelier.tasks.loader import load_suite, load_task
from atelier.tasks.schema import Task, TaskError

__all__ = ["Task", "TaskError", "load_suite", "load_task"]
