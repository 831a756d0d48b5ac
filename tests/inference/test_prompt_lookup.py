"""Speculative decoding with drafts looked up in the request's own context: what a lookup proposes,
and that decoding with its drafts is exact (greedy and sampled), on a model with no heads at all."""

from __future__ import annotations

import random
import threading

import httpx
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from atelier.inference.engine import LocalEngine
from atelier.inference.sampling import make_generator, speculative_accept
from atelier.inference.speculative import LOOKUP_DRAFTS, PromptLookup
from atelier.inference.types import SamplingParams
from tests.inference.conftest import atelier_serve, serving

REPEATING = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]   # its suffix 5 6 7 occurred before: drafts from the start


@pytest.fixture(scope="module")
def cycling_dir(spiky_model_dir, tmp_path_factory):
    """A tiny model whose layers add nothing: its prediction after token t depends on t alone, so
    its greedy output soon runs in a cycle, the text a lookup drafts well (sampled, it strays)."""
    import shutil

    from transformers import AutoModelForCausalLM

    dst = tmp_path_factory.mktemp("lookup") / "cycling"
    shutil.copytree(spiky_model_dir, dst)
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.mul_(0.3)   # flatter distributions: samples that vary
    model.save_pretrained(dst)
    return dst


def test_lookup_proposes_what_followed_the_longest_latest_repeat():
    lookup = PromptLookup()
    assert lookup.propose([1, 2, 3, 4], 3) == []                       # nothing repeats
    assert lookup.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]           # 1 2 was followed by 3 4 1 ...
    assert PromptLookup().propose([1, 2, 9, 7, 1, 2, 8, 1, 2], 2) == [8, 1]   # ... its latest occurrence wins
    # the longest repeated suffix decides: 1 2 3 (then 7), not the later 2 3 (then 8)
    assert PromptLookup().propose([1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3], 2) == [7, 9]
    assert PromptLookup().propose([7, 7], 4) == []                      # the suffix never matches itself
    assert PromptLookup().propose([7, 7, 7], 4) == [7, 7, 7, 7]         # a repeat runs on past the end
    assert PromptLookup().propose([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]


def test_the_lookup_index_grows_with_the_context_as_if_built_at_once():
    rng = random.Random(0)
    context, grown = [], PromptLookup()
    for _ in range(300):
        context += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        assert grown.propose(context, LOOKUP_DRAFTS) == PromptLookup().propose(context, LOOKUP_DRAFTS)


def test_rejecting_a_chosen_draft_is_exact():
    """A looked-up draft is chosen, not drawn (its distribution is all on it): the tokens emitted
    are distributed as the target whether the draft is likely or not (chi-square, fixed seeds)."""
    torch.manual_seed(2)
    V, draws = 6, 6000
    logits = torch.randn(3, V) * 1.5
    target = torch.softmax(logits[0] / 0.7, dim=-1)
    g = make_generator(4)
    for draft in (int(target.argmax()), int(target.argmin())):
        counts = torch.zeros(V)
        for _ in range(draws):
            counts[speculative_accept(logits, [draft, 1], [None, None], 0.7, 1.0, g)[0][0]] += 1
        assert chisquare(counts.numpy(), (target * draws).numpy()).pvalue > 1e-3


def run(path, params, prompts, **engine):
    with LocalEngine(path, dtype="float32", compile=False, **engine) as e:
        if engine.get("speculate"):
            e.speculation.mode = "always"
        out = [e.generate(p, params) for p in prompts]
        return out, dict(e.stats)


@pytest.mark.parametrize("which", ["spiky_model_dir", "cycling_dir"])
def test_greedy_output_with_lookup_drafts_is_the_models(which, request):
    """A model without heads, speculating by lookup alone: the same greedy tokens and logprobs
    (fp32) as plain decoding, whether its drafts are kept (a model that cycles) or not."""
    params = SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=(-1,))
    prompts = [REPEATING, [3, 1, 4, 1, 5, 9, 2, 6], list(range(20, 40))]
    path = request.getfixturevalue(which)
    want, _ = run(path, params, prompts, speculate=False)
    got, stats = run(path, params, prompts, speculate=True)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4
    assert stats["lookup_drafted"] == stats["drafted"] > 0
    if which == "cycling_dir":   # a cycle's drafts are kept: a step emits several tokens
        assert stats["lookup_accepted"] > stats["lookup_drafted"] / 2
        assert stats["speculative_steps"] < sum(len(g.token_ids) for g in got) / 2


