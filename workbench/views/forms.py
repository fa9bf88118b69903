"""Every form of the dashboards, defined once for both views (workbench.views.fields): the Live tab's model,
compile, speculative decoding, generation and workload forms, its chart window and its step view (the x axis, the
pace, pause / step / resume and the replay slider), the Tuning tab's sweep and the What-if tab's layouts. A control
is added here, in one place; the views lay the rows out and `fields.Field.check` bounds what they send."""

from __future__ import annotations

from runner_core.config import COMPILE_BACKENDS, COMPILE_MODES, COMPILE_SCOPES, QUANT_GROUP_SIZES, QUANTIZATIONS
from runner_core.simulator.hardware import HARDWARE
from runner_core.simulator.simulation import WEIGHT_FORMATS
from workbench.runtime.workload import DEMO
from workbench.views.charts import WINDOW_MINUTES
from workbench.views.fields import WIDTH, Action, Field

SIDE = 130  # px: two fields side by side in the Panel sidebar, their labels in full
NONE = "none"  # a storage format choice: the weights kept in the compute dtype

# ---- Live: the model --------------------------------------------------------------------------------
# what the views (and `serve --model`) load with unless told otherwise: a small KV pool keeps the block map
# readable and the load fast on a laptop CPU
DEFAULT_MODEL = "tiny-speaker"  # the trained preset: its text is words (the random presets are for benchmarks)
DEFAULT_LOAD = {"dtype": "float32", "kv_cache_memory_mib": 16, "max_model_len": 0,  # 0: the model's own limit
                "enable_prefix_caching": True}  # the demo's prompts share their opening: watch the hits
STORAGE_CHOICES = (NONE, *(q for q in QUANTIZATIONS if q))  # none, int8, int4
LOAD_FORM = (
    (Field("model_select", "Model preset", "choice", DEFAULT_MODEL, width=None, css_name="wb-model"),),
    (Field("model_path", "…or a local Hugging Face directory", "text", "", placeholder="/path/to/model",
           width=None),),
    (Field("dtype", "dtype", "choice", DEFAULT_LOAD["dtype"], options=("float32", "bfloat16", "float16", "auto"),
           width=SIDE),
     Field("device", "device", "choice", "cpu", width=SIDE)),
    (Field("kv_mib", "KV cache (MiB)", "int", DEFAULT_LOAD["kv_cache_memory_mib"], low=0, width=SIDE,
           help="0 = automatic: what the device's free memory allows"),
     Field("max_len", "max_model_len", "int", DEFAULT_LOAD["max_model_len"], low=0, width=SIDE,
           help="0 = the model's own maximum context length")),
    (Field("storage", "weights stored as", "choice", NONE, options=STORAGE_CHOICES, width=SIDE,
           help="none: the dtype; int8: one scale per output channel; int4: a scale and a minimum per group of "
                "weights"),
     Field("group_size", "int4 group", "choice", 64, options=tuple(QUANT_GROUP_SIZES), width=SIDE,
           help="weights along k per int4 scale")),
    (Field("quantize_lm_head", "quantize the LM head too", "check", False, width=None),),
    (Field("prefix_caching", "prefix caching", "check", DEFAULT_LOAD["enable_prefix_caching"], width=None,
           help="full blocks of a prompt's opening shared with later prompts that start the same"),),
    (Action("load_button", "Load model", primary=True, icon="download", css_name="wb-load"),
     Action("unload_button", "Unload", icon="eject", css_name="wb-unload")),
    (Field("active_select", "Active model", "choice", None, width=None, css_name="wb-active"),),
)

# ---- Live: compile mode -------------------------------------------------------------------------------
COMPILE_FORM = (
    (Field("compile_on", "torch.compile", "check", False, width=None, css_name="wb-compile"),),
    (Field("compile_backend", "backend", "choice", "inductor", options=tuple(COMPILE_BACKENDS), width=SIDE),
     Field("compile_mode", "mode", "choice", "auto", options=tuple(COMPILE_MODES), width=SIDE,
           help="auto: inductor default on CUDA (the runner captures CUDA graphs), max-autotune on the CPU")),
    (Field("compile_scope", "scope", "choice", "model", options=tuple(COMPILE_SCOPES), width=SIDE),),
    (Action("compile_button", "Apply compile mode", icon="bolt", css_name="wb-apply-compile"),),
)

# ---- Live: speculative decoding (n-gram prompt lookup), switched by reconfigure (no reload) ------------------------
SPEC_FORM = (
    (Field("spec_on", "n-gram speculation", "check", False, width=None, css_name="wb-spec",
           help="draft tokens copied from the prompt and output so far, verified in one forward pass"),),
    (Field("spec_k", "k (draft tokens)", "int", 4, low=1, high=16, width=SIDE,
           help="num_speculative_tokens: the drafts proposed per sequence per step"),
     Action("spec_button", "Apply speculation", icon="forward", css_name="wb-apply-spec")),
)

