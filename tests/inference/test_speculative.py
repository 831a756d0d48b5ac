"""Speculative decoding with MTP heads: exact at every temperature, the same greedy output, the same
logprobs and versions as plain decoding, and off where it does not pay."""

from __future__ import annotations

import itertools
import random
import shutil
import threading

import httpx
import pytest
import torch
from scipy.stats import chisquare

from atelier.inference.engine import EngineError, LocalEngine
from atelier.inference.sampling import make_generator, speculative_accept
from atelier.inference.speculative import LOOKUP_DRAFTS, WARM_STEPS, HeadProgress, SpeculationPolicy
from atelier.inference.types import SamplingParams
from atelier.mtp.heads import MTPHeads
from atelier.mtp.store import save_mtp_heads
from tests.inference.conftest import serving

PROMPTS = [[1, 5, 9, 13, 2], [3, 3, 8], [7, 1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 33, 35]]


def with_heads(src, dst, heads: int = 2, agreeing: bool = False, noise: float = 0.0):
    """A copy of model directory `src` with `heads` MTP heads: random ones, or (`agreeing`) a model
    whose layers add nothing (its prediction after token t depends on t alone) with heads that
    make the same prediction from their input token, so their drafts are the model's own (`noise`:
    that much of a random matrix added to their projections, so that some drafts are rejected)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    torch.manual_seed(0)
    mtp = MTPHeads(model, heads)
    if agreeing:
        H = model.config.hidden_size
        with torch.no_grad():
            for layer in [*model.model.layers, *(head.block for head in mtp.heads)]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            for head in mtp.heads:   # keep the normed embedding of the head's input token
                head.proj.weight.zero_()
                head.proj.weight[:, H:] = torch.eye(H) + noise * torch.randn(H, H)
            model.model.norm.weight.mul_(0.3)   # flatter distributions: samples that vary
        model.save_pretrained(dst)
    save_mtp_heads(dst, mtp, num_hidden_layers=model.config.num_hidden_layers)
    return dst


@pytest.fixture(scope="module")
def heads_dir(spiky_model_dir, tmp_path_factory):
    return with_heads(spiky_model_dir, tmp_path_factory.mktemp("spec") / "random-heads")


@pytest.fixture(scope="module")
def agreeing_dir(spiky_model_dir, tmp_path_factory):
    return with_heads(spiky_model_dir, tmp_path_factory.mktemp("spec") / "agreeing-heads", heads=3, agreeing=True)


@pytest.fixture(scope="module")
def roughly_agreeing_dir(spiky_model_dir, tmp_path_factory):
    return with_heads(spiky_model_dir, tmp_path_factory.mktemp("spec") / "rough-heads", heads=2, agreeing=True,
                      noise=0.5)


def run_all(engine, params):
    return [engine.generate(p, params) for p in PROMPTS]


@pytest.mark.parametrize("which,compile", [("heads_dir", False), ("agreeing_dir", False), ("agreeing_dir", True)])
def test_greedy_output_is_the_models_with_and_without_speculation(which, compile, request):
    """Greedy tokens and their logprobs equal plain decoding's (fp32), whatever the heads guess,
    with the verification pass compiled or eager."""
    params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(-1,))
    path = request.getfixturevalue(which)
    with LocalEngine(path, dtype="float32", compile=False, speculate=False) as plain:
        want = run_all(plain, params)
    with LocalEngine(path, dtype="float32", compile=compile, speculate=True) as spec:
        got = run_all(spec, params)
        stats = dict(spec.stats)
    assert stats["speculative_steps"] > 0 and stats["drafted"] > 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4
    if which == "agreeing_dir":   # heads that agree are accepted: a step emits several tokens
        assert stats["accepted"] > stats["drafted"] / 2
        assert stats["speculative_steps"] < sum(len(g.token_ids) for g in got) / 2


def test_drafts_from_part_of_the_vocabulary_keep_the_output_exact(roughly_agreeing_dir, monkeypatch):
    """Heads that draft from the first 64 token ids only: greedy and sampled tokens as without
    speculation (a draft outside them is never made; every emitted token is the model's)."""
    monkeypatch.setattr("atelier.inference.speculative.DRAFT_VOCAB", 64)
    runs = {}
    for spec in (False, True):
        with LocalEngine(roughly_agreeing_dir, dtype="float32", compile=False, speculate=spec, lookup=False) as engine:
            if spec:
                assert engine._heads.vocab == 64
            runs[spec] = [engine.generate(p, SamplingParams(max_tokens=25, temperature=0.0, stop_token_ids=(-1,)))
                          .token_ids for p in PROMPTS]
    assert runs[True] == runs[False]


def test_rejection_sampling_is_exact():
    """Speculative samples of one position are distributed as the target, whatever the draft
    distribution (chi-square, fixed seeds): the drafted token's and the correction's share."""
    torch.manual_seed(1)
    V, draws = 6, 6000
    logits = torch.randn(2, V) * 1.5
    q = torch.softmax(torch.randn(V), dim=-1)
    target = torch.softmax(logits[0] / 0.7, dim=-1)
    g = make_generator(3)
    counts = torch.zeros(V)
    for _ in range(draws):
        d = int(torch.multinomial(q, 1, generator=g))
        first, _ = speculative_accept(logits, [d], [q], 0.7, 1.0, g)[0]
        counts[first] += 1
    assert chisquare(counts.numpy(), (target * draws).numpy()).pvalue > 1e-3


def test_speculative_samples_match_plain_samples(roughly_agreeing_dir):
    """At temperature 0.7 the first tokens after a prompt follow the same distribution with and
    without speculation: a chi-square test of the two samples' second-token counts."""
    prompt, n = PROMPTS[0], 500
    counts = {}
    for name, spec in (("plain", False), ("spec", True)):
        with LocalEngine(roughly_agreeing_dir, dtype="float32", compile=False, speculate=spec, lookup=False,
                         prefix_cache_tokens=0) as engine:
            seen = {}
            for seed in range(n):
                ids = engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0.7, seed=seed,
                                                             stop_token_ids=(-1,))).token_ids
                seen[tuple(ids[:2])] = seen.get(tuple(ids[:2]), 0) + 1
            counts[name] = seen
            if spec:   # drafts were both kept and rejected: the correction draws ran
                assert 0 < engine.stats["accepted"] < engine.stats["drafted"]
    keys = sorted(set(counts["plain"]) | set(counts["spec"]), key=lambda k: -counts["plain"].get(k, 0))
    common = [k for k in keys if counts["plain"].get(k, 0) + counts["spec"].get(k, 0) >= 10]
    table = [[counts[s].get(k, 0) for k in common] + [n - sum(counts[s].get(k, 0) for k in common)]
             for s in ("plain", "spec")]
    from scipy.stats import chi2_contingency

    assert chi2_contingency(table).pvalue > 1e-3


