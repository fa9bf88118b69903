"""The Live tab's speculative decoding switch, for both dashboards: forms.SPEC_FORM's check box and k applied to the
active model through `Session.reconfigure(speculative_config=...)` (n-gram prompt lookup; no reload, refused while
generations run, the refusal shown). Its chart is spec_charts.py's, in the step view."""

from __future__ import annotations

from concurrent.futures import Future

SPEC_METHOD = "ngram"


def speculative_config(on: bool, k: int) -> dict | None:
    """The RunnerConfig field the form's values stand for (None: speculation off)."""
    return {"method": SPEC_METHOD, "num_speculative_tokens": int(k)} if on else None


class SpecControls:
    """The switch's action; a base of the dashboards (workbench.views.dashboard), whose `session`, `guard`,
    `_track`, `show_info` and the form's `spec_on`, `spec_k`, `spec_button` it uses."""

    def wire_spec(self) -> None:
        self.spec_button.on_click(lambda _event: self.on_spec())

    def on_spec(self) -> None:
        on, k = bool(self.spec_on.value), self.spec_k.value or 4
        if self.set_speculation(on, k) is not None:
            self.show_info(f"Switching n-gram speculation {'on, k=' + str(k) if on else 'off'}…")

    def set_speculation(self, on: bool, k: int) -> Future | None:
        """Reconfigure the active model's speculative_config (a background job; its error becomes a message)."""
        config = speculative_config(on, k)
        return self._track("speculation " + ("on" if on else "off"), self.guard("Speculation", lambda: (
            self.session.reconfigure(speculative_config=config, wait=False))))
