from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

class ECConnectorOutput:
    finished_sending: set[str] | None
    finished_recving: set[str] | None
    ec_connector_stats: ECConnectorStats | None
    ec_connector_worker_meta: ECConnectorWorkerMetadata | None
    def __init__(
        self,
        finished_sending: set[str] | None = ...,
        finished_recving: set[str] | None = ...,
        ec_connector_stats: ECConnectorStats | None = ...,
        ec_connector_worker_meta: ECConnectorWorkerMetadata | None = ...,
    ) -> None: ...