def test_logprobs_are_the_models_at_the_sampling_temperature(agreeing_dir):
    """Every emitted token's logprob is log_softmax(logits / T) of the model at its position, as
    the trainer recomputes it (fp32, within 1e-4)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(agreeing_dir, dtype=torch.float32).eval()
    with LocalEngine(agreeing_dir, dtype="float32", compile=False, speculate=True) as engine:
        out = engine.generate(PROMPTS[2], SamplingParams(max_tokens=30, temperature=1.0, seed=5,
                                                         stop_token_ids=(-1,)))
        assert engine.stats["accepted"] > 0
    ids = torch.tensor([PROMPTS[2] + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(PROMPTS[2]) - 1
    want = [float(logp[start + i, t]) for i, t in enumerate(out.token_ids)]
    assert max(abs(a - b) for a, b in zip(out.logprobs, want)) < 1e-4


def test_versions_and_logprobs_across_a_weight_update(agreeing_dir):
    """An update mid-generation: tokens before it carry the old version, after it the new one,
    and every token after it was verified by the new weights (its logprob is theirs)."""
    from safetensors.torch import load_file

    with LocalEngine(agreeing_dir, dtype="float32", compile=False, speculate=True) as engine:
        weights = {k: v.clone() for k, v in load_file(str(agreeing_dir / "model.safetensors")).items()}
        changed = {k: v * 1.05 for k, v in weights.items() if "mlp" in k}
        seen = threading.Event()
        first_update: list[int] = []

        def on_token(token, logprob, version):
            if not seen.is_set():
                seen.set()

        handle = engine.submit(PROMPTS[1], SamplingParams(max_tokens=120, temperature=0.0, stop_token_ids=(-1,)),
                               on_token=on_token)
        seen.wait(30)
        engine.update_weights(changed, version=1)
        out = handle.result(60)
        first_update = [i for i, v in enumerate(out.versions) if v == 1]
    assert first_update and out.versions[:first_update[0]] == [0] * first_update[0]
    assert all(v == 1 for v in out.versions[first_update[0]:])


def test_a_model_without_heads_decodes_plainly_unless_asked_and_then_looks_up(spiky_model_dir):
    """No heads: plain decoding by default; `speculate=True` speculates with lookup drafts alone,
    and refuses (naming the fix) with lookup off."""
    with LocalEngine(spiky_model_dir, dtype="float32", compile=False) as engine:
        engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0))
        assert engine.stats["speculative_steps"] == 0 and not engine.speculates
    with LocalEngine(spiky_model_dir, dtype="float32", compile=False, speculate=True) as engine:
        assert engine.speculates and engine._heads is None
    with pytest.raises(EngineError, match="no MTP heads") as error:
        LocalEngine(spiky_model_dir, dtype="float32", compile=False, speculate=True, lookup=False)
    assert "lookup" in error.value.hint


def test_stop_sequences_and_max_tokens_cut_accepted_drafts(agreeing_dir):
    """A stop token or max_tokens inside a step's accepted drafts ends the request right there."""
    base = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(-1,))
    with LocalEngine(agreeing_dir, dtype="float32", compile=False, speculate=False) as plain:
        ref = plain.generate(PROMPTS[2], base).token_ids
    stop = ref[7]
    with LocalEngine(agreeing_dir, dtype="float32", compile=False, speculate=True) as spec:
        cut = spec.generate(PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop,)))
        short = spec.generate(PROMPTS[2], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(-1,)))
    assert cut.token_ids == ref[:ref.index(stop) + 1] and cut.finish_reason == "stop"
    assert short.token_ids == ref[:5] and short.finish_reason == "length"


