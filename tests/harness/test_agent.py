"""The agent loop end to end over real sandboxes, driven by scripted models."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from atelier.harness.agent import Event, run_episode
from atelier.harness.config import AgentConfig, SamplingConfig
from atelier.harness.parsing import format_call as fc
from atelier.harness.trajectory import Trajectory
from atelier.inference.scripted import ScriptedChatModel, ScriptedModel
from atelier.inference.types import ChatReply
from tests.harness.conftest import TEST_COMMAND

FIX = {"path": "pkg/calc.py", "old_string": "return a - b", "new_string": "return a + b"}
SOLVE = [
    "Let me look at the code.\n" + fc("read_file", {"path": "pkg/calc.py"}),
    fc("edit_file", FIX) + "\n" + fc("run_terminal", {"command": TEST_COMMAND}),
    fc("submit", {"message": "add now adds"}),
]


def test_scripted_model_solves_a_task_end_to_end(sandbox, repo, tokenizer, tmp_path):
    events: list[Event] = []
    traj = run_episode(ScriptedModel(tokenizer, SOLVE), sandbox, "add(2, 3) is not 5; fix it", task_id="calc",
                       on_event=events.append)
    assert traj.exit_reason == "submitted" and traj.error is None
    assert traj.turns == 3 and traj.num_tool_calls == 4 and traj.broken_calls == 0
    run = traj.tool_calls[2]
    assert run.name == "run_terminal" and run.output.startswith("exit code: 0") and run.ok
    assert "-    return a - b\n+    return a + b" in traj.final_diff
    assert [e.kind for e in events] == ["turn", "tool_call", "turn", "tool_call", "tool_call", "turn",
                                        "tool_call", "end"]
    # The diff applies to the original repository and makes its tests pass there.
    copy = shutil.copytree(repo, tmp_path / "applied")
    subprocess.run(["git", "apply", "-"], input=traj.final_diff, text=True, cwd=copy, check=True)
    tests = subprocess.run([sys.executable, "-m", "unittest", "-q", "tests.test_calc"], cwd=copy,
                           capture_output=True, text=True)
    assert tests.returncode == 0, tests.stderr
    for kind in ("prompt", "completion", "tool_call", "tool_output", "final_message"):
        assert traj.tokens[kind] > 0, kind
    assert traj.limits["max_turns"] == AgentConfig().max_turns
    saved = Trajectory.load(traj.save(tmp_path / "traj.json"))
    assert saved.to_dict() == traj.to_dict()


def _check_token_exact(traj: Trajectory, model: ScriptedModel) -> None:
    """Each generate call saw exactly its segment so far; the segments hold the
    prompts plus exactly what the model produced, masked 1, nothing else masked 1."""
    call = 0
    for seg in traj.segments:
        sampled_at: list[int] = []
        while call < len(model.prompts) and seg.token_ids[: len(model.prompts[call])] == model.prompts[call] \
                and len(model.prompts[call]) + len(model.outputs[call]) <= len(seg):
            start = len(model.prompts[call])
            out = model.outputs[call]
            assert seg.token_ids[start:start + len(out)] == out
            sampled_at += range(start, start + len(out))
            call += 1
        assert [i for i, m in enumerate(seg.loss_mask) if m] == sampled_at
        assert all(seg.versions[i] == model.version and seg.logprobs[i] == 0.0 for i in sampled_at)
        assert all(v == -1 for i, v in enumerate(seg.versions) if i not in set(sampled_at))
    assert call == len(model.prompts)


def test_token_exact_segment_and_text_agree_with_the_chat_template(sandbox, tokenizer):
    model = ScriptedModel(tokenizer, SOLVE, version=7)
    traj = run_episode(model, sandbox, "fix add")
    (seg,) = traj.segments
    _check_token_exact(traj, model)
    assert [p[: len(model.prompts[0])] for p in model.prompts] == [model.prompts[0]] * 3
    for i in range(2):
        assert model.prompts[i + 1][: len(model.prompts[i]) + len(model.outputs[i])] == \
            model.prompts[i] + model.outputs[i]
    # The buffer decodes to what the chat template makes of the messages.
    rendered = tokenizer.apply_chat_template(traj.messages, tokenize=False)
    assert tokenizer.decode(seg.token_ids) + "\n" == rendered
    assert seg.sampled_tokens == sum(len(o) for o in model.outputs) == traj.tokens["completion"]


def test_turn_cut_at_its_length_limit_keeps_sampled_tokens_and_closes_the_turn(sandbox, tokenizer):
    long_text = "thinking " * 200 + fc("submit", {})
    model = ScriptedModel(tokenizer, [long_text, SOLVE[-1]])
    config = AgentConfig(sampling=SamplingConfig(max_tokens=100))
    traj = run_episode(model, sandbox, "fix add", config=config)
    assert traj.exit_reason == "submitted" and traj.broken_calls == 1  # the cut turn has no complete call
    assert len(model.outputs[0]) == 100 and tokenizer.eos_token_id not in model.outputs[0]
    _check_token_exact(traj, model)
    assert tokenizer.decode(traj.segments[0].token_ids) + "\n" == \
        tokenizer.apply_chat_template(traj.messages, tokenize=False)


def test_broken_calls_are_observed_counted_and_the_loop_goes_on(sandbox, tokenizer):
    script = ["I am not sure what to do.", '<tool_call>{"name": "read_file", "arguments": {"file": 1}}</tool_call>',
              "<tool_call>{oops</tool_call>" + fc("list_dir", {}), fc("submit", {})]
    traj = run_episode(ScriptedModel(tokenizer, script), sandbox, "look around")
    assert traj.exit_reason == "submitted" and traj.broken_calls == 3
    outputs = [c.output for c in traj.tool_calls]
    assert "no tool call found" in outputs[0] and "unknown argument 'file'" in outputs[1]
    assert "not valid JSON" in outputs[2] and "pkg/" in outputs[3]
    assert "unknown argument 'file'" in traj.messages[5]["content"]


def test_max_turns_ends_the_loop_and_the_trajectory_is_kept(sandbox, tokenizer, tmp_path):
    script = [fc("list_dir", {})] * 5
    traj = run_episode(ScriptedModel(tokenizer, script), sandbox, "wander", config=AgentConfig(max_turns=2))
    assert traj.exit_reason == "max_turns" and traj.turns == 2 and traj.error is None
    assert traj.limits["max_turns"] == 2
    assert Trajectory.load(traj.save(tmp_path / "t.json")).exit_reason == "max_turns"


class EngineDiesAfterScript(ScriptedModel):
    """A token model whose engine is closed once its script is played (an infrastructure failure)."""

    def generate(self, prompt_ids, params):
        from atelier.inference.engine import EngineClosed

        if self.remaining == 0:
            raise EngineClosed("the engine is closed")
        return super().generate(prompt_ids, params)


def test_token_budget_and_errors_end_with_a_reason(sandbox, tokenizer):
    script = [fc("edit_file", FIX)] + [fc("list_dir", {})] * 5
    traj = run_episode(ScriptedModel(tokenizer, script), sandbox, "go", config=AgentConfig(max_tokens=60))
    assert traj.exit_reason == "max_tokens"
    died = run_episode(EngineDiesAfterScript(tokenizer, [fc("edit_file", FIX)]), sandbox.fork(), "go")
    assert died.exit_reason == "error" and died.error.startswith("EngineClosed")
    assert "+    return a + b" in died.final_diff  # the diff is filled whatever happens


def test_a_bug_in_an_episode_propagates_instead_of_reading_as_an_outage(sandbox, tokenizer):
    """Running out of script is not the infrastructure's failure: `run_episode` raises it."""
    from atelier.failures import is_infra
    from atelier.inference.scripted import ScriptExhausted

    with pytest.raises(ScriptExhausted) as info:
        run_episode(ScriptedModel(tokenizer, [fc("edit_file", FIX)]), sandbox.fork(), "go")
    assert not is_infra(info.value)


