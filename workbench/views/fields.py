"""A form's controls defined once for both views: each `Field` (a value the user sets) and `Action` (a button)
names its attribute on the view, its label, default and bounds; `Field.check` applies the bounds to a value
the view sends (a browser can send any), and `panel_control` / `widgets_control` make a control's widget with Panel
or ipywidgets (workbench.views.layout places them). The css class of a control is its attribute's name
("tune_requests" -> "wb-tune-requests")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("text", "area", "int", "float", "choice", "check", "slider")
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
    width: int | None = WIDTH  # px; None: as wide as its container
    step: float | None = None  # a number's arrow step
    help: str = ""  # the field's tooltip
    css_name: str = ""  # its css class when not "wb-" + attr (the one tests and docs name)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"field {self.attr}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def css(self) -> str:
        return self.css_name or "wb-" + self.attr.replace("_", "-")

    def check(self, value):
        """`value` as the field's type within its bounds; ValueError naming the field, its bounds and the value."""
        if self.kind in ("text", "area"):
            return str(value)
        if self.kind == "check":
            return bool(value)
        if self.kind == "choice":
            if self.options and value not in self.options:
                raise ValueError(f"{self.label} {value!r}: choose one of {', '.join(map(str, self.options))}")
            return value
        number = int if self.kind in ("int", "slider") else float
        try:
            checked = number(value)
        except (TypeError, ValueError):
            raise ValueError(f"{self.label} {value!r}: give a number{self._range()}") from None
        if number is int and checked != float(value):
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
    css_name: str = ""

    @property
    def css(self) -> str:
        return self.css_name or "wb-" + self.attr.replace("_", "-")


def panel_control(control: Field | Action, options: Sequence | None):
    import panel as pn

    w = pn.widgets
    css = [control.css]
    if isinstance(control, Action):
        return w.Button(label=control.label, color="primary" if control.primary else "default", css_classes=css)
    size = {"sizing_mode": "stretch_width"} if control.width is None else {"width": control.width}
    common = dict(label=control.label, value=control.default, css_classes=css, **size)
    if control.help and control.kind != "check":  # Panel's checkbox has no tooltip
        common["description"] = control.help
    if control.kind == "check":
        return w.Checkbox(**common)
    if control.kind == "choice":
        return w.Select(options=list(options if options is not None else control.options), **common)
    if control.kind in ("text", "area"):
        text = w.TextAreaInput if control.kind == "area" else w.TextInput
        return text(placeholder=control.placeholder, **({"rows": 3} if control.kind == "area" else {}), **common)
    if control.kind == "slider":  # whole numbers from `low` to `high` (set_range moves the end)
        return w.IntSlider(start=control.low, end=max(control.high, control.low + 1), **common)
    number = w.IntInput if control.kind == "int" else w.FloatInput
    return number(start=control.low, end=control.high, **({"step": control.step} if control.step else {}), **common)


def widgets_control(control: Field | Action, options: Sequence | None):
    import ipywidgets as W

    if isinstance(control, Action):
        return W.Button(description=control.label, button_style="primary" if control.primary else "", icon=control.icon)
    width = "98%" if control.width is None else f"{control.width + 90}px"  # the label sits beside the field
    common = dict(description=control.label, value=control.default, style={"description_width": "initial"},
                  layout=W.Layout(width=width), tooltip=control.help or None)
    if control.kind == "check":
        return W.Checkbox(indent=False, **common)
    if control.kind == "choice":
        return W.Dropdown(options=list(options if options is not None else control.options), **common)
    if control.kind in ("text", "area"):
        return (W.Textarea if control.kind == "area" else W.Text)(placeholder=control.placeholder, **common)
    if control.kind == "slider":
        return W.IntSlider(min=control.low, max=max(control.high, control.low + 1), **common)
    step = {"step": control.step} if control.step else {}
    if control.low is None and control.high is None:
        return (W.IntText if control.kind == "int" else W.FloatText)(**step, **common)
    bounded = W.BoundedIntText if control.kind == "int" else W.BoundedFloatText
    big = 2**31 - 1  # ipywidgets needs both bounds
    return bounded(min=-big if control.low is None else control.low, max=big if control.high is None else control.high,
                   **step, **common)
