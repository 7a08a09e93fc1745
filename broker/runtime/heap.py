"""The garbage collector of a long-running service, told what will live for the whole process.

After start-up a service holds ~10^5 objects that live as long as it does (modules, classes, configs,
clients). Python's full collection walks all of them each time, and a service that allocates per
message (the broker decodes every group) triggers one every ~2,000 groups: 20-30 ms each, ~19 µs per
group in the broker, the tenth of its CPU (docs/benchmarks.md "ingest"). :func:`freeze_startup_objects`
moves them to the collector's permanent generation (``gc.freeze``): never scanned, never freed, which
they would not be anyway. Call it once, when the service is set up and about to serve.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("relay.runtime.heap")


def freeze_startup_objects() -> int:
    """Collect once, then freeze what survived; the number frozen."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.debug("%d start-up objects frozen out of the garbage collector's scans", n)
    return n
