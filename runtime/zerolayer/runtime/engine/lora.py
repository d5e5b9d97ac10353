"""The LoRA adapters one vLLM engine serves, each under its own model name, and how they change
while the engine runs.

vLLM fixes at start whether LoRA is on and the largest rank it takes (``enable_lora``,
``max_lora_rank``); within those, adapters are loaded and unloaded in the running engine
(``AsyncLLM.add_lora``/``remove_lora``, vLLM's dynamic LoRA). :class:`AdapterSet` keeps the served
names and vLLM's ``LoRARequest`` of each in step, so a name is served exactly while its request
exists. vLLM is imported lazily, as in :mod:`.vllm_engine`.

vLLM's engine core keys an adapter by its ``lora_int_id``. Several API processes are clients of one
engine core (docs/api-processes.md), so every process must give one adapter one id, and two
adapters two: :func:`adapter_id` derives it from the adapter's name and folder alone, with no
counter and no talk between processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Mapping, Sequence

from zerolayer.runtime.errors import ConfigError, EngineError


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter served under its own model name: a PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``) trained for the engine's base model."""

    name: str
    path: str


# vLLM's accepted ``max_lora_rank`` values (vllm.config.lora.MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's own default ``max_lora_rank``: adapters added while running fit up to the rank the engine
# started with, so a start with adapters leaves at least this much room.
DEFAULT_LORA_RANK = 16


# vLLM keeps ids in int32 arrays (v1/worker/gpu/lora_utils.py) and wants them > 0.
LORA_ID_SPACE = 2**31 - 1


def adapter_id(adapter: LoraAdapter) -> int:
    """vLLM's ``lora_int_id`` for ``adapter``: from its name and folder alone (SHA-256, into
    1..2**31-1), so every API process, in whatever order it loads adapters and however often, gives
    one adapter the same id, and the same name on a new folder a new one (vLLM's ``add_lora`` keeps
    what it has under a known id). Not Python's ``hash()``: that is salted per process."""
    digest = hashlib.sha256(f"{adapter.name}\0{adapter.path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % LORA_ID_SPACE + 1


def adapter_rank(adapter: LoraAdapter) -> int:
    """The adapter's rank ``r`` from its ``adapter_config.json`` (ConfigError when unreadable)."""
    where = os.path.join(adapter.path, "adapter_config.json")
    try:
        with open(where) as f:
            rank = json.load(f).get("r")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"LoRA adapter {adapter.name!r}: cannot read {where}: {exc}") from exc
    if not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"LoRA adapter {adapter.name!r}: {where} gives no positive rank r")
    return rank


