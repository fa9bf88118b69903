"""Vocabulary-parallel token embedding and LM head (rows of the vocabulary split across ranks)."""

from __future__ import annotations

import torch
from torch import nn

from runner_core.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from runner_core.layers.linear import default_weight_loader
from runner_core.layers.weight_storage import WeightLayer


class VocabParallelEmbedding(WeightLayer):
    """Token ids -> rows of this rank's slice of the vocabulary, read from its `storage` (its own row-major
    weight, or the storage of an LM head tied to it: weight_storage.py)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)  # padded so every rank holds the same rows
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"checkpoint shape {tuple(loaded.shape)} does not match expected "
                f"{(self.num_embeddings, param.shape[1])}"
            )
        rows = min(self.shard_size, self.num_embeddings - self.vocab_start)
        param.data.zero_()
        default_weight_loader(param.narrow(0, 0, rows), loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.storage.embedding(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        y = self.storage.embedding(local.masked_fill(outside, 0))
        return tp_all_reduce(y.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the vocabulary; each rank computes its slice, then they are gathered.

    Its own (untied) weight is stored column-major: `weight` is the [vocab, hidden] view of a
    contiguous [hidden, vocab] tensor, so the projection is a plain x @ W^T GEMM over contiguous
    columns. On the CPU, BLAS handles this wide matrix far better that way at decode batch sizes
    (docs/benchmarks.md, "Where the time goes"). A head tied to the embedding keeps its layout.
    Where the native kernels run, the loader stores it as panels or quantized instead (weight_storage.py)."""

    multiplies = True
    is_lm_head = True  # stored in the compute dtype unless quantize_lm_head

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.weight = nn.Parameter(torch.empty(embedding_dim, self.shard_size).t(), requires_grad=False)
        self.weight.weight_loader = self.load_shard

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = tp_all_gather(self.storage.matmul(hidden_states, None))
        return logits[..., : self.num_embeddings]
