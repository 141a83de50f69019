"""Daemon threads inside the native kernel's GIL-free calls (``poll``, ``flush``: what the recorder's
progress thread calls) while the interpreter exits. On Python < 3.14 such a thread is ended by
pthread_exit when it takes the GIL back during finalization; the process must still exit 0 (a kernel
that took the GIL back in a destructor aborted here every time: "terminate called without an active
exception")."""

import sys
import threading
import time

from moedoctor.recorder import native

module = native.load()
if module is None:
    sys.exit(3)


def spin() -> None:
    while True:
        module.poll()
        module.flush()


for _ in range(4):
    threading.Thread(target=spin, daemon=True).start()
time.sleep(0.05)
print("exiting", flush=True)
sys.exit(0)
