"""The runner's drafter: the proposer of `speculative_config.method`."""

from __future__ import annotations

from pdserve.config import SpeculativeConfig
from pdserve.model.spec.draft_model import DraftModelProposer, DraftTarget
from pdserve.model.spec.ngram import NgramProposer
from pdserve.model.spec.proposer import DraftRequest, Proposer
from pdserve.model.spec.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig, target: DraftTarget | None = None) -> Proposer:
    """The proposer of `config.method` (config.py's SPEC_METHODS lists the methods that exist); `target`: what a
    draft model must match (the engine's model), for draft_model."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    if config.method == "draft_model":
        if target is None:
            raise ValueError("speculative_config: draft_model needs the engine's target model to load against")
        return DraftModelProposer.load(config, target)
    raise ValueError(f"speculative_config: method {config.method!r} has no proposer")


__all__ = ["DraftRequest", "DraftTarget", "Proposer", "make_proposer"]
