from typing import Any, Literal

import torch

ECRole = Literal["ec_producer", "ec_consumer", "ec_both"]

class ECTransferConfig:
    ec_connector: str | None
    engine_id: str | None
    ec_role: ECRole | None
    ec_connector_extra_config: dict[str, Any]
    ec_connector_module_path: str | None
    def __init__(
        self,
        *,
        ec_connector: str | None = ...,
        engine_id: str | None = ...,
        ec_role: ECRole | None = ...,
        ec_connector_extra_config: dict[str, Any] = ...,
        ec_connector_module_path: str | None = ...,
    ) -> None: ...
    @property
    def is_ec_producer(self) -> bool: ...
    @property
    def is_ec_consumer(self) -> bool: ...
    def get_from_extra_config(self, key: str, default: Any) -> Any: ...

class MultiModalConfig:
    mm_processor_kwargs: dict[str, object] | None
    def __init__(self, *, mm_processor_kwargs: dict[str, object] | None = ...) -> None: ...
    def compute_hash(self) -> str: ...

class ModelConfig:
    model: str
    revision: str | None
    dtype: torch.dtype | str
    multimodal_config: MultiModalConfig | None

class VllmConfig:
    # vLLM annotates model_config as ModelConfig but leaves it None without a model
    model_config: ModelConfig | None
    ec_transfer_config: ECTransferConfig | None
    def __init__(self, *, ec_transfer_config: ECTransferConfig | None = ...) -> None: ...
