"""CompileOptimizer: compile modes you can switch on a loaded model, and what they build.

* `compile_optimizer`: settings (backend, mode, scope; `mode="auto"`), the two warm-start routes
  (an AOTInductor package, or torch.compile with inductor's cache artifacts), warm-up and stats;
* `compile_cache`: the persistent cache's key and its folder of locked, atomic, checksummed files;
* `aoti_program`: export, package and checked runs of an AOTInductor program;
* `decode_programs`, `decode_plan`: static programs for pure-decode batch sizes (CPU: packages on
  MKL-prepacked weights; CUDA: graph capture), which sizes to build, and building them.
"""

from runner_core.compile.compile_optimizer import WARMUP_SIZES, CompileOptimizer, CompileSettings, cuda_graphs_status
from runner_core.compile.decode_plan import build_decode_programs, cpu_programs_expected, cuda_capture_plan, plan_sizes
from runner_core.compile.decode_programs import CUDAGraphDecodePrograms, DecodePrograms, PackedDecodePrograms

__all__ = ["CUDAGraphDecodePrograms", "CompileOptimizer", "CompileSettings", "DecodePrograms", "PackedDecodePrograms",
           "WARMUP_SIZES", "build_decode_programs", "cpu_programs_expected", "cuda_capture_plan", "cuda_graphs_status",
           "plan_sizes"]
