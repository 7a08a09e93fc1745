"""What each Relay service may do in the run's Redis: one ACL user per service, least privilege
(docs/security.md, "Redis users"). ``relay up`` writes these users into the embedded Redis's ACL file;
``relay secrets`` into the file Docker Compose and Kubernetes give their Redis (deploy/provision.py).

Redis 7 checks every command against a user's *root* permissions and its *selectors* (``(...)`` in the
ACL file): a command passes when one of them allows the command and every key it touches, with the access
the command needs (``%R~`` read, ``%RW~`` read and write). The commands a Lua script runs are checked the
same way, one by one, and ``EVAL``/``EVALSHA`` itself must be allowed on every key it names with write
access (Redis cannot know what the script will do). So each right below is a pair (commands, keys): a
command of the pair may write only the keys of that pair. Every key comes from broker/protocol/keys.py.

- **broker**: reads the whole run (its dashboard shows it); writes the prompts it feeds, the replay queue
  (the trajectories stream, its messages, the de-duplication sets, the byte counters: the append script),
  dead letters, its stats, the feeder's position, evaluation rounds and summaries, the run's advertisement,
  events. Only the broker writes the trajectories stream.
- **learner**: reads the whole run; alone writes the announcements (``latest``, ``versions``, the
  ``announce`` channel), the admission bound, ``done``, the collective/ipc rendezvous records; consumes
  the trajectories stream (reads, acknowledges, deletes what it trained or dropped, never adds) through
  its commit/drop scripts; writes its stats and metrics, events.
- **generator**: reads the announcements, the admission bound and counters, ``done``, the evaluation
  rounds, the rendezvous records; claims, acknowledges and deletes prompts (never adds one); raises
  ``issued`` (admission); writes its heartbeat, its metrics endpoint, events, evaluation results, and the
  run's reward URL and sampling if nobody wrote them first (HSETNX). It can neither read nor write the
  trajectories stream, nor write an announcement.
- **producer-<i>** (``relay up --producers N``: a producer of the user's own, docs/protocol.md section 12):
  exactly the generator's rights, under a user (and password) of its own.
- **launcher** (``relay up``'s progress and summary, health checks, ``relay status --redis-url``): reads
  the whole run, ``INFO``, and ``ACL LOG`` (so a run reports a command Redis refused); writes nothing.

Every user also has the connection commands (AUTH, HELLO, PING, CLIENT SETINFO, ...) and transactions
(MULTI/EXEC), and none of the ``@dangerous`` category (FLUSHALL, CONFIG, KEYS, DEBUG, SHUTDOWN, ACL but
the launcher's ACL LOG, MONITOR, CLIENT KILL, ...).
"""

from __future__ import annotations

from broker.protocol.keys import Keys

# a right: (commands, keys with read and write access)
Right = tuple[tuple[str, ...], tuple[str, ...]]

BASE = "+@connection +@transaction"  # every user: AUTH, HELLO, PING, CLIENT SETINFO, ...; MULTI/EXEC
GENERATOR_READS = ("+get", "+hget", "+hgetall", "+hmget", "+hexists", "+exists")


def _pattern(key: str) -> str:
    """``key`` as an ACL key pattern matching itself only (glob characters of a run id escaped)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in key)


def _prefix(prefix: str) -> str:
    return _pattern(prefix) + "*"


def rights(keys: Keys) -> dict[str, tuple[str, tuple[str, ...], list[Right]]]:
    """user -> (its root commands, the keys those may read, its write rights)."""
    everything = (_prefix(keys.prefix),)
    return {
        "broker": ("+@read", everything, _broker_writes(keys)),
        "learner": ("+@read +publish", everything, _learner_writes(keys)),
        "generator": _generator(keys),
        "launcher": ("+@read", everything, []),
    }


def _prompts(k: Keys) -> tuple[str, ...]:
    return (_pattern(k.prompts), _pattern(k.eval_prompts))


def _broker_writes(k: Keys) -> list[Right]:
    """The broker's: the replay queue (the append script), the prompts it feeds, its records."""
    p = _pattern
    payloads, staged = _prefix(k.payload_prefix), _prefix(k.staged(""))
    queue = tuple(
        p(x) for x in (k.seen, k.seen_prev, k.trajectories, k.queue_bytes, k.queue_sizes, k.stats("broker"))
    ) + (payloads, staged)
    return [
        # the append script (queues.append_groups): EVAL names these keys; SET stages each message
        (("+eval",), queue),
        (
            (
                "+set",
                "+get",
                "+del",
                "+rename",
                "+persist",
                "+sismember",
                "+sadd",
                "+scard",
                "+hset",
                "+hincrby",
                "+xadd",
                "+xlen",
                "+xpending",
                "+xgroup|create",
            ),
            queue,
        ),
        (
            ("+xadd", "+xtrim", "+xdel", "+xgroup|create"),
            _prompts(k) + (p(k.dead_letter), p(k.events), p(k.eval_results)),
        ),
        (
            ("+hset", "+hincrby"),
            tuple(p(x) for x in (k.stats("broker"), k.feeder, k.eval_rounds, k.eval_summaries, k.run, k.services)),
        ),
    ]


