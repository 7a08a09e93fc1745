"""Process plumbing every service shares: config loading, logging, the /metrics and /healthz server."""
