"""The client library every service uses to meet the others (Redis and ZeroMQ; no service internals):

connection.py     Redis connections and back-off
sender.py         GroupSender: groups to the broker over ZeroMQ, acked, resent, back-pressured
queues.py         the streams of the replay queue (prompts, trajectories, eval) and admission control
announcements.py  weight versions: announce, read the latest, the hash announced for each version
telemetry.py      heartbeats, metrics endpoints, events, counters
"""
