"""The LoRA adapters an EngineClient serves, by name: what admission and unloading check (vLLM's LoRA names).

Guarded by the client's lock, with its open streams: an unload is refused (LoRAInUse) while any unfinished request
of the adapter exists, and a request whose adapter was unloaded after it was routed is refused at admission
(LoRANotLoaded), so the engine never meets a request for an adapter it no longer holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.engine.request import Request
from pdserve.lora_request import LoRARequest


class LoRANotLoaded(KeyError):
    """No adapter of that name (or it was unloaded after the request was routed)."""


class LoRAInUse(RuntimeError):
    """Unload refused: unfinished requests run with the adapter."""


class LoRAExists(ValueError):
    """Load refused: an adapter of that name is loaded or loading."""


@dataclass
class ClientLoRAs:
    by_name: dict[str, LoRARequest] = field(default_factory=dict)
    loading: set[str] = field(default_factory=set)

    def reserve(self, name: str) -> None:
        if name in self.by_name or name in self.loading:
            raise LoRAExists(f"LoRA adapter {name!r} is already {'loaded' if name in self.by_name else 'loading'}")
        self.loading.add(name)

    def check_admit(self, requests: Iterable[Request]) -> None:
        ids = {lr.lora_int_id for lr in self.by_name.values()}
        for r in requests:
            if r.lora_int_id and r.lora_int_id not in ids:
                raise LoRANotLoaded(f"the LoRA adapter of request {r.request_id!r} was unloaded")

    def take_unused(self, name: str, open_requests: Iterable[Request]) -> LoRARequest:
        """Remove and return the adapter `name` unless an open request runs with it."""
        lr = self.by_name.get(name)
        if lr is None:
            raise LoRANotLoaded(f"LoRA adapter {name!r} is not loaded")
        busy = sum(1 for r in open_requests if r.lora_int_id == lr.lora_int_id)
        if busy:
            raise LoRAInUse(f"LoRA adapter {name!r} is in use by {busy} unfinished request(s); retry when they end")
        del self.by_name[name]
        return lr
