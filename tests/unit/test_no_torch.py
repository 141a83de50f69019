"""The reading and analysis side runs anywhere: importing it must not import torch."""

import subprocess
import sys


def test_reader_and_events_import_no_torch():
    code = ("import sys, moedoctor.events, moedoctor.trace.reader, moedoctor._imports; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
