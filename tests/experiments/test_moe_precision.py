"""experiments/moe_precision at smoke scale: every arm trains, and the batch-invariance finding holds."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import EXPERIMENTS, load_experiment

EXPERIMENT = EXPERIMENTS / "moe_precision"


@pytest.mark.slow
def test_smoke_run_writes_results_and_plot(tmp_path):
    run = load_experiment("moe_precision")
    results = run.main(["--out", str(tmp_path), "--smoke"])
    assert set(results["arms"]) == set(run.ARMS)
    for arm in results["arms"].values():
        assert len(arm["train_loss"]) == 3 and all(math.isfinite(x) for x in arm["train_loss"])
    inv = results["batch_invariance_max_abs_logit_diff"]
    assert inv["nvfp4_fwd_mxfp8_bwd"] == 0.0 and inv["mxfp8"] == 0.0
    assert inv["nvfp4_tensor_fwd_mxfp8_bwd"] > 1e-4
    assert results["division"]["bfloat16"]["codes_differ"] > 0
    assert json.loads((tmp_path / "results.json").read_text())["arms"]
    assert (tmp_path / "moe_precision.png").stat().st_size > 10_000


def test_committed_results_show_the_findings():
    results = json.loads((EXPERIMENT / "results.json").read_text())
    inv = results["batch_invariance_max_abs_logit_diff"]
    assert inv["nvfp4_fwd_mxfp8_bwd"] == 0.0 and inv["nvfp4_tensor_fwd_mxfp8_bwd"] > 0
    assert results["settings"]["steps"] == len(results["arms"]["bf16_operands"]["train_loss"])