def test_sampled_tokens_with_lookup_drafts_follow_the_models_distribution(cycling_dir):
    """At T = 0.7 the first tokens after a prompt that ends in the model's own greedy cycle (drafted
    from the first step on, the drafts likely) follow the same distribution with and without
    lookup drafts: a chi-square test of the two samples."""
    n, counts = 400, {}
    (cycle,), _ = run(cycling_dir, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(-1,)),
                      [REPEATING], speculate=False)
    prompt = REPEATING + cycle.token_ids
    for spec in (False, True):
        with LocalEngine(cycling_dir, dtype="float32", compile=False, speculate=spec,
                         prefix_cache_tokens=0) as engine:
            if spec:
                engine.speculation.mode = "always"
            seen: dict[tuple[int, ...], int] = {}
            for seed in range(n):
                ids = engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0.7, seed=seed,
                                                                stop_token_ids=(-1,))).token_ids
                seen[tuple(ids[:2])] = seen.get(tuple(ids[:2]), 0) + 1
            counts[spec] = seen
            if spec:   # drafts were both kept and rejected: both ways of ending a step ran
                assert 0 < engine.stats["lookup_accepted"] < engine.stats["lookup_drafted"]
    keys = sorted(set(counts[False]) | set(counts[True]), key=lambda k: -counts[False].get(k, 0))
    common = [k for k in keys if counts[False].get(k, 0) + counts[True].get(k, 0) >= 10]
    table = [[counts[s].get(k, 0) for k in common] + [n - sum(counts[s].get(k, 0) for k in common)]
             for s in (False, True)]
    assert chi2_contingency(table).pvalue > 1e-3


def test_versions_and_logprobs_across_a_weight_update_with_lookup_drafts(cycling_dir):
    """An update mid-generation: every token after it carries the new version and the new weights'
    logprob (a looked-up draft is verified like any other), the ones before it the old."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    weights = load_file(str(cycling_dir / "model.safetensors"))
    changed = {k: v * 1.05 for k, v in weights.items() if "embed" in k}
    with LocalEngine(cycling_dir, dtype="float32", compile=False, speculate=True) as engine:
        engine.speculation.mode = "always"
        seen = threading.Event()
        handle = engine.submit(REPEATING, SamplingParams(max_tokens=80, temperature=0.0, stop_token_ids=(-1,)),
                               on_token=lambda *_: seen.set())
        seen.wait(30)
        engine.update_weights(changed, version=1)
        out = handle.result(60)
        assert engine.stats["lookup_accepted"] > 0
    switch = out.versions.index(1)
    assert out.versions == [0] * switch + [1] * (len(out.versions) - switch)
    model = AutoModelForCausalLM.from_pretrained(cycling_dir, dtype=torch.float32).eval()
    model.load_state_dict(changed, strict=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([REPEATING + out.token_ids])).logits[0], dim=-1)
    start = len(REPEATING) - 1
    after = [float(logp[start + i, t]) for i, t in enumerate(out.token_ids)][switch:]
    assert max(abs(a - b) for a, b in zip(out.logprobs[switch:], after)) < 1e-4


def test_serve_speculates_by_lookup_on_a_model_without_heads(cycling_dir):
    """`atelier serve --speculate` on a model with no heads: completions as without speculation."""
    body = {"model": "m", "prompt": [REPEATING], "max_tokens": 24, "temperature": 0, "logprobs": 1}
    answers = []
    for spec in (False, True):
        with LocalEngine(cycling_dir, dtype="float32", compile=False, speculate=spec, name="m") as engine, \
                serving(engine) as url:
            engine.speculation.mode = "always" if spec else "auto"
            answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0])
            assert (engine.stats["lookup_drafted"] > 0) == spec
    assert answers[0]["text"] == answers[1]["text"]
    assert answers[0]["logprobs"]["tokens"] == answers[1]["logprobs"]["tokens"]


@pytest.mark.parametrize("flags,says", [(["--speculate"], "speculating with lookup drafts"),
                                         (["--speculate", "--no-lookup"], "no MTP heads")])
def test_the_serve_command_speculates_by_lookup_or_says_why_not(flags, says, spiky_model_dir):
    """`atelier serve --speculate` on a model without heads serves, speculating by lookup; with
    `--no-lookup` too it has nothing to draft with and says so, without a traceback."""
    import subprocess
    import sys

    args = ["--model", str(spiky_model_dir), "--dtype", "float32", "--no-compile", *flags]
    if "--no-lookup" not in flags:
        with atelier_serve(args) as (url, stderr):
            assert says in stderr
            body = {"model": spiky_model_dir.name, "prompt": [REPEATING], "max_tokens": 8, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        return
    proc = subprocess.run([sys.executable, "-m", "atelier.cli.main", "serve", *args, "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and says in proc.stderr and "Traceback" not in proc.stderr


def test_atelier_eval_speculate_reaches_the_engine_it_opens(spiky_model_dir):
    """`atelier eval --speculate` (its inference config) opens a built-in engine that speculates by
    lookup on a model without heads; unset, the same model decodes plainly."""
    from atelier.eval.models import open_eval_model
    from atelier.inference.config import inference_config
    from atelier.inference.types import owning

    for speculate, drafters in ((True, ("lookup",)), (None, ())):
        with owning(open_eval_model(str(spiky_model_dir), inference=inference_config("builtin", (), speculate))) as m:
            assert m.drafters == drafters


def test_a_stop_inside_accepted_drafts_ends_the_request_whole(tmp_path):
    """A stop token among a step's kept drafts: the request ends there, the drafts after it are
    neither emitted nor counted as cached positions of its context, and an MoE model's routes
    (one row per context position) come back with it. The model's layers add nothing and its head
    maps 5 -> 6 -> 7 -> 5, so a prompt ending in that cycle gets its 4 drafts kept."""
    from transformers import AutoModelForCausalLM

    from atelier.inference.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "moe", moe=True, initializer_range=0.2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    nxt = torch.arange(model.config.vocab_size)
    nxt[[5, 6, 7]] = torch.tensor([6, 7, 5])
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("o_proj.weight", "experts.down_proj")):
                weight.zero_()
        model.lm_head.weight[nxt] = model.model.embed_tokens.weight   # after token t: nxt[t]
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(path)
    prompt = [9, 5, 6, 7, 5, 6, 7, 5, 6]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(5,))
    (want,), _ = run(path, params, [prompt], speculate=False)
    assert want.token_ids == [7, 5]
    (got,), stats = run(path, params, [prompt], speculate=True)
    assert got.finish_reason == "stop" and got.token_ids == [7, 5]
    assert stats["lookup_accepted"] >= 2   # the drafts after the stop token were kept too
    assert got.routes is not None


def test_every_step_of_lookup_alone_counts_as_speculation(spiky_model_dir, monkeypatch):
    """Without heads, a request that found no repeat has nothing else to draft with: its step is
    a speculative step all the same, and the policy records it (a new request's first step too)."""
    with LocalEngine(spiky_model_dir, dtype="float32", compile=False, speculate=True) as engine:
        engine.speculation.mode = "always"
        recorded = []
        record = engine.speculation.record
        monkeypatch.setattr(engine.speculation, "record", lambda *a: (recorded.append(a[0]), record(*a)))
        engine.generate(list(range(20, 40)), SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(-1,)))
    assert recorded == [1] * engine.stats["speculative_steps"]   # (closed: the last step's record is in)


