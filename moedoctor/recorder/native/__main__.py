"""``python -m moedoctor.recorder.native``: build the native recorder for this environment now (at
install time, in an image), so that no ``moedoctor run`` waits for it. Exit status 0 when it is
built and loads, 1 (with the reason) when it cannot be."""

import sys

from moedoctor.recorder import native

if native.available():
    print(f"moedoctor: the native recorder is built for this environment ({native.extension_name()})")
    sys.exit(0)
print(f"moedoctor: the native recorder cannot be built here: {native.reason}", file=sys.stderr)
sys.exit(1)
