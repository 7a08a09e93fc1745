"""Item cgroups on a cgroup v2 hierarchy (the development machines have v1, where the integration
tests run; this checks the v2 path against a directory laid out as the kernel's file system is)."""

import pytest

from reward_service.builtin import cgroups


def fake_v2(root, procs="101\n102\n"):
    root.mkdir(exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    (root / "cgroup.subtree_control").write_text("\n")
    (root / "cgroup.procs").write_text(procs)


def test_v2_moves_its_own_processes_to_a_leaf_and_limits_each_item(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "MOUNTS", tmp_path)
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {"": "/"})  # the root of a private cgroup namespace
    fake_v2(tmp_path)
    cg = cgroups.Cgroups()
    assert cg.version == 2
    item = cg.make(memory_mb=256, max_procs=16)
    assert (tmp_path / "service" / "cgroup.procs").read_text() == "102"  # each pid written in turn
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory +pids"
    (d,) = item.dirs
    assert d.parent == tmp_path and d.name.startswith("relay-item-")
    assert (d / "memory.max").read_text() == str(256 << 20) and (d / "pids.max").read_text() == "16"
    assert item.procs == [str(d / "cgroup.procs")]


def test_v2_never_reorganises_a_cgroup_that_is_not_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "MOUNTS", tmp_path)
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {"": "/user.slice/session-1.scope"})
    fake_v2(tmp_path)
    fake_v2(tmp_path / "user.slice")
    fake_v2(tmp_path / "user.slice" / "session-1.scope")
    with pytest.raises(cgroups.CgroupError, match="not the root of a private cgroup namespace"):
        cgroups.Cgroups().make(256, 16)
    assert not (tmp_path / "user.slice" / "session-1.scope" / "service").exists()
    # named by the operator (a delegated cgroup), it is used
    delegated = tmp_path / "relay.service"
    fake_v2(delegated, procs="")
    item = cgroups.Cgroups(str(delegated)).make(128, 8)
    assert item.dirs[0].parent == delegated and (delegated / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_no_memory_and_pids_controllers_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "MOUNTS", tmp_path)
    with pytest.raises(cgroups.CgroupError, match="memory and pids"):
        cgroups.Cgroups()
