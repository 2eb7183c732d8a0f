from typing import Any

def launch_encoder(server_args: Any, schedule_path: Any, dist_init_method: Any, rank: Any) -> None: ...

class MMEncoder:
    def __init__(
        self,
        server_args: Any,
        schedule_path: Any = None,
        dist_init_method: Any = None,
        rank: int = 0,
        gpu_id: int | None = None,
    ) -> None: ...
    async def _prepare_encode_context(
        self,
        requests: list[dict[str, Any]],
        modality: Any,
        *,
        use_global_cache: bool,
        is_health_check: bool = False,
    ) -> Any: ...
    def _calculate_hashes_from_features(
        self, mm_feature: Any, grid_thw: list[Any], modality: Any, mm_inputs: Any = None
    ) -> list[int]: ...
