"""relay up's progress line: what a user reads while a run goes (deploy/launcher/progress.py)."""

from deploy.launcher.progress import Rates, duration, latest_eval, progress_line

GENS = [{"id": "gen-0", "version": 12}, {"id": "gen-1", "version": None}]


def test_before_the_first_step_the_line_says_what_the_run_waits_for():
    line = progress_line({"learner": {}, "learner_version": None, "generators": GENS[1:]}, 16, 42.0, None, None)
    assert line.startswith("step 0/16  elapsed 42s  waiting for the learner's first version")
    assert "None" not in line and "nan" not in line and "gen-1:v-" in line
    line = progress_line({"learner": {}, "learner_version": 0, "generators": GENS}, 16, 95.0, None, None)
    assert "elapsed 1m35s  waiting for the first batch" in line and "reward 0" not in line


def test_a_running_step_shows_rates_eta_reward_loss_length_eval_and_versions():
    st = {
        "learner": {
            "step": 12.0,
            "reward_mean": 0.309,
            "loss": 0.01143,
            "completion_len_mean": 31.2,
            "completion_len_max": 50.0,
            "completion_truncated_frac": 0.02,
            "groups_dropped_stale": 8.0,
        },
        "learner_version": 12,
        "queue_depth": 8,
        "generators": GENS[:1],
    }
    ev = latest_eval([{"version": 4, "pass@1": 0.31}, {"version": 8, "pass@1": 0.41}, {"version": 12, "pass@1": None}])
    line = progress_line(st, 16, 782.0, 1 / 65, 212.4, ev, restarts=1, tty=True)
    for part in (
        "step 12/16  75% [###############-----]",
        "elapsed 13m02s",
        "eta 4m20s",
        "0.92 steps/min",
        "212 tok/s",
        "reward 0.309",
        "loss 0.01143",
        "len 31/50 cut 2%",
        "eval pass@1 0.41 (v8)",
        "queue 8",
        "stale-dropped 8",
        "gen-0:v12",
        "restarts 1",
    ):
        assert part in line, (part, line)
    assert "[" not in progress_line(st, 16, 782.0, None, None, tty=False)  # no bar in a log file


def test_rates_are_measured_from_the_first_step_seen():
    rates = Rates()
    assert rates.update(10.0, 0, 0) == (None, None)  # no step yet
    assert rates.update(20.0, 5, 1000) == (None, None)  # the first step seen (a resumed run starts at 5)
    steps_s, tokens_s = rates.update(40.0, 7, 1400)
    assert steps_s == 2 / 20 and tokens_s == 400 / 20
    assert duration(9) == "9s" and duration(3725) == "1h02m"


def test_a_fast_run_counts_steps_per_second():
    st = {"learner": {"step": 71.0}, "learner_version": 71, "generators": []}
    assert "4.5 steps/s" in progress_line(st, 200, 61.0, 4.517, None)


def test_failures_after_start_up_are_on_the_line():
    """A plugin that fails every reward once looked like "waiting for the first batch" for minutes."""
    st = {
        "learner": {"groups_dropped_reward_failed": 80.0},
        "learner_version": 0,
        "generators": [{"id": "gen-0", "version": 0, "reward_ok": 0}],
        "failures": {"reward_failures": 640, "reward_failures_by_plugin": {"mine": 640}},
    }
    line = progress_line(st, 16, 40.0, None, None)
    assert "waiting for the first batch: every reward so far failed" in line
    assert line.endswith("gen-0:v0  reward-failed mine 640  reward-dropped 80")
    st = {"learner": {"step": 9.0, "loss": 0.0}, "learner_version": 9, "generators": []}
    assert progress_line(st, 16, 40.0, None, None, flags=["POLICY COLLAPSED"]).endswith("POLICY COLLAPSED")
