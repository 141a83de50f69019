"""``moedoctor.trace.op_names``: every spelling of a collective that a backend, a torch version or an
API produces comes out as one canonical name, and the recorder, the Flight Recorder reader and the
fixes use that one table."""

from __future__ import annotations

import pytest

from moedoctor.events import COLLECTIVE_OPS, P2P_OPS
from moedoctor.trace import op_names
from moedoctor.trace.op_names import canonical_op

FORMS = {
    "all_gather": [
        "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather_tensor",
        "c10d::allgather_", "c10d::_allgather_base_", "_c10d_functional::all_gather_into_tensor",
        "_c10d_functional.all_gather_into_tensor.default", "all_gather_into_tensor_out", "nccl:all_gather",
        "nccl:_allgather_base", "nccl:all_gather_into_tensor", "gloo:allgather", "nccl:ALLGATHER",
    ],
    "all_gather_coalesced": [
        "all_gather_coalesced", "all_gather_into_tensor_coalesced", "c10d::allgather_coalesced_",
        "c10d::allgather_into_tensor_coalesced_", "nccl:allgather_into_tensor_coalesced",
    ],
    "reduce_scatter": [
        "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
        "c10d::reduce_scatter_", "c10d::_reduce_scatter_base_", "_c10d_functional::reduce_scatter_tensor",
        "reduce_scatter_tensor_out", "nccl:_reduce_scatter_base", "nccl:reduce_scatter_tensor",
    ],
    "reduce_scatter_coalesced": [
        "reduce_scatter_tensor_coalesced", "c10d::reduce_scatter_tensor_coalesced_",
        "nccl:reduce_scatter_tensor_coalesced",
    ],
    "all_reduce": ["all_reduce", "c10d::allreduce_", "_c10d_functional::all_reduce_", "nccl:allreduce",
                   "gloo:all_reduce"],
    "all_reduce_coalesced": ["all_reduce_coalesced", "c10d::allreduce_coalesced_", "nccl:allreduce_coalesced"],
    "all_to_all": ["all_to_all", "all_to_all_single", "c10d::alltoall_base_", "c10d::alltoall_",
                   "nccl:all_to_all_v_single"],
    "broadcast": ["broadcast", "c10d::broadcast_", "_broadcast_coalesced", "nccl:_broadcast_oop", "gloo:broadcast"],
    "barrier": ["barrier", "c10d::barrier", "nccl:all_reduce_barrier"],
    "send": ["send", "isend", "c10d::send", "nccl:send 0->1"],
    "recv": ["recv", "irecv", "c10d::recv_", "c10d::recv_any_source_", "nccl:recv 1<-0", "gloo:recvAnySource"],
}


@pytest.mark.parametrize("canonical, spelling", [(c, s) for c, forms in FORMS.items() for s in forms])
def test_every_spelling_has_one_canonical_name(canonical, spelling):
    assert canonical_op(spelling) == canonical


@pytest.mark.parametrize("name", ["coalesced", "nccl:coalesced", "all_gather_object", "", "matmul"])
def test_what_is_not_one_collective_has_none(name):
    assert canonical_op(name) is None


def test_the_tables_agree_and_map_into_the_vocabulary():
    tables = [op_names.C10D_OPS, op_names.FUNCTIONAL_OPS, op_names.PROFILING_NAMES, op_names.PYTHON_OPS]
    seen: dict[str, str] = {}
    for table in tables:
        for name, canonical in table.items():
            assert canonical in COLLECTIVE_OPS | P2P_OPS, (name, canonical)
            assert seen.setdefault(name, canonical) == canonical, f"{name}: {seen[name]} or {canonical}"


def test_the_recorder_and_the_flight_recorder_reader_use_this_table():
    from moedoctor.recorder import ops
    from moedoctor.trace.flight_recorder import normalize_op

    assert ops.C10D_OPS is op_names.C10D_OPS and ops.FUNCTIONAL_OPS is op_names.FUNCTIONAL_OPS
    assert {s.op for s in ops.all_specs()} <= COLLECTIVE_OPS | P2P_OPS
    for base, canonical in op_names.PROFILING_NAMES.items():
        assert normalize_op(f"nccl:{base}")[0] == canonical


def test_a_trace_record_with_a_raw_op_name_reads_as_the_canonical_op():
    from moedoctor.events import CollectiveEvent, Group, Phase
    from moedoctor.trace import schema

    group = Group("0", "default_pg", (0, 1))
    event = CollectiveEvent(rank=0, event_id=1, time=1.0, group=group, seq=1, op="_allgather_base_",
                            raw_op="c10d::_allgather_base_", in_shapes=((4,),), out_shapes=((8,),),
                            dtypes=("float32",), reduce_op=None, async_op=False, thread="MainThread",
                            call_site=None, phase=Phase.FORWARD, step=0)
    rec = schema.record_of(event, group_id=0, site_id=None)
    assert schema.decode_collective(rec, 0, {0: group}, {}).op == "all_gather"


def test_the_analysis_fast_scan_leaves_a_trace_with_raw_op_names_to_the_exact_load(tmp_path):
    """The large-run scan compares op names as written: a trace spelling one otherwise (a raw
    dispatcher name) goes to the exact load, which reads it as its canonical op."""
    from event_factory import TraceBuilder, write_traces

    from moedoctor.analysis.loading.scan import scan_rank

    plain, raw = TraceBuilder(0, 2), TraceBuilder(1, 2)
    plain.coll("all_gather", (4,)).coll("all_reduce", (4,))
    raw.coll("_allgather_base_", (4,)).coll("all_reduce", (4,))
    folder = write_traces(tmp_path, plain, raw)
    assert scan_rank(str(folder / "rank-00000.jsonl")).fallback is None
    assert "_allgather_base_" in (scan_rank(str(folder / "rank-00001.jsonl")).fallback or "")
