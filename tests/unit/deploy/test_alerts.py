"""relay up's console warnings and the failures that stop a run (deploy/launcher/alerts.py), on states
and metric lines as the run's Redis gives them: a failing reward plugin is named with its reason at
once, a run whose rewards all fail for --fail-after stops, a collapsed or diverging policy is said."""

import pytest

from deploy.launcher.alerts import ConsoleAlerts, PolicyWatch, RewardWatch, RunFailure, describe_failures


def _state(ok=0, failed=0, by_plugin=None, reasons=None, gid="gen-0") -> dict:
    return {
        "generators": [{"id": gid, "reward_ok": ok, "reward_failures": failed}],
        "failures": {"reward_failures_by_plugin": by_plugin or {}, "reward_last_failure": reasons or {}},
    }


BUG = "plugin_error: ValueError: the plugin's own bug"


def test_a_failing_plugin_is_named_with_its_reason_once_and_again_for_a_new_reason():
    w = RewardWatch(fail_after_s=120)
    assert w.update(_state(ok=64), 0.0) == []
    said = w.update(_state(ok=64, failed=64, by_plugin={"mine": 64}, reasons={"mine": BUG}), 1.0)
    assert said == [f"reward plugin 'mine' failed 64 samples: {BUG}"]
    assert w.update(_state(ok=64, failed=128, by_plugin={"mine": 128}, reasons={"mine": BUG}), 2.0) == []
    said = w.update(
        _state(ok=64, failed=192, by_plugin={"mine": 192}, reasons={"mine": "remote_http_401: bad token"}), 3.0
    )
    assert said == ["reward plugin 'mine' failed 192 samples: remote_http_401: bad token"]


def test_the_reward_service_itself_and_an_environment_are_named_as_such():
    assert (
        describe_failures("reward_service", 8, "reward_service: ConnectError")
        == "the generators got no reward from the reward service for 8 samples: reward_service: ConnectError"
    )
    assert (
        describe_failures("env:calc", 3, "env_error: exception_ValueError: boom")
        == "environment 'calc' failed 3 episodes: env_error: exception_ValueError: boom"
    )


def test_no_reward_scored_for_fail_after_s_while_failures_arrive_stops_the_run():
    w = RewardWatch(fail_after_s=60)
    w.update(_state(ok=32), 0.0)
    for t in range(2, 63, 2):  # a minute of failures only, counted from the first one (at 2 s)
        w.update(_state(ok=32, failed=32 * t, by_plugin={"mine": 32 * t}, reasons={"mine": BUG}), float(t))
        if t < 62:
            assert w.stop_reason(float(t)) is None, t
    why = w.stop_reason(62.0)
    assert why.startswith("no reward was scored for 60s while 1984 failed; reward plugin 'mine'") and BUG in why
    # a run whose model still loads scores nothing either: only failures start the count
    idle = RewardWatch(fail_after_s=60)
    for t in range(0, 100, 10):
        idle.update(_state(), float(t))
    idle.update(_state(failed=8, by_plugin={"mine": 8}), 100.0)
    assert idle.stop_reason(100.0) is None and idle.stop_reason(159.0) is None


def test_a_run_that_scores_some_rewards_or_pauses_for_an_outage_is_not_stopped():
    mixed, paused = RewardWatch(fail_after_s=60), RewardWatch(fail_after_s=60)
    for t in range(0, 181, 5):
        mixed.update(_state(ok=t, failed=10 * t, by_plugin={"mine": 10 * t}), float(t))  # some scored: a poor plugin
        paused.update(_state(ok=0, failed=min(t, 20), by_plugin={"mine": min(t, 20)}), float(t))  # then held
        assert mixed.stop_reason(float(t)) is None and paused.stop_reason(float(t)) is None, t
    never = RewardWatch(fail_after_s=0)  # --fail-after 0
    for t in range(0, 300, 10):
        never.update(_state(failed=t + 1, by_plugin={"mine": t + 1}), float(t))
    assert never.stop_reason(290.0) is None


def test_a_restarted_generator_counting_from_zero_is_not_taken_for_a_drop():
    w = RewardWatch(fail_after_s=60)
    w.update(_state(ok=500, failed=10), 0.0)
    w.update(_state(ok=20, failed=0), 1.0)  # restarted: its counters start over
    assert (w.ok, w.failed) == (520, 10)


def _step(step, entropy=1.0, loss=0.01, grad_norm=0.5, reward=0.3, skipped=0, lr=2e-3) -> dict:
    return {
        "step": step,
        "entropy": entropy,
        "loss": loss,
        "grad_norm": grad_norm,
        "reward_mean": reward,
        "skipped_steps": skipped,
        "lr": lr,
    }


def test_a_collapsed_policy_is_said_after_50_steps_without_a_gradient():
    """The issue's case: entropy 0.006 and loss 0 for the last 100 steps looked like a normal run."""
    w = PolicyWatch()
    assert w.update([_step(s) for s in range(1, 101)]) == []
    # one answer per prompt: each group's samples score the same, the prompts differ (the mean moves)
    said = w.update(
        [_step(s, entropy=0.006, loss=0.0, grad_norm=0.0, reward=0.3 + s % 3 / 100) for s in range(101, 126)]
    )
    assert said == []  # 25 of the last 50 steps: the window's typical step still learns
    said = w.update([_step(126, entropy=0.006, loss=0.0, grad_norm=0.0, reward=0.31)])
    assert len(said) == 1 and said[0].startswith(
        "the policy has collapsed: over the last 50 steps (to step 126) its "
        "entropy was 0.006 and 26 steps had no gradient at all"
    )
    assert "learner.regularization.entropy_coef" in said[0]
    assert w.update([_step(s, entropy=0.006, loss=0.0, grad_norm=0.0) for s in range(126, 200)]) == []  # once
    assert w.stalled and w.collapsed
    w.update([_step(s) for s in range(200, 241)])  # learning again: said again if it happens again
    assert not w.stalled


