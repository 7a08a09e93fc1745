"""``math_verify``: is the completion's final answer mathematically equal to the reference?

Parsing and comparison are done by Hugging Face's ``math-verify`` library (LaTeX, plain
expressions, ``\\boxed{}``, fractions vs decimals, sets, intervals...), so ``1/2``, ``0.5`` and
``\\frac{1}{2}`` are the same answer. math-verify bounds its own time with SIGALRM, which only
works in a process's main thread, so the work runs in a small pool of worker processes; a worker
that does not answer in time is killed and the item is failed ``math_timeout``.

Scores: 1.0 equal, 0.0 not equal or no answer found in the completion (the model's fault: a real
0, with ``details.parsed = 0``). Failed: ``unparsable_reference`` (the dataset's fault),
``math_timeout``, ``math_error``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from pydantic import Field

from broker.runtime.config import StrictModel
from reward_service.plugins import Item, Result, RewardPlugin, register


class MathOptions(StrictModel):
    """math-verify answer equivalence."""

    workers: int = Field(1, ge=1, le=64, description="worker processes")
    timeout_s: int = Field(
        5,
        ge=1,
        le=600,
        description="math-verify's own limit for parsing and for comparing "
        "one item (each); the worker is killed at 2 × timeout_s + 5 s",
    )
    float_rounding: int = Field(6, ge=0, le=20, description="decimal places compared for floats")


def verify_one(completion: str, reference: str, timeout_s: int, float_rounding: int) -> tuple[float | None, str, float]:
    """(score, failure reason, parsed) in a worker process's main thread."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold = parse(reference, parsing_timeout=timeout_s, raise_on_error=True)
    except TimeoutException:
        return None, "math_timeout: parsing the reference", 0.0
    except Exception as e:  # the library raises many types; the item fails with the reason
        return None, f"unparsable_reference: {type(e).__name__}: {e}"[:200], 0.0
    if not gold:
        return None, f"unparsable_reference: no answer found in {reference[:60]!r}", 0.0
    try:
        pred = parse(completion, parsing_timeout=timeout_s, raise_on_error=True)
    except TimeoutException:
        return None, "math_timeout: parsing the completion", 0.0
    except Exception:  # unparsable model output is a wrong answer, not a service failure
        return 0.0, "", 0.0
    if not pred:
        return 0.0, "", 0.0
    try:
        ok = verify(gold, pred, float_rounding=float_rounding, timeout_seconds=timeout_s, raise_on_error=True)
    except TimeoutException:
        return None, "math_timeout: comparing", 1.0
    except Exception as e:
        return None, f"math_error: {type(e).__name__}: {e}"[:200], 1.0
    return float(ok), "", 1.0


@register("math_verify")
class MathVerify(RewardPlugin):
    Options = MathOptions

    def __init__(self, options=None, observer=None):
        super().__init__(options, observer)
        self.pool: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.options.workers, mp_context=multiprocessing.get_context("spawn"))
        return self.pool

    def _kill_pool(self) -> None:
        if self.pool is not None:
            for p in list(getattr(self.pool, "_processes", {}).values()):
                p.kill()
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    async def close(self) -> None:
        self._kill_pool()

    async def score(self, items: list[Item]) -> list[Result]:
        o = self.options
        loop = asyncio.get_running_loop()
        pool = self._pool()
        futs = [
            loop.run_in_executor(pool, verify_one, it.completion, it.reference, o.timeout_s, o.float_rounding)
            for it in items
        ]
        # every item may take up to 2 * timeout_s; the pool works through them `workers` at a time
        budget = (2 * o.timeout_s + 5) * (len(items) / o.workers + 1)
        done, pending = await asyncio.wait(futs, timeout=budget)
        if pending:
            self._kill_pool()
        out = []
        for f in futs:
            if f not in done:
                f.cancel()
                out.append(Result.failed(f"math_timeout: no answer from the worker within {budget:.0f}s"))
                continue
            try:
                score, reason, parsed = f.result()
            except BrokenProcessPool as e:
                self.pool = None
                out.append(Result.failed(f"math_error: worker died ({e})"[:200]))
                continue
            out.append(Result.failed(reason) if score is None else Result(score, details={"parsed": parsed}))
        return out
