"""Control stage: where compute goes (stage.py puts the parts together).

- Selectors choose which prompts to roll out (base.py: the protocol; `control.selector =
  uniform | thompson | dps | package.module:factory`).
- Refill decides how many generation rounds a step takes (DAPO dynamic sampling).
- In-flight controllers decide to continue, pause, abort or fork requests while they generate,
  over any generator (inflight.py: the protocol; `control.inflight = none | april |
  package.module:factory`).
"""

from rollwise.stages.control.base import Selector, build_selector
from rollwise.stages.control.inflight import Decision, InflightController, build_inflight

__all__ = ["Decision", "InflightController", "Selector", "build_selector", "build_inflight"]