def test_self_summarization_starts_new_segments_from_summary_and_state(sandbox, tokenizer):
    from atelier.harness.prompt import build_messages
    from atelier.harness.tools import default_tools

    prompt_len = len(tokenizer.encode(tokenizer.apply_chat_template(
        build_messages(default_tools(), "fix add"), add_generation_prompt=True, tokenize=False)))
    script = [
        fc("todo_write", {"items": [{"content": "fix add", "status": "in_progress"}]}) + fc(
            "read_file", {"path": "pkg/calc.py"}),
        "SUMMARY-ONE: add in pkg/calc.py subtracts; fix it next.",
        fc("edit_file", FIX) + fc("read_file", {"path": "tests/test_calc.py"}),
        "SUMMARY-TWO: fixed add; run the tests.",
        fc("run_terminal", {"command": TEST_COMMAND}) + fc("submit", {"message": "done"}),
    ]
    model = ScriptedModel(tokenizer, script)
    config = AgentConfig(summary_trigger_tokens=prompt_len + 400, max_context_tokens=8192)
    events: list[Event] = []
    traj = run_episode(model, sandbox, "fix add", config=config, on_event=events.append)
    assert traj.exit_reason == "submitted", traj.error
    assert traj.summaries == 2 and len(traj.segments) == 3 and traj.turns == 3
    assert [e.text[:11] for e in events if e.kind == "summary"] == ["SUMMARY-ONE", "SUMMARY-TWO"]
    _check_token_exact(traj, model)
    second = tokenizer.decode(traj.segments[1].token_ids)
    assert "SUMMARY-ONE" in second and '<summary number="1">' in second
    assert "[~] fix add" in second and "pkg/calc.py (viewed)" in second
    third = tokenizer.decode(traj.segments[2].token_ids)
    assert "SUMMARY-TWO" in third and "pkg/calc.py (edited)" in third and "SUMMARY-ONE" not in third
    assert traj.tokens["summary"] == len(model.outputs[1]) + len(model.outputs[3])
    assert "+    return a + b" in traj.final_diff


