import abc
import logging
from typing import Any

import torch

logger: logging.Logger

class EmbeddingStore(abc.ABC):
    @abc.abstractmethod
    def batch_get(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]: ...
    @abc.abstractmethod
    def batch_put(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]: ...
    @abc.abstractmethod
    def batch_get_into_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]: ...
    @abc.abstractmethod
    def batch_put_from_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]: ...
    @abc.abstractmethod
    def batch_is_exist(self, hashes: list[str]) -> list[bool]: ...
    def register_buffer(self, tensor: torch.Tensor) -> None: ...
    def get_key(self, mm_hash: str) -> str: ...

class EmbeddingStoreFactory:
    _registry: dict[str, dict[str, Any]]
    @staticmethod
    def _load_backend_class(module_path: str, class_name: str, backend_name: str) -> type: ...
    @classmethod
    def register_backend(cls, name: str, module_path: str, class_name: str) -> None: ...
    @classmethod
    def create_backend(cls, backend_name: str, **kwargs: Any) -> EmbeddingStore: ...
