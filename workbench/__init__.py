"""workbench: the notebook session and dashboards around runner_core (see DESIGN.md)."""
