"""Next-line completion: the RL task of the CPT scaling experiment.

A task shows the model the few lines of a real Python file that precede a
line and asks for that line; the reward is the character-level edit
similarity of the first line it writes to the true line (1.0 for an exact
match, `pass` when exact). The same task builder makes the SFT chat data (from
training repositories) and the RL tasks (from held-out repositories, which
the CPT runs never trained on), so SFT teaches the answer format and RL
measures how much code knowledge the base brought.

Why this task: continued pretraining on code can only show up in RL reward if
the reward depends on knowing code. Real agent tasks (`atelier train` with
`env.kind = "tasks"`) are out of reach for a sub-million-parameter model on a
laptop CPU, and the toy environment's reward (low token ids) does not depend
on code at all. Single-turn, no tools: this measures code knowledge through
the RL trainer, not agent skill.

`NextLineEnvironment` follows `atelier.rl.env.Environment` (tasks, category,
rollout) exactly as `ToyEnvironment` does, and uses the same trajectory,
shaping and `pass` conventions. `make_environment` is its factory for
`env.kind = "python"` (`factory = ".../completion.py:make_environment"`,
`args = {tasks_file = "rl_tasks.jsonl"}`).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from atelier.pretrain.state_tracking import edit_similarity


@dataclass(frozen=True)
class LineTask:
    id: str
    prompt: str            # the user message
    target: str            # the line to write, with its indentation
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def prompt_for(path: str, context: Sequence[str]) -> str:
    body = "\n".join(context)
    return f"Write the next line of {path}.\n```python\n{body}\n```"


def candidate_lines(lines: Sequence[str], *, context_lines: int, min_chars: int,
                    max_chars: int) -> list[int]:
    """Indices of lines worth predicting: code (not blank, not a comment) of a bounded length,
    with `context_lines` lines before them."""
    out = []
    for i in range(context_lines, len(lines)):
        stripped = lines[i].strip()
        if stripped.startswith("#") or not min_chars <= len(stripped) <= max_chars:
            continue
        if len(lines[i]) > max_chars + 16:  # deep indentation: long for the model, little to learn
            continue
        out.append(i)
    return out


def line_tasks(files: Iterable[tuple[str, str]], count: int, *, seed: int, per_file: int = 2,
               context_lines: int = 8, min_chars: int = 8, max_chars: int = 48,
               prefix: str = "line") -> list[LineTask]:
    """`count` tasks from (path, text) pairs: at most `per_file` per file, in a seeded order.

    Files are visited in the order given; positions within a file and the final
    order are drawn from `seed`, so the same inputs give the same tasks.
    """
    rng = random.Random(seed)
    pool: list[LineTask] = []
    for path, text in files:
        lines = [line.rstrip() for line in text.splitlines()]
        picks = candidate_lines(lines, context_lines=context_lines, min_chars=min_chars, max_chars=max_chars)
        for i in sorted(rng.sample(picks, min(per_file, len(picks)))):
            context = lines[i - context_lines:i]
            indent = len(lines[i]) - len(lines[i].lstrip())
            pool.append(LineTask(f"{prefix}-{len(pool):05d}", prompt_for(path, context), lines[i],
                                 {"path": path, "line": i + 1, "indent": indent}))
    rng.shuffle(pool)
    return pool[:count]


def first_line(text: str) -> str:
    return text.split("\n", 1)[0].rstrip()


def line_reward(generated: str, target: str) -> float:
    """Edit similarity of the first generated line to the target line (both right-stripped)."""
    return edit_similarity(first_line(generated), target.rstrip())


def chat_record(task: LineTask) -> dict[str, Any]:
    """One SFT conversation: the task's prompt and the true line as the answer."""
    return {"messages": [{"role": "user", "content": task.prompt},
                         {"role": "assistant", "content": task.target}]}


class NextLineEnvironment:
    """`atelier.rl.env.Environment` over `LineTask`s; reward = `line_reward` (+ shaping)."""

    def __init__(self, tasks: Sequence[LineTask], rollout, shaping) -> None:
        self._tasks, self.rollout_cfg, self.shaping = list(tasks), rollout, shaping

    def tasks(self) -> Sequence[LineTask]:
        return self._tasks

    def category(self, task: LineTask) -> str:
        return f"indent-{min(task.metadata.get('indent', 0) // 4, 3)}"

    def rollout(self, task: LineTask, model, seed: int):
        from atelier.inference.types import SamplingParams
        from atelier.rl.env import chat_prompt_ids, single_turn_trajectory

        start = time.perf_counter()
        tok = model.tokenizer
        prompt_ids = chat_prompt_ids(tok, task.prompt)
        # One line is the whole answer: stop at the end of the turn or of the line.
        params = SamplingParams(max_tokens=self.rollout_cfg.max_tokens,
                                temperature=self.rollout_cfg.temperature, seed=seed, stop=("\n",))
        gen = model.generate(prompt_ids, params)
        text = tok.decode(gen.token_ids, skip_special_tokens=True)  # without the end-of-turn token
        return single_turn_trajectory(task.id, task.prompt, model, prompt_ids, gen, text, params,
                                      correctness=line_reward(text, task.target),
                                      passed=first_line(text) == task.target.rstrip(),
                                      shaping=self.shaping, started=start)


def make_environment(rollout, shaping, seed: int, tasks_file: str) -> NextLineEnvironment:
    """The `env.kind = "python"` factory: the tasks of a JSONL file written by `LineTask.to_json`."""
    with open(tasks_file, encoding="utf-8") as f:
        tasks = [LineTask(**json.loads(line)) for line in f if line.strip()]
    return NextLineEnvironment(tasks, rollout, shaping)
