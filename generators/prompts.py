"""A prompts-stream entry -> the token ids fed to the model (docs/protocol.md 7.1).

An entry with ``prompt_ids`` (a JSON list, written by the feeder for dataset prompts: the chat
template already applied by the model's tokenizer) is used exactly as given, so the model sees
token for token what the dataset's templating produced, with no second BOS. Otherwise the
``text`` is encoded with the snapshot's tokenizer.
"""

from __future__ import annotations

import json


def prompt_token_ids(fields: dict[str, str], encode) -> list[int]:
    raw = fields.get("prompt_ids")
    if raw:
        ids = json.loads(raw)
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(f"prompt_ids must be a non-empty JSON list of token ids, got {raw[:80]!r}")
        return ids
    return encode(fields["text"])
