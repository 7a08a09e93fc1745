"""A restarted learner never writes a version number twice: before this, a learner SIGKILLed between
sealing a snapshot (the rename) and announcing it crashed on every restart with ``version_exists``,
because it chose its first version from the announcement alone."""

from broker.protocol import weightstore as ws
from learner.publish import first_version
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
