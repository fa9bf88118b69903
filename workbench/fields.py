"""A form's controls defined once for both views: each `Field` (a value the user sets) and `Action` (a button)
names its attribute on the view, its label, default and bounds; `Field.check` applies the bounds to a value
the view sends (a browser can send any), and `panel_form` / `widgets_form` create the form's widgets on a
view, in the form's rows, with Panel or ipywidgets. The css class of a control is its attribute's name
("tune_requests" -> "wb-tune-requests")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("text", "int", "float", "choice")
WIDTH = 120  # px: a number or a short choice; a list typed as text gets twice that


@dataclass(frozen=True)
class Field:
    attr: str
    label: str
    kind: str
    default: object
    low: float | None = None
    high: float | None = None
    options: tuple = ()  # a choice's values (a view may pass its own, such as the models loaded)
    placeholder: str = ""
    width: int = WIDTH

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"field {self.attr}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def css(self) -> str:
        return "wb-" + self.attr.replace("_", "-")

    def check(self, value):
        """`value` as the field's type within its bounds; ValueError naming the field, its bounds and the value."""
        if self.kind == "text":
            return str(value)
        if self.kind == "choice":
            if self.options and value not in self.options:
                raise ValueError(f"{self.label} {value!r}: choose one of {', '.join(map(str, self.options))}")
            return value
        number = int if self.kind == "int" else float
        try:
            checked = number(value)
        except (TypeError, ValueError):
            raise ValueError(f"{self.label} {value!r}: give a number{self._range()}") from None
        if self.kind == "int" and checked != float(value):
            raise ValueError(f"{self.label} {value!r}: give a whole number{self._range()}")
        if (self.low is not None and checked < self.low) or (self.high is not None and checked > self.high):
            raise ValueError(f"{self.label} {value}: must be{self._range()}")
        return checked

    def _range(self) -> str:
        if self.low is not None and self.high is not None:
            return f" from {self.low:g} to {self.high:g}"
        if self.low is not None:
            return f" of at least {self.low:g}"
        return "" if self.high is None else f" of at most {self.high:g}"


@dataclass(frozen=True)
class Action:
    attr: str
    label: str
    primary: bool = False
    icon: str = ""  # ipywidgets' Font Awesome name (Panel shows the label alone)

    @property
    def css(self) -> str:
        return "wb-" + self.attr.replace("_", "-")


Row = Sequence[Field | Action]


def _panel_control(control: Field | Action, options: Sequence | None):
    import panel as pn

    w = pn.widgets
    css = [control.css]
    if isinstance(control, Action):
        return w.Button(label=control.label, color="primary" if control.primary else "default", css_classes=css)
    common = dict(label=control.label, value=control.default, width=control.width, css_classes=css)
    if control.kind == "choice":
        return w.Select(options=list(options if options is not None else control.options), **common)
    if control.kind == "text":
        return w.TextInput(placeholder=control.placeholder, **common)
    number = w.IntInput if control.kind == "int" else w.FloatInput
    return number(start=control.low, end=control.high, **common)


def _widgets_control(control: Field | Action, options: Sequence | None):
    import ipywidgets as W

    if isinstance(control, Action):
        return W.Button(description=control.label, button_style="primary" if control.primary else "", icon=control.icon)
    common = dict(description=control.label, value=control.default, style={"description_width": "initial"},
                  layout=W.Layout(width=f"{control.width + 80}px"))
    if control.kind == "choice":
        return W.Dropdown(options=list(options if options is not None else control.options), **common)
    if control.kind == "text":
        return W.Text(placeholder=control.placeholder, **common)
    if control.low is None and control.high is None:
        return (W.IntText if control.kind == "int" else W.FloatText)(**common)
    bounded = W.BoundedIntText if control.kind == "int" else W.BoundedFloatText
    big = 2**31 - 1  # ipywidgets needs both bounds
    return bounded(min=-big if control.low is None else control.low, max=big if control.high is None else control.high,
                   **common)


def panel_form(view, rows: Sequence[Row], options: dict | None = None) -> list:
    """Create each control of `rows` on `view` as a Panel widget; a pn.Row per row, in order."""
    import panel as pn

    return [pn.Row(*(_make(view, c, _panel_control, options) for c in row), sizing_mode="stretch_width")
            for row in rows]


def widgets_form(view, rows: Sequence[Row], options: dict | None = None) -> list:
    """Create each control of `rows` on `view` as an ipywidget; an HBox per row, in order."""
    import ipywidgets as W

    return [W.HBox([_make(view, c, _widgets_control, options) for c in row]) for row in rows]


def _make(view, control, build, options: dict | None):
    widget = build(control, (options or {}).get(control.attr))
    setattr(view, control.attr, widget)
    return widget
