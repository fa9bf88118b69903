"""transformers as a peer in benchmarks/throughput.py: one model, three ways to run a workload.

  hf single      generate one request at a time, unpadded (slow: the driver gives it a subset)
  hf batch B     generate, FIFO batches of B in arrival order, left padding; a batch runs to its
                 longest request, only each request's own tokens are kept
  hf cb          transformers' continuous batching (the manager behind generate_batch), each request
                 with its own max_new_tokens
Each method returns (seconds, the token ids it returned per request); the model runs on the device
the driver gives, the same as our engine's.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

try:
    from workload import Request
except ImportError:  # imported as benchmarks.hf_methods
    from benchmarks.workload import Request


def load(model_dir: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def hf_config(n: int):
    from transformers import GenerationConfig
    # min_new_tokens == max_new_tokens: no early stop even if a default eos id gets merged in
    return GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)


@torch.inference_mode()
def hf_batches(model, reqs: list[Request], batch: int, desc: str) -> tuple[float, list[list[int]]]:
    """generate() over FIFO batches (left padding); batch=1 means unpadded one-at-a-time."""
    outs, t0 = [], time.perf_counter()
    for i in tqdm(range(0, len(reqs), batch), desc=desc, leave=False):
        chunk = reqs[i:i + batch]
        width = max(r.prompt_len for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(chunk):
            ids[j, width - r.prompt_len:] = torch.tensor(r.prompt_ids)
            mask[j, width - r.prompt_len:] = 1
        gen = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=hf_config(max(r.max_tokens for r in chunk))).cpu()
        outs += [gen[j, width:width + r.max_tokens].tolist() for j, r in enumerate(chunk)]
    return time.perf_counter() - t0, outs


@torch.inference_mode()
def hf_continuous(model, reqs: list[Request]) -> tuple[float, list[list[int]]]:
    """transformers continuous batching with a per-request max_new_tokens (generate_batch takes one)."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    gc = GenerationConfig(max_new_tokens=max(r.max_tokens for r in reqs), do_sample=False, eos_token_id=-1)
    hints = WorkloadHints(max(r.prompt_len for r in reqs), gc.max_new_tokens, len(reqs))
    with model.continuous_batching_context_manager(generation_config=gc, workload_hints=hints, timeout=30) as mgr:
        t0 = time.perf_counter()
        ids = [mgr.add_request(r.prompt_ids, f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
               for i, r in enumerate(reqs)]
        done: dict[str, list[int]] = {}
        with tqdm(total=len(ids), desc="hf cb", leave=False) as bar:
            while len(done) < len(ids):
                res = mgr.get_result(timeout=1)
                if res is None:
                    if not mgr.is_running():
                        raise RuntimeError("generation thread stopped")
                    continue
                if res.is_finished():
                    if res.error is not None:
                        raise RuntimeError(res.error)
                    done[res.request_id] = res.generated_tokens
                    bar.update(1)
        seconds = time.perf_counter() - t0
    return seconds, [done[i] for i in ids]


def methods(reqs: list[Request], single_requests: int) -> dict:
    """{name: (the requests it runs, fn(model, requests) -> (seconds, token ids))}."""
    return {"hf single": (reqs[:single_requests or len(reqs)], lambda m, r: hf_batches(m, r, 1, "hf single")),
            "hf batch 16": (reqs, lambda m, r: hf_batches(m, r, 16, "hf batch 16")),
            "hf batch 64": (reqs, lambda m, r: hf_batches(m, r, 64, "hf batch 64")),
            "hf cb": (reqs, hf_continuous)}
