"""``--config`` sections of ``metrics-after-microbatches`` and ``key-manifest-checkpoint``: what
each accepts, how it is normalized, and that a bad section names the offending key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moedoctor.errors import MoedoctorError
from moedoctor.fixes import FIXES
from moedoctor.fixes.base import FixConfigError, Target
from moedoctor.fixes.config import load_fix_config

METRICS = FIXES["metrics-after-microbatches"]
MANIFEST = FIXES["key-manifest-checkpoint"]


def test_registered_for_their_patterns() -> None:
    assert METRICS.patterns == ("inflight-metric-allreduce",)
    assert MANIFEST.patterns == ("uneven-dtensor-allgather",)
    assert {t.path for t in METRICS.targets} == {"__main__:all_reduce_metrics", "__main__:train_step"}
    assert [t.path for t in MANIFEST.targets] == ["_lib.checkpoint:preprocess_fsdp_dtensor_state_dict"]


# -- metrics-after-microbatches ---------------------------------------------------------------------

def test_metrics_no_section_uses_the_built_in_pair() -> None:
    assert METRICS.parse_config({}) == {}
    assert METRICS.all_targets({}) == METRICS.targets


def test_metrics_section_names_both_functions() -> None:
    config = METRICS.parse_config({"reduce": " mypkg.metrics:all_reduce_metrics ", "loop": "mypkg.worker:Worker.forward_backward"})
    assert config == {"reduce": "mypkg.metrics:all_reduce_metrics", "loop": "mypkg.worker:Worker.forward_backward",
                      "targets": ["mypkg.metrics:all_reduce_metrics", "mypkg.worker:Worker.forward_backward"]}
    assert Target("mypkg.worker:Worker.forward_backward", "from --config") in METRICS.all_targets(config)


@pytest.mark.parametrize(("section", "names"), [
    ({"reduce": "m:f"}, "'loop'"),
    ({"loop": "m:f"}, "'reduce'"),
    ({"reduce": "m:f", "loop": "m:g", "group": "dp"}, "'group'"),
    ({"reduce": 3, "loop": "m:g"}, "reduce"),
    ({"reduce": "m:f", "loop": "not a target"}, "loop"),
    ({"reduce": "m:f", "loop": ["m:g"]}, "loop"),
    ({"reduce": "m:f", "loop": "m:f"}, "'m:f'"),
])
def test_metrics_bad_sections_name_the_key(section: dict, names: str) -> None:
    with pytest.raises(FixConfigError) as error:
        METRICS.parse_config(section)
    assert names in error.value.message


# -- key-manifest-checkpoint ------------------------------------------------------------------------

def test_manifest_preprocess_is_one_function_or_a_list() -> None:
    assert MANIFEST.parse_config({}) == {"targets": []}
    one = MANIFEST.parse_config({"preprocess": "mypkg.ckpt:preprocess_state_dict"})
    assert one == {"targets": ["mypkg.ckpt:preprocess_state_dict"]}
    two = MANIFEST.parse_config({"preprocess": ["a.b:f", "c:Saver.prepare"]})
    assert two == {"targets": ["a.b:f", "c:Saver.prepare"]}
    assert [t.path for t in MANIFEST.all_targets(two)] == [
        "_lib.checkpoint:preprocess_fsdp_dtensor_state_dict", "a.b:f", "c:Saver.prepare"]


@pytest.mark.parametrize(("section", "names"), [
    ({"preprocesss": "a:f"}, "'preprocesss'"),
    ({"preprocess": {"fn": "a:f"}}, "preprocess"),
    ({"preprocess": ["a:f", "no-colon"]}, "preprocess[1]"),
    ({"preprocess": [7]}, "preprocess[0]"),
])
def test_manifest_bad_sections_name_the_key(section: dict, names: str) -> None:
    with pytest.raises(FixConfigError) as error:
        MANIFEST.parse_config(section)
    assert names in error.value.message


# -- through a --config file ------------------------------------------------------------------------

def test_config_file_errors_name_file_fix_and_key(tmp_path: Path) -> None:
    path = tmp_path / "fixes.yaml"
    path.write_text("metrics-after-microbatches:\n  reduce: mypkg.metrics:reduce\n")
    with pytest.raises(MoedoctorError) as error:
        load_fix_config(path, FIXES.values())
    assert str(path) in str(error.value) and "metrics-after-microbatches" in str(error.value)
    assert "'loop'" in str(error.value)


def test_config_file_good_sections(tmp_path: Path) -> None:
    path = tmp_path / "fixes.yaml"
    path.write_text("metrics-after-microbatches:\n  reduce: a.m:reduce\n  loop: a.w:step\n"
                    "key-manifest-checkpoint:\n  preprocess: a.c:prep\n")
    config = load_fix_config(path, FIXES.values())
    assert config["metrics-after-microbatches"]["loop"] == "a.w:step"
    assert config["key-manifest-checkpoint"] == {"targets": ["a.c:prep"]}


def test_gather_upfront_takes_units_kept_only(tmp_path: Path) -> None:
    path = tmp_path / "fixes.yaml"
    path.write_text("fsdp-gather-upfront:\n  units: kept\n")
    assert load_fix_config(path, FIXES.values())["fsdp-gather-upfront"] == {"units": "kept"}
    path.write_text("fsdp-gather-upfront:\n  units: all\n")
    with pytest.raises(MoedoctorError, match="units: expected 'kept'"):
        load_fix_config(path, FIXES.values())


def test_fix_modules_import_no_torch() -> None:
    code = ("import sys, moedoctor.fixes.metrics_after_microbatches, moedoctor.fixes.key_manifest_checkpoint, "
            "moedoctor.fixes.fsdp_gather_upfront; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
