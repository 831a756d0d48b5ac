"""The vLLM backend against real vLLM (its CPU build), one server for the whole module.

Oracles: the built-in engine and transformers for greedy tokens; the
trainer's own fp32 recompute (`atelier.train.head.token_logprobs`) for
logprobs, at the sampling temperature; a freshly started vLLM for weights
pushed into a running one (the restart after `kill -9` starts the server
from the pushed weights, so it is that fresh vLLM). The pure parts (fused
groups, the fence's ordering) are tested without a server.

The server is the session fixture `vllm_engine` (tests/conftest.py); it skips, saying
why, only when the vLLM environment is absent (`make vllm-env`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from atelier.inference.types import SamplingParams
from atelier.inference.vllm_engine import EngineUnavailable, VLLMEngineError, _Fence, fused_group, whole_groups
from tests.conftest import VLLM_TEST_CHUNK as CHUNK

# The first test to use the session's server waits for it to start: minutes on a loaded machine
# (14 minutes seen at load 16), so the limit is the server's own start-up limit, not less.
pytestmark = pytest.mark.timeout(1800)
NO_STOP = (0,)  # stop only on <|endoftext|>, which a random model rarely samples


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=NO_STOP)


# -- pure parts -----------------------------------------------------------------------
def test_fused_groups_are_whole():
    names = {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {
        "model.layers.0.self_attn.q_proj.bias", "model.embed_tokens.weight"}
    assert fused_group("model.layers.0.self_attn.k_proj.weight") == "model.layers.0.self_attn.qkv_proj"
    assert whole_groups({"model.layers.0.self_attn.k_proj.weight"}, names) == {
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.bias"}
    assert whole_groups({"model.layers.0.mlp.up_proj.weight"}, names) == {
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    assert whole_groups({"model.embed_tokens.weight"}, names) == {"model.embed_tokens.weight"}


def test_fence_update_waits_for_running_chunks_and_blocks_new_ones():
    fence, log = _Fence(0), []
    entered, release = threading.Event(), threading.Event()

    def chunk(tag):
        with fence.shared() as version:
            log.append((tag, "start", version))
            entered.set()
            release.wait(5) if tag == "a" else None
            log.append((tag, "end", version))

    def update():
        with fence.exclusive():
            log.append(("update", "start", fence.version))
            fence.version = 1
            log.append(("update", "end", 1))

    a = threading.Thread(target=chunk, args=("a",))
    a.start()
    entered.wait(5)
    u = threading.Thread(target=update)
    u.start()
    while fence._writers == 0:
        time.sleep(0.001)
    b = threading.Thread(target=chunk, args=("b",))  # arrives while the update waits
    b.start()
    time.sleep(0.05)
    assert [e[:2] for e in log] == [("a", "start")]  # neither the update nor b ran yet
    release.set()
    for t in (a, u, b):
        t.join(5)
    assert log == [("a", "start", 0), ("a", "end", 0), ("update", "start", 0), ("update", "end", 1),
                   ("b", "start", 1), ("b", "end", 1)]


# -- against a real vLLM server --------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model(vllm_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()


def recompute(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """The trainer's logprobs of `tokens` after `prompt` (fp32, at `temperature`)."""
    from atelier.train.head import token_logprobs

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)
    return logp[0, len(prompt):].tolist()


