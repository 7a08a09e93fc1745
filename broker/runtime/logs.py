"""One logger per process, set up once, tagged with the service and replica id."""

from __future__ import annotations

import json
import logging
import sys
import time


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str, replica: str):
        super().__init__()
        self.service, self.replica = service, replica

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "t": round(record.created, 3),
            "level": record.levelname,
            "service": self.service,
            "replica": self.replica,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(service: str, replica: str = "0", level: str = "INFO", as_json: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(_JsonFormatter(service, replica))
    else:
        fmt = f"%(asctime)s %(levelname).1s [{service}:{replica}] %(name)s: %(message)s"
        f = logging.Formatter(fmt, datefmt="%H:%M:%S")
        f.converter = time.localtime
        handler.setFormatter(f)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "uvicorn.access", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
