"""A long-lived ``moedoctor analyze`` for the fuzz suite (tests/unit/test_fuzz_analyze.py): one
process, so that thousands of inputs cost milliseconds each, not an interpreter start-up each, and
still bounded as a separate process is.

Reads one JSON request per line on stdin (``{"args": ["analyze", PATH, ...]}``), runs
``moedoctor.cli.main.main(args)`` in-process with stdout and stderr captured, and answers one JSON
line on stdout: ``{"code": exit status, "seconds": wall time, "out": last 3000 characters,
"traceback": the traceback of an exception that escaped main, or null}``. After a warm-up on the
path given as ``argv[1]`` (every module the analysis imports is loaded), the address space is
capped at what it is then plus ``argv[2]`` MiB (``RLIMIT_AS``): an input that needs more fails its
allocation, which ``main`` turns into exit 3. ``MOEDOCTOR_DEBUG=1`` makes ``main`` re-raise
unexpected exceptions, so that a failure comes back with its traceback.

The parent enforces the time limit (it kills a worker that does not answer in time).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import sys
import time
import traceback

os.environ["MOEDOCTOR_DEBUG"] = "1"
os.environ.setdefault("COLUMNS", "120")

from moedoctor.cli.main import main  # noqa: E402


class _Tail(io.TextIOBase):
    """A text stream that keeps only its last characters (the report may be megabytes)."""

    def __init__(self, keep: int = 3000):
        self.keep, self.text, self.size = keep, "", 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.size += len(s)
        self.text = (self.text + s)[-self.keep:]
        return len(s)


def run(args: list[str]) -> dict:
    out = _Tail()
    tb = None
    start = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(args)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - what escaped main is the finding
            code = 3
            tb = traceback.format_exc()[-6000:]
    return {"code": code, "seconds": time.monotonic() - start, "out": out.text, "traceback": tb}


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def serve(warm_up: str, budget_mib: int) -> None:
    run(["analyze", warm_up])
    run(["analyze", warm_up, "--json"])
    limit = _address_space() + (budget_mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(json.dumps({"ready": True, "limit": limit}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(run(request["args"])), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
