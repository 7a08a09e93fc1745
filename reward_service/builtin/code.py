"""``code_exec``: run the completion's Python code against unit tests, in the sandbox.

The code is the last fenced block of the completion (```python ... ```), or the whole completion
when it has none. The tests are ``metadata["tests"]`` (a list of snippets, usually ``assert``
lines: score = passed / total) or else the item's ``reference`` (one snippet: score 1 or 0).
Each test runs after the solution, in the solution's namespace.

What the program does is the *model's* doing, so its outcomes are scores, never failures: tests
failing, an exception, an infinite loop killed at ``timeout_s`` (``details.timeout = 1``), memory
exhausted, a crash: all score what passed before, usually 0. An item is *failed* only when the
sandbox itself did not work (``sandbox_error``) or there are no tests (``no_tests``).

The runner prints a line with a per-run random nonce only after the last test, so a program that
exits early (``os._exit(0)``) does not pass. It is not a defence against a program written to read
the runner's memory; see docs/rewards.md.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets

from pydantic import Field

from broker.runtime.config import StrictModel
from reward_service.builtin import sandbox
from reward_service.plugins import Item, Result, RewardPlugin, register

RUNNER = r'''
import json, sys


def main():
    nonce = sys.stdin.readline().strip()  # a local: not reachable as a module global
    out = sys.stdout
    src = open("solution.py").read()
    tests = json.load(open("tests.json"))
    ns = {"__name__": "__main__"}
    passed = 0
    try:
        exec(compile(src, "solution.py", "exec"), ns)
        ok = True
    except BaseException as e:
        print(f"solution raised {type(e).__name__}: {e}", file=sys.stderr)
        ok = False
    if ok:
        for i, t in enumerate(tests):
            try:
                exec(compile(t, f"test_{i}", "exec"), ns)
                passed += 1
            except BaseException as e:
                print(f"test {i} failed: {type(e).__name__}: {e}", file=sys.stderr)
    out.write(f"\n{nonce} {passed} {len(tests)}\n")
    out.flush()


main()
'''

FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


class CodeOptions(StrictModel):
    """Sandboxed code execution."""

    timeout_s: float = Field(5.0, gt=0, le=300, description="wall-clock limit per item; CPU limit is the same, "
                             "rounded up")
    memory_mb: int = Field(512, ge=64, le=65536, description="address-space limit of the program")
    disk_mb: int = Field(32, ge=1, le=4096, description="size of the program's writable file system")
    max_concurrency: int = Field(2, ge=1, le=256, description="sandboxes running at once")
    extract_code: bool = Field(True, description="take the last ```python block of the completion")
    tests_field: str = Field("tests", description="metadata field holding the list of test snippets")
    check_sandbox: bool = Field(True, description="at start-up, refuse to start unless the sandbox works here")


@register("code_exec")
class CodeExec(RewardPlugin):
    Options = CodeOptions

    def __init__(self, options=None, observer=None):
        super().__init__(options, observer)
        o = self.options
        self.limits = sandbox.Limits(wall_s=o.timeout_s, cpu_s=max(1, int(o.timeout_s + 0.999)),
                                     memory_mb=o.memory_mb, disk_mb=o.disk_mb)
        self.sem: asyncio.Semaphore | None = None

    async def start(self) -> None:
        if self.options.check_sandbox:
            await sandbox.probe()

    async def score(self, items: list[Item]) -> list[Result]:
        if self.sem is None:
            self.sem = asyncio.Semaphore(self.options.max_concurrency)
        return list(await asyncio.gather(*(self._one(it) for it in items)))

    async def _one(self, it: Item) -> Result:
        tests = it.metadata.get(self.options.tests_field)
        if tests is None:
            tests = [it.reference] if it.reference.strip() else []
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            return Result.failed(f"bad_tests: metadata.{self.options.tests_field} must be a list of strings")
        if not tests:
            return Result.failed("no_tests: neither metadata tests nor a reference")
        code = extract_code(it.completion) if self.options.extract_code else it.completion
        nonce = secrets.token_hex(16)
        async with self.sem:
            try:
                o = await sandbox.run({"solution.py": code, "tests.json": json.dumps(tests), "_runner.py": RUNNER},
                                      ["_runner.py"], (nonce + "\n").encode(), self.limits)
            except sandbox.SandboxError as e:
                return Result.failed(f"sandbox_error: {e}"[:300])
        passed, total = 0, len(tests)
        for line in reversed(o.stdout.splitlines()):
            parts = line.split()
            if len(parts) == 3 and parts[0] == nonce:
                passed, total = int(parts[1]), int(parts[2])
                break
        finished = any(line.startswith(nonce) for line in o.stdout.splitlines())
        return Result(passed / total, details={"passed": float(passed), "total": float(total),
                                               "timeout": float(o.timed_out), "completed": float(finished),
                                               "seconds": round(o.seconds, 3)})
