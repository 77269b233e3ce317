"""pdserve.launch.cluster.new_run_dir: a run folder given again starts a new launch without the previous launch's
shared membership (a router that found it took the old workers over its own and never became healthy)."""

from __future__ import annotations

import json

from pdserve.launch.cluster import new_run_dir
from pdserve.launch.config import LauncherConfig
from pdserve.launch.plan import MEMBERSHIP_FILE


def test_a_reused_run_folder_drops_the_last_launch_s_membership_and_keeps_its_logs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    stale = {"workers": {"http://127.0.0.1:16839": {"roles": ["prefill"]}}}
    (run / MEMBERSHIP_FILE).write_text(json.dumps(stale))
    (run / "router.log").write_text("the last launch's log\n")
    assert new_run_dir(LauncherConfig(run_dir=str(run))) == run.resolve()
    assert not (run / MEMBERSHIP_FILE).exists()
    assert (run / "router.log").read_text() == "the last launch's log\n"


def test_a_new_run_folder_is_created(tmp_path):
    run = tmp_path / "a" / "b"
    assert new_run_dir(LauncherConfig(run_dir=str(run))).is_dir()
