from typing import Any

from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec
from vllm.sampling_params import SamplingParams

class Request:
    request_id: str
    mm_features: list[MultiModalFeatureSpec]
    ec_transfer_params: dict[str, Any] | None
    lora_request: LoRARequest | None
    cache_salt: str | None
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        sampling_params: SamplingParams | None,
        pooling_params: None,
        *,
        mm_features: list[MultiModalFeatureSpec] | None = ...,
        lora_request: LoRARequest | None = ...,
        cache_salt: str | None = ...,
    ) -> None: ...
    def get_num_encoder_embeds(self, input_id: int) -> int: ...
