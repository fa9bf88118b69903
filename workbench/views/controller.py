"""The actions of both views (the Panel dashboard and the ipywidgets panel) on the forms' widgets
(workbench.views.forms, placed by workbench.views.layout): each user action one Session call whose error becomes the
view's message, background jobs (load, unload, compile switch) tracked until they finish, the buttons wired to the
actions, and the streamed answer, the workload and the charts prepared for display (workbench.views.dashboard shows
them). A view supplies `show_error`, `show_info`, `clear_messages` and `show_generating`; no engine logic here.
"""

from __future__ import annotations

import io
from concurrent.futures import Future
from pathlib import Path

from runner_core.tuning import SweepSpace, Target, Workload, propose_space, speculation_values
from workbench.runtime.handles import RequestHandle
from workbench.runtime.model_roots import ModelRoots
from workbench.session import Session
from workbench.views import charts, tuning_charts
from workbench.views.forms import DEFAULT_LOAD, NONE, TUNE_DEFAULTS, TUNE_FIELDS, WINDOW_CHOICES, WINDOW_FIELD

CHART_HISTORY = 1200  # rows drawn at most, the latest of the window (0.1 s each while work runs: 2 busy minutes)
DEFAULT_WINDOW = WINDOW_FIELD.default


def parse_values(text: str, field: str) -> list[int]:
    """"1, 2, 4" -> [1, 2, 4]; ValueError naming the field and the piece that is not a whole number >= 1."""
    values = []
    for piece in text.replace(";", ",").replace(" ", ",").split(","):
        if piece:
            if not piece.isdigit() or int(piece) < 1:
                raise ValueError(f"{field}: {piece!r} is not a whole number >= 1; give a list such as 1, 2, 4, 8")
            values.append(int(piece))
    return values


def tune_plan(concurrency: str, max_num_seqs: str, metric: str, limit: float, repeats: int, requests: int,
              speculation: str = ""):
    """(SweepSpace, Workload, Target, repeats) from the Tuning form's fields (lists as text: "1, 2, 4"; an
    empty max_num_seqs or speculation list leaves it as loaded; k values: off, then n-gram at each k);
    ValueError naming the field at fault."""
    levels = parse_values(concurrency, "concurrency values")
    if not levels:
        raise ValueError("concurrency values: give at least one, such as 1, 2, 4, 8")
    seqs = parse_values(max_num_seqs, "max_num_seqs values")
    f = TUNE_FIELDS
    ks = parse_values(speculation, "n-gram speculation k values")
    knobs = {"max_num_seqs": seqs, "speculative_config": speculation_values(ks) if ks else []}
    space = SweepSpace(concurrency=levels, scheduler={name: values for name, values in knobs.items() if values})
    return (space, Workload(num_requests=f["requests"].check(requests)),
            Target(f["metric"].check(metric), f["limit"].check(limit)), f["repeats"].check(repeats))
IMAGE_PLACEHOLDER = "<image>"  # where a multimodal prompt's image goes (LLaVA's placeholder)
PREVIEW_PX = 160


