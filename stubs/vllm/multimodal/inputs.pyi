from collections import UserDict

class PlaceholderRange:
    offset: int
    length: int
    def __init__(self, offset: int, length: int) -> None: ...
    def get_num_embeds(self) -> int: ...

class BaseMultiModalField: ...

class MultiModalSharedField(BaseMultiModalField):
    batch_size: int
    def __init__(self, batch_size: int) -> None: ...

class MultiModalFieldElem:
    data: object
    field: BaseMultiModalField
    def __init__(self, data: object, field: BaseMultiModalField) -> None: ...

class MultiModalKwargsItem(UserDict[str, MultiModalFieldElem]):
    def get_data(self) -> dict[str, object]: ...

class MultiModalFeatureSpec:
    data: MultiModalKwargsItem | None
    modality: str
    identifier: str
    mm_position: PlaceholderRange
    def __init__(
        self,
        data: MultiModalKwargsItem | None,
        modality: str,
        identifier: str,
        mm_position: PlaceholderRange,
    ) -> None: ...
