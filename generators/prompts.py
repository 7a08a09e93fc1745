"""A prompts-stream entry -> the token ids fed to the model (docs/protocol.md 7.1).

An entry with ``prompt_ids`` (written by the feeder for dataset prompts: the chat template already
applied by the model's tokenizer) is used exactly as given, so the model sees token for token what
the dataset's templating produced, with no second BOS. Otherwise the ``text`` is encoded with the
snapshot's tokenizer.
"""

from __future__ import annotations

from broker.protocol.messages import PromptEntry


def prompt_token_ids(prompt: PromptEntry, encode) -> list[int]:
    return prompt.prompt_ids if prompt.prompt_ids is not None else encode(prompt.text)