def test_chat_model_with_native_tool_calls(sandbox):
    replies = [
        ChatReply(text="", tool_calls=[{"id": "c1", "name": "edit_file", "arguments": FIX}],
                  prompt_tokens=900, completion_tokens=30),
        ChatReply(text=fc("run_terminal", {"command": TEST_COMMAND})),
        ChatReply(text="done", tool_calls=[{"id": "c3", "function": {"name": "submit", "arguments": "{}"}}]),
    ]
    model = ScriptedChatModel(replies)
    traj = run_episode(model, sandbox, "fix add", config=AgentConfig(native_tools=True))
    assert traj.exit_reason == "submitted" and traj.segments == [] and traj.broken_calls == 0
    assert model.requests[1][-1] == {"role": "tool", "name": "edit_file", "tool_call_id": "c1",
                                     "content": traj.tool_calls[0].output}
    assert model.requests[1][-2]["tool_calls"][0]["function"]["name"] == "edit_file"
    assert "<tool_response" in model.requests[2][-1]["content"]
    assert traj.tool_calls[1].output.startswith("exit code: 0")
    assert traj.tokens["prompt"] == 900 and "+    return a + b" in traj.final_diff


def test_tiny_real_model_runs_turns_without_crashing(sandbox, tiny_model_dir):
    engine_mod = pytest.importorskip("atelier.inference.engine")
    with engine_mod.LocalEngine(tiny_model_dir) as engine:
        config = AgentConfig(max_turns=2, sampling=SamplingConfig(max_tokens=24, seed=0))
        traj = run_episode(engine, sandbox, "fix add", config=config)
    assert traj.exit_reason == "max_turns", traj.error
    assert traj.turns == 2 and traj.broken_calls >= 1
    (seg,) = traj.segments
    assert 0 < seg.sampled_tokens <= 48 and all(v == 0 for v, m in zip(seg.versions, seg.loss_mask) if m)
    assert Path(tiny_model_dir).is_dir()


@pytest.mark.parametrize("numbered", [False, True])
def test_long_episodes_stay_token_exact_with_local_and_history_dependent_templates(sandbox, tokenizer, numbered):
    """After a few probe turns the deltas are rendered over a short history;
    a template that looks back (it numbers messages) must keep full renders."""
    import copy

    tok = copy.deepcopy(tokenizer)
    if numbered:
        tok.chat_template = tok.chat_template.replace(
            "message['role'] + '\\n'", "message['role'] + ' ' + loop.index|string + '\\n'").replace(
            "'<|im_start|>assistant\\n'", "'<|im_start|>assistant ' + (messages|length + 1)|string + '\\n'")
    script = [fc("list_dir", {}), fc("grep", {"pattern": "def"}), fc("read_file", {"path": "README.md"})] * 3
    model = ScriptedModel(tok, [*script, fc("submit", {})])
    traj = run_episode(model, sandbox, "look around")
    assert traj.exit_reason == "submitted" and traj.turns == 10
    _check_token_exact(traj, model)
    rendered = tok.apply_chat_template(traj.messages, tokenize=False)
    assert tok.decode(traj.segments[0].token_ids) + "\n" == rendered
    if numbered:
        assert "<|im_start|>user 12\n" in rendered


@pytest.mark.slow
def test_smollm2_runs_a_few_turns_in_the_harness(sandbox):
    """The real embedded model (when pulled): turns run, calls are parsed or counted as broken."""
    models = pytest.importorskip("atelier.inference.models")
    try:
        path = models.resolve_model("smollm2-135m")
    except models.ModelNotFound:
        pytest.skip("smollm2-135m is not pulled (atelier models pull smollm2-135m)")
    from atelier.inference.engine import LocalEngine

    with LocalEngine(path) as engine:
        config = AgentConfig(max_turns=3, sampling=SamplingConfig(max_tokens=96, temperature=0.7, seed=1))
        traj = run_episode(engine, sandbox, "add(2, 3) returns -1; fix pkg/calc.py", config=config)
    assert traj.exit_reason in ("max_turns", "submitted"), traj.error
    assert traj.num_tool_calls >= traj.turns >= 1
    (seg,) = traj.segments
    assert seg.sampled_tokens == traj.tokens["completion"]


def test_wall_time_and_context_limits_end_with_their_reasons(sandbox, tokenizer):
    script = [fc("list_dir", {})] * 3
    timed = run_episode(ScriptedModel(tokenizer, script), sandbox, "go", config=AgentConfig(wall_time_s=1e-9))
    assert timed.exit_reason == "wall_time" and timed.turns == 0 and timed.limits["wall_time_s"] == 1e-9
    small = run_episode(ScriptedModel(tokenizer, script), sandbox, "go", config=AgentConfig(max_context_tokens=500))
    assert small.exit_reason == "max_context" and small.turns == 0 and small.error is None
    assert small.limits["max_context_tokens"] == 500
