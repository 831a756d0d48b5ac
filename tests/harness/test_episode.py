"""`GradedEpisode`: which attempts say something about the policy (pure; the
episode-and-grade path itself runs in tests/eval and tests/rl)."""

from __future__ import annotations

from atelier.harness.episode import GradedEpisode, target_fractions
from atelier.harness.trajectory import Trajectory
from atelier.tasks.grade import Fraction, GradeResult


def _grade(reward: float, *, infra: bool = False, error: str | None = None) -> GradeResult:
    return GradeResult(reward, Fraction(1, 2), Fraction(0, 0), {}, error, infra)


def test_a_graded_episode_is_the_policys_even_when_it_scores_zero() -> None:
    episode = GradedEpisode(Trajectory(task_id="t", exit_reason="submitted"), _grade(0.0, error="patch does not apply"),
                            1.0)
    assert episode.infra_error is None and episode.error_type is None
    assert target_fractions(episode.grade) == {"fail_to_pass": 0.5, "pass_to_pass": 1.0}


def test_an_episode_that_raised_or_a_grade_that_timed_out_is_infrastructure() -> None:
    crashed = GradedEpisode(Trajectory(task_id="t", exit_reason="error", error="SandboxError: holder died"), None, 1.0)
    assert crashed.infra_error == "episode failed: SandboxError: holder died"
    assert crashed.error_type == "SandboxError"
    timed_out = GradedEpisode(Trajectory(task_id="t", exit_reason="submitted"),
                              _grade(0.0, infra=True, error="infrastructure: timed out"), 1.0)
    assert timed_out.infra_error == "grading: infrastructure: timed out"
    assert timed_out.error_type == "GradeTimeout"