def test_heads_run_over_a_prompt_that_lookup_drafts_for(cycling_dir, tmp_path, monkeypatch):
    """A prompt that ends in the model's own cycle is drafted for by lookup from its first step,
    yet its prefill still runs every head over it: no head is left without keys over the prompt
    (its kept rows would be cut back to the backlog, and the heads would attend from there on)."""
    from tests.inference.test_speculative import with_heads

    monkeypatch.setattr("atelier.inference.speculative.MAX_BACKLOG", 8)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(-1,))
    (cycle,), _ = run(cycling_dir, greedy, [REPEATING], speculate=False)
    path = with_heads(cycling_dir, tmp_path / "heads")
    with LocalEngine(path, dtype="float32", compile=False, speculate=True) as engine:
        engine.speculation.mode = "always"
        seen: list[tuple[int, bool]] = []
        speculate = engine._speculate
        monkeypatch.setattr(engine, "_speculate", lambda depth: (
            seen.extend((r.heads.unseen, r.looked_up) for r in engine._active), speculate(depth))[1])
        engine.generate(REPEATING + cycle.token_ids, SamplingParams(max_tokens=8, temperature=0.0,
                                                                    stop_token_ids=(-1,)))
    assert engine.stats["lookup_drafted"] > 0
    assert seen[1] == (0, True)   # a looked-up step after the first: every head attends from the start


def test_plain_steps_tell_the_policy_how_often_contexts_repeat(cycling_dir):
    """While the engine takes plain steps it still looks for repeats (a few dictionary reads a
    sequence), so its policy's share of repeats follows the text and a turn to text that repeats
    itself can bring speculation back: a model that cycles, on plain steps only, shows the share."""
    with LocalEngine(cycling_dir, dtype="float32", compile=False, speculate=True) as engine:
        policy = engine._speculation
        policy.choose = lambda batch: 0   # plain steps only: what the policy learns from them
        engine.generate(REPEATING, SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=(-1,)))
        assert engine.stats["speculative_steps"] == 0
        bucket = policy._state(1).lookups
        assert bucket.steps > 20 and bucket.share() > 0.8
