"""The `--model` of `atelier eval`: a real model, or a scripted one for checks.

- a directory, a known name (`smollm2-135m`), a hub id or an `http(s)://`
  URL of an OpenAI-compatible server: `atelier.inference.models.open_model`;
- `scripted:gold`: replays each task's gold patch through the agent's tools
  (`atelier.harness.replay`): every task should score 1, so it checks the
  tasks, the tools and the grader end to end;
- `GoldReplay` (not a `--model`: `atelier run`'s SFT data): the same replays
  as *token* models with the policy's tokenizer, so their trajectories carry
  the token ids and loss masks a warm start trains on;
- `scripted:empty`: submits at once without a change: every task should
  score 0;
- `script:FILE`: replays a JSON list of assistant texts (the same for every
  attempt).

Scripted models are chat models made afresh for each attempt (`for_task`):
a script is consumed turn by turn, so attempts must not share one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atelier.eval.records import EvalError
from atelier.harness.parsing import format_call
from atelier.harness.replay import gold_patch_script, task_replay_script
from atelier.inference.models import is_url, open_model
from atelier.inference.scripted import ScriptedChatModel, ScriptedModel, load_script
from atelier.tasks.schema import Task


class ScriptedPolicy:
    """A fresh `ScriptedChatModel` per attempt, its texts chosen by `texts_for(task)`."""

    def __init__(self, name: str, texts_for) -> None:
        self.name = name
        self._texts_for = texts_for

    def for_task(self, task: Task) -> Any:
        return ScriptedChatModel(self._texts_for(task), name=self.name)


class GoldReplay:
    """Per task, a scripted *token* model that replays the gold patch through the tools with
    the policy's tokenizer, so its trajectories carry token ids and loss masks the SFT phase
    trains on directly. `kind`: "located" (find the named function with grep, read it, edit)
    or "gold" (read at the patch's line numbers); see `atelier.harness.replay`."""

    name = "gold-replay"

    def __init__(self, model_path: str, kind: str = "located") -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.kind = kind

    def for_task(self, task: Task) -> ScriptedModel:
        return ScriptedModel(self.tokenizer, task_replay_script(task, self.kind), name=self.name)


def gold_texts(task: Task) -> list[str]:
    def read_original(rel: str) -> str:
        return (task.snapshot / rel).read_text(encoding="utf-8")

    return gold_patch_script(task.gold_patch, read_original=read_original)


def empty_texts(task: Task) -> list[str]:
    return [format_call("submit", {"message": "No change."})]


def open_eval_model(spec: str, *, api_key: str | None = None, served_model: str | None = None,
                    inference: Any = None) -> Any:
    """What `--model SPEC` names (see the module docstring); `api_key` and
    `served_model` go to an http(s) server, `inference` (an `InferenceConfig`)
    picks the engine of a local model."""
    if not spec:
        raise EvalError("--model is empty", hint="pass a model directory, a name such as smollm2-135m, "
                                                 "a server URL, or scripted:gold")
    if spec == "scripted:gold":
        return ScriptedPolicy("scripted:gold", gold_texts)
    if spec == "scripted:empty":
        return ScriptedPolicy("scripted:empty", empty_texts)
    if spec.startswith("scripted:"):
        raise EvalError(f"unknown scripted model {spec!r}",
                        hint="scripted:gold, scripted:empty, or script:FILE (a JSON list of texts)")
    if spec.startswith("script:"):
        path = Path(spec[len("script:"):])
        texts = load_script(path)
        return ScriptedPolicy(f"scripted:{path.stem}", lambda task: texts)

    if is_url(spec):
        return open_model(spec, api_key=api_key, model=served_model)
    return open_model(spec, inference=inference)
