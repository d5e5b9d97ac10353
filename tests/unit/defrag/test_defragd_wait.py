"""defragd waits for a GPU driver that is missing or not loaded yet instead of crash-looping its pod."""

from __future__ import annotations

import threading

import pytest

from zerolayer.runtime.defrag.cli import wait_for_gpu_source
from zerolayer.runtime.gpu.api import GpuSourceError


class Driver:
    """Fails ``failures`` times, then opens."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise GpuSourceError("NVML could not start (no NVIDIA driver or GPU?)")
        return "source"


def test_waits_until_the_driver_appears():
    driver = Driver(failures=3)
    assert wait_for_gpu_source(driver, threading.Event(), wait=True, first_s=0.001, max_s=0.002) == "source"
    assert driver.calls == 4


def test_sigterm_while_waiting_ends_without_a_source():
    stopped = threading.Event()
    stopped.set()
    driver = Driver(failures=10**6)
    assert wait_for_gpu_source(driver, stopped, wait=True, first_s=0.001) is None
    assert driver.calls == 1


def test_without_wait_the_error_is_raised():
    with pytest.raises(GpuSourceError, match="NVML could not start"):
        wait_for_gpu_source(Driver(failures=1), threading.Event(), wait=False)


def test_the_delay_doubles_up_to_the_cap():
    delays = []

    class Recording(threading.Event):
        def wait(self, timeout=None):
            delays.append(timeout)
            return len(delays) >= 5

    assert wait_for_gpu_source(Driver(failures=10), Recording(), wait=True, first_s=5, max_s=30) is None
    assert delays == [5, 10, 20, 30, 30]