def _steps(policy: SpeculationPolicy, batch: int, costs: dict[int, float], acceptance: list[float], steps: int,
           seed: int = 0, lookup: tuple[float, float] | None = None) -> list[int]:
    """`steps` steps as the engine takes them: choose a depth, verify each of the `batch` sequences'
    drafts (head j kept with probability `acceptance[j]` once the drafts before it are; with
    `lookup` (share, rate), that share of sequences drafts `LOOKUP_DRAFTS` by lookup instead, each
    kept with that rate; on a plain step, that share of contexts holds a repeat), record the step's
    seconds (`costs[depth]`). Returns the depths chosen."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        depth = policy.choose(batch)
        if not depth and lookup is not None:
            policy.observe_repeats(batch, sum(rng.random() < lookup[0] for _ in range(batch)))
        for _ in range(batch if depth else 0):
            looked_up = lookup is not None and rng.random() < lookup[0]
            drafts, rates = (LOOKUP_DRAFTS, [lookup[1]] * LOOKUP_DRAFTS) if looked_up else \
                (min(depth, len(acceptance)), acceptance)
            kept = 0
            while kept < drafts and rng.random() < rates[kept]:
                kept += 1
            policy.observe(batch, drafts, kept, looked_up=looked_up)
        policy.record(depth, batch, costs[depth])
        chosen.append(depth)
    return chosen


# batch 4 on a CPU: each head's pass and each verified draft cost about a tenth of a plain step
SMALL_BATCH = {0: 0.012, 1: 0.0145, 2: 0.017, 3: 0.0195}


def test_policy_starts_plain_and_keeps_the_faster_kind_of_step():
    """Heads that guess one time in five: one short probe of every head, then plain steps, the
    next probe only after many more of them."""
    policy = SpeculationPolicy(3, max_batch=16)
    assert policy.choose(32) == 0                              # above max_batch: never
    chosen = _steps(policy, 4, SMALL_BATCH, [0.2, 0.2, 0.2], 60)
    assert chosen[:WARM_STEPS] == [0] * WARM_STEPS              # plain first: it cannot lose
    assert chosen[WARM_STEPS] == 3                              # the first probe runs every head
    assert sum(1 for d in chosen if d) == SpeculationPolicy.probe_steps(4)     # one probe
    assert policy.switches == 0 and policy.choose(4) == 0
    assert SpeculationPolicy(0, 16).choose(1) == 0
    policy.mode = "always"
    assert policy.choose(32) == 3


def test_policy_picks_the_depth_that_pays_best():
    """Where the first head guesses well and the later ones badly, one draft a step emits the most
    tokens per second: the policy finds it without measuring every depth for long, and stays there
    through its later probes."""
    policy = SpeculationPolicy(3, max_batch=16)
    chosen = _steps(policy, 4, SMALL_BATCH, [0.7, 0.1, 0.1], 200)
    assert policy.current(4) == 1 and chosen[-40:].count(1) >= 36
    later = _steps(policy, 4, SMALL_BATCH, [0.7, 0.1, 0.1], 2000, seed=1)
    assert policy.current(4) == 1 and later.count(1) > 0.95 * len(later)
    assert set(later) > {1}                                     # it kept probing the others


def test_policy_goes_deeper_when_every_head_guesses_well():
    policy = SpeculationPolicy(3, max_batch=16)
    _steps(policy, 1, {0: 0.010, 1: 0.0112, 2: 0.0124, 3: 0.0136}, [0.8, 0.8, 0.8], 100)
    assert policy.current(1) == 3 and policy.switches == 1


def test_a_probe_that_loses_is_one_probe():
    """Settled on two drafts, a periodic probe of another depth that loses ends there: depths no
    fresh cost says anything of are not probed one after another on its account."""
    policy = SpeculationPolicy(3, max_batch=16)
    costs = {0: 0.010, 1: 0.0112, 2: 0.0124, 3: 0.0150}
    _steps(policy, 1, costs, [0.8, 0.8, 0.05], 300)
    assert policy.current(1) == 2
    chosen = _steps(policy, 1, costs, [0.8, 0.8, 0.05], 3000, seed=1)
    runs = [(d, len(list(group))) for d, group in itertools.groupby(chosen)]
    for (_, _), (between, steps), (after, _) in zip(runs, runs[1:], runs[2:]):
        assert between != 2 or after == 2 or steps > SpeculationPolicy.probe_steps(1)
    assert policy.current(1) == 2 and chosen.count(2) > 0.95 * len(chosen)


def test_lookup_alone_speculates_where_contexts_repeat_and_not_where_they_do_not():
    """No heads: one kind of speculative step (lookup drafts where a context repeats, a plain row
    where not), judged by how often the contexts repeat: an agent's that quote their tools'
    outputs pay, chat replies that rarely repeat do not."""
    costs = {0: 0.012, 1: 0.0125}
    agent = SpeculationPolicy(0, max_batch=16, lookup=True)
    assert agent.depth == 1
    chosen = _steps(agent, 4, costs, [], 300, lookup=(0.6, 0.8))
    assert agent.current(4) == 1 and chosen[-100:].count(1) >= 90   # (a probe of plain steps now and then)
    chat = SpeculationPolicy(0, max_batch=16, lookup=True)
    chosen = _steps(chat, 4, costs, [], 2000, lookup=(0.03, 0.6))
    assert chat.current(4) == 0 and chosen.count(1) < 60
    assert 0.01 < chat.lookups.share() < 0.06


def test_two_workloads_at_one_batch_size_each_get_their_kind_of_step():
    """Lookup alone at batch 4: agent turns whose contexts repeat at 70% of steps, then chat replies
    that repeat at 5%, in turn. Each batch size's share of repeats follows its last few dozen
    sequence-steps, plain steps' included: chat turns go back to plain steps after a few dozen
    steps, agent turns speculate almost throughout."""
    policy = SpeculationPolicy(0, max_batch=16, lookup=True)
    chat, agent = [], []
    for turn in range(12):
        chat.append(_steps(policy, 4, {0: 0.012, 1: 0.0143}, [], 124, seed=turn, lookup=(0.05, 0.6)).count(1))
        agent.append(_steps(policy, 4, {0: 0.014, 1: 0.0166}, [], 47, seed=100 + turn, lookup=(0.7, 0.8)).count(1))
    assert sum(chat[2:]) / 10 < 0.7 * 124 and sum(agent[2:]) / 10 > 0.75 * 47, (chat, agent)


def test_a_kind_whose_steps_draft_now_and_then_costs_its_mean_step():
    """Lookups in a few contexts: most speculative steps draft nothing and cost a plain step, the
    others verify their drafts' rows and cost more. The kind costs its mean step (its median would
    make it look free), while a step that built a kernel still counts for nothing."""
    mixed = [0.012] * 10 + [0.018] * 6
    assert SpeculationPolicy.typical_cost(mixed) == pytest.approx(sum(mixed) / len(mixed))
    assert SpeculationPolicy.typical_cost([0.012] * 5 + [2.0]) == pytest.approx(0.012)
    assert SpeculationPolicy.typical_cost([]) == 0.0


def test_lookup_drafts_do_not_talk_the_policy_into_deep_heads():
    """Heads whose later drafts miss, beside lookups that guess well: the lookups' long drafts
    count as theirs, not as the heads', so the heads stay at the one draft that pays."""
    policy = SpeculationPolicy(3, max_batch=16, lookup=True)
    _steps(policy, 4, SMALL_BATCH, [0.7, 0.1, 0.1], 400, lookup=(0.5, 0.9))
    assert policy.current(4) == 1
    assert policy.acceptance.rates()[1] < 0.3 and policy.lookups.acceptance.rates()[3] > 0.7


