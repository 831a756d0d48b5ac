"""lm-evaluation-harness through `atelier serve`, against its own transformers backend on the same
model: a multiple-choice task by `local-completions` (loglikelihoods from echoed prompt logprobs)
and a generation task by `local-chat-completions`, both from task files written here (a YAML task
over a local JSON-lines file: nothing is downloaded)."""

from __future__ import annotations

import json

import pytest

from tests.inference.conftest import atelier_serve

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
KEY = "eval-key"

QUESTIONS = [
    ("len([1, 2, 3]) returns", [" 3", " 2", " 1"]),
    ("The keyword that defines a function in Python is", [" def", " fun", " lambda", " class"]),
    ("json.loads parses a", [" string", " file", " socket"]),
    ("A list is sorted in place by", [" list.sort", " sorted", " reversed"]),
    ("The exception for a missing key is", [" KeyError", " IndexError", " ValueError", " OSError"]),
    ("shlex.split splits a command line like a", [" shell", " compiler", " browser"]),
    ("textwrap.dedent removes common leading", [" whitespace", " comments", " imports"]),
    ("string.ascii_letters holds the", [" letters", " digits", " punctuation"]),
    ("The value of 2 ** 3 is", [" 8", " 6", " 9"]),
    ("None is returned by a function without a", [" return", " yield", " raise"]),
    ("import os gives access to the", [" operating system", " network", " compiler"]),
    ("A tuple is", [" immutable", " mutable", " sorted", " empty"]),
]


def _task_dir(tmp_path):
    """Two lm-eval tasks over local files: `atelier_mc` (multiple choice), `atelier_gen` (generation)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rows = [{"question": q, "choices": c, "answer": 0} for q, c in QUESTIONS]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": c[0].strip()}) + "\n"
                                                for q, c in QUESTIONS[:6]))
    common = {"dataset_path": "json", "test_split": "test", "doc_to_text": "{{question}}"}
    mc = {"task": "atelier_mc", **common, "dataset_kwargs": {"data_files": {"test": str(tmp_path / "mc.jsonl")}},
          "output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
          "metric_list": [{"metric": "acc"}]}
    gen = {"task": "atelier_gen", **common, "dataset_kwargs": {"data_files": {"test": str(tmp_path / "gen.jsonl")}},
           "output_type": "generate_until", "doc_to_target": "{{answer}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
           "metric_list": [{"metric": "exact_match"}]}
    for task in (mc, gen):
        (tmp_path / f"{task['task']}.yaml").write_text(json.dumps(task))  # JSON is YAML
    return tmp_path


def _evaluate(model: str, model_args: dict, task: str, tasks_dir, **kwargs) -> list[dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                          task_manager=TaskManager(include_path=str(tasks_dir)), bootstrap_iters=0, **kwargs)
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def served(spiky_model_dir, tmp_path_factory):
    """(lm-eval's model_args for `atelier serve` on the spiky model, with an API key; the task dir)."""
    mp = pytest.MonkeyPatch()
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(name, "1")
    mp.setenv("OPENAI_API_KEY", KEY)  # lm-eval's API models send it as the bearer token
    tmp = tmp_path_factory.mktemp("lm-eval")
    with atelier_serve(["--model", str(spiky_model_dir), "--dtype", "float32"], {
            "ATELIER_API_KEY": KEY, "ATELIER_CACHE": str(tmp / "cache")}) as (url, _):
        yield {"base_url": url, "model": spiky_model_dir.name, "tokenizer": str(spiky_model_dir),
               "tokenizer_backend": "huggingface", "max_retries": 1}, _task_dir(tmp / "tasks")
    mp.undo()


def _reference(spiky_model_dir) -> dict:
    return {"pretrained": str(spiky_model_dir), "dtype": "float32", "device": "cpu"}


def test_lm_eval_loglikelihoods_through_atelier_serve_equal_transformers(served, spiky_model_dir):
    """`local-completions` scores each choice from the echoed prompt's logprobs (batches of prompts in
    one request); `hf` runs the model in process."""
    args, tasks = served
    scored = _evaluate("local-completions", {**args, "base_url": args["base_url"] + "/v1/completions",
                                             "batch_size": 8}, "atelier_mc", tasks)
    reference = _evaluate("hf", _reference(spiky_model_dir), "atelier_mc", tasks)
    assert len(scored) == len(QUESTIONS)
    for ours, theirs in zip(scored, reference):
        got = [float(r[0]) for r in ours["filtered_resps"]]
        expected = [float(r[0]) for r in theirs["filtered_resps"]]
        assert got == pytest.approx(expected, abs=1e-3), ours["doc"]["question"]
        assert [bool(r[1]) for r in ours["filtered_resps"]] == [bool(r[1]) for r in theirs["filtered_resps"]]
        assert ours["acc"] == theirs["acc"]


@pytest.mark.slow
def test_lm_eval_chat_generations_through_atelier_serve_equal_transformers(served, spiky_model_dir):
    args, tasks = served
    generated = _evaluate("local-chat-completions", {**args, "base_url": args["base_url"] + "/v1/chat/completions"},
                          "atelier_gen", tasks, apply_chat_template=True)
    reference = _evaluate("hf", _reference(spiky_model_dir), "atelier_gen", tasks, apply_chat_template=True)
    assert [s["filtered_resps"] for s in generated] == [s["filtered_resps"] for s in reference]
    assert all(s["filtered_resps"][0] for s in generated)  # something was generated for each