# ---- Live: a generation and a workload ----------------------------------------------------------------
# (the sampling fields have no bounds of their own: the engine refuses a bad value, saying why)
GENERATE_FORM = (
    (Field("prompt", "Prompt", "area", "Once upon a time", placeholder="Type a prompt…", width=None),),
    (Field("max_tokens", "max tokens", "int", 64),
     Field("temperature", "temperature", "float", 0.8, step=0.1, help="0 = greedy"),
     Field("top_p", "top p", "float", 1.0, step=0.05), Field("top_k", "top k", "int", 0, help="0 = off"),
     Field("ignore_eos", "ignore EOS", "check", False)),
    (Action("generate_button", "Generate", primary=True, icon="play", css_name="wb-generate"),
     Action("cancel_button", "Cancel", icon="stop", css_name="wb-cancel")),
)
WORKLOAD_FORM = ((Field("workload_n", "requests", "int", DEMO["n"], low=1, high=1024),
                  Action("workload_button", "Run workload", icon="bolt", css_name="wb-workload")),)

# ---- Live: the charts' window: label -> (charts.window mode, minutes) -------------------------------------
WINDOW_CHOICES = {"last minute": ("minutes", 1.0), "last 2 minutes": ("minutes", 2.0),
                  "last 5 minutes": ("minutes", 5.0), "last 10 minutes": ("minutes", 10.0),
                  "last run": ("run", WINDOW_MINUTES)}
WINDOW_FIELD = Field("window_select", "the charts show", "choice", "last 2 minutes", options=tuple(WINDOW_CHOICES),
                     width=SIDE + 20, css_name="wb-chart-window")

# ---- Live: the step view: label -> seconds between steps; the x axis ------------------------------------------
PACE_CHOICES = {"full speed": 0.0, "20 ms a step": 0.02, "100 ms a step": 0.1, "300 ms a step": 0.3,
                "1 s a step": 1.0}
AXIS_CHOICES = ("auto", "engine step", "wall clock")  # auto: engine steps for a run of up to STEP_VIEW_STEPS
STEP_FORM = (
    (Field("axis_select", "x axis", "choice", "auto", options=AXIS_CHOICES, width=SIDE, css_name="wb-axis",
           help="engine step: one point per step of the last run; wall clock: the session's time series"),
     Field("pace_select", "pace", "choice", "full speed", options=tuple(PACE_CHOICES), width=SIDE,
           css_name="wb-pace", help="a wait between engine steps (a teaching mode, not a benchmark)"),
     Action("pause_button", "Pause", icon="pause", css_name="wb-pause"),
     Action("step_button", "Step", icon="step-forward", css_name="wb-step"),
     Action("resume_button", "Resume", icon="play", css_name="wb-resume")),
    (Field("replay_step", "replay step (0: the latest)", "slider", 0, low=0, high=1, width=None,
           css_name="wb-replay"),),
)

# ---- Tuning -----------------------------------------------------------------------------------------------
TUNE_METRICS = ("tpot_p99_ms", "ttft_p99_ms", "e2e_p99_ms", "itl_p99_ms", "tpot_p50_ms", "ttft_p50_ms")
# its fields by the sweep's names, with the defaults they show before a model's KV capacity proposes values
TUNE_FIELDS = {
    "concurrency": Field("tune_concurrency", "concurrency values", "text", "1, 2, 4, 8", width=2 * WIDTH),
    "max_num_seqs": Field("tune_seqs", "max_num_seqs values", "text", "", placeholder="as loaded", width=2 * WIDTH),
    "speculation": Field("tune_spec", "n-gram speculation k values", "text", "", placeholder="as loaded",
                         width=2 * WIDTH, help="e.g. 2, 4: speculation off, then at each k (live, no reload)"),
    "metric": Field("tune_metric", "target metric", "choice", "tpot_p99_ms", options=TUNE_METRICS),
    "limit": Field("tune_limit", "limit (ms)", "float", 100.0, low=0),
    "repeats": Field("tune_repeats", "repeats", "int", 3, low=1, high=20),
    "requests": Field("tune_requests", "requests per run", "int", 16, low=1, high=4096),
}
TUNE_DEFAULTS = {key: field.default for key, field in TUNE_FIELDS.items()}
_tune = list(TUNE_FIELDS.values())
TUNE_FORM = (_tune[:3], _tune[3:], (Action("tune_start", "Start sweep", primary=True, icon="play"),
                                    Action("tune_cancel", "Cancel sweep", icon="stop")))

# ---- What-if (the model's choices are the view's: WhatifControls.whatif_models) ------------------------------
FORMATS = (NONE, *(f for f in WEIGHT_FORMATS if f))
WHATIF_FIELDS = {
    "model": Field("whatif_model", "model", "choice", "llama-3-70b", width=200),
    "hardware": Field("whatif_hardware", "hardware", "choice", "h100-sxm", options=tuple(HARDWARE), width=160),
    "format": Field("whatif_format", "weights stored as", "choice", NONE, options=FORMATS, width=140),
    "tp": Field("whatif_tp", "TP sizes", "text", "1, 8"),
    "pp": Field("whatif_pp", "PP sizes", "text", "1"),
    "requests": Field("whatif_requests", "requests per run", "int", 64, low=1, high=100_000, width=140),
}
WHATIF_DEFAULTS = {key: field.default for key, field in WHATIF_FIELDS.items()}
_whatif = list(WHATIF_FIELDS.values())
WHATIF_FORM = (_whatif[:3], _whatif[3:], (Action("whatif_memory_button", "Memory picture", icon="th-large"),
                                          Action("whatif_start", "Simulate", primary=True, icon="play"),
                                          Action("whatif_cancel", "Cancel what-if", icon="stop")))
