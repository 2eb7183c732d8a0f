from typing import Any

from sglang.srt.disaggregation.encoder.server import launch_encoder as launch_encoder

def launch_dp_worker(
    server_args: Any, dp_rank: int, gpu_id: int, dispatch_path: str, release_path: str, result_path: str
) -> None: ...
