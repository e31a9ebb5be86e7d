"""Offline API in vLLM's shape: `LLM(model=..., **engine options).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine, PromptType, StepStats
from pdserve.lora_request import LoRARequest
from pdserve.model.load_progress import ProgressFn
from pdserve.model.loader import LoadedModel
from pdserve.outputs import RequestOutput
from pdserve.roofline import resolve_device_peaks
from pdserve.sampling_params import SamplingParams
from pdserve.server.chat_template import render_chat

ChatMessages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, *, loaded_model: LoadedModel | None = None, tokenizer: Any = None,
                 load_progress: ProgressFn | None = None, **engine_options: Any) -> None:
        """`load_progress(fraction, stage)`: called as the weights load (see pdserve/model/load_progress.py)."""
        unknown = set(engine_options) - set(EngineConfig.option_names())
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {EngineConfig.option_names()}")
        self.config = EngineConfig(model=model, **engine_options)
        peaks = resolve_device_peaks(self.config.device_peaks, self.config.num_threads,
                                     self.config.device)
        self.engine = LLMEngine(self.config, model=loaded_model, tokenizer=tokenizer, device_peaks=peaks,
                                load_progress=load_progress)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; results in input order. A prompt is a string,
        a list of token ids or {"prompt_token_ids": [...]}; `n > 1` yields n outputs per prompt. `on_step`
        receives each step's stats (benchmarks and the live roofline's tests read them). `lora_request` (as
        vLLM): the LoRA adapter of every prompt, or one per prompt (None: the base model); registered on first
        use (`enable_lora=True`)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("need one SamplingParams per prompt, or a single one for all")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompt_list)
        for lr in loras:
            if lr is not None and lr.lora_int_id not in self.engine.lora_requests:
                self.engine.add_lora(lr)
        children = [req for i, (prompt, params, lr) in enumerate(zip(prompt_list, params_list, loras, strict=True))
                    for req in self.engine.make_requests([prompt], params, f"offline-{i}", lora_request=lr)]
        for req in children:
            self.engine.add_request(req)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            result = self.engine.step()
            if on_step is not None:
                on_step(result.stats)
            for out in result.outputs:
                if out.finished:
                    finals[out.request_id] = out
        results: list[RequestOutput] = []
        for req in children:  # samples of one prompt are adjacent: fold them into the first one's output
            out = finals[req.request_id]
            out.outputs[0].index = req.sample_index
            if req.sample_index == 0:
                out.request_id = str(len(results))
                results.append(out)
            else:
                results[-1].outputs.append(out.outputs[0])
        return results

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        `chat_template_kwargs`: extra template variables, as vLLM's (e.g. {"enable_thinking": False})."""
        convs = cast("list[ChatMessages]", [messages] if messages and isinstance(messages[0], dict) else list(messages))
        prompts: list[PromptType] = [render_chat(self.engine.tokenizer, c, add_generation_prompt, None,
                                                 chat_template_kwargs) for c in convs]
        return self.generate(prompts, sampling_params)
