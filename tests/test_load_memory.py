"""What a loaded model holds beside its weights: one rotary table per model (shared by its layers and
predicted by estimate_memory to the byte), a KV pool whose pages are not made resident before the
pool is used (yet read as zeros), and a bound on the resident memory after loading small-llama."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from torch import nn

from runner_core import ModelRunner
from runner_core.layers.attention import Attention
from runner_core.layers.rotary import RotaryEmbedding, rotary_positions
from runner_core.memory.estimate import estimate_memory
from runner_core.memory.manager import MemoryManager
from runner_core.process_memory import resident_bytes
from tests.conftest import REPO

MiB = 2**20


def _rotary_modules(model: nn.Module) -> list[RotaryEmbedding]:
    return [layer.self_attn.rotary_emb for layer in model.model.layers]


def test_layers_share_one_rotary_table_predicted_to_the_byte(tiny_llama_path):
    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 4 * MiB}).load_model()
    try:
        modules = _rotary_modules(runner.model)
        assert len(modules) > 1
        assert all(m.cos is modules[0].cos and m.sin is modules[0].sin for m in modules)
        positions = runner.engine.worker.hf_config.max_position_embeddings
        table = positions * runner.model.head_dim * 4  # cos and sin, head_dim/2 float32 each
        held = sum(b.numel() * b.element_size() for b in modules[0].buffers())
        assert held == table == estimate_memory(tiny_llama_path, dtype="float32").buffers_bytes
        cos = weakref.ref(modules[0].cos)
        del modules
    finally:
        runner.shutdown()
    gc.collect()
    assert cos() is None, "the shared rotary table outlived its model"


def test_rotary_positions_caps_the_table_without_changing_it():
    full = RotaryEmbedding.shared(object(), 16, 4096, 10000.0)
    with rotary_positions(64):
        capped = RotaryEmbedding.shared(object(), 16, 4096, 10000.0)
    assert full.cos.shape[0] == 4096 and capped.cos.shape == (64, 8)
    torch.testing.assert_close(capped.cos, full.cos[:64], rtol=0, atol=0)
    torch.testing.assert_close(capped.sin, full.sin[:64], rtol=0, atol=0)
    with pytest.raises(ValueError, match="int >= 1"):
        with rotary_positions(0):
            pass


def test_kv_pool_pages_are_not_resident_until_used():
    """The pool reads as zeros everywhere (attention may weigh slots it never wrote by zero, and 0 x NaN
    would be NaN), but allocating it writes nothing: a 256 MiB pool adds under 16 MiB of resident
    memory (measured: under 1 MiB; zero-filling it, as torch.zeros does, makes all 256 MiB resident)."""
    layers, heads, head_dim, block_size = 4, 4, 64, 16
    model = nn.ModuleList(Attention(heads, head_dim, head_dim ** -0.5, heads) for _ in range(layers))
    num_blocks = 256 * MiB // (layers * 2 * heads * block_size * head_dim * 4)
    memory = MemoryManager(num_blocks, block_size)
    before = resident_bytes()
    memory.allocate_kv_cache(model, layers, heads, head_dim, torch.float32, torch.device("cpu"))
    grown = resident_bytes() - before
    assert memory.kv_cache_bytes == 256 * MiB
    assert grown < 16 * MiB, f"allocating the KV pool made {grown / MiB:.0f} MiB resident"
    blocks = memory.kv_cache[:, :, :, : 4 * block_size]  # reading a few blocks, as attention would
    assert torch.equal(blocks, torch.zeros_like(blocks))
    model[0].kv_cache[0, 0, 0].fill_(1.0)  # the layers write through their views of the one pool
    assert memory.kv_cache[0, 0, 0, 0, 0].item() == 1.0


CHILD = """
import json
from runner_core import ModelRunner, estimate_memory
from runner_core.kernels import cpu_kernels_available
from runner_core.process_memory import resident_bytes
from runner_core.models.presets import ensure_preset

path = str(ensure_preset("small-llama"))
estimate_memory(path, dtype="float32")  # transformers and the config machinery imported: the runtime
cpu_kernels_available()  # the native kernels loaded (built on a fresh cache, importing the build tools)
before = resident_bytes()
runner = ModelRunner({"model": path, "dtype": "float32", "kv_cache_memory": 1 << 30}).load_model()
stats = runner.memory_stats()
print(json.dumps({"before": before, "after": resident_bytes(), **stats}))
"""


def test_resident_memory_after_loading_small_llama():
    """In a fresh process (earlier tests' heap would blur the figure), with the runtime imported and
    the native kernels loaded: loading small-llama in float32 with a 1 GiB KV pool adds at most its
    weights (with decode programs, where the runner holds them) + 96 MiB to the resident memory.
    Measured (benchmarks/load_memory.py): 165 MiB = the weights 121 + the tokenizer 15 + freed heap
    the C allocator keeps 29 (malloc_trim gives it back) + the rotary table 1 + the rest; the pool
    holds nothing until used. 96 MiB is twice the 44 MiB beside the weights. A pool zeroed at
    allocation (+1024 MiB resident) fails it."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    f = json.loads(res.stdout.strip().splitlines()[-1])
    held = f["weights_bytes"] + f.get("decode_programs_bytes", 0)
    grown = f["after"] - f["before"]
    print({k: round(v / MiB, 1) for k, v in f.items() if isinstance(v, int) and k.endswith("bytes")},
          f"grown {grown / MiB:.0f} MiB")
    assert f["kv_pool_bytes"] == 1 << 30
    assert grown <= held + 96 * MiB, f"loading grew the process by {grown / MiB:.0f} MiB, weights {held / MiB:.0f} MiB"
