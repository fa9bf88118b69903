"""The dashboards' layout, defined once for both views: the header, the messages and the three tabs (Live, Tuning,
What-if) as boxes (`Box`: rows, columns, a grid of charts, tabs) of slots: the forms' controls (workbench.views.forms),
texts the refresh fills (`Text`), charts (`Chart`), fixed notes (`Note`) and the few elements each toolkit makes its
own way (`Element`: progress bars, the spinner, the messages, the image upload and preview). `build` makes it with a
view's toolkit (Panel's or ipywidgets') and sets each slot on the view by its name; workbench.views.dashboard fills
the texts and charts. A control is added in forms.py; a chart is drawn in charts.py (tuning_charts, whatif_charts)
and placed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.views import forms
from workbench.views.fields import Action, Field

CHART_CSS = {"charts": "wb-chart-", "tune_charts": "wb-tune-", "whatif_charts": "wb-whatif-"}  # group -> css prefix
CHART_NAMES = ("throughput", "blocks", "block_map", "batch", "waste", "step_times", "spec_decoding", "memory",
               "weights", "compile", "expert_load")
TUNE_CHARTS = ("pareto", "latency", "pass_fail")
WHATIF_CHARTS = ("pareto", "memory", "latency")


@dataclass(frozen=True)
class Text:
    """A text the refresh fills, HTML (or, `pre`, plain text shown as it is: the answer)."""

    attr: str
    css: str
    pre: bool = False


@dataclass(frozen=True)
class Chart:
    """A chart, in the view's dict `group` ("charts": the Live tab's; "tune_charts"; "whatif_charts") by `name`."""

    group: str
    name: str

    @property
    def css(self) -> str:
        return CHART_CSS[self.group] + self.name.replace("_", "-")


@dataclass(frozen=True)
class Note:
    """Fixed text (HTML)."""

    html: str


@dataclass(frozen=True)
class Element:
    """What a toolkit makes its own way: kind progress (0 to 100), spinner (busy), error, info (the messages),
    image_input, image_view, divider."""

    attr: str
    kind: str
    css: str = ""


@dataclass(frozen=True)
class Box:
    """Slots laid out: kind row, column, side (the Live tab's controls), split (side | main), grid (charts two by
    two) or tabs (`titles`); `attr` names it on the view."""

    kind: str
    items: tuple
    titles: tuple = ()
    attr: str = ""
    css: str = ""


def _rows(form, *extra) -> tuple[Box, ...]:
    """A form's rows, `extra` slots after its last one (its buttons)."""
    rows = [tuple(row) for row in form]
    rows[-1] += extra
    return tuple(Box("row", row) for row in rows)


def _grid(group: str, names) -> Box:
    return Box("grid", tuple(Chart(group, name) for name in names))


SIDE = Box("side", (Note("<h3>Model</h3>"), *_rows(forms.LOAD_FORM), Text("models_text", "wb-models"),
                    Element("divider", "divider"), Note("<h3>Compile</h3>"), *_rows(forms.COMPILE_FORM),
                    Note("<h3>Speculative decoding</h3>"), *_rows(forms.SPEC_FORM)))
GENERATION = Box("column", (
    *_rows(forms.GENERATE_FORM, Note("image (multimodal models):"), Element("image_input", "image_input", "wb-image")),
    Box("row", (Text("answer", "wb-answer", pre=True), Element("image_view", "image_view", "wb-image-preview"))),
    Text("answer_stats", "wb-answer-stats"),
    Box("row", (Note("<b>Workload</b> — random requests to watch continuous batching:"), *forms.WORKLOAD_FORM[0])),
    Text("workload_plan", "wb-workload-plan"), Text("workload_status", "wb-workload-status")))
STEPS = Box("column", (Note("<b>The run, step by step</b>: the charts draw one point per engine step of the last run "
                            "(or the session's time series: x axis); slow the engine down, pause it and step it, and "
                            "replay any recorded step's batch and block map."),
                       *_rows(forms.STEP_FORM), Box("row", (forms.WINDOW_FIELD,))))
LIVE = Box("split", (SIDE, Box("column", (GENERATION, STEPS, _grid("charts", CHART_NAMES)))))
TUNING = Box("column", (
    Note("<b>Sweep</b> the loaded model's scheduler live (no reload): the most output tokens/s whose target metric "
         "stays under the limit. The values come from its KV capacity."),
    *_rows(forms.TUNE_FORM, Element("tune_progress", "progress", "wb-tune-progress")),
    Text("tune_status", "wb-tune-status"), Text("tune_recommendation", "wb-tune-recommendation"),
    _grid("tune_charts", TUNE_CHARTS)))
WHATIF = Box("column", (
    Note("<b>What-if</b>: the engine's real scheduler on a virtual clock, each step's time predicted for the device "
         "(no weights loaded). <i>Memory picture</i> shows at once what one device of each layout holds; "
         "<i>Simulate</i> sweeps the layouts and concurrency, with the device's efficiency band as error bars, next "
         "to the latest measured sweep of the Tuning tab."),
    *_rows(forms.WHATIF_FORM, Element("whatif_progress", "progress", "wb-whatif-progress")),
    Text("whatif_status", "wb-whatif-status"), _grid("whatif_charts", WHATIF_CHARTS)))
DASHBOARD = Box("column", (
    Box("row", (Note("<h2>runner-workbench</h2>"), Element("spinner", "spinner"), Text("status", "wb-status"))),
    Element("error", "error", "wb-error"), Element("info", "info", "wb-info"),
    Box("tabs", (LIVE, TUNING, WHATIF), titles=("Live", "Tuning", "What-if"), attr="tabs", css="wb-tabs")),
    css="wb-dashboard")


def build(toolkit, view, node, options: dict, live_charts=CHART_NAMES):
    """Make `node` and what it holds with `toolkit`, setting each named slot on `view` (a control, text, element or
    box by its attr; a chart in `view.<group>[name]`, the Live tab's only those in `live_charts`); `options`: a
    choice's values by attr. Returns the made widget, or None for a slot the toolkit or view leaves out."""
    if isinstance(node, (Field, Action)):
        made = toolkit.control(node, options.get(node.attr))
    elif isinstance(node, Text):
        made = toolkit.text(node)
        view.text_slots[node.attr] = node
    elif isinstance(node, Chart):
        if node.group == "charts" and node.name not in live_charts:
            return None
        made = getattr(view, node.group)[node.name] = toolkit.chart(node)
        return made
    elif isinstance(node, Note):
        return toolkit.note(node.html)
    elif isinstance(node, Element):
        made = toolkit.element(node)
    else:
        children = [child for child in (build(toolkit, view, item, options, live_charts) for item in node.items)
                    if child is not None]
        made = toolkit.box(node, children)
    attr = getattr(node, "attr", "")
    if made is not None and attr:
        setattr(view, attr, made)
    return made
