"""Speculative decoding's parts that know no engine: the settings (`SpeculativeConfig`, RunnerConfig's
`speculative_config`), the proposers (`Proposer`, `NgramProposer`), the accept/reject rule (`RejectionSampler`)
and the figures (`SpecDecodingStats`). The engine's side, proposing for a step's sequences, verifying in the
step's one forward pass and rolling back what was rejected, is `runner_core/engine/spec_decode.py`."""

from runner_core.spec_decode.config import SpeculativeConfig
from runner_core.spec_decode.metrics import SpecDecodingStats
from runner_core.spec_decode.ngram_proposer import NgramProposer, Proposer, ngram_lookup
from runner_core.spec_decode.rejection_sampler import RejectionOutput, RejectionSampler

__all__ = ["NgramProposer", "Proposer", "RejectionOutput", "RejectionSampler", "SpecDecodingStats",
           "SpeculativeConfig", "ngram_lookup"]
