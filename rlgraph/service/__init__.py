"""Training as a service (issue 23): Tinker's calls on one base model with many LoRA tenants.

- `Service` (core.py): the calls, in process; `Scheduler`: fair, ordered, exactly-once execution;
- `LocalClient` (client.py): the SDK's call names without HTTP;
- `build_app` (http.py, needs the `service` extra): the server `rlgraph serve` runs.
"""

from rlgraph.service.core import SampleParams, Service
from rlgraph.service.datums import Datum, Limits
from rlgraph.service.errors import CallError
from rlgraph.service.scheduler import Scheduler

__all__ = ["CallError", "Datum", "Limits", "SampleParams", "Scheduler", "Service"]
