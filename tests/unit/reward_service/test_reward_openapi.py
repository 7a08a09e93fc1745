"""The reward service's HTTP contract is pinned: any change to its OpenAPI spec fails this test.

To change the contract deliberately:
    RELAY_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest -q tests/unit/reward_service/test_reward_openapi.py
then review `git diff tests/snapshots/reward_openapi.json`, update docs/rewards.md to match, and
commit all of it together.
"""

import json
import os

from reward_service.app import RewardConfig, create_app
from tests.support.services import ROOT

SNAPSHOT = ROOT / "tests" / "snapshots" / "reward_openapi.json"


def current_spec() -> dict:
    return json.loads(json.dumps(create_app(RewardConfig()).openapi(), sort_keys=True))


def test_openapi_spec_matches_the_snapshot():
    spec = current_spec()
    if os.environ.get("RELAY_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(SNAPSHOT.read_text())
    assert spec == pinned, (
        "The reward service's HTTP contract (OpenAPI spec) changed. If that is deliberate, run\n"
        "  RELAY_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest -q tests/unit/reward_service/test_reward_openapi.py\n"
        "review `git diff tests/snapshots/reward_openapi.json`, update docs/rewards.md, and commit them together."
    )


def test_the_snapshot_pins_the_score_contract():
    """The snapshot is not empty or stale in what matters most: /score's request and result shapes."""
    pinned = json.loads(SNAPSHOT.read_text())
    schemas = pinned["components"]["schemas"]
    assert set(schemas["ItemIn"]["properties"]) == {
        "prompt",
        "completion",
        "reference",
        "finished",
        "task",
        "metadata",
        "num_tokens",
    }
    assert set(schemas["ResultOut"]["properties"]) == {"score", "status", "reason", "plugin", "details"}
    assert {"401", "413", "422"} <= set(pinned["paths"]["/score"]["post"]["responses"])