def test_a_collapse_with_some_gradient_left_is_said_too():
    """A measured default run (busy machine, 4 December 2026): after step ~440 the entropy sat near 0.005, about
    half the steps had no gradient (never 50 in a row) and the reward stayed at 0.88 while single steps had
    reached 0.97; the progress line showed loss 0 and nothing more."""
    w = PolicyWatch()
    w.update([_step(s, entropy=1.0 - s / 250, reward=0.2 + s * 0.0077) for s in range(1, 101)])  # up to 0.97
    said = []
    for s in range(101, 200):
        flat = s % 2 == 0
        said += w.update(
            [
                _step(
                    s,
                    entropy=0.005,
                    loss=0.0 if flat else -5e-5,
                    grad_norm=0.0 if flat else 0.05,
                    reward=0.88 + (s % 5 - 2) / 100,
                )
            ]
        )
    assert len(said) == 1 and said[0].startswith("the policy has collapsed: over the last 50 steps")
    assert "the mean reward stays at 0.88" in said[0] and not w.converged


def test_a_flat_reward_is_no_learning_signal_not_a_collapse():
    w = PolicyWatch()
    said = w.update([_step(s, entropy=2.6, loss=0.0, grad_norm=None, reward=0.0) for s in range(1, 51)])
    assert len(said) == 1 and said[0].startswith("no learning signal: over the last 50 steps") and not w.collapsed


def test_a_diverging_policy_is_said_by_its_gradient_norm_or_its_skipped_steps():
    w = PolicyWatch()
    assert w.update([_step(s, grad_norm=0.5) for s in range(1, 31)]) == []
    said = w.update([_step(s, grad_norm=80.0, entropy=0.01) for s in range(31, 41)])
    assert len(said) == 1 and "gradient norm is 80" in said[0] and "160x its 0.5 at the start" in said[0]
    assert "lower learner.optim.lr (0.002)" in said[0] and w.diverging
    said = PolicyWatch().update([_step(1), _step(2, skipped=1, lr=1000.0), _step(3, skipped=2, lr=1000.0)])
    assert len(said) == 1 and said[0].startswith("1 optimizer step(s) skipped by step 2 for a non-finite loss")
    assert "lower learner.optim.lr (1000)" in said[0]


def test_a_policy_a_far_too_high_learning_rate_killed_is_said_dead_after_5_steps():
    """What lr=1000 did to the tiny model (measured): from step 2 the gradient was exactly 0 while the loss was
    not, and the entropy sat at ln 15 = 2.708 (uniform): the policy answered noise, and the only warning was
    the truncation warning blaming max_tokens."""
    w = PolicyWatch()
    steps = [_step(1, entropy=2.652, grad_norm=0.277, lr=1000.0)]
    steps += [_step(s, entropy=2.708, loss=0.0179, grad_norm=0.0, lr=1000.0) for s in range(2, 6)]
    assert w.update(steps) == [] and w.suspect().startswith("its gradient has been 0 for the last 4 steps")
    said = w.update([_step(6, entropy=2.708, loss=0.0068, grad_norm=0.0, lr=1000.0)])
    assert len(said) == 1 and said[0].startswith(
        "the policy is dead: its gradient has been 0 for the last 5 steps "
        "(to step 6) while its loss is 0.0068 and its entropy 2.708"
    )
    assert "learner.optim.lr = 1000" in said[0] and w.killed and not w.stalled
    assert PolicyWatch().suspect() is None


def test_console_alerts_print_each_warning_once_and_stop_the_run(capsys):
    clock = [0.0]
    lines = []
    alerts = ConsoleAlerts(lambda: lines.append("done"), fail_after_s=30, entries=lambda: [], clock=lambda: clock[0])
    for t in range(0, 31, 3):
        clock[0] = float(t)
        try:
            alerts.check(_state(failed=t + 1, by_plugin={"mine": t + 1}, reasons={"mine": BUG}))
        except RunFailure as e:
            assert t >= 30 and "reward plugin 'mine'" in str(e)
            break
    else:
        pytest.fail("the run was not stopped")
    out = capsys.readouterr().out
    assert out.count("relay up: warning: reward plugin 'mine' failed 1 samples: " + BUG) == 1
    assert alerts.warnings == [f"reward plugin 'mine' failed 1 samples: {BUG}"] and lines == ["done"]


def test_a_policy_that_converged_at_its_best_is_a_note_not_a_collapse(capsys):
    """The copy task solved: every sample of every prompt scores 1.0, so the loss is 0 too; that is the end of
    learning, not a failure: a note on the console, no warning in the summary."""
    alerts = ConsoleAlerts(lambda: None, fail_after_s=0, entries=lambda: [])
    alerts.entries = lambda: (
        [_step(s, entropy=0.5, reward=0.6 + s / 1000) for s in range(1, 301)]
        + [_step(s, entropy=0.004, loss=0.0, grad_norm=0.0, reward=1.0) for s in range(301, 360)]
    )
    alerts.check({})
    out = capsys.readouterr().out
    assert "relay up: note: the policy converged: over the last 50 steps" in out and "the best of the run" in out
    assert alerts.warnings == [] and alerts.flags() == ["CONVERGED"]
