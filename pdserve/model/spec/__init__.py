"""Speculative decoding, model side: the runner's drafter (the proposer of `speculative_config.method`) and the
rejection sampler that verifies drafts. The engine side (pdserve/engine/spec_decode) decides which requests
speculate and how many drafts fit a step; it only ever sees draft token ids."""
