"""Choosing torch's thread count from the free cores: /proc/stat arithmetic on synthetic samples,
precedence of explicit choices, bounds, and the CLI flag."""

import subprocess
import sys

import pytest
import torch

from selfspec.model import threads
from selfspec.model.threads import apply_threads, busy_cores, choose_threads, cpu_times, running_others


def stat(*cpus: tuple[int, int]) -> str:
    """A /proc/stat text whose CPU i spent cpus[i] = (busy, idle) jiffies, busy all as user time."""
    lines = [f"cpu  {sum(b for b, _ in cpus)} 0 0 {sum(i for _, i in cpus)} 0 0 0 0 0 0"]
    lines += [f"cpu{n} {b} 0 0 {i} 0 0 0 0 0 0" for n, (b, i) in enumerate(cpus)]
    return "\n".join(lines + ["intr 12345 0 0", "ctxt 999", "btime 1700000000", "procs_running 2"])


def test_cpu_times_reads_each_cpu_and_counts_iowait_as_idle():
    text = "cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 10 1 2 100 7 1 1 3 5 0\ncpu1 0 0 0 50 0 0 0 0 0 0\nintr 1 2\n"
    # busy = user+nice+system+irq+softirq+steal; guest (col 9) is already inside user, so not added
    assert cpu_times(text) == {0: (18, 125), 1: (0, 50)}


def test_a_core_kept_busy_by_another_process_counts():
    before = cpu_times(stat((0, 0), (0, 0)))
    assert busy_cores(before, cpu_times(stat((15, 0), (1, 14))), {0, 1}) == 1  # one core 100%, one idle
    assert busy_cores(before, cpu_times(stat((15, 0), (15, 0))), {0, 1}) == 2
    assert busy_cores(before, cpu_times(stat((3, 12), (2, 13))), {0, 1}) == 0  # background noise


def test_a_process_migrating_between_cores_still_counts_as_one():
    before = cpu_times(stat((0, 0), (0, 0)))
    assert busy_cores(before, cpu_times(stat((8, 7), (8, 7))), {0, 1}) == 1  # 53% on each: one process


def test_only_the_cores_we_may_run_on_count():
    before = cpu_times(stat((0, 0), (0, 0), (0, 0)))
    after = cpu_times(stat((15, 0), (0, 15), (15, 0)))
    assert busy_cores(before, after, {1}) == 0
    assert busy_cores(before, after, {0, 1}) == 1


def test_our_own_cpu_time_is_not_someone_elses_load():
    before = cpu_times(stat((0, 0), (0, 0)))
    after = cpu_times(stat((15, 0), (1, 14)))
    assert busy_cores(before, after, {0, 1}, own_cores=1.0) == 0


def test_loadavg_fallback_leaves_out_the_reader():
    assert running_others("0.50 0.40 0.30 1/95 1234") == 0
    assert running_others("2.10 1.40 0.30 3/95 1234") == 2


def test_free_cores_are_usable_minus_busy_and_never_below_one(monkeypatch):
    def sampled(after):
        monkeypatch.setattr(threads, "_sample", lambda window_s: (stat((0, 0), (0, 0)), after, 0.0))

    monkeypatch.setattr(threads, "_affinity", lambda: {0, 1})
    sampled(stat((15, 0), (1, 14)))
    assert threads.free_cores() == (1, 2)
    sampled(stat((15, 0), (15, 0)))
    assert threads.free_cores() == (1, 2)
    sampled(stat((0, 15), (0, 15)))
    assert threads.free_cores() == (2, 2)


@pytest.fixture
def auto(monkeypatch):
    """No explicit choice in the environment; the free-core sample is what the test says."""
    for name in ("SELFSPEC_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield lambda free, usable: monkeypatch.setattr(threads, "free_cores", lambda window_s=0: (free, usable))
    torch.set_num_threads(before)


def test_auto_uses_the_free_cores(auto):
    auto(3, 4)
    assert choose_threads(None) == (3, "1 of 4 cores busy with other work")
    auto(4, 4)
    assert choose_threads(None) == (4, "4 cores free")


def test_an_explicit_request_wins_over_the_sample_and_the_environment(auto, monkeypatch):
    auto(1, 4)
    monkeypatch.setenv("SELFSPEC_THREADS", "2")
    assert choose_threads(None) == (2, "as asked")
    assert choose_threads(3) == (3, "as asked")


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_requests_are_refused(auto, monkeypatch, value):
    monkeypatch.setenv("SELFSPEC_THREADS", value)
    with pytest.raises(ValueError, match="THREADS|threads"):
        choose_threads(None)


def test_omp_num_threads_is_left_to_torch(auto, monkeypatch):
    auto(1, 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(None) == (torch.get_num_threads(), "from $OMP_NUM_THREADS")


def test_apply_sets_torch_and_speaks_only_when_it_changes_the_default(auto):
    torch.set_num_threads(2)  # torch's default on an idle 2-core machine
    auto(2, 2)
    assert apply_threads(None) is None and torch.get_num_threads() == 2
    auto(1, 2)
    assert apply_threads(None) == "1 thread (1 of 2 cores busy with other work)"
    assert torch.get_num_threads() == 1
    assert apply_threads(2) == "2 threads (as asked)" and torch.get_num_threads() == 2


def test_every_decoding_subcommand_takes_the_flag():
    for command in ("generate", "serve", "bench", "tune", "calibrate", "search"):
        out = subprocess.run([sys.executable, "-m", "selfspec.cli", command, "--help"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and "--threads" in out.stdout, command


def test_the_cli_refuses_zero_threads_before_loading():
    out = subprocess.run([sys.executable, "-m", "selfspec.cli", "generate", "hi", "--threads", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--threads must be >= 1" in out.stderr and "Traceback" not in out.stderr
