"""The restricted unpickler: plain data loads, anything that could run code is refused unexecuted."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from moedoctor.trace import safe_pickle
from moedoctor.trace.reader import TraceError

SAMPLES = Path(__file__).resolve().parent.parent / "data" / "flight_recorder" / "pickle"


class _Exploit:
    """Pickles to ``os.system("touch <marker>")``: a file appears if the pickle is ever executed."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Builder:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_plain_data_round_trips_at_every_protocol():
    value = {"version": "2.10", "entries": [{"a": (1, "x"), "b": [1.5, None, True, ()], "c": -2**70}],
             "pg_config": {"": {"ranks": "[0, 1]"}}}
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        assert safe_pickle.loads(pickle.dumps(value, protocol=protocol)) == value
    # bytes pickle as plain opcodes from protocol 3 on (before that, through a _codecs global)
    assert safe_pickle.loads(pickle.dumps([b"\x00\xff"], protocol=3)) == [b"\x00\xff"]


def test_real_dumps_need_no_global():
    for path in sorted(SAMPLES.iterdir()):
        dump = safe_pickle.load(path)
        assert isinstance(dump, dict) and dump["version"] == "2.10"


@pytest.mark.parametrize("exploit", [_Exploit, _Builder])
@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_code_execution_is_refused_and_nothing_runs(tmp_path, exploit, protocol):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"version": "2.10", "entries": [exploit(marker)]}, protocol=protocol)
    pickle.loads(payload)  # control: the payload is live, plain pickle runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(safe_pickle.PickleRefused, match="refused"):
        safe_pickle.loads(payload)
    assert not marker.exists()


def test_refusal_is_a_trace_error_naming_the_global(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "fr_rank_0"
    path.write_bytes(pickle.dumps(_Exploit(marker), protocol=2))
    with pytest.raises(TraceError) as info:
        safe_pickle.load(path)
    message = str(info.value)
    assert str(path) in message and "GLOBAL" in message and "nothing was executed" in message
    assert not marker.exists()


def test_the_unpickler_alone_resolves_no_global(tmp_path):
    # The second fence, without the opcode scan: find_class refuses before any callable exists.
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker), protocol=2)
    with pytest.raises(safe_pickle.PickleRefused, match="posix.system|os.system"):
        safe_pickle._PlainUnpickler(io.BytesIO(payload)).load()
    assert not marker.exists()


def test_sets_and_objects_are_not_plain():
    with pytest.raises(safe_pickle.PickleRefused):
        safe_pickle.loads(pickle.dumps(Path("/x"), protocol=2))
    with pytest.raises(safe_pickle.PickleRefused):
        safe_pickle.loads(pickle.dumps({1, 2}, protocol=4))


@pytest.mark.parametrize("data", [b"", b"\x80", b"\x80\x02}q\x00(X", b"not a pickle", b"\x80\x02]r\xff\xff\xff\x7f."])
def test_malformed_streams_are_trace_errors(data):
    with pytest.raises(TraceError):
        safe_pickle.loads(data)


def test_memo_index_far_beyond_use_is_refused_before_allocating():
    # LONG_BINPUT 2**31-1: the C unpickler would size its memo table to that.
    with pytest.raises(TraceError, match="memo index"):
        safe_pickle.loads(b"\x80\x02]r\xff\xff\xff\x7f.")


def test_modules_import_no_torch():
    code = ("import sys, moedoctor.trace.safe_pickle, moedoctor.trace.flight_recorder; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