def lora_args(adapters: Sequence[LoraAdapter], given: Mapping[str, Any]) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` LoRA needs (those ``given`` in engine_args win): LoRA on, every adapter
    resident at once (``max_loras``), and the smallest vLLM rank that fits the largest adapter and is
    at least :data:`DEFAULT_LORA_RANK`."""
    if not adapters:
        return {}
    args: dict[str, Any] = {"enable_lora": True, "max_loras": len(adapters)}
    rank = max(adapter_rank(a) for a in adapters)
    fits = [r for r in LORA_RANKS if r >= max(rank, DEFAULT_LORA_RANK)]
    if not fits:
        raise ConfigError(f"LoRA rank {rank} is above vLLM's largest, {LORA_RANKS[-1]}")
    args["max_lora_rank"] = fits[0]
    return {k: v for k, v in args.items() if k not in given}


class AdapterSet:
    """The adapters of base model ``base``: their names (served after the base model's) and, once
    :meth:`start_args` has run, vLLM's ``LoRARequest`` for each, under :func:`adapter_id`'s id."""

    def __init__(self, base: str, adapters: Sequence[LoraAdapter]) -> None:
        names = [base, *(a.name for a in adapters)]
        if len(set(names)) != len(names):
            raise ConfigError(f"model {base!r}: adapter names must be unique and differ from the model's")
        self.base = base
        self.adapters: tuple[LoraAdapter, ...] = ()
        for adapter in adapters:
            self._free_id(adapter)  # refuses a clash with one before it
            self.adapters = (*self.adapters, adapter)
        self.max_rank: int | None = None  # LoRA on: the largest rank the engine takes
        self._requests: dict[str, Any] = {}

    def _free_id(self, adapter: LoraAdapter) -> int:
        """``adapter``'s id; ConfigError when a served adapter has it (a 1 in 2**31 chance per pair):
        one id would load one adapter's weights for both."""
        ident = adapter_id(adapter)
        clash = next((other.name for other in self.adapters if adapter_id(other) == ident), None)
        if clash is not None:
            raise ConfigError(f"adapter {adapter.name!r}: its LoRA id {ident} (from its name and path) is "
                              f"that of adapter {clash!r}; rename one of them")
        return ident

    @property
    def names(self) -> tuple[str, ...]:
        """The base model, then its adapters: every name a request may give."""
        return (self.base, *(a.name for a in self.adapters))

    @property
    def parents(self) -> dict[str, str]:
        """Adapter name -> the base model."""
        return {a.name: self.base for a in self.adapters}

    def start_args(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The engine's arguments with LoRA's laid over ``given``; builds the adapters' requests."""
        args = {**given, **lora_args(self.adapters, given)}
        if args.get("enable_lora"):
            self.max_rank = int(args.get("max_lora_rank") or DEFAULT_LORA_RANK)
        if self.adapters:
            from vllm.lora.request import LoRARequest

            self._requests = {a.name: LoRARequest(a.name, adapter_id(a), a.path) for a in self.adapters}
        return args

    def request(self, name: str | None) -> Any:
        """vLLM's ``LoRARequest`` for adapter ``name``; None for the base model (or no such adapter)."""
        return self._requests.get(name) if name else None

    def card(self, name: str) -> dict[str, Any] | None:
        """An adapter's ``/v1/models`` fields (its folder as ``root``); None when ``name`` is no adapter."""
        path = next((a.path for a in self.adapters if a.name == name), None)
        return None if path is None else {"root": path, "max_model_len": None}

    async def add(self, llm: Any, adapter: LoraAdapter) -> None:
        """Load ``adapter`` into the running engine ``llm`` (``add_lora``), then serve its name.

        :class:`ConfigError` when that needs a restart (LoRA off, a rank above ``max_rank``) or the
        name is taken; :class:`EngineError` when vLLM cannot load it. Nothing changes on failure."""
        if llm is None or self.max_rank is None:
            raise ConfigError(f"adapter {adapter.name!r}: model {self.base!r} runs without LoRA; its first "
                              "adapter (or engine_args enable_lora) takes a restart")
        if adapter.name in self.names:
            raise ConfigError(f"adapter {adapter.name!r}: that name is already served")
        rank = adapter_rank(adapter)
        if rank > self.max_rank:
            raise ConfigError(f"adapter {adapter.name!r}: rank {rank} is above the engine's max_lora_rank "
                              f"{self.max_rank}, fixed at start (a restart takes it)")
        ident = self._free_id(adapter)
        from vllm.lora.request import LoRARequest

        request = LoRARequest(adapter.name, ident, adapter.path)
        try:
            await llm.add_lora(request)
        except Exception as exc:  # vLLM raises plain errors for unreadable or mismatched adapters
            raise EngineError(f"vLLM could not load adapter {adapter.name!r} from {adapter.path}: {exc}") from exc
        self._requests[adapter.name] = request
        self.adapters = (*self.adapters, adapter)

    async def remove(self, llm: Any, name: str) -> None:
        """Stop serving adapter ``name`` at once (new requests naming it are refused), then unload it
        (``remove_lora``); streams already running on it keep their request and finish: vLLM loads
        again any adapter a scheduled request carries (so does a request another API process of the
        same engine core admitted before its own watcher removed the adapter)."""
        request = self._requests.pop(name, None)
        if request is None:
            raise ConfigError(f"adapter {name!r} is not served by model {self.base!r}")
        self.adapters = tuple(a for a in self.adapters if a.name != name)
        if llm is not None:
            await llm.remove_lora(request.lora_int_id)
