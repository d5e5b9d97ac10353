"""The micro-scheduler inside the engine process: admission, ordering, quotas, deadlines, shedding.

The server codes against :mod:`.api`; :class:`MicroScheduler` implements it from the plugins
in :mod:`.plugins`. See docs/scheduler.md.
"""

from .api import (Admission, Preemption, Pressure, Reservation, RunningStream, Scheduler, TenantPolicy,
                  Ticket)
from .config import SchedulerConfig, SchedulerConfigError, SchedulerError, Watermarks
from .core import MicroScheduler
from .pressure import PressureGate, pressure_from_readings

__all__ = [
    "Admission", "MicroScheduler", "Preemption", "Pressure", "PressureGate", "Reservation", "RunningStream",
    "Scheduler", "SchedulerConfig", "SchedulerConfigError", "SchedulerError", "TenantPolicy", "Ticket",
    "Watermarks", "pressure_from_readings",
]