def _learner_writes(k: Keys) -> list[Right]:
    """The learner's: the announcements and its records; the trajectories stream consumed (its scripts)."""
    p = _pattern
    trained = tuple(
        p(x)
        for x in (
            k.trained,
            k.trained_prev,
            k.trained_log,
            k.counted,
            k.dropped_log,
            k.queue_bytes,
            k.queue_sizes,
            k.stats("learner"),
        )
    ) + (_prefix(k.payload_prefix),)
    return [
        (("+set", "+hset", "+hdel"), (p(k.latest), p(k.versions))),
        (
            ("+set", "+del", "+hset", "+hdel", "+hincrby"),
            tuple(p(x) for x in (k.stats("learner"), k.admission, k.done, k.collective, k.ipc, k.run, k.services)),
        ),
        (("+xadd",), (p(k.events), p(k.learner_metrics))),
        (("+xreadgroup", "+xack", "+xdel"), (p(k.trajectories),)),  # consumes: never adds a group
        # the commit, drop and count scripts (queues.commit, drop, count_trained)
        (("+evalsha", "+script|load"), trained + (p(k.trajectories),)),
        (
            (
                "+sismember",
                "+sadd",
                "+srem",
                "+scard",
                "+rename",
                "+xadd",
                "+hget",
                "+hdel",
                "+decrby",
                "+hincrby",
                "+del",
            ),
            trained,
        ),
    ]


def _generator(k: Keys) -> tuple[str, tuple[str, ...], list[Right]]:
    """The generator's: a few reads of its own keys (not the trajectories), the prompts claimed, admission."""
    p = _pattern
    prompts = _prompts(k)
    admission = tuple(p(x) for x in (k.admission, k.stats("learner"), k.stats("broker"), k.issued))
    return (
        " ".join(GENERATOR_READS),
        tuple(p(x) for x in (k.latest, k.versions, k.done, k.eval_rounds, k.ipc, k.collective, k.run, *admission)),
        [
            (("+xreadgroup", "+xautoclaim", "+xclaim", "+xpending", "+xack", "+xdel"), prompts),  # never XADD
            # the admission and claim renewal scripts (queues.admit_and_claim, renew_claims)
            (("+eval", "+evalsha", "+script|load"), admission + prompts),
            (("+incrby",), (p(k.issued),)),
            (("+hset",), (p(k.generators), p(k.services))),
            (("+hsetnx",), (p(k.run),)),  # the reward URL and sampling, when no generator wrote them first
            (("+xadd",), (p(k.events), p(k.eval_results))),
        ],
    )


# granted after -@dangerous: the launcher watches Redis's memory and clients (INFO) and reports what it refused
AFTER = {"launcher": "+info +acl|log"}


PRODUCER_PREFIX = "producer-"  # the Redis users (and generator ids) of ``relay up --producers N``


def role(user: str) -> str:
    """The service whose rights ``user`` has: a producer of the user's own has a generator's."""
    return "generator" if user.startswith(PRODUCER_PREFIX) else user


def acl_permissions(run_id: str, user: str) -> str:
    """The permissions part of ``user``'s line of the ACL file (after ``user NAME on #HASH``)."""
    keys = Keys(run_id)
    user = role(user)
    root, reads, grants = rights(keys)[user]
    channel = f" &{_pattern(keys.announce)}" if user == "learner" else ""
    root_keys = " ".join(f"%R~{r}" for r in reads)
    selectors = " ".join(f"({' '.join(cmds)} {' '.join(f'%RW~{x}' for x in ks)})" for cmds, ks in grants)
    after = f" {AFTER[user]}" if user in AFTER else ""
    return f"resetkeys resetchannels{channel} -@all {BASE} {root} {root_keys} -@dangerous{after}" + (
        f" {selectors}" if selectors else ""
    )
