"""Control stage: where compute goes. Prompt selectors choose which prompts to roll out;
in-flight controllers (APRIL) decide to continue, pause or stop requests.

Selectors share one small protocol (see base.py) and are chosen by name:
`control.selector = uniform | thompson | dps`.
"""

from rollwise.stages.control.base import Selector, build_selector

__all__ = ["Selector", "build_selector"]