def test_policy_judges_speculation_by_its_acceptance_not_a_few_steps_tokens():
    """At batch 1 a speculative step emits one token most of the time and several now and then: a
    probe's own few steps may have only the ones. The acceptance over every verified draft says
    what the steps yield, and a later run of bad luck does not talk the policy out of it."""
    policy = SpeculationPolicy(1, max_batch=16)
    policy.acceptance.tried, policy.acceptance.kept = [200.0], [120.0]      # heads that were seen to guess
    _steps(policy, 1, {0: 0.010, 1: 0.012}, [0.0], WARM_STEPS + 1)            # a probe that drew only misses
    assert policy.choose(1) == 1
    _steps(policy, 1, {0: 0.010, 1: 0.012}, [0.6], 400)
    assert policy.current(1) == 1 and policy.switches == 1


def test_each_batch_size_judges_by_the_acceptance_of_its_own_text():
    """Chat replies at batch 1 that the heads guess well, agent turns at batch 4 they guess badly,
    in turn: batch 1 speculates, batch 4 does not, though most drafts the engine verifies are kept."""
    policy = SpeculationPolicy(1, max_batch=16)
    chosen = []
    for turn in range(20):
        _steps(policy, 1, {0: 0.010, 1: 0.0115}, [0.7], 100, seed=turn)
        chosen += _steps(policy, 4, {0: 0.012, 1: 0.0160}, [0.05], 100, seed=100 + turn)
    assert policy.current(1) == 1 and policy.current(4) == 0
    assert policy.acceptance.rates()[0] > 0.5 and chosen.count(1) < 60   # (one rate for both: 571 of 2000)