def read_image(data: bytes):
    """A PIL image from uploaded bytes; ValueError naming the problem when it is not one."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, ...
        raise ValueError(f"the uploaded file is not an image that can be read ({type(exc).__name__}: {exc})") from exc
    return image.convert("RGB")


def image_prompt(text: str, image) -> str | dict:
    """The request for `text` with `image` (vLLM's multimodal form); the placeholder goes first
    when the text has none."""
    if image is None:
        return text
    if IMAGE_PLACEHOLDER not in text:
        text = f"{IMAGE_PLACEHOLDER}\n{text}"
    return {"prompt": text, "multi_modal_data": {"image": image}}


def load_config(dtype: str, device: str, kv_cache_memory_mib: int | None, max_model_len: int | None,
                storage: str = NONE, group_size: int = 64, quantize_lm_head: bool = False,
                prefix_caching: bool = DEFAULT_LOAD["enable_prefix_caching"]) -> dict:
    """RunnerConfig fields from the load controls (0 or None means automatic; `storage` is one of
    forms.STORAGE_CHOICES: "none" keeps the weights in the compute dtype)."""
    config = {"dtype": dtype, "device": device, "enable_prefix_caching": bool(prefix_caching)}
    if storage != NONE:
        config.update(quantization=storage, quantization_group_size=int(group_size),
                      quantize_lm_head=bool(quantize_lm_head))
    if kv_cache_memory_mib:
        config["kv_cache_memory"] = int(kv_cache_memory_mib) << 20
    if max_model_len:
        config["max_model_len"] = int(max_model_len)
    return config


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def model_choice(preset: str, path: str) -> str:
    """The model to load: a typed local path wins over the preset picker."""
    path = path.strip()
    return str(Path(path).expanduser().resolve()) if path else preset


class ViewController:
    """The base of a view over `session` (default: `Session.current()`). The view's widgets
    include the buttons `load_button`, `unload_button`, `compile_button`, `generate_button`,
    `cancel_button`, `workload_button`, `tune_start`, `tune_cancel` (each with
    `.on_click(callback(event))`), the `workload_n` number input and the Tuning form's fields
    (`tune_concurrency`, `tune_seqs`, `tune_spec`, `tune_metric`, `tune_limit`, `tune_repeats`, `tune_requests`:
    each with `.value`) and `tune_progress` (0 to 100)."""

    def __init__(self, session: Session | None = None, model_roots: ModelRoots | None = None):
        self.session = session or Session.current()
        self.model_roots = model_roots  # None: any path (a notebook's own dashboard); else a served one's roots
        self.handle: RequestHandle | None = None
        self.workload: list[RequestHandle] = []
        self.jobs: list[tuple[str, Future]] = []
        self._error_shown_for: RequestHandle | None = None
        self.image = None  # the uploaded image (PIL) the next generation sends, if any
        self._syncing = False  # set while the view copies the session's active model into its picker
        self.chart_window = DEFAULT_WINDOW  # a WINDOW_CHOICES label
        self.tune_job = None  # the sweep the Tuning tab started (a workbench.tuning.job.TuneJob)
        self._tune_version = -1  # the job's version the tuning charts show (None: the empty charts)
        self._tune_model = None  # the model whose KV capacity proposed the Tuning form's values

    # ---- supplied by the view ---------------------------------------------------------------
    def show_error(self, message: str) -> None:
        raise NotImplementedError

    def show_info(self, message: str) -> None:
        raise NotImplementedError

    def clear_messages(self) -> None:
        raise NotImplementedError

    def show_generating(self) -> None:
        """A generation was sent: the answer's output starts empty."""
        raise NotImplementedError

    # ---- wiring -----------------------------------------------------------------------------
    def wire_buttons(self) -> None:
        """Each button's click runs its action (Panel and ipywidgets buttons alike)."""
        for button, action in ((self.load_button, self.on_load), (self.unload_button, self.on_unload),
                               (self.compile_button, self.on_compile), (self.generate_button, self.on_generate),
                               (self.cancel_button, self.on_cancel), (self.workload_button, self.on_workload),
                               (self.tune_start, self.on_tune), (self.tune_cancel, self.cancel_tune)):
            button.on_click(lambda _event, action=action: action())

    def on_load(self) -> None:
        model = model_choice(self.model_select.value, self.model_path.value)
        config = load_config(self.dtype.value, self.device.value, self.kv_mib.value, self.max_len.value,
                             self.storage.value, self.group_size.value, self.quantize_lm_head.value,
                             self.prefix_caching.value)
        already = model in self.session.models
        if self.load(model, config) is not None:
            self.show_info(f"{model} is already loaded; it is the active model now" if already
                           else f"Loading {model}…")

    def on_compile(self) -> None:
        on, backend, mode, scope = (self.compile_on.value, self.compile_backend.value, self.compile_mode.value,
                                    self.compile_scope.value)
        if self.set_compile(on, backend, mode, scope) is not None:
            self.show_info(f"Switching compile {'on' if on else 'off'} ({backend}, {mode}, scope {scope})…")

    def on_generate(self) -> None:
        if self.generate(self.prompt.value, max_tokens=self.max_tokens.value, temperature=self.temperature.value,
                         top_p=self.top_p.value, top_k=self.top_k.value or 0,
                         ignore_eos=self.ignore_eos.value) is not None:
            self.show_generating()

    def on_chart_window(self, label: str) -> None:
        self.set_chart_window(label)
        self.redraw_charts()

    def on_unload(self) -> None:
        self.unload()

    def on_cancel(self) -> None:
        self.cancel()

    def on_workload(self) -> None:
        self.start_workload(self.workload_n.value)

    def on_tune(self) -> None:
        self.start_tune(self.tune_concurrency.value, self.tune_seqs.value, self.tune_metric.value,
                        self.tune_limit.value, self.tune_repeats.value, self.tune_requests.value,
                        self.tune_spec.value)

    def on_active(self, name: str | None) -> None:
        """The user picked another active model (ignored while the view syncs the picker)."""
        if not self._syncing and name:
            self.use(name)

    def sync_active(self, picker) -> None:
        """Make `picker` (a select widget: `.options`, `.value`) show the loaded models and the active one."""
        names = list(self.session.models)
        self._syncing = True
        try:
            if list(picker.options) != names:
                picker.options = names
            if self.session.active != picker.value:
                picker.value = self.session.active
        finally:
            self._syncing = False

    # ---- actions ----------------------------------------------------------------------------
    def guard(self, action: str, fn):
        """Run a Session call; a raised error becomes the view's message (the session goes on)."""
        self.clear_messages()
        try:
            return fn()
        except Exception as exc:  # shown, not swallowed
            self.show_error(f"{action}: {exc}")
            return None

    def _track(self, label: str, fut: Future | None) -> Future | None:
        if fut is not None:
            self.jobs.append((label, fut))
        return fut

    def load(self, model: str, config: dict) -> Future | None:
        def load():
            allowed = model if self.model_roots is None else self.model_roots.check(model)
            return self.session.load_model(allowed, wait=False, **config)
        return self._track(f"Load {model}", self.guard("Load", load))

    def unload(self) -> Future | None:
        return self._track("Unload", self.guard("Unload", lambda: self.session.unload(wait=False)))

    def set_compile(self, enabled: bool, backend: str, mode: str, scope: str | None = None) -> Future | None:
        label = "compile " + ("on" if enabled else "off")
        return self._track(label, self.guard("Compile mode", lambda: self.session.set_compile_mode(
            enabled, backend=backend, mode=mode, scope=scope, wait=False)))

    def set_image(self, data: bytes | None) -> None:
        """Take an uploaded image for the next generations (None or b"": none)."""
        self.image = None
        if data:
            self.image = self.guard("Image", lambda: read_image(data))

    def image_preview(self) -> bytes | None:
        """The uploaded image as a small PNG, for display beside the answer."""
        if self.image is None:
            return None
        thumb = self.image.copy()
        thumb.thumbnail((PREVIEW_PX, PREVIEW_PX))
        out = io.BytesIO()
        thumb.save(out, format="PNG")
        return out.getvalue()

    def generate(self, prompt: str, **sampling) -> RequestHandle | None:
        handle = self.guard("Generate", lambda: self.session.submit(image_prompt(prompt, self.image), **sampling))
        if handle is not None:
            self.handle, self._error_shown_for = handle, None
        return handle

    def cancel(self) -> None:
        for h in [self.handle, *self.workload]:
            if h is not None:
                h.cancel()

    def start_workload(self, n: int) -> None:
        handles = self.guard("Workload", lambda: self.session.run_workload(int(n)))
        if handles:
            self.workload = handles
            self.session.metrics.add_event("workload", model=self.session.active, requests=len(handles))

    def set_chart_window(self, label: str) -> None:
        """Show the live charts over another window (a WINDOW_CHOICES label)."""
        if label not in WINDOW_CHOICES:
            raise ValueError(f"chart window {label!r}: use one of {', '.join(WINDOW_CHOICES)}")
        self.chart_window = label

    def proposed_tuning(self, requests: int = TUNE_DEFAULTS["requests"]) -> dict:
        """The Tuning form's concurrency and max_num_seqs lists proposed from the active model's KV capacity
        (runner_core.tuning's propose_space); TUNE_DEFAULTS' when no model is loaded."""
        if self.session.active_model is None:
            return dict(TUNE_DEFAULTS)
        from workbench.tuning import SessionBackend

        space = propose_space(SessionBackend(self.session).capacity(), Workload(num_requests=int(requests)))
        return {**TUNE_DEFAULTS, "requests": int(requests), "concurrency": ", ".join(map(str, space.concurrency)),
                "max_num_seqs": ", ".join(map(str, space.scheduler.get("max_num_seqs", [])))}

    def refresh_tuning(self) -> tuple[str, dict | None, str]:
        """Fill the Tuning form with proposed values when the active model changed since the last proposal
        (and no sweep runs), move the progress bar; returns tune_state's status, figures and recommendation."""
        s, job = self.session, self.tune_job
        if s.active != self._tune_model and s.active_model is not None and s.active_model.ready and (
                job is None or job.done):
            self._tune_model = s.active
            try:
                proposed = self.proposed_tuning(self.tune_requests.value)
                self.tune_concurrency.value, self.tune_seqs.value = proposed["concurrency"], proposed["max_num_seqs"]
            except Exception as exc:  # shown; the form keeps its values
                self.show_error(f"Propose sweep values: {exc}")
        status, fraction, figures, recommendation = self.tune_state()
        self.tune_progress.value = round(100 * fraction)
        return status, figures, recommendation

    def start_tune(self, concurrency: str, max_num_seqs: str, metric: str, limit: float, repeats: int,
                   requests: int, speculation: str = ""):
        """Start a sweep of the active model from the form's fields (see tune_plan); the job or None."""
        def start():
            space, workload, target, n = tune_plan(concurrency, max_num_seqs, metric, limit, repeats, requests,
                                                   speculation)
            return self.session.tune(space, workload, target=target, repeats=n)

        job = self.guard("Tune", start)
        if job is not None:
            self.tune_job, self._tune_version = job, -1
        return job

    def cancel_tune(self) -> None:
        if self.tune_job is not None:
            self.tune_job.cancel()

    def tune_state(self) -> tuple[str, float, dict | None, str]:
        """(the sweep's status line, the fraction done, its charts when the job moved since the last call
        (the empty ones at first) else None, the recommendation once it finished)."""
        job = self.tune_job
        version = None if job is None else job.version
        done = job is not None and job.done and job.error is None
        result = job.result(0) if done else None
        figures = None
        if version != self._tune_version:  # the empty charts before the first sweep
            self._tune_version = version
            figures = (tuning_charts.all_figures([], Target()) if job is None
                       else tuning_charts.all_figures(job.points, job.target, result))
        if job is None:
            return "no sweep yet: set the values and press Start sweep", 0.0, figures, ""
        fraction = 1.0 if done and not job.cancelled else tuning_charts.progress_fraction(job.progress, job.repeats)
        recommendation = tuning_charts.recommendation_text(result, job.target) if done else ""
        return job.status, fraction, figures, recommendation

    def use(self, name: str) -> None:
        self.guard("Switch model", lambda: self.session.use(name))

    # ---- state for display ------------------------------------------------------------------
    def finished_jobs(self) -> list[tuple[str, BaseException | None, object]]:
        """Jobs that finished since the last call: (label, exception or None, result); errors are shown."""
        done = []
        for label, fut in list(self.jobs):
            if fut.done():
                self.jobs.remove((label, fut))
                exc = fut.exception()
                if exc is not None:
                    self.show_error(f"{label}: {exc}")
                done.append((label, exc, None if exc is not None else fut.result()))
        return done

    def answer_view(self) -> tuple[str, str]:
        """(text, stats line) of the current generation, one consistent pair: the stats are read first, so a
        line that says "finished" comes with the final text (the engine thread could otherwise add the last
        piece between the two reads, and a page would show "finished" one token short until its next refresh)."""
        stats = self.answer_stats_text()
        return (self.handle.text if self.handle is not None else ""), stats

    def answer_stats_text(self) -> str:
        """'N tokens · R tokens/s · finished: reason' for the current generation; its error, once."""
        h = self.handle
        if h is None:
            return ""
        rate = h.tokens_per_s
        parts = [f"{h.num_tokens} tokens"] + ([f"{rate:.1f} tokens/s"] if rate else [])
        if h.done:
            parts.append(f"finished: {h.finish_reason}")
            spec = h.spec_decoding
            if spec and spec["num_drafts"]:  # speculation verified drafts for it
                parts.append(f"drafts: {spec['acceptance_rate']:.0%} accepted, "
                             f"{spec['mean_acceptance_length']:.2f} tokens a verified step")
            if h.exception is not None and self._error_shown_for is not h:
                self._error_shown_for = h
                self.show_error(f"Generate: {h.exception}")
        return " · ".join(parts)

    def chart_figures(self) -> dict:
        """Every chart of the active model's rows in the chosen window, the events and its block map."""
        s = self.session
        entry = s.active_model
        events = s.metrics.events()
        rows = s.metrics.rows(model=s.active) if entry is not None and entry.acc is not None else []
        if rows:
            shift = entry.acc.t0 - s.metrics.t0  # events count from the session's start, rows from the load
            mine = [{**e, "t": e["t"] - shift} for e in events if e.get("model") == s.active]
            mode, minutes = WINDOW_CHOICES[self.chart_window]
            rows = charts.window(rows, mode, minutes, mine)[-CHART_HISTORY:]
        return charts.all_figures(rows, events, s.block_map(),
                                  weights=entry.weights_storage() if entry is not None else None)

    def workload_summary(self) -> str:
        if not self.workload:
            return ""
        done = sum(x.done for x in self.workload)
        tokens = sum(x.num_tokens for x in self.workload)
        return f"workload: {done}/{len(self.workload)} requests done, {tokens} tokens"
