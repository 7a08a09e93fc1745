"""``code_exec``: run the completion's Python code against unit tests, in the sandbox.

The code is the last fenced block of the completion (```python ... ```), or the whole completion
when it has none. The tests are ``metadata["tests"]`` (a list of snippets, usually ``assert``
lines: score = passed / total) or else the item's ``reference`` (one snippet: score 1 or 0).
Each test runs after the solution, in the solution's namespace.

What the program does is the *model's* doing, so its outcomes are scores, never failures: tests
failing, an exception, an infinite loop killed at ``timeout_s`` (``details.timeout = 1``), memory
exhausted, a crash: all score what passed before, usually 0. An item is *failed* only when the
sandbox itself did not work (``sandbox_error``), there are no tests (``no_tests``) or they cannot be
graded outside the sandbox (``bad_tests``).

The verdict is given outside the sandbox (reward_service/builtin/grader.py): the tests are parsed
here, the sandboxed child gets only the solution and the tests' probes (``f(2)`` of ``assert f(2) ==
4``), never an expected value, and writes the probes' values as data; the grader compares them with
the expected values it alone holds. Nothing the program prints, patches or exits with can make a
test pass. Tests the grader cannot split this way fail the item as ``bad_tests``.

Limits: one cgroup per item (``isolation = "cgroup"``, the default: memory and process counts for
the whole process tree), or, only when the operator says so, ``isolation = "rlimits"`` (per-process
memory, a per-user process count shared by all items: weaker, see docs/rewards.md).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

from pydantic import Field, model_validator

from broker.runtime.config import StrictModel
from reward_service.builtin import grader, sandbox
from reward_service.builtin.cgroups import CgroupError, Cgroups
from reward_service.builtin.sandbox_uids import FIRST_UID, UID_COUNT, UidPool
from reward_service.plugins import Item, Result, RewardPlugin, register

FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


class CodeOptions(StrictModel):
    """Sandboxed code execution."""

    timeout_s: float = Field(
        5.0, gt=0, le=300, description="wall-clock limit per item; CPU limit is the same, rounded up"
    )
    memory_mb: int = Field(
        512,
        ge=64,
        le=65536,
        description="memory of the program, all its processes together "
        "(the item's cgroup); also each process's address-space limit",
    )
    max_processes: int = Field(
        32,
        ge=2,
        le=4096,
        description="processes and threads of one item at once (pids.max "
        'of its cgroup; with isolation = "rlimits", RLIMIT_NPROC of the item\'s own uid)',
    )
    isolation: Literal["cgroup", "rlimits"] = Field(
        "cgroup",
        description='"cgroup": one cgroup per item, limits for the whole process tree (refuses to start '
        'where cgroups cannot be made); "rlimits": per-process limits only, forked children multiply memory and '
        "one item's fork bomb can starve the others (weaker, opt-in)",
    )
    cgroup_parent: str | None = Field(
        None,
        description="cgroup to make item cgroups under (v2: a directory of the "
        "cgroup2 file system; v1: a path under each controller); default: the "
        "service's own cgroup",
    )
    disk_mb: int = Field(32, ge=1, le=4096, description="size of the program's writable file system")
    max_concurrency: int = Field(2, ge=1, le=256, description="sandboxes running at once")
    extract_code: bool = Field(True, description="take the last ```python block of the completion")
    tests_field: str = Field("tests", description="metadata field holding the list of test snippets")
    check_sandbox: bool = Field(True, description="at start-up, refuse to start unless the sandbox works here")
    uid_first: int = Field(
        FIRST_UID,
        ge=1000,
        le=2**31 - 2,
        description="first uid (and gid) of the range the "
        "items run as: each item gets one of its own that no user or process of the host has "
        "(docs/rewards.md, Security); keep the range for the sandbox alone",
    )
    uid_count: int = Field(
        UID_COUNT, ge=1, le=2**24, description="uids in that range: at least the items that may run at once on the host"
    )

    @model_validator(mode="after")
    def _uid_range(self) -> "CodeOptions":
        if self.uid_first + self.uid_count > 2**31 - 1:
            raise ValueError(f"uid_first + uid_count must stay below 2^31 - 1 ({self.uid_first} + {self.uid_count})")
        return self


@register("code_exec")
class CodeExec(RewardPlugin):
    Options = CodeOptions

    def __init__(self, options=None, observer=None):
        super().__init__(options, observer)
        o = self.options
        self.limits = sandbox.Limits(
            wall_s=o.timeout_s,
            cpu_s=max(1, int(o.timeout_s + 0.999)),
            memory_mb=o.memory_mb,
            disk_mb=o.disk_mb,
            max_procs=o.max_processes,
            max_output=2**20,
        )
        self.sem: asyncio.Semaphore | None = None
        self.cgroups: Cgroups | None = None
        self.uids = UidPool(o.uid_first, o.uid_count)

    async def start(self) -> None:
        if self.options.isolation == "cgroup":
            try:
                self.cgroups = Cgroups(self.options.cgroup_parent)
                self.cgroups.check()
            except (CgroupError, OSError) as e:
                raise sandbox.SandboxError(
                    f"{e}; code_exec needs a cgroup per item (see docs/deploy.md), or "
                    'isolation = "rlimits" to accept per-process limits only'
                ) from e
        if self.options.check_sandbox:
            await sandbox.probe(self.cgroups, self.uids)

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
        parsed = []
        for i, t in enumerate(tests):
            try:
                parsed.append(grader.parse_test(t))
            except grader.BadTest as e:
                return Result.failed(f"bad_tests: test {i}: {e}"[:300])
        code = extract_code(it.completion) if self.options.extract_code else it.completion
        if self.cgroups is None and self.options.isolation == "cgroup":
            try:  # start() was not called: made here, and failing items (never running them unconfined)
                self.cgroups = Cgroups(self.options.cgroup_parent)
            except CgroupError as e:
                return Result.failed(f"sandbox_error: {e}"[:300])
        probes = json.dumps([t.steps for t in parsed])
        async with self.sem:
            try:
                o = await sandbox.run(
                    {"solution.py": code, "probes.json": probes, "_runner.py": grader.RUNNER},
                    ["_runner.py"],
                    b"",
                    self.limits,
                    self.cgroups,
                    self.uids,
                )
            except sandbox.SandboxError as e:
                return Result.failed(f"sandbox_error: {e}"[:300])
        v = grader.grade(parsed, o.stdout)
        details = {
            "passed": float(v.passed),
            "total": float(v.total),
            "timeout": float(o.timed_out),
            "completed": float(v.finished),
            "seconds": round(o.seconds, 3),
            "oom_kills": float(o.oom_kills),
        }
        if o.memory_peak_mb is not None:
            details["memory_peak_mb"] = o.memory_peak_mb
        return Result(v.passed / v.total, details=details)
