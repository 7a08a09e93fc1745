"""The Lua scripts docs/protocol.md prints are the ones Relay runs (broker/protocol/scripts.py): a
producer written in another language from the document alone runs exactly Relay's atomic steps."""

import re
from pathlib import Path

from broker.protocol import scripts

DOC = (Path(__file__).parents[3] / "docs" / "protocol.md").read_text()


def _blocks() -> list[str]:
    return [b.strip() for b in re.findall(r"```lua\n(.*?)```", DOC, re.S)]


def test_the_admission_scripts_are_printed_exactly():
    blocks = _blocks()
    for name in ("ADMIT_CLAIM", "ADMIT"):
        assert getattr(scripts, name).strip() in blocks, f"docs/protocol.md 7.4 does not print scripts.{name}"