def test_policy_follows_the_heads_drift_back_to_plain_steps():
    """Heads that stop guessing (RL moved the policy away from them): the acceptance follows within
    a few hundred drafts and the policy returns to plain steps."""
    policy = SpeculationPolicy(2, max_batch=16)
    _steps(policy, 8, {0: 0.016, 1: 0.019, 2: 0.022}, [0.8, 0.8], 200)
    assert policy.current(8) == 2
    _steps(policy, 8, {0: 0.016, 1: 0.019, 2: 0.022}, [0.02, 0.02], 400)
    assert policy.current(8) == 0 and policy.acceptance.rates()[0] < 0.2


def test_speculation_that_loses_a_little_gives_way_to_plain_steps():
    """Speculation chosen while it paid, then heads that guess so much worse that it runs 5% slower
    than plain steps: less than speculation must win by to be chosen, and still the policy returns
    to plain steps (the kind that cannot lose), and stays there."""
    policy = SpeculationPolicy(1, max_batch=16)
    costs = {0: 0.012, 1: 0.0145}
    _steps(policy, 4, costs, [0.8], 200)
    assert policy.current(4) == 1
    chosen = _steps(policy, 4, costs, [0.15], 1000, seed=1)       # 0.0145 / 1.15 = 1.05 x 0.012 a token
    assert policy.current(4) == 0 and chosen[-500:].count(1) < 25


