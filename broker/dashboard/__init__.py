"""The live dashboard: its HTTP server (page, JSON API, server-sent events, /metrics) and the run's
state read from Redis (also what ``relay status`` prints)."""
