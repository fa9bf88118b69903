"""workbench: the notebook session and dashboards around runner_core (see DESIGN.md).

`Session.current()` is the kernel's long-lived session; `session.dashboard()` (Panel) and
`session.widgets()` (ipywidgets) are views over it; `workbench.charts` draws its metrics.
"""

from workbench.handles import GenerationError, NoModelError, RequestHandle, SessionBusyError, SessionError
from workbench.loaded_models import ModelEntry
from workbench.session import Session

__all__ = ["GenerationError", "ModelEntry", "NoModelError", "RequestHandle", "Session", "SessionBusyError",
           "SessionError"]