def test_costs_from_another_workload_do_not_decide_a_switch():
    """Long agent contexts, then short chat replies, in turn at the same batch size: every step
    costs more in the first. Speculation loses in both; a cheap cost measured in one must never be
    weighed against the current kind's dear one in the other."""
    policy = SpeculationPolicy(3, max_batch=16)
    long_context = {d: 2.5 * cost for d, cost in SMALL_BATCH.items()}
    chosen = []
    for turn in range(60):
        chosen += _steps(policy, 4, long_context if turn % 2 else SMALL_BATCH, [0.2, 0.2, 0.2], 50, seed=turn)
    assert policy.switches == 0 and sum(1 for d in chosen if d) / len(chosen) < 0.02


def test_one_step_that_built_a_kernel_does_not_decide_a_probe():
    """The first speculative steps at a batch size compile the verification graphs: one such
    step, seconds long, must not make plain decoding look faster than speculation that pays."""
    policy = SpeculationPolicy(1, max_batch=16)
    _steps(policy, 1, {0: 0.010, 1: 0.012}, [0.8], WARM_STEPS)
    assert policy.choose(1) == 1
    policy.observe(1, 1, 1)
    policy.record(1, 1, 3.0)                                    # the compile: the probe's first step
    _steps(policy, 1, {0: 0.010, 1: 0.012}, [0.8], 20)
    assert policy.current(1) == 1 and policy.switches == 1
    assert SpeculationPolicy.typical_cost([1.0]) == 1.0 and SpeculationPolicy.typical_cost([]) == 0.0


def test_speculation_that_loses_costs_a_few_steps_now_and_then():
    """At batch 16 a speculative step costs 2.5x a plain one for 1.25x the tokens: over the first
    500 steps the probes take under 3% of them, over 30,000 under 0.5%; other batch sizes' steps
    in between do not bring a probe sooner."""
    policy = SpeculationPolicy(3, max_batch=16)
    costs = {0: 0.020, 1: 0.030, 2: 0.040, 3: 0.050}
    chosen = _steps(policy, 16, costs, [0.2, 0.1, 0.1], 500)
    assert sum(1 for d in chosen if d) / len(chosen) < 0.03
    for _ in range(100):
        _steps(policy, 1, {0: 0.010, 1: 0.015, 2: 0.020, 3: 0.025}, [0.1, 0.1, 0.1], 50)
        assert policy.choose(16) == 0                          # batch 1 ran between them: no probe at 16
        policy.record(0, 16, 0.020)
    chosen += _steps(policy, 16, costs, [0.2, 0.1, 0.1], 30_000)
    assert policy.switches == 0 and sum(1 for d in chosen if d) / len(chosen) < 0.005


class ScriptedPolicy(SpeculationPolicy):
    """The depths of `script` step after step, then its last one for ever."""

    def __init__(self, depth: int, script: list[int]) -> None:
        super().__init__(depth, max_batch=16)
        self.script = list(script)

    def choose(self, batch: int) -> int:
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    def speculating(self, batch: int) -> bool:
        return self.script[0] > 0


def _head_keys(path, script: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """One greedy generation under `script`; its tokens, and each head's cached keys of its positions."""
    with LocalEngine(path, dtype="float32", compile=False, speculate=True, lookup=False) as engine:
        heads = len(engine._heads)
        engine._speculation = ScriptedPolicy(heads, script)
        kept = {}
        release = engine._release

        def keep(request):
            kept["rows"] = engine._forward.kv.rows(request.blocks, 0, request.length)
            release(request)

        engine._release = keep
        out = engine.generate(PROMPTS[2], SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=(-1,)))
        first = len(engine._forward.layers)
        rows = torch.tensor(kept["rows"])
        keys = [engine._forward.kv.k_LHRD[first + k][:, rows].clone() for k in range(heads)]
    return out.token_ids, keys


def test_heads_catch_up_on_positions_decoded_without_them(heads_dir):
    """Plain steps, then steps with fewer drafts than heads, then every head: in the end each head
    holds the keys it would have had with every head on every step (the skipped positions' hidden
    states waited for it), so stepping in and out of speculation costs no acceptance after."""
    script = [2] * 3 + [0] * 12 + [1] * 6 + [2]
    tokens, keys = _head_keys(heads_dir, script)
    want_tokens, want = _head_keys(heads_dir, [2])
    assert tokens == want_tokens
    done = min(k.shape[1] for k in keys + want) - 8      # the last steps' keys may still be provisional
    for got_k, want_k in zip(keys, want):
        torch.testing.assert_close(got_k[:, :done], want_k[:, :done], rtol=1e-4, atol=1e-4)


