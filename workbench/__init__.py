"""workbench: the notebook session and dashboards around runner_core (docs/workbench.md).

`Session.current()` is the kernel's long-lived session; `SessionDashboard(session)` (Panel) and
`SessionWidgets(session)` (ipywidgets) are views over it; `workbench.views.charts` draws its metrics.
The views are imported on first use, so `import workbench` loads no UI package.
"""

from workbench.runtime.handles import GenerationError, NoModelError, RequestHandle, SessionBusyError, SessionError
from workbench.runtime.loaded_models import ModelEntry
from workbench.session import Session

__all__ = ["GenerationError", "ModelEntry", "NoModelError", "RequestHandle", "Session", "SessionBusyError",
           "SessionDashboard", "SessionError", "SessionWidgets"]


def __getattr__(name: str):
    """The view classes, imported when first asked for (PEP 562)."""
    if name == "SessionDashboard":
        from workbench.views.panel_app import SessionDashboard

        return SessionDashboard
    if name == "SessionWidgets":
        from workbench.views.widgets import SessionWidgets

        return SessionWidgets
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
