"""Built-in reward plugins (each module registers its plugins on import).

exact_match     1 when the stripped completion equals the stripped reference
digits          partial credit per position (the toy digit tasks)
final_number    the last tagged number ("Answer: 12") against the reference number
regex           a format check: a regular expression must (not) match
length_penalty  DAPO's soft overlong penalty
math_verify     math answer equivalence through the math-verify library
code_exec       Python code against unit tests in a sandbox (no network, no host files)
judge           an LLM judge through any OpenAI-compatible endpoint
remote          any HTTP reward server speaking the contract of docs/rewards.md
"""

from reward_service.builtin import basic, code, judge, mathverify  # noqa: F401
from reward_service import remote  # noqa: F401
