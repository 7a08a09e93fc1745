"""A version pruned between its announcement and the generator's read is not a bad snapshot: the
generator moves on to the newer version instead of refusing (real Redis, real weight store)."""

import shutil
from pathlib import Path

from broker.client.announcements import announce
from broker.client.connection import connect_redis
from broker.protocol import weightstore
from broker.protocol.keys import Keys
from broker.protocol.messages import Announcement
from generators.config import GeneratorConfig
from generators.service import Generator


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

    gen = Generator(GeneratorConfig(id="g", run_id="race", redis_url=redis_url))
    try:
        gen.backend = RacingBackend(learner_moves_on)
        gen.maybe_update(block=True)
        assert gen.version == 2 and gen.refused == {} and gen.stats["refused_updates"] == 0
        assert gen.backend.loaded == [str(tmp_path / "v000002")]
    finally:
        gen.metrics.close()
