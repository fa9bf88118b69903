"""The Live tab's step view, for both dashboards: the last run drawn per engine step (one point a step: tokens and
requests, KV blocks, waste, each step's time), a step's batch and block map replayed with a slider, and the engine's
pace (a wait between steps; pause / step / resume). Its controls are forms.STEP_FORM; while the x axis is "engine
step" its figures take the wall-clock charts' slots (throughput, blocks, waste, block map), whose time series stay
for long runs ("wall clock"); "auto" draws steps for a last run of up to STEP_VIEW_STEPS. Speculative decoding's
chart (spec_charts.py: draft tokens proposed and accepted per step, acceptance by position) draws the last run too."""

from __future__ import annotations

from workbench.views import charts, spec_charts, timeline
from workbench.views.forms import PACE_CHOICES

STEP_VIEW_STEPS = 5000  # "auto": a last run of up to this many steps is drawn by step
STEP_POINTS = 400  # a chart's points at most (a longer run: a point for k steps): a chart is ~600 px wide, and
#                    each refresh sends every point to the page, so the page's updates keep pace with the engine


class StepControls:
    """The step view's actions and figures; a base of the dashboards (workbench.views.dashboard), whose
    `session`, `toolkit`, `guard`, `show_info` and `redraw_charts` it uses."""

    def wire_steps(self) -> None:
        self.pause_button.on_click(lambda _event: self.guard("Pause", self.session.pause))
        self.step_button.on_click(lambda _event: self.on_step())
        self.resume_button.on_click(lambda _event: self.guard("Resume", self.session.resume))
        self.toolkit.on_change(self.pace_select, self.on_pace)
        self.toolkit.on_change(self.axis_select, lambda _value: self.redraw_charts())
        self.toolkit.on_change(self.replay_step, lambda _value: self.redraw_charts())

    def on_pace(self, label: str) -> None:
        self.guard("Pace", lambda: self.session.pace(PACE_CHOICES[label]))

    def on_step(self) -> None:
        if not self.session.paused:
            self.show_info("Step runs one engine step while paused: press Pause first")
        elif self.guard("Step", lambda: self.session.step(10.0)) is False:
            self.show_info("nothing to step: no request is running or waiting (run the workload first)")
        self.redraw_charts()

    def by_step(self, run: list) -> bool:
        """Whether the charts show engine steps (else the session's wall-clock rows)."""
        axis = self.axis_select.value
        return axis == "engine step" or (axis == "auto" and 0 < len(run) <= STEP_VIEW_STEPS)

    def step_figures(self) -> dict:
        """The step view's figures by chart slot, and the replay slider's end set to the run's recorded steps."""
        records, details = self.session.steps()
        run = timeline.last_run(records)
        first = run[0].step if run else 0
        shown = [d for d in details if d.step >= first] if run else []
        self.toolkit.set_end(self.replay_step, len(shown))
        k = min(int(self.replay_step.value or 0), len(shown))
        detail = shown[k - 1] if k else (shown[-1] if shown else None)
        before = next((d for d in reversed(shown) if d.step < detail.step), None) if detail is not None else None
        points, per = timeline.thin(run, STEP_POINTS)
        figures = {"batch": timeline.step_batch(detail, before),
                   "step_times": per_point(timeline.step_times(points), per),
                   "spec_decoding": spec_charts.spec_decoding(run, STEP_POINTS)}
        if self.by_step(run):
            entry = self.session.active_model
            budget = entry.runner.config.effective_max_num_batched_tokens if entry and entry.runner else None
            watched, per_watched = timeline.thin([r for r in run if r.kv_utilization is not None], STEP_POINTS)
            figures.update(throughput=per_point(timeline.step_timeline(points, budget), per),
                           blocks=per_point(timeline.step_blocks(points), per),
                           waste=per_point(timeline.step_waste(watched), per_watched))
            if k:  # a replayed step's map (0: the pool now, as the wall-clock view draws it)
                figures["block_map"] = charts.kv_block_map(detail.block_map(), when=f" after step {detail.step}")
        return figures


def per_point(fig, k: int):
    """`fig` with its title saying that a point stands for `k` steps (when k > 1: timeline.thin)."""
    if k > 1:
        fig.update_layout(title_text=f"{fig.layout.title.text} (a point per {k} steps)")
    return fig
