"""LoRARequest: which adapter a request runs with (chapter 16; vLLM's name and fields).

    LoRARequest("french", 1, "/adapters/french")    # lora_name, lora_int_id, lora_path

lora_int_id is the adapter's identity inside the engine: the GPU slots, the CPU pool and the prefix
cache are keyed by it, so one id must always mean one folder. 0 is reserved for "no adapter" (the
base model), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import is_int


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest lora_name must be a non-empty str, not {self.lora_name!r}")
        if not is_int(self.lora_int_id) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest lora_int_id must be an int >= 1 (0 means no adapter), "
                             f"not {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest lora_path must be a non-empty str (a PEFT adapter folder), "
                             f"not {self.lora_path!r}")


def check_lora_request(name: str, value) -> LoRARequest | None:
    """None or a LoRARequest; anything else is a TypeError naming the argument."""
    if value is None or isinstance(value, LoRARequest):
        return value
    raise TypeError(f"{name} must be a LoRARequest(lora_name, lora_int_id, lora_path) or None, "
                    f"not {type(value).__name__}")
