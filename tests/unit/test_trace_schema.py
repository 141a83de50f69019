"""The trace schema (``moedoctor/trace/schema.py``) is the format's one definition: what the writers,
the reader, the factory, the scanners and the docs derive from it must agree with it."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from event_factory import TraceBuilder, encode_trace, site, world
from moedoctor.events import CollectiveEvent, Phase
from moedoctor.trace import schema

REPO = Path(__file__).resolve().parents[2]


#: A value of each simple type, for optional keys added later.
SAMPLE = {schema.STR: "x", schema.INT: 1, schema.OPT_INT: 1, schema.COUNT: 1}


def every_key_event() -> CollectiveEvent:
    """A collective with every optional key of the record set (but ``n``, which the typed record
    does not keep)."""
    event = CollectiveEvent(
        rank=0, event_id=7, time=1000.25, group=world(2), seq=3, op="send", raw_op="c10d::send",
        in_shapes=((4, 2), (3,)), out_shapes=(), dtypes=("bfloat16",), reduce_op="sum", async_op=True,
        thread='worker "7"', call_site=site(), phase=Phase.BACKWARD, step=2, module="layers.0.experts",
        peer=1, p2p_seq=5, root=0, in_splits=(1, 3), out_splits=(2, 2))
    unset = {k.name: SAMPLE[k.type] for k in schema.COLLECTIVE.keys
             if hasattr(event, k.name) and getattr(event, k.name) is None}
    return dataclasses.replace(event, **unset)


def test_every_collective_field_of_the_typed_record_is_in_the_format():
    in_record = {k.name for k in schema.COLLECTIVE.keys} - {"splits", "counts"} | {"in_splits", "out_splits"}
    kept_elsewhere = {"rank", "completed"}  # the header's rank; completion from `d` records
    assert {f.name for f in dataclasses.fields(CollectiveEvent)} - kept_elsewhere == in_record


def test_writer_reader_and_factory_round_trip_every_key():
    event = every_key_event()
    rec = schema.record_of(event, group_id=0, site_id=4)
    assert list(rec) == ["k"] + [k.key for k in schema.COLLECTIVE.keys if k.key != "n"]
    assert schema.problems(rec) == []
    text = {key: json.dumps(value, separators=(",", ":")) for key, value in rec.items()}
    line = schema.encode_collective(*(text[k.key] for k in schema.COLLECTIVE.keys if k.required),
                                    **{k.name: text[k.key] for k in schema.COLLECTIVE.keys
                                       if not k.required and k.key in text})
    assert line == json.dumps(rec, separators=(",", ":")) + "\n"
    decoded = schema.decode_collective(json.loads(line), 0, {0: event.group}, {4: event.call_site})
    assert decoded == event


def test_optional_keys_left_out_are_none_and_unknown_keys_are_ignored():
    optional = {k.name: None for k in schema.COLLECTIVE.keys if not k.required and k.name not in ("splits", "counts")}
    event = dataclasses.replace(every_key_event(), **optional, in_splits=None, out_splits=None, op="all_reduce",
                                raw_op="c10d::allreduce_")
    rec = schema.record_of(event, 0, 4)
    assert not {k.key for k in schema.COLLECTIVE.keys if not k.required} & rec.keys()
    rec["zz"] = "a key of a later writer"
    assert schema.decode_collective(rec, 0, {0: event.group}, {4: event.call_site}) == event


@pytest.mark.parametrize("change, error", [
    (lambda r: r.pop("op"), KeyError), (lambda r: r.update(seq="3"), TypeError),
    (lambda r: r.update({"in": [[-1]]}), TypeError), (lambda r: r.update({"async": 1}), TypeError),
    (lambda r: r.update(ph="sideways"), ValueError), (lambda r: r.update(g=9), KeyError),
    (lambda r: r.update(sp=[[1]]), TypeError), (lambda r: r.update(th="x" * 5000), TypeError),
])
def test_a_damaged_record_raises(change, error):
    event = every_key_event()
    rec = schema.record_of(event, 0, 4)
    change(rec)
    with pytest.raises(error):
        schema.decode_collective(rec, 0, {0: event.group}, {4: event.call_site})


def test_problems_names_order_missing_unknown_and_types():
    rec = schema.record_of(every_key_event(), 0, 4)
    swapped = {"k": "c", "g": rec["g"], "i": rec["i"], **{k: v for k, v in rec.items() if k not in ("k", "g", "i")}}
    assert any("order" in p for p in schema.problems(swapped))
    assert schema.problems({**rec, "what": 1}) == ["c: unknown key 'what'"]
    assert schema.problems({k: v for k, v in rec.items() if k != "th"}) == ["c: missing key 'th'"]
    assert "not a bool" in schema.problems({**rec, "async": "yes"})[0]
    assert schema.problems({"k": "zz"}) == ["unknown record kind 'zz'"]


def test_factory_traces_follow_the_schema():
    b = TraceBuilder(0)
    b.coll("all_reduce", reduce_op="max")
    b.coll("all_to_all", splits=((1, 2), (2, 1)), root=None, module="layers.0")
    b.coll("broadcast", root=1)
    b.p2p("send", 1)
    b.ev("grad_norm", norm=1.0)
    lines = [json.loads(line) for line in encode_trace(b).splitlines()]
    assert all(schema.problems(rec) == [] for rec in lines), [schema.problems(rec) for rec in lines]


def test_scanner_patterns_follow_the_key_order():
    p2p = schema.record_of(every_key_event(), 0, 4)
    plain = {k: v for k, v in p2p.items() if k not in ("pseq", "peer")}
    for rec, pseq in ((p2p, b"5"), (plain, None)):
        line = json.dumps(rec, separators=(",", ":")).encode()
        m = re.match(schema.line_pattern("dt", ("g", "pseq", "op", "in", "dt")), line)
        assert m is not None and m.groups() == (b"0", pseq, rec["op"].encode(), b"[[4,2],[3]]", b'["bfloat16"]')
        m = re.match(schema.line_pattern("th", ("i", "th"), strings=("th",)), line)
        assert m is not None and json.loads(m.group(2)) == 'worker "7"'
    m = re.match(schema.line_pattern("peer", ("g", "pseq", "peer"), strings=("th", "mod")),
                 json.dumps(p2p, separators=(",", ":")).encode())
    assert m is not None and m.groups() == (b"0", b"5", b"1")


def test_docs_tables_are_the_schemas():
    doc = (REPO / "docs" / "trace-format.md").read_text()
    assert "<!-- schema:c -->" in doc and "<!-- schema:header -->" in doc
    assert schema.sync_docs(doc) == doc, "run: python -m moedoctor.trace.schema docs/trace-format.md"


def test_definitions_are_type_checked():
    assert schema.decode(schema.GROUP, {"k": "g", "id": 0, "name": "0", "ranks": [0, 1]})["ranks"] == [0, 1]
    with pytest.raises(TypeError):
        schema.decode(schema.GROUP, {"k": "g", "id": 0, "name": "0", "ranks": [0, -1]})
    with pytest.raises(KeyError):
        schema.decode(schema.SITE, {"k": "s", "id": 0, "file": "a.py", "fn": "f"})
