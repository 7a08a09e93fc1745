"""The Redis layout of a run. Every key lives under ``relay:{run_id}:``.

| key                       | type       | written by | meaning                                         |
|---------------------------|------------|------------|-------------------------------------------------|
| prompts                   | stream     | broker     | prompts to sample; group ``generators`` claims  |
| trajectories              | stream     | broker     | scored groups (the replay queue); group ``learner`` |
| payload:<stream id>       | string     | broker     | the message of the group at that entry of trajectories |
| staged:<token>            | string     | broker     | a message on its way in, within one MULTI (expires) |
| seen                      | set        | broker     | group ids already appended (de-duplication)     |
| queue_bytes / queue_sizes | string/hash | broker, learner | bytes of the groups in trajectories; group id -> its bytes (the byte bound) |
| dead_letter               | stream     | broker     | rejected messages + reason (capped)             |
| latest                    | string     | learner    | msgpack announcement of the latest version      |
| announce                  | pub/sub    | learner    | channel carrying each announcement              |
| generators                | hash       | generators | generator id -> JSON heartbeat                  |
| events                    | stream     | all        | capped event log for the dashboard              |
| learner_metrics           | stream     | learner    | capped per-step metrics (dashboard history)     |
| versions                  | hash       | announcer  | version -> announced manifest hash              |
| services                  | hash       | services   | "service:replica" -> JSON metrics endpoint      |
| stats:broker / stats:learner | hash    | services   | counters (accepted, rejected:<reason>, trained, ...) |
| issued                    | string     | generators | prompts admitted so far (admission control)     |
| admission                 | hash       | learner    | {batch_groups, eta}: the staleness bound        |
| done                      | string     | learner    | set when the learner finished its step budget   |
| trained / trained_log     | set/stream | learner    | groups whose training is committed (audit)      |
| counted                   | set        | learner    | groups trained and counted, not yet committed   |
| dropped_log               | stream     | learner    | groups dropped, with the reason (audit)         |
| feeder                    | hash       | broker     | the prompt feeder's position {epoch, index, fed, skipped_too_long} |
| eval_prompts              | stream     | broker     | held-out prompts of evaluation rounds; group ``generators`` |
| eval_rounds               | hash       | broker     | round version -> JSON {prompts, greedy, samples, threshold, final} |
| eval_results              | stream     | generators | one entry per evaluated prompt (round, idx, data JSON); a complete round's are deleted once summarised |
| eval_summaries            | hash       | broker     | round version -> JSON summary of a complete round (pass@1, pass@k, mean reward and length, ...) |
| run                       | hash       | broker, generators, learner | how a producer joins the run: ingest_address (broker), reward_url and sampling (the first generator), eos_token_id (learner, at publication); messages.RunInfo |
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPTS_GROUP = "generators"
TRAJECTORIES_GROUP = "learner"
# group ids remembered for de-duplication and exactly-once commits: the last RECORD_WINDOW to twice that
# many (``broker.record_window``, ``learner.batch.record_window``; 0: all of the run's, never trimmed).
# 2**18 ids are 45 minutes of a run at 100 groups/s, about 20-40 MB of Redis per set at most.
RECORD_WINDOW = 1 << 18
# the events stream's ceiling: every writer appends with MAXLEN ~ this; the broker trims it further to
# ``broker.events_kept``
EVENTS_MAX = 10_000


@dataclass(frozen=True)
class Keys:
    run_id: str

    def _k(self, name: str) -> str:
        return f"relay:{self.run_id}:{name}"

    @property
    def prefix(self) -> str:
        """What every key and channel of the run starts with (``relay:<run_id>:``; Redis ACL patterns)."""
        return self._k("")

    @staticmethod
    def run_of(key: str) -> str:
        """The run id of one of these keys (``Keys("*")`` gives the SCAN patterns over every run)."""
        return key.split(":", 2)[1]

    @property
    def prompts(self) -> str:
        return self._k("prompts")

    @property
    def trajectories(self) -> str:
        return self._k("trajectories")

    def payload(self, stream_id: bytes | str) -> str:
        """The group message of the trajectories entry ``stream_id``: exactly the bytes the producer sent.
        Kept out of the stream so that Redis's Lua never copies it (docs/protocol.md 7.3)."""
        return self.payload_prefix + (stream_id.decode() if isinstance(stream_id, bytes) else stream_id)

    @property
    def payload_prefix(self) -> str:
        return self._k("payload:")

    def staged(self, token: str) -> str:
        """A group message written in the same MULTI as the append script, which renames it to its
        ``payload`` key or deletes it (busy, duplicate); it expires should that script never run."""
        return self._k(f"staged:{token}")

    @property
    def seen(self) -> str:
        """Set of the group ids appended lately (the broker's de-duplication; with ``seen_prev``, the last
        ``record_window`` to 2 x ``record_window`` of them)."""
        return self._k("seen")

    @property
    def seen_prev(self) -> str:
        """The previous generation of ``seen`` (renamed when ``seen`` reached the record window)."""
        return self._k("seen_prev")

    @property
    def queue_bytes(self) -> str:
        """Bytes of the group messages in the trajectories stream (added on append, removed on commit/drop)."""
        return self._k("queue_bytes")

    @property
    def queue_sizes(self) -> str:
        """Group id -> bytes of its message, for each group in the trajectories stream."""
        return self._k("queue_sizes")

    @property
    def dead_letter(self) -> str:
        """Capped stream of rejected messages with their reasons, for inspection."""
        return self._k("dead_letter")

    @property
    def latest(self) -> str:
        return self._k("latest")

    @property
    def announce(self) -> str:
        return self._k("announce")

    @property
    def generators(self) -> str:
        return self._k("generators")

    @property
    def events(self) -> str:
        return self._k("events")

    @property
    def learner_metrics(self) -> str:
        """Capped stream of the learner's per-step metrics (one entry per step, JSON), for charts."""
        return self._k("learner_metrics")

    @property
    def versions(self) -> str:
        """Hash version -> the manifest hash announced for it (written with every announcement)."""
        return self._k("versions")

    @property
    def services(self) -> str:
        """Hash "service:replica" -> JSON {service, replica, host, port}: where each /metrics is."""
        return self._k("services")

    def stats(self, service: str) -> str:
        return self._k(f"stats:{service}")

    @property
    def issued(self) -> str:
        """Counter of prompts admitted by generators (staleness admission control)."""
        return self._k("issued")

    @property
    def admission(self) -> str:
        """Hash {batch_groups, eta} written by the learner: the admission bound's parameters."""
        return self._k("admission")

    @property
    def trained(self) -> str:
        """Set of group ids whose training is committed (in a learner checkpoint, or acknowledged); with
        ``trained_prev``, the last ``record_window`` to 2 x ``record_window`` of them."""
        return self._k("trained")

    @property
    def trained_prev(self) -> str:
        """The previous generation of ``trained`` (renamed when ``trained`` reached the record window)."""
        return self._k("trained_prev")

    @property
    def trained_log(self) -> str:
        """Stream of committed trainings, one entry per group (gid, step): the audit's record."""
        return self._k("trained_log")

    @property
    def counted(self) -> str:
        """Set of group ids the learner trained and counted in ``consumed`` but has not committed yet:
        a restarted learner that trains them again does not count them twice (admission control)."""
        return self._k("counted")

    @property
    def dropped_log(self) -> str:
        """Stream of groups the learner dropped (gid, reason): the audit's record."""
        return self._k("dropped_log")

    @property
    def done(self) -> str:
        """Set by the learner when the run is over (its step budget done, or the dataset used up); the
        value says why, in a sentence."""
        return self._k("done")

    @property
    def feeder(self) -> str:
        """Hash {epoch, index, fed, skipped_too_long}: where the prompt feeder resumes (written with its XADDs)."""
        return self._k("feeder")

    @property
    def eval_prompts(self) -> str:
        """Stream of held-out prompts of evaluation rounds (consumer group ``generators``)."""
        return self._k("eval_prompts")

    @property
    def eval_rounds(self) -> str:
        """Hash round version -> JSON of the round's settings (prompts, greedy, samples, threshold, final)."""
        return self._k("eval_rounds")

    @property
    def run(self) -> str:
        """Hash: what a producer needs to join the run (messages.RunInfo, docs/protocol.md 7.11): ingest_address
        (the broker, at start-up), reward_url and sampling (JSON; the first generator to start: every producer
        must use them), eos_token_id (the learner, at each publication)."""
        return self._k("run")

    @property
    def eval_results(self) -> str:
        """Stream of evaluated prompts: round, idx, data (JSON: version served, greedy and sampled results).
        A round's entries are deleted once the round is complete and its summary is in ``eval_summaries``."""
        return self._k("eval_results")

    @property
    def eval_summaries(self) -> str:
        """Hash round version -> JSON summary of a complete round (broker/prompts/evals.py summarize_round),
        written with the deletion of its ``eval_results`` entries, in one MULTI/EXEC."""
        return self._k("eval_summaries")

    @property
    def collective(self) -> str:
        """Hash {host, port, pid}: the learner leader's rendezvous (learner/rendezvous.py) for the collective
        weight transport, written when it starts (learner/broadcast.py); generators join through it."""
        return self._k("collective")

    @property
    def ipc(self) -> str:
        """Hash: the learner leader's shared slots for the ipc weight transport (epoch, header, slot0/1,
        seq0/1, current; broker/protocol/ipc.py), written by learner/ipc.py."""
        return self._k("ipc")
