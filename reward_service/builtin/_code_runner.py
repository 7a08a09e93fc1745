"""The child side of ``code_exec`` (runs inside the sandbox, standard library only).

It runs ``solution.py``, then each test's steps from ``probes.json`` in the solution's namespace, and
writes one JSON record a line to the stdout it was started with: ``{"test": i, "step": j, "value":
V}`` for each probe's value, ``{"test": i, "error": "..."}`` when a step raised (the test stops
there), ``{"done": true}`` at the end. The program's own ``print``s go to stderr.

Nothing here is trusted: the program runs in this interpreter and can change any of it. It never
sees an expected value, and the grader (reward_service/builtin/grader.py, outside the sandbox) only
reads the values as data.
"""

import json
import os
import sys

MAX_DEPTH = 64
SCALARS = (type(None), bool, int, float, str)


def encode(v, depth=0):
    """Exact built-in types as tagged JSON data; anything else is sent as unsupported."""
    t = type(v)
    if depth > MAX_DEPTH:
        return {"unsupported": "value nested too deep"}
    if t in SCALARS:
        return v
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t in (tuple, set, frozenset):
        return {t.__name__: [encode(x, depth + 1) for x in v]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": v.hex()}
    if t is complex:
        return {"complex": [v.real, v.imag]}
    return {"unsupported": t.__name__}


def non_dumpable():
    """PR_SET_DUMPABLE 0: no core file, and the process's memory and /proc files out of reach of anything but
    root, even a process of the same uid (the uid is this run's alone already: sandbox_uids.py). The
    program can undo it for itself; it protects the program from others, not others from it."""
    import ctypes

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4


def main():
    non_dumpable()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the program's stdout goes to stderr: fd 1 of this process is the records' pipe
    sys.stdout = sys.stderr

    def record(**rec):
        out.write(json.dumps(rec) + "\n")
        out.flush()

    with open("probes.json") as f:
        tests = json.load(f)
    with open("solution.py") as f:
        src = f.read()
    ns = {"__name__": "__main__"}
    try:
        exec(compile(src, "solution.py", "exec"), ns)
    except BaseException as e:
        print(f"solution raised {type(e).__name__}: {e}", file=sys.stderr)
        for i in range(len(tests)):
            record(test=i, error=f"the solution raised {type(e).__name__}")
        record(done=True)
        return
    for i, steps in enumerate(tests):
        for j, step in enumerate(steps):
            try:
                if "exec" in step:
                    exec(compile(step["exec"], f"test_{i}", "exec"), ns)
                    continue
                value = eval(compile(step["eval"], f"test_{i}", "eval"), ns)
                value = encode(bool(value) if step["bool"] else value)
                line = json.dumps({"test": i, "step": j, "value": value})
            except BaseException as e:
                record(test=i, error=f"{type(e).__name__}: {str(e)[:200]}")
                break
            out.write(line + "\n")
            out.flush()
    record(done=True)


if __name__ == "__main__":
    main()
