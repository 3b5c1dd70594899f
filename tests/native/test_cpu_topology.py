"""Thread plan from a fake sysfs CPU tree: big cores on big.LITTLE boards, every allowed CPU otherwise."""
import os

from appliance.native.cpu_topology import big_cores, parse_cpu_list, thread_plan, threads_plan_for


def _tree(root, online="0-7", capacity=None, max_freq=None):
    os.makedirs(root, exist_ok=True)
    if online is not None:
        (root / "online").write_text(online + "\n")
    n = len(capacity or max_freq or [0] * 8)
    for c in range(n):
        d = root / f"cpu{c}"
        (d / "cpufreq").mkdir(parents=True, exist_ok=True)
        if capacity:
            (d / "cpu_capacity").write_text(f"{capacity[c]}\n")
        if max_freq:
            (d / "cpufreq" / "cpuinfo_max_freq").write_text(f"{max_freq[c]}\n")
    return str(root)


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,5,7-8\n") == [0, 1, 2, 3, 5, 7, 8]
    assert parse_cpu_list("0") == [0]


def test_rk3588_capacity_picks_the_a76_cores(tmp_path):
    root = _tree(tmp_path / "cpu", capacity=[414] * 4 + [1024] * 4,
                 max_freq=[1800000] * 4 + [2352000, 2352000, 2304000, 2304000])
    assert big_cores(root) == ([4, 5, 6, 7], True)
    assert thread_plan(root, allowed=set(range(8))) == (4, [4, 5, 6, 7])


def test_max_freq_is_the_fallback(tmp_path):
    root = _tree(tmp_path / "cpu", max_freq=[1800000] * 4 + [2400000] * 2 + [2256000] * 2)
    assert big_cores(root) == ([4, 5], True)


def test_uniform_machine_uses_every_allowed_cpu_unpinned(tmp_path):
    root = _tree(tmp_path / "cpu", online="0-3", capacity=[1024] * 4)
    assert big_cores(root) == ([0, 1, 2, 3], False)
    assert thread_plan(root, allowed={1, 2}) == (2, None)


def test_offline_and_disallowed_cores_are_left_out(tmp_path):
    root = _tree(tmp_path / "cpu", online="0-5,7", capacity=[414] * 4 + [1024] * 4)
    assert thread_plan(root, allowed=set(range(8))) == (3, [4, 5, 7])
    assert thread_plan(root, allowed={0, 1, 5, 6}) == (1, [5])


def test_no_sysfs_falls_back_to_the_affinity_mask(tmp_path):
    assert thread_plan(str(tmp_path / "missing"), allowed={0, 1, 2}) == (3, None)


def test_explicit_thread_counts_take_big_cores_first(tmp_path):
    root = _tree(tmp_path / "cpu", capacity=[414] * 4 + [1024] * 4)
    every = set(range(8))
    assert threads_plan_for(None, root, every) == (4, [4, 5, 6, 7])
    assert threads_plan_for(2, root, every) == (2, [4, 5])
    assert threads_plan_for(6, root, every) == (6, [4, 5, 6, 7, 0, 1])
    uniform = _tree(tmp_path / "u", online="0-3", capacity=[1024] * 4)
    assert threads_plan_for(3, uniform, {0, 1, 2, 3}) == (3, None)
