"""relay up stops a run's services in dependency order, so that the audit written after them is exact."""

from deploy.launcher.start import stop_order


def test_producers_first_then_what_they_need_then_the_learner():
    names = ["redis", "broker", "reward", "learner", "gen-0", "gen-1"]
    assert stop_order(names) == [["gen-0", "gen-1"], ["broker", "reward"], ["learner"]]


def test_a_learners_nodes_stop_together_last():
    """``--learner-nodes 2``: the learner's checkpoint on stopping is a collective, so its nodes stop at once."""
    names = ["redis", "broker", "reward", "learner", "learner-1", "gen-0"]
    assert stop_order(names) == [["gen-0"], ["broker", "reward"], ["learner", "learner-1"]]
