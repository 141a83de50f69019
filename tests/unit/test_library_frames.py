"""Which frames are the job's own: moedoctor's frames are recognised by the package's real location
(or a path into one of its modules), not by any ``/moedoctor/`` in the path: a clone of this
repository is a folder named ``moedoctor``, and its fixtures are jobs (issue 32, point 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

import moedoctor
from moedoctor.run_records import Frame, StackDump, is_library_frame

PACKAGE = Path(moedoctor.__file__).resolve().parent


@pytest.mark.parametrize(
    "path",
    [
        "/home/me/moedoctor/fixtures/skipped_optimizer_step/train.py",
        "/home/me/moedoctor/fixtures/_lib/sharded_optim.py",
        "/home/me/moedoctor/train.py",
        "/srv/jobs/moedoctor/recipes/moe.py",
    ],
)
def test_a_job_in_a_folder_named_moedoctor_is_the_jobs_own_code(path):
    assert not is_library_frame(Frame("step", path, 69))


@pytest.mark.parametrize(
    "path",
    [
        str(PACKAGE / "recorder" / "core.py"),
        str(PACKAGE / "_bootstrap" / "sitecustomize.py"),
        "/other/machine/venv/src/moedoctor/moedoctor/fixes/runtime.py",
        "/usr/lib/python3/dist-packages/moedoctor/recorder/ops.py",
    ],
)
def test_moedoctors_own_frames_are_library_frames(path):
    assert is_library_frame(Frame("hook", path, 1))


def test_the_user_frame_of_a_stack_in_a_clone_named_moedoctor():
    dump = StackDump(rank=1, pid=42)
    dump.main_thread = (
        Frame("all_reduce", "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 2800),
        Frame("step", "/home/me/moedoctor/fixtures/_lib/sharded_optim.py", 45),
        Frame("main", "/home/me/moedoctor/fixtures/skipped_optimizer_step/train.py", 69),
    )
    assert str(dump.user_frame) == "step (sharded_optim.py:45)"