def test_a_finished_request_keeps_nothing_for_its_heads(heads_dir):
    """A caller may hold a finished request's handle for long (an RL batch holds hundreds): it
    keeps neither the heads' hidden states nor drafts."""
    with LocalEngine(heads_dir, dtype="float32", compile=False, speculate=True, lookup=False) as engine:
        handle = engine.submit(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(-1,)))
        handle.result()
        assert handle._request.heads is None and not handle._request.drafts


def test_head_progress_keeps_a_bounded_backlog(monkeypatch):
    monkeypatch.setattr("atelier.inference.speculative.MAX_BACKLOG", 8)
    progress = HeadProgress(3)
    progress.extend(5, torch.zeros(4, 2))                    # a prompt's positions 5..8
    progress.ran(3, 8)
    assert progress.redo == [9, 8, 7] and progress.first == 7
    for position in range(9, 20):                            # plain steps: no head runs
        progress.extend(position, torch.full((1, 2), float(position)))
    start, hidden = progress.pending(3)
    assert hidden.shape[0] == 8 and start == progress.first == 12    # the oldest rows dropped
    assert progress.unseen == 12          # no head ran over them: the heads attend from 12 on
    assert hidden[:, 0].tolist() == list(range(12, 20))
    progress.ran(1, 19)                                      # only the first head ran
    assert progress.redo == [20, 12, 12] and progress.pending(3)[0] == 12
    progress.extend(25, torch.zeros(1, 2))                   # positions 20..24 were never kept
    assert progress.first == 25 and progress.redo == [25, 25, 25] and progress.unseen == 25
    start, hidden = progress.pending(3)
    assert start == 25 and hidden.shape[0] == 1
    cached = HeadProgress(2)                                 # a prefix hit, the heads run over the rest
    cached.extend(32, torch.zeros(600, 2), seen_before=True, cap=False)
    start, hidden = cached.pending(2)
    assert cached.unseen == 0 and start == 32 and hidden.shape[0] == 600   # a pass over the whole prompt next


def test_heads_attend_to_no_position_they_never_ran_over(spiky_model_dir):
    """A prompt prefilled while the heads did not follow: their pass later masks what it never saw."""
    with LocalEngine(spiky_model_dir, dtype="float32", compile=False) as engine:
        batch = engine._forward.flat_batch([(list(range(10)), 6, [0])], unseen=[3])
    _, n, _, mask_11NT = batch.plans[0]
    seen = (mask_11NT[0, 0] == 0).int().tolist()
    assert n == 4 and seen == [[0, 0, 0, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1, 0, 0],
                               [0, 0, 0, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]]


def test_vllm_refuses_heads_it_cannot_load(heads_dir):
    """vLLM drafts only with MTP layers of the architectures it knows: atelier's heads on a Llama
    get a typed error naming the way out, and no flag reaches a server."""
    from atelier.inference.vllm_server import SpeculationUnsupported, VLLMConfig, speculative_args

    assert speculative_args(VLLMConfig(), heads_dir) == []
    with pytest.raises(SpeculationUnsupported, match="mtp.json") as caught:
        speculative_args(VLLMConfig(speculative_tokens=2), heads_dir)
    assert "built-in engine" in caught.value.hint and "ngram" in caught.value.hint


def test_serve_speculates_through_the_openai_api(agreeing_dir):
    """`atelier serve`'s engine with heads answers completions as the plain engine does (greedy)."""
    body = {"model": "m", "prompt": [PROMPTS[2]], "max_tokens": 20, "temperature": 0, "logprobs": 1}
    answers = []
    for spec in (False, True):
        with LocalEngine(agreeing_dir, dtype="float32", compile=False, speculate=spec, name="m") as engine, \
                serving(engine) as url:
            answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0])
            assert engine.stats["speculative_steps"] > 0 if spec else engine.stats["speculative_steps"] == 0
    assert answers[0]["text"] == answers[1]["text"]
    assert answers[0]["logprobs"]["tokens"] == answers[1]["logprobs"]["tokens"]
