"""gpu-defragd (``zerolayer defragd``): nudge idle GPU processes of this pod, reset fragmented GPUs if allowed.

- :mod:`.policy`: the decisions (pure); :mod:`.scope`: which PIDs are "ours";
- :mod:`.daemon`: scans, actions, Events and metrics; :mod:`.cli`: the command;
- :mod:`.fragmentation`: the definition and the runtime's measure; :mod:`.release`: the
  runtime's SIGUSR1 answer.

See docs/defragd.md.
"""

from .errors import DefragError
from .fragmentation import fragmentation
from .policy import DefragPolicy, IdleTracker, Nudge, ResetDecision, ScanPlan

__all__ = ["DefragError", "DefragPolicy", "IdleTracker", "Nudge", "ResetDecision", "ScanPlan", "fragmentation"]
