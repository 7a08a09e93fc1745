"""Relay's contracts, the library every service imports (no service internals, no torch except
``sampling``):

    codec.py       msgpack maps, raw little-endian arrays, ProtocolError and its reason codes
    group.py       the group message (generator -> broker -> learner); decode_group validates it
    messages.py    control messages: ack, weight announcement, generator heartbeat, reward items/results
    keys.py        the Redis layout of a run (every key, the consumer groups)
    scripts.py     every Lua script run against that layout (atomic steps of the replay queue)
    weightstore.py immutable, hashed weight snapshots (write, seal, verify, prune)
    weights_config.py  the [weights] section both ends read: each transport's config, naming its two ends
    sampling.py    the sampling transform whose log-probs generators record and the learner recomputes

docs/protocol.md is the byte-level specification.
"""
