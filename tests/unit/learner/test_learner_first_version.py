"""A restarted learner never writes a version number twice: before this, a learner SIGKILLed between
sealing a snapshot (the rename) and announcing it crashed on every restart with ``version_exists``,
because it chose its first version from the announcement alone."""

from broker.protocol import weightstore as ws
from learner.publish import first_version, resumed_versions
from tests.support.data import snapshot


def test_first_version_of_a_new_run_is_zero(tmp_path):
    assert first_version(None, tmp_path / "weights") == 0


def test_first_version_follows_the_latest_announcement(tmp_path):
    for v in (5, 6, 7):
        snapshot(tmp_path, v)
    assert first_version(7, tmp_path) == 8


def test_a_sealed_but_unannounced_version_is_skipped(tmp_path):
    for v in (6, 7, 8):  # 8 was sealed (renamed into place), then the learner died before announcing it
        snapshot(tmp_path, v)
    v = first_version(7, tmp_path)
    assert v == 9
    snapshot(tmp_path, v)  # publishing it works: no version_exists
    assert ws.list_versions(tmp_path)[-1] == 9


# A learner resumed from a checkpoint (learner/publish.py resumed_versions): (version, publish now, unpublished).
# Before, every resume published the checkpoint's weights again under a new number (a 400-step run resumed
# once ended at version 401).


def test_a_resume_where_the_checkpoint_left_the_versions_publishes_nothing(tmp_path):
    for v in (6, 7):
        snapshot(tmp_path, v)
    # stopped (Ctrl-C) right after version 7 was published from the checkpoint's weights
    assert resumed_versions({"version": 7, "pending": False, "unpublished": False}, 7, tmp_path) == (7, False, False)
    # stopped between two publications (learner.publish.every > 1): the next due one publishes
    assert resumed_versions({"version": 7, "pending": False, "unpublished": True}, 7, tmp_path) == (7, False, True)
    # a checkpoint written just before its step's publication, which was announced
    snapshot(tmp_path, 8)
    assert resumed_versions({"version": 7, "pending": True, "unpublished": True}, 8, tmp_path) == (8, False, False)


def test_a_resume_publishes_the_checkpoint_when_the_versions_went_past_it(tmp_path):
    for v in (6, 7):
        snapshot(tmp_path, v)
    # killed between a checkpoint and its step's publication: that publication is made now
    assert resumed_versions({"version": 7, "pending": True, "unpublished": True}, 7, tmp_path) == (8, True, False)
    # killed steps after the checkpoint: versions 8-9 hold steps it does not; its weights become version 10
    for v in (8, 9):
        snapshot(tmp_path, v)
    assert resumed_versions({"version": 7, "pending": False, "unpublished": False}, 9, tmp_path) == (10, True, False)
    # a version sealed but not announced after the checkpoint's (killed between the rename and the announcement)
    assert resumed_versions({"version": 8, "pending": False, "unpublished": False}, 8, tmp_path) == (10, True, False)
    # nothing announced at all (a Redis that lost its data): the checkpoint's weights are published
    assert resumed_versions({"version": 9, "pending": False, "unpublished": False}, None, tmp_path) == (10, True, False)
