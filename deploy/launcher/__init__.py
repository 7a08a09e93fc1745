"""The local launcher, ``relay up``: every service as a child process on this machine (up.py), started
and stopped by PID (procs.py), restarted when it dies (supervisor.py), and the run's summary
(summary.py)."""
