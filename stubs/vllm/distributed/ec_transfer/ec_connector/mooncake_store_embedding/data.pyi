class TensorSpec:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    def __init__(self, shape: tuple[int, ...], dtype: str, nbytes: int) -> None: ...

def make_embedding_key(namespace: str, identifier: str) -> str: ...
