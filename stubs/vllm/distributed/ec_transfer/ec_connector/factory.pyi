from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

class ECConnectorFactory:
    @classmethod
    def create_connector(cls, config: VllmConfig, role: ECConnectorRole) -> ECConnectorBase: ...
    @classmethod
    def get_connector_class(cls, ec_transfer_config: ECTransferConfig) -> type[ECConnectorBase]: ...
