"""capacity: docs/scaling.md's projection, computed from a ``relay bench ingest fanout`` JSON.

    .venv/bin/python -m benchmarks.capacity docs/benchmarks/scaling.json   # prints the tables of docs/scaling.md

It measures nothing: it turns measured inputs (read from the JSON, each named by its row and field) and the
scenario's assumptions (:class:`Scenario`, :data:`MODELS`: hardware and workload figures this 2-core machine
cannot measure, stated as such) into, for a 7B and a 70B model and 8 / 64 / 512 generators, each part's
utilization (1.0 = saturated) and the fleet size at which each part saturates:

    P            = G × T                                   tokens/s the fleet produces (G generators of T each)
    ingest       = P × broker_us_per_token / 1e6 / broker_cores
    redis_cpu    = P × redis_us_per_token / 1e6            (Redis runs commands on one thread: one core)
    redis_memory = P × queue_s × bytes_per_token / redis_memory_bytes
    learner      = P × flops_per_token / (learner_gpus × gpu_flops × mfu)      one learner node
    fanout_nic   = V × G × S / nic_bytes_per_s             V = P / tokens_per_step versions/s, S bytes a version
    fanout_cpu   = V × G × S × learner_cpu_s_per_byte / sending_cores
    fanout_tree  = V × S / nic_bytes_per_s                 the learner sends one copy (an NCCL broadcast, peers
                                                           re-serving): each link carries a version once

Every part but the fan-out grows linearly with G (it saturates at G / u); the fan-out grows with G² (more
generators make versions come faster, and each goes to every generator: it saturates at G / √u). The
fan-out assumes the learner keeps up (versions come as fast as the fleet fills steps): the learner's own
limit is its row. Per-token CPU figures scale the measured group (8 × 1,024 tokens) by its tokens: the
cost of a larger group is taken as proportional to its bytes (an upper bound: a group's fixed costs are
paid once per group).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

TRANSPORTS = ("store", "http", "collective")
FLEETS = (8, 64, 512)


@dataclass(frozen=True)
class Scenario:
    """The assumptions: hardware and workload, not measured here (docs/scaling.md says where each comes from)."""

    tokens_per_group: int = 8 * 2048  # 8 samples of 2,048 tokens
    tokens_per_step: int = 64 * 8 * 2048  # 64 groups a learner step: 1,048,576 tokens, one version each step
    publish_bytes_per_param: int = 2  # bf16 (weights.dtype)
    learner_gpus: int = 8  # one learner node
    gpu_flops: float = 989e12  # H100 SXM, dense bf16
    mfu: float = 0.4
    flops_per_token_per_param: int = 8  # 6 (forward + backward) + 2 (the π_old forward)
    nic_bytes_per_s: float = 50e9  # 400 Gb/s out of the learner's leader (or the shared store, for `store`)
    sending_cores: int = 16  # learner-host cores free to send weights
    broker_cores: int = 16  # one broker host (broker.ingest_workers up to its cores)
    redis_memory_bytes: float = 64e9  # one Redis host
    queue_s: float = 60.0  # the queue holds a minute of the fleet's production (a learner stall)


# per model: parameters, GPUs one generator (one engine) spans, its tokens/s (assumed: vLLM-class engines)
MODELS = {
    "7B": {"params": 7e9, "generator_gpus": 1, "tokens_per_s": 5000.0},
    "70B": {"params": 70e9, "generator_gpus": 8, "tokens_per_s": 2500.0},
}


def inputs(report: dict) -> dict:
    """The measured inputs, from a ``relay bench`` report holding the ``ingest`` and ``fanout/*`` rows."""
    rows = {r["name"]: r for r in report["benchmarks"]}
    ing = rows["ingest"]
    d = ing["details"]
    tokens = d["samples"] * d["tokens_per_sample"]
    cpu = d["broker_cpu_us_per_group"]
    out = {
        "ingest_groups_per_s": ing["value"],
        "ingest_tokens_per_group": tokens,
        "bytes_per_group": d["broker_MB_per_s"] * 1e6 / ing["value"],
        "broker_us_per_group": cpu["broker"],
        "redis_us_per_group": cpu["redis"],
    }
    out["bytes_per_token"] = out["bytes_per_group"] / tokens
    out["broker_us_per_token"] = cpu["broker"] / tokens
    out["redis_us_per_token"] = cpu["redis"] / tokens
    for t in TRANSPORTS:
        r = rows.get(f"fanout/{t}")
        if r is None or r.get("skipped") or r.get("error"):
            continue
        f = r["details"]
        out[t] = {
            "slope_s": r["value"],
            "one_receiver_s": r["baseline"],
            "r2": f["fit"]["r2"],
            "receivers": [p["receivers"] for p in f["points"]],
            "latency_s": [p["latency_s"] for p in f["points"]],
            "version_bytes": f["version_bytes"],
            "learner_cpu_s_per_receiver": f["learner_cpu_s_per_receiver"],
            "learner_cpu_s_per_byte": f["learner_cpu_s_per_receiver"] / f["version_bytes"],
        }
    return out


def utilization(m: dict, model: dict, fleet: int, s: Scenario, transport: str = "http") -> dict:
    """Each part's utilization (1.0 = saturated) with ``fleet`` generators of ``model``; the fan-out by
    ``transport``'s measured learner CPU per byte."""
    p = fleet * model["tokens_per_s"]
    size = model["params"] * s.publish_bytes_per_param
    versions = p / s.tokens_per_step
    fan_bytes = versions * fleet * size
    cpu_per_byte = max(0.0, m[transport]["learner_cpu_s_per_byte"]) if transport in m else 0.0
    return {
        "tokens_per_s": p,
        "groups_per_s": p / s.tokens_per_group,
        "ingest_mb_per_s": p * m["bytes_per_token"] / 1e6,
        "versions_per_s": versions,
        "fanout_bytes_per_s": fan_bytes,
        "ingest": p * m["broker_us_per_token"] / 1e6 / s.broker_cores,
        "redis_cpu": p * m["redis_us_per_token"] / 1e6,
        "redis_memory": p * s.queue_s * m["bytes_per_token"] / s.redis_memory_bytes,
        "learner": p * s.flops_per_token_per_param * model["params"] / (s.learner_gpus * s.gpu_flops * s.mfu),
        "fanout_nic": fan_bytes / s.nic_bytes_per_s,
        "fanout_cpu": fan_bytes * cpu_per_byte / s.sending_cores,
        "fanout_tree": versions * size / s.nic_bytes_per_s,
    }


PARTS = ("ingest", "redis_cpu", "redis_memory", "learner", "fanout_nic", "fanout_cpu", "fanout_tree")
QUADRATIC = ("fanout_nic", "fanout_cpu")


def saturates_at(m: dict, model: dict, s: Scenario, transport: str = "http") -> dict[str, float]:
    """The fleet size at which each part reaches utilization 1."""
    u = utilization(m, model, 1, s, transport)
    return {k: (1 / math.sqrt(u[k]) if k in QUADRATIC else 1 / u[k]) if u[k] > 0 else math.inf for k in PARTS}


def _n(x: float) -> str:
    if math.isinf(x):
        return "∞"
    if abs(x) >= 1e7:
        return f"{x:.3g}"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def markdown(report: dict, s: Scenario = Scenario(), source: str = "docs/benchmarks/scaling.json") -> str:
    m = inputs(report)
    lines = [
        f"Measured inputs (`{source}`, commit {report['machine']['commit']}):",
        "",
        "| input | value | from |",
        "|---|---|---|",
        f"| bytes per token on the wire and in Redis | {_n(m['bytes_per_token'])} | `ingest`: "
        f"`broker_MB_per_s` / `value` / ({m['ingest_tokens_per_group']:,} tokens) |",
        f"| broker CPU per group of {m['ingest_tokens_per_group']:,} tokens | {_n(m['broker_us_per_group'])} µs "
        f"({_n(1e6 / m['broker_us_per_group'])} groups/s per core) | `ingest`: `broker_cpu_us_per_group.broker` |",
        f"| Redis CPU per group | {_n(m['redis_us_per_group'])} µs ({_n(1e6 / m['redis_us_per_group'])} groups/s "
        "per core) | `ingest`: `broker_cpu_us_per_group.redis` |",
    ]
    for t in TRANSPORTS:
        if t in m:
            f = m[t]
            lines.append(
                f"| learner CPU per receiver, `{t}` | {_n(f['learner_cpu_s_per_receiver'])} s per "
                f"{f['version_bytes'] / 1e9:.2f} GB ({_n(f['learner_cpu_s_per_byte'] * 1e9)} s/GB) | "
                f"`fanout/{t}`: `learner_cpu_s_per_receiver` / `version_bytes` |"
            )
    lines += ["", "Assumed (the scenario, not measured here):", "", "| assumption | value |", "|---|---|"]
    lines += [f"| `{k}` | {_n(v) if isinstance(v, float) else f'{v:,}'} |" for k, v in asdict(s).items()]
    lines += [
        f"| model `{name}` | {mod['params'] / 1e9:.0f}B parameters, {mod['generator_gpus']} GPU(s) a generator, "
        f"{mod['tokens_per_s']:,.0f} tokens/s a generator |"
        for name, mod in MODELS.items()
    ]
    lines += [
        "",
        "Fleet size at which each part saturates (weights over `http`; the fan-out's CPU by `http`'s measured "
        "cost per byte):",
        "",
        "| model | ingest (broker) | Redis CPU | Redis memory | learner (1 node) | fan-out: learner NIC | "
        "fan-out: learner CPU | first | fan-out, one copy from the learner |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, mod in MODELS.items():
        g = saturates_at(m, mod, s)
        first = min((k for k in PARTS if k != "fanout_tree"), key=g.get)
        cells = " | ".join(_n(g[k]) for k in PARTS if k != "fanout_tree")
        lines.append(f"| {name} | {cells} | {first} | {_n(g['fanout_tree'])} |")
    lines += [
        "",
        "Utilization at 8 / 64 / 512 generators (1.0 = saturated; bold: over):",
        "",
        "| model | generators | tokens/s | groups/s | ingest MB/s | versions/s | fan-out GB/s | ingest | Redis CPU | "
        "Redis memory | learner | fan-out NIC | fan-out CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, mod in MODELS.items():
        for g in FLEETS:
            u = utilization(m, mod, g, s)
            cells = [f"**{u[k]:.3g}**" if u[k] > 1 else f"{u[k]:.2g}" for k in PARTS if k != "fanout_tree"]
            lines.append(
                f"| {name} | {g} | {_n(u['tokens_per_s'])} | {_n(u['groups_per_s'])} | {_n(u['ingest_mb_per_s'])} | "
                f"{u['versions_per_s']:.3g} | "
                f"{_n(u['fanout_bytes_per_s'] / 1e9)} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n"


def fanout_table(report: dict) -> str:
    """The measured fan-out: latency per receiver count, the fitted slope, per transport."""
    m = inputs(report)
    counts = sorted({n for t in TRANSPORTS if t in m for n in m[t]["receivers"]})
    lines = [
        "| transport | " + " | ".join(f"{n} receiver{'s' if n > 1 else ''}, s" for n in counts) + " | slope, s per "
        "receiver | r² | learner CPU, s per receiver |",
        "|---|" + "---|" * (len(counts) + 3),
    ]
    for t in TRANSPORTS:
        if t in m:
            f = m[t]
            by = dict(zip(f["receivers"], f["latency_s"]))
            lines.append(
                f"| `{t}` | "
                + " | ".join(f"{by[n]:.3g}" if n in by else "–" for n in counts)
                + f" | **{f['slope_s']:.3g}** | {f['r2']:.2f} | {f['learner_cpu_s_per_receiver']:.3g} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="docs/scaling.md's tables from a relay bench ingest fanout JSON")
    ap.add_argument("report", nargs="?", default="docs/benchmarks/scaling.json")
    a = ap.parse_args()
    report = json.loads(Path(a.report).read_text())
    print(fanout_table(report))
    print(markdown(report, source=a.report))
