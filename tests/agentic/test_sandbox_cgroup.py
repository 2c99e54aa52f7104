"""The cgroup layout logic on fake hierarchies: v2 first, v1 next, a clear error naming each one tried.

This machine binds memory, pids and cpu to cgroup v1, so the v2 path runs here against a directory shaped
like a cgroup2 mount (the real v1 path runs in every sandbox test)."""

from __future__ import annotations

import pytest

from openk2.agentic import sandbox_cgroup
from openk2.agentic.sandbox_cgroup import CgroupUnavailableError, RunCgroup, plan


def _fake(monkeypatch, mounts, own_v2="/", own_v1=None):
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: mounts)
    monkeypatch.setattr(sandbox_cgroup, "_own_paths", lambda: (own_v2, own_v1 or {}))
    monkeypatch.delenv(sandbox_cgroup.ENV_PARENT, raising=False)


def test_v2_root_gets_a_base_with_controllers_and_a_run_with_every_limit(tmp_path, monkeypatch):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    _fake(monkeypatch, [("cgroup2", str(tmp_path), set())])
    base = tmp_path / "openk2-sandbox"
    base.mkdir()
    (base / "cgroup.subtree_control").write_text("memory pids cpu")
    layout = plan()
    assert layout == {"version": 2, "base": str(base)}
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    run = RunCgroup.create(layout, 256 << 20, 40, 0.5, owner_pid=1)
    (leaf,) = run.dirs
    assert [(f, (base / leaf / f).read_text()) for f in ("memory.max", "pids.max", "cpu.max")] == [
        ("memory.max", str(256 << 20)), ("pids.max", "40"), ("cpu.max", "50000 100000")]
    (base / leaf / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert run.oom_kills() == 2


def test_no_usable_hierarchy_is_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "cgroup.controllers").write_text("hugetlb\n")
    _fake(monkeypatch, [("cgroup2", str(tmp_path), set())])
    with pytest.raises(CgroupUnavailableError, match=r"controllers memory, pids, cpu not available.*v1: memory not "
                                                       r"mounted; pids not mounted; cpu not mounted"):
        plan()


def test_v2_below_a_non_root_cgroup_needs_a_delegated_parent(tmp_path, monkeypatch):
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    _fake(monkeypatch, [("cgroup2", str(tmp_path), set())], own_v2="/user.slice/session-1.scope")
    with pytest.raises(CgroupUnavailableError, match="OPENK2_SANDBOX_CGROUP is unset"):
        plan()
    delegated = tmp_path / "openk2"
    delegated.mkdir()
    (delegated / "cgroup.subtree_control").write_text("memory pids cpu")
    (delegated / "openk2-sandbox").mkdir()
    (delegated / "openk2-sandbox" / "cgroup.subtree_control").write_text("memory pids cpu")
    monkeypatch.setenv(sandbox_cgroup.ENV_PARENT, str(delegated))
    assert plan() == {"version": 2, "base": str(delegated / "openk2-sandbox")}
