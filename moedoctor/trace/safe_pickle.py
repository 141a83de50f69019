"""Load a pickle that can only build plain data: never import, call or construct anything.

Flight Recorder dumps are pickles of dicts, lists, tuples, strings and numbers, and a pickle found on
disk may have been crafted: ``pickle.load`` on it runs whatever callable it names (``os.system``
through ``__reduce__``). Two independent fences keep that from happening:

1. before anything is built, every opcode of the stream is checked against an allow-list of opcodes
   that push plain values or assemble containers (no ``GLOBAL``/``STACK_GLOBAL``/``INST``/``OBJ``/
   ``REDUCE``/``BUILD``/``NEWOBJ``, no persistent ids, no extension codes, no out-of-band buffers);
2. the unpickler that then builds the data resolves no global at all (``find_class`` and
   ``persistent_load`` refuse), so even an opcode the scan missed could not reach a callable.

Real dumps (torch 2.13, pickle protocol 2) use only opcodes of the allow-list; no global is needed.
Admitted types: dict, list, tuple, str, bytes, int, float, bool and None. No torch here.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from pathlib import Path

from moedoctor.trace.reader import TraceError

#: Opcodes that push a plain value, assemble a container or manage the stack and memo.
ALLOWED_OPCODES = frozenset(
    {
        "PROTO",
        "FRAME",
        "STOP",
        "MARK",
        "POP",
        "POP_MARK",
        "DUP",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "INT",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG",
        "LONG1",
        "LONG4",
        "FLOAT",
        "BINFLOAT",
        "STRING",
        "BINSTRING",
        "SHORT_BINSTRING",
        "UNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "EMPTY_LIST",
        "APPEND",
        "APPENDS",
        "LIST",
        "EMPTY_TUPLE",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "EMPTY_DICT",
        "DICT",
        "SETITEM",
        "SETITEMS",
        "PUT",
        "BINPUT",
        "LONG_BINPUT",
        "MEMOIZE",
        "GET",
        "BINGET",
        "LONG_BINGET",
    }
)

_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})

#: Why the dangerous opcodes are refused, for the error message.
_REFUSED_WHY = {
    "GLOBAL": "imports a global",
    "STACK_GLOBAL": "imports a global",
    "INST": "instantiates a class",
    "OBJ": "instantiates a class",
    "REDUCE": "calls a function",
    "BUILD": "sets object state",
    "NEWOBJ": "instantiates a class",
    "NEWOBJ_EX": "instantiates a class",
    "PERSID": "loads a persistent id",
    "BINPERSID": "loads a persistent id",
    "EXT1": "imports a registered extension",
    "EXT2": "imports a registered extension",
    "EXT4": "imports a registered extension",
}

#: Dumps larger than this are refused rather than loaded (a full 2000-entry dump is a few MB); the
#: same cap applies to JSON dumps (``flight_recorder``).
MAX_BYTES = 256 << 20


class PickleRefused(TraceError):
    """The pickle asks for something other than plain data; nothing in it was executed."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise PickleRefused(f"refused to resolve the global {module}.{name}")

    def persistent_load(self, pid):
        raise PickleRefused("refused a persistent id")


#: Opcodes that build or push nothing new (stack and memo bookkeeping, containers filled in place).
_NO_VALUE = frozenset({"PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})


def check_opcodes(data: bytes, source: str = "pickle", max_values: int | None = None) -> None:
    """Raise ``PickleRefused`` at the first opcode outside ``ALLOWED_OPCODES``, ``TraceError`` when
    the stream is not a well-formed pickle, or when it would push more than ``max_values`` values
    (each a slot in a container and, but for a memo reference, an object). Builds nothing."""
    memo_size = values = 0
    try:
        for opcode, arg, pos in pickletools.genops(io.BytesIO(data)):
            name = opcode.name
            if name not in _NO_VALUE:
                values += 1
                if max_values is not None and values > max_values:
                    raise TraceError(
                        f"{source}: builds more than {max_values} values (at byte {pos}): larger than a Flight "
                        "Recorder dump can be; refused before loading"
                    )
            if name in _MEMO_PUTS:
                # Picklers number memo slots 0, 1, 2, ... in order. A far larger index (a flipped
                # byte) would make the C unpickler allocate and clear a memo table of that size.
                if name != "MEMOIZE" and not 0 <= arg <= memo_size:
                    raise TraceError(
                        f"{source}: corrupt pickle (memo index {arg} at byte {pos}, {memo_size} slots used so far)"
                    )
                memo_size += 1
            if name not in ALLOWED_OPCODES:
                why = _REFUSED_WHY.get(opcode.name, "is outside the plain-data allow-list")
                shown = f" {arg!r}" if isinstance(arg, str) and len(arg) < 80 else ""
                raise PickleRefused(
                    f"{source}: refused to load: opcode {opcode.name}{shown} at byte {pos} "
                    f"{why}; Flight Recorder dumps hold plain data only (nothing was executed)"
                )
    except TraceError:
        raise
    except Exception as e:  # pickletools raises ValueError and friends on any malformed stream
        raise TraceError(f"{source}: not a readable pickle ({type(e).__name__}: {e})") from None


def loads(data: bytes, source: str = "pickle", max_values: int | None = None) -> object:
    """Plain data from a pickle, or ``TraceError`` (``PickleRefused`` for anything not plain; more
    than ``max_values`` values pushed, ``check_opcodes``)."""
    if len(data) > MAX_BYTES:
        raise TraceError(f"{source}: {len(data)} bytes is larger than a Flight Recorder dump can be")
    check_opcodes(data, source, max_values)
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except PickleRefused as e:
        raise PickleRefused(f"{source}: {e}; nothing was executed") from None
    except Exception as e:  # truncated or corrupt after a well-formed opcode scan (memo misuse)
        raise TraceError(f"{source}: not a readable pickle ({type(e).__name__}: {e})") from None


def load(path: Path | str) -> object:
    """``loads`` of a file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise TraceError(f"{path}: {size} bytes is larger than a Flight Recorder dump can be")
        data = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    return loads(data, str(path))
