"""The kernel thread policy (colibri/threads.py): decisions from synthetic CPU readings, explicit
threads winning, cgroup quotas, the per-thread numba setting, and one real check against a busy
process started here."""
import os
import subprocess
import sys
import threading
import time

import pytest

from colibri import threads as th
from colibri.threads import CpuReading, ThreadPolicy, decide, others_busy


class FakeMachine:
    """A clock and /proc readings: `others` cores busy elsewhere, `mine` cores of our own."""

    def __init__(self, others: float = 0.0, mine: float = 0.0):
        self.t, self.busy, self.cpu = 100.0, 0.0, 0.0
        self.others, self.mine = others, mine
        self.reads, self.slept = 0, []

    def advance(self, dt: float) -> None:
        self.t += dt
        self.busy += (self.others + self.mine) * dt
        self.cpu += self.mine * dt

    def read(self) -> CpuReading:
        self.reads += 1
        return CpuReading(self.t, self.busy, self.cpu)

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.advance(s)

    def policy(self, cores: int = 2, **kw) -> ThreadPolicy:
        return ThreadPolicy(cores=cores, pool=cores, read=self.read, clock=lambda: self.t, sleep=self.sleep, **kw)


# ----------------------------------------------------------------------------- pure decisions

@pytest.mark.parametrize("cores, others, want", [
    (2, 0.0, 2), (2, 0.3, 2),   # idle, or a shell and tick noise: every core
    (2, 0.6, 1), (2, 1.0, 1),   # one busy process (0.6: it shares the cores with our two threads)
    (2, 2.0, 1), (1, 0.0, 1),   # never fewer than one
    (16, 3.5, 12), (16, 0.0, 16),
])
def test_decide_leaves_the_busy_cores(cores, others, want):
    assert decide(cores, others) == want


def test_others_exclude_our_own_cpu_time():
    a, b = CpuReading(0.0, 10.0, 5.0), CpuReading(0.5, 11.0, 5.75)
    assert others_busy(a, b) == pytest.approx(0.5)   # 1 s busy, 0.75 s ours, over 0.5 s
    assert others_busy(a, CpuReading(0.5, 10.5, 5.6)) == 0.0  # tick rounding below zero: clamped
    assert others_busy(a, a) == 0.0


def test_policy_follows_a_busy_process_in_and_out():
    m = FakeMachine(mine=2.0)  # our two kernel threads busy
    p = m.policy()
    m.advance(0.6)
    assert p.choose() == 2 and m.slept == []  # the window since construction: no probe needed
    m.others = 1.0
    m.advance(0.6)
    assert p.choose() == 1 and p.others == pytest.approx(1.0)
    m.others = 0.0
    m.advance(0.6)
    assert p.choose() == 2


def test_decisions_are_rate_limited_without_reading():
    m = FakeMachine()
    p = m.policy()
    m.advance(1.0)
    p.choose()
    reads = m.reads
    m.others = 2.0
    for _ in range(10):  # ten tokens inside one window: neither a reading nor a change
        m.advance(0.01)
        assert p.choose() == 2
    assert m.reads == reads
    m.advance(0.5)
    assert p.choose() == 1


def test_a_stale_reading_is_replaced_by_a_short_probe():
    m = FakeMachine(others=1.0)
    p = m.policy()
    m.others = 0.0
    m.advance(3600.0)  # an idle hour: its average says nothing about now
    m.others = 1.0
    assert p.choose() == 1
    assert m.slept == [th.PROBE_S]


def test_a_too_short_window_is_topped_up():
    m = FakeMachine(others=1.0)
    p = m.policy()
    m.advance(0.01)
    assert p.choose() == 1
    assert m.slept == [pytest.approx(th.PROBE_S - 0.01)]


def test_explicit_threads_win_and_never_read():
    def boom():
        raise AssertionError("an explicit thread count must not read /proc")

    busy = ThreadPolicy(2, cores=2, pool=2, read=boom)
    assert busy.fixed and busy.choose() == 2
    assert ThreadPolicy(1, cores=2, pool=2, read=boom).choose() == 1
    assert ThreadPolicy(8, cores=2, pool=2, read=boom).choose() == 2  # at most numba's pool
    assert ThreadPolicy(0, cores=2, pool=2, read=boom).choose() == 1
    assert ThreadPolicy(cores=1, pool=2, read=boom).choose() == 1  # one core: nothing to decide