def perturbed(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """New weights for every parameter; a tied head keeps pointing at the new embedding."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings and "lm_head.weight" in new:
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
    return new


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in ("def parse(line):\n    ", "import json\n\nclass Decoder", "x = [")]


def test_greedy_tokens_equal_builtin_engine_and_transformers(vllm_engine, vllm_model_dir, hf_model):
    from atelier.inference.engine import LocalEngine

    with LocalEngine(vllm_model_dir, dtype="float32") as builtin:
        for prompt in prompts(vllm_engine.tokenizer):
            got = vllm_engine.generate(prompt, greedy(3 * CHUNK + 3))  # crosses chunk boundaries
            want = builtin.generate(prompt, greedy(3 * CHUNK + 3)).token_ids
            ids = torch.tensor([prompt])
            hf = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3 * CHUNK + 3,
                                   do_sample=False, eos_token_id=0, pad_token_id=0)[0, len(prompt):].tolist()
            assert got.token_ids == want == hf
            assert got.versions == [0] * len(got.token_ids)
            assert len(set(got.token_ids)) > 3  # a real check, not one repeated token


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_the_trainer_at_the_temperature(vllm_engine, hf_model, temperature):
    prompt = prompts(vllm_engine.tokenizer)[0]
    got = vllm_engine.generate(prompt, SamplingParams(max_tokens=40, temperature=temperature, seed=3,
                                                      stop_token_ids=NO_STOP))
    assert len(got.token_ids) == 40
    want = recompute(hf_model, prompt, got.token_ids, temperature)
    assert max(abs(a - b) for a, b in zip(got.logprobs, want)) < 1e-4
    if temperature != 1.0:  # the untempered logprobs differ: the check above can tell them apart
        untempered = recompute(hf_model, prompt, got.token_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(got.logprobs, untempered)) > 1e-2


def test_seeded_sampling_reproduces_across_chunks(vllm_engine):
    prompt = prompts(vllm_engine.tokenizer)[1]
    params = SamplingParams(max_tokens=3 * CHUNK, temperature=1.0, seed=11, stop_token_ids=NO_STOP)
    first, second = vllm_engine.generate(prompt, params), vllm_engine.generate(prompt, params)
    assert first.token_ids == second.token_ids
    other = vllm_engine.generate(prompt, SamplingParams(max_tokens=3 * CHUNK, seed=12, stop_token_ids=NO_STOP))
    assert other.token_ids != first.token_ids


def test_stop_strings_and_bad_input(vllm_engine):
    prompt = prompts(vllm_engine.tokenizer)[2]
    full = vllm_engine.generate(prompt, greedy(3 * CHUNK))
    text_at = vllm_engine.tokenizer.decode(full.token_ids[:CHUNK + 2], skip_special_tokens=False)
    stop = text_at[-3:]  # completes at or before token CHUNK+1: spans the first chunk boundary or not
    got = vllm_engine.generate(prompt, SamplingParams(max_tokens=3 * CHUNK, temperature=0.0, stop=(stop,),
                                                      stop_token_ids=NO_STOP))
    assert got.finish_reason == "stop"
    assert got.token_ids == full.token_ids[:len(got.token_ids)]
    assert stop in vllm_engine.tokenizer.decode(got.token_ids, skip_special_tokens=False)
    assert stop not in vllm_engine.tokenizer.decode(got.token_ids[:-1], skip_special_tokens=False)
    never = vllm_engine.generate(prompt, SamplingParams(max_tokens=CHUNK + 2, temperature=0.0, stop_token_ids=(-1,)))
    assert len(never.token_ids) == CHUNK + 2 and never.finish_reason == "length"  # -1: never stop, no eos
    with pytest.raises(VLLMEngineError):
        vllm_engine.generate([vllm_engine.vocab_size + 5], greedy(2))
    with pytest.raises(VLLMEngineError):
        vllm_engine.update_weights({"model.nope.weight": torch.zeros(2)}, 99)
    assert vllm_engine.version == 0


def test_in_flight_update_stamps_early_tokens_old_and_later_tokens_new(vllm_engine, hf_model):
    """The race: an update requested while a rollout streams lands between two chunks."""
    old = {k: v.clone() for k, v in hf_model.state_dict().items()}
    new = perturbed(hf_model, seed=1)
    prompt = prompts(vllm_engine.tokenizer)[0]
    version = vllm_engine.version + 1
    result = {}
    chunks_before = vllm_engine.stats["chunks"]
    # Long enough (40 chunks) that the update lands mid-rollout even when a loaded machine keeps
    # this thread from running for a while after the second chunk.
    rollout = threading.Thread(target=lambda: result.setdefault(
        "g", vllm_engine.generate(prompt, SamplingParams(max_tokens=40 * CHUNK, temperature=1.0, seed=5,
                                                         stop_token_ids=NO_STOP))))
    rollout.start()
    while vllm_engine.stats["chunks"] < chunks_before + 2:  # two chunks done, the third running
        assert rollout.is_alive(), "the rollout ended before its second chunk"
        time.sleep(0.001)
    vllm_engine.update_weights(new, version)
    rollout.join(120)
    g = result["g"]
    switch = g.versions.index(version)
    assert 2 * CHUNK <= switch < len(g.token_ids), g.versions
    assert switch % CHUNK == 0  # only at a chunk boundary
    assert g.versions == [version - 1] * switch + [version] * (len(g.token_ids) - switch)
    hf_model.load_state_dict(old)
    before = recompute(hf_model, prompt, g.token_ids, 1.0)[:switch]
    hf_model.load_state_dict(new)
    after = recompute(hf_model, prompt, g.token_ids, 1.0)[switch:]
    assert max(abs(a - b) for a, b in zip(g.logprobs, before + after)) < 1e-4
    # And after `update_weights` returned, everything is the new version.
    later = vllm_engine.generate(prompt, greedy(CHUNK))
    assert later.versions == [version] * CHUNK
    hf_model.load_state_dict(old)


def test_no_prefix_cache_hit_crosses_an_update(vllm_engine, hf_model):
    tok = vllm_engine.tokenizer
    long_prompt = tok.encode("def decode(self, s, _w=WHITESPACE.match):\n" * 12)[:160]
    vllm_engine.generate(long_prompt, greedy(1))
    cached = vllm_engine.stats["cached_prompt_tokens"]
    vllm_engine.generate(long_prompt, greedy(1))
    assert vllm_engine.stats["cached_prompt_tokens"] - cached >= 128  # the cache works...
    new = perturbed(hf_model, seed=2)
    vllm_engine.update_weights(new, vllm_engine.version + 1)
    cached = vllm_engine.stats["cached_prompt_tokens"]
    got = vllm_engine.generate(long_prompt, greedy(1))
    assert vllm_engine.stats["cached_prompt_tokens"] == cached  # ...and nothing survived the update
    hf_model.load_state_dict(new)
    assert abs(got.logprobs[0] - recompute(hf_model, long_prompt, got.token_ids, 1.0)[0]) < 1e-4


def _long_prompt(tok) -> list[int]:
    return tok.encode("def decode(self, s, _w=WHITESPACE.match):\n" * 12)[:160]


def _updated_like_a_fresh_model(engine, model, weights, check_prompt, *, temperature=0.7) -> None:
    """The server's logprobs equal the trainer's recompute at `weights`, and its prefix cache was
    dropped by the update that made them live (the long prompt was cached before it)."""
    cached = engine.stats["cached_prompt_tokens"]
    engine.generate(_long_prompt(engine.tokenizer), greedy(1))
    assert engine.stats["cached_prompt_tokens"] == cached, "a prefix-cache hit crossed an update"
    params = SamplingParams(max_tokens=2 * CHUNK, temperature=temperature, seed=21, stop_token_ids=NO_STOP)
    got = engine.generate(check_prompt, params)
    assert got.versions == [engine.version] * len(got.token_ids)
    model.load_state_dict(weights)
    want = recompute(model, check_prompt, got.token_ids, temperature)
    assert max(abs(a - b) for a, b in zip(got.logprobs, want)) < 1e-4


def test_a_partial_update_reaches_vllm_as_whole_fused_groups_with_the_tied_head(vllm_engine, hf_model):
    """An update of only k_proj, up_proj and the (tied) embedding: vLLM loads q/k/v and gate/up as
    one fused tensor each, so the engine must send q and v (gate) with the new k (up) from its copy
    of the current weights, and the worker must re-derive the tied head from the new embedding.
    A partial group, or a stale head, gives logprobs far from the recompute."""
    prompt = prompts(vllm_engine.tokenizer)[2]
    base = perturbed(hf_model, seed=6, scale=0.05)
    vllm_engine.update_weights(base, vllm_engine.version + 1)  # a known starting point
    vllm_engine.generate(_long_prompt(vllm_engine.tokenizer), greedy(1))  # cached under `base`
    moved = perturbed(hf_model, seed=7, scale=0.2)
    partial = {k: moved[k] for k in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                      "model.embed_tokens.weight")}
    vllm_engine.update_weights(partial, vllm_engine.version + 1)
    target = {**base, **partial, "lm_head.weight": partial["model.embed_tokens.weight"]}
    _updated_like_a_fresh_model(vllm_engine, hf_model, target, prompt)
    assert vllm_engine.stats["updates"][-1]["tensors"] == 6  # q, k, v + gate, up + embed


@pytest.mark.parametrize("kind", ["inprocess", "delta"])
def test_published_weights_reach_the_server_through_either_sync(vllm_engine, hf_model, tmp_path, kind):
    """The rollout backend's path: the trainer publishes (in-process tensors, or the delta chain
    on shared storage: a full snapshot, then a delta), the backend takes the reader's latest
    weights into the running server; every update drops the prefix cache."""
    from atelier.rl.backends import LocalBackend
    from atelier.rl.weight_sync import make_weight_sync

    sync = make_weight_sync(kind, tmp_path / "weights", full_every=1000)  # one full, then deltas
    backend = LocalBackend(env=None, engine=vllm_engine, reader=sync.reader(), workers=1)
    try:
        first, second = vllm_engine.version + 1, vllm_engine.version + 2
        for version, seed in ((first, 8), (second, 9)):
            weights = perturbed(hf_model, seed=seed, scale=0.1)
            stats = sync.publish(weights, version)
            assert stats.kind == {"inprocess": "inprocess", "delta": "full" if version == first else "delta"}[kind]
            vllm_engine.generate(_long_prompt(vllm_engine.tokenizer), greedy(1))  # cached before the update
            backend.update_weights(version)
            assert vllm_engine.version == version
            _updated_like_a_fresh_model(vllm_engine, hf_model, weights, prompts(vllm_engine.tokenizer)[1])
    finally:
        backend.pool.shutdown(wait=True)  # not backend.close(): the session's engine stays open


@pytest.mark.slow  # a second server start: minutes here; the default run checks updates against the trainer
def test_updated_server_equals_a_fresh_one_and_survives_kill_9(vllm_engine, hf_model):
    """Push weights (tied head), then kill -9 the server: the restarted server starts fresh from
    the pushed weights, and must give the same logprobs as the updated one did."""
    new = perturbed(hf_model, seed=3, scale=0.1)
    version = vllm_engine.version + 1
    vllm_engine.update_weights(new, version)
    prompt = prompts(vllm_engine.tokenizer)[1]
    params = SamplingParams(max_tokens=2 * CHUNK, temperature=0.7, seed=9, stop_token_ids=NO_STOP)
    updated = vllm_engine.generate(prompt, params)
    hf_model.load_state_dict(new)
    assert max(abs(a - b) for a, b in zip(updated.logprobs,
                                          recompute(hf_model, prompt, updated.token_ids, 0.7))) < 1e-4

    killed_sockets = vllm_engine.server.rpc_dir
    os.kill(vllm_engine.server.pid, signal.SIGKILL)
    restarts = vllm_engine.stats["restarts"]
    try:  # the request that meets the dead server is an infrastructure failure (retried)...
        fresh = vllm_engine.generate(prompt, params)
    except EngineUnavailable:
        fresh = vllm_engine.generate(prompt, params)  # ...and the next one runs on the restarted server
    assert vllm_engine.stats["restarts"] == restarts + 1
    assert not killed_sockets.exists() and vllm_engine.server.rpc_dir.is_dir()
    assert vllm_engine.version == version
    assert fresh.token_ids == updated.token_ids
    assert max(abs(a - b) for a, b in zip(fresh.logprobs, updated.logprobs)) < 1e-5


@pytest.mark.slow  # a server of its own (an untied model): minutes here
@pytest.mark.timeout(2400)
def test_untied_head_update_equals_a_fresh_server(tmp_path):
    """An untied `lm_head` is a weight of its own: an update must reach it, and re-tying must not
    touch it. Oracles: the server as started fresh from weights A, and the trainer's recompute.
    The same server updated to B must match the recompute at B (a head left at A would not, nor
    would a head re-derived from B's embedding); a head-only update must too; updated back to A it
    must equal the fresh server at A."""
    from transformers import AutoModelForCausalLM

    from atelier.inference.tiny import VLLM_SHAPE, build_tiny_model
    from atelier.inference.vllm_engine import VLLMEngine
    from atelier.inference.vllm_server import VLLMConfig, VLLMUnavailable, find_vllm_python

    try:
        find_vllm_python(VLLMConfig())
    except VLLMUnavailable as exc:
        pytest.skip(f"the vLLM environment is absent ({exc.message}); `make vllm-env` builds it")
    path = build_tiny_model(tmp_path / "untied", initializer_range=0.2, tie_word_embeddings=False, **VLLM_SHAPE)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    weights_a = {k: v.clone() for k, v in model.state_dict().items()}
    assert not model.config.tie_word_embeddings
    assert not torch.equal(weights_a["lm_head.weight"], weights_a["model.embed_tokens.weight"])
    weights_b = perturbed(model, seed=4, scale=0.1)  # untied: the head moves on its own
    config = VLLMConfig(dtype="float32", chunk_tokens=CHUNK, enforce_eager=True, kv_cache_gb=1, max_model_len=1024)
    params = SamplingParams(max_tokens=2 * CHUNK, temperature=0.7, seed=9, stop_token_ids=NO_STOP)

    def close_to_recompute(got, weights) -> bool:
        model.load_state_dict(weights)
        want = recompute(model, prompt, got.token_ids, 0.7)
        return max(abs(a - b) for a, b in zip(got.logprobs, want)) < 1e-4

    with VLLMEngine(path, config, work_dir=tmp_path / "work") as engine:
        assert not engine.tied
        prompt = prompts(engine.tokenizer)[1]
        fresh_a = engine.generate(prompt, params)
        assert close_to_recompute(fresh_a, weights_a)

        engine.update_weights(weights_b, 1)
        at_b = engine.generate(prompt, params)
        assert close_to_recompute(at_b, weights_b)

        head_only = {"lm_head.weight": weights_a["lm_head.weight"]}  # B's body with A's head
        engine.update_weights(head_only, 2)
        mixed = engine.generate(prompt, params)
        assert close_to_recompute(mixed, {**weights_b, **head_only})
        assert not close_to_recompute(mixed, weights_b)  # the head really changed the logprobs

        engine.update_weights(weights_a, 3)
        back = engine.generate(prompt, params)
        assert back.versions == [3] * len(back.token_ids)
        assert back.token_ids == fresh_a.token_ids
        assert max(abs(a - b) for a, b in zip(back.logprobs, fresh_a.logprobs)) < 1e-5


# -- selected by config ------------------------------------------------------------------
def test_engine_option_is_typed_and_reaches_open_model(vllm_engine, vllm_model_dir):
    """`--engine vllm --vllm KEY=VALUE` (eval, agent) and `[inference]` (train, run) build the same
    `InferenceConfig`; here it connects to the session's server by URL instead of starting one."""
    from atelier.config import ConfigError
    from atelier.eval.models import open_eval_model
    from atelier.harness.deploy import open_agent_model
    from atelier.inference.config import inference_config
    from atelier.inference.types import TokenModel, owning
    from atelier.inference.vllm_engine import VLLMEngine
    from atelier.rl.config import TrainConfig

    with pytest.raises(ConfigError, match="tensor_parallel"):
        inference_config("vllm", ["tensor_paralel_size=2"])
    assert TrainConfig.model_validate({"inference": {"engine": "vllm", "vllm": {"chunk_tokens": 4}}}
                                      ).inference.vllm.chunk_tokens == 4
    cfg = inference_config("vllm", [f"url={vllm_engine.base_url}"])
    prompt = prompts(vllm_engine.tokenizer)[0]
    want = vllm_engine.generate(prompt, greedy(CHUNK)).token_ids
    for model in (open_eval_model(str(vllm_model_dir), inference=cfg),
                  open_agent_model(str(vllm_model_dir), None, None, cfg)):
        with owning(model):
            assert isinstance(model, VLLMEngine) and isinstance(model, TokenModel)
            assert model.server is None  # connected, not started
            assert model.generate(prompt, greedy(CHUNK)).token_ids == want


@pytest.mark.timeout(2400)  # when it is the first to use the session's server, its start counts here
def test_a_run_reattaching_by_url_serves_its_own_weights(vllm_engine, vllm_model_dir, hf_model):
    """A run that connects to a server by URL (a resumed trainer re-attaching) finds it holding other
    weights, here ones the session's engine pushed; `open_rollout_engine` makes it serve the run's
    model as the run's version before any rollout."""
    from atelier.config import load_config
    from atelier.inference.engine import LocalEngine
    from atelier.rl.backends import open_rollout_engine
    from atelier.rl.config import TrainConfig

    prompt = prompts(vllm_engine.tokenizer)[0]
    other = perturbed(hf_model, seed=5, scale=0.1)
    vllm_engine.update_weights(other, vllm_engine.version + 1)
    stale = vllm_engine.generate(prompt, greedy(2 * CHUNK)).token_ids
    with LocalEngine(vllm_model_dir, dtype="float32") as builtin:
        want = builtin.generate(prompt, greedy(2 * CHUNK)).token_ids
    assert stale != want  # the server really holds other weights
    config = load_config(TrainConfig, None, [f"model={vllm_model_dir}", "inference.engine=vllm",
                                             f"inference.vllm.url={vllm_engine.base_url}",
                                             f"inference.vllm.chunk_tokens={CHUNK}"])
    engine = open_rollout_engine(config, vllm_model_dir, 7)
    try:
        assert engine.server is None  # attached, not started
        got = engine.generate(prompt, greedy(2 * CHUNK))
        assert got.token_ids == want and got.versions == [7] * len(want)
    finally:
        engine.close()
    vllm_engine.update_weights(other, vllm_engine.version + 1)  # the server again holds what its engine records


def test_vllm_sockets_live_in_the_servers_own_directory(vllm_engine):
    """vLLM names its processes' Unix sockets `<tmp>/<uuid>` and leaves them when its group is
    stopped (196 of them had piled up in /tmp here): a server's go to a directory of its own."""
    import stat
    import tempfile

    rpc_dir = vllm_engine.server.rpc_dir
    assert rpc_dir is not None and rpc_dir.parent == Path(tempfile.gettempdir())
    sockets = [p for p in rpc_dir.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
    assert sockets, sorted(rpc_dir.iterdir())   # vLLM put its sockets here, not in /tmp
    assert vllm_engine.server.pid_path.read_text().split()[1] == str(rpc_dir)


def test_stopping_a_server_or_reaping_a_killed_one_removes_its_socket_directory(tmp_path):
    """Stopped, a server's socket directory goes with its group; the group a killed atelier left
    (its id and directory kept beside the log) is reaped by the next start, directory included.
    `sleep` stands in for vLLM's processes (and this interpreter for the vLLM environment's, so the
    test needs none); only directories atelier made are removed."""
    import subprocess
    import sys
    import tempfile

    from atelier.inference.vllm_server import RPC_DIR_PREFIX, VLLMConfig, VLLMServer, in_group

    server = VLLMServer(VLLMConfig(python=sys.executable), tmp_path / "model", "m", 64, tmp_path / "vllm.log")
    server.proc = subprocess.Popen(["sleep", "600"], **in_group(0))
    server.rpc_dir = Path(tempfile.mkdtemp(prefix=RPC_DIR_PREFIX))
    (server.rpc_dir / "socket-stand-in").touch()
    stopped = server.rpc_dir
    server.stop()
    assert not stopped.exists() and server.rpc_dir is None

    left = Path(tempfile.mkdtemp(prefix=RPC_DIR_PREFIX))
    server.pid_path.write_text(f"{os.getpid()}\n{left}\n")   # our own group: nothing in it says vllm
    server._reap_orphans()
    assert not left.exists()
    theirs = tmp_path / "not-atelier"
    theirs.mkdir()
    server.pid_path.write_text(f"{os.getpid()}\n{theirs}\n")
    server._reap_orphans()
    assert theirs.exists()


@pytest.mark.parametrize("killer", ["kill -9 of atelier", "Ray's cleanup of a dead actor"])
def test_a_server_group_dies_with_atelier(killer):
    """`kill -9` of the process that started a server (the trainer, an inference actor) takes the
    server's whole group with it: the watchdog `VLLMServer` starts in it. Ray also SIGKILLs a dead
    actor's direct children (the server's leader): the leader's own child (vLLM's engine core and
    workers) must die too. Shell and `sleep` processes stand in for vLLM's."""
    import subprocess
    import sys

    script = (
        "import subprocess, sys\n"
        "from atelier.inference.vllm_server import in_group, start_watchdog\n"
        "leader = subprocess.Popen(['sh', '-c', 'sleep 600 & echo $!; wait'], stdout=subprocess.PIPE, text=True,\n"
        "                          **in_group(0))\n"
        "grandchild = int(leader.stdout.readline())\n"
        "child = subprocess.Popen(['sleep', '600'], **in_group(leader.pid))\n"
        "start_watchdog(leader.pid)\n"
        "print(leader.pid, child.pid, grandchild, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    victims = [parent.pid] + (_children(parent.pid) if killer.startswith("Ray") else [])
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie waits only for its reaper
    except OSError:
        return False


def test_vllm_ngram_speculation_needs_no_heads(vllm_model_dir):
    """`vllm.speculative_method = "ngram"` asks vLLM for drafts from the context, for any model (no
    config read, no MTP layers), matching the n-grams the built-in engine's lookup matches."""
    import json

    from atelier.inference.speculative import LOOKUP_MAX, LOOKUP_MIN
    from atelier.inference.vllm_server import VLLMConfig, speculative_args

    flag, spec = speculative_args(VLLMConfig(speculative_tokens=4, speculative_method="ngram"), vllm_model_dir)
    assert flag == "--speculative-config"
    assert json.loads(spec) == {"method": "ngram", "num_speculative_tokens": 4,
                                "prompt_lookup_min": LOOKUP_MIN, "prompt_lookup_max": LOOKUP_MAX}


@pytest.mark.slow  # a server of its own: minutes here
@pytest.mark.timeout(2400)
def test_a_vllm_server_speculating_by_ngram_decodes_as_one_that_does_not(vllm_engine, vllm_model_dir, tmp_path):
    """A real vLLM server started with n-gram speculation: its greedy tokens are the session
    server's (fp32), and its metrics count drafts made and kept."""
    import httpx
    from safetensors.torch import load_file

    from atelier.inference.vllm_engine import VLLMEngine
    from atelier.inference.vllm_server import VLLMConfig

    # the model directory's weights, which the new server loads: earlier tests leave the session
    # server (and the module's hf_model) with others
    vllm_engine.update_weights(load_file(str(vllm_model_dir / "model.safetensors")), vllm_engine.version + 1)
    prompt = vllm_engine.tokenizer.encode("a b c d a b c d a b c d a b")
    want = vllm_engine.generate(prompt, greedy(4 * CHUNK)).token_ids
    config = VLLMConfig(dtype="float32", chunk_tokens=CHUNK, enforce_eager=True, kv_cache_gb=1, max_model_len=1024,
                        speculative_tokens=4, speculative_method="ngram")
    with VLLMEngine(vllm_model_dir, config, work_dir=tmp_path) as engine:
        assert engine.generate(prompt, greedy(4 * CHUNK)).token_ids == want
        metrics = httpx.get(f"{engine.base_url}/metrics", timeout=30).text
    drafts = [float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
    assert drafts and drafts[0] > 0
