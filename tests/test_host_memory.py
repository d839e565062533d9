"""The host's memory as a process may use it (`gtp_jax.base.host`): /proc/meminfo narrowed
by the process's cgroup (container) limit, for cgroup v2 and v1 layouts."""

from __future__ import annotations

from gtp_jax.base import host

GIB = 2**30


def _meminfo(tmp_path, total_gib: int, available_gib: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {total_gib * 2**20} kB\nMemFree:        1 kB\n"
                    f"MemAvailable:   {available_gib * 2**20} kB\n")
    return str(path)


def test_meminfo_alone_when_no_cgroup_limits(tmp_path):
    meminfo = _meminfo(tmp_path, 256, 200)
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/\n0::/\n")
    args = (meminfo, str(root), str(proc))
    assert host.cgroup_memory(str(root), str(proc)) == (None, GIB)
    assert host.total_bytes(*args) == 256 * GIB
    assert host.available_bytes(*args) == 200 * GIB
    assert host.meminfo_bytes("Nonexistent", meminfo) is None
    assert host.meminfo_bytes("MemTotal", str(tmp_path / "missing")) is None


def test_a_cgroup_v2_limit_at_the_process_path_narrows_total_and_available(tmp_path):
    meminfo = _meminfo(tmp_path, 256, 200)
    folder = tmp_path / "cgroup" / "jobs" / "42"
    folder.mkdir(parents=True)
    (folder / "memory.max").write_text(f"{24 * GIB}\n")
    (folder / "memory.current").write_text(f"{4 * GIB}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/jobs/42\n")
    args = (meminfo, str(tmp_path / "cgroup"), str(proc))
    assert host.total_bytes(*args) == 24 * GIB
    assert host.available_bytes(*args) == 20 * GIB
    # Reclaimable page cache counts as available.
    (folder / "memory.stat").write_text(f"anon 1\ninactive_file {3 * GIB}\nactive_file 5\n")
    assert host.available_bytes(*args) == 23 * GIB
    (folder / "memory.max").write_text("max\n")  # no limit: meminfo's figures
    assert host.total_bytes(*args) == 256 * GIB
    assert host.available_bytes(*args) == 200 * GIB


def test_a_cgroup_v1_limit_at_the_namespace_root(tmp_path):
    meminfo = _meminfo(tmp_path, 256, 200)
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{32 * GIB}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{40 * GIB}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/outside/this/namespace\n")  # not visible here: the root
    args = (meminfo, str(root), str(proc))
    assert host.total_bytes(*args) == 32 * GIB
    assert host.available_bytes(*args) == 0  # over its limit already
    assert host.cgroup_memory(str(tmp_path / "none"), str(proc)) == (None, None)
