from contextlib import AbstractContextManager
from typing import Any

import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput

class ECConnectorModelRunnerMixin:
    @staticmethod
    def maybe_save_ec_to_connector(encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None: ...
    @staticmethod
    def maybe_get_ec_connector_output(
        scheduler_output: SchedulerOutput, encoder_cache: dict[str, torch.Tensor], **kwargs: Any
    ) -> AbstractContextManager[ECConnectorOutput | None]: ...
