"""Output processing: the engine core's per-step EngineCoreOutputs become the API's RequestOutputs.

Per request it keeps what only the output side needs: the incremental detokenizer (never a broken UTF-8 character;
stop strings), the output token ids and logprobs collected for the final output, and the prompt text. A stop string
is found here, in text; the request is then finished by the scheduler (`ProcessedOutputs.stops`, applied by the
engine before its next step, so its blocks are freed at once). Precedence at one token is the engine's order: a stop
token before a stop string before max_tokens; tokens after the stop are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.messages import EngineCoreOutput
from pdserve.engine.request import Request
from pdserve.errors import ErrorCode
from pdserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs


@dataclass
class RequestState:
    """The output side of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class StopString:
    """A stop string completed by output token `num_output_tokens` (1-based): the scheduler finishes the request
    there (Scheduler.finish_by_stop_string)."""

    request_id: str
    num_output_tokens: int
    stop: str


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    stops: list[StopString] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, why): postprocessing raised


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, req: Request) -> None:
        p = req.sampling_params
        det = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                                     stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output,
                                     min_tokens=p.min_tokens)
        self.states[req.request_id] = RequestState(req.request_id, req.prompt, req.prompt_token_ids, det,
                                                   p.logprobs is not None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """RequestOutputs for a step's core outputs, and the stop strings and failures the scheduler must apply.
        A request whose detokenizing raises fails alone (POSTPROCESS_FAILED)."""
        res = ProcessedOutputs([])
        for out in core_outputs:
            st = self.states.get(out.request_id)
            if st is None:  # not this processor's (never added): nothing to report
                continue
            try:
                res.outputs.append(self._process(st, out, res.stops))
            except Exception as exc:  # e.g. a detokenizer failure: fail this request only
                message = f"postprocess failed: {exc!r}"
                res.failed.append((out.request_id, message))
                out.finish_reason, out.error, out.error_code = "error", message, ErrorCode.POSTPROCESS_FAILED
                out.new_token_ids, out.new_logprobs = [], None
                res.outputs.append(self._output(st, out, [], ""))
            if res.outputs[-1].finished:
                del self.states[out.request_id]
        return res

    def _process(self, st: RequestState, out: EngineCoreOutput, stops: list[StopString]) -> RequestOutput:
        new = out.new_token_ids
        det = st.detokenizer
        for j, tok in enumerate(new):
            stop = det.update([tok])
            # a stop string wins over what ended the request at a later token, or at this one by max_tokens;
            # a stop token at this very token wins over it (the engine checks tokens first)
            if stop is not None and (j < len(new) - 1 or out.finish_reason != "stop"):
                del new[j + 1:]
                if out.new_logprobs is not None:
                    del out.new_logprobs[j + 1:]
                out.finish_reason, out.stop_reason = "stop", stop
                stops.append(StopString(out.request_id, len(st.token_ids) + j + 1, stop))
                break
        st.token_ids.extend(new)
        if st.want_logprobs and out.new_logprobs:
            st.logprobs.extend(out.new_logprobs)
        return self._output(st, out, new, det.get_delta(finished=out.finished) if new else "")

    @staticmethod
    def _output(st: RequestState, out: EngineCoreOutput, new: list[int], delta: str) -> RequestOutput:
        """Deltas on every step; the full text, token ids and logprobs (O(length) to copy) only once finished."""
        done = out.finished
        lps = st.logprobs
        comp = CompletionOutput(
            index=0, text=st.detokenizer.output_text if done else "", token_ids=list(st.token_ids) if done else [],
            finish_reason=out.finish_reason, stop_reason=out.stop_reason,
            logprobs=list(lps) if st.want_logprobs and done else None, delta_text=delta, delta_token_ids=new,
            delta_logprobs=lps[len(lps) - len(new):] if st.want_logprobs and new else None)
        embedding = None
        if out.pooled is not None:
            embedding = torch.nn.functional.normalize(out.pooled, dim=0).tolist()
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, [comp], done, out.times,
                             out.num_cached_tokens, out.error, out.error_code, out.prompt_logprobs, embedding,
                             kv_transfer_result=out.kv_transfer_result, num_draft_tokens=out.num_draft_tokens,
                             num_accepted_tokens=out.num_accepted_tokens)
