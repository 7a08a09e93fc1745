"""A version pruned between its announcement and the generator's read is not a bad snapshot: the
generator moves on to the newer version instead of refusing (real Redis, real weight store)."""

import shutil
from pathlib import Path

from broker.client.announcements import announce
from broker.client.connection import connect_redis
from broker.protocol import weightstore
from broker.protocol.keys import Keys
from broker.protocol.messages import Announcement
from generators.weights import WeightApplier


def _snapshot(root, version):
    d = weightstore.staging_dir(root, version)
    (d / "model.safetensors").write_bytes(bytes([version]) * 16)
    (d / "config.json").write_text("{}")
    return weightstore.seal(root, version, d)


class RacingBackend:
    """Loads nothing; on the first load, the learner publishes v2 and prunes v1 (the race)."""

    name = "stub"

    def __init__(self, on_first_load):
        self.loaded, self.on_first_load = [], on_first_load

    def load(self, path):
        if not self.loaded and self.on_first_load:
            self.on_first_load()
            self.on_first_load = None
        if not (Path(path) / "config.json").exists():
            raise OSError(f"{path} vanished")
        self.loaded.append(path)

    update_weights = load


def test_generator_skips_a_version_pruned_while_loading(redis_url, tmp_path):
    r, keys = connect_redis(redis_url), Keys("race")
    p1, h1 = _snapshot(tmp_path, 1)
    announce(connect_redis(redis_url), keys, Announcement(1, h1, str(p1)))

    def learner_moves_on():
        p2, h2 = _snapshot(tmp_path, 2)
        announce(r, keys, Announcement(2, h2, str(p2)))
        shutil.rmtree(p1)

    backend = RacingBackend(learner_moves_on)
    weights = WeightApplier(r, keys, backend, "g")
    weights.update(block=True)
    assert weights.version == 2 and weights.refused == {} and weights.refused_updates == 0
    assert backend.loaded == [str(tmp_path / "v000002")]
