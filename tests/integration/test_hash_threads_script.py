"""benchmarks/hash_threads.py (docs/weights.md, "Shards side by side") runs its quick check: a version in
several shards written and verified with 1 and 3 threads, the same digest each way."""

import json

from benchmarks import hash_threads


def test_hash_threads_script_writes_and_verifies_a_sharded_version(tmp_path):
    out = tmp_path / "h.json"
    res = hash_threads.main(
        [
            "--sizes-mb",
            "8",
            "--threads",
            "1,3",
            "--shard-mb",
            "2",
            "--repeats",
            "1",
            "--dir",
            str(tmp_path),
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == res
    assert [r["threads"] for r in res["rows"]] == [1, 3]
    assert all(r["shards"] == 4 and r["write_s"] > 0 and r["verify_s"] > 0 for r in res["rows"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("relay-hash-")]  # its versions removed
