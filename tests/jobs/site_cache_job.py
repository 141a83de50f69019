"""``mixed_healthy.py`` under the installed recorder, then the native kernel's call-site cache counts:
``site_cache=<on> hits=<n> misses=<n> defer_format=<on> gil_free=<on> without_gil=<n>``
(tests/integration/test_native_recorder.py compares the records of runs with the cache on and off, with
the formatting deferred or not, and with cache hits recorded without the GIL or with it).

  torchrun --nproc_per_node 2 tests/jobs/site_cache_job.py [mixed_healthy.py's arguments]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from moedoctor.recorder.install import installed_recorder

MIXED = Path(__file__).resolve().with_name("mixed_healthy.py")

if __name__ == "__main__":
    sys.argv = [str(MIXED), *sys.argv[1:]]
    runpy.run_path(str(MIXED), run_name="__main__")
    native = getattr(installed_recorder(), "_native", None)
    hits, misses = native.site_cache_counts() if native is not None else (0, 0)
    without_gil = native.gil_free_count() if native is not None else 0
    sys.stdout.write(
        f"site_cache={getattr(native, 'site_cache', None)} hits={hits} misses={misses} "
        f"defer_format={getattr(native, 'defer_format', None)} gil_free={getattr(native, 'gil_free', None)} "
        f"without_gil={without_gil}\n"
    )
    sys.stdout.flush()
