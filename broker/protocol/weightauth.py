"""The bearer token of the ``http`` weight transport (learner/weight_server.py serves, generators/weight_fetch.py
fetches): derived from the run's announcement key, which every service that reads weights already holds, so
the weights' confidentiality needs no secret of its own (docs/security.md)."""

from __future__ import annotations

import hashlib
import hmac

TOKEN_CONTEXT = b"relay weights http v1\0"


def bearer_token(announce_key: bytes | None, run_id: str) -> str | None:
    """HMAC-SHA256 of the run id under the run's announcement key (hex), or None when announcements are
    unsigned (``announce_auth = "insecure"``: the weight server asks for no token)."""
    if announce_key is None:
        return None
    return hmac.new(announce_key, TOKEN_CONTEXT + run_id.encode(), hashlib.sha256).hexdigest()