# ----------------------------------------------------------------------------- the machine

def test_cgroup_quota_is_the_tightest_on_the_path(tmp_path, monkeypatch):
    monkeypatch.setattr(th, "_cgroup_paths", lambda: ["/a/b"])
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert th.cgroup_quota_cores(tmp_path) is None
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    assert th.cgroup_quota_cores(tmp_path) is None
    (tmp_path / "a" / "cpu.max").write_text("150000 100000\n")  # the parent's limit binds too
    assert th.cgroup_quota_cores(tmp_path) == 1.5
    v1 = tmp_path / "cpu" / "a" / "b"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert th.cgroup_quota_cores(tmp_path) == 0.5


def test_usable_cores_rounds_a_quota_down(monkeypatch):
    monkeypatch.setattr(th.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(th, "cgroup_quota_cores", lambda: None)
    assert th.usable_cores() == 4
    monkeypatch.setattr(th, "cgroup_quota_cores", lambda: 1.5)
    assert th.usable_cores() == 1
    monkeypatch.setattr(th, "cgroup_quota_cores", lambda: 0.2)
    assert th.usable_cores() == 1


def test_read_cpu_counts_our_own_time():
    a = th.read_cpu()
    t = time.process_time()
    while time.process_time() - t < 0.05:
        pass
    b = th.read_cpu()
    assert b.t > a.t and b.mine - a.mine >= 0.05 and b.busy >= a.busy


def test_apply_sets_the_calling_threads_count():
    """numba keeps the count per thread: a count set where the engine was loaded does not reach
    the server's scheduler thread, so apply() runs in the thread that runs the kernels."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba runs one thread here")
    seen, mine = [], numba.get_num_threads()

    def worker():
        seen.append(numba.get_num_threads())
        ThreadPolicy(1).apply()
        seen.append(numba.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [numba.config.NUMBA_NUM_THREADS, 1]
    assert numba.get_num_threads() == mine  # this thread's count untouched


# ----------------------------------------------------------------------------- for real

def _decide_over(seconds: float) -> ThreadPolicy:
    p = ThreadPolicy(window_s=seconds)
    time.sleep(seconds)
    p.choose()
    return p


@pytest.mark.alone  # the idle half needs the other worker quiet
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or th.usable_cores() < 2, reason="needs 2 usable cores")
def test_a_busy_process_takes_a_thread_and_an_idle_machine_gets_them_all():
    cores = min(th.usable_cores(), th.pool_size())
    if cores < 2:
        pytest.skip("numba runs one thread here")
    # The busy process ends by itself after 10 s even if this test dies; killed in finally.
    spin = "import time\nt = time.time()\nwhile time.time() - t < 10: pass"
    hog = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # running before the window opens
        busy = [_decide_over(0.5) for _ in range(2)]  # a second try against a scheduling blip
        assert min(p.threads for p in busy) < cores, [p.others for p in busy]
    finally:
        hog.kill()
        hog.wait()
    idle = []
    for _ in range(3):  # other tests' processes may still be ending
        idle.append(_decide_over(0.5))
        if idle[-1].threads == cores:
            break
    else:
        others = [p.others for p in idle]
        if min(others) >= 0.6:  # someone else's process keeps a core busy: nothing to check here
            pytest.skip(f"the machine is busy elsewhere ({others} cores)")
        pytest.fail(f"an idle machine got {[p.threads for p in idle]} threads, others {others}")


def test_run_apart_returns_and_raises_in_the_caller():
    caller = threading.get_ident()
    assert th.run_apart(lambda x, y=0: (x + y, threading.get_ident() != caller), 1, y=2) == (3, True)
    with pytest.raises(ValueError, match="boom"):
        th.run_apart(lambda: (_ for _ in ()).throw(ValueError("boom")))
