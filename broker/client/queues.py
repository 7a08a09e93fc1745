"""The streams of a run, behind a few functions: no service spells a Redis stream command itself.

    prompts       the broker feeds it; generators claim (consumer group ``generators``), release when
                  their group is safe in the replay queue; a dead generator's prompts are reclaimed
    trajectories  the replay queue: the broker appends (one script: bound, de-dup, append), the
                  learner reads (consumer group ``learner``), commits what it trained, drops the rest;
                  each entry's group message is the string ``payload:<entry id>`` beside it
    eval_prompts  held-out prompts of evaluation rounds, claimed like prompts
    eval_results  one entry per evaluated prompt
    admission     the staleness bound that meters prompts into the loop (docs/protocol.md 7.4)

Every Lua script is in broker/protocol/scripts.py; every key in broker/protocol/keys.py. ``pipe``
arguments take a Redis pipeline, so a caller can make a stream write part of a larger atomic step.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from dataclasses import dataclass

import redis

from broker.protocol import scripts
from broker.protocol.codec import ProtocolError
from broker.protocol.group import Group, GroupHead, decode_group
from broker.protocol.keys import PROMPTS_GROUP, RECORD_WINDOW, TRAJECTORIES_GROUP, Keys
from broker.protocol.messages import PromptEntry

log = logging.getLogger(__name__)


def ensure_groups(r: redis.Redis, keys: Keys) -> None:
    """Create the streams and their consumer groups (idempotent): prompts and eval prompts for the
    generators, trajectories for the learner."""
    for stream, group in (
        (keys.prompts, PROMPTS_GROUP),
        (keys.trajectories, TRAJECTORIES_GROUP),
        (keys.eval_prompts, PROMPTS_GROUP),
    ):
        try:
            r.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


def _prompts(entries) -> list[tuple[bytes, PromptEntry]]:
    """Stream entries as prompts (an entry deleted while pending has no fields: skipped)."""
    return [(eid, PromptEntry.from_fields({k.decode(): v.decode() for k, v in f.items()})) for eid, f in entries if f]


# ----------------------------------------------------------------------------------------------
# prompts and eval prompts: claimed by generators, released once their work is safe


def claim_abandoned(
    r: redis.Redis, stream: str, consumer: str, idle_s: float, count: int
) -> list[tuple[bytes, PromptEntry]]:
    """Up to ``count`` entries of ``stream`` that another consumer has held for ``idle_s`` (a dead
    generator's), now ``consumer``'s."""
    _, claimed, _ = r.xautoclaim(stream, PROMPTS_GROUP, consumer, int(idle_s * 1000), count=count)
    return _prompts(claimed)


def renew_claims(r: redis.Redis, stream: str, consumer: str, eids: list[bytes]) -> set[bytes]:
    """Reset the idle time of the entries of ``stream`` that ``consumer`` still holds, so that no other
    consumer takes them over while it works on them (scripts.RENEW_CLAIMS); the ids renewed."""
    if not eids:
        return set()
    return set(r.register_script(scripts.RENEW_CLAIMS)(keys=[stream], args=[PROMPTS_GROUP, consumer, *eids]))


def claim_new(
    r: redis.Redis, stream: str, consumer: str, count: int, block_ms: int | None = None
) -> list[tuple[bytes, PromptEntry]]:
    """Up to ``count`` entries of ``stream`` no generator has read yet, waiting up to ``block_ms``."""
    resp = r.xreadgroup(PROMPTS_GROUP, consumer, {stream: ">"}, count=count, block=block_ms)
    return [e for _, entries in resp or [] for e in _prompts(entries)]


def release(pipe, stream: str, *eids: bytes) -> None:
    """Acknowledge and delete claimed entries (queued on ``pipe``, a pipeline or a client)."""
    pipe.xack(stream, PROMPTS_GROUP, *eids)
    pipe.xdel(stream, *eids)


def delete_entries(pipe, stream: str, *eids: bytes) -> None:
    """Delete entries of a stream no consumer group reads (the evaluation results, once summarised), queued on
    ``pipe``."""
    pipe.xdel(stream, *eids)


def prompts_ready(r: redis.Redis, keys: Keys) -> int:
    """Prompts in the prompts stream (fed, not yet released)."""
    return int(r.xlen(keys.prompts))


def add_prompt(pipe, stream: str, prompt: PromptEntry) -> None:
    """Queue one prompt (or held-out prompt) on ``pipe``."""
    pipe.xadd(stream, prompt.fields())


def add_eval_result(pipe, keys: Keys, round_: int, idx: int, data: str) -> None:
    pipe.xadd(keys.eval_results, {"round": round_, "idx": idx, "data": data})


def read_eval_results(r: redis.Redis, keys: Keys, after: str = "-", count: int = 1000) -> list[tuple[bytes, dict]]:
    """Evaluation results after stream id ``after`` (exclusive; "-" from the start), raw fields."""
    return r.xrange(keys.eval_results, min=after if after == "-" else f"({after}", max="+", count=count)


# ----------------------------------------------------------------------------------------------
# admission control (AReaL's rule, with drops and rejections given back)


def admit_and_claim(
    r: redis.Redis, keys: Keys, consumer: str, want: int
) -> tuple[int, list[tuple[bytes, PromptEntry]]]:
    """Admission and the claim of up to ``want`` new prompts in one atomic step: (grant, prompts claimed),
    ``issued`` raised by exactly the prompts claimed. Grant 0: the producer is at the staleness bound."""
    grant, entries = r.eval(
        scripts.ADMIT_CLAIM,
        5,
        keys.admission,
        keys.stats("learner"),
        keys.stats("broker"),
        keys.issued,
        keys.prompts,
        want,
        PROMPTS_GROUP,
        consumer,
    )
    # a script's reply is raw: each entry [id, [field, value, ...]]
    return int(grant), _prompts((eid, dict(zip(f[::2], f[1::2]))) for eid, f in entries)


# ----------------------------------------------------------------------------------------------
# trajectories: the broker's side


# staged keys are unique per process: a random token, then a counter
_STAGE_TOKEN = secrets.token_hex(8)
_stage_count = itertools.count()
# a staged message outlives its MULTI only if the append script failed; it then expires
STAGED_TTL_MS = 60_000


def append_groups(
    pipe,
    keys: Keys,
    max_queue_groups: int,
    max_queue_bytes: int,
    groups: list[tuple[Group | GroupHead, bytes | memoryview]],
    window: int = RECORD_WINDOW,
) -> None:
    """Queue on ``pipe`` the atomic append of a batch of valid groups (the bounds in groups and in bytes,
    de-dup over the last ``window`` to 2 x ``window`` group ids, XADD, counters). ``pipe`` must be a
    transaction (``r.pipeline()``): each message is SET under a staged key that the script renames to
    ``keys.payload(<entry id>)`` or deletes. The script's reply (last), per group: ``b"B"`` busy,
    ``b"D"`` duplicate, else the new stream id."""
    if not pipe.transaction:
        raise ValueError("append_groups needs a transaction pipeline: the staged messages and the script go together")
    staged = [keys.staged(f"{_STAGE_TOKEN}.{next(_stage_count)}") for _ in groups]
    args: list = [max_queue_groups, max_queue_bytes, TRAJECTORIES_GROUP, window, keys.payload_prefix]
    for (g, payload), key in zip(groups, staged):
        pipe.execute_command("SET", key, payload, "PX", STAGED_TTL_MS)  # set()'s argument checks cost more
        args += [g.group_id, len(payload), g.min_version, g.generator_id]
    # EVAL, not EVALSHA: a pipeline's registered script costs a SCRIPT EXISTS round trip per
    # execute, and Redis caches the compiled body anyway
    pipe.eval(
        scripts.APPEND_BATCH,
        6 + len(staged),
        keys.seen,
        keys.trajectories,
        keys.stats("broker"),
        keys.queue_bytes,
        keys.queue_sizes,
        keys.seen_prev,
        *staged,
        *args,
    )


def dead_letter(pipe, keys: Keys, reason: str, detail: str, payload: bytes, keep: int) -> None:
    """Keep a rejected message (its first 64 KiB) for inspection, capped at about ``keep`` entries."""
    pipe.xadd(
        keys.dead_letter,
        {"reason": reason, "detail": detail[:500], "data": payload[:65536]},
        maxlen=keep,
        approximate=True,
    )


def queued_bytes(r: redis.Redis, keys: Keys) -> int:
    """Bytes of the group messages in the trajectories stream (the byte bound's measure)."""
    return int(r.get(keys.queue_bytes) or 0)


def pending_groups(r: redis.Redis, keys: Keys) -> int:
    """Groups the learner has read but not yet acknowledged (being trained on)."""
    try:
        return int(r.xpending(keys.trajectories, TRAJECTORIES_GROUP)["pending"])
    except redis.exceptions.NoPermissionError:
        raise  # a user without the right (docs/security.md, "Redis users"): never a silent 0
    except redis.ResponseError:  # no stream or no consumer group yet (before the broker started)
        return 0


def queued_groups(r: redis.Redis, keys: Keys) -> int:
    """Groups in the trajectories stream (waiting, and read but not yet acknowledged)."""
    return int(r.xlen(keys.trajectories))


def waiting_groups(r: redis.Redis, keys: Keys) -> int:
    """Groups in the replay queue not yet read by the learner: the stream's length minus the groups
    read but not yet acknowledged (those stay in the stream until a checkpoint holds them)."""
    return max(0, queued_groups(r, keys) - pending_groups(r, keys))


# ----------------------------------------------------------------------------------------------
# trajectories: the learner's side


@dataclass
class TrajectoryReader:
    """Reads groups through the ``learner`` consumer group. Nothing is acknowledged here: the learner
    commits a group only once a checkpoint holds its training, or drops it (both below)."""

    r: redis.Redis
    keys: Keys
    consumer: str = "learner-0"
    _pending_cursor: str | None = "0"  # walks this consumer's pending list once, then None: new entries

    def read(self, want: int, block_ms: int = 1000) -> list[tuple[bytes, Group | None]]:
        """Up to ``want`` entries: first this consumer's unacknowledged ones (a previous learner's,
        after a restart), each once, then new ones. Undecodable entries come back as (id, None) so
        they are dropped and counted."""
        start = self._pending_cursor or ">"
        resp = self.r.xreadgroup(
            TRAJECTORIES_GROUP,
            self.consumer,
            {self.keys.trajectories: start},
            count=want,
            block=None if start != ">" else block_ms,
        )
        entries = resp[0][1] if resp else []
        if start != ">":
            # the pending list keeps what we read until it is acknowledged: continue after the last id
            self._pending_cursor = entries[-1][0].decode() if entries else None
        return decode_entries(self.r, self.keys, entries)

    @property
    def past_pending(self) -> bool:
        """This consumer's pending list (a previous learner's unacknowledged groups) has been read."""
        return self._pending_cursor is None

    def wait_for(self, want: int, should_stop, timeout_s: float) -> list[tuple[bytes, Group | None]]:
        """Block until ``want`` entries are read (or stop / timeout)."""
        got: list = []
        deadline = time.monotonic() + timeout_s
        while len(got) < want and not should_stop():
            new = self.read(want - len(got))
            got.extend(new)
            if new:
                deadline = time.monotonic() + timeout_s
            elif time.monotonic() > deadline:
                raise TimeoutError(f"no data for {timeout_s}s: are the generators running?")
        return got


def decode_entries(r: redis.Redis, keys: Keys, entries: list) -> list[tuple[bytes, Group | None]]:
    """Trajectories entries (id, fields) as (id, group), their messages read in one MGET. An entry that
    cannot be trained on comes back as (id, None), logged: deleted while pending (no fields), its message
    missing, or a message that does not decode."""
    if not entries:
        return []
    payloads = r.mget([keys.payload(eid) for eid, _ in entries])
    out = []
    for (eid, fields), payload in zip(entries, payloads):
        g = None
        if fields and payload is None:  # an entry appended before the messages moved out of the stream
            payload = fields.get(b"data")
        if not fields:  # deleted entry left in the pending list
            pass
        elif payload is None:
            log.error("trajectories entry %s has no message (%s is missing)", eid, keys.payload(eid))
        else:
            try:
                g = decode_group(payload)
            except ProtocolError as e:
                log.error("undecodable stream entry %s: %s", eid, e)
        out.append((eid, g))
    return out


def read_groups(
    r: redis.Redis, keys: Keys, after: bytes | str = "-", count: int | None = None
) -> list[tuple[bytes, Group | None]]:
    """The trajectories entries after stream id ``after`` (exclusive; "-" from the start), decoded, without
    reading them for the learner (no consumer group): for tools, benchmarks and tests."""
    after = after.decode() if isinstance(after, bytes) else after
    entries = r.xrange(keys.trajectories, min=after if after == "-" else f"({after}", max="+", count=count)
    return decode_entries(r, keys, entries)


def count_trained(r: redis.Redis, keys: Keys, group_ids: list[str]) -> None:
    """Count trained groups once each in ``consumed`` (admission control), before their commit."""
    if group_ids:
        r.register_script(scripts.COUNT_TRAINED)(keys=[keys.counted, keys.stats("learner")], args=group_ids)


def commit(r: redis.Redis, keys: Keys, entries: list[tuple[str, str]], step: int, window: int = RECORD_WINDOW) -> int:
    """Acknowledge trained groups ``(stream id, group id)`` and record them once each (the ``trained`` set
    over the last ``window`` to 2 x ``window`` ids, the log, the ``committed`` counter); the number recorded."""
    if not entries:
        return 0
    return int(
        r.register_script(scripts.COMMIT)(
            keys=[
                keys.trained,
                keys.trained_log,
                keys.trajectories,
                keys.counted,
                keys.queue_bytes,
                keys.queue_sizes,
                keys.trained_prev,
                keys.stats("learner"),
                *[keys.payload(eid) for eid, _ in entries],
            ],
            args=[step, TRAJECTORIES_GROUP, window, *[x for e in entries for x in e]],
        )
    )


def drop(r: redis.Redis, keys: Keys, drops: list[tuple[bytes | str, str, str]], window: int = RECORD_WINDOW) -> None:
    """Record (the log keeps about ``window`` entries), acknowledge, delete and count dropped groups
    ``(stream id, group id, reason)`` in one step."""
    if drops:
        r.register_script(scripts.DROP)(
            keys=[
                keys.dropped_log,
                keys.trajectories,
                keys.counted,
                keys.stats("learner"),
                keys.queue_bytes,
                keys.queue_sizes,
                *[keys.payload(d[0]) for d in drops],
            ],
            args=[TRAJECTORIES_GROUP, window, *[x for d in drops for x in d]],
        )


def audit_counts(r: redis.Redis, keys: Keys) -> dict[str, int]:
    """Where every group went, by the counters the atomic scripts keep (exact for the whole run, whatever
    the record window trimmed): accepted by the broker, committed as trained, dropped by the learner,
    still in the stream; and, from the kept part of the commit log, commits of a group id already in it."""
    broker, learner = r.hgetall(keys.stats("broker")), r.hgetall(keys.stats("learner"))
    log = [f[b"gid"] for _, f in r.xrange(keys.trained_log)]
    committed = learner.get(b"committed")
    dropped = learner.get(b"dropped")
    return {
        "accepted": int(broker.get(b"accepted", 0)),
        # a run whose Redis predates the counters: its logs are whole (nothing was ever trimmed)
        "committed": int(committed) if committed is not None else len(set(log)),
        "dropped": int(dropped) if dropped is not None else len({f[b"gid"] for _, f in r.xrange(keys.dropped_log)}),
        "queued": int(r.xlen(keys.trajectories)),
        "committed_again": len(log) - len(set(log)),
    }
